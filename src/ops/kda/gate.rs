//! The KDA forget gate and the gated output norm (design §4.2).

use burn::tensor::{backend::Backend, DType, Tensor};

use super::gate_host::KdaGateHost;
use super::kernels::NormGatedOp;
use crate::error::{Error, Result};
use crate::ops::backend::{self, FusedOp, KernelPath};
use crate::ops::norm::host::RmsNormGatedHost;
use crate::ops::norm::rms_norm;
use crate::ops::precision::{restore, sigmoid, softplus, widen};

/// The per-channel log decay of KDA (design §4.2), computed in f32 (f64 for f64 inputs):
///
/// ```text
/// g = −exp(A_log[h]) · softplus(f + dt_bias)              (lower_bound = None)
/// g = lb · σ(exp(A_log[h]) · (f + dt_bias))              (lower_bound = Some(lb), "safe gate")
/// ```
///
/// `f: [B, T, H, K]` (the output of `f_b_proj`, split into heads), `a_log: [H]`,
/// `dt_bias: [H·K]` (head-major, as in the checkpoint) → `g: [B, T, H, K]`, every value ≤ 0, in
/// f32 whatever the input dtype (the ops consume it in f32). The safe gate keeps `g ∈ (lb, 0)`.
///
/// On the CPU backends (f32 inputs) one host pass forward and one backward with the derived
/// gradients; elsewhere tensor ops.
///
/// # Panics
/// On invalid input; see [`try_kda_gate`].
pub fn kda_gate<B: Backend>(
    f: Tensor<B, 4>,
    a_log: Tensor<B, 1>,
    dt_bias: Tensor<B, 1>,
    lower_bound: Option<f32>,
) -> Tensor<B, 4> {
    try_kda_gate(f, a_log, dt_bias, lower_bound).unwrap_or_else(|e| panic!("{e}"))
}

/// [`kda_gate`], reporting an `a_log` that is not `[H]`, a `dt_bias` that is not `[H·K]` and a
/// lower bound outside `[−5, 0)`.
pub fn try_kda_gate<B: Backend>(
    f: Tensor<B, 4>,
    a_log: Tensor<B, 1>,
    dt_bias: Tensor<B, 1>,
    lower_bound: Option<f32>,
) -> Result<Tensor<B, 4>> {
    let [_, _, h, k] = f.dims();
    if a_log.dims() != [h] {
        return Err(Error::shape("a_log", format!("[H] = [{h}]"), a_log.dims()));
    }
    if dt_bias.dims() != [h * k] {
        return Err(Error::shape(
            "dt_bias",
            format!("[H·K] = [{}]", h * k),
            dt_bias.dims(),
        ));
    }
    if let Some(lb) = lower_bound {
        if !(-5.0..0.0).contains(&lb) {
            return Err(Error::argument(
                "lower_bound",
                format!("the safe-gate lower bound must lie in [-5, 0), got {lb}"),
            ));
        }
    }
    if backend::host::is_cpu_backend::<B>()
        && [f.dtype(), a_log.dtype(), dt_bias.dtype()] == [DType::F32; 3]
    {
        // One host pass each way (`gate_host`).
        let inputs = [
            f.into_primitive().tensor(),
            a_log.into_primitive().tensor(),
            dt_bias.into_primitive().tensor(),
        ];
        return Ok(backend::host::run(&KdaGateHost { lower_bound }, inputs));
    }
    let (f, _) = widen(f);
    let x = f.add(widen(dt_bias).0.reshape([1, 1, h, k]));
    let a = widen(a_log).0.exp().reshape([1, 1, h, 1]);
    Ok(match lower_bound {
        None => softplus(x).mul(a).neg(),
        Some(lb) => sigmoid(x.mul(a)).mul_scalar(lb),
    })
}

/// The fused output norm of KDA (design §4.2): RMSNorm over the head dim first, then the sigmoid
/// gate (not swish):
///
/// ```text
/// y = o / sqrt(mean(o²) + eps) · weight ⊙ σ(z)
/// ```
///
/// `o, z: [..., V]`, `weight: [V]` → `[..., V]` in the dtype of `o`; statistics and gate in f32.
///
/// On the CubeCL backends (see [`backend`]) one fused kernel each way (f32, f16
/// or bf16 storage, `o` and `z` of one dtype); on the CPU backends (f32) a host kernel with one pass
/// over each row each way; elsewhere the tensor ops.
///
/// # Panics
/// On invalid input; see [`try_rms_norm_gated`].
pub fn rms_norm_gated<B: Backend, const D: usize>(
    o: Tensor<B, D>,
    z: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    try_rms_norm_gated(o, z, weight, eps).unwrap_or_else(|e| panic!("{e}"))
}

/// [`rms_norm_gated`], reporting a `z` whose shape differs from `o`'s and a `weight` that is not
/// `[V]`.
pub fn try_rms_norm_gated<B: Backend, const D: usize>(
    o: Tensor<B, D>,
    z: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Result<Tensor<B, D>> {
    let dims = o.dims();
    if z.dims() != dims {
        return Err(Error::shape(
            "z",
            format!("the shape of o, {dims:?}"),
            z.dims(),
        ));
    }
    let v = dims[D - 1];
    if weight.dims() != [v] {
        return Err(Error::shape(
            "weight",
            format!("[V] = [{v}]"),
            weight.dims(),
        ));
    }
    if dims.iter().product::<usize>() > 0
        && backend::host::is_cpu_backend::<B>()
        && [o.dtype(), z.dtype(), weight.dtype()] == [DType::F32; 3]
    {
        backend::record(FusedOp::RmsNormGated, KernelPath::Reference);
        let op = RmsNormGatedHost { eps: eps as f32 };
        let inputs = [
            o.into_primitive().tensor(),
            z.into_primitive().tensor(),
            weight.into_primitive().tensor(),
        ];
        return Ok(backend::host::run(&op, inputs));
    }
    let usable = backend::kernel_dtype(o.dtype())
        && o.dtype() == z.dtype()
        && dims.iter().product::<usize>() > 0
        && backend::kernels_available::<B>();
    if usable {
        let rows = dims.iter().product::<usize>() / v;
        let op = NormGatedOp {
            o: o.reshape([rows, v]),
            z: z.reshape([rows, v]),
            weight,
            eps,
        };
        match backend::on_kernels::<B, _>(op) {
            Ok(y) => {
                backend::record(FusedOp::RmsNormGated, KernelPath::Kernel);
                return Ok(y.reshape(dims));
            }
            Err(op) => {
                backend::record(FusedOp::RmsNormGated, KernelPath::Reference);
                return Ok(rms_norm_gated_reference(
                    op.o.reshape(dims),
                    op.z.reshape(dims),
                    op.weight,
                    eps,
                ));
            }
        }
    }
    backend::record(FusedOp::RmsNormGated, KernelPath::Reference);
    Ok(rms_norm_gated_reference(o, z, weight, eps))
}

/// [`rms_norm_gated`] in tensor ops (any backend, Burn's autodiff).
fn rms_norm_gated_reference<B: Backend, const D: usize>(
    o: Tensor<B, D>,
    z: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let (o, dtype) = widen(o);
    let (z, _) = widen(z);
    restore(rms_norm(o, weight, eps).mul(sigmoid(z)), dtype)
}
