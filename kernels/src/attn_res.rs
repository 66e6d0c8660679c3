//! Attention Residuals (design §6): the softmax mix over depth, forward and backward, one unit
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
//! Statistics in f32 whatever the storage dtype, each sum over `d` in order; `dq` is summed over
//! rows by [`column_sum`](fn@crate::kda::column_sum) from per-row partials: no atomics, reruns
//! are bit-identical. A unit owns its token, so no barrier is needed: a cube of 32 units per
//! token, sharing each sum through shared memory, made the lavapipe training step slower than the
//! tensor ops (its barriers), this layout faster (BENCHMARKS). On a GPU, a plane per token would
//! read `v` coalesced; that is the layout to try there.
//!
//! **Loop limit.** Mesa's software drivers stop a unit's loops silently after 65 535 iterations
//! in all (see [`LOOP_BUDGET`](crate::kda::LOOP_BUDGET)). Each walk over a token's columns runs
//! [`ROW_UNROLL`] of them per iteration, so a unit runs [`attn_res_loops`] iterations, about
//! `N·d / 4`: K3's widest mix (9 sources of 7168) stays within half the limit, where walking one
//! column per iteration ran about 130 000.

use cubecl::prelude::*;

/// Units per cube (one unit per token).
pub const ATTN_RES_CUBE: u32 = 64;

/// Columns per iteration of the kernels' walks over a token (unrolled, so a shader's loop
/// counter sees one iteration for them), here and in [`crate::rms_norm`].
pub const ROW_UNROLL: usize = 8;

/// Loop iterations one unit of [`attn_res_forward`](fn@attn_res_forward) or
/// [`attn_res_backward`](fn@attn_res_backward) runs for `n_src` sources of width `d` (the larger
/// of the two): two walks over each source's columns and a few passes over the sources.
pub fn attn_res_loops(n_src: usize, d: usize) -> usize {
    let walks = d.div_ceil(ROW_UNROLL);
    // Forward: a walk per source, the softmax pass, and the mix's walk with a pass over the
    // sources per step; backward: two walks per source and two passes over the sources.
    let forward = n_src * (walks + 1) + n_src + walks * (n_src + 1);
    let backward = 2 * n_src * (walks + 1) + 2 * n_src;
    forward.max(backward)
}

/// Forward: `out: [rows, d]` in `F` from `v: [n_src, rows, d]` in `F` and `query: [d]` f32.
/// `scores: [n_src, rows]` f32 is scratch (the scores `s_n` on exit). One unit per row, cubes
/// of [`ATTN_RES_CUBE`] units; extra units exit.
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
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let mut top = f32::new(-1.0e30);
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let mut sq = 0.0f32;
        let mut dot = 0.0f32;
        let mut c0 = 0usize;
        while c0 < d {
            #[unroll]
            for j in 0..ROW_UNROLL {
                let c = c0 + j;
                if c < d {
                    let x = f32::cast_from(v[base + c]);
                    sq += x * x;
                    dot += x * query[c];
                }
            }
            c0 += ROW_UNROLL;
        }
        // As the backward computes it, so both see the same scores.
        let s = dot * (1.0f32 / f32::sqrt(sq / d as f32 + eps));
        scores[n * rows + row] = s;
        top = f32::max(top, s);
    }
    let mut total = 0.0f32;
    for n in 0..n_src {
        let e = f32::exp(scores[n * rows + row] - top);
        scores[n * rows + row] = e;
        total += e;
    }
    // The mix, `ROW_UNROLL` columns at a time, each summed over the sources in order.
    let mut c0 = 0usize;
    while c0 < d {
        let mut acc = Array::<f32>::new(ROW_UNROLL);
        #[unroll]
        for j in 0..ROW_UNROLL {
            acc[j] = 0.0;
        }
        for n in 0..n_src {
            let e = scores[n * rows + row];
            let base = (n * rows + row) * d + c0;
            #[unroll]
            for j in 0..ROW_UNROLL {
                if c0 + j < d {
                    acc[j] += e * f32::cast_from(v[base + j]);
                }
            }
        }
        #[unroll]
        for j in 0..ROW_UNROLL {
            if c0 + j < d {
                out[row * d + c0 + j] = F::cast_from(acc[j] / total);
            }
        }
        c0 += ROW_UNROLL;
    }
}

/// Backward for `grad: [rows, d]` in `F`: `dv: [n_src, rows, d]` in `F` and the per-row partials
/// of `dq`, `dq_partial: [n_src·rows, d]` f32 (sum them over the first axis). `scores`,
/// `inv_rms` and `weights: [n_src, rows]` f32 are scratch. Reads each source twice. Launch as [`attn_res_forward`](fn@attn_res_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attn_res_backward<F: Float>(
    v: &Array<F>,
    query: &Array<f32>,
    grad: &Array<F>,
    dv: &mut Array<F>,
    dq_partial: &mut Array<f32>,
    scores: &mut Array<f32>,
    inv_rms: &mut Array<f32>,
    weights: &mut Array<f32>,
    n_src: usize,
    rows: usize,
    d: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    // Pass 1, one read of each source: the scores s_n (in `scores`), r_n (in `inv_rms`) and
    // a_n = g · v_n (in `weights`).
    let mut top = f32::new(-1.0e30);
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let mut sq = 0.0f32;
        let mut dot = 0.0f32;
        let mut ga = 0.0f32;
        let mut c0 = 0usize;
        while c0 < d {
            #[unroll]
            for j in 0..ROW_UNROLL {
                let c = c0 + j;
                if c < d {
                    let x = f32::cast_from(v[base + c]);
                    sq += x * x;
                    dot += x * query[c];
                    ga += x * f32::cast_from(grad[row * d + c]);
                }
            }
            c0 += ROW_UNROLL;
        }
        let r = 1.0f32 / f32::sqrt(sq / d as f32 + eps);
        let s = dot * r;
        scores[n * rows + row] = s;
        inv_rms[n * rows + row] = r;
        weights[n * rows + row] = ga;
        top = f32::max(top, s);
    }
    let mut total = 0.0f32;
    for n in 0..n_src {
        let e = f32::exp(scores[n * rows + row] - top);
        total += e;
    }
    let mut mean_a = 0.0f32;
    for n in 0..n_src {
        let p = f32::exp(scores[n * rows + row] - top) / total;
        mean_a += p * weights[n * rows + row];
    }
    // Pass 2, the second read of each source: its gradient. With s_n = (v_n · q)·r_n, the
    // coefficient of v_n is ds_n·(v_n · q)·r_n³/d = ds_n·s_n·r_n²/d.
    for n in 0..n_src {
        let base = (n * rows + row) * d;
        let s = scores[n * rows + row];
        let r = inv_rms[n * rows + row];
        let p = f32::exp(s - top) / total;
        let ds = p * (weights[n * rows + row] - mean_a);
        let dq_coef = ds * r;
        let v_coef = ds * s * r * r / d as f32;
        let mut c0 = 0usize;
        while c0 < d {
            #[unroll]
            for j in 0..ROW_UNROLL {
                let c = c0 + j;
                if c < d {
                    let x = f32::cast_from(v[base + c]);
                    let g = f32::cast_from(grad[row * d + c]);
                    dv[base + c] = F::cast_from(p * g + dq_coef * query[c] - v_coef * x);
                    dq_partial[base + c] = dq_coef * x;
                }
            }
            c0 += ROW_UNROLL;
        }
    }
}
