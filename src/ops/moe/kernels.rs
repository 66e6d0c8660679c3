//! The MoE side of the kernels: the backend extension [`MoeKernels`], its inputs and outputs, and
//! the op wrappers that move tensors onto it once [`on_kernels`](crate::ops::backend::on_kernels)
//! matched the backend.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::situ::GluActivation;
use crate::nn::balance::HistogramSpec;
use crate::ops::backend::{same, FusedKernels, KernelOp};
use crate::ops::quant::MxSpec;

/// The routed experts' weights and routing of one dropless MoE call, as backend primitives.
///
/// `n` experts of width `ℓ` and hidden width `m_e`; `m` tokens with `k` experts each.
#[derive(Debug, Clone)]
pub struct MoeExpertsInput<B: Backend> {
    /// Expert input rows `h: [m, ℓ]`.
    pub input: FloatTensor<B>,
    /// Selected experts `[m, k]` (each in `0..n`).
    pub indices: IntTensor<B>,
    /// Routing weights `p: [m, k]` (differentiable).
    pub weights: FloatTensor<B>,
    /// `[m]`, non-zero for tokens that are dispatched; `None`: all of them.
    pub valid: Option<IntTensor<B>>,
    /// Stacked gate projections `W1: [n, ℓ, m_e]`.
    pub w1: FloatTensor<B>,
    /// Stacked up projections `W3: [n, ℓ, m_e]`.
    pub w3: FloatTensor<B>,
    /// Stacked down projections `W2: [n, m_e, ℓ]`.
    pub w2: FloatTensor<B>,
    /// The experts' activation.
    pub activation: GluActivation,
    /// MX fake quantisation of the activated hidden rows before the down projection
    /// (quantisation-aware training, design §9): `u[t] = Σ p · W2[e]ᵀ·Q(act(…))`, straight-through
    /// in the backward. `None`: full precision.
    pub hidden_quant: Option<MxSpec>,
}

/// What the forward of the routed experts keeps for its backward
/// ([`MoeKernels::moe_experts_saving`]): the gate and up projections of every dispatched pair, in
/// the expert-sorted order of the dispatch (`[pairs, m_e]` each). Keeping them costs what the
/// reference path's autodiff keeps anyway and saves the backward two of its grouped matmuls.
#[derive(Debug, Clone)]
pub struct MoeSaved<B: Backend> {
    /// `h·W1[e]` per sorted pair.
    pub gate: FloatTensor<B>,
    /// `h·W3[e]` per sorted pair.
    pub up: FloatTensor<B>,
}

/// The gradients of [`MoeKernels::moe_experts`] with respect to its float inputs.
#[derive(Debug, Clone)]
pub struct MoeExpertsGrads<B: Backend> {
    /// `[m, ℓ]`.
    pub input: FloatTensor<B>,
    /// `[m, k]`.
    pub weights: FloatTensor<B>,
    /// `[n, ℓ, m_e]`.
    pub w1: FloatTensor<B>,
    /// `[n, ℓ, m_e]`.
    pub w3: FloatTensor<B>,
    /// `[n, m_e, ℓ]`.
    pub w2: FloatTensor<B>,
}

/// Backend extension with the fused MoE-side kernels. Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`) and for `Autodiff<B>` over one (custom
/// backward passes that call the backward kernels). Float inputs may be f32, f16 or bf16
/// (callers check [`kernel_dtype`](crate::ops::backend::kernel_dtype) first); math is f32 throughout.
pub trait MoeKernels: Backend {
    /// SiTU-GLU forward `y = p·A(gate)·B(up)` (design §1). `gate`, `up`: `[rows, h]`, same dtype;
    /// `weight`: optional per-row `p: [rows]`. Returns `[rows, h]` in the input dtype.
    fn situ_glu_forward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        activation: GluActivation,
    ) -> FloatTensor<Self>;

    /// The fused backward of [`situ_glu_forward`](Self::situ_glu_forward): given `grad = dY`
    /// `[rows, h]`, returns `(dgate, dup, dweight)` with `dweight: [rows] = Σ_h dY·A·B` (f32) when a
    /// weight was given. Not differentiable itself.
    #[allow(clippy::type_complexity)]
    fn situ_glu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        activation: GluActivation,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    );

    /// Top-k of `scores + bias` per token (ties: lower expert index) and, optionally, the QB
    /// histogram of the margins `r_ij = α_i − s_ij` (design §3) over the valid tokens.
    ///
    /// `scores: [m, n]` f32, `bias: [n]` f32, `valid: [m]` (non-zero: counted). Returns the
    /// indices `[m, k]` (best first) and, with `histogram`, the integer counts `[n, bins]`.
    /// Selection is not differentiable (no autodiff graph).
    fn route_top_k(
        scores: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        valid: Option<IntTensor<Self>>,
        k: usize,
        histogram: Option<HistogramSpec>,
    ) -> (IntTensor<Self>, Option<IntTensor<Self>>);

    /// The routed experts of a dropless MoE (design §2), in one pass over the routed pairs only:
    /// `u[t] = Σ_{(t,e,p)} p · W2[e]ᵀ·act(W1[e]ᵀ·h[t], W3[e]ᵀ·h[t])`, i.e. sort the pairs by expert
    /// on the device, gather rows, grouped matmuls over the expert segments, fold `p` into the
    /// activation, un-permute by a gather-sum. Returns `u: [m, ℓ]` in `h`'s dtype (zeros for
    /// masked tokens). Differentiable in `input`, `weights`, `w1`, `w3`, `w2` on autodiff backends.
    fn moe_experts(input: MoeExpertsInput<Self>) -> FloatTensor<Self>;

    /// [`moe_experts`](Self::moe_experts), also handing back what the backward can reuse instead
    /// of recomputing it (the autodiff wiring keeps it until the backward). The default keeps
    /// nothing.
    fn moe_experts_saving(
        input: MoeExpertsInput<Self>,
    ) -> (FloatTensor<Self>, Option<MoeSaved<Self>>) {
        (Self::moe_experts(input), None)
    }

    /// The fused backward of [`moe_experts`](Self::moe_experts) for the output gradient
    /// `grad: [m, ℓ]`, reusing `saved` from [`moe_experts_saving`](Self::moe_experts_saving)
    /// when given (recomputing it otherwise). Not differentiable itself.
    fn moe_experts_backward(
        input: MoeExpertsInput<Self>,
        grad: FloatTensor<Self>,
        saved: Option<MoeSaved<Self>>,
    ) -> MoeExpertsGrads<Self>;

    /// MX fake quantisation `X · Q(x / X)` in blocks of 32 along the last axis of `x` (design §9),
    /// exactly (bit-identical to the host loop). `x`: any float dtype; returns f32, same shape.
    /// Not differentiable (callers add the straight-through gradient).
    fn mx_fake_quant(x: FloatTensor<Self>, spec: MxSpec) -> FloatTensor<Self>;
}

/// [`MoeKernels::route_top_k`] on `Tensor`s.
pub(crate) struct RouteOp<B: Backend> {
    pub scores: burn::tensor::Tensor<B, 2>,
    pub bias: burn::tensor::Tensor<B, 1>,
    pub valid: Option<burn::tensor::Tensor<B, 1, burn::tensor::Int>>,
    pub k: usize,
    pub histogram: Option<HistogramSpec>,
}

impl<B: Backend> KernelOp<B> for RouteOp<B> {
    #[allow(clippy::type_complexity)]
    type Output = (
        burn::tensor::Tensor<B, 2, burn::tensor::Int>,
        Option<burn::tensor::Tensor<B, 2, burn::tensor::Int>>,
    );

    fn run<K: FusedKernels>(self) -> Self::Output {
        use burn::tensor::{Int, Tensor};
        let scores: Tensor<K, 2> = same(self.scores);
        let bias: Tensor<K, 1> = same(self.bias);
        let valid: Option<Tensor<K, 1, Int>> = self.valid.map(same);
        let (indices, counts) = K::route_top_k(
            scores.into_primitive().tensor(),
            bias.into_primitive().tensor(),
            valid.map(Tensor::into_primitive),
            self.k,
            self.histogram,
        );
        (
            same(Tensor::<K, 2, Int>::from_primitive(indices)),
            counts.map(|c| same(Tensor::<K, 2, Int>::from_primitive(c))),
        )
    }
}

/// [`MoeKernels::moe_experts`] on `Tensor`s.
pub(crate) struct MoeOp<B: Backend> {
    pub input: burn::tensor::Tensor<B, 2>,
    pub indices: burn::tensor::Tensor<B, 2, burn::tensor::Int>,
    pub weights: burn::tensor::Tensor<B, 2>,
    pub valid: Option<burn::tensor::Tensor<B, 1, burn::tensor::Int>>,
    pub w1: burn::tensor::Tensor<B, 3>,
    pub w3: burn::tensor::Tensor<B, 3>,
    pub w2: burn::tensor::Tensor<B, 3>,
    pub activation: GluActivation,
    pub hidden_quant: Option<MxSpec>,
}

impl<B: Backend> KernelOp<B> for MoeOp<B> {
    type Output = burn::tensor::Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        use burn::tensor::{Int, Tensor, TensorPrimitive};
        fn float<B: Backend, K: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<K> {
            same::<Tensor<B, D>, Tensor<K, D>>(t)
                .into_primitive()
                .tensor()
        }
        let input = MoeExpertsInput::<K> {
            input: float::<B, K, 2>(self.input),
            indices: same::<_, Tensor<K, 2, Int>>(self.indices).into_primitive(),
            weights: float::<B, K, 2>(self.weights),
            valid: self
                .valid
                .map(|v| same::<_, Tensor<K, 1, Int>>(v).into_primitive()),
            w1: float::<B, K, 3>(self.w1),
            w3: float::<B, K, 3>(self.w3),
            w2: float::<B, K, 3>(self.w2),
            activation: self.activation,
            hidden_quant: self.hidden_quant,
        };
        let out = K::moe_experts(input);
        same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(out)))
    }
}
