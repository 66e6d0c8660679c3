//! Causal softmax attention for Gated NoPE MLA (design §5): the plain `softmax(QKᵀ)V` form, the
//! fused kernels of the CubeCL backends ([`AttentionKernels`]), the dispatch to Burn's attention
//! op, and the absorbed latent form used by decode.
//!
//! Masks follow Burn's convention: `true` marks a position that must **not** be attended to.

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::{AttentionModuleOptions, FloatTensor, IntTensor};
use std::sync::Arc;

use burn::tensor::{backend::Backend, Bool, DType, Int, Tensor, TensorData, TensorPrimitive};
use serde::{Deserialize, Serialize};

use super::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};
use super::precision::{restore, widen};

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod host;

/// Which implementation computes the training / prefill attention of the expanded form.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AttentionKind {
    /// A fused implementation: on the CubeCL backends (wgpu, cuda, plain, under `Fusion` and
    /// under `Autodiff`) the crate's own kernels ([`AttentionKernels`]: one forward, two backward
    /// launches, the scores never stored), on the CPU backends the crate's host kernel, and
    /// elsewhere Burn's `attention` op.
    ///
    /// Burn's op in 0.21 runs its unfused fallback on ndarray and on **every autodiff backend**;
    /// its CubeCL flash kernels need Burn's `autotune` feature, no explicit scale and `dqk ≥
    /// dv`. So the crate's kernels are what makes training attention fused.
    #[default]
    Fused,
    /// The plain `softmax(scale·QKᵀ + mask)·V`, materialising the `T×T` scores: the reference.
    Plain,
}

/// Score given to masked positions before the exponential: finite, so that a row whose keys are
/// all masked keeps a finite maximum (no `−∞ − (−∞)`); such rows are zeroed afterwards.
const MASKED_SCORE: f64 = -1e30;

/// Causal mask `[tq, tk]` aligned at the bottom-right corner: query `i` sits at absolute position
/// `tk − tq + i` and may see keys `j ≤ tk − tq + i`; `true` where `j` lies in its future.
///
/// `tk ≥ tq` (the queries are the last `tq` of the `tk` positions: prefill into a cache).
pub fn causal_mask<B: Backend>(tq: usize, tk: usize, device: &B::Device) -> Tensor<B, 2, Bool> {
    debug_assert!(
        tk >= tq,
        "causal mask needs tk ≥ tq, got tq = {tq}, tk = {tk}"
    );
    let offset = (tk - tq) as i64;
    let rows = Tensor::<B, 1, Int>::arange(offset..offset + tq as i64, device)
        .reshape([tq, 1])
        .expand([tq, tk]);
    let cols = Tensor::<B, 1, Int>::arange(0..tk as i64, device)
        .reshape([1, tk])
        .expand([tq, tk]);
    cols.greater(rows)
}

/// The full mask `[batch, 1, tq, tk]` of causal attention with optional key padding
/// `[batch, tk]` (`true` = padding; such keys are never attended to).
pub fn attention_mask<B: Backend>(
    batch: usize,
    tq: usize,
    tk: usize,
    key_padding: Option<Tensor<B, 2, Bool>>,
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let causal = causal_mask::<B>(tq, tk, device)
        .reshape([1, 1, tq, tk])
        .expand([batch, 1, tq, tk]);
    match key_padding {
        Some(pad) => causal.bool_or(pad.reshape([batch, 1, 1, tk]).expand([batch, 1, tq, tk])),
        None => causal,
    }
}

/// Softmax over the last dimension with masked positions excluded, NaN-free:
/// `p_j = exp(s_j − m)·[¬mask_j] / max(Σ_j exp(s_j − m)·[¬mask_j], 1e-30)`.
///
/// `scores: [..., tk]`, `mask` of the same shape. A row whose positions are all masked gets all
/// zeros (not NaN, not a uniform average over the masked keys). Computed in f32 (f64 stays f64).
/// The row maximum `m` is detached: the softmax does not depend on it, so its gradient is zero.
/// On the CPU backends (f32 scores) one host pass per row each way, with the derived gradient
/// `ds = p ⊙ (dp − Σ p·dp)`; elsewhere tensor ops.
pub fn masked_softmax<B: Backend, const D: usize>(
    scores: Tensor<B, D>,
    mask: Tensor<B, D, Bool>,
) -> Tensor<B, D> {
    if scores.dtype() == DType::F32
        && scores.dims() == mask.dims()
        && backend::host::is_cpu_backend::<B>()
    {
        let inputs = [
            scores.into_primitive().tensor(),
            mask.float().into_primitive().tensor(),
        ];
        return backend::host::run(&host::MaskedSoftmaxHost, inputs);
    }
    let (s, dtype) = widen(scores);
    let s = s.mask_fill(mask.clone(), MASKED_SCORE);
    let max = s.clone().max_dim(D - 1).detach();
    let e = s.sub(max).exp().mask_fill(mask, 0.0);
    let den = e.clone().sum_dim(D - 1).clamp_min(1e-30);
    restore(e.div(den), dtype)
}

/// Plain attention `softmax(scale·q·kᵀ, masked)·v` (design §5, the reference form).
///
/// `q: [B, H, tq, dqk]`, `k: [B, H, tk, dqk]`, `v: [B, H, tk, dv]`, `mask: [B, 1 or H, tq, tk]`
/// (`true` = not attended) → `[B, H, tq, dv]`. Rows with every key masked give zeros.
pub fn attention_plain<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scale: f64,
) -> Tensor<B, 4> {
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let mask = mask.expand(scores.dims());
    masked_softmax(scores, mask).matmul(v)
}

/// Panics unless the key padding, where there is one, is `[B, T] = [batch, t]` (the message names
/// `op` and both shapes).
fn check_key_padding<B: Backend>(
    op: &str,
    key_padding: Option<&Tensor<B, 2, Bool>>,
    batch: usize,
    t: usize,
) {
    if let Some(pad) = key_padding {
        assert!(
            pad.dims() == [batch, t],
            "{op}: the key padding has shape {:?}, expected [B, T] = [{batch}, {t}]",
            pad.dims()
        );
    }
}

/// Causal self-attention with optional key padding, by the chosen implementation.
///
/// `q, k: [B, H, T, dqk]`, `v: [B, H, T, dv]` (`dv` may differ from `dqk`), `key_padding:
/// [B, T]` (`true` = padding) → `[B, H, T, dv]`. The scale is `dqk^−1/2`, MLA's
/// `(qk_nope + qk_rope)^−1/2`; it is left implicit for the fused op because the CubeCL backends
/// route any explicit scale to the unfused fallback.
///
/// Rows whose keys are all masked (a padding query preceded only by padding) are not defined
/// the same way by every kernel; callers zero the outputs at padding queries.
///
/// # Panics
/// When the shapes disagree (`k` not `q`'s, `v` not `[B, H, T, dv]`, the padding not `[B, T]`).
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    kind: AttentionKind,
) -> Tensor<B, 4> {
    let [batch, heads, t, dqk] = q.dims();
    let dv = v.dims()[3];
    assert!(
        k.dims() == [batch, heads, t, dqk] && v.dims() == [batch, heads, t, dv],
        "causal_attention: q {:?}, k {:?} and v {:?} must be [B, H, T, dqk], [B, H, T, dqk], \
         [B, H, T, dv]",
        q.dims(),
        k.dims(),
        v.dims()
    );
    check_key_padding("causal_attention", key_padding.as_ref(), batch, t);
    if batch * heads * t == 0 {
        // No query: the output is as empty as `v`, whose shape it has.
        return v;
    }
    if let Some(o) = host_attention(&q, &k, &v, key_padding.as_ref()) {
        return o;
    }
    let scale = (dqk as f64).powf(-0.5);
    let (q, k, v, key_padding) = if kind == AttentionKind::Fused {
        match kernel_attention(q, k, v, key_padding, scale) {
            Ok(o) => return o,
            Err(op) => (op.q, op.k, op.v, op.pad),
        }
    } else {
        (q, k, v, key_padding)
    };
    match kind {
        AttentionKind::Fused => {
            let mask =
                key_padding.map(|pad| pad.reshape([batch, 1, 1, t]).expand([batch, heads, t, t]));
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            burn_attention(q, k, v, mask, None, options)
        }
        AttentionKind::Plain => {
            let device = q.device();
            let mask = attention_mask::<B>(batch, t, t, key_padding, &device);
            attention_plain(q, k, v, mask, scale)
        }
    }
}

/// MLA's expanded causal attention over its projections' own layouts: `q: [B, T, H, dqk]`,
/// `kv: [B, T, H, dn + dv]` and `k_pe: [B, T, dqk − dn]` → `[B, T, H, dv]`. Head `h`'s key is
/// `kv`'s first `dn` dims followed by `k_pe` (shared by all heads), its value `kv`'s other `dv`
/// dims; the scale is `dqk^−1/2`, as in [`causal_attention`]. A rotary embedding, where the
/// layer has one, is applied to `q`'s last `dqk − dn` dims and to `k_pe` before the call (under
/// NoPE nothing is rotated).
///
/// On the CPU backends (f32) one host kernel gathers each head's rows itself and writes the
/// output and the gradients in these layouts: no per-head key, value or query tensor is built
/// (a concatenation, two slices and a broadcast forward, and as many full-size zero-filled
/// gradients backward). Elsewhere the per-head tensors are assembled and [`causal_attention`]
/// runs with `kind`.
///
/// # Panics
/// When the shapes disagree (`kv`, `k_pe` or the padding not as above, `dn > dqk`).
pub fn mla_attention<B: Backend>(
    q: Tensor<B, 4>,
    kv: Tensor<B, 4>,
    k_pe: Tensor<B, 3>,
    dn: usize,
    key_padding: Option<Tensor<B, 2, Bool>>,
    kind: AttentionKind,
) -> Tensor<B, 4> {
    let [batch, t, heads, dqk] = q.dims();
    let dv = kv.dims()[3].saturating_sub(dn);
    assert!(
        dn <= dqk
            && kv.dims()[..3] == [batch, t, heads]
            && kv.dims()[3] > dn
            && k_pe.dims() == [batch, t, dqk - dn],
        "mla_attention: q {:?}, kv {:?} and k_pe {:?} must be [B, T, H, dqk], [B, T, H, dn + dv] \
         and [B, T, dqk − dn] with dn = {dn}",
        q.dims(),
        kv.dims(),
        k_pe.dims()
    );
    check_key_padding("mla_attention", key_padding.as_ref(), batch, t);
    if batch * heads * t == 0 {
        // No query: the output `[B, T, H, dv]` is as empty as the values.
        return kv.narrow(3, dn, dv);
    }
    if let Some(o) = host_mla_attention(&q, &kv, &k_pe, dn, key_padding.as_ref()) {
        return o;
    }
    let kv = kv.swap_dims(1, 2);
    let k_nope = kv.clone().narrow(3, 0, dn);
    let v = kv.narrow(3, dn, dv);
    let k = if dqk > dn {
        let k_pe = k_pe
            .unsqueeze_dim::<4>(1)
            .expand([batch, heads, t, dqk - dn]);
        Tensor::cat(vec![k_nope, k_pe], 3)
    } else {
        k_nope
    };
    causal_attention(q.swap_dims(1, 2), k, v, key_padding, kind).swap_dims(1, 2)
}

/// [`mla_attention`] on the host kernel ([`crate::ops::attention::MlaAttention`]) when `B` is a
/// CPU backend and the tensors are f32.
fn host_mla_attention<B: Backend>(
    q: &Tensor<B, 4>,
    kv: &Tensor<B, 4>,
    k_pe: &Tensor<B, 3>,
    dn: usize,
    key_padding: Option<&Tensor<B, 2, Bool>>,
) -> Option<Tensor<B, 4>> {
    use crate::ops::attention::{CausalAttention, MlaAttention};
    let f32s = [q.dtype(), kv.dtype(), k_pe.dtype()]
        .iter()
        .all(|d| *d == DType::F32);
    if !(f32s && backend::host::is_cpu_backend::<B>()) {
        return None;
    }
    let key_padding = match key_padding {
        Some(pad) => Some(crate::sync::read(pad.clone()).to_vec::<bool>().ok()?),
        None => None,
    };
    let op = MlaAttention {
        attention: CausalAttention {
            scale: (q.dims()[3] as f32).powf(-0.5),
            key_padding,
        },
        dn,
    };
    Some(backend::host::run(
        &op,
        [
            q.clone().into_primitive().tensor(),
            kv.clone().into_primitive().tensor(),
            k_pe.clone().into_primitive().tensor(),
        ],
    ))
}

/// The widest head the attention kernels take (`dqk` and `dv`): the tiled kernels keep four rows
/// of `⌈d / 64⌉` column quads per unit for each accumulated gradient, 219–255 registers in the key
/// backward at 256 (`scripts/cuda-codegen.sh`). Wider heads run the other paths.
pub const KERNEL_MAX_HEAD_DIM: usize = 256;

/// [`causal_attention`] on the fused kernels when the backend has them and the inputs suit them;
/// the arguments back otherwise.
fn kernel_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    scale: f64,
) -> Result<Tensor<B, 4>, AttentionOp<B>> {
    let [batch, heads, t, dqk] = q.dims();
    let dv = v.dims()[3];
    let dtype = q.dtype();
    let suits = backend::kernel_dtype(dtype)
        && k.dtype() == dtype
        && v.dtype() == dtype
        && batch * heads * t > 0
        && dqk.max(dv) <= KERNEL_MAX_HEAD_DIM
        && dqk.min(dv) > 0
        && t <= u16::MAX as usize
        && backend::kernels_available::<B>();
    let op = AttentionOp {
        q,
        k,
        v,
        pad: key_padding,
        scale,
    };
    if !suits {
        backend::record(FusedOp::Attention, KernelPath::Reference);
        return Err(op);
    }
    match backend::on_kernels::<B, _>(op) {
        Ok(Ok(o)) => {
            backend::record(FusedOp::Attention, KernelPath::Kernel);
            Ok(o)
        }
        Ok(Err(op)) | Err(op) => {
            backend::record(FusedOp::Attention, KernelPath::Reference);
            Err(op)
        }
    }
}

/// Backend extension with the causal attention kernels (design §5; the formulas are in
/// `kimi_burn_kernels::attention`). Implemented for every CubeCL backend (`CubeBackend<R, F, I,
/// BT>`, features `wgpu` / `cuda`), for `Fusion` over one and for `Autodiff<B>` over those (fused
/// backward).
pub trait AttentionKernels: Backend {
    /// Causal attention of `q, k: [B, H, T, dqk]`, `v: [B, H, T, dv]` (one float dtype: f32, f16
    /// or bf16) with the scores scaled by `scale` and the keys where `key_padding: [B, T]` is
    /// non-zero masked. Returns `(o: [B, H, T, dv]` in the inputs' dtype, `lse: [B, H, T]` f32`)`,
    /// the log-sum-exp of each query's visible scores (`1e30` when it sees no key; its output is
    /// zero). Differentiable on autodiff backends with respect to `q`, `k` and `v`.
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: Option<IntTensor<Self>>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The fused backward of [`attention_forward`](Self::attention_forward) for `grad: [B, H, T,
    /// dv]`, from its output `o` and `lse`: returns `(dq, dk, dv)` in the inputs' dtype. Not
    /// differentiable itself.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: Option<IntTensor<Self>>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The longest sequence the kernels take on this backend at heads `(dqk, dv)`;
    /// [`causal_attention`] runs the other fused path above it. Mesa's software Vulkan driver
    /// (lavapipe, what wgpu runs on without a GPU) ends an invocation's loops silently after
    /// 65 535 iterations, so the wgpu runtime takes the lengths whose loops stay within half of
    /// that ([`kimi_burn_kernels::attention::max_len_within`]: about 2 700 tokens at MLA's
    /// `d_qk = 192`, `d_v = 128`, about 8 500 at the tiny model's heads; a GPU adapter could take
    /// more, but the runtime cannot tell them apart here); CUDA has no limit.
    fn attention_max_len(dqk: usize, dv: usize) -> usize;
}

/// [`AttentionKernels::attention_forward`] on `Tensor`s.
struct AttentionOp<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    /// `[B, T]`, `true`: padding (handed to the kernels as ints).
    pad: Option<Tensor<B, 2, Bool>>,
    scale: f64,
}

impl<B: Backend> KernelOp<B> for AttentionOp<B> {
    /// The output, or the op back when the sequence is too long for the kernels.
    type Output = Result<Tensor<B, 4>, Self>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let [_, _, t, dqk] = self.q.dims();
        if t > K::attention_max_len(dqk, self.v.dims()[3]) {
            return Err(self);
        }
        let float = |t: Tensor<B, 4>| {
            same::<Tensor<B, 4>, Tensor<K, 4>>(t)
                .into_primitive()
                .tensor()
        };
        let pad = self
            .pad
            .map(|p| same::<Tensor<B, 2, Int>, Tensor<K, 2, Int>>(p.int()).into_primitive());
        let (o, _lse) =
            K::attention_forward(float(self.q), float(self.k), float(self.v), pad, self.scale);
        Ok(same(Tensor::<K, 4>::from_primitive(
            TensorPrimitive::Float(o),
        )))
    }
}

/// [`causal_attention`] on the CPU host kernel ([`crate::ops::attention`]) when the backend has
/// one and the inputs are f32; `None` otherwise. The key padding is read to the host.
fn host_attention<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    key_padding: Option<&Tensor<B, 2, Bool>>,
) -> Option<Tensor<B, 4>> {
    use crate::ops::backend::host;
    let f32s = [q.dtype(), k.dtype(), v.dtype()]
        .iter()
        .all(|d| *d == burn::tensor::DType::F32);
    if !(f32s && host::is_cpu_backend::<B>()) {
        return None;
    }
    let key_padding = match key_padding {
        Some(pad) => Some(crate::sync::read(pad.clone()).to_vec::<bool>().ok()?),
        None => None,
    };
    let op = crate::ops::attention::CausalAttention {
        scale: (q.dims()[3] as f32).powf(-0.5),
        key_padding,
    };
    let prim = |x: &Tensor<B, 4>| x.clone().into_primitive().tensor();
    Some(host::run(&op, [prim(q), prim(k), prim(v)]))
}

/// Attention in the absorbed latent form (design §5, decode): the keys and values are never
/// expanded per head. Per head `h`:
///
/// ```text
/// q_lat = q_nope_h · W_UK[h]                              # [dn] → [r]
/// s_j   = scale · (q_lat · c_j + q_pe_h · k_pe_j)         # masked, softmax over j
/// o_lat = Σ_j softmax(s)_j · c_j                          # [r]
/// o_h   = o_lat · W_UV[h]                                 # [r] → [dv]
/// ```
///
/// `q_nope: [B, H, tq, dn]`, `q_pe: [B, H, tq, dr]`, `latent` (the normalised `c`):
/// `[B, tk, r]`, `k_pe: [B, tk, dr]`, `w_uk: [H, dn, r]`, `w_uv: [H, r, dv]`,
/// `mask: [B, 1, tq, tk]` (`true` = not attended) → `[B, H, tq, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn absorbed_attention<B: Backend>(
    q_nope: Tensor<B, 4>,
    q_pe: Tensor<B, 4>,
    latent: Tensor<B, 3>,
    k_pe: Tensor<B, 3>,
    w_uk: Tensor<B, 3>,
    w_uv: Tensor<B, 3>,
    mask: Tensor<B, 4, Bool>,
    scale: f64,
) -> Tensor<B, 4> {
    // The cache is shared by all heads: a broadcast over the head dim, never a copy per head.
    let c = latent.unsqueeze_dim::<4>(1); // [B, 1, tk, r]
    let q_lat = q_nope.matmul(w_uk.unsqueeze_dim(0)); // [B, H, tq, r]
    let scores = q_lat
        .matmul(c.clone().swap_dims(2, 3))
        .add(q_pe.matmul(k_pe.unsqueeze_dim::<4>(1).swap_dims(2, 3)))
        .mul_scalar(scale);
    let mask = mask.expand(scores.dims());
    let o_lat = masked_softmax(scores, mask).matmul(c); // [B, H, tq, r]
    o_lat.matmul(w_uv.unsqueeze_dim(0))
}

/// Rotary position embedding in the "rotate half" layout (GPT-NeoX / Hugging Face), for
/// DeepSeek-style MLA only; Kimi's MLA is NoPE and never calls it.
///
/// `x: [B, N, T, dr]` (dr even) holding positions `offset..offset + T`: with `x = [a | b]`
/// (halves), `θ_i = base^(−2i/dr)`, `y = [a·cos − b·sin | b·cos + a·sin]` at angle `pos·θ_i`.
/// The angles are computed on the host in f64, so long positions keep their precision. On the
/// CPU backends (f32) one host pass each way (the backward rotates the gradient back); elsewhere
/// tensor ops.
pub fn rotary<B: Backend>(x: Tensor<B, 4>, offset: usize, base: f64) -> Tensor<B, 4> {
    let [_, _, t, dr] = x.dims();
    let half = dr / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in offset..offset + t {
        for i in 0..half {
            let angle = pos as f64 * base.powf(-2.0 * i as f64 / dr as f64);
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    if x.dtype() == DType::F32 && dr % 2 == 0 && backend::host::is_cpu_backend::<B>() {
        let f32s = |v: Vec<f64>| Arc::new(v.into_iter().map(|c| c as f32).collect::<Vec<_>>());
        let op = host::RotaryHost {
            cos: f32s(cos),
            sin: f32s(sin),
        };
        return backend::host::run(&op, [x.into_primitive().tensor()]);
    }
    let device = x.device();
    let table = |v: Vec<f64>| {
        Tensor::<B, 2>::from_data(TensorData::new(v, [t, half]), (&device, x.dtype()))
            .reshape([1, 1, t, half])
    };
    let (cos, sin) = (table(cos), table(sin));
    let a = x.clone().narrow(3, 0, half);
    let b = x.narrow(3, half, half);
    Tensor::cat(
        vec![
            a.clone().mul(cos.clone()).sub(b.clone().mul(sin.clone())),
            b.mul(cos).add(a.mul(sin)),
        ],
        3,
    )
}
