//! Dropless, routed-only MoE dispatch (design §2), reference form in tensor ops.
//!
//! The `(token, expert)` pairs are sorted by expert on the host (a counting sort, so pairs keep
//! their token order within an expert), each expert gathers the rows of its own contiguous segment
//! and runs on them only, the outputs are concatenated in segment order, scaled by their routing
//! weight and scatter-added back. No token is dropped and no expert sees a token not routed to it.
//!
//! Gathering per segment rather than gathering all pairs once and slicing matters for the backward
//! of this tensor-op form: Burn's autodiff turns each slice into a zero tensor the size of its
//! source, so slicing `n` segments out of the `[m·k, ℓ]` gather costs `n·m·k·ℓ`, while a per-expert
//! `select` from `[m, ℓ]` costs `n·m·ℓ` (k times less; 2× faster end to end at n = 64, k = 8).

use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor, TensorData};

use super::route::{Selection, TokenMask};
use super::situ::GluActivation;
use crate::ops::backend::{self, FusedOp, KernelPath};
use crate::ops::precision::restore;
use crate::ops::quant::MxSpec;

/// The host-side plan of a dispatch: pairs in expert order and each expert's segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Token of each sorted pair, `[P]`.
    pub tokens: Vec<i64>,
    /// Flat index `token·k + slot` of each sorted pair into the `[m, k]` selection, `[P]`.
    pub pairs: Vec<i64>,
    /// `offsets[e]..offsets[e + 1]` is expert `e`'s segment; `[n + 1]`.
    pub offsets: Vec<usize>,
    /// Number of tokens `m`.
    pub m: usize,
}

impl DispatchPlan {
    /// Plans the dispatch of a selection, leaving out invalid (padding) tokens.
    pub fn new(selection: &Selection, valid: Option<&[bool]>) -> Self {
        let (m, n, k) = (selection.tokens, selection.experts, selection.k);
        let keep = |t: usize| valid.is_none_or(|v| v[t]);
        let mut offsets = vec![0usize; n + 1];
        for (t, sel) in selection.indices.chunks_exact(k).enumerate() {
            if keep(t) {
                for &e in sel {
                    offsets[e as usize + 1] += 1;
                }
            }
        }
        for e in 0..n {
            offsets[e + 1] += offsets[e];
        }
        let total = offsets[n];
        let mut cursor = offsets.clone();
        let mut tokens = vec![0i64; total];
        let mut pairs = vec![0i64; total];
        for (t, sel) in selection.indices.chunks_exact(k).enumerate() {
            if keep(t) {
                for (slot, &e) in sel.iter().enumerate() {
                    let at = cursor[e as usize];
                    cursor[e as usize] += 1;
                    tokens[at] = t as i64;
                    pairs[at] = (t * k + slot) as i64;
                }
            }
        }
        Self {
            tokens,
            pairs,
            offsets,
            m,
        }
    }

    /// Number of dispatched pairs `P`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when no pair is dispatched (every token masked).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Experts with a non-empty segment, with their segment range.
    pub fn segments(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        self.offsets
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[1] > w[0])
            .map(|(e, w)| (e, w[0]..w[1]))
    }
}

fn int_tensor<B: Backend>(values: &[i64], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// Runs the routed experts on their tokens only and combines them:
/// `out[t] = Σ_{(t,e,p)} p · expert_e(h[t])`.
///
/// `h: [m, d_in]`, `weights: [m, k]` (aligned with the plan's selection), `expert(e, rows)` maps
/// `[rows, d_in]` to `[rows, d_out]`. Returns `[m, d_out]` in `h`'s dtype; masked tokens get zeros.
pub fn dispatch<B, F>(
    h: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    plan: &DispatchPlan,
    d_out: usize,
    mut expert: F,
) -> Tensor<B, 2>
where
    B: Backend,
    F: FnMut(usize, Tensor<B, 2>) -> Tensor<B, 2>,
{
    let device = h.device();
    let dtype = h.dtype();
    let out = Tensor::<B, 2>::zeros([plan.m, d_out], (&device, dtype));
    if plan.is_empty() {
        return out;
    }
    let tokens = int_tensor::<B>(&plan.tokens, &device);
    let outputs: Vec<Tensor<B, 2>> = plan
        .segments()
        .map(|(e, range)| expert(e, h.clone().select(0, tokens.clone().slice([range]))))
        .collect();
    let y = Tensor::cat(outputs, 0);
    let [m, k] = weights.dims();
    let p = weights
        .reshape([m * k])
        .select(0, int_tensor::<B>(&plan.pairs, &device));
    let y = y.mul(restore(p, dtype).unsqueeze_dim::<2>(1));
    out.select_assign(0, tokens, y, IndexingUpdateOp::Add)
}

/// The routed experts' weights stacked along a leading expert axis, for the fused dispatch.
#[derive(Debug, Clone)]
pub struct StackedExperts<B: Backend> {
    /// Gate projections `W1: [n, ℓ, m_e]` (expert `e`'s `w1.weight` is `W1[e]`).
    pub w1: Tensor<B, 3>,
    /// Up projections `W3: [n, ℓ, m_e]`.
    pub w3: Tensor<B, 3>,
    /// Down projections `W2: [n, m_e, ℓ]`.
    pub w2: Tensor<B, 3>,
    /// The experts' activation.
    pub activation: GluActivation,
    /// MX fake quantisation of the activated hidden rows entering `W2` (quantisation-aware
    /// training); `None`: full precision.
    pub hidden_quant: Option<MxSpec>,
}

/// Whether [`dispatch_fused`] runs on `B` now (a CubeCL backend with the kernels enabled), so
/// callers only stack the expert weights when it pays.
pub fn fused_available<B: Backend>() -> bool {
    backend::kernels_available::<B>()
}

/// The routed experts by the fused kernels (design §2, dropless and routed-only):
/// `out[t] = Σ_{(t,e,p)} p · W2[e]ᵀ·act(W1[e]ᵀ·h[t], W3[e]ᵀ·h[t])`, the same as [`dispatch`] with
/// SiTU-GLU experts, in a fixed number of launches whatever `n`: the pairs are sorted by expert on
/// the device (stable, so the order matches [`DispatchPlan`]), gate/up/down run as grouped matmuls
/// over the expert segments with rows gathered on load, `p` is folded into the activation, and the
/// un-permute is a gather-sum (no float atomics: bit-reproducible). Differentiable in `h`,
/// `weights` and the stacked weights on autodiff backends (fused backward kernels).
///
/// `h: [m, ℓ]`, `indices: [m, k]`, `weights: [m, k]`, `valid: [m]` (`false`: padding; zero
/// output). An index outside `0..n` is not checked (that would need a read); its pair is dropped,
/// as padding drops a token's pairs. Reads nothing back, and no shape depends on the routing:
/// buffers are sized by `m·k` and the segments are device-side offsets. Returns `None` (nothing consumed but clones)
/// where the kernels do not apply: another backend, kernels off, an unsupported dtype or
/// inconsistent shapes.
pub fn dispatch_fused<B: Backend>(
    h: &Tensor<B, 2>,
    indices: &Tensor<B, 2, Int>,
    weights: &Tensor<B, 2>,
    valid: Option<&TokenMask<B>>,
    experts: &StackedExperts<B>,
) -> Option<Tensor<B, 2>> {
    let [m, l] = h.dims();
    let [n, l1, me] = experts.w1.dims();
    let shapes_ok = indices.dims() == weights.dims()
        && indices.dims()[0] == m
        && l1 == l
        && experts.w3.dims() == [n, l, me]
        && experts.w2.dims() == [n, me, l]
        && valid.is_none_or(|v| v.len() == m)
        && m * l * n * me > 0;
    if !(shapes_ok && backend::kernel_dtype(h.dtype()) && backend::kernels_available::<B>()) {
        backend::record(FusedOp::MoeExperts, KernelPath::Reference);
        return None;
    }
    let device = h.device();
    let op = crate::ops::moe::kernels::MoeOp {
        input: h.clone(),
        indices: indices.clone(),
        weights: weights.clone(),
        valid: valid.map(|v| v.device(&device)),
        w1: experts.w1.clone(),
        w3: experts.w3.clone(),
        w2: experts.w2.clone(),
        activation: experts.activation,
        hidden_quant: experts.hidden_quant,
    };
    let out = backend::on_kernels::<B, _>(op).ok();
    let path = if out.is_some() {
        KernelPath::Kernel
    } else {
        KernelPath::Reference
    };
    backend::record(FusedOp::MoeExperts, path);
    out
}

/// The routed experts of a dropless MoE (design §2), choosing the path itself: the fused kernels
/// ([`dispatch_fused`]) where they run, else [`dispatch_stacked`] in tensor ops.
///
/// `experts`: the stacked weights (already quantised for QAT, see
/// [`RoutedExperts::stacked`](crate::nn::RoutedExperts::stacked)); `indices` and `weights`:
/// `[m, k]`, `selection`: gives the host copy of `indices`, called only on the reference path
/// (which plans on the host), `valid`: `false` for padding. Returns `[m, ℓ]`.
pub fn routed_experts<'s, B: Backend>(
    h: Tensor<B, 2>,
    indices: &Tensor<B, 2, Int>,
    weights: Tensor<B, 2>,
    selection: impl FnOnce() -> &'s Selection,
    valid: Option<&TokenMask<B>>,
    experts: &StackedExperts<B>,
) -> Tensor<B, 2> {
    if let Some(u) = dispatch_fused(&h, indices, &weights, valid, experts) {
        return u;
    }
    let plan = DispatchPlan::new(selection(), valid.map(TokenMask::host));
    if host_applies(&h, &weights, experts) {
        return dispatch_host(h, weights, plan, experts);
    }
    dispatch_stacked(h, weights, &plan, experts)
}

/// Whether [`dispatch_host`] runs these inputs: a CPU backend with host kernels, f32 everywhere
/// and no hidden quantisation (QAT keeps the tensor-op form).
fn host_applies<B: Backend>(
    h: &Tensor<B, 2>,
    weights: &Tensor<B, 2>,
    experts: &StackedExperts<B>,
) -> bool {
    let dtypes = [
        h.dtype(),
        weights.dtype(),
        experts.w1.dtype(),
        experts.w3.dtype(),
        experts.w2.dtype(),
    ];
    experts.hidden_quant.is_none()
        && dtypes.iter().all(|d| *d == burn::tensor::DType::F32)
        && crate::ops::backend::host::is_cpu_backend::<B>()
}

/// The routed experts on the CPU host kernel (one grouped pass over the expert segments, every
/// product a `gemm` call, no padding); the same map as [`dispatch_stacked`]. The caller checks
/// [`host_applies`].
fn dispatch_host<B: Backend>(
    h: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    plan: DispatchPlan,
    experts: &StackedExperts<B>,
) -> Tensor<B, 2> {
    let k = weights.dims()[1];
    let op = super::host::RoutedExperts {
        plan: std::sync::Arc::new(plan),
        k,
        activation: experts.activation,
    };
    let prim = |x: Tensor<B, 3>| x.into_primitive().tensor();
    crate::ops::backend::host::run(
        &op,
        [
            h.into_primitive().tensor(),
            weights.into_primitive().tensor(),
            prim(experts.w1.clone()),
            prim(experts.w3.clone()),
            prim(experts.w2.clone()),
        ],
    )
}

/// The routed experts over stacked weights in tensor ops (the reference of [`dispatch_fused`]):
/// the routed rows are gathered into a zero-padded batch `[n, cap, ℓ]` (`cap`: the largest expert
/// load of `plan`), run through batched matmuls `act(X·W1, X·W3)·W2` (with the hidden quantisation
/// of QAT between them), weighted by `p` and scatter-added back:
/// `out[t] = Σ_{(t,e,p)} p · W2[e]ᵀ·act(W1[e]ᵀ·h[t], W3[e]ᵀ·h[t])`. A constant number of tensor ops
/// whatever `n`, and the weight gradients come out stacked.
///
/// `h: [m, ℓ]`, `weights: [m, k]` (aligned with the plan's selection). Returns `[m, ℓ_out]` in
/// `h`'s dtype; masked tokens get zeros.
pub fn dispatch_stacked<B: Backend>(
    h: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    plan: &DispatchPlan,
    experts: &StackedExperts<B>,
) -> Tensor<B, 2> {
    let device = h.device();
    let dtype = h.dtype();
    let [m, l] = h.dims();
    let [n, _, _] = experts.w1.dims();
    let width = experts.w2.dims()[2];
    if plan.is_empty() || n == 0 {
        return Tensor::zeros([m, width], (&device, dtype));
    }
    let [_, k] = weights.dims();
    let cap = plan
        .offsets
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or(0)
        .max(1);
    // Padding slots read the zero row `m` and carry weight 0 (the zero at index `m·k`).
    let mut slot_token = vec![m as i64; n * cap];
    let mut slot_pair = vec![(m * k) as i64; n * cap];
    for (e, range) in plan.segments() {
        for (j, at) in range.enumerate() {
            slot_token[e * cap + j] = plan.tokens[at];
            slot_pair[e * cap + j] = plan.pairs[at];
        }
    }
    let slot_token = int_tensor::<B>(&slot_token, &device);
    let rows = Tensor::cat(vec![h, Tensor::zeros([1, l], (&device, dtype))], 0)
        .select(0, slot_token.clone())
        .reshape([n, cap, l]);
    let a = experts.activation.apply(
        rows.clone().matmul(experts.w1.clone()),
        rows.matmul(experts.w3.clone()),
    );
    let a = match experts.hidden_quant {
        Some(spec) => spec.fake_quant(a, 2),
        None => a,
    };
    let y = a.matmul(experts.w2.clone()).reshape([n * cap, width]);
    let zero = Tensor::zeros([1], (&device, weights.dtype()));
    let p = Tensor::cat(vec![weights.reshape([m * k]), zero], 0)
        .select(0, int_tensor::<B>(&slot_pair, &device));
    let y = y.mul(restore(p, dtype).unsqueeze_dim::<2>(1));
    Tensor::<B, 2>::zeros([m + 1, width], (&device, dtype))
        .select_assign(0, slot_token, y, IndexingUpdateOp::Add)
        .narrow(0, 0, m)
}
