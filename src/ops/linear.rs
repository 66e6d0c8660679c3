//! Matrix products of the blocks (`x · W` of every bias-free linear layer and of the router) on
//! the CPU host kernels where the backend has them, Burn's own `matmul` elsewhere.
//!
//! Burn's ndarray backend multiplies on one thread with `matrixmultiply`; the host kernel uses the
//! `gemm` crate (AVX-512 where the CPU has it, rayon's threads for large products) for the forward
//! pass and both products of the backward pass (`dX = dY·Wᵀ`, `dW = Xᵀ·dY`).

use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType, Tensor};

use crate::ops::backend::host::{self, HostArray, HostOp};
use crate::ops::backend::matmul::{matmul_new, Layout};

/// `y = x · W` for `x: [.., d_in]` (any rank: its leading dims are the rows), `W: [d_in, d_out]`;
/// `y: [.., d_out]`. Taking and giving the full shapes spares two reshapes, each a copy on
/// Burn's ndarray backend.
#[derive(Debug, Clone)]
struct Matmul;

impl Matmul {
    /// `(rows, d_in, d_out)`.
    fn sizes(x: &HostArray, w: &HostArray) -> (usize, usize, usize) {
        let d_in = w.shape[0];
        (x.data.len() / d_in.max(1), d_in, w.shape[1])
    }
}

impl HostOp<2> for Matmul {
    type Saved = ();

    fn forward(&self, inputs: &[HostArray; 2], save: bool) -> (HostArray, Option<()>) {
        let [x, w] = inputs;
        let (rows, d_in, d_out) = Self::sizes(x, w);
        let mut shape = x.shape.clone();
        *shape
            .last_mut()
            .unwrap_or_else(|| unreachable!("x has a last dim")) = d_out;
        let y = matmul_new(
            &x.data,
            Layout::Plain,
            &w.data,
            Layout::Plain,
            [rows, d_in, d_out],
        );
        let y = HostArray {
            data: y.into(),
            shape,
        };
        (y, save.then_some(()))
    }

    fn backward(&self, inputs: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        let [x, w] = inputs;
        let (rows, d_in, d_out) = Self::sizes(x, w);
        let dx = matmul_new(
            &grad.data,
            Layout::Plain,
            &w.data,
            Layout::Transposed,
            [rows, d_out, d_in],
        );
        let dw = matmul_new(
            &x.data,
            Layout::Transposed,
            &grad.data,
            Layout::Plain,
            [d_in, rows, d_out],
        );
        [
            HostArray {
                data: dx.into(),
                shape: x.shape.clone(),
            },
            HostArray {
                data: dw.into(),
                shape: w.shape.clone(),
            },
        ]
    }
}

/// `x · w` over the last dim of `x` (`w: [d_in, d_out]`): the host kernel on a CPU backend with
/// f32 tensors, `matmul` otherwise.
pub(crate) fn matmul_last<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
) -> Tensor<B, D> {
    let host = host::is_cpu_backend::<B>() && x.dtype() == DType::F32 && w.dtype() == DType::F32;
    if !host {
        return x.matmul(w.unsqueeze());
    }
    host::run(
        &Matmul,
        [x.into_primitive().tensor(), w.into_primitive().tensor()],
    )
}

/// A linear layer applied to `x` (its last dim): `x · W (+ b)`, by [`matmul_last`].
pub(crate) fn linear<B: Backend, const D: usize>(
    layer: &Linear<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if !host::is_cpu_backend::<B>() {
        return layer.forward(x);
    }
    let y = matmul_last(x, layer.weight.val());
    match &layer.bias {
        Some(b) => y.add(b.val().unsqueeze()),
        None => y,
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tensor};

    use super::linear;
    use crate::ops::with_kernels;

    type B = Autodiff<NdArray<f32>>;

    #[test]
    fn the_host_kernel_matches_burns_linear_and_its_gradients() {
        let device = Default::default();
        for bias in [false, true] {
            let layer = LinearConfig::new(24, 40).with_bias(bias).init::<B>(&device);
            let x = Tensor::<B, 3>::random([3, 7, 24], Distribution::Normal(0.0, 1.0), &device);
            let dy = Tensor::<B, 3>::random([3, 7, 40], Distribution::Normal(0.0, 1.0), &device);
            let run = |host: bool| {
                with_kernels(host, || {
                    let x = x.clone().require_grad();
                    let y = linear(&layer, x.clone());
                    let grads = y.clone().mul(dy.clone()).sum().backward();
                    let dx = x.grad(&grads).expect("dx");
                    let dw = layer.weight.grad(&grads).expect("dW");
                    [y.inner().into_data(), dx.into_data(), dw.into_data()]
                })
            };
            let (want, got) = (run(false), run(true));
            for (w, g) in want.iter().zip(&got) {
                g.assert_approx_eq::<f32>(w, burn::tensor::Tolerance::rel_abs(1e-5, 1e-5));
            }
        }
    }
}
