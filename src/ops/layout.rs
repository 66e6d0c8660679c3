//! Shape changes that are right on every backend.
//!
//! Burn 0.21's CubeCL backends (wgpu, CUDA) reshape a strided view without copying when they judge
//! that the reshape only splits dimensions, and compute the new strides wrong when the view's last
//! dimension has size 1 with a stride other than 1 (`burn-std`'s `split_strides` never steps over
//! the old unit dimension, so the next dimension inherits its stride). `unsqueeze_dim` is such a
//! reshape: `[[1, 2]]` → `swap_dims(0, 1)` → `unsqueeze_dim(2)` reads back `[1, 0]` on wgpu instead
//! of `[1, 2]`. NdArray is not affected. The test `layout::broadcast_over_swapped_unit_dims` pins the
//! upstream behaviour and these helpers.
//!
//! The helpers flatten first: a rank-lowering reshape of a strided view is always copied into
//! contiguous memory, and a contiguous tensor is then reshaped by its strides alone. On a tensor
//! that is already contiguous both steps only change metadata.

use burn::tensor::{backend::Backend, Tensor};

/// `x.reshape(shape)`, right on every backend even for a strided view (see the module docs).
pub fn reshape<B: Backend, const D: usize, const D2: usize>(
    x: Tensor<B, D>,
    shape: [usize; D2],
) -> Tensor<B, D2> {
    let n = x.shape().num_elements();
    x.reshape([n]).reshape(shape)
}

/// `x.unsqueeze_dim(dim)`, right on every backend even for a strided view (see the module docs).
pub fn unsqueeze_dim<B: Backend, const D: usize, const D2: usize>(
    x: Tensor<B, D>,
    dim: usize,
) -> Tensor<B, D2> {
    assert!(
        D2 == D + 1 && dim <= D,
        "unsqueeze_dim: cannot insert dim {dim} into a rank-{D} tensor to make rank {D2}"
    );
    let dims = x.dims();
    let mut shape = [1; D2];
    shape[..dim].copy_from_slice(&dims[..dim]);
    shape[dim + 1..].copy_from_slice(&dims[dim..]);
    reshape(x, shape)
}
