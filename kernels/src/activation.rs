//! The logistic sigmoid and its derivative without cancellation (design §0, "Numerics of the
//! activations"), one unit per element.
//!
//! With `e = e^{−|x|}`: `σ(x) = 1/(1 + e)` for `x ≥ 0` and `e/(1 + e)` for `x < 0`, and
//! `σ'(x) = σ(x)·(1 − σ(x)) = e/(1 + e)²` on both sides. Neither can overflow, and neither is
//! formed by a subtraction, so both keep their relative precision in the tails (the gate and
//! routing scores of the model reach `σ(−20)` and beyond).

use cubecl::prelude::*;

/// Units per cube (one unit per element).
pub const ACTIVATION_CUBE: u32 = 256;

/// `out = σ(x)` over `len` elements of `F`, in f32. One unit per element, cubes of
/// [`ACTIVATION_CUBE`] units; extra units exit.
#[cube(launch_unchecked)]
pub fn sigmoid_forward<F: Float>(
    x: &Array<F>,
    out: &mut Array<F>,
    len: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let v = f32::cast_from(x[i]);
    let e = f32::exp(-f32::abs(v));
    let r = 1.0f32 / (1.0f32 + e);
    let mut s = r;
    if v < 0.0 {
        s = e * r;
    }
    out[i] = F::cast_from(s);
}

/// `dx = grad · σ'(x)` over `len` elements of `F`, in f32. Launch as
/// [`sigmoid_forward`](fn@sigmoid_forward).
#[cube(launch_unchecked)]
pub fn sigmoid_backward<F: Float>(
    x: &Array<F>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    len: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let e = f32::exp(-f32::abs(f32::cast_from(x[i])));
    let r = 1.0f32 / (1.0f32 + e);
    dx[i] = F::cast_from(f32::cast_from(grad[i]) * (e * r * r));
}
