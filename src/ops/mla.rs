//! Causal softmax attention for Gated NoPE MLA (design §5): the plain `softmax(QKᵀ)V` form, the
//! dispatch to Burn's fused attention op, and the absorbed latent form used by decode.
//!
//! Masks follow Burn's convention: `true` marks a position that must **not** be attended to.

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{backend::Backend, Bool, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::precision::{restore, widen};

/// Which implementation computes the training / prefill attention of the expanded form.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AttentionKind {
    /// Burn's `attention` op, which a backend may implement with a flash kernel.
    ///
    /// What runs in Burn 0.21: ndarray and **every autodiff backend** (so all training) run
    /// Burn's unfused fallback, which handles `dqk ≠ dv` (192 vs 128) and masks. The CubeCL
    /// backends (wgpu, cuda) consider flash kernels only with Burn's `autotune` feature, and
    /// only without an explicit scale; those kernels need `dqk ≥ dv` and autotune keeps the
    /// fallback when they fail (on Mesa's lavapipe they do, so wgpu in CI runs the fallback).
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
pub fn masked_softmax<B: Backend, const D: usize>(
    scores: Tensor<B, D>,
    mask: Tensor<B, D, Bool>,
) -> Tensor<B, D> {
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

/// Causal self-attention with optional key padding, by the chosen implementation.
///
/// `q, k: [B, H, T, dqk]`, `v: [B, H, T, dv]` (`dv` may differ from `dqk`), `key_padding:
/// [B, T]` (`true` = padding) → `[B, H, T, dv]`. The scale is `dqk^−1/2`, MLA's
/// `(qk_nope + qk_rope)^−1/2`; it is left implicit for the fused op because the CubeCL backends
/// route any explicit scale to the unfused fallback.
///
/// Rows whose keys are all masked (a padding query preceded only by padding) are not defined
/// the same way by every kernel; callers zero the outputs at padding queries.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    kind: AttentionKind,
) -> Tensor<B, 4> {
    let [batch, heads, t, dqk] = q.dims();
    if let Some(o) = host_attention(&q, &k, &v, key_padding.as_ref()) {
        return o;
    }
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
            attention_plain(q, k, v, mask, (dqk as f64).powf(-0.5))
        }
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
/// The angles are computed on the host in f64, so long positions keep their precision.
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
