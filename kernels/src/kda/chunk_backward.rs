//! Chunked KDA backward (design §4.3). The forward's per-chunk states `S_c` and `Vn` are kept;
//! the gate sums, within-chunk matrices and `W`, `U` are recomputed by the forward kernels. Then:
//!
//! ```text
//! state pass (reverse):  dVn = A_qkᵀ dO + (K ⊙ exp(G_last − G)) dS'
//!                        dS  = Diag(exp(G_last)) dS' + (q ⊙ exp(G))ᵀ dO − Wᵀ dVn
//! per chunk:             d(q ⊙ exp(G)) = dO Sᵀ,  dW = −dVn Sᵀ,  d(K ⊙ exp(G_last − G)) = Vn dS'ᵀ,
//!                        d exp(G_last) = rowsum(S ⊙ dS'),  dA_qk = dO Vnᵀ (j ≤ i)
//! solve:                 Z = (I + A_kk)⁻ᵀ [dW | dVn],  dA_kk = −Z [W | U]ᵀ (j < i),
//!                        d(exp(G) ⊙ K) = β ⊙ Z_w,  dV = β ⊙ Z_u,  dβ ∋ rowsum(Z ⊙ [exp(G) ⊙ K | V])
//! ```
//!
//! and the within-chunk matrices are differentiated through their `exp(G_i − G_j)` factors
//! ([`kda_chunk_intra_backward`](fn@kda_chunk_intra_backward)), which gives per-position gradients
//! `dG` of the cumulative gate sums; `dg` is their reverse cumulative sum
//! ([`kda_chunk_gates_backward`](fn@kda_chunk_gates_backward)). `S'` is the state after a chunk and
//! `dS'` its gradient. Layouts as in the [parent module](super).

use cubecl::prelude::*;

use super::chunk::{
    load_cols, load_state_tile, store_cols, store_state_tile, SOLVE_CUBE, STATE_CUBE, SUB, V4,
};
use super::tile::{
    multiply_slice, place, stage_columns, stage_rows, store_block, zero_block, Place, SLICE,
};

/// The reverse sequential pass, one cube of [`STATE_CUBE`] units per (value tile,
/// sequence·head), `dS` tile `[kdim, vt]` and the tile of `dVn` in shared memory. The terms that
/// do not depend on the state come in computed for every chunk at once: `d_vn` holds `A_qkᵀ dO`
/// ([`kda_chunk_dvn_intra`](fn@kda_chunk_dvn_intra)) and `d_after` holds `(q ⊙ exp(G))ᵀ dO`
/// ([`kda_chunk_state_do`](fn@kda_chunk_state_do)); the pass adds the state's terms and stores
/// `dVn` (`d_vn: [chunks, heads, chunk, vdim]`) and the gradient of the state after every chunk
/// (`d_after: [chunks, heads, kdim, vdim]`) over them. One launch covers the chunks of each sequence whose
/// index counted from its end lies in `[window_lo, window_lo + window_len)` (see
/// [`chunk_state_window`](super::chunk_state_window)); `d_state: [N, heads, kdim, vdim]` holds
/// `dS_T` on entry to the first window and `dS_0` on exit from the last.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_state_backward(
    ke: &Array<f32>,
    decay: &Array<f32>,
    w: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    seq_chunk: &Array<u32>,
    d_state: &mut Array<f32>,
    d_after: &mut Array<f32>,
    d_vn: &mut Array<f32>,
    heads: usize,
    tiles: usize,
    seq_heads: usize,
    vdim: usize,
    window_lo: usize,
    window_len: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
    #[comptime] chunk: usize,
) {
    let unit = UNIT_POS as usize;
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `tiles` per sequence·head.
    let id = CUBE_POS;
    if id >= tiles * seq_heads {
        terminate!();
    }
    let col0 = (id % tiles) * vt;
    let nh = id / tiles;
    let n = nh / heads;
    let h = nh % heads;
    let cube = STATE_CUBE as usize;
    // As in the forward pass: tiles of [`V4`]s (four consecutive columns), each unit two rows of
    // four `dVn` columns, then one row of four `dS` columns.
    let q = comptime!(vt / 4);
    let s_rounds = comptime!((kdim * vt / 4).div_ceil(STATE_CUBE as usize));
    let v_rounds = comptime!((chunk.div_ceil(2) * vt / 4).div_ceil(STATE_CUBE as usize));
    let mut ds = SharedMemory::<V4>::new(kdim * q);
    let mut dvn = SharedMemory::<V4>::new(chunk.div_ceil(2) * 2 * q);
    let s_base = nh * kdim * vdim;
    load_state_tile(d_state, &mut ds, s_base, col0, vdim, kdim, vt);
    let first = seq_chunk[n] as usize;
    let count = seq_chunk[n + 1] as usize - first;
    let r0 = usize::min(window_lo, count);
    let r1 = usize::min(window_lo + window_len, count);
    for back in r0..r1 {
        let ch = first + count - 1 - back;
        let ch_h = ch * heads + h;
        let tok0 = chunk_tok[ch] as usize;
        let len = chunk_len[ch] as usize;
        for r in 0..v_rounds {
            let e = r * cube + unit;
            let i0 = 2 * (e / q);
            let cq = e % q;
            if i0 < len {
                // Row i0 + 1 may lie past the chunk's length: computed, never stored.
                let two = i0 + 1 < len;
                let col = col0 + 4 * cq;
                let k0 = ((tok0 + i0) * heads + h) * kdim;
                let mut k1 = k0;
                if two {
                    k1 = k0 + heads * kdim;
                }
                // `d_vn` holds `A_qkᵀ dO` ([`kda_chunk_dvn_intra`](fn@kda_chunk_dvn_intra)).
                let at = (ch_h * chunk + i0) * vdim;
                let mut x0 = load_cols(d_vn, at, col, vdim);
                let mut x1 = V4::new(0.0f32);
                if two {
                    x1 = load_cols(d_vn, at + vdim, col, vdim);
                }
                for d in 0..kdim {
                    let sv = ds[d * q + cq];
                    x0 += V4::new(ke[k0 + d]) * sv;
                    x1 += V4::new(ke[k1 + d]) * sv;
                }
                dvn[i0 * q + cq] = x0;
                store_cols(d_vn, (ch_h * chunk + i0) * vdim, col, vdim, x0);
                if two {
                    dvn[(i0 + 1) * q + cq] = x1;
                    store_cols(d_vn, (ch_h * chunk + i0 + 1) * vdim, col, vdim, x1);
                }
            }
        }
        sync_cube();
        for r in 0..s_rounds {
            let e = r * cube + unit;
            if e < kdim * q {
                let d = e / q;
                let cq = e % q;
                let col = col0 + 4 * cq;
                let old = ds[e];
                // `d_after` holds `(q ⊙ exp(G))ᵀ dO` until this unit writes `dS'` over it
                // ([`kda_chunk_state_do`](fn@kda_chunk_state_do)).
                let at = (ch_h * kdim + d) * vdim;
                let mut x =
                    V4::new(decay[ch_h * kdim + d]) * old + load_cols(d_after, at, col, vdim);
                store_cols(d_after, at, col, vdim, old);
                for i in 0..len {
                    x -= V4::new(w[(ch_h * chunk + i) * kdim + d]) * dvn[i * q + cq];
                }
                ds[e] = x;
            }
        }
        sync_cube();
    }
    store_state_tile(&ds, d_state, s_base, col0, vdim, kdim, vt);
}

/// The part of the reverse pass's `dVn` that does not depend on the state, `d_vn[i, c] = Σ_{j ≥ i}
/// A_qk[j, i] dO[j, c]`, for every chunk at once: one tiled product (see [`SLICE`])
/// per (chunk·head, tile of `cols` value columns, [`tile_columns`](super::tile_columns)`(vdim)`)
/// of [`tile_units`](super::tile_units)`(chunk, cols)` units over the chunk's rows.
/// `d_vn: [chunks, heads, chunk, vdim]`, rows past a chunk's length not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_dvn_intra(
    a_qk: &Array<f32>,
    d_out: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    d_vn: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    vdim: usize,
    tiles: usize,
    #[comptime] chunk: usize,
    #[comptime] cols: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `tiles` per chunk·head.
    let id = CUBE_POS;
    if id >= chunks * heads * tiles {
        terminate!();
    }
    let at = place(id, chunk_tok, chunk_len, heads, tiles, cols);
    let rq_n = comptime!(chunk / 4);
    let cq_n = comptime!(cols / 4);
    let units = comptime!(chunk / 4 * (cols / 4));
    let mut left = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut right = SharedMemory::<V4>::new(SLICE * cq_n);
    let mut acc = zero_block();
    let a_rows = at.ch_h * chunk * chunk;
    let o_rows = (at.tok0 * heads + at.h) * vdim;
    for s in 0..(at.len + SLICE - 1) / SLICE {
        let j0 = s * SLICE;
        // A_qkᵀ: row j of A_qk holds the output rows' entries side by side.
        stage_columns(
            a_qk, &mut left, a_rows, chunk, j0, at.len, 0, chunk, rq_n, units,
        );
        let stride = heads * vdim;
        stage_columns(
            d_out, &mut right, o_rows, stride, j0, at.len, at.col0, vdim, cq_n, units,
        );
        sync_cube();
        multiply_slice(&mut acc, &left, &right, at.rq, at.cq, rq_n, cq_n);
        sync_cube();
    }
    let base = at.ch_h * chunk * vdim;
    store_block(
        d_vn,
        &acc,
        base,
        vdim,
        4 * at.rq,
        at.len,
        at.col0 + 4 * at.cq,
        vdim,
    );
}

/// The part of the reverse pass's `dS` that does not depend on the state, `p[d, c] = Σ_i (q ⊙
/// exp(G))[i, d] dO[i, c]` over each chunk's rows, for every chunk at once: one tiled product
/// (see [`SLICE`]) per (chunk·head, tile of `rows` key channels, tile of `cols`
/// value columns) of [`tile_units`](super::tile_units)`(rows, cols)` units; `row_tiles =
/// ceil(kdim / rows)`, `col_tiles = ceil(vdim / cols)`. `p: [chunks, heads, kdim, vdim]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_state_do(
    qe: &Array<f32>,
    d_out: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    p: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    kdim: usize,
    vdim: usize,
    row_tiles: usize,
    col_tiles: usize,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `row_tiles · col_tiles` per
    // chunk·head.
    let id = CUBE_POS;
    let tiles = row_tiles * col_tiles;
    if id >= chunks * heads * tiles {
        terminate!();
    }
    let at = place(id, chunk_tok, chunk_len, heads, tiles, cols);
    let row0 = (id % tiles) / col_tiles * rows;
    let col0 = (id % col_tiles) * cols;
    let rq_n = comptime!(rows / 4);
    let cq_n = comptime!(cols / 4);
    let units = comptime!(rows / 4 * (cols / 4));
    let mut left = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut right = SharedMemory::<V4>::new(SLICE * cq_n);
    let mut acc = zero_block();
    let q_rows = (at.tok0 * heads + at.h) * kdim;
    let o_rows = (at.tok0 * heads + at.h) * vdim;
    for s in 0..(at.len + SLICE - 1) / SLICE {
        let i0 = s * SLICE;
        let q_stride = heads * kdim;
        stage_columns(
            qe, &mut left, q_rows, q_stride, i0, at.len, row0, kdim, rq_n, units,
        );
        let o_stride = heads * vdim;
        stage_columns(
            d_out, &mut right, o_rows, o_stride, i0, at.len, col0, vdim, cq_n, units,
        );
        sync_cube();
        multiply_slice(&mut acc, &left, &right, at.rq, at.cq, rq_n, cq_n);
        sync_cube();
    }
    let base = (at.ch_h * kdim + row0) * vdim;
    store_block(
        p,
        &acc,
        base,
        vdim,
        4 * at.rq,
        kdim - row0,
        col0 + 4 * at.cq,
        vdim,
    );
}

/// The per-chunk products with the states, one tiled product (see [`SLICE`]) per
/// (chunk·head, tile of `cols` key channels, [`tile_columns`](super::tile_columns)`(kdim)`) of
/// [`tile_units`](super::tile_units)`(chunk, cols)` units, over the value channels:
///
/// ```text
/// dqe[i,d] = Σ_v dO[i,v] S[d,v]     dw[i,d] = −Σ_v dVn[i,v] S[d,v]     dke[i,d] = Σ_v Vn[i,v] dS'[d,v]
/// ddecay[d] = Σ_v S[d,v] dS'[d,v]   (from the staged slices of S and dS')
/// ```
///
/// `tiles = ceil(kdim / cols)` cubes per chunk·head. `dqe`, `dke: [tokens, heads, kdim]`, `dw:
/// [chunks, heads, chunk, kdim]` (rows past a chunk's length not written), `ddecay: [chunks,
/// heads, kdim]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_state_products(
    d_out: &Array<f32>,
    states: &Array<f32>,
    d_after: &Array<f32>,
    vn: &Array<f32>,
    d_vn: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    dqe: &mut Array<f32>,
    dw: &mut Array<f32>,
    dke: &mut Array<f32>,
    ddecay: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    vdim: usize,
    tiles: usize,
    #[comptime] kdim: usize,
    #[comptime] chunk: usize,
    #[comptime] cols: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `tiles` per chunk·head.
    let id = CUBE_POS;
    if id >= chunks * heads * tiles {
        terminate!();
    }
    let Place {
        ch_h,
        col0,
        h,
        tok0,
        len,
        rq,
        cq,
    } = place(id, chunk_tok, chunk_len, heads, tiles, cols);
    let rq_n = comptime!(chunk / 4);
    let cq_n = comptime!(cols / 4);
    let units = comptime!(chunk / 4 * (cols / 4));
    let mut l_out = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut l_dvn = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut l_vn = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut r_s = SharedMemory::<V4>::new(SLICE * cq_n);
    let mut r_ds = SharedMemory::<V4>::new(SLICE * cq_n);
    let mut a_q = zero_block();
    let mut a_w = zero_block();
    let mut a_k = zero_block();
    let mut dec = V4::new(0.0f32);
    let tok_rows = (tok0 * heads + h) * vdim;
    let chunk_rows = ch_h * chunk * vdim;
    let s_rows = (ch_h * kdim + col0) * vdim;
    let channels = kdim - usize::min(col0, kdim);
    for s in 0..(vdim + SLICE - 1) / SLICE {
        let v0 = s * SLICE;
        stage_rows(
            d_out,
            &mut l_out,
            tok_rows,
            heads * vdim,
            len,
            v0,
            vdim,
            rq_n,
            units,
        );
        stage_rows(
            d_vn, &mut l_dvn, chunk_rows, vdim, len, v0, vdim, rq_n, units,
        );
        stage_rows(vn, &mut l_vn, chunk_rows, vdim, len, v0, vdim, rq_n, units);
        stage_rows(
            states, &mut r_s, s_rows, vdim, channels, v0, vdim, cq_n, units,
        );
        stage_rows(
            d_after, &mut r_ds, s_rows, vdim, channels, v0, vdim, cq_n, units,
        );
        sync_cube();
        multiply_slice(&mut a_q, &l_out, &r_s, rq, cq, rq_n, cq_n);
        multiply_slice(&mut a_w, &l_dvn, &r_s, rq, cq, rq_n, cq_n);
        multiply_slice(&mut a_k, &l_vn, &r_ds, rq, cq, rq_n, cq_n);
        if rq == 0 {
            #[unroll]
            for k in 0..SLICE {
                dec += r_s[k * cq_n + cq] * r_ds[k * cq_n + cq];
            }
        }
        sync_cube();
    }
    #[unroll]
    for l in 0..4usize {
        a_w[l] = V4::new(0.0f32) - a_w[l];
    }
    let col = col0 + 4 * cq;
    let i0 = 4 * rq;
    let tok_keys = (tok0 * heads + h) * kdim;
    store_block(dqe, &a_q, tok_keys, heads * kdim, i0, len, col, kdim);
    store_block(dw, &a_w, ch_h * chunk * kdim, kdim, i0, len, col, kdim);
    store_block(dke, &a_k, tok_keys, heads * kdim, i0, len, col, kdim);
    if rq == 0 {
        store_cols(ddecay, ch_h * kdim, col, kdim, dec);
    }
}

/// `dA_qk[i,j] = Σ_v dO[i,v] Vn[j,v]` for `j ≤ i < len` (zero elsewhere), one tiled product (see
/// [`SLICE`]) per chunk·head of [`tile_units`](super::tile_units)`(chunk, chunk)`
/// units over the value channels; `d_aqk: [chunks, heads, chunk, chunk]`, every entry written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_aqk_backward(
    d_out: &Array<f32>,
    vn: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    d_aqk: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): one per chunk·head.
    if CUBE_POS >= chunks * heads {
        terminate!();
    }
    let Place {
        ch_h,
        h,
        tok0,
        len,
        rq,
        cq,
        ..
    } = place(CUBE_POS, chunk_tok, chunk_len, heads, 1, chunk);
    let q_n = comptime!(chunk / 4);
    let units = comptime!(chunk / 4 * (chunk / 4));
    let mut left = SharedMemory::<V4>::new(SLICE * q_n);
    let mut right = SharedMemory::<V4>::new(SLICE * q_n);
    let mut acc = zero_block();
    let tok_rows = (tok0 * heads + h) * vdim;
    for s in 0..(vdim + SLICE - 1) / SLICE {
        let v0 = s * SLICE;
        stage_rows(
            d_out,
            &mut left,
            tok_rows,
            heads * vdim,
            len,
            v0,
            vdim,
            q_n,
            units,
        );
        stage_rows(
            vn,
            &mut right,
            ch_h * chunk * vdim,
            vdim,
            len,
            v0,
            vdim,
            q_n,
            units,
        );
        sync_cube();
        multiply_slice(&mut acc, &left, &right, rq, cq, q_n, q_n);
        sync_cube();
    }
    store_lower(d_aqk, &acc, ch_h * chunk * chunk, len, rq, cq, false, chunk);
}

/// Writes a unit's 4 × 4 block (row quad `rq`, column quad `cq`) of a `[chunk, chunk]` matrix at
/// `base`, its entries `(i, j)` kept for `j ≤ i < len` (`j < i` when `strict`) and zero elsewhere.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_lower(
    dst: &mut Array<f32>,
    acc: &Array<V4>,
    base: usize,
    len: usize,
    rq: usize,
    cq: usize,
    #[comptime] strict: bool,
    #[comptime] chunk: usize,
) {
    #[unroll]
    for l in 0..4usize {
        let i = 4 * rq + l;
        let mut x = acc[l];
        #[unroll]
        for c in 0..4usize {
            let j = 4 * cq + c;
            let mut above = j > i;
            if strict {
                above = j >= i;
            }
            if above || i >= len {
                x[c] = 0.0f32;
            }
        }
        store_cols(dst, base + i * chunk, 4 * cq, chunk, x);
    }
}

/// The transposed triangular solve `(I + A_kk)ᵀ Z = [dW | dVn]` by back substitution, one unit
/// per column of `Z` (`col_blocks` cubes per chunk·head, as the forward
/// solve). `zw: [chunks, heads, chunk, kdim]`, `zu: [chunks, heads, chunk, vdim]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_solve_backward(
    a_kk: &Array<f32>,
    dw: &Array<f32>,
    d_vn: &Array<f32>,
    chunk_len: &Array<u32>,
    zw: &mut Array<f32>,
    zu: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    col_blocks: usize,
    kdim: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `col_blocks` per chunk·head.
    let id = CUBE_POS;
    let ch_h = id / col_blocks;
    let col = (id % col_blocks) * SOLVE_CUBE as usize + UNIT_POS as usize;
    if ch_h >= chunks * heads || col >= kdim + vdim {
        terminate!();
    }
    let ch = ch_h / heads;
    let len = chunk_len[ch] as usize;
    let a_base = ch_h * chunk * chunk;
    if col < kdim {
        for r in 0..len {
            let i = len - 1 - r;
            let mut x = dw[(ch_h * chunk + i) * kdim + col];
            for j in i + 1..len {
                x -= a_kk[a_base + j * chunk + i] * zw[(ch_h * chunk + j) * kdim + col];
            }
            zw[(ch_h * chunk + i) * kdim + col] = x;
        }
    } else {
        let c = col - kdim;
        for r in 0..len {
            let i = len - 1 - r;
            let mut x = d_vn[(ch_h * chunk + i) * vdim + c];
            for j in i + 1..len {
                x -= a_kk[a_base + j * chunk + i] * zu[(ch_h * chunk + j) * vdim + c];
            }
            zu[(ch_h * chunk + i) * vdim + c] = x;
        }
    }
}

/// `dA_kk[i,j] = −(Σ_d Z_w[i,d] W[j,d] + Σ_v Z_u[i,v] U[j,v])` for `j < i < len` (zero
/// elsewhere), one tiled product (see [`SLICE`]) per chunk·head of
/// [`tile_units`](super::tile_units)`(chunk, chunk)` units over the key then the value channels;
/// `d_akk: [chunks, heads, chunk, chunk]`, every entry written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_akk_backward(
    zw: &Array<f32>,
    zu: &Array<f32>,
    w: &Array<f32>,
    u: &Array<f32>,
    chunk_len: &Array<u32>,
    d_akk: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    kdim: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    // Cubes spread over the hardware grid (`CUBE_POS` linear): one per chunk·head.
    let ch_h = CUBE_POS;
    if ch_h >= chunks * heads {
        terminate!();
    }
    let len = chunk_len[ch_h / heads] as usize;
    let q_n = comptime!(chunk / 4);
    let units = comptime!(chunk / 4 * (chunk / 4));
    let rq = UNIT_POS as usize / q_n;
    let cq = UNIT_POS as usize % q_n;
    let mut left = SharedMemory::<V4>::new(SLICE * q_n);
    let mut right = SharedMemory::<V4>::new(SLICE * q_n);
    let mut acc = zero_block();
    let k_slices = (kdim + SLICE - 1) / SLICE;
    for s in 0..k_slices + (vdim + SLICE - 1) / SLICE {
        if s < k_slices {
            let base = ch_h * chunk * kdim;
            let d0 = s * SLICE;
            stage_rows(zw, &mut left, base, kdim, len, d0, kdim, q_n, units);
            stage_rows(w, &mut right, base, kdim, len, d0, kdim, q_n, units);
        } else {
            let base = ch_h * chunk * vdim;
            let v0 = (s - k_slices) * SLICE;
            stage_rows(zu, &mut left, base, vdim, len, v0, vdim, q_n, units);
            stage_rows(u, &mut right, base, vdim, len, v0, vdim, q_n, units);
        }
        sync_cube();
        multiply_slice(&mut acc, &left, &right, rq, cq, q_n, q_n);
        sync_cube();
    }
    #[unroll]
    for l in 0..4usize {
        acc[l] = V4::new(0.0f32) - acc[l];
    }
    store_lower(d_akk, &acc, ch_h * chunk * chunk, len, rq, cq, true, chunk);
}

/// The within-chunk matrices differentiated through their factors `E_ij = exp(G_i − G_j)` (per
/// key channel), one unit per (chunk·head, row `i`, four channels `d`):
///
/// ```text
/// rq[i] = Σ_{j≤i} dA_qk[i,j] k_j E_ij        rk[i] = Σ_{j<i} dA_kk[i,j] k_j E_ij
/// cc[i] = Σ_{i'≥i} dA_qk[i',i] q_i' E_i'i + Σ_{i'>i} dA_kk[i',i] β_i' k_i' E_i'i
/// ```
///
/// so that `dq ∋ rq`, `dk ∋ β rk + cc`, `dβ ∋ Σ_d k rk` and the gradient of the cumulative gate
/// sum at `i` gains `q rq + β k rk − k cc`. The factors are formed as in the forward: summed
/// directly inside a 16-row sub-chunk, and across sub-chunks as the anchored product
/// `exp(P_i) · Π sub_decay · exp(X_j)` (through `qp`, `kp`, `ks` and `sub_decay` of
/// [`kda_chunk_gates`](fn@super::kda_chunk_gates)), every factor ≤ 1. `rq`, `rk`, `cc: [tokens,
/// heads, kdim]`.
///
/// Long on purpose: one kernel body over shared-memory tiles, in the order of the formula above.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_intra_backward(
    q: &Array<f32>,
    k: &Array<f32>,
    g: &Array<f32>,
    beta: &Array<f32>,
    qp: &Array<f32>,
    kp: &Array<f32>,
    ks: &Array<f32>,
    sub_decay: &Array<f32>,
    d_aqk: &Array<f32>,
    d_akk: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    rq: &mut Array<f32>,
    rk: &mut Array<f32>,
    cc: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    #[comptime] kdim: usize,
    #[comptime] chunk: usize,
) {
    // One unit per (chunk·head, row i, four key channels d0..d0 + 4): the channels are the lanes
    // of a [`V4`] (zeros past `kdim`), so each `dA` entry read feeds four channels.
    let quads = comptime!(kdim.div_ceil(4));
    let pos = ABSOLUTE_POS;
    if pos >= chunks * heads * chunk * quads {
        terminate!();
    }
    let d0 = 4 * (pos % quads);
    let i = (pos / quads) % chunk;
    let ch_h = pos / (quads * chunk);
    let h = ch_h % heads;
    let ch = ch_h / heads;
    let len = chunk_len[ch] as usize;
    if i >= len {
        terminate!();
    }
    let tok0 = chunk_tok[ch] as usize;
    let subs = chunk / SUB;
    // Row t of this chunk starts at `base + t · stride`; its channels d0.. at `+ d0`.
    let stride = heads * kdim;
    let base = (tok0 * heads + h) * kdim;
    let bi = i / SUB;
    let a_base = ch_h * chunk * chunk;
    let decay_base = ch_h * subs * kdim;
    // exp(P_i): the gates from the start of i's sub-chunk up to i.
    let mut p = V4::new(0.0f32);
    for t in bi * SUB..i + 1 {
        p += load_cols(g, base + t * stride, d0, kdim);
    }
    let ep = V4::exp(p);
    // Rows j ≤ i, walking back from i: `s` is the sum of the gates in (j, i] while j is in i's
    // sub-chunk; earlier sub-chunks use the anchored factors.
    let mut sq = V4::new(0.0f32);
    let mut sk = V4::new(0.0f32);
    let mut s = V4::new(0.0f32);
    for r in 0..i + 1 {
        let j = i - r;
        if r > 0 {
            s += load_cols(g, base + (j + 1) * stride, d0, kdim);
        }
        let bj = j / SUB;
        let kj = if bj == bi {
            load_cols(k, base + j * stride, d0, kdim) * V4::exp(s)
        } else {
            let mut m = load_cols(ks, base + j * stride, d0, kdim);
            for b in bj + 1..bi {
                m *= load_cols(sub_decay, decay_base + b * kdim, d0, kdim);
            }
            ep * m
        };
        sq += V4::new(d_aqk[a_base + i * chunk + j]) * kj;
        sk += V4::new(d_akk[a_base + i * chunk + j]) * kj;
    }
    store_cols(rq, base + i * stride, d0, kdim, sq);
    store_cols(rk, base + i * stride, d0, kdim, sk);
    // Rows i' ≥ i: `s` is the sum of the gates in (i, i'] while i' is in i's sub-chunk.
    let sub_end = usize::min(bi * SUB + SUB, len);
    let mut x = V4::new(0.0f32);
    for t in i + 1..sub_end {
        x += load_cols(g, base + t * stride, d0, kdim);
    }
    let ex = V4::exp(x);
    let mut c = V4::new(0.0f32);
    s = V4::new(0.0f32);
    for i2 in i..len {
        if i2 > i {
            s += load_cols(g, base + i2 * stride, d0, kdim);
        }
        let b2 = i2 / SUB;
        // exp(G_i2 − G_i), read as one factor, times q or k of row i2 (anchored form across
        // sub-chunks).
        let row2 = base + i2 * stride;
        let (fq, fk) = if b2 == bi {
            let f = V4::exp(s);
            (
                load_cols(q, row2, d0, kdim) * f,
                load_cols(k, row2, d0, kdim) * f,
            )
        } else {
            let mut m = ex;
            for b in bi + 1..b2 {
                m *= load_cols(sub_decay, decay_base + b * kdim, d0, kdim);
            }
            (
                load_cols(qp, row2, d0, kdim) * m,
                load_cols(kp, row2, d0, kdim) * m,
            )
        };
        let beta2 = beta[(tok0 + i2) * heads + h];
        c += V4::new(d_aqk[a_base + i2 * chunk + i]) * fq;
        c += V4::new(d_akk[a_base + i2 * chunk + i] * beta2) * fk;
    }
    store_cols(cc, base + i * stride, d0, kdim, c);
}

/// The gate-side gradients, one unit per (chunk·head, key channel `d`), walking the chunk's rows
/// as [`kda_chunk_gates`](fn@super::kda_chunk_gates) does (every exponent a direct sum ≤ 0):
///
/// ```text
/// dq = rq + dqe Γ                          Γ_i = exp(G_i),  R_i = exp(G_last − G_i)
/// dk = β rk + cc + β Z_w Γ + dke R
/// dG_i = q rq + β k rk − k cc + dqe q Γ + β Z_w k Γ − dke k R
/// dG_last = ddecay exp(G_last) + Σ_i dke k R;    dg_u = dG_last + Σ_{i≥u} dG_i
/// ```
///
/// `dq`, `dk`, `dg: [tokens, heads, kdim]`; `zw` chunk-major as
/// [`kda_chunk_solve_backward`](fn@kda_chunk_solve_backward) writes it.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_gates_backward(
    q: &Array<f32>,
    k: &Array<f32>,
    g: &Array<f32>,
    beta: &Array<f32>,
    rq: &Array<f32>,
    rk: &Array<f32>,
    cc: &Array<f32>,
    dqe: &Array<f32>,
    zw: &Array<f32>,
    dke: &Array<f32>,
    ddecay: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    dq: &mut Array<f32>,
    dk: &mut Array<f32>,
    dg: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    kdim: usize,
    #[comptime] chunk: usize,
) {
    let pos = ABSOLUTE_POS;
    if pos >= chunks * heads * kdim {
        terminate!();
    }
    let d = pos % kdim;
    let ch_h = pos / kdim;
    let h = ch_h % heads;
    let ch = ch_h / heads;
    let tok0 = chunk_tok[ch] as usize;
    let len = chunk_len[ch] as usize;
    let mut total = 0.0f32;
    for i in 0..len {
        let row = (tok0 + i) * heads + h;
        let idx = row * kdim + d;
        total += g[idx];
        let gam = f32::exp(total);
        let qi = q[idx];
        let ki = k[idx];
        let bi = beta[row];
        let a = rq[idx];
        let b = rk[idx];
        let c = cc[idx];
        let e = dqe[idx];
        let z = zw[(ch_h * chunk + i) * kdim + d];
        dq[idx] = a + e * gam;
        dk[idx] = bi * b + c + bi * z * gam;
        dg[idx] = qi * a + bi * ki * b - ki * c + e * qi * gam + bi * z * ki * gam;
    }
    let mut last = ddecay[ch_h * kdim + d] * f32::exp(total);
    let mut rest = 0.0f32;
    for r in 0..len {
        let i = len - 1 - r;
        let idx = ((tok0 + i) * heads + h) * kdim + d;
        let e = dke[idx] * f32::exp(rest);
        let t = e * k[idx];
        dk[idx] += e;
        dg[idx] -= t;
        last += t;
        rest += g[idx];
    }
    let mut acc = last;
    for r in 0..len {
        let i = len - 1 - r;
        let idx = ((tok0 + i) * heads + h) * kdim + d;
        acc += dg[idx];
        dg[idx] = acc;
    }
}

/// The per-row gradients, one unit per (token, head): `dβ = Σ_d k rk + Σ_d Z_w we + Σ_v Z_u v` and
/// `dv = β Z_u` (`we = k ⊙ exp(G)`, `rk` from
/// [`kda_chunk_intra_backward`](fn@kda_chunk_intra_backward)). `dbeta: [tokens, heads]`, `dv:
/// [tokens, heads, vdim]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_rows_backward(
    k: &Array<f32>,
    v: &Array<f32>,
    beta: &Array<f32>,
    we: &Array<f32>,
    rk: &Array<f32>,
    zw: &Array<f32>,
    zu: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    dbeta: &mut Array<f32>,
    dv: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    kdim: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    let pos = ABSOLUTE_POS;
    if pos >= chunks * heads * chunk {
        terminate!();
    }
    let i = pos % chunk;
    let ch_h = pos / chunk;
    let h = ch_h % heads;
    let ch = ch_h / heads;
    if i >= chunk_len[ch] as usize {
        terminate!();
    }
    let row = (chunk_tok[ch] as usize + i) * heads + h;
    let c_row = ch_h * chunk + i;
    let b = beta[row];
    let mut x = 0.0f32;
    for d in 0..kdim {
        let idx = row * kdim + d;
        x += k[idx] * rk[idx] + zw[c_row * kdim + d] * we[idx];
    }
    for c in 0..vdim {
        let z = zu[c_row * vdim + c];
        x += z * v[row * vdim + c];
        dv[row * vdim + c] = b * z;
    }
    dbeta[row] = x;
}
