//! SiTU-GLU activation (design §1).

use burn::tensor::{backend::Backend, Tensor, TensorPrimitive};

use crate::error::{Error, Result};
use crate::ops::backend::host as cpu;
use crate::ops::backend::{self, FusedKernels, FusedOp, KernelOp, KernelPath};
use crate::ops::precision::host::{SituGlu as SituGluKernel, Unary, WeightedSituGlu};
use crate::ops::precision::{restore, sigmoid, widen};
use serde::{Deserialize, Serialize};

/// The gated activation of a GLU FFN.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GluActivation {
    /// SiTU-GLU `β1·tanh(g/β1)·σ(g) ⊙ β2·tanh(v/β2)` (K3; `β1 = 4`, `β2 = Some(25)`).
    Situ {
        /// Gate cap `activation_situ_beta`.
        beta1: f32,
        /// Linear-branch cap `activation_situ_linear_beta`; `None` leaves the branch linear.
        beta2: Option<f32>,
    },
    /// SwiGLU `SiLU(g) ⊙ v` (Kimi-Linear, DeepSeek-V3).
    SwiGlu,
}

impl Default for GluActivation {
    fn default() -> Self {
        Self::situ()
    }
}

impl GluActivation {
    /// SiTU-GLU with the K3 constants `β1 = 4`, `β2 = 25`.
    pub fn situ() -> Self {
        Self::Situ {
            beta1: 4.0,
            beta2: Some(25.0),
        }
    }

    /// Checks that the caps are finite and positive.
    pub fn validate(&self) -> Result<()> {
        if let Self::Situ { beta1, beta2 } = *self {
            if !(beta1.is_finite() && beta1 > 0.0) {
                return Err(Error::config(
                    "activation_situ_beta",
                    format!("must be finite and positive, got {beta1}"),
                ));
            }
            if let Some(b2) = beta2 {
                if !(b2.is_finite() && b2 > 0.0) {
                    return Err(Error::config(
                        "activation_situ_linear_beta",
                        format!("must be finite and positive, got {b2}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies the activation to the gate and up projections (same shape).
    pub fn apply<B: Backend, const D: usize>(
        &self,
        gate: Tensor<B, D>,
        up: Tensor<B, D>,
    ) -> Tensor<B, D> {
        match *self {
            Self::Situ { beta1, beta2 } => situ_glu(gate, up, beta1, beta2),
            Self::SwiGlu => swiglu(gate, up),
        }
    }
}

/// The SiTU-GLU gated activation `A(gate) ⊙ B(up)` (design §1):
///
/// ```text
/// A(g) = β1 · tanh(g / β1) · σ(g)        # "SiTU", range (−0.2698, β1)
/// B(v) = β2 · tanh(v / β2)               # soft cap of the linear branch; B(v) = v when β2 is None
/// ```
///
/// so `|A·B| < β1·β2`. `gate` and `up` have the same shape (any rank); the result has that shape and
/// the input dtype, but is computed in f32 (or f64 for f64 inputs) whatever the storage dtype.
/// K3 uses `β1 = 4`, `β2 = Some(25)`. As `β → ∞` it tends to SwiGLU (`SiLU(g)·v`).
///
/// On the CubeCL backends (see `ops::backend`) this runs one fused kernel forward and one
/// backward (design §1 derivatives), on the CPU backends one host kernel each way (f32), and
/// elsewhere the tensor ops of [`situ_glu_reference`].
///
/// # Panics
/// If `beta1` or `beta2` is not finite and positive, or the shapes differ. Configs validate these
/// values with an `Error` before they reach this op.
pub fn situ_glu<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    beta1: f32,
    beta2: Option<f32>,
) -> Tensor<B, D> {
    check_betas(beta1, beta2);
    assert_eq!(
        gate.dims(),
        up.dims(),
        "situ_glu: gate and up must have the same shape"
    );
    let act = GluActivation::Situ { beta1, beta2 };
    match try_fused(FusedGlu { gate, up, act }) {
        Ok(y) => y,
        Err(FusedGlu { gate, up, .. }) => situ_glu_reference(gate, up, beta1, beta2),
    }
}

/// SiTU-GLU with a per-row routing weight folded in: `y = p ⊙ A(gate)·B(up)` (design §1), as the
/// routed experts use it.
///
/// `gate`, `up`: `[rows, h]`; `weight`: `[rows]`. Returns `[rows, h]` in the input dtype. On the
/// CubeCL backends one fused kernel each way, whose backward also yields
/// `dp = Σ_h dY ⊙ A·B`; elsewhere the tensor ops.
///
/// # Panics
/// As [`situ_glu`], or if `weight` is not `[rows]`.
pub fn situ_glu_weighted<B: Backend>(
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    beta1: f32,
    beta2: Option<f32>,
) -> Tensor<B, 2> {
    check_betas(beta1, beta2);
    assert_eq!(
        gate.dims(),
        up.dims(),
        "situ_glu_weighted: gate and up must have the same shape"
    );
    assert_eq!(
        weight.dims()[0],
        gate.dims()[0],
        "situ_glu_weighted: weight must be [rows]"
    );
    let act = GluActivation::Situ { beta1, beta2 };
    let op = FusedWeightedGlu {
        gate,
        up,
        weight,
        act,
    };
    let usable = kernel_usable(&op.gate, &op.up);
    let result = if usable {
        backend::on_kernels::<B, _>(op)
    } else {
        Err(op)
    };
    match result {
        Ok(y) => {
            backend::record(FusedOp::SituGlu, KernelPath::Kernel);
            y
        }
        Err(op) => {
            backend::record(FusedOp::SituGlu, KernelPath::Reference);
            let (g, dtype) = widen(op.gate);
            let (v, _) = widen(op.up);
            let (p, _) = widen(op.weight);
            // One host kernel on the CPU backends: the value and the weight in one pass each way.
            let kernel = WeightedSituGlu(SituGluKernel { beta1, beta2 });
            let (g, v, p) = match cpu::try_run(&kernel, [g, v, p.unsqueeze_dim(1)]) {
                Ok(y) => return restore(y, dtype),
                Err([g, v, p]) => (g, v, p),
            };
            let (y, _) = situ_glu_f32(g, v, beta1, beta2);
            restore(y.mul(p), dtype)
        }
    }
}

fn check_betas(beta1: f32, beta2: Option<f32>) {
    check_beta("situ_glu", "beta1", beta1);
    if let Some(b2) = beta2 {
        check_beta("situ_glu", "beta2", b2);
    }
}

/// Panics unless `value`, the parameter `name` of `op`, is finite and positive.
fn check_beta(op: &str, name: &str, value: f32) {
    assert!(
        value.is_finite() && value > 0.0,
        "{op}: {name} must be finite and positive, got {value}"
    );
}

/// The kernels take f32/f16/bf16 storage with both branches in one dtype, and non-empty rows.
fn kernel_usable<B: Backend, const D: usize>(gate: &Tensor<B, D>, up: &Tensor<B, D>) -> bool {
    let dims = gate.dims();
    backend::kernel_dtype(gate.dtype())
        && gate.dtype() == up.dtype()
        && D > 0
        && dims.iter().product::<usize>() > 0
}

/// `[.., h]` → `[rows, h]`, the layout the kernels take.
#[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
fn rows_of<const D: usize>(dims: [usize; D]) -> [usize; 2] {
    let h = dims[D - 1];
    [dims.iter().product::<usize>() / h, h]
}

#[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
struct FusedGlu<B: Backend, const D: usize> {
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    act: GluActivation,
}

impl<B: Backend, const D: usize> KernelOp<B> for FusedGlu<B, D> {
    type Output = Tensor<B, D>;

    fn run<K: FusedKernels>(self) -> Tensor<B, D> {
        let dims = self.gate.dims();
        let rows = rows_of(dims);
        let gate: Tensor<K, D> = backend::same(self.gate);
        let up: Tensor<K, D> = backend::same(self.up);
        let y = K::situ_glu_forward(
            gate.reshape(rows).into_primitive().tensor(),
            up.reshape(rows).into_primitive().tensor(),
            None,
            self.act,
        );
        let y = Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(dims);
        backend::same(y)
    }
}

#[cfg_attr(not(feature = "cubecl-kernels"), allow(dead_code))]
struct FusedWeightedGlu<B: Backend> {
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    act: GluActivation,
}

impl<B: Backend> KernelOp<B> for FusedWeightedGlu<B> {
    type Output = Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Tensor<B, 2> {
        let gate: Tensor<K, 2> = backend::same(self.gate);
        let up: Tensor<K, 2> = backend::same(self.up);
        // f32 before the kernel, so the routing-weight gradient flows back through a cast.
        let weight: Tensor<K, 1> = backend::same(self.weight);
        let weight = if weight.dtype() == burn::tensor::DType::F32 {
            weight
        } else {
            weight.cast(burn::tensor::FloatDType::F32)
        };
        let y = K::situ_glu_forward(
            gate.into_primitive().tensor(),
            up.into_primitive().tensor(),
            Some(weight.into_primitive().tensor()),
            self.act,
        );
        backend::same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(y)))
    }
}

/// Offers a GLU activation to the fused kernel; records the path taken.
fn try_fused<B: Backend, const D: usize>(
    op: FusedGlu<B, D>,
) -> Result<Tensor<B, D>, FusedGlu<B, D>> {
    let result = if kernel_usable(&op.gate, &op.up) {
        backend::on_kernels::<B, _>(op)
    } else {
        Err(op)
    };
    let path = match result {
        Ok(_) => KernelPath::Kernel,
        Err(_) => KernelPath::Reference,
    };
    backend::record(FusedOp::SituGlu, path);
    result
}

/// [`situ_glu`] without the CubeCL kernels: one host kernel each way on the CPU backends (f32),
/// the tensor ops of [`situ`] and [`soft_cap`] times each other elsewhere, and everywhere with
/// the kernels switched off ([`with_kernels`](crate::ops::with_kernels)).
pub fn situ_glu_reference<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    beta1: f32,
    beta2: Option<f32>,
) -> Tensor<B, D> {
    let (y, dtype) = situ_glu_f32(gate, up, beta1, beta2);
    restore(y, dtype)
}

/// `A(gate)·B(up)` in f32 (f64 for f64 inputs), with the storage dtype to restore.
fn situ_glu_f32<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    beta1: f32,
    beta2: Option<f32>,
) -> (Tensor<B, D>, burn::tensor::DType) {
    let (g, dtype) = widen(gate);
    let (v, _) = widen(up);
    // One host kernel on the CPU backends, the same function.
    let (g, v) = match crate::ops::backend::host::try_run(&SituGluKernel { beta1, beta2 }, [g, v]) {
        Ok(y) => return (y, dtype),
        Err([g, v]) => (g, v),
    };
    let a = situ(g, beta1);
    let b = match beta2 {
        Some(b2) => soft_cap(v, b2),
        None => v,
    };
    (a.mul(b), dtype)
}

/// `SiTU(g) = β1·tanh(g/β1)·σ(g)`, the gate branch of [`situ_glu`] (`β1 > 0`). On the CPU
/// backends an `f32` tensor goes through one host kernel forward and one backward, SiTU-GLU's
/// own arithmetic without the up branch.
///
/// # Panics
/// If `beta1` is not finite and positive.
pub fn situ<B: Backend, const D: usize>(g: Tensor<B, D>, beta1: f32) -> Tensor<B, D> {
    check_beta("situ", "beta1", beta1);
    match cpu::try_run(&Unary::SituGate(beta1), [g]) {
        Ok(y) => y,
        Err([g]) => soft_cap(g.clone(), beta1).mul(sigmoid(g)),
    }
}

/// `β·tanh(x/β)` (`β > 0`): a cap at ±β whose gradient never vanishes (unlike a clamp), with the
/// cancellation-free [`tanh`](crate::ops::precision::tanh). On the CPU backends an `f32` tensor
/// goes through one host kernel forward and one backward.
///
/// # Panics
/// If `beta` is not finite and positive.
pub fn soft_cap<B: Backend, const D: usize>(x: Tensor<B, D>, beta: f32) -> Tensor<B, D> {
    check_beta("soft_cap", "beta", beta);
    match cpu::try_run(&Unary::SoftCap(beta), [x]) {
        Ok(y) => y,
        Err([x]) => crate::ops::precision::tanh(x.div_scalar(beta)).mul_scalar(beta),
    }
}

/// The SwiGLU activation `SiLU(gate) ⊙ up`, for comparison with [`situ_glu`]; computed in f32 like it
/// (by the same fused kernel on the CubeCL backends).
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "swiglu: gate and up must have the same shape"
    );
    let (gate, up) = match try_fused(FusedGlu {
        gate,
        up,
        act: GluActivation::SwiGlu,
    }) {
        Ok(y) => return y,
        Err(FusedGlu { gate, up, .. }) => (gate, up),
    };
    let (g, dtype) = widen(gate);
    let (v, _) = widen(up);
    restore(crate::ops::precision::silu(g).mul(v), dtype)
}
