//! What the ops of every block share to choose their path: the registry of backends that run the
//! CubeCL kernels, the kernels on/off switch, the per-op path record, the CPU host-kernel runner
//! (`host`) and the `Fusion` glue (`fusion`). Each op decides its own path in its own folder
//! ([`kda`](crate::ops::kda), [`moe`](crate::ops::moe)); the modules in [`nn`](crate::nn) never
//! choose one.
//!
//! The modules stay generic over any [`Backend`]. An op first offers its tensors to a kernel
//! implementation, reached through the backend-extension traits
//! [`MoeKernels`], [`KdaKernels`], [`AttnResKernels`], [`RmsNormKernels`],
//! [`CrossEntropyKernels`], [`AttentionKernels`], [`OptimKernels`] and [`ActivationKernels`]
//! (implemented with the `wgpu` or `cuda` feature for every `CubeBackend<R, F, I, BT>`, for
//! `Fusion<B>` over one, and, with custom backward passes, for `Autodiff<B>` over either), and
//! otherwise runs its reference tensor-op code (or, on the CPU backends, a host kernel).
//!
//! **Which backends take the kernel path automatically.** An op's `B` is compared (by `TypeId`)
//! with this list in `on_kernels`, and on a match the call is forwarded to `B`'s trait methods:
//!
//! | feature | backend types |
//! |---|---|
//! | `wgpu` | `CubeBackend<WgpuRuntime, F, i32, u32>` for `F` = `f32`, `half::f16` |
//! | `cuda` | `CubeBackend<CudaRuntime, F, i32, u8>` for `F` = `f32`, `half::f16`, `half::bf16` |
//! | both | `Fusion<X>` of each of the above (what `burn::backend::Wgpu` / `Cuda` are with Burn's default `fusion` feature; the kernels join the fusion stream as custom operations) |
//! | with `autodiff` | `Autodiff<X>` of each of the above, with and without `BalancedCheckpointing` |
//!
//! `kimi_burn::backends` (with `wgpu` or `cuda`) names these types. Anything else (ndarray,
//! other CubeCL type parameters) runs the reference path. A user with another `CubeBackend` type
//! can call the trait methods directly: the implementations are generic over the runtime and
//! element types.
//!
//! **Forcing the reference path.** The environment variable `KIMI_BURN_REFERENCE=1` (read once),
//! [`set_kernels`] (process-wide) and [`with_kernels`] (this thread, for a closure) switch the
//! kernels off, the CPU host kernels included, so a test or a bench can run both paths on the same
//! backend. [`kernel_calls`] and [`last_path`] report, per thread, which path each op took, so a
//! GPU test can never pass on the reference path by accident.

// Without a CubeCL backend the registry never matches: its plumbing is compiled but unused.
#![cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code, unused_macros))]

use std::any::{Any, TypeId};
use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;

use crate::ops::attn_res::AttnResKernels;
use crate::ops::kda::KdaKernels;
use crate::ops::loss::CrossEntropyKernels;
use crate::ops::mla::AttentionKernels;
use crate::ops::moe::MoeKernels;
use crate::ops::norm::RmsNormKernels;
use crate::ops::optim::OptimKernels;
use crate::ops::precision::ActivationKernels;

#[cfg(feature = "autodiff")]
pub(crate) mod autodiff;
#[cfg(feature = "cubecl-kernels")]
pub(crate) mod cube;
#[cfg(feature = "cubecl-kernels")]
pub(crate) mod fusion;
pub(crate) mod host;
pub(crate) mod matmul;
mod memory;
mod pool;
pub(crate) mod simd;

pub use memory::retain_freed_memory;
pub(crate) use pool::join;
pub use pool::{on_cpu_pool, pool_idle_spin, set_pool_idle_spin};

/// Whether the kernels handle a float dtype (f32, f16, bf16 storage).
pub fn kernel_dtype(dtype: burn::tensor::DType) -> bool {
    use burn::tensor::DType;
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// The fused ops, for [`kernel_calls`] and [`last_path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
    /// [`mx_fake_quant`](crate::ops::quant::mx_fake_quant) (forward; the backward is elementwise).
    MxFakeQuant,
    /// [`attn_res`](crate::ops::attn_res::attn_res) forward (Attention Residuals' mix).
    AttnRes,
    /// Its backward (autodiff).
    AttnResBackward,
    /// [`rms_norm`](crate::ops::norm::rms_norm) forward.
    RmsNorm,
    /// Its backward (autodiff).
    RmsNormBackward,
    /// [`masked_cross_entropy`](crate::ops::loss::masked_cross_entropy) forward.
    CrossEntropy,
    /// Its backward (autodiff).
    CrossEntropyBackward,
    /// [`causal_attention`](crate::ops::mla::causal_attention) forward (the expanded MLA
    /// attention of training and prefill).
    Attention,
    /// Its backward (autodiff).
    AttentionBackward,
    /// [`adamw_update`](crate::ops::optim::adamw_update): one AdamW step of a parameter.
    AdamW,
    /// [`scaled_sum`](crate::ops::optim::scaled_sum): Muon's momentum and update steps.
    ScaledSum,
    /// [`sigmoid`](crate::ops::precision::sigmoid) forward (the precise sigmoid).
    Sigmoid,
    /// Its backward (autodiff).
    SigmoidBackward,
}

const N_OPS: usize = 26;

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
    static TENSOR_CORES: Cell<Option<bool>> = const { Cell::new(None) };
    static EMULATION: Cell<Option<bool>> = const { Cell::new(None) };
    static TENSOR_CORE_LAUNCHES: Cell<u64> = const { Cell::new(0) };
}

/// This thread's switches and records of the ops' paths, as [`pool`] carries them between a
/// caller and the pool thread that runs its work.
#[derive(Clone, Copy)]
pub(crate) struct PathState {
    calls: [u64; N_OPS],
    last: [Option<KernelPath>; N_OPS],
    switch: Option<bool>,
    tensor_cores: Option<bool>,
    emulation: Option<bool>,
    tensor_core_launches: u64,
}

impl PathState {
    /// This thread's state now.
    pub(crate) fn current() -> Self {
        Self {
            calls: CALLS.with(Cell::get),
            last: LAST.with(Cell::get),
            switch: THREAD_SWITCH.with(Cell::get),
            tensor_cores: TENSOR_CORES.with(Cell::get),
            emulation: EMULATION.with(Cell::get),
            tensor_core_launches: TENSOR_CORE_LAUNCHES.with(Cell::get),
        }
    }

    /// Makes `self` this thread's state.
    pub(crate) fn install(self) {
        CALLS.with(|c| c.set(self.calls));
        LAST.with(|c| c.set(self.last));
        THREAD_SWITCH.with(|c| c.set(self.switch));
        TENSOR_CORES.with(|c| c.set(self.tensor_cores));
        EMULATION.with(|c| c.set(self.emulation));
        TENSOR_CORE_LAUNCHES.with(|c| c.set(self.tensor_core_launches));
    }

    /// The same switches with nothing recorded yet.
    pub(crate) fn switches_only(self) -> Self {
        Self {
            calls: [0; N_OPS],
            last: [None; N_OPS],
            tensor_core_launches: 0,
            ..self
        }
    }

    /// Adds what `records` (a state that started from [`switches_only`](Self::switches_only))
    /// recorded to this state.
    pub(crate) fn merge(mut self, records: &Self) -> Self {
        for (c, r) in self.calls.iter_mut().zip(&records.calls) {
            *c += r;
        }
        for (l, r) in self.last.iter_mut().zip(&records.last) {
            if r.is_some() {
                *l = *r;
            }
        }
        self.tensor_core_launches += records.tensor_core_launches;
        self
    }
}

/// Runs `f` with the kernels' tensor-core (cooperative matrix) paths switched on or off on this
/// thread, whatever `KIMI_BURN_TENSOR_CORES` says. Where they are on, they run wherever the
/// device has them for the storage type: on CUDA (compute capability 8.0 and later) f16 and
/// bf16 products for half storage and TF32 products for f32 storage, accumulated in f32 (TF32
/// keeps f32's range with a 10-bit significand, as Burn's own f32 matmuls on CUDA do). Off, the
/// same kernels take their scalar f32 loops, the path every device runs.
///
/// They are **off by default** for now: the matrix-unit paths have tests against the scalar path
/// and the reference (`scripts/cuda-check.sh`) that have not yet run on a GPU with matrix units
/// (on an H200 the bf16 path has run in the benches, 1.32× as fast as the scalar loop). Their
/// tiles, staging and epilogues are tested on every device through
/// [`with_tensor_core_emulation`].
/// `KIMI_BURN_TENSOR_CORES=1` switches them on for a whole process.
///
/// The choice is made when a kernel is launched: on a `Fusion` backend that is when the fused
/// stream runs, which may be outside this scope, so use the environment variable there.
pub fn with_tensor_cores<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
    with_switch(&TENSOR_CORES, enabled, f)
}

/// Runs `f` with the kernels' tensor-core paths emulated on this thread: the same tiles, shared
/// memory staging, placement of the `16 × 16` blocks and epilogues as on the matrix units, with
/// each block product computed in f32 by the units of its plane instead of a `cmma` instruction.
/// It runs on every device and storage type, whatever [`with_tensor_cores`] says, and is slower
/// than the kernels' scalar loops: it exists so that a device without matrix units (lavapipe in
/// CI) tests everything of the tensor-core path except the matrix instructions themselves.
/// [`tensor_core_launches`] counts its launches.
///
/// As with [`with_tensor_cores`], the choice is made when a kernel is launched
/// (`KIMI_BURN_TENSOR_CORES=emulate` for a whole process, e.g. on a `Fusion` backend).
pub fn with_tensor_core_emulation<T>(f: impl FnOnce() -> T) -> T {
    with_switch(&EMULATION, true, f)
}

/// Whether the kernels emulate their tensor-core paths on this thread now: inside a
/// [`with_tensor_core_emulation`] scope, or with `KIMI_BURN_TENSOR_CORES=emulate` outside any
/// [`with_tensor_cores`] scope (which, on or off, overrides the variable as it says).
pub fn tensor_core_emulation() -> bool {
    EMULATION.with(Cell::get).unwrap_or_else(|| {
        TENSOR_CORES.with(Cell::get).is_none()
            && tensor_cores_from_env() == Some(TensorCoresEnv::Emulate)
    })
}

/// What `KIMI_BURN_TENSOR_CORES` asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TensorCoresEnv {
    On,
    Emulate,
}

/// `KIMI_BURN_TENSOR_CORES`, read once: `1` or `true` on, `emulate` emulated, else unset.
fn tensor_cores_from_env() -> Option<TensorCoresEnv> {
    static FROM_ENV: std::sync::OnceLock<Option<TensorCoresEnv>> = std::sync::OnceLock::new();
    *FROM_ENV.get_or_init(
        || match std::env::var("KIMI_BURN_TENSOR_CORES").as_deref() {
            Ok("1" | "true") => Some(TensorCoresEnv::On),
            Ok("emulate") => Some(TensorCoresEnv::Emulate),
            _ => None,
        },
    )
}

/// Runs `f` with the thread's `switch` set to `enabled`, and restores it afterwards (also when
/// `f` panics).
fn with_switch<T>(
    switch: &'static std::thread::LocalKey<Cell<Option<bool>>>,
    enabled: bool,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore(
        &'static std::thread::LocalKey<Cell<Option<bool>>>,
        Option<bool>,
    );
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.with(|s| s.set(self.1));
        }
    }
    let _restore = Restore(switch, switch.with(|s| s.replace(Some(enabled))));
    f()
}

/// Whether the kernels may use the device's matrix units on this thread now: the innermost
/// [`with_tensor_cores`] scope, else `KIMI_BURN_TENSOR_CORES` (`1` or `true`: on; default off).
pub fn tensor_cores_enabled() -> bool {
    TENSOR_CORES
        .with(Cell::get)
        .unwrap_or_else(|| tensor_cores_from_env() == Some(TensorCoresEnv::On))
}

/// How many kernel launches on this thread ran on the matrix units (tensor cores), or on their
/// emulation ([`with_tensor_core_emulation`]).
pub fn tensor_core_launches() -> u64 {
    TENSOR_CORE_LAUNCHES.with(Cell::get)
}

/// Counts one launch on the matrix units ([`tensor_core_launches`]).
pub(crate) fn record_tensor_core_launch() {
    TENSOR_CORE_LAUNCHES.with(|c| c.set(c.get() + 1));
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
    with_switch(&THREAD_SWITCH, enabled, f)
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

/// Hands each gradient of a kernel's custom backward to its parent node; parents that autodiff
/// does not track, and absent gradients, are skipped.
#[cfg(feature = "autodiff")]
pub(crate) fn register_grads<B: Backend>(
    grads: &mut burn::backend::autodiff::grads::Gradients,
    pairs: impl IntoIterator<
        Item = (
            Option<burn::backend::autodiff::NodeId>,
            Option<burn::tensor::ops::FloatTensor<B>>,
        ),
    >,
) {
    for (node, grad) in pairs {
        if let (Some(id), Some(grad)) = (node, grad) {
            grads.register::<B>(id, grad);
        }
    }
}

/// Every kernel family a dispatched backend provides: [`MoeKernels`], [`KdaKernels`],
/// [`AttnResKernels`], [`RmsNormKernels`], [`CrossEntropyKernels`], [`AttentionKernels`],
/// [`OptimKernels`] and [`ActivationKernels`].
pub trait FusedKernels:
    MoeKernels
    + KdaKernels
    + AttnResKernels
    + RmsNormKernels
    + CrossEntropyKernels
    + AttentionKernels
    + OptimKernels
    + ActivationKernels
{
}

impl<B> FusedKernels for B where
    B: MoeKernels
        + KdaKernels
        + AttnResKernels
        + RmsNormKernels
        + CrossEntropyKernels
        + AttentionKernels
        + OptimKernels
        + ActivationKernels
{
}

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
pub(crate) fn on_kernels<B: Backend, O: KernelOp<B>>(op: O) -> Result<O::Output, O> {
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

/// Whether `B` takes the kernel path now (kernels enabled and `B` in the list of [`on_kernels`]).
/// Callers check it before preparing kernel-only inputs (e.g. stacking the expert weights).
pub(crate) fn kernels_available<B: Backend>() -> bool {
    struct Probe;
    impl<B: Backend> KernelOp<B> for Probe {
        type Output = ();
        fn run<K: FusedKernels>(self) {}
    }
    on_kernels::<B, _>(Probe).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks the child process of [`emulate_in_the_environment_yields_to_scopes`].
    const CHILD: &str = "KIMI_BURN_SWITCH_TEST_CHILD";

    /// In a process started with `KIMI_BURN_TENSOR_CORES=emulate`: the emulation is on and the
    /// tensor cores off; a [`with_tensor_cores`] scope, on or off, sets both as it says; a
    /// [`with_tensor_core_emulation`] scope inside it emulates again.
    #[test]
    #[ignore = "the child process of emulate_in_the_environment_yields_to_scopes"]
    fn emulation_from_the_environment() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        assert!(tensor_core_emulation());
        assert!(!tensor_cores_enabled());
        for on in [false, true] {
            with_tensor_cores(on, || {
                assert!(
                    !tensor_core_emulation(),
                    "with_tensor_cores({on}) leaves the emulation on"
                );
                assert_eq!(tensor_cores_enabled(), on);
                with_tensor_core_emulation(|| assert!(tensor_core_emulation()));
            });
        }
        assert!(tensor_core_emulation());
        println!("emulation switches as documented");
    }

    /// The environment's `emulate` is a default that the thread's scopes override, checked in a
    /// child process of this test binary (the variable is read once per process).
    #[test]
    fn emulate_in_the_environment_yields_to_scopes() {
        let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "ops::backend::tests::emulation_from_the_environment",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("KIMI_BURN_TENSOR_CORES", "emulate")
            .output()
            .expect("the child process runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("emulation switches as documented"),
            "the child failed or did not run: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
