//! Top-k routing and the Quantile Balancing histogram in one pass (design §2, §3).
//!
//! One unit per token keeps the `k + 1` largest biased scores `s_j + b_j` in a small sorted local
//! array (insertion with a strict `>`, so among equal values the lower expert index stays ahead,
//! exactly like the host `select_top_k`). The first `k` entries are the selection; entry `k` is the
//! cut `α = (k+1)`-th largest. With the histogram on, every expert `j` of an unmasked token adds one
//! to `counts[j, bin]` with `bin = clamp(floor((α − s_j − lo)·scale), 0, bins − 1)`, by an integer
//! atomic (so the counts are exact and order-independent), evaluated in the same f32 operations as
//! the host `QuantileBalancer`, so the counts are identical.

use cubecl::prelude::*;

/// Routes `tokens` tokens over `n` experts.
///
/// * `scores: [tokens, n]` f32 (unbiased), `bias: [n]` f32;
/// * `valid: [tokens]` u32, non-zero for tokens that count (read only when `masked`);
/// * `indices: [tokens, k]` out, best first (written only when `select`);
/// * `counts: [n, bins]` u32 atomics, accumulated (only when `histogram`; zero it first).
///
/// `lo` and `scale = bins / (hi − lo)` must be computed on the host exactly as the host balancer
/// does. Launch with at least `tokens` units.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn route_top_k<I: Int>(
    scores: &Array<f32>,
    bias: &Array<f32>,
    valid: &Array<u32>,
    indices: &mut Array<I>,
    counts: &mut Array<Atomic<u32>>,
    tokens: usize,
    n: usize,
    lo: f32,
    scale: f32,
    bins: u32,
    #[comptime] k: usize,
    #[comptime] select: bool,
    #[comptime] histogram: bool,
    #[comptime] masked: bool,
    #[define(I)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= tokens {
        terminate!();
    }
    // Biased scores are finite (s ∈ [0, 1], a finite bias), so the most negative finite f32 is a
    // safe "empty slot" (WGSL has no infinity literal).
    let mut vals = Array::<f32>::new(k + 1);
    let mut idx = Array::<u32>::new(k + 1);
    #[unroll]
    for q in 0..k + 1 {
        vals[q] = f32::MIN;
        idx[q] = 0u32;
    }
    let row = t * n;
    for j in 0..n {
        let v = scores[row + j] + bias[j];
        if v > vals[k] {
            // Insertion from the back; `&&` does not short-circuit on every target, so the
            // `p > 0` test guards the read explicitly.
            let mut p = k.runtime();
            let mut moving = true;
            while moving {
                if p == 0 {
                    moving = false;
                } else if v > vals[p - 1] {
                    vals[p] = vals[p - 1];
                    idx[p] = idx[p - 1];
                    p -= 1;
                } else {
                    moving = false;
                }
            }
            vals[p] = v;
            idx[p] = j as u32;
        }
    }
    if comptime!(select) {
        #[unroll]
        for q in 0..k {
            indices[t * k + q] = I::cast_from(idx[q]);
        }
    }
    if comptime!(histogram) {
        let mut counted = true;
        if comptime!(masked) {
            counted = valid[t] != 0u32;
        }
        if counted {
            let alpha = vals[k];
            let last = (bins - 1) as f32;
            for j in 0..n {
                let r = alpha - scores[row + j];
                let x = f32::floor((r - lo) * scale);
                // Clamped again as an integer: a NaN score (unchecked when eager checks are
                // off) converts to an unspecified u32 on some targets, never past the last bin.
                let bin = u32::min(
                    u32::cast_from(f32::min(f32::max(x, 0.0), last)),
                    bins - 1u32,
                );
                counts[j * bins as usize + bin as usize].fetch_add(1u32);
            }
        }
    }
}
