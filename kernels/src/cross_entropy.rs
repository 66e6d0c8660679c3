//! Cross-entropy over the rows of a logit matrix, forward and backward, one unit per row.
//!
//! For a row `z: [vocab]` and its target `t` (a row whose target is the ignore index scores
//! nothing):
//!
//! ```text
//! lse = max(z) + ln Σ_c exp(z_c − max(z)),   loss = lse − z_t
//! dz_c = g·(exp(z_c − lse) − [c = t])        (0 on an ignored row)
//! ```
//!
//! The forward keeps `lse` per row, so the backward reads each row once. A target outside
//! `[0, vocab)` other than the ignore index gives a NaN loss (and NaN gradients on its row): the
//! error surfaces at the next read of the loss instead of as an out-of-bounds read. Statistics in
//! f32 whatever the storage dtype; no atomics.

use cubecl::prelude::*;

/// Units per cube (one unit per row).
pub const CROSS_ENTROPY_CUBE: u32 = 64;

/// Whether `t` is a valid class of `vocab` (as a signed index).
#[cube]
fn in_range(t: i32, vocab: usize) -> bool {
    t >= 0 && (t as usize) < vocab
}

/// Forward: `loss: [rows]` in `F` and `lse: [rows]` f32 from `logits: [rows, vocab]` in `F` and
/// `targets: [rows]` in `I`. `nan` is `f32::NAN` (passed in: a NaN constant is a compile error in
/// some shader languages). One unit per row, cubes of [`CROSS_ENTROPY_CUBE`] units.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn cross_entropy_forward<F: Float, I: Int>(
    logits: &Array<F>,
    targets: &Array<I>,
    loss: &mut Array<F>,
    lse: &mut Array<f32>,
    rows: usize,
    vocab: usize,
    ignore: i32,
    nan: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * vocab;
    let mut top = f32::new(-3.0e38);
    for c in 0..vocab {
        top = f32::max(top, f32::cast_from(logits[base + c]));
    }
    let mut total = 0.0f32;
    for c in 0..vocab {
        total += f32::exp(f32::cast_from(logits[base + c]) - top);
    }
    let l = top + f32::ln(total);
    lse[row] = l;
    let t = i32::cast_from(targets[row]);
    let mut out = 0.0f32;
    if t != ignore {
        if in_range(t, vocab) {
            out = l - f32::cast_from(logits[base + t as usize]);
        } else {
            out = nan;
        }
    }
    loss[row] = F::cast_from(out);
}

/// Backward for `grad: [rows]` in `F` (the gradient of each row's loss): `dlogits: [rows,
/// vocab]` in `F`, from the forward's `lse`. Launch as
/// [`cross_entropy_forward`](fn@cross_entropy_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn cross_entropy_backward<F: Float, I: Int>(
    logits: &Array<F>,
    targets: &Array<I>,
    lse: &Array<f32>,
    grad: &Array<F>,
    dlogits: &mut Array<F>,
    rows: usize,
    vocab: usize,
    ignore: i32,
    nan: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * vocab;
    let t = i32::cast_from(targets[row]);
    let mut g = f32::cast_from(grad[row]);
    let l = lse[row];
    if t == ignore {
        g = 0.0;
    } else if !in_range(t, vocab) {
        g = nan;
    }
    for c in 0..vocab {
        let p = f32::exp(f32::cast_from(logits[base + c]) - l);
        let mut x = g * p;
        if c as i32 == t {
            x -= g;
        }
        dlogits[base + c] = F::cast_from(x);
    }
}
