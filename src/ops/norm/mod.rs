//! RMS normalisation with f32 statistics (a precision island, design §0).
//!
//! [`rms_norm`] runs a fused kernel (forward and backward, one unit per row) on the CubeCL
//! backends, [`RmsNormKernels`], a host kernel on the CPU backends (f32), and the tensor-op
//! reference elsewhere.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use super::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};
use super::precision::{restore, widen};

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
pub(crate) mod host;

/// `x / sqrt(mean(x², last dim) + eps) · weight`.
///
/// `x: [..., d]`, `weight: [d]`. The statistics are computed in f32 (f64 for f64 inputs) and the
/// result is returned in the input dtype. On the CubeCL backends (f32, f16, bf16 `x`) one kernel
/// computes the norm and one its gradient ([`RmsNormKernels`]); on the CPU backends (f32) a host
/// kernel makes one pass over each row each way; other backends run the tensor ops.
///
/// # Panics
/// When `weight`'s shape is not `[d]`.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let d = dims[D - 1];
    assert!(
        weight.dims() == [d],
        "rms_norm: weight has shape {:?}, expected [{d}] (the last dim of x, {dims:?})",
        weight.dims()
    );
    let rows = dims.iter().product::<usize>() / d.max(1);
    if rows * d > 0
        && backend::host::is_cpu_backend::<B>()
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
    {
        backend::record(FusedOp::RmsNorm, KernelPath::Reference);
        let op = host::RmsNormHost { eps: eps as f32 };
        let inputs = [
            x.into_primitive().tensor(),
            weight.into_primitive().tensor(),
        ];
        return backend::host::run(&op, inputs);
    }
    if backend::kernel_dtype(x.dtype()) && rows * d > 0 && backend::kernels_available::<B>() {
        let op = RmsNormOp {
            x: x.reshape([rows, d]),
            weight,
            eps,
        };
        return match backend::on_kernels::<B, _>(op) {
            Ok(out) => {
                backend::record(FusedOp::RmsNorm, KernelPath::Kernel);
                out.reshape(dims)
            }
            Err(op) => {
                backend::record(FusedOp::RmsNorm, KernelPath::Reference);
                rms_norm_reference(op.x, op.weight, eps).reshape(dims)
            }
        };
    }
    backend::record(FusedOp::RmsNorm, KernelPath::Reference);
    rms_norm_reference(x, weight, eps)
}

/// [`rms_norm`] in tensor ops (any backend, Burn's autodiff).
fn rms_norm_reference<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let (xf, dtype) = widen(x);
    let (w, _) = widen(weight);
    let inv = xf
        .clone()
        .square()
        .mean_dim(D - 1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let normed = xf.mul(inv).mul(w.unsqueeze::<D>());
    restore(normed, dtype)
}

/// Backend extension with the RMSNorm kernels. Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`), for `Fusion` over one and for
/// `Autodiff<B>` over those (fused backward).
pub trait RmsNormKernels: Backend {
    /// [`rms_norm`] of `x: [rows, d]` (f32, f16 or bf16) with `weight: [d]`: returns `[rows, d]` in
    /// `x`'s dtype. Differentiable on autodiff backends with respect to `x` and `weight` (fused
    /// backward).
    fn rms_norm_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;

    /// The fused backward of [`rms_norm_forward`](Self::rms_norm_forward) for `grad: [rows, d]`:
    /// returns `(dx, dweight)` in the dtypes of `x` and `weight`. Not differentiable itself.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// [`RmsNormKernels::rms_norm_forward`] on `Tensor`s.
struct RmsNormOp<B: Backend> {
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    eps: f64,
}

impl<B: Backend> KernelOp<B> for RmsNormOp<B> {
    type Output = Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let x = same::<Tensor<B, 2>, Tensor<K, 2>>(self.x)
            .into_primitive()
            .tensor();
        let w = same::<Tensor<B, 1>, Tensor<K, 1>>(self.weight)
            .into_primitive()
            .tensor();
        let out = K::rms_norm_forward(x, w, self.eps);
        same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(out)))
    }
}
