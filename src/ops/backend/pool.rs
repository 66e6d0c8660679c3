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
//! A pool thread that finds no work looks for some a few dozen times and then sleeps, and the
//! next op that has work for it wakes it again (a system call, and tens of microseconds on a
//! virtualised machine before it runs). Between the ops of a step that happens hundreds of
//! times: the tiny model's training step woke a pool thread about 200 times. So while a
//! computation of [`on_cpu_pool`] runs, the other pool threads are kept awake: each runs a job
//! that takes whatever work the pool has and otherwise waits without sleeping, until the
//! computation ends or no work came for [`pool_idle_spin`] (10 ms unless
//! [`set_pool_idle_spin`] says otherwise).
//!
//! What the crate keeps per thread (the [`with_kernels`](super::with_kernels) and
//! [`with_tensor_cores`](super::with_tensor_cores) switches, [`kernel_calls`](super::kernel_calls),
//! [`last_path`](super::last_path), [`device_reads`](crate::sync::device_reads),
//! [`eager_checks`](crate::sync::eager_checks), a checkpoint loader's lazy parameters) goes
//! along: the computation sees the caller's switches, and what it records is the caller's
//! afterwards, as if it had run on the caller's thread.

use std::any::TypeId;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

/// Runs `f` on a thread of rayon's global pool, this thread's switches and records with it,
/// the pool's other threads kept awake meanwhile ([`keep_awake`]).
fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    /// Sets the flag when dropped: when `f` returns or panics (then the kept-awake threads leave
    /// and the scope hands the panic on).
    struct SetOnDrop<'a>(&'a AtomicBool);
    impl Drop for SetOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let state = ThreadState::current();
    let done = AtomicBool::new(false);
    let done = &done;
    let (out, records) = rayon::scope(move |scope| {
        let limit = pool_idle_spin();
        if !limit.is_zero() {
            let owner = rayon::current_thread_index();
            for _ in 1..rayon::current_num_threads() {
                scope.spawn(move |_| {
                    keep_awake(done, owner, limit);
                });
            }
        }
        let _done = SetOnDrop(done);
        state.run(f)
    });
    ThreadState::current().merge(&records).install();
    out
}

/// The default of [`pool_idle_spin`], in microseconds.
const DEFAULT_IDLE_SPIN_US: u64 = 10_000;

/// [`pool_idle_spin`] in microseconds.
static IDLE_SPIN_US: AtomicU64 = AtomicU64::new(DEFAULT_IDLE_SPIN_US);

/// How long a pool thread kept awake for a computation of [`on_cpu_pool`] goes on waiting for
/// work after it last found some, before it leaves (and sleeps when idle, as rayon's threads
/// do). 10 ms unless [`set_pool_idle_spin`] was called.
pub fn pool_idle_spin() -> Duration {
    Duration::from_micros(IDLE_SPIN_US.load(Ordering::Relaxed))
}

/// Sets [`pool_idle_spin`] for the whole process; `Duration::ZERO` keeps no thread awake (each
/// op then wakes the sleeping pool threads it has work for, rayon's own behaviour).
///
/// While a computation of [`on_cpu_pool`] runs (a training step, a forward, a decode step), every
/// other thread of rayon's pool runs a job that takes whatever work the pool has and otherwise
/// waits without sleeping, until the computation ends or no work came for this long. Such a
/// thread keeps its core busy while it waits: on a machine shared with other programs, a shorter
/// limit (or none) leaves them more. The results do not depend on it: every op splits its work
/// the same way whichever thread runs each part. On the tiny model, the training step of
/// `train_tiny` took about a tenth less time with the default than with none (BENCHMARKS, "Pool
/// threads kept awake"); a limit of 2 ms gained a third of that, because the thread left during
/// the longer waits of the step and slept from then on.
///
/// ```
/// use std::time::Duration;
/// let before = kimi_burn::ops::backend::pool_idle_spin();
/// kimi_burn::ops::backend::set_pool_idle_spin(Duration::ZERO);
/// assert_eq!(kimi_burn::ops::backend::pool_idle_spin(), Duration::ZERO);
/// kimi_burn::ops::backend::set_pool_idle_spin(before);
/// ```
pub fn set_pool_idle_spin(limit: Duration) {
    let us = u64::try_from(limit.as_micros()).unwrap_or(u64::MAX);
    IDLE_SPIN_US.store(us, Ordering::Relaxed);
}

thread_local! {
    /// Whether this thread runs [`keep_awake`] (further down its stack, for a nested call).
    static KEPT_AWAKE: Cell<bool> = const { Cell::new(false) };
}

/// Why [`keep_awake`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Left {
    /// It ran on the computation's own thread (which took it from its queue while it waited for
    /// a part of its work), where it must not wait.
    Owner,
    /// It ran inside another [`keep_awake`] of this thread (one thread keeps awake once).
    Nested,
    /// The computation ended.
    Done,
    /// No work came for the limit.
    Idle,
}

/// Keeps this pool thread awake for a computation on the pool: runs the pool's pending jobs as
/// they come ([`rayon::yield_now`]: its own queue, the other threads' queues, then jobs from
/// outside the pool) and waits between them without sleeping, until `done` is set or no job came
/// for `limit`.
///
/// It returns at once on the computation's own thread (`owner`), and inside another
/// `keep_awake` of the same thread. Elsewhere the limit also bounds the one case where waiting
/// for `done` would hold the computation up: a pool thread that waits for a part of some other
/// work (a join) runs queued jobs meanwhile, this one among them, and returns to that work only
/// when this returns.
fn keep_awake(done: &AtomicBool, owner: Option<usize>, limit: Duration) -> Left {
    if rayon::current_thread_index() == owner {
        return Left::Owner;
    }
    if KEPT_AWAKE.with(|k| k.replace(true)) {
        return Left::Nested;
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            KEPT_AWAKE.with(|k| k.set(false));
        }
    }
    let _reset = Reset;
    let mut idle_since = None;
    loop {
        if done.load(Ordering::Acquire) {
            return Left::Done;
        }
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() >= limit {
            return Left::Idle;
        }
        for _ in 0..16 {
            std::hint::spin_loop();
        }
    }
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
    reads: [u64; 2],
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
            reads: [0; 2],
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
            reads: [
                self.reads[0] + records.reads[0],
                self.reads[1] + records.reads[1],
            ],
            ..self
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::Tensor;
    use rayon::prelude::*;

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

    /// A pool of two threads of its own, so that no other test's work reaches it.
    fn two_threads() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads")
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn a_thread_is_not_kept_awake_where_waiting_would_hold_the_computation_up() {
        let pool = two_threads();
        let not_done = AtomicBool::new(false);
        // On the computation's own thread: at once, whatever the limit.
        let owner = pool.install(|| keep_awake(&not_done, rayon::current_thread_index(), HOUR));
        assert_eq!(owner, Left::Owner);
        // Inside another keep_awake of the same thread: at once.
        let nested = pool.install(|| {
            KEPT_AWAKE.with(|k| k.set(true));
            let left = keep_awake(&not_done, None, HOUR);
            let still = KEPT_AWAKE.with(|k| k.get());
            KEPT_AWAKE.with(|k| k.set(false));
            (left, still)
        });
        assert_eq!(
            nested,
            (Left::Nested, true),
            "the nested call cleared the outer call's mark"
        );
        // A computation that has ended: at once.
        let ended = AtomicBool::new(true);
        assert_eq!(pool.install(|| keep_awake(&ended, None, HOUR)), Left::Done);
        // No work and no time to wait: it leaves idle, and unmarks its thread.
        let idle = pool.install(|| {
            let left = keep_awake(&not_done, None, Duration::ZERO);
            (left, KEPT_AWAKE.with(|k| k.get()))
        });
        assert_eq!(idle, (Left::Idle, false));
    }

    /// The kept-awake thread runs the computation's work, and leaves when the computation ends
    /// (not at its limit, which is an hour here: the test would hang).
    #[test]
    fn a_kept_awake_thread_takes_the_work_and_leaves_when_the_computation_ends() {
        let pool = two_threads();
        let (done, started) = (AtomicBool::new(false), AtomicBool::new(false));
        let left = std::sync::Mutex::new(None);
        let threads = pool.install(|| {
            let owner = rayon::current_thread_index();
            rayon::scope(|scope| {
                scope.spawn(|_| {
                    started.store(true, Ordering::SeqCst);
                    *left.lock().unwrap() = Some(keep_awake(&done, owner, HOUR));
                });
                // Wait without taking jobs from the pool, so that the other thread takes the
                // kept-awake job (and is then busy with it: the only way it can run any of the
                // work below).
                while !started.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
                let threads: std::collections::BTreeSet<usize> = (0..64)
                    .into_par_iter()
                    .map(|i| {
                        std::thread::sleep(Duration::from_millis(1));
                        i
                    })
                    .map(|_| rayon::current_thread_index().expect("on the pool"))
                    .collect();
                done.store(true, Ordering::Release);
                threads
            })
        });
        assert_eq!(*left.lock().unwrap(), Some(Left::Done));
        assert_eq!(
            threads.len(),
            2,
            "the kept-awake thread took none of the work"
        );
    }

    #[test]
    fn the_idle_spin_limit_is_set_and_read_back() {
        let before = pool_idle_spin();
        assert_eq!(before, Duration::from_micros(DEFAULT_IDLE_SPIN_US));
        set_pool_idle_spin(Duration::from_micros(1500));
        assert_eq!(pool_idle_spin(), Duration::from_micros(1500));
        set_pool_idle_spin(Duration::MAX);
        assert_eq!(pool_idle_spin(), Duration::from_micros(u64::MAX));
        set_pool_idle_spin(before);
    }

    #[test]
    fn only_the_cpu_backends_go_to_the_pool() {
        assert!(is_cpu::<NdArray<f32>>());
        assert!(is_cpu::<Autodiff<NdArray<f64>>>());
        #[cfg(feature = "wgpu")]
        assert!(!is_cpu::<burn::backend::Wgpu>());
    }
}
