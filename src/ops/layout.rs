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

use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use crate::ops::backend::host;

/// `x.reshape(shape)`, right on every backend even for a strided view (see the module docs).
///
/// On `NdArray<f32>` (with or without autodiff, host kernels on) an `f32` tensor in standard
/// layout keeps its buffer: Burn 0.21's ndarray backend copies on every reshape.
///
/// # Panics
/// When `shape` holds another number of elements than `x`, as `Tensor::reshape` does.
pub fn reshape<B: Backend, const D: usize, const D2: usize>(
    x: Tensor<B, D>,
    shape: [usize; D2],
) -> Tensor<B, D2> {
    let n = x.shape().num_elements();
    if host::is_ndarray_backend::<B>() && x.dtype() == DType::F32 {
        let m: usize = shape.iter().product();
        assert_eq!(
            m,
            n,
            "reshape of {:?} ({n} elements) to {shape:?} ({m} elements)",
            x.dims()
        );
        let op = host::Reshape {
            shape: shape.to_vec(),
        };
        return match host::run_parts::<B, _, 1>(&op, [x.into_primitive().tensor()]) {
            Ok(mut parts) => Tensor::from_primitive(TensorPrimitive::Float(parts.swap_remove(0))),
            Err(inputs) => host::run(&op, inputs),
        };
    }
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

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tensor};

    use crate::ops::backend::host::read_in_place;
    use crate::ops::with_kernels;

    type B = Autodiff<NdArray<f32>>;

    /// The host path of `reshape`: the same values as Burn's own reshape (also of a strided
    /// view), the gradient reshaped back, and on the plain backend the input's own buffer.
    #[test]
    fn host_reshape_keeps_values_gradients_and_the_buffer() {
        let device = Default::default();
        let x = Tensor::<B, 3>::random([2, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<B, 2>::random([6, 4], Distribution::Normal(0.0, 1.0), &device);
        for strided in [false, true] {
            let input = |x: Tensor<B, 3>| if strided { x.swap_dims(0, 1) } else { x };
            let run = |host: bool| {
                with_kernels(host, || {
                    let xg = x.clone().require_grad();
                    let y: Tensor<B, 2> = super::reshape(input(xg.clone()), [6, 4]);
                    let grads = y.clone().mul(w.clone()).sum().backward();
                    (
                        y.inner().into_data(),
                        xg.grad(&grads).expect("dx").into_data(),
                    )
                })
            };
            let (want, got) = (run(false), run(true));
            assert_eq!(got.0, want.0, "strided {strided}");
            assert_eq!(got.1, want.1, "strided {strided}");
        }
        let plain = x.inner();
        let at = |t: &Tensor<NdArray<f32>, 2>| read_in_place(t, |s| s.as_ptr() as usize);
        let flat: Tensor<NdArray<f32>, 2> =
            with_kernels(true, || super::reshape(plain.clone(), [6, 4]));
        let original = read_in_place(&plain, |s| s.as_ptr() as usize);
        assert!(original.is_some());
        assert_eq!(at(&flat), original, "the reshape shares the buffer");
        assert_eq!(flat.into_data(), plain.clone().reshape([6, 4]).into_data());
        // A strided view on the plain backend: read back in order, then moved into the output.
        let swapped: Tensor<NdArray<f32>, 2> = with_kernels(true, || {
            super::reshape(plain.clone().swap_dims(0, 1), [6, 4])
        });
        assert_eq!(
            swapped.into_data(),
            plain.swap_dims(0, 1).reshape([6, 4]).into_data()
        );
    }
}
