//! Precision islands (SPEC §0): parts of the model that are computed in f32 even when the model runs
//! in bf16/f16. Tensors already in f32 or f64 are left alone, so f64 gradient checks stay exact.

use burn::tensor::{backend::Backend, DType, FloatDType, Tensor};

use super::cpu::{self, elementwise::Unary};

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

/// The logistic sigmoid `σ(x) = ½·(1 + tanh(x/2))`.
///
/// Written through `tanh` rather than `1/(1+e^{−x})`: it cannot overflow for any `|x|` and it is
/// evaluated in the tensor's own precision (Burn's default `sigmoid` rounds through f32, which
/// would spoil f64 finite-difference checks).
///
/// On the CPU backends an `f32` tensor goes through one host kernel
/// (`cpu::elementwise`) computing the same function.
pub fn sigmoid<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    match cpu::try_run(&Unary::Sigmoid, [x]) {
        Ok(y) => y,
        Err([x]) => x.mul_scalar(0.5).tanh().mul_scalar(0.5).add_scalar(0.5),
    }
}

/// `softplus(x) = log(1 + e^x)`, equal to `x` for `x > 20` (SPEC §4.2), computed without overflow
/// as `max(x, 0) + log1p(e^{−|x|})`.
pub fn softplus<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let tail = x.clone().abs().neg().exp().log1p();
    let linear = x.clone().greater_elem(20.0);
    x.clone().clamp_min(0.0).add(tail).mask_where(linear, x)
}

/// `SiLU(x) = x·σ(x)`, with the precise sigmoid above (one host kernel on the CPU backends).
pub fn silu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    match cpu::try_run(&Unary::Silu, [x]) {
        Ok(y) => y,
        Err([x]) => x.clone().mul(sigmoid(x)),
    }
}
