//! Cross-entropy with an ignore index, the training loss of the causal LM.
//!
//! [`masked_cross_entropy`] runs fused kernels (forward and backward) on the CubeCL backends,
//! [`CrossEntropyKernels`], and the tensor-op reference elsewhere. The kernels never materialise
//! the log-softmax: the forward keeps one f32 per row (the log-sum-exp) and the backward writes
//! the logits' gradient in one pass. They spread each row over several units (one per 64 logits
//! up to 64 units, more past two million logits), so no unit loops past lavapipe's limit and every
//! vocabulary takes them, on wgpu too (the `cross_entropy` module of `kimi-burn-kernels`).

use burn::tensor::activation::log_softmax;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorPrimitive};

use super::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};
use super::precision::{restore, widen};

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod host;

/// Mean cross-entropy over the scored positions, `−(1/N)·Σ_{t: y_t ≠ ignore} log softmax(z_t)[y_t]`.
///
/// - `logits`: `[batch, seq, vocab]`
/// - `targets`: `[batch, seq]`, `ignore_index` where nothing is scored
///
/// The sums run in f32 (f64 for f64 logits). Returns a `[1]` tensor in the logits' dtype; `0` when nothing is scored. A target outside
/// `[0, vocab)` other than `ignore_index` makes the loss NaN (on every path), so a bad batch shows
/// at the next read of the loss instead of as an out-of-bounds read on the device.
///
/// On the CubeCL backends (f32, f16, bf16 logits) two launches compute the per-row losses and one
/// the logits' gradient ([`CrossEntropyKernels`]), with f32 statistics; on the CPU backends (f32
/// logits) a host kernel makes one pass over each row for its log-sum-exp and one backward; other
/// backends run the tensor ops (the log-softmax in the logits' dtype).
///
/// # Panics
/// When `targets` is not `[batch, seq]` of the logits.
pub fn masked_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    ignore_index: i64,
) -> Tensor<B, 1> {
    let [batch, seq, vocab] = logits.dims();
    assert!(
        targets.dims() == [batch, seq],
        "masked_cross_entropy: targets have shape {:?}, the logits {:?}: expected [{batch}, {seq}]",
        targets.dims(),
        [batch, seq, vocab]
    );
    let rows = batch * seq;
    if rows * vocab > 0
        && vocab < 1 << 24
        && ignore_index.unsigned_abs() < 1 << 24
        && backend::host::is_cpu_backend::<B>()
        && logits.dtype() == DType::F32
    {
        backend::record(FusedOp::CrossEntropy, KernelPath::Reference);
        let op = host::CrossEntropyHost {
            ignore: ignore_index,
        };
        // The targets as floats: exact below 2²⁴ in magnitude, as are the classes and the ignore
        // index here; a larger target stays out of range (and so NaN) after the conversion.
        let targets = targets.float().cast(DType::F32);
        let inputs = [
            logits.into_primitive().tensor(),
            targets.into_primitive().tensor(),
        ];
        return backend::host::run(&op, inputs);
    }
    let scored = targets.clone().not_equal_elem(ignore_index);
    // The sums and the count in f32 (f64 stays f64), the result in the logits' dtype.
    let count = widen(scored.clone().float()).0.sum().clamp_min(1.0);
    if backend::kernel_dtype(logits.dtype())
        && rows * vocab > 0
        && i32::try_from(ignore_index).is_ok()
        && backend::kernels_available::<B>()
    {
        let op = CrossEntropyOp {
            logits: logits.reshape([rows, vocab]),
            targets: targets.reshape([rows]),
            ignore: ignore_index as i32,
        };
        match backend::on_kernels::<B, _>(op) {
            Ok(per_row) => {
                backend::record(FusedOp::CrossEntropy, KernelPath::Kernel);
                let (per_row, dtype) = widen(per_row);
                return restore(per_row.sum().div(count), dtype);
            }
            Err(op) => {
                backend::record(FusedOp::CrossEntropy, KernelPath::Reference);
                let logits = op.logits.reshape([batch, seq, vocab]);
                let targets = op.targets.reshape([batch, seq]);
                return reference(logits, targets, scored, count);
            }
        }
    }
    backend::record(FusedOp::CrossEntropy, KernelPath::Reference);
    reference(logits, targets, scored, count)
}

/// [`masked_cross_entropy`] in tensor ops (any backend, Burn's autodiff), given the scored mask
/// and the clamped count of scored positions.
fn reference<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    scored: Tensor<B, 2, burn::tensor::Bool>,
    count: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let [batch, seq, vocab] = logits.dims();
    let invalid = targets
        .clone()
        .lower_elem(0)
        .bool_or(targets.clone().greater_equal_elem(vocab as i64))
        .bool_and(scored.clone())
        .any();
    // Ignored (and invalid) positions gather a class in range and are then zeroed or flagged.
    let safe = targets
        .clamp(0, vocab.max(1) as i64 - 1)
        .reshape([batch, seq, 1]);
    let (picked, dtype) = widen(log_softmax(logits, 2).gather(2, safe).reshape([batch, seq]));
    let loss = picked
        .mul(widen(scored.float()).0)
        .sum()
        .neg()
        .div(count)
        .mask_fill(invalid, f32::NAN);
    restore(loss, dtype)
}

/// Backend extension with the cross-entropy kernels. Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`), for `Fusion` over one and for
/// `Autodiff<B>` over those (fused backward).
pub trait CrossEntropyKernels: Backend {
    /// The per-row losses of `logits: [rows, vocab]` (f32, f16 or bf16) for `targets: [rows]`:
    /// `(loss, lse)`, `loss: [rows]` in the logits' dtype (`lse − z_target`, 0 where the target is
    /// `ignore`, NaN where it is out of range) and `lse: [rows]` f32, each row's log-sum-exp.
    /// `loss` is differentiable on autodiff backends with respect to the logits (fused backward);
    /// `lse` is not.
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The fused backward of [`cross_entropy_forward`](Self::cross_entropy_forward) for the
    /// losses' gradient `grad: [rows]`, from its `lse`: the logits' gradient `[rows, vocab]` in
    /// their dtype. Not differentiable itself.
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        ignore: i32,
    ) -> FloatTensor<Self>;
}

/// [`CrossEntropyKernels::cross_entropy_forward`] on `Tensor`s, returning the per-row losses.
struct CrossEntropyOp<B: Backend> {
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore: i32,
}

impl<B: Backend> KernelOp<B> for CrossEntropyOp<B> {
    /// The per-row losses.
    type Output = Tensor<B, 1>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let logits = same::<Tensor<B, 2>, Tensor<K, 2>>(self.logits)
            .into_primitive()
            .tensor();
        let targets = same::<Tensor<B, 1, Int>, Tensor<K, 1, Int>>(self.targets).into_primitive();
        let (loss, _lse) = K::cross_entropy_forward(logits, targets, self.ignore);
        same(Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(loss)))
    }
}
