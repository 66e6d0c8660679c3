//! Fused CubeCL kernels behind the ops, chosen at run time.
//!
//! The modules stay generic over any [`Backend`]; the ops ([`situ_glu`](crate::ops::situ_glu),
//! the router's top-k and QB histogram, the MoE dispatch, chunked and recurrent KDA, the KDA
//! layer's short convolution and gated norm) first
//! offer their tensors to a kernel implementation and otherwise run their reference tensor-op
//! code. The kernels are reached through the backend-extension traits [`MoeKernels`] and
//! [`KdaKernels`], implemented (with the `wgpu` or `cuda` feature) for
//! every `CubeBackend<R, F, I, BT>` and, with custom backward passes, for `Autodiff<B>` over such a
//! backend.
//!
//! **Which backends take the kernel path automatically.** An op's `B` is compared (by `TypeId`)
//! with this list, and on a match the call is forwarded to `B`'s [`MoeKernels`] / [`KdaKernels`]
//! methods:
//!
//! | feature | backend types |
//! |---|---|
//! | `wgpu` | `CubeBackend<WgpuRuntime, F, i32, u32>` for `F` = `f32`, `half::f16` |
//! | `cuda` | `CubeBackend<CudaRuntime, F, i32, u8>` for `F` = `f32`, `half::f16`, `half::bf16` |
//! | both | `Fusion<X>` of each of the above (what `burn::backend::Wgpu` / `Cuda` are with Burn's default `fusion` feature; the kernels join the fusion stream as custom operations) |
//! | with `autodiff` | `Autodiff<X>` of each of the above, with and without `BalancedCheckpointing` |
//!
//! Anything else (ndarray, other CubeCL type parameters) runs the reference path. A user with another `CubeBackend` type can call the trait
//! methods directly (`<MyBackend as MoeKernels>::situ_glu_forward(...)`): the implementation is
//! generic over the runtime and element types.
//!
//! **Forcing the reference path.** The environment variable `KIMI_BURN_REFERENCE=1` (read once),
//! [`set_kernels`] (process-wide) and [`with_kernels`] (this thread, for a closure) switch the
//! kernels off, so a test or a bench can run both paths on the same backend. [`kernel_calls`] and
//! [`last_path`] report, per thread, which path each op took, so a GPU test can never pass on the
//! reference path by accident.

// Without a CubeCL backend the dispatch never matches: its plumbing is compiled but unused.
#![cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code, unused_macros))]

use std::any::{Any, TypeId};
use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "autodiff")]
mod autodiff_kda;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod cube_kda;
#[cfg(feature = "cubecl-kernels")]
mod cube_kda_chunk;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod kda;

pub(crate) use crate::ops::situ::GluActivation;
pub(crate) use kda::{tracked_on_kernels, KdaForm, NormGatedOp, RecurrentOp, ShortConvOp};
pub use kda::{KdaChunkGrads, KdaChunkSaved, KdaKernelInput, KdaKernels};

/// What the QB histogram is gathered over (design §3): `bins` bins on `[lo, hi]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HistogramSpec {
    /// Lower bound of the margins `r = α − s`.
    pub lo: f32,
    /// Upper bound.
    pub hi: f32,
    /// Number of bins.
    pub bins: usize,
}

impl HistogramSpec {
    /// `bins / (hi − lo)` in f32, computed exactly as the host balancer computes it (so both bin
    /// every margin identically).
    pub fn scale(&self) -> f32 {
        self.bins as f32 / (self.hi - self.lo)
    }
}

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
/// (callers check [`kernel_dtype`] first); math is f32 throughout.
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
}

/// Whether the kernels handle a float dtype (f32, f16, bf16 storage).
pub fn kernel_dtype(dtype: burn::tensor::DType) -> bool {
    use burn::tensor::DType;
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The fused ops, for [`kernel_calls`] and [`last_path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FusedOp {
    /// [`situ_glu`](crate::ops::situ_glu) forward.
    SituGlu,
    /// The SiTU-GLU backward (autodiff).
    SituGluBackward,
    /// The router's top-k selection (and QB histogram when requested).
    RouteTopK,
    /// The QB histogram (counted only when requested together with the selection).
    QbHistogram,
    /// The routed experts of a MoE layer (dispatch, grouped matmuls, combine).
    MoeExperts,
    /// Their backward (autodiff).
    MoeExpertsBackward,
    /// [`fused_recurrent_kda`](crate::ops::kda::fused_recurrent_kda) (the recurrent KDA kernel).
    KdaRecurrent,
    /// [`chunk_kda`](crate::ops::kda::chunk_kda) forward (the chunked kernels).
    KdaChunk,
    /// Its backward (autodiff).
    KdaChunkBackward,
    /// The short convolution with SiLU in front of KDA's q, k, v (the KDA layer), forward.
    ShortConv,
    /// Its backward (autodiff).
    ShortConvBackward,
    /// [`rms_norm_gated`](crate::ops::kda::rms_norm_gated) forward.
    RmsNormGated,
    /// Its backward (autodiff).
    RmsNormGatedBackward,
}

const N_OPS: usize = 13;

impl FusedOp {
    fn slot(self) -> usize {
        self as usize
    }
}

/// Which implementation an op ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// The fused CubeCL kernel.
    Kernel,
    /// The reference tensor-op (or host) implementation.
    Reference,
}

thread_local! {
    static CALLS: Cell<[u64; N_OPS]> = const { Cell::new([0; N_OPS]) };
    static LAST: Cell<[Option<KernelPath>; N_OPS]> = const { Cell::new([None; N_OPS]) };
    static THREAD_SWITCH: Cell<Option<bool>> = const { Cell::new(None) };
}

/// 0: not decided (read `KIMI_BURN_REFERENCE`), 1: kernels on, 2: off.
static GLOBAL_SWITCH: AtomicU8 = AtomicU8::new(0);

/// Switches the fused kernels on or off for the whole process (overrides `KIMI_BURN_REFERENCE`;
/// a [`with_kernels`] scope still wins on its thread).
pub fn set_kernels(enabled: bool) {
    GLOBAL_SWITCH.store(if enabled { 1 } else { 2 }, Ordering::Relaxed);
}

/// Runs `f` with the fused kernels switched on or off on this thread only (tests run in parallel
/// threads, so they compare both paths this way without disturbing each other).
pub fn with_kernels<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            THREAD_SWITCH.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(THREAD_SWITCH.with(|s| s.replace(Some(enabled))));
    f()
}

/// Whether the ops may use the fused kernels on this thread now.
pub fn kernels_enabled() -> bool {
    if let Some(on) = THREAD_SWITCH.with(Cell::get) {
        return on;
    }
    match GLOBAL_SWITCH.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let off = std::env::var("KIMI_BURN_REFERENCE")
                .is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
            // A concurrent `set_kernels` wins over the environment.
            let _ = GLOBAL_SWITCH.compare_exchange(
                0,
                if off { 2 } else { 1 },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            !off
        }
    }
}

/// How many times `op` ran its fused kernel on this thread.
pub fn kernel_calls(op: FusedOp) -> u64 {
    CALLS.with(|c| c.get()[op.slot()])
}

/// The path `op` took the last time it ran on this thread (`None` if it never ran).
pub fn last_path(op: FusedOp) -> Option<KernelPath> {
    LAST.with(|l| l.get()[op.slot()])
}

/// Records that `op` ran on `path` (the ops call this; so do the autodiff backward passes).
pub(crate) fn record(op: FusedOp, path: KernelPath) {
    LAST.with(|l| {
        let mut v = l.get();
        v[op.slot()] = Some(path);
        l.set(v);
    });
    if path == KernelPath::Kernel {
        CALLS.with(|c| {
            let mut v = c.get();
            v[op.slot()] += 1;
            c.set(v);
        });
    }
}

/// Every kernel family a dispatched backend provides: [`MoeKernels`] and [`KdaKernels`].
pub trait FusedKernels: MoeKernels + KdaKernels {}

impl<B: MoeKernels + KdaKernels> FusedKernels for B {}

/// An op's arguments, ready to run on a concrete kernel backend `K` (which is `B` itself: the
/// dispatch only calls [`run`](Self::run) after matching the types).
pub(crate) trait KernelOp<B: Backend>: Sized {
    /// The result, in `B`'s types.
    type Output;
    /// Runs on `K` (`== B`); use [`same`] to move values between the two names of the type.
    fn run<K: FusedKernels>(self) -> Self::Output;
}

/// Moves a value between two names of the same type (`T == U`, checked at run time).
///
/// # Panics
/// If the types differ (a bug in the dispatch, which compares `TypeId`s first).
pub(crate) fn same<T: 'static, U: 'static>(x: T) -> U {
    let mut slot = Some(x);
    (&mut slot as &mut dyn Any)
        .downcast_mut::<Option<U>>()
        .and_then(Option::take)
        .expect("kernel dispatch: the backend types must match")
}

/// Runs `op` on the fused kernels when `B` is one of the listed CubeCL backends and the kernels
/// are enabled; otherwise hands `op` back for the reference path.
pub(crate) fn dispatch<B: Backend, O: KernelOp<B>>(op: O) -> Result<O::Output, O> {
    if !kernels_enabled() {
        return Err(op);
    }
    let id = TypeId::of::<B>();
    // One line per concrete backend type: the single list of automatically dispatched backends.
    macro_rules! try_backend {
        ($K:ty) => {
            if id == TypeId::of::<$K>() {
                return Ok(op.run::<$K>());
            }
        };
    }
    macro_rules! with_autodiff {
        ($K:ty) => {
            try_backend!($K);
            #[cfg(feature = "autodiff")]
            {
                use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
                try_backend!(burn::backend::Autodiff<$K>);
                try_backend!(burn::backend::Autodiff<$K, BalancedCheckpointing>);
            }
        };
    }
    // Each CubeCL backend type plain and wrapped in `Fusion` (what `burn::backend::Wgpu` / `Cuda`
    // name with Burn's default features): the aliases change meaning with Burn's features, the
    // types do not.
    macro_rules! with_fusion {
        ($K:ty) => {
            with_autodiff!($K);
            with_autodiff!(burn_fusion::Fusion<$K>);
        };
    }
    #[cfg(feature = "wgpu")]
    {
        use crate::backends::WgpuCube;
        with_fusion!(WgpuCube<f32>);
        with_fusion!(WgpuCube<half::f16>);
    }
    #[cfg(feature = "cuda")]
    {
        use crate::backends::CudaCube;
        with_fusion!(CudaCube<f32>);
        with_fusion!(CudaCube<half::f16>);
        with_fusion!(CudaCube<half::bf16>);
    }
    let _ = id;
    Err(op)
}

/// Whether `B` takes the kernel path now (kernels enabled and `B` in the list of [`dispatch`]).
/// Callers check it before preparing kernel-only inputs (e.g. stacking the expert weights).
pub(crate) fn available<B: Backend>() -> bool {
    struct Probe;
    impl<B: Backend> KernelOp<B> for Probe {
        type Output = ();
        fn run<K: FusedKernels>(self) {}
    }
    dispatch::<B, _>(Probe).is_ok()
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
        };
        let out = K::moe_experts(input);
        same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(out)))
    }
}
