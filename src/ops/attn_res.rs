//! Attention Residuals (design §6): a softmax mix over depth replacing the residual sum.

use burn::tensor::activation::softmax;
use burn::tensor::{backend::Backend, Tensor};

use super::precision::{restore, widen};

/// The block-form AttnRes mix of design §6, in f32 (f64 stays f64):
///
/// ```text
/// V = [blocks…, partial];   K_n = V_n / sqrt(mean_d(V_n²) + eps)
/// score_n = Σ_d K_n[d]·w_norm[d]·w_proj[d];   P = softmax_n(score);   out = Σ_n P_n·V_n
/// ```
///
/// Each source is `[B, T, d]`; the scores and the softmax are per token, over the `N =
/// blocks.len() + 1` sources. `w_norm` is the gain of the RMSNorm that makes the keys, `w_proj`
/// the pseudo-query (`[d]` each). With `w_proj = 0` the result is the mean of the sources. The
/// result has `partial`'s dtype.
///
/// # Panics
/// When a block's shape differs from `partial`'s or a vector's length is not `d`.
pub fn attn_res<B: Backend>(
    partial: Tensor<B, 3>,
    blocks: &[Tensor<B, 3>],
    w_proj: Tensor<B, 1>,
    w_norm: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, 3> {
    let dims = partial.dims();
    let d = dims[2];
    for (i, b) in blocks.iter().enumerate() {
        assert!(
            b.dims() == dims,
            "attn_res: block {i} has shape {:?}, the partial sum {dims:?}",
            b.dims()
        );
    }
    for (what, w) in [("w_proj", &w_proj), ("w_norm", &w_norm)] {
        assert!(
            w.dims() == [d],
            "attn_res: {what} has shape {:?}, expected [{d}]",
            w.dims()
        );
    }
    let (partial, dtype) = widen(partial);
    let sources: Vec<Tensor<B, 3>> = blocks
        .iter()
        .map(|b| widen(b.clone()).0)
        .chain([partial])
        .collect();
    let v = Tensor::stack::<4>(sources, 0); // [N, B, T, d]
                                            // Σ_d K·(w_norm⊙w_proj) = (Σ_d V·w_norm⊙w_proj) / rms(V): K itself is never materialised.
    let query = widen(w_norm).0.mul(widen(w_proj).0).reshape([1, 1, 1, d]);
    let inv_rms = v
        .clone()
        .square()
        .mean_dim(3)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let scores = v.clone().mul(query).sum_dim(3).mul(inv_rms); // [N, B, T, 1]
    let p = softmax(scores, 0);
    restore(v.mul(p).sum_dim(0).squeeze_dim(0), dtype)
}
