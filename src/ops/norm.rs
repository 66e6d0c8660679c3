//! RMS normalisation with f32 statistics (a precision island, design §0).

use burn::tensor::{backend::Backend, Tensor};

use super::precision::{restore, widen};

/// `x / sqrt(mean(x², last dim) + eps) · weight`.
///
/// `x: [..., d]`, `weight: [d]`. The statistics are computed in f32 (f64 for f64 inputs) and the
/// result is returned in the input dtype.
pub fn rms_norm<B: Backend, const D: usize>(
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
