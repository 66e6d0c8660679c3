//! Kimi Delta Attention kernels (design §4): the token-by-token recurrence for decode
//! (`recurrent`), the chunked form for training and prefill (forward in `chunk`, backward in
//! `chunk_backward`, their tiled products in `tile`), the short convolution for prefill and decode (`conv`) and the gated output
//! norm (`norm`), all re-exported here. This file holds the helpers they share.
//!
//! Layout: tokens of every sequence are contiguous along one axis (`[B·T, H, X]` for `B` rows of
//! length `T`, or the packed `[ΣT_n, H, X]`); `seq_start: [N + 1]` gives each sequence's token
//! range, so unpacked and packed batches take the same kernels. States are `[N, H, K, V]` f32.
//! Inputs arrive in f32 with `q` already scaled (and L2-normalised when asked).
//!
//! No float atomics: every output element has one writer, so reruns are bit-identical.

use cubecl::prelude::*;

mod chunk;
mod chunk_backward;
mod conv;
mod norm;
mod recurrent;
pub(crate) mod tile;

pub use chunk::*;
pub use chunk_backward::*;
pub use conv::*;
pub use norm::*;
pub use recurrent::*;
pub use tile::{tile_columns, tile_units, SLICE};

/// `σ(x)` in the reference path's cancellation-free form
/// ([`sigmoid_pair`](fn@crate::situ::sigmoid_pair)).
#[cube]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let (s, _c) = crate::situ::sigmoid_pair(x);
    s
}

/// Rows one unit of [`column_sum`](fn@column_sum) adds (see [`LOOP_BUDGET`]): longer columns
/// are summed in several launches, each adding blocks of this many rows.
pub const COLUMN_SUM_BLOCK: usize = 4096;

/// Column sums of `x: [rows, cols]` by blocks of `block` rows, in row order (deterministic):
/// `out[b, c] = Σ_{row in [b·block, min(rows, (b+1)·block))} x[row, c]`, `out: [ceil(rows /
/// block), cols]`, one unit per `(b, c)`. With `block ≥ rows` this is the plain column sum; the
/// host repeats it on `out` until one row is left, so no unit's loop passes [`LOOP_BUDGET`].
#[cube(launch_unchecked)]
pub fn column_sum(x: &Array<f32>, out: &mut Array<f32>, rows: usize, cols: usize, block: usize) {
    let id = ABSOLUTE_POS;
    // At least one block, so zero rows give zeros.
    let blocks = usize::max((rows + block - 1) / block, 1);
    if id >= blocks * cols {
        terminate!();
    }
    let b = id / cols;
    let c = id % cols;
    let lo = b * block;
    let hi = usize::min(rows, lo + block);
    let mut acc = 0.0f32;
    for r in lo..hi {
        acc += x[r * cols + c];
    }
    out[id] = acc;
}
