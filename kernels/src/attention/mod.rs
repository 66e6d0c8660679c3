//! Causal softmax attention (design §5, the expanded form of MLA's training and prefill), forward
//! and backward: the scores are never stored.
//!
//! Per (batch row, head), query `i` attends keys `j ≤ i` that are not padding:
//!
//! ```text
//! s_ij = scale · q_i · k_j,   L_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij − L_i),   o_i = Σ_j p_ij v_j
//! D_i  = dO_i · o_i,          ds_ij = p_ij (dO_i · v_j − D_i)
//! dq_i = scale · Σ_j ds_ij k_j,   dk_j = scale · Σ_i ds_ij q_i,   dv_j = Σ_i p_ij dO_i
//! ```
//!
//! Two sets of three kernels compute it, chosen by [`uses_row_kernels`]:
//!
//! - the per-row kernels ([`attention_forward`](fn@attention_forward),
//!   [`attention_backward_query`](fn@attention_backward_query),
//!   [`attention_backward_key`](fn@attention_backward_key)): one unit per row with its head
//!   vectors in registers, for small heads (`dqk + dv ≤ 64`) and sequences short enough for
//!   their loops;
//! - the tiled kernels ([`attention_tiled_forward`](fn@attention_tiled_forward),
//!   [`attention_tiled_backward_query`](fn@attention_tiled_backward_query),
//!   [`attention_tiled_backward_key`](fn@attention_tiled_backward_key)): 64 × 64 tiles of the
//!   scores in a cube's registers, the factors staged in shared memory; for larger heads (MLA's
//!   `d_qk = 192`, `d_v = 128`, where one unit's row vectors would spill on CUDA) and longer
//!   sequences.
//!
//! Both keep `L` (one f32 per query row) from the forward. A query with no visible key gets a
//! zero output, `L` = [`EMPTY_ROW_LSE`] (so every `p_ij` of the backward is 0) and zero
//! gradients. Neither uses atomics, so reruns are bit-identical.
//!
//! Layouts: `q, k: [BH, T, dqk]`, `v, o, dO: [BH, T, dv]` (row-major, `BH` = batch · heads, batch
//! outer), `pad: [B, T]` (non-zero: the key is padding), `L, D: [BH · T]` f32.
//!
//! **Loop limit.** Mesa's software drivers stop a unit's loops silently after 65 535 iterations
//! in all ([`LOOP_BUDGET`](crate::kda::LOOP_BUDGET)). [`row_loops`] and [`tiled_loops`] bound what
//! one unit of each set runs; [`max_len_within`] gives the longest sequence the tiled kernels
//! take within a budget (about 2 700 tokens at `d_qk = 192`, `d_v = 128` within
//! `LOOP_BUDGET`, about 8 500 at the tiny model's heads). GPUs have no such limit.

use cubecl::prelude::*;

mod rows;
mod tiled;

pub use rows::*;
pub use tiled::*;

/// The log-sum-exp stored for a query with no visible key: `exp(s − L)` is 0 for every score.
pub const EMPTY_ROW_LSE: f32 = 1.0e30;

/// The widest heads (`dqk + dv`) the per-row kernels take: a unit of the backward holds
/// `2·(dqk + dv)` floats of row vectors in registers. ptxas keeps them there at the tiny model's
/// `(24, 16)` (128 registers, no spill) and spills 1.3 KB per unit at `(64, 64)`.
pub const ROW_KERNEL_MAX_WIDTH: usize = 64;

/// An upper bound on the loop iterations one unit of the per-row kernels runs at `t` tokens
/// (the backward's, the largest: every key of a row, each through `2·dqk + dv` products).
pub fn row_loops(t: usize, dqk: usize, dv: usize) -> usize {
    t * (2 * dqk + dv + 1) + 2 * (dqk + dv)
}

/// An upper bound on the loop iterations one unit of the tiled kernels runs at `t` tokens (the
/// key kernel's, the largest): per tile pair, the two score products ([`SLICE`](crate::kda::SLICE)
/// -deep slices of 19 iterations) and the two accumulations (four slices per 64 columns), plus
/// the tile's own bookkeeping.
pub fn tiled_loops(t: usize, dqk: usize, dv: usize) -> usize {
    let slices = |d: usize| d.div_ceil(crate::kda::SLICE);
    let passes = |d: usize| d.div_ceil(tiled::COLS);
    let per_tile = 19 * (slices(dqk) + slices(dv)) + 68 * (passes(dqk) + passes(dv)) + 50;
    attention_tiles(t) * per_tile + dqk + dv
}

/// Whether the per-row kernels serve `t` tokens at heads `(dqk, dv)`: `dqk + dv` at most
/// [`ROW_KERNEL_MAX_WIDTH`] and [`row_loops`] within [`LOOP_BUDGET`](crate::kda::LOOP_BUDGET) (on
/// every runtime, so lavapipe's tests run the path a GPU takes at the same shape). Otherwise the
/// tiled kernels.
pub fn uses_row_kernels(t: usize, dqk: usize, dv: usize) -> bool {
    dqk + dv <= ROW_KERNEL_MAX_WIDTH && row_loops(t, dqk, dv) <= crate::kda::LOOP_BUDGET
}

/// The longest sequence (a multiple of [`ATTENTION_TILE`]) whose [`tiled_loops`] stay within
/// `budget`.
pub fn max_len_within(budget: usize, dqk: usize, dv: usize) -> usize {
    let one = tiled_loops(ATTENTION_TILE, dqk, dv);
    let per_tile = one - dqk - dv;
    (budget.saturating_sub(dqk + dv) / per_tile) * ATTENTION_TILE
}

/// Whether key `j` of batch row `b` exists (`j < t`) and is visible (not padding); `pad` is read
/// only when `has_pad`.
#[cube]
fn key_visible<I: Int>(
    pad: &Array<I>,
    b: usize,
    j: usize,
    t: usize,
    #[comptime] has_pad: bool,
) -> bool {
    let mut visible = j < t;
    if comptime!(has_pad) {
        if visible {
            visible = u32::cast_from(pad[b * t + j]) == 0u32;
        }
    }
    visible
}
