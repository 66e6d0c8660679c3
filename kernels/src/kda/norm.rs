//! The gated output norm of the KDA layer, forward and backward.

use cubecl::prelude::*;

use super::sigmoid;

/// Units per cube of the row-wise norm kernels (a power of two).
pub const NORM_CUBE: u32 = 32;

/// Sum of `x` over the cube, by a fixed-order tree in shared memory (every unit gets the result).
#[cube]
pub(crate) fn cube_sum(x: f32, #[comptime] cube: u32) -> f32 {
    let mut part = SharedMemory::<f32>::new(cube as usize);
    let u = UNIT_POS as usize;
    part[u] = x;
    sync_cube();
    // A runtime value: a comptime one cannot be mutated in the loop.
    let mut stride = CUBE_DIM as usize / 2;
    while stride > 0 {
        if u < stride {
            part[u] = part[u] + part[u + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let total = part[0];
    sync_cube();
    total
}

/// Gated RMSNorm forward (design §4.2): per row of `cols`,
/// `y = o / sqrt(mean(o²) + eps) · w ⊙ σ(z)`, statistics and gate in f32.
///
/// `o, z, y: [rows, cols]` in `F`, `weight: [cols]` f32. One cube of [`NORM_CUBE`] units per row
/// (`rows` cubes; extras exit).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rms_norm_gated_forward<F: Float>(
    o: &Array<F>,
    z: &Array<F>,
    weight: &Array<f32>,
    y: &mut Array<F>,
    rows: usize,
    cols: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let u = UNIT_POS as usize;
    let step = NORM_CUBE as usize;
    let base = row * cols;
    let mut acc = 0.0f32;
    let mut c = u;
    while c < cols {
        let x = f32::cast_from(o[base + c]);
        acc += x * x;
        c += step;
    }
    let total = cube_sum(acc, NORM_CUBE);
    let r = 1.0f32 / f32::sqrt(total / cols as f32 + eps);
    let mut c = u;
    while c < cols {
        let x = f32::cast_from(o[base + c]);
        let s = sigmoid(f32::cast_from(z[base + c]));
        y[base + c] = F::cast_from(x * r * weight[c] * s);
        c += step;
    }
}

/// Gated RMSNorm backward for `dy`: with `r = (mean(o²) + eps)^−½`, `n = o·r`, `s = σ(z)`,
/// `a = dy·w·s`:
///
/// ```text
/// do = r·(a − n·mean(a·n)),   dz = dy·n·w·s·(1 − s),   dw_partial[row] = dy·n·s
/// ```
///
/// `dw_partial: [rows, cols]` f32 is summed over rows by [`column_sum`](fn@super::column_sum) (no
/// atomics). Launch as [`rms_norm_gated_forward`](fn@rms_norm_gated_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rms_norm_gated_backward<F: Float>(
    o: &Array<F>,
    z: &Array<F>,
    weight: &Array<f32>,
    dy: &Array<F>,
    d_o: &mut Array<F>,
    d_z: &mut Array<F>,
    dw_partial: &mut Array<f32>,
    rows: usize,
    cols: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let u = UNIT_POS as usize;
    let step = NORM_CUBE as usize;
    let base = row * cols;
    let mut sq = 0.0f32;
    let mut c = u;
    while c < cols {
        let x = f32::cast_from(o[base + c]);
        sq += x * x;
        c += step;
    }
    let total = cube_sum(sq, NORM_CUBE);
    let r = 1.0f32 / f32::sqrt(total / cols as f32 + eps);
    let mut an = 0.0f32;
    let mut c = u;
    while c < cols {
        let n = f32::cast_from(o[base + c]) * r;
        let s = sigmoid(f32::cast_from(z[base + c]));
        let g = f32::cast_from(dy[base + c]);
        an += g * weight[c] * s * n;
        c += step;
    }
    let mean_an = cube_sum(an, NORM_CUBE) / cols as f32;
    let mut c = u;
    while c < cols {
        let n = f32::cast_from(o[base + c]) * r;
        let s = sigmoid(f32::cast_from(z[base + c]));
        let g = f32::cast_from(dy[base + c]);
        let w = weight[c];
        let a = g * w * s;
        d_o[base + c] = F::cast_from(r * (a - n * mean_an));
        d_z[base + c] = F::cast_from(g * n * w * s * (1.0 - s));
        dw_partial[base + c] = g * n * s;
        c += step;
    }
}
