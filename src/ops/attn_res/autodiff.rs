//! [`AttnResKernels`] for `Autodiff<B>`: `B`'s forward kernel, tracked with `B`'s fused backward
//! kernel (the shared pair-kernel backward).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::AttnResKernels;
use crate::ops::backend::autodiff::{pair_backward, pair_forward, PairKernel};
use crate::ops::backend::FusedOp;

/// The Attention Residuals kernels as a pair kernel: `(v, query)`.
#[derive(Debug)]
struct AttnRes;

impl<B: AttnResKernels> PairKernel<B> for AttnRes {
    const BACKWARD: FusedOp = FusedOp::AttnResBackward;

    fn forward(v: FloatTensor<B>, q: FloatTensor<B>, eps: f64) -> FloatTensor<B> {
        B::attn_res_forward(v, q, eps)
    }

    fn backward(
        v: FloatTensor<B>,
        q: FloatTensor<B>,
        grad: FloatTensor<B>,
        eps: f64,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        B::attn_res_backward(v, q, grad, eps)
    }
}

impl<B: AttnResKernels, C: CheckpointStrategy> AttnResKernels for Autodiff<B, C> {
    fn attn_res_forward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        pair_forward::<B, C, AttnRes>(v, query, eps)
    }

    fn attn_res_backward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        pair_backward::<B, C, AttnRes>(v, query, grad, eps)
    }
}
