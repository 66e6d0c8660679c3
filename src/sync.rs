//! Device-to-host reads, counted, and the checks that would need one.
//!
//! On a GPU a read drains the device's queue: the host waits until every kernel launched before
//! it has finished, and nothing new is queued meanwhile. A training step on the kernel path makes
//! none in its forward and backward (the routing, the QB histogram, the expert loads and the
//! padding mask stay on the device); the model's balance update reads the accumulated counts of
//! all its MoE layers in one read per optimiser step.
//!
//! Every read the crate makes goes through one function that counts it, per thread
//! ([`device_reads`], [`count_reads`]); the crate's lint configuration forbids the tensor read
//! methods anywhere else, so the count sees them all. Reads of `NdArray` tensors the host
//! kernels borrow in place are not reads of a device and are not counted.
//!
//! Checks of values (NaN router scores, token ids out of range) need a read. They run when
//! [`eager_checks`] is on: by default in debug builds only, switchable per thread with
//! [`set_eager_checks`]. With them off, a NaN score propagates to the routing weights and the
//! loss, and an out-of-range token id gives an undefined embedding row (on the GPU backends) or
//! a panic of the backend's gather (on the CPU backends), instead of an [`Error`](crate::Error)
//! naming the value.

use std::cell::Cell;

use burn::tensor::{backend::Backend, BasicOps, Tensor, TensorData};

thread_local! {
    static READS: Cell<u64> = const { Cell::new(0) };
    static READ_BYTES: Cell<u64> = const { Cell::new(0) };
    static EAGER: Cell<Option<bool>> = const { Cell::new(None) };
}

/// The number of device-to-host reads the crate has made on this thread so far.
pub fn device_reads() -> u64 {
    READS.with(Cell::get)
}

/// The number of bytes the crate's device-to-host reads have brought back on this thread so far
/// (a generation step on a GPU backend reads its `[batch]` token ids: a few bytes, not the
/// `[batch, vocab]` logits).
pub fn device_read_bytes() -> u64 {
    READ_BYTES.with(Cell::get)
}

/// Runs `f` and returns its result with the number of device-to-host reads the crate made on
/// this thread meanwhile.
pub fn count_reads<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = device_reads();
    let out = f();
    (out, device_reads() - before)
}

/// Whether checks that need a device read run on this thread: [`set_eager_checks`]'s value, or
/// else `true` in debug builds and `false` in release builds.
pub fn eager_checks() -> bool {
    EAGER.with(Cell::get).unwrap_or(cfg!(debug_assertions))
}

/// Switches the checks that need a device read on or off for this thread (see the module docs
/// for what they are and what happens without them).
pub fn set_eager_checks(on: bool) {
    EAGER.with(|e| e.set(Some(on)));
}

/// This thread's read count and [`eager_checks`] setting, as the pool carries them between a
/// caller and the pool thread that runs its work.
pub(crate) fn thread_state() -> ([u64; 2], Option<bool>) {
    (
        [READS.with(Cell::get), READ_BYTES.with(Cell::get)],
        EAGER.with(Cell::get),
    )
}

/// Makes `([reads, bytes], eager)` this thread's state (see [`thread_state`]).
pub(crate) fn set_thread_state(([reads, bytes], eager): ([u64; 2], Option<bool>)) {
    READS.with(|c| c.set(reads));
    READ_BYTES.with(|c| c.set(bytes));
    EAGER.with(|c| c.set(eager));
}

/// Reads a tensor back to the host, counting the read. The one place the crate calls
/// `into_data`.
pub(crate) fn read<B: Backend, const D: usize, K: BasicOps<B>>(t: Tensor<B, D, K>) -> TensorData {
    READS.with(|c| c.set(c.get() + 1));
    #[allow(clippy::disallowed_methods)]
    let data = t.into_data();
    READ_BYTES.with(|c| c.set(c.get() + data.as_bytes().len() as u64));
    data
}

/// Reads a one-element tensor back as `f64` (NaN for an empty one), counting the read.
pub(crate) fn read_scalar<B: Backend, K: BasicOps<B>>(t: Tensor<B, 1, K>) -> f64 {
    read(t).iter::<f64>().next().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn reads_are_counted_per_thread() {
        let t = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 2.0], &Default::default());
        let bytes = device_read_bytes();
        let (data, n) = count_reads(|| read(t.clone()));
        assert_eq!(n, 1);
        assert_eq!(device_read_bytes() - bytes, 8, "two f32");
        assert_eq!(data.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        let other = std::thread::spawn(move || {
            read(t);
            device_reads()
        });
        let (_, here) = count_reads(|| other.join().unwrap());
        assert_eq!(here, 0, "a read on another thread counts there");
    }

    #[test]
    fn eager_checks_switch_per_thread() {
        assert_eq!(eager_checks(), cfg!(debug_assertions));
        set_eager_checks(!cfg!(debug_assertions));
        assert_eq!(eager_checks(), !cfg!(debug_assertions));
        let other = std::thread::spawn(eager_checks).join().unwrap();
        assert_eq!(other, cfg!(debug_assertions));
    }
}
