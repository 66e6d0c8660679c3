//! RMSNorm (design §0: f32 statistics), forward and backward, one unit per row.
//!
//! For a row `x: [d]` and the gain `w: [d]`:
//!
//! ```text
//! r = (mean_d(x²) + eps)^−½,   y = x·r·w
//! dx = r·(g ⊙ w) − x·r³·(Σ_d g·w·x)/d,   dw = Σ_rows g·x·r
//! ```
//!
//! `dw` is summed over rows by [`column_sum`](fn@crate::kda::column_sum) from per-row partials: no
//! atomics, reruns are bit-identical. A unit owns its row and needs no barrier, the layout that
//! ran fastest on lavapipe for the Attention Residuals kernels ([`crate::attn_res`]). Its two
//! walks over the row take [`ROW_UNROLL`] columns per loop iteration, so a unit stays within
//! lavapipe's loop limit (see [`LOOP_BUDGET`](crate::kda::LOOP_BUDGET)) up to `d` ≈ 130 000.

use cubecl::prelude::*;

use crate::attn_res::ROW_UNROLL;

/// Units per cube (one unit per row).
pub const RMS_NORM_CUBE: u32 = 64;

/// Forward: `out: [rows, d]` in `F` from `x: [rows, d]` in `F` and `weight: [d]` f32. One unit per
/// row, cubes of [`RMS_NORM_CUBE`] units; extra units exit.
#[cube(launch_unchecked)]
pub fn rms_norm_forward<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    out: &mut Array<F>,
    rows: usize,
    d: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * d;
    let mut sq = 0.0f32;
    let mut c0 = 0usize;
    while c0 < d {
        #[unroll]
        for j in 0..ROW_UNROLL {
            let c = c0 + j;
            if c < d {
                let v = f32::cast_from(x[base + c]);
                sq += v * v;
            }
        }
        c0 += ROW_UNROLL;
    }
    let r = 1.0f32 / f32::sqrt(sq / d as f32 + eps);
    let mut c0 = 0usize;
    while c0 < d {
        #[unroll]
        for j in 0..ROW_UNROLL {
            let c = c0 + j;
            if c < d {
                out[base + c] = F::cast_from(f32::cast_from(x[base + c]) * r * weight[c]);
            }
        }
        c0 += ROW_UNROLL;
    }
}

/// Backward for `grad: [rows, d]` in `F`: `dx: [rows, d]` in `F` and the per-row partials of the
/// gain's gradient, `dw_partial: [rows, d]` f32 (sum them over rows). Launch as
/// [`rms_norm_forward`](fn@rms_norm_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rms_norm_backward<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    dw_partial: &mut Array<f32>,
    rows: usize,
    d: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * d;
    let mut sq = 0.0f32;
    let mut gwx = 0.0f32;
    let mut c0 = 0usize;
    while c0 < d {
        #[unroll]
        for j in 0..ROW_UNROLL {
            let c = c0 + j;
            if c < d {
                let v = f32::cast_from(x[base + c]);
                sq += v * v;
                gwx += f32::cast_from(grad[base + c]) * weight[c] * v;
            }
        }
        c0 += ROW_UNROLL;
    }
    let r = 1.0f32 / f32::sqrt(sq / d as f32 + eps);
    let coef = gwx * r * r * r / d as f32;
    let mut c0 = 0usize;
    while c0 < d {
        #[unroll]
        for j in 0..ROW_UNROLL {
            let c = c0 + j;
            if c < d {
                let v = f32::cast_from(x[base + c]);
                let g = f32::cast_from(grad[base + c]);
                dx[base + c] = F::cast_from(r * g * weight[c] - coef * v);
                dw_partial[base + c] = g * v * r;
            }
        }
        c0 += ROW_UNROLL;
    }
}
