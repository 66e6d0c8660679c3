//! Matrix products of the blocks (`x · W` of every bias-free linear layer and of the router) on
//! the CPU host kernels where the backend has them, Burn's own `matmul` elsewhere.
//!
//! Burn's ndarray backend multiplies on one thread with `matrixmultiply`; the host kernel uses the
//! `gemm` crate (AVX-512 where the CPU has it, rayon's threads for large products) for the forward
//! pass and both products of the backward pass (`dX = dY·Wᵀ`, `dW = Xᵀ·dY`).

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use crate::ops::backend::host::{self, HostArray, HostOp};
use crate::ops::backend::matmul::{matmul as gemm, matmul_new, Layout, MIN_PARALLEL_FLOPS};

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

    /// `(dX, dW) = (dY · Wᵀ, Xᵀ · dY)`, the two products side by side on rayon's pool from
    /// [`MIN_PARALLEL_FLOPS`] multiply-adds each (each also splits itself when it is large): a
    /// small layer's two products each keep one thread busy instead of one after the other.
    fn grads(x: &HostArray, w: &HostArray, grad: &HostArray) -> [HostArray; 2] {
        let (rows, d_in, d_out) = Self::sizes(x, w);
        let dx = || {
            matmul_new(
                &grad.data,
                Layout::Plain,
                &w.data,
                Layout::Transposed,
                [rows, d_out, d_in],
            )
        };
        let dw = || {
            matmul_new(
                &x.data,
                Layout::Transposed,
                &grad.data,
                Layout::Plain,
                [d_in, rows, d_out],
            )
        };
        let (dx, dw) = if rows * d_in * d_out >= MIN_PARALLEL_FLOPS {
            rayon::join(dx, dw)
        } else {
            (dx(), dw())
        };
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

    fn backward(&self, [x, w]: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        Self::grads(x, w, grad)
    }
}

/// `c + x · W` (`x: [.., d_in]`, `W: [d_in, d_out]`, `c` of the output's shape): the product
/// accumulated into `c`, in `c`'s own buffer when nothing else holds it (an untracked call), so a
/// residual or a second branch costs no pass of its own.
#[derive(Debug, Clone)]
struct MatmulAdd;

impl MatmulAdd {
    /// `c + x · W` into `out`, which holds `c` on entry.
    fn accumulate(out: &mut [f32], x: &HostArray, w: &HostArray) {
        let (rows, d_in, d_out) = Matmul::sizes(x, w);
        gemm(
            out,
            &x.data,
            Layout::Plain,
            &w.data,
            Layout::Plain,
            [rows, d_in, d_out],
            true,
        );
    }
}

impl HostOp<3> for MatmulAdd {
    type Saved = ();

    fn forward(&self, [x, w, c]: &[HostArray; 3], save: bool) -> (HostArray, Option<()>) {
        let mut out = c.data.to_vec();
        Self::accumulate(&mut out, x, w);
        let out = HostArray {
            data: out.into(),
            shape: c.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn forward_parts(&self, inputs: [HostArray; 3]) -> Vec<HostArray> {
        let [x, w, mut c] = inputs;
        match c.data.unique_mut() {
            Some(out) => {
                Self::accumulate(out, &x, &w);
                vec![c]
            }
            None => vec![self.forward(&[x, w, c], false).0],
        }
    }

    fn backward(&self, [x, w, _]: &[HostArray; 3], _: &(), grad: &HostArray) -> [HostArray; 3] {
        let [dx, dw] = Matmul::grads(x, w, grad);
        [dx, dw, grad.clone()]
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

/// `linear(layer, x) + c` for a bias-free layer, with the product accumulated into `c` on the CPU
/// host kernels ([`MatmulAdd`]): a residual or a parallel branch added without a pass of its own.
pub(crate) fn linear_add<B: Backend, const D: usize>(
    layer: &Linear<B>,
    x: Tensor<B, D>,
    c: Tensor<B, D>,
) -> Tensor<B, D> {
    let w = layer.weight.val();
    let host = host::is_cpu_backend::<B>()
        && layer.bias.is_none()
        && [x.dtype(), w.dtype(), c.dtype()] == [DType::F32; 3];
    if !host {
        return linear(layer, x).add(c);
    }
    let inputs = [
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
        c.into_primitive().tensor(),
    ];
    match host::run_parts::<B, _, 3>(&MatmulAdd, inputs) {
        Ok(mut parts) => Tensor::from_primitive(TensorPrimitive::Float(parts.swap_remove(0))),
        Err(inputs) => host::run(&MatmulAdd, inputs),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::LinearConfig;
    use burn::tensor::{Distribution, Tensor};

    use burn::module::AutodiffModule;

    use super::{linear, linear_add};
    use crate::ops::backend::host::read_in_place;
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

    /// `linear_add` against Burn's `linear` and `add`: the value (tracked, and untracked where
    /// the product accumulates into the addend's own buffer) and the gradients of all three.
    #[test]
    fn linear_add_matches_linear_then_add_and_its_gradients() {
        let device = Default::default();
        let layer = LinearConfig::new(24, 40)
            .with_bias(false)
            .init::<B>(&device);
        let normal =
            |s: [usize; 3]| Tensor::<B, 3>::random(s, Distribution::Normal(0.0, 1.0), &device);
        let (x, c, dy) = (normal([3, 7, 24]), normal([3, 7, 40]), normal([3, 7, 40]));
        let run = |host: bool| {
            with_kernels(host, || {
                let (x, c) = (x.clone().require_grad(), c.clone().require_grad());
                let y = linear_add(&layer, x.clone(), c.clone());
                let grads = y.clone().mul(dy.clone()).sum().backward();
                let dx = x.grad(&grads).expect("dx");
                let dc = c.grad(&grads).expect("dc");
                let dw = layer.weight.grad(&grads).expect("dW");
                [
                    y.inner().into_data(),
                    dx.into_data(),
                    dc.into_data(),
                    dw.into_data(),
                ]
            })
        };
        let want = with_kernels(false, || {
            let y = layer.forward(x.clone()).add(c.clone());
            let (xg, cg) = (x.clone().require_grad(), c.clone().require_grad());
            let grads = layer
                .forward(xg.clone())
                .add(cg.clone())
                .mul(dy.clone())
                .sum()
                .backward();
            [
                y.inner().into_data(),
                xg.grad(&grads).expect("dx").into_data(),
                cg.grad(&grads).expect("dc").into_data(),
                layer.weight.grad(&grads).expect("dW").into_data(),
            ]
        });
        let tol = burn::tensor::Tolerance::rel_abs(1e-5, 1e-5);
        for got in [run(false), run(true)] {
            for (w, g) in want.iter().zip(&got) {
                g.assert_approx_eq::<f32>(w, tol);
            }
        }
        // Untracked on the plain backend: the addend's buffer is written in place.
        let inner = layer.clone().valid();
        let addend = c.clone().inner().mul_scalar(1.0);
        let at = |t: &Tensor<NdArray<f32>, 3>| read_in_place(t, |s| s.as_ptr() as usize);
        let buffer = at(&addend);
        assert!(buffer.is_some());
        let untracked = with_kernels(true, || linear_add(&inner, x.clone().inner(), addend));
        assert_eq!(at(&untracked), buffer, "written into the addend's buffer");
        untracked.into_data().assert_approx_eq::<f32>(&want[0], tol);
        // An addend that something else still holds is left as it was.
        let held = c.clone().inner();
        let _ = with_kernels(true, || linear_add(&inner, x.clone().inner(), held.clone()));
        assert_eq!(held.into_data(), c.inner().into_data());
    }
}
