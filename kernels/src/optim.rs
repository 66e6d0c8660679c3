//! The optimiser's elementwise updates as one launch per parameter.
//!
//! Burn's AdamW step is about fourteen tensor ops per parameter (each a kernel launch over the
//! whole parameter), which on a GPU makes the optimiser step of a small model a stream of tiny
//! launches. [`adamw_step`](fn@adamw_step) does the same arithmetic, in the same order, in one
//! pass:
//!
//! ```text
//! m₁ ← β₁·m₁ + (1 − β₁)·g          m₂ ← β₂·m₂ + (1 − β₂)·g²
//! Δ  = (m₁ / c₁) / (sqrt(m₂ / c₂) + ε)        c₁ = 1 − β₁ᵗ, c₂ = 1 − β₂ᵗ (the bias corrections)
//! p  ← p·keep − lr·Δ                          keep = 1 − lr·λ (decoupled weight decay)
//! ```
//!
//! The moments are stored in the parameter's dtype and the update reads them back rounded, as the
//! tensor-op form does; the arithmetic is f32 whatever the storage dtype.
//! [`scaled_sum`](fn@scaled_sum) is the two-term combination Muon's momentum and update are made
//! of.

use cubecl::prelude::*;

/// Units per cube (one unit per element).
pub const OPTIM_CUBE: u32 = 256;

/// One AdamW step over `len` elements: `param`, `grad`, `m1`, `m2` in `F` (the moments of the
/// previous step; zeros before the first) → `param_out`, `m1_out`, `m2_out` in `F`, with
/// `f1 = 1 − β₁`, `f2 = 1 − β₂`, the bias corrections `c1`, `c2` and `keep = 1 − lr·λ`. One unit
/// per element, cubes of [`OPTIM_CUBE`] units; extra units exit.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn adamw_step<F: Float>(
    param: &Array<F>,
    grad: &Array<F>,
    m1: &Array<F>,
    m2: &Array<F>,
    param_out: &mut Array<F>,
    m1_out: &mut Array<F>,
    m2_out: &mut Array<F>,
    len: usize,
    beta1: f32,
    f1: f32,
    beta2: f32,
    f2: f32,
    c1: f32,
    c2: f32,
    eps: f32,
    keep: f32,
    lr: f32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let g = f32::cast_from(grad[i]);
    // Each product rounded on its own, as separate tensor ops round them.
    let a1 = f32::cast_from(m1[i]) * beta1;
    let b1 = g * f1;
    let first = F::cast_from(a1 + b1);
    let a2 = f32::cast_from(m2[i]) * beta2;
    let g2 = g * g;
    let b2 = g2 * f2;
    let second = F::cast_from(a2 + b2);
    m1_out[i] = first;
    m2_out[i] = second;
    let m1c = f32::cast_from(first) / c1;
    let m2c = f32::cast_from(second) / c2;
    let delta = m1c / (f32::sqrt(m2c) + eps);
    let kept = f32::cast_from(param[i]) * keep;
    let step = delta * lr;
    param_out[i] = F::cast_from(kept - step);
}

/// `out = a·x + b·y` over `len` elements of `F` (each product rounded, then the sum, as two
/// scaled tensors added), in f32. Muon's update `p ← keep·p − lr·u` and each Newton–Schulz
/// combination are one launch of it. One unit per element, cubes of [`OPTIM_CUBE`]
/// units; extra units exit.
#[cube(launch_unchecked)]
pub fn scaled_sum<F: Float>(
    x: &Array<F>,
    y: &Array<F>,
    out: &mut Array<F>,
    len: usize,
    a: f32,
    b: f32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let ax = f32::cast_from(x[i]) * a;
    let by = f32::cast_from(y[i]) * b;
    out[i] = F::cast_from(ax + by);
}
