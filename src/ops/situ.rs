//! SiTU-GLU activation (SPEC §1).

use burn::tensor::{backend::Backend, Tensor};

use super::cpu::elementwise::SituGlu as SituGluKernel;
use super::precision::{restore, sigmoid, widen};

/// The SiTU-GLU gated activation `A(gate) ⊙ B(up)` (SPEC §1):
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
/// # Panics
/// If `beta1` or `beta2` is not finite and positive, or the shapes differ. Configs validate these
/// values with an [`Error`](crate::Error) before they reach this op.
pub fn situ_glu<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
    beta1: f32,
    beta2: Option<f32>,
) -> Tensor<B, D> {
    assert!(
        beta1.is_finite() && beta1 > 0.0,
        "situ_glu: beta1 must be finite and positive, got {beta1}"
    );
    if let Some(b2) = beta2 {
        assert!(
            b2.is_finite() && b2 > 0.0,
            "situ_glu: beta2 must be finite and positive, got {b2}"
        );
    }
    assert_eq!(
        gate.dims(),
        up.dims(),
        "situ_glu: gate and up must have the same shape"
    );
    let (g, dtype) = widen(gate);
    let (v, _) = widen(up);
    // One host kernel on the CPU backends, the same function.
    let (g, v) = match super::cpu::try_run(&SituGluKernel { beta1, beta2 }, [g, v]) {
        Ok(y) => return restore(y, dtype),
        Err([g, v]) => (g, v),
    };
    let a = situ(g, beta1);
    let b = match beta2 {
        Some(b2) => soft_cap(v, b2),
        None => v,
    };
    restore(a.mul(b), dtype)
}

/// `SiTU(g) = β1·tanh(g/β1)·σ(g)`, the gate branch of [`situ_glu`].
pub fn situ<B: Backend, const D: usize>(g: Tensor<B, D>, beta1: f32) -> Tensor<B, D> {
    soft_cap(g.clone(), beta1).mul(sigmoid(g))
}

/// `β·tanh(x/β)`: a cap at ±β whose gradient never vanishes (unlike a clamp).
pub fn soft_cap<B: Backend, const D: usize>(x: Tensor<B, D>, beta: f32) -> Tensor<B, D> {
    x.div_scalar(beta).tanh().mul_scalar(beta)
}

/// The SwiGLU activation `SiLU(gate) ⊙ up`, for comparison with [`situ_glu`]; computed in f32 like it.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    let (g, dtype) = widen(gate);
    let (v, _) = widen(up);
    restore(super::precision::silu(g).mul(v), dtype)
}
