//! The tiled products of the chunked kernels ([`kda_chunk_output`](fn@super::kda_chunk_output)
//! forward; [`kda_chunk_dvn_intra`](fn@super::kda_chunk_dvn_intra),
//! [`kda_chunk_state_do`](fn@super::kda_chunk_state_do),
//! [`kda_chunk_state_products`](fn@super::kda_chunk_state_products),
//! [`kda_chunk_aqk_backward`](fn@super::kda_chunk_aqk_backward) and
//! [`kda_chunk_akk_backward`](fn@super::kda_chunk_akk_backward) backward): a cube holds an output tile of
//! a chunk as 4 × 4 blocks in its units' registers and walks the product's depth
//! [`SLICE`] at a time, each factor's slice staged in shared memory as [`V4`]s by loads on which
//! consecutive units read consecutive addresses (coalesced on a GPU). Each shared read then
//! feeds sixteen multiply-adds. The tiled attention kernels
//! ([`attention_tiled_forward`](fn@crate::attention::attention_tiled_forward) and its backward)
//! stage their factors and multiply their score blocks with the same helpers (`stage_rows`,
//! `stage_columns`, `multiply_slice`, `zero_block`, generic over the storage type).

use cubecl::prelude::*;

use super::chunk::{load_cols, store_cols};
use super::V4;

/// Depth of one staged slice of the chunked kernels' tiled products: a cube holds an output tile
/// of a chunk as 4 × 4 blocks in its units' registers ([`tile_units`] units) and walks the
/// product's depth this many at a time, each factor's slice staged in shared memory by loads on
/// which consecutive units read consecutive addresses.
pub const SLICE: usize = 16;

/// Columns (or rows) of an output tile for `cols` output columns (rows): 64, or `cols` rounded
/// up to a multiple of 4 below that.
pub fn tile_columns(cols: usize) -> usize {
    cols.next_multiple_of(4).clamp(4, 64)
}

/// Units per cube of a tiled product whose output tile is `[rows, cols]` (both multiples of 4):
/// one per 4 × 4 block.
pub fn tile_units(rows: usize, cols: usize) -> u32 {
    ((rows / 4) * (cols / 4)) as u32
}

/// Where a cube of a tiled product works and what this unit holds: the chunk·head, the tile's
/// first output column, the head, the chunk's first token and length, and the unit's row and
/// column quads of the output tile.
#[derive(CubeType)]
pub(super) struct Place {
    pub ch_h: usize,
    pub col0: usize,
    pub h: usize,
    pub tok0: usize,
    pub len: usize,
    pub rq: usize,
    pub cq: usize,
}

/// The [`Place`] of cube `id = chunk·head · tiles + tile`, for tiles of `cols` output columns.
#[cube]
pub(super) fn place(
    id: usize,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    heads: usize,
    tiles: usize,
    #[comptime] cols: usize,
) -> Place {
    let ch_h = id / tiles;
    let ch = ch_h / heads;
    let cq_n = comptime!(cols / 4);
    Place {
        ch_h,
        col0: (id % tiles) * cols,
        h: ch_h % heads,
        tok0: chunk_tok[ch] as usize,
        len: chunk_len[ch] as usize,
        rq: UNIT_POS as usize / cq_n,
        cq: UNIT_POS as usize % cq_n,
    }
}

/// Stages a slice of a factor whose *rows* are the output's rows or columns (`A` of `A · B`, or
/// `B` of `A · Bᵀ`): `tile[k · quads + q][l] = src[base + (4q + l) · stride + depth0 + k]` for
/// `k < SLICE`, zero where the row `4q + l` is at or past `rows` or the depth at or past `depth`.
/// Consecutive units take consecutive depths of the same four rows. `units`: the cube's.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float>(
    src: &Array<F>,
    tile: &mut SharedMemory<V4>,
    base: usize,
    stride: usize,
    rows: usize,
    depth0: usize,
    depth: usize,
    #[comptime] quads: usize,
    #[comptime] units: usize,
) {
    let rounds = comptime!((SLICE * quads).div_ceil(units));
    for r in 0..rounds {
        let e = r * units + UNIT_POS as usize;
        if e < SLICE * quads {
            let k = e % SLICE;
            let q = e / SLICE;
            let d = depth0 + k;
            let mut x = V4::new(0.0f32);
            if d < depth {
                #[unroll]
                for l in 0..4usize {
                    let i = 4 * q + l;
                    if i < rows {
                        x[l] = f32::cast_from(src[base + i * stride + d]);
                    }
                }
            }
            tile[k * quads + q] = x;
        }
    }
}

/// Stages a slice of a factor whose *columns* are the output's columns (`B` of `A · B`):
/// `tile[k · quads + c][j] = src[base + (depth0 + k) · stride + col0 + 4c + j]`, zero where the
/// depth row is at or past `depth` or the column at or past `cols`. Consecutive units take
/// consecutive columns of the same depth row.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_columns<F: Float>(
    src: &Array<F>,
    tile: &mut SharedMemory<V4>,
    base: usize,
    stride: usize,
    depth0: usize,
    depth: usize,
    col0: usize,
    cols: usize,
    #[comptime] quads: usize,
    #[comptime] units: usize,
) {
    let rounds = comptime!((SLICE * quads).div_ceil(units));
    for r in 0..rounds {
        let e = r * units + UNIT_POS as usize;
        if e < SLICE * quads {
            let k = e / quads;
            let c = e % quads;
            let mut x = V4::new(0.0f32);
            if depth0 + k < depth {
                x = load_cols(src, base + (depth0 + k) * stride, col0 + 4 * c, cols);
            }
            tile[k * quads + c] = x;
        }
    }
}

/// Four zero [`V4`]s: a unit's 4 × 4 block.
#[cube]
pub(crate) fn zero_block() -> Array<V4> {
    let mut acc = Array::<V4>::new(4usize);
    #[unroll]
    for l in 0..4usize {
        acc[l] = V4::new(0.0f32);
    }
    acc
}

/// `acc[l] += left[k][rq][l] · right[k][cq]` over the staged slice: the unit's 4 × 4 block at
/// row quad `rq` and column quad `cq`.
#[cube]
pub(crate) fn multiply_slice(
    acc: &mut Array<V4>,
    left: &SharedMemory<V4>,
    right: &SharedMemory<V4>,
    rq: usize,
    cq: usize,
    #[comptime] left_quads: usize,
    #[comptime] right_quads: usize,
) {
    for k in 0..SLICE {
        let a = left[k * left_quads + rq];
        let b = right[k * right_quads + cq];
        #[unroll]
        for l in 0..4usize {
            acc[l] += V4::new(a[l]) * b;
        }
    }
}

/// Writes row `l` of the unit's block (rows `i0 + l` below `rows`) to `dst[base + (i0 + l) ·
/// stride + col ..]`, the columns below `cols` (see [`store_cols`](fn@super::chunk::store_cols)).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_block(
    dst: &mut Array<f32>,
    acc: &Array<V4>,
    base: usize,
    stride: usize,
    i0: usize,
    rows: usize,
    col: usize,
    cols: usize,
) {
    #[unroll]
    for l in 0..4usize {
        if i0 + l < rows {
            store_cols(dst, base + (i0 + l) * stride, col, cols, acc[l]);
        }
    }
}
