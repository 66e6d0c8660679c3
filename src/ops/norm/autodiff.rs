//! [`RmsNormKernels`] for `Autodiff<B>`: `B`'s forward kernel, tracked with `B`'s fused backward
//! kernel (the shared pair-kernel backward).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::RmsNormKernels;
use crate::ops::backend::autodiff::{pair_backward, pair_forward, PairKernel};
use crate::ops::backend::FusedOp;

/// The RMSNorm kernels as a pair kernel: `(x, weight)`.
#[derive(Debug)]
struct RmsNorm;

impl<B: RmsNormKernels> PairKernel<B> for RmsNorm {
    const BACKWARD: FusedOp = FusedOp::RmsNormBackward;

    fn forward(x: FloatTensor<B>, w: FloatTensor<B>, eps: f64) -> FloatTensor<B> {
        B::rms_norm_forward(x, w, eps)
    }

    fn backward(
        x: FloatTensor<B>,
        w: FloatTensor<B>,
        grad: FloatTensor<B>,
        eps: f64,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        B::rms_norm_backward(x, w, grad, eps)
    }
}

impl<B: RmsNormKernels, C: CheckpointStrategy> RmsNormKernels for Autodiff<B, C> {
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        pair_forward::<B, C, RmsNorm>(x, weight, eps)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        pair_backward::<B, C, RmsNorm>(x, weight, grad, eps)
    }
}
