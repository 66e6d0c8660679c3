//! The tiled kernels: a cube of [`TILED_CUBE`] units owns a tile of [`ATTENTION_TILE`] query rows
//! (the forward, [`attention_tiled_backward_query`](fn@attention_tiled_backward_query)) or key
//! rows ([`attention_tiled_backward_key`](fn@attention_tiled_backward_key)) of one (batch row,
//! head) and walks the tiles of the other side that the causal mask leaves.
//!
//! Each unit holds a 4 × 4 block of a tile pair's scores in registers, computed from slices of
//! the two factors staged in shared memory [`SLICE`] deep by coalesced loads (each staged value
//! feeds sixteen multiply-adds). The probabilities (or their gradients) then go through shared
//! memory once, transposed, as the left factor of the product with the value (or key, query,
//! output-gradient) tile, whose columns are staged 64 at a time. A unit's accumulators are four
//! rows by `⌈d / 64⌉` column quads, so no head vector lives in one unit: nothing spills at MLA's
//! `d_qk = 192`, `d_v = 128`. Shared memory: 24 KiB per cube at every head size (lavapipe has
//! 32 KiB, a CUDA cube 48 KiB without opting in to more).
//!
//! The forward keeps its running maximum and sum per row and rescales the accumulators by
//! `exp(m_old − m_new)` after each key tile (flash attention). No atomics and a fixed summation
//! order: reruns are bit-identical.
//!
//! Launch `BH · ⌈T / ATTENTION_TILE⌉` cubes ([`attention_tiles`]), linear in `CUBE_POS`.

use cubecl::prelude::*;

use super::{key_visible, EMPTY_ROW_LSE};
use crate::kda::tile::{multiply_slice, stage_columns, stage_rows, zero_block};
use crate::kda::SLICE;
use crate::V4;

/// Query (key) rows of a cube's tile, and key (query) rows of each tile it walks.
pub const ATTENTION_TILE: usize = 64;

/// Row (or column) quads of a tile.
const QUADS: usize = ATTENTION_TILE / 4;

/// Units per cube: one per 4 × 4 block of a tile pair's scores.
pub const TILED_CUBE: u32 = (QUADS * QUADS) as u32;

/// Output columns staged per pass of a tile's second product.
pub(super) const COLS: usize = 4 * QUADS;

/// The score of a pair the mask hides (finite, so a row that has seen nothing keeps a finite
/// maximum); real scores stay above [`VISIBLE_ABOVE`].
const MASKED: f32 = -1.0e30;
const VISIBLE_ABOVE: f32 = -1.0e29;

/// Tiles of [`ATTENTION_TILE`] rows in a sequence of `t` tokens: cubes per (batch row, head).
pub fn attention_tiles(t: usize) -> usize {
    t.div_ceil(ATTENTION_TILE)
}

/// Where a cube works and what this unit holds: the batch row `b`, the first token `seq` of the
/// (batch row, head)'s sequence, the first row of the cube's own tile and that tile's row count
/// (0 for a cube past the last tile), and the unit's row and column quads `rq`, `cq` of a tile
/// pair's scores.
#[derive(CubeType)]
struct Tile {
    b: usize,
    seq: usize,
    first: usize,
    rows: usize,
    rq: usize,
    cq: usize,
}

/// The [`Tile`] of this cube and unit.
#[cube]
fn tile_of(bh_count: usize, t: usize, heads: usize) -> Tile {
    let tiles = (t + ATTENTION_TILE - 1) / ATTENTION_TILE;
    let id = CUBE_POS;
    let bh = id / tiles;
    let first = (id % tiles) * ATTENTION_TILE;
    let mut rows = 0usize;
    if id < bh_count * tiles {
        rows = usize::min(ATTENTION_TILE, t - first);
    }
    let unit = UNIT_POS as usize;
    Tile {
        b: bh / heads,
        seq: bh * t,
        first,
        rows,
        rq: unit / QUADS,
        cq: unit % QUADS,
    }
}

/// Accumulators of a unit for `d` output columns: four rows by `⌈d / 64⌉` column quads, zeroed.
/// Entry `4·c + l` is row `l`, column quad `c·16 + cq` (columns `4·(c·16 + cq) ..`).
#[cube]
fn zero_rows(#[comptime] d: usize) -> Array<V4> {
    let n = comptime!(4 * d.div_ceil(COLS));
    let mut acc = Array::<V4>::new(n);
    #[unroll]
    for e in 0..n {
        acc[e] = V4::new(0.0f32);
    }
    acc
}

/// `acc += P · X` for the unit's four rows of `P` (the tile's probabilities or their gradients,
/// `depth` columns): `P` is stored transposed, `pt[r · QUADS + rq]` holding its column `r` for the
/// four rows; `X` is the `depth` rows (at most [`ATTENTION_TILE`]) of `src` from `base` on, each
/// `d` wide, staged [`SLICE`] rows by 64 columns at a time in `stage`. Starts each staging with a
/// barrier and ends without one.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_rows<F: Float>(
    acc: &mut Array<V4>,
    pt: &SharedMemory<V4>,
    stage: &mut SharedMemory<V4>,
    src: &Array<F>,
    base: usize,
    depth: usize,
    rq: usize,
    cq: usize,
    #[comptime] d: usize,
) {
    let passes = comptime!(d.div_ceil(COLS));
    for s in 0..(depth + SLICE - 1) / SLICE {
        let r0 = s * SLICE;
        #[unroll]
        for c in 0..passes {
            sync_cube();
            stage_columns(
                src,
                stage,
                base,
                d,
                r0,
                depth,
                c * COLS,
                d,
                QUADS,
                TILED_CUBE as usize,
            );
            sync_cube();
            for r in 0..SLICE {
                let a = pt[(r0 + r) * QUADS + rq];
                let x = stage[r * QUADS + cq];
                #[unroll]
                for l in 0..4usize {
                    acc[4 * c + l] += V4::new(a[l]) * x;
                }
            }
        }
    }
}

/// `acc = left · rightᵀ` for the unit's 4 × 4 block: `left` rows `lbase / d ..` (`lrows` of them)
/// and `right` rows `rbase / d ..` (`rrows`), both of width `d`, staged [`SLICE`] columns at a time.
/// Ends with the last slice's products in flight (no barrier).
#[cube]
#[allow(clippy::too_many_arguments)]
fn block_product<F: Float>(
    acc: &mut Array<V4>,
    sa: &mut SharedMemory<V4>,
    sb: &mut SharedMemory<V4>,
    left: &Array<F>,
    lbase: usize,
    lrows: usize,
    right: &Array<F>,
    rbase: usize,
    rrows: usize,
    rq: usize,
    cq: usize,
    #[comptime] d: usize,
) {
    let units = comptime!(TILED_CUBE as usize);
    for s in 0..comptime!(d.div_ceil(SLICE)) {
        let d0 = s * SLICE;
        sync_cube();
        stage_rows(left, sa, lbase, d, lrows, d0, d, QUADS, units);
        stage_rows(right, sb, rbase, d, rrows, d0, d, QUADS, units);
        sync_cube();
        multiply_slice(acc, sa, sb, rq, cq, QUADS, QUADS);
    }
}

/// The unit's 4 × 4 blocks of the scores `S = A · Bᵀ` (into `s`, depth `dqk`) and of `dP = A_v ·
/// B_vᵀ` (into `dp`, depth `dv`) of a tile pair of the backward: rows `own ..` (`own_rows` of them)
/// of `a` and `a_v` against rows `other ..` (`other_rows`) of `b` and `b_v`, all zeroed first.
#[cube]
#[allow(clippy::too_many_arguments)]
fn score_blocks<F: Float>(
    s: &mut Array<V4>,
    dp: &mut Array<V4>,
    sa: &mut SharedMemory<V4>,
    sb: &mut SharedMemory<V4>,
    a: &Array<F>,
    a_v: &Array<F>,
    own: usize,
    own_rows: usize,
    b: &Array<F>,
    b_v: &Array<F>,
    other: usize,
    other_rows: usize,
    rq: usize,
    cq: usize,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
) {
    block_product(
        s,
        sa,
        sb,
        a,
        own * dqk,
        own_rows,
        b,
        other * dqk,
        other_rows,
        rq,
        cq,
        dqk,
    );
    block_product(
        dp,
        sa,
        sb,
        a_v,
        own * dv,
        own_rows,
        b_v,
        other * dv,
        other_rows,
        rq,
        cq,
        dv,
    );
}

/// Writes the unit's rows `first + 4·rq + l` (those below `rows`) of `acc` times `factor[l]`,
/// `d` columns wide, to `dst[(base_row + …) · d ..]` in `F`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_rows<F: Float>(
    dst: &mut Array<F>,
    acc: &Array<V4>,
    factor: V4,
    base_row: usize,
    rows: usize,
    rq: usize,
    cq: usize,
    #[comptime] d: usize,
) {
    let passes = comptime!(d.div_ceil(COLS));
    #[unroll]
    for l in 0..4usize {
        let r = 4 * rq + l;
        if r < rows {
            let row = (base_row + r) * d;
            #[unroll]
            for c in 0..passes {
                let col = c * COLS + 4 * cq;
                let x = acc[4 * c + l];
                #[unroll]
                for j in 0..4usize {
                    if col + j < d {
                        dst[row + col + j] = F::cast_from(x[j] * factor[l]);
                    }
                }
            }
        }
    }
}

/// Forward: `o: [BH, T, dv]` in `F` and `lse: [BH · T]` f32, one cube of [`TILED_CUBE`] units
/// per (batch row, head) and query tile (`bh_count` = `BH`). `pad` is read only when `has_pad`
/// (pass any one-element buffer otherwise).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_tiled_forward<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    o: &mut Array<F>,
    lse: &mut Array<f32>,
    bh_count: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let Tile {
        b,
        seq,
        first,
        rows,
        rq,
        cq,
    } = tile_of(bh_count, t, heads);
    if rows == 0 {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let mut sa = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut sb = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut pt = SharedMemory::<V4>::new(ATTENTION_TILE * QUADS);
    let mut acc = zero_rows(dv);
    // The running maximum and sum of each of the unit's four rows (the 16 units of a row quad
    // compute the same values).
    let mut top = V4::new(MASKED);
    let mut total = V4::new(0.0f32);
    for kt in 0..first / ATTENTION_TILE + 1 {
        let j0 = kt * ATTENTION_TILE;
        let keys = usize::min(ATTENTION_TILE, t - j0);
        let mut s = zero_block();
        block_product(
            &mut s,
            &mut sa,
            &mut sb,
            q,
            (seq + first) * dqk,
            rows,
            k,
            (seq + j0) * dqk,
            keys,
            rq,
            cq,
            dqk,
        );
        // Scaled scores, hidden pairs at MASKED, transposed: pt[j · QUADS + rq][l] is row 4rq + l.
        #[unroll]
        for c in 0..4usize {
            let jl = 4 * cq + c;
            let mut x = V4::new(MASKED);
            if key_visible(pad, b, j0 + jl, t, has_pad) {
                #[unroll]
                for l in 0..4usize {
                    if j0 + jl <= first + 4 * rq + l {
                        x[l] = s[l][c] * scale;
                    }
                }
            }
            pt[jl * QUADS + rq] = x;
        }
        sync_cube();
        // Row maxima: each unit scans its four keys; a row quad's 16 partials meet in `sa`.
        let mut part = V4::new(MASKED);
        for c in 0..4usize {
            let x = pt[(4 * cq + c) * QUADS + rq];
            #[unroll]
            for l in 0..4usize {
                part[l] = f32::max(part[l], x[l]);
            }
        }
        sa[unit] = part;
        sync_cube();
        let mut top_new = top;
        for p in 0..QUADS {
            let x = sa[rq * QUADS + p];
            #[unroll]
            for l in 0..4usize {
                top_new[l] = f32::max(top_new[l], x[l]);
            }
        }
        // Probabilities relative to the new maximum, in place; the partial sums meet in `sb`.
        let mut sum = V4::new(0.0f32);
        for c in 0..4usize {
            let idx = (4 * cq + c) * QUADS + rq;
            let x = pt[idx];
            let mut e = V4::new(0.0f32);
            #[unroll]
            for l in 0..4usize {
                if x[l] > VISIBLE_ABOVE {
                    e[l] = f32::exp(x[l] - top_new[l]);
                }
            }
            pt[idx] = e;
            sum += e;
        }
        sb[unit] = sum;
        let mut alpha = V4::new(0.0f32);
        #[unroll]
        for l in 0..4usize {
            alpha[l] = f32::exp(top[l] - top_new[l]);
        }
        top = top_new;
        sync_cube();
        let mut add = V4::new(0.0f32);
        for p in 0..QUADS {
            add += sb[rq * QUADS + p];
        }
        total = total * alpha + add;
        #[unroll]
        for e in 0..comptime!(4 * dv.div_ceil(COLS)) {
            acc[e] = acc[e] * V4::new(alpha[e % 4]);
        }
        accumulate_rows(&mut acc, &pt, &mut sb, v, (seq + j0) * dv, keys, rq, cq, dv);
    }
    let mut inv = V4::new(0.0f32);
    #[unroll]
    for l in 0..4usize {
        if total[l] > 0.0f32 {
            inv[l] = 1.0f32 / total[l];
        }
    }
    store_rows(o, &acc, inv, seq + first, rows, rq, cq, dv);
    if cq == 0 {
        #[unroll]
        for l in 0..4usize {
            let r = 4 * rq + l;
            if r < rows {
                let mut value = f32::new(EMPTY_ROW_LSE);
                if total[l] > 0.0f32 {
                    value = top[l] + f32::ln(total[l]);
                }
                lse[seq + first + r] = value;
            }
        }
    }
}

/// Backward, per query tile: `dq: [BH, T, dqk]` in `F` and `delta: [BH · T]` f32 (`D_i`, which
/// [`attention_tiled_backward_key`](fn@attention_tiled_backward_key) reads), from the forward's `o` and `lse`
/// and `d_o: [BH, T, dv]`. Launch as [`attention_tiled_forward`](fn@attention_tiled_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_tiled_backward_query<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    o: &Array<F>,
    lse: &Array<f32>,
    d_o: &Array<F>,
    dq: &mut Array<F>,
    delta: &mut Array<f32>,
    bh_count: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let Tile {
        b,
        seq,
        first,
        rows,
        rq,
        cq,
    } = tile_of(bh_count, t, heads);
    if rows == 0 {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let mut sa = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut sb = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut pt = SharedMemory::<V4>::new(ATTENTION_TILE * QUADS);
    let mut d_rows = SharedMemory::<f32>::new(ATTENTION_TILE);
    // D_i = dO_i · o_i, one unit per row of the tile.
    if unit < rows {
        let row = (seq + first + unit) * dv;
        let mut d = 0.0f32;
        for c in 0..dv {
            d += f32::cast_from(d_o[row + c]) * f32::cast_from(o[row + c]);
        }
        delta[seq + first + unit] = d;
        d_rows[unit] = d;
    }
    sync_cube();
    let mut dd = V4::new(0.0f32);
    let mut ll = V4::new(EMPTY_ROW_LSE);
    #[unroll]
    for l in 0..4usize {
        let r = 4 * rq + l;
        if r < rows {
            dd[l] = d_rows[r];
            ll[l] = lse[seq + first + r];
        }
    }
    let mut acc = zero_rows(dqk);
    for kt in 0..first / ATTENTION_TILE + 1 {
        let j0 = kt * ATTENTION_TILE;
        let keys = usize::min(ATTENTION_TILE, t - j0);
        let mut s = zero_block();
        let mut dp = zero_block();
        score_blocks(
            &mut s,
            &mut dp,
            &mut sa,
            &mut sb,
            q,
            d_o,
            seq + first,
            rows,
            k,
            v,
            seq + j0,
            keys,
            rq,
            cq,
            dqk,
            dv,
        );
        // dS, transposed into `pt` (column j of the unit's rows at pt[j · QUADS + rq]).
        #[unroll]
        for c in 0..4usize {
            let jl = 4 * cq + c;
            let mut x = V4::new(0.0f32);
            if key_visible(pad, b, j0 + jl, t, has_pad) {
                #[unroll]
                for l in 0..4usize {
                    if j0 + jl <= first + 4 * rq + l {
                        let p = f32::exp(s[l][c] * scale - ll[l]);
                        x[l] = p * (dp[l][c] - dd[l]);
                    }
                }
            }
            pt[jl * QUADS + rq] = x;
        }
        accumulate_rows(
            &mut acc,
            &pt,
            &mut sb,
            k,
            (seq + j0) * dqk,
            keys,
            rq,
            cq,
            dqk,
        );
    }
    store_rows(dq, &acc, V4::new(scale), seq + first, rows, rq, cq, dqk);
}

/// Backward, per key tile: `dk: [BH, T, dqk]` and `dv: [BH, T, dv]` in `F`, from the forward's
/// `lse` and the `delta` of [`attention_tiled_backward_query`](fn@attention_tiled_backward_query) (launch it
/// first). Launched as [`attention_tiled_forward`](fn@attention_tiled_forward), each cube owning a tile of
/// keys and walking the query tiles at and after it.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_tiled_backward_key<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    d_o: &Array<F>,
    dk: &mut Array<F>,
    d_v: &mut Array<F>,
    bh_count: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let Tile {
        b,
        seq,
        first,
        rows,
        rq,
        cq,
    } = tile_of(bh_count, t, heads);
    if rows == 0 {
        terminate!();
    }
    let tiles = (t + ATTENTION_TILE - 1) / ATTENTION_TILE;
    let mut sa = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut sb = SharedMemory::<V4>::new(SLICE * QUADS);
    let mut pt = SharedMemory::<V4>::new(ATTENTION_TILE * QUADS);
    // The unit's four keys: 1 where visible (a padding key is seen by no query: its gradients
    // stay zero).
    let mut seen = V4::new(0.0f32);
    #[unroll]
    for l in 0..4usize {
        if key_visible(pad, b, first + 4 * rq + l, t, has_pad) {
            seen[l] = 1.0f32;
        }
    }
    let mut acc_k = zero_rows(dqk);
    let mut acc_v = zero_rows(dv);
    for qt in first / ATTENTION_TILE..tiles {
        let i0 = qt * ATTENTION_TILE;
        let queries = usize::min(ATTENTION_TILE, t - i0);
        // Sᵀ and dPᵀ: rows are the tile's keys, columns the queries.
        let mut s = zero_block();
        let mut dp = zero_block();
        score_blocks(
            &mut s,
            &mut dp,
            &mut sa,
            &mut sb,
            k,
            v,
            seq + first,
            rows,
            q,
            d_o,
            seq + i0,
            queries,
            rq,
            cq,
            dqk,
            dv,
        );
        // Pᵀ into `pt` (column i of the unit's keys at pt[i · QUADS + rq]); dSᵀ kept in the
        // same layout (`ds[c]`: column 4cq + c).
        let mut ds = zero_block();
        #[unroll]
        for c in 0..4usize {
            let il = 4 * cq + c;
            let mut x = V4::new(0.0f32);
            let mut y = V4::new(0.0f32);
            if il < queries {
                let i = seq + i0 + il;
                let l_i = lse[i];
                let d_i = delta[i];
                #[unroll]
                for l in 0..4usize {
                    if first + 4 * rq + l <= i0 + il && seen[l] > 0.0f32 {
                        let p = f32::exp(s[l][c] * scale - l_i);
                        x[l] = p;
                        y[l] = p * (dp[l][c] - d_i);
                    }
                }
            }
            pt[il * QUADS + rq] = x;
            ds[c] = y;
        }
        accumulate_rows(
            &mut acc_v,
            &pt,
            &mut sb,
            d_o,
            (seq + i0) * dv,
            queries,
            rq,
            cq,
            dv,
        );
        sync_cube();
        #[unroll]
        for c in 0..4usize {
            pt[(4 * cq + c) * QUADS + rq] = ds[c];
        }
        accumulate_rows(
            &mut acc_k,
            &pt,
            &mut sb,
            q,
            (seq + i0) * dqk,
            queries,
            rq,
            cq,
            dqk,
        );
    }
    store_rows(dk, &acc_k, V4::new(scale), seq + first, rows, rq, cq, dqk);
    store_rows(d_v, &acc_v, V4::new(1.0f32), seq + first, rows, rq, cq, dv);
}
