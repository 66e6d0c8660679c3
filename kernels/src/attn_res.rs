//! Attention Residuals (design §6): the softmax mix over depth, forward and backward, one cube
//! per token.
//!
//! With the sources stacked `v: [N, rows, d]` (row = token), the query `q = w_norm ⊙ w_proj: [d]`:
//!
//! ```text
//! r_n = (mean_d(v_n²) + eps)^−½,   s_n = r_n·(v_n · q),   p = softmax_n(s),   out = Σ_n p_n·v_n
//! ```
//!
//! and for the gradient `g` of `out`, with `a_n = g · v_n` and `ā = Σ_n p_n·a_n`:
//!
//! ```text
//! ds_n = p_n·(a_n − ā),   dv_n = p_n·g + ds_n·r_n·q − ds_n·(v_n · q)·r_n³·v_n / d,
//! dq   = Σ_rows Σ_n ds_n·r_n·v_n
//! ```
//!
//! Statistics in f32 whatever the storage dtype; each sum over `d` is a fixed-order tree in
//! shared memory, and `dq` is summed over rows by [`column_sum`](fn@crate::kda::column_sum) from
//! per-row partials: no atomics, reruns are bit-identical.

use cubecl::prelude::*;

use crate::kda::cube_sum;

/// Units per cube (one cube per token; a power of two).
pub const ATTN_RES_CUBE: u32 = 32;

/// Forward: `out: [rows, d]` in `F` from `v: [n_src, rows, d]` in `F` and `query: [d]` f32.
/// `scores: [n_src, rows]` f32 is scratch (the scores `s_n` on exit). `rows` cubes of
/// [`ATTN_RES_CUBE`] units; extra cubes exit.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attn_res_forward<F: Float>(
    v: &Array<F>,
    query: &Array<f32>,
    out: &mut Array<F>,
    scores: &mut Array<f32>,
    n_src: usize,
    rows: usize,
    d: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let u = UNIT_POS as usize;
    let step = ATTN_RES_CUBE as usize;
    let rounds = (d + step - 1) / step;
    // Every unit holds the same sums, so every unit writes the same score, once: a unit may read
    // a value another plane wrote, but never one from another stage (the planes of a cube run
    // apart between barriers), so `scores` needs no barrier and is never rewritten.
    let mut top = f32::new(-1.0e30);
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let mut sq = 0.0f32;
        let mut dot = 0.0f32;
        for round in 0..rounds {
            let c = round * step + u;
            if c < d {
                let x = f32::cast_from(v[base + c]);
                sq += x * x;
                dot += x * query[c];
            }
        }
        let sq_total = cube_sum(sq, ATTN_RES_CUBE);
        let dot_total = cube_sum(dot, ATTN_RES_CUBE);
        let s = dot_total / f32::sqrt(sq_total / d as f32 + eps);
        scores[n * rows + row] = s;
        top = f32::max(top, s);
    }
    let mut total = 0.0f32;
    for n in 0..n_src {
        total += f32::exp(scores[n * rows + row] - top);
    }
    for round in 0..rounds {
        let c = round * step + u;
        if c < d {
            let mut acc = 0.0f32;
            for n in 0..n_src {
                let p = f32::exp(scores[n * rows + row] - top) / total;
                acc += p * f32::cast_from(v[(n * rows + row) * d + c]);
            }
            out[row * d + c] = F::cast_from(acc);
        }
    }
}

/// Backward for `grad: [rows, d]` in `F`: `dv: [n_src, rows, d]` in `F` and the per-row partials
/// of `dq`, `dq_partial: [n_src·rows, d]` f32 (sum them over the first axis). `scores` and
/// `weights: [n_src, rows]` f32 are scratch. Launch as [`attn_res_forward`](fn@attn_res_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attn_res_backward<F: Float>(
    v: &Array<F>,
    query: &Array<f32>,
    grad: &Array<F>,
    dv: &mut Array<F>,
    dq_partial: &mut Array<f32>,
    scores: &mut Array<f32>,
    weights: &mut Array<f32>,
    n_src: usize,
    rows: usize,
    d: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let u = UNIT_POS as usize;
    let step = ATTN_RES_CUBE as usize;
    let rounds = (d + step - 1) / step;
    // Pass 1: the scores s_n (in `scores`) and a_n = g · v_n (in `weights`), each written once
    // with the same value by every unit, as in the forward.
    let mut top = f32::new(-1.0e30);
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let mut sq = 0.0f32;
        let mut dot = 0.0f32;
        let mut ga = 0.0f32;
        for round in 0..rounds {
            let c = round * step + u;
            if c < d {
                let x = f32::cast_from(v[base + c]);
                sq += x * x;
                dot += x * query[c];
                ga += x * f32::cast_from(grad[row * d + c]);
            }
        }
        let sq_total = cube_sum(sq, ATTN_RES_CUBE);
        let dot_total = cube_sum(dot, ATTN_RES_CUBE);
        let ga_total = cube_sum(ga, ATTN_RES_CUBE);
        let s = dot_total / f32::sqrt(sq_total / d as f32 + eps);
        scores[n * rows + row] = s;
        weights[n * rows + row] = ga_total;
        top = f32::max(top, s);
    }
    let mut total = 0.0f32;
    for n in 0..n_src {
        total += f32::exp(scores[n * rows + row] - top);
    }
    let mut mean_a = 0.0f32;
    for n in 0..n_src {
        let p = f32::exp(scores[n * rows + row] - top) / total;
        mean_a += p * weights[n * rows + row];
    }
    // Pass 2: per source, its statistics again and the gradient.
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let mut sq = 0.0f32;
        let mut dot = 0.0f32;
        for round in 0..rounds {
            let c = round * step + u;
            if c < d {
                let x = f32::cast_from(v[base + c]);
                sq += x * x;
                dot += x * query[c];
            }
        }
        let sq_total = cube_sum(sq, ATTN_RES_CUBE);
        let dot_total = cube_sum(dot, ATTN_RES_CUBE);
        let r = 1.0f32 / f32::sqrt(sq_total / d as f32 + eps);
        let p = f32::exp(scores[n * rows + row] - top) / total;
        let ds = p * (weights[n * rows + row] - mean_a);
        let dq_coef = ds * r;
        let v_coef = ds * dot_total * r * r * r / d as f32;
        for round in 0..rounds {
            let c = round * step + u;
            if c < d {
                let x = f32::cast_from(v[base + c]);
                let g = f32::cast_from(grad[row * d + c]);
                dv[base + c] = F::cast_from(p * g + dq_coef * query[c] - v_coef * x);
                dq_partial[base + c] = dq_coef * x;
            }
        }
    }
}
