//! Precision islands (design §0): parts of the model that are computed in f32 even when the model runs
//! in bf16/f16. Tensors already in f32 or f64 are left alone, so f64 gradient checks stay exact.

use burn::tensor::{backend::Backend, DType, FloatDType, Tensor};

#[cfg(feature = "cubecl-kernels")]
mod fusion;
pub(crate) mod host;
mod kernel;

pub use kernel::ActivationKernels;

use crate::ops::backend::host as cpu;
use host::Unary;

/// Upcasts a half-precision tensor to f32 and returns it with its original dtype, so that
/// [`restore`] can cast the result back. f32 and f64 tensors pass through unchanged.
pub fn widen<B: Backend, const D: usize>(x: Tensor<B, D>) -> (Tensor<B, D>, DType) {
    let dtype = x.dtype();
    match dtype {
        DType::F16 | DType::BF16 | DType::Flex32 => (x.cast(FloatDType::F32), dtype),
        _ => (x, dtype),
    }
}

/// Casts `x` back to `dtype` (the dtype [`widen`] reported) when it differs.
pub fn restore<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        return x;
    }
    match dtype {
        DType::F16 => x.cast(FloatDType::F16),
        DType::BF16 => x.cast(FloatDType::BF16),
        DType::Flex32 => x.cast(FloatDType::Flex32),
        DType::F64 => x.cast(FloatDType::F64),
        _ => x.cast(FloatDType::F32),
    }
}

/// The logistic sigmoid, from `e = e^{−|x|}`: `1/(1 + e)` for `x ≥ 0` and `e/(1 + e)` for `x < 0`.
///
/// Neither branch can overflow, and neither is formed by a subtraction, so the result keeps its
/// relative precision in both tails (`½·(1 + tanh(x/2))` returns rounding noise for σ(−20) ≈ 2e−9,
/// and its gradient `σ·(1 − σ)` cancels). It is evaluated in the tensor's own precision (Burn's
/// default `sigmoid` rounds through f32, which would spoil f64 finite-difference checks), and
/// autodiff through it gives the same cancellation-free derivative.
///
/// On the CPU backends an `f32` tensor goes through one host kernel
/// (`cpu::elementwise`) computing the same function, and on the CubeCL backends (f32, f16, bf16)
/// one kernel forward and one backward ([`ActivationKernels`]).
pub fn sigmoid<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let x = match cpu::try_run(&Unary::Sigmoid, [x]) {
        Ok(y) => return y,
        Err([x]) => x,
    };
    match kernel::try_sigmoid(x) {
        Ok(y) => y,
        Err(x) => {
            crate::ops::backend::record(
                crate::ops::backend::FusedOp::Sigmoid,
                crate::ops::backend::KernelPath::Reference,
            );
            let neg = x.clone().lower_elem(0.0);
            // |x| by a masked negation (not `abs`, whose derivative at 0 is 0).
            let e = x.clone().mask_where(neg.clone(), x.neg()).neg().exp();
            let r = e.clone().add_scalar(1.0).recip();
            r.clone().mask_where(neg, e.mul(r))
        }
    }
}

/// Below this `|x|` the f32 [`tanh`] is its odd Taylor polynomial up to `x⁹` (truncation error
/// below 1e−8 relative), where `(1 − e^{−2|x|})/(1 + e^{−2|x|})` would cancel.
const TANH_SERIES_BELOW: f64 = 0.25;

/// `tanh(x)` without cancellation or overflow: `sign(x)·(1 − e)/(1 + e)` with `e = e^{−2|x|}`, and an
/// odd polynomial near 0 in f32 (f64 tensors use the backend's own `tanh` there, exact to f64).
///
/// Autodiff through this form gives `1 − tanh²(x) = 4e/(1 + e)²` as a product, so the derivative
/// keeps its relative precision where `tanh` has saturated to ±1 (the backend's `tanh` backward
/// forms `1 − t²`, which is 0 there). The same function as the CubeCL kernels' and the CPU host
/// kernels' `tanh` (docs/design.md, "Numerics of the activations"); on the CPU backends an `f32`
/// tensor goes through one host kernel forward and one backward, computing it through `expm1`
/// (accurate near 0 without the polynomial).
pub fn tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let x = match cpu::try_run(&Unary::SoftCap(1.0), [x]) {
        Ok(y) => return y,
        Err([x]) => x,
    };
    let neg = x.clone().lower_elem(0.0);
    let small = x.clone().abs().lower_elem(TANH_SERIES_BELOW);
    // Each branch sees only inputs where it is used (others are set to a harmless value), so no
    // infinity or NaN from the unused branch can reach the gradient.
    let a = x.clone().mask_where(neg.clone(), x.clone().neg());
    let large_a = a.clone().mask_fill(small.clone(), 1.0);
    let e = large_a.mul_scalar(-2.0).exp();
    let large = e.clone().neg().add_scalar(1.0).div(e.add_scalar(1.0));
    let near_zero = x.clone().mask_fill(small.clone().bool_not(), 0.0);
    let series = if x.dtype() == DType::F64 {
        near_zero.tanh()
    } else {
        let z2 = near_zero.clone().square();
        let p = z2
            .clone()
            .mul_scalar(62.0 / 2835.0)
            .add_scalar(-17.0 / 315.0);
        let p = p.mul(z2.clone()).add_scalar(2.0 / 15.0);
        let p = p.mul(z2.clone()).add_scalar(-1.0 / 3.0);
        near_zero.clone().add(near_zero.mul(z2).mul(p))
    };
    let signed = large.clone().mask_where(neg, large.neg());
    signed.mask_where(small, series)
}

/// `softplus(x) = log(1 + e^x)`, equal to `x` for `x > 20` (design §4.2), computed without overflow
/// as `max(x, 0) + log1p(e^{−|x|})` (one host kernel each way on the CPU backends, for `f32`).
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let x = match cpu::try_run(&Unary::Softplus, [x]) {
        Ok(y) => return y,
        Err([x]) => x,
    };
    let tail = x.clone().abs().neg().exp().log1p();
    let linear = x.clone().greater_elem(host::SOFTPLUS_LINEAR);
    x.clone().clamp_min(0.0).add(tail).mask_where(linear, x)
}

/// `SiLU(x) = x·σ(x)`, with the precise sigmoid above (one host kernel on the CPU backends).
pub fn silu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    match cpu::try_run(&Unary::Silu, [x]) {
        Ok(y) => y,
        Err([x]) => x.clone().mul(sigmoid(x)),
    }
}
