//! Whole computations on rayon's pool, for the CPU backends.
//!
//! The host kernels split their work over rayon's global pool. Called from a thread outside the
//! pool (a program's main thread), every such op hands its work to the pool and the caller sleeps
//! until it is done: two thread wake-ups per op, which on the tiny model cost more than many of
//! the ops themselves (a decode step runs a few hundred of them). Run from a pool thread, the same
//! op pushes its parts onto that thread's own queue, works on them itself, and the other pool
//! threads take what they can. [`on_cpu_pool`] moves a whole forward, decode step or training
//! step onto the pool that way.
//!
//! What the crate keeps per thread (the [`with_kernels`](super::with_kernels) and
//! [`with_tensor_cores`](super::with_tensor_cores) switches, [`kernel_calls`](super::kernel_calls),
//! [`last_path`](super::last_path), [`device_reads`](crate::sync::device_reads),
//! [`eager_checks`](crate::sync::eager_checks), a checkpoint loader's lazy parameters) goes
//! along: the computation sees the caller's switches, and what it records is the caller's
//! afterwards, as if it had run on the caller's thread.

use std::any::TypeId;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::backend::Backend;

use super::PathState;

/// Runs `f` on rayon's global thread pool when `B` is a CPU backend (`NdArray` or `Flex`, also
/// under `Autodiff`), and on this thread otherwise; returns its result.
///
/// The crate's own entry points already do this ([`KimiForCausalLM::try_forward`], and so
/// [`generate`] and every forward of the model; the forwards of the MLA, KDA and LatentMoe
/// layers; [`accumulate_gradients`]; the [`KimiOptimizer`]'s step). Wrap a training step of your
/// own in it, forward and backward together, when it calls the crate's modules and ops directly:
/// on a small model a step with its ops called from outside the pool took about a fifth longer,
/// a cached decode about half longer (BENCHMARKS, "The whole step on the pool").
///
/// ```
/// # use burn::backend::{Autodiff, NdArray};
/// # use burn::tensor::Tensor;
/// type B = Autodiff<NdArray<f32>>;
/// let device = Default::default();
/// let x = Tensor::<B, 2>::ones([4, 4], &device).require_grad();
/// let weight = Tensor::<B, 1>::ones([4], &device);
/// let grads = kimi_burn::ops::backend::on_cpu_pool::<B, _>(|| {
///     let loss = kimi_burn::ops::norm::rms_norm(x.clone(), weight, 1e-6).sum();
///     loss.backward()
/// });
/// assert!(x.grad(&grads).is_some());
/// ```
///
/// Nothing changes in the results: every op splits its work the same way on any thread. The
/// caller's per-thread switches and records travel with `f` (see the module docs). When `f`
/// runs on a pool thread already, or another thread's computation is on the pool through this
/// function at the time, `f` runs right here: one whole computation on the pool at a time, so
/// that a pool thread that waits for its parts never picks up a second one (with the first one's
/// autodiff graph locked on its stack). With a pool of one thread `f` runs right here too: a
/// computation on the pool may wait for another thread's (a collective operation of data
/// parallelism, say), and that thread's ops need a pool thread left to run on.
///
/// [`KimiForCausalLM::try_forward`]: crate::model::KimiForCausalLM::try_forward
/// [`generate`]: crate::model::KimiForCausalLM::generate
/// [`accumulate_gradients`]: crate::train::accumulate_gradients
/// [`KimiOptimizer`]: crate::optim::KimiOptimizer
pub fn on_cpu_pool<B: Backend, R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if !is_cpu::<B>() || rayon::current_thread_index().is_some() || rayon::current_num_threads() < 2
    {
        return f();
    }
    let Some(_claim) = Claim::take() else {
        return f();
    };
    in_pool(f)
}

/// `rayon::join(a, b)`, with the caller's per-thread switches and records carried into both
/// (from outside the pool, both run on pool threads; from a pool thread, `a` runs on it and `b`
/// wherever a pool thread takes it).
pub(crate) fn join<RA: Send, RB: Send>(
    a: impl FnOnce() -> RA + Send,
    b: impl FnOnce() -> RB + Send,
) -> (RA, RB) {
    let both = move || {
        let state = ThreadState::current();
        let (ra, (rb, records)) = rayon::join(a, move || state.run(b));
        ThreadState::current().merge(&records).install();
        (ra, rb)
    };
    if rayon::current_thread_index().is_some() {
        both()
    } else {
        in_pool(both)
    }
}

/// Runs `f` on a thread of rayon's global pool, this thread's switches and records with it.
fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let state = ThreadState::current();
    let (out, records) = rayon::scope(move |_| state.run(f));
    ThreadState::current().merge(&records).install();
    out
}

/// Whether `B` computes on the host: its device is the ndarray or flex device (also under
/// `Autodiff`, whose device is its inner backend's).
fn is_cpu<B: Backend>() -> bool {
    let device = TypeId::of::<B::Device>();
    #[cfg(feature = "ndarray")]
    if device == TypeId::of::<burn::backend::ndarray::NdArrayDevice>() {
        return true;
    }
    #[cfg(feature = "flex")]
    if device == TypeId::of::<burn::backend::flex::FlexDevice>() {
        return true;
    }
    let _ = device;
    false
}

/// Set while a computation of [`on_cpu_pool`] is on the pool.
static ON_POOL: AtomicBool = AtomicBool::new(false);

/// The pool taken for one computation; given back when dropped (also on a panic).
struct Claim;

impl Claim {
    fn take() -> Option<Self> {
        (!ON_POOL.swap(true, Ordering::Acquire)).then_some(Claim)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        ON_POOL.store(false, Ordering::Release);
    }
}

/// What the crate keeps per thread.
#[derive(Clone, Copy)]
struct ThreadState {
    paths: PathState,
    reads: u64,
    eager: Option<bool>,
    skeleton: bool,
}

impl ThreadState {
    fn current() -> Self {
        let (reads, eager) = crate::sync::thread_state();
        Self {
            paths: PathState::current(),
            reads,
            eager,
            skeleton: crate::nn::in_skeleton(),
        }
    }

    fn install(self) {
        self.paths.install();
        crate::sync::set_thread_state((self.reads, self.eager));
        crate::nn::set_skeleton(self.skeleton);
    }

    /// Runs `f` on this thread with the switches of `self` (the caller's) and nothing recorded
    /// yet; returns its result and what it recorded. This thread's own state is back afterwards
    /// (also on a panic).
    fn run<R>(self, f: impl FnOnce() -> R) -> (R, Self) {
        struct Restore(ThreadState);
        impl Drop for Restore {
            fn drop(&mut self) {
                self.0.install();
            }
        }
        let _restore = Restore(Self::current());
        Self {
            paths: self.paths.switches_only(),
            reads: 0,
            ..self
        }
        .install();
        let out = f();
        (out, Self::current())
    }

    /// This state with what `records` recorded added (switches unchanged).
    fn merge(self, records: &Self) -> Self {
        Self {
            paths: self.paths.merge(&records.paths),
            reads: self.reads + records.reads,
            ..self
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::Tensor;

    use super::*;
    use crate::ops::backend::{kernel_calls, kernels_enabled, last_path, record, with_kernels};
    use crate::ops::{FusedOp, KernelPath};
    use crate::sync::{count_reads, eager_checks, set_eager_checks};

    /// One op's record and one device read, as an op would make them.
    fn an_op() {
        record(FusedOp::Sigmoid, KernelPath::Kernel);
        let t = Tensor::<NdArray<f32>, 1>::from_floats([1.0], &Default::default());
        crate::sync::read(t);
    }

    #[test]
    fn work_on_the_pool_sees_the_callers_switches_and_records_for_the_caller() {
        let before = kernel_calls(FusedOp::Sigmoid);
        set_eager_checks(!eager_checks());
        let eager = eager_checks();
        let ((on_pool, enabled, eager_there), reads) = count_reads(|| {
            with_kernels(false, || {
                in_pool(|| {
                    an_op();
                    an_op();
                    (
                        rayon::current_thread_index().is_some(),
                        kernels_enabled(),
                        eager_checks(),
                    )
                })
            })
        });
        assert!(on_pool, "the closure ran outside the pool");
        assert!(
            !enabled,
            "the caller's with_kernels(false) did not reach the pool"
        );
        assert_eq!(
            eager_there, eager,
            "the caller's eager checks did not reach the pool"
        );
        assert_eq!(
            reads, 2,
            "the pool's device reads were not counted for the caller"
        );
        assert_eq!(kernel_calls(FusedOp::Sigmoid), before + 2);
        assert_eq!(last_path(FusedOp::Sigmoid), Some(KernelPath::Kernel));
    }

    /// Also when the second half runs on the thread of the first (nobody took it), where it
    /// must leave the first half's records in place.
    #[test]
    fn both_halves_of_a_join_record_for_the_caller() {
        let before = kernel_calls(FusedOp::Sigmoid);
        let ((a, b), reads) = count_reads(|| {
            with_kernels(false, || {
                join(
                    || {
                        an_op();
                        kernels_enabled()
                    },
                    || {
                        an_op();
                        an_op();
                        kernels_enabled()
                    },
                )
            })
        });
        assert!(!a && !b, "a half of the join missed the caller's switch");
        assert_eq!(reads, 3);
        assert_eq!(kernel_calls(FusedOp::Sigmoid), before + 3);
    }

    #[test]
    fn a_panic_on_the_pool_reaches_the_caller_and_frees_the_pool() {
        let caught = std::panic::catch_unwind(|| {
            on_cpu_pool::<NdArray<f32>, _>(|| panic!("inside"));
        });
        assert!(caught.is_err());
        // Another test thread may hold the pool for one of its computations at this moment:
        // wait until nobody does (a leaked claim never frees).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let free = loop {
            if Claim::take().is_some() {
                break true;
            }
            if std::time::Instant::now() > deadline {
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert!(free, "the pool stayed claimed after a panic");
    }

    #[test]
    fn only_the_cpu_backends_go_to_the_pool() {
        assert!(is_cpu::<NdArray<f32>>());
        assert!(is_cpu::<Autodiff<NdArray<f64>>>());
        #[cfg(feature = "wgpu")]
        assert!(!is_cpu::<burn::backend::Wgpu>());
    }
}
