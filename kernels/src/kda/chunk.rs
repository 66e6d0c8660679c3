//! Chunked KDA forward (design §4.3): gate sums, within-chunk matrices, the triangular solve, the
//! sequential state pass and the parallel output. Layouts as in the [parent module](super);
//! chunks never cross a sequence (`chunk_tok`, `chunk_len: [chunks]` give each chunk's first
//! token and length).

use cubecl::prelude::*;

use super::tile::{
    multiply_slice, place, stage_columns, stage_rows, store_block, zero_block, Place, SLICE,
};
use super::LOOP_BUDGET;
pub(super) use crate::V4;

/// Chunks per launch of [`kda_chunk_state`](fn@kda_chunk_state) and
/// [`kda_chunk_state_backward`](fn@super::kda_chunk_state_backward) (see [`LOOP_BUDGET`]) for
/// chunks of `chunk` tokens and a state tile `[kdim, vt]`.
pub fn chunk_state_window(kdim: usize, vt: usize, chunk: usize) -> usize {
    let cube = STATE_CUBE as usize;
    // An upper bound: counted as if each unit took one `Vn` entry and one state entry per
    // round; the kernels take four columns (and two `Vn` rows) per unit, so they loop at most
    // this often (the windows, and the tests that cross them, stay as they were).
    let v_rounds = (chunk * vt).div_ceil(cube);
    let s_rounds = (kdim * vt).div_ceil(cube);
    // Counted with the backward pass's loops as they were before its state-free terms moved to
    // `kda_chunk_dvn_intra` and `kda_chunk_state_do` (`kdim + chunk` per `Vn` entry, `2·chunk`
    // per state entry; now `kdim` and `chunk`): still an upper bound for both passes.
    let per_chunk = v_rounds * (kdim + chunk + 2) + s_rounds * (2 * chunk + 2) + 2;
    (LOOP_BUDGET / per_chunk).max(1)
}

/// Value columns per cube of [`kda_chunk_state`](fn@kda_chunk_state): its shared state tile `[k,
/// vt]` and `Vn` tile `[chunk, vt]` (f32) stay within 16 KiB.
/// Always a multiple of 4 (32, 16, 8 or 4): the state passes keep four columns per tile entry.
pub fn chunk_state_columns(k: usize, chunk: usize) -> usize {
    let mut vt = 32;
    while vt > 4 && (k + chunk) * vt * 4 > 16 * 1024 {
        vt /= 2;
    }
    vt
}

/// Rows of a sub-chunk: the anchoring block of the chunked kernels (design §4.3).
pub const SUB: usize = 16;
/// Units per cube of [`kda_chunk_intra`](fn@kda_chunk_intra).
pub const INTRA_CUBE: u32 = 256;
/// Units per cube of [`kda_chunk_solve`](fn@kda_chunk_solve).
pub const SOLVE_CUBE: u32 = 64;

/// Chunked KDA, step 0 (design §4.3): the gate sums of every chunk, one unit per (chunk, head,
/// key channel `d`), walking the chunk's rows forward then backward.
///
/// Every exponent formed here is a direct sum of gates over a range, hence ≤ 0 and accurate (no
/// difference of two cumulative sums, which loses the small gates next to a −1000 one):
///
/// ```text
/// qe = q ⊙ exp(G)            we = k ⊙ exp(G)             (G: inclusive sum from the chunk start)
/// ke = k ⊙ exp(G_last − G)   decay = exp(G_last)
/// qp = q ⊙ exp(P), kp = k ⊙ exp(P)   (P: inclusive sum from the start of the row's sub-chunk)
/// ks = k ⊙ exp(X)                    (X: sum over the rest of the row's sub-chunk, row excluded)
/// sub_decay[b] = exp(sum of sub-chunk b)
/// ```
///
/// Token-major arrays are `[tokens, heads, kdim]`; `decay: [chunks, heads, kdim]`,
/// `sub_decay: [chunks, heads, chunk / SUB, kdim]`. `chunk_tok`, `chunk_len: [chunks]` give each
/// chunk's first token and length (≤ `chunk`).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_gates(
    q: &Array<f32>,
    k: &Array<f32>,
    g: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    qe: &mut Array<f32>,
    we: &mut Array<f32>,
    ke: &mut Array<f32>,
    qp: &mut Array<f32>,
    kp: &mut Array<f32>,
    ks: &mut Array<f32>,
    decay: &mut Array<f32>,
    sub_decay: &mut Array<f32>,
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
    let subs = chunk / SUB;
    let mut total = 0.0f32;
    let mut part = 0.0f32;
    for i in 0..len {
        let idx = ((tok0 + i) * heads + h) * kdim + d;
        if i % SUB == 0 {
            part = 0.0f32;
        }
        let gi = g[idx];
        total += gi;
        part += gi;
        let qi = q[idx];
        let ki = k[idx];
        let e = f32::exp(total);
        qe[idx] = qi * e;
        we[idx] = ki * e;
        let p = f32::exp(part);
        qp[idx] = qi * p;
        kp[idx] = ki * p;
        if i % SUB == SUB - 1 || i + 1 == len {
            sub_decay[(ch_h * subs + i / SUB) * kdim + d] = p;
        }
    }
    decay[ch_h * kdim + d] = f32::exp(total);
    let mut rest = 0.0f32;
    let mut rest_sub = 0.0f32;
    for r in 0..len {
        let i = len - 1 - r;
        let idx = ((tok0 + i) * heads + h) * kdim + d;
        if i % SUB == SUB - 1 || i + 1 == len {
            rest_sub = 0.0f32;
        }
        let ki = k[idx];
        ke[idx] = ki * f32::exp(rest);
        ks[idx] = ki * f32::exp(rest_sub);
        let gi = g[idx];
        rest += gi;
        rest_sub += gi;
    }
}

/// Chunked KDA, steps 1 and 4a (design §4.3): the within-chunk matrices, one cube of
/// [`INTRA_CUBE`] units per (chunk, head), each unit a fixed set of entry groups `(i, j0..j0 + 4)`
/// (four columns share the reads of row `i`, the decays and the gate sums):
///
/// ```text
/// A_qk[i,j] = Σ_d q_i k_j exp(G_i − G_j)          (j ≤ i)
/// A_kk[i,j] = β_i Σ_d k_i k_j exp(G_i − G_j)      (j < i)
/// ```
///
/// Pairs in different sub-chunks `bj < bi` use the anchored factors of
/// [`kda_chunk_gates`](fn@kda_chunk_gates): `exp(G_i − G_j) = exp(P_i) · Π_{bj<b<bi} exp(sum of b)
/// · exp(X_j)`, a product of factors ≤ 1. Pairs inside one sub-chunk sum their (at most 15) gates
/// directly. `a_qk`, `a_kk: [chunks, heads, chunk, chunk]`, zero above the diagonal and past the
/// chunk's length.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_intra(
    q: &Array<f32>,
    k: &Array<f32>,
    g: &Array<f32>,
    beta: &Array<f32>,
    qp: &Array<f32>,
    kp: &Array<f32>,
    ks: &Array<f32>,
    sub_decay: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    a_qk: &mut Array<f32>,
    a_kk: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    kdim: usize,
    #[comptime] chunk: usize,
) {
    let ch_h = CUBE_POS;
    if ch_h >= chunks * heads {
        terminate!();
    }
    let h = ch_h % heads;
    let ch = ch_h / heads;
    let tok0 = chunk_tok[ch] as usize;
    let len = chunk_len[ch] as usize;
    let subs = chunk / SUB;
    let base = ch_h * chunk * chunk;
    // Four consecutive columns `j0..j0 + 4` per entry group (one sub-chunk: SUB is a multiple of
    // 4), so the row `i`'s reads, the shared sub-chunk decays and the gate sums serve four entries.
    let qc = chunk / 4;
    let per_unit = comptime!((chunk * chunk / 4).div_ceil(INTRA_CUBE as usize));
    for r in 0..per_unit {
        let e = r * INTRA_CUBE as usize + UNIT_POS as usize;
        let i = e / qc;
        let j0 = 4 * (e % qc);
        let mut aqk = V4::new(0.0f32);
        let mut akk = V4::new(0.0f32);
        if i < chunk && j0 <= i && i < len {
            let row_i = (tok0 + i) * heads + h;
            let bi = i / SUB;
            let bj = j0 / SUB;
            if bi == bj {
                for d in 0..kdim {
                    // Lane `l` sums the gates `u = j0 + l + 1 ..= i` in ascending order.
                    let mut s = V4::new(0.0f32);
                    for u in j0 + 1..i + 1 {
                        let gu = g[((tok0 + u) * heads + h) * kdim + d];
                        #[unroll]
                        for l in 0..4usize {
                            if u > j0 + l {
                                s[l] += gu;
                            }
                        }
                    }
                    let qi = q[row_i * kdim + d];
                    let ki = k[row_i * kdim + d];
                    #[unroll]
                    for l in 0..4usize {
                        if j0 + l <= i {
                            let kj = k[((tok0 + j0 + l) * heads + h) * kdim + d] * f32::exp(s[l]);
                            aqk[l] += qi * kj;
                            akk[l] += ki * kj;
                        }
                    }
                }
            } else {
                for d in 0..kdim {
                    let mut m = V4::new(0.0f32);
                    #[unroll]
                    for l in 0..4usize {
                        m[l] = ks[((tok0 + j0 + l) * heads + h) * kdim + d];
                    }
                    for b in bj + 1..bi {
                        m *= V4::new(sub_decay[(ch_h * subs + b) * kdim + d]);
                    }
                    aqk += V4::new(qp[row_i * kdim + d]) * m;
                    akk += V4::new(kp[row_i * kdim + d]) * m;
                }
            }
            let b_i = beta[row_i];
            #[unroll]
            for l in 0..4usize {
                if j0 + l < i {
                    akk[l] *= b_i;
                } else {
                    akk[l] = 0.0f32;
                }
                if j0 + l > i {
                    aqk[l] = 0.0f32;
                }
            }
        }
        if i < chunk {
            #[unroll]
            for l in 0..4usize {
                a_qk[base + i * chunk + j0 + l] = aqk[l];
                a_kk[base + i * chunk + j0 + l] = akk[l];
            }
        }
    }
}

/// Chunked KDA, steps 2 and 3 (design §4.3): `W = T̃ (exp(G) ⊙ K)` and `U = T̃ V` with `T̃ = (I +
/// A_kk)^{-1} Diag(β)`, by forward substitution on the unit lower-triangular system `(I + A_kk) X =
/// Diag(β) Y`, `col_blocks = ceil((kdim + vdim) / SOLVE_CUBE)` cubes per chunk·head of
/// [`SOLVE_CUBE`] units, each unit solving one column of `Y = [we | V]` (no synchronisation: a
/// column depends only on itself).
///
/// `w: [chunks, heads, chunk, kdim]`, `u: [chunks, heads, chunk, vdim]`; rows past the chunk's
/// length are not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_solve(
    we: &Array<f32>,
    v: &Array<f32>,
    beta: &Array<f32>,
    a_kk: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    w: &mut Array<f32>,
    u: &mut Array<f32>,
    chunks: usize,
    heads: usize,
    col_blocks: usize,
    kdim: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    // One column per unit and no loop over column blocks: a unit looping over several blocks ran
    // past lavapipe's per-invocation loop limit (see `LOOP_BUDGET`) from the third block on.
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `col_blocks` per chunk·head.
    let id = CUBE_POS;
    let ch_h = id / col_blocks;
    let col = (id % col_blocks) * SOLVE_CUBE as usize + UNIT_POS as usize;
    if ch_h >= chunks * heads || col >= kdim + vdim {
        terminate!();
    }
    let h = ch_h % heads;
    let ch = ch_h / heads;
    let tok0 = chunk_tok[ch] as usize;
    let len = chunk_len[ch] as usize;
    let a_base = ch_h * chunk * chunk;
    if col < kdim {
        for i in 0..len {
            let row = (tok0 + i) * heads + h;
            let mut x = beta[row] * we[row * kdim + col];
            for j in 0..i {
                x -= a_kk[a_base + i * chunk + j] * w[(ch_h * chunk + j) * kdim + col];
            }
            w[(ch_h * chunk + i) * kdim + col] = x;
        }
    } else {
        let c = col - kdim;
        for i in 0..len {
            let row = (tok0 + i) * heads + h;
            let mut x = beta[row] * v[row * vdim + c];
            for j in 0..i {
                x -= a_kk[a_base + i * chunk + j] * u[(ch_h * chunk + j) * vdim + c];
            }
            u[(ch_h * chunk + i) * vdim + c] = x;
        }
    }
}

/// Units per cube of [`kda_chunk_state`](fn@kda_chunk_state) and
/// [`kda_chunk_state_backward`](fn@super::kda_chunk_state_backward).
pub const STATE_CUBE: u32 = 256;

/// Chunked KDA, step 4 (design §4.3): the sequential pass over the chunks of each sequence, one
/// cube of [`STATE_CUBE`] units per (value tile, sequence·head) holding the state tile `[kdim, vt]`
/// (f32) and the tile of `Vn` in shared memory. Per chunk, two phases separated by barriers, each
/// spreading its entries over the cube:
///
/// ```text
/// Vn = U − W S;   S ← Diag(exp(G_last)) S + (K ⊙ exp(G_last − G))ᵀ Vn
/// ```
///
/// It stores the state entering every chunk (`states: [chunks, heads, kdim, vdim]`) and `Vn` (`vn:
/// [chunks, heads, chunk, vdim]`), from which [`kda_chunk_output`](fn@kda_chunk_output) forms the
/// output of all chunks in parallel and the backward recomputes nothing sequential. Every entry has
/// one writer, so reruns are bit-identical; columns past `vdim` in the last tile compute zeros and
/// are not written. `seq_chunk: [N + 1]` gives each sequence's chunk range; one launch covers its
/// chunks `[window_lo, window_lo + window_len)` (see [`chunk_state_window`]); `state: [N, heads,
/// kdim, vdim]` holds `S_0` on entry to the first window and `S_T` on exit from the last.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_state(
    ke: &Array<f32>,
    decay: &Array<f32>,
    w: &Array<f32>,
    u: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    seq_chunk: &Array<u32>,
    state: &mut Array<f32>,
    states: &mut Array<f32>,
    vn_out: &mut Array<f32>,
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
    // The tiles hold four consecutive columns per entry ([`V4`]); each unit computes two rows of
    // four `Vn` columns, then one state row of four columns, so one shared read feeds four (or
    // eight) multiply-adds. Each phase walks a comptime count of strided entries; a unit's loop
    // iterations per chunk stay small (see `chunk_state_window`).
    let q = comptime!(vt / 4);
    let s_rounds = comptime!((kdim * vt / 4).div_ceil(STATE_CUBE as usize));
    let v_rounds = comptime!((chunk.div_ceil(2) * vt / 4).div_ceil(STATE_CUBE as usize));
    let mut s = SharedMemory::<V4>::new(kdim * q);
    let mut vn = SharedMemory::<V4>::new(chunk.div_ceil(2) * 2 * q);
    let s_base = nh * kdim * vdim;
    load_state_tile(state, &mut s, s_base, col0, vdim, kdim, vt);
    let seq_last = seq_chunk[n + 1] as usize;
    let first = usize::min(seq_chunk[n] as usize + window_lo, seq_last);
    let last = usize::min(first + window_len, seq_last);
    for ch in first..last {
        let ch_h = ch * heads + h;
        let tok0 = chunk_tok[ch] as usize;
        let len = chunk_len[ch] as usize;
        for r in 0..v_rounds {
            let e = r * cube + unit;
            let i0 = 2 * (e / q);
            let cq = e % q;
            if i0 < len {
                // Row i0 + 1 may lie past the chunk's length: it is computed from a row of `w`
                // inside the chunk's buffer and never stored.
                let two = i0 + 1 < len;
                let col = col0 + 4 * cq;
                let row0 = (ch_h * chunk + i0) * vdim;
                let mut x0 = load_cols(u, row0, col, vdim);
                let mut x1 = V4::new(0.0f32);
                if two {
                    x1 = load_cols(u, row0 + vdim, col, vdim);
                }
                let w0 = (ch_h * chunk + i0) * kdim;
                let mut w1 = w0;
                if i0 + 1 < chunk {
                    w1 = w0 + kdim;
                }
                for d in 0..kdim {
                    let sv = s[d * q + cq];
                    x0 -= V4::new(w[w0 + d]) * sv;
                    x1 -= V4::new(w[w1 + d]) * sv;
                }
                vn[i0 * q + cq] = x0;
                store_cols(vn_out, row0, col, vdim, x0);
                if two {
                    vn[(i0 + 1) * q + cq] = x1;
                    store_cols(vn_out, row0 + vdim, col, vdim, x1);
                }
            }
        }
        sync_cube();
        for r in 0..s_rounds {
            let e = r * cube + unit;
            if e < kdim * q {
                let d = e / q;
                let cq = e % q;
                let old = s[e];
                store_cols(states, (ch_h * kdim + d) * vdim, col0 + 4 * cq, vdim, old);
                let mut x = V4::new(decay[ch_h * kdim + d]) * old;
                for i in 0..len {
                    x += V4::new(ke[((tok0 + i) * heads + h) * kdim + d]) * vn[i * q + cq];
                }
                s[e] = x;
            }
        }
        sync_cube();
    }
    store_state_tile(&s, state, s_base, col0, vdim, kdim, vt);
}

/// `src[base + col + j]` for the four columns `col + j` below `vdim` (zeros past it).
#[cube]
pub(super) fn load_cols<F: Float>(src: &Array<F>, base: usize, col: usize, vdim: usize) -> V4 {
    let mut v = V4::new(0.0f32);
    #[unroll]
    for j in 0..4usize {
        if col + j < vdim {
            v[j] = f32::cast_from(src[base + col + j]);
        }
    }
    v
}

/// Writes the columns of `v` below `vdim` to `dst[base + col + j]`.
#[cube]
pub(super) fn store_cols(dst: &mut Array<f32>, base: usize, col: usize, vdim: usize, v: V4) {
    #[unroll]
    for j in 0..4usize {
        if col + j < vdim {
            dst[base + col + j] = v[j];
        }
    }
}

/// Loads columns `[col0, col0 + vt)` of the `[kdim, vdim]` state at `base` into the shared tile
/// of [`V4`]s `[kdim, vt / 4]` (zeros past `vdim`), spread over the cube, then synchronises it.
#[cube]
pub(super) fn load_state_tile(
    src: &Array<f32>,
    tile: &mut SharedMemory<V4>,
    base: usize,
    col0: usize,
    vdim: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
) {
    let q = comptime!(vt / 4);
    let rounds = comptime!((kdim * vt / 4).div_ceil(STATE_CUBE as usize));
    for r in 0..rounds {
        let e = r * STATE_CUBE as usize + UNIT_POS as usize;
        if e < kdim * q {
            tile[e] = load_cols(src, base + (e / q) * vdim, col0 + 4 * (e % q), vdim);
        }
    }
    sync_cube();
}

/// Writes the shared tile back: the inverse of [`load_state_tile`](fn@load_state_tile) (columns
/// past `vdim` are dropped). The tile must be synchronised.
#[cube]
pub(super) fn store_state_tile(
    tile: &SharedMemory<V4>,
    dst: &mut Array<f32>,
    base: usize,
    col0: usize,
    vdim: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
) {
    let q = comptime!(vt / 4);
    let rounds = comptime!((kdim * vt / 4).div_ceil(STATE_CUBE as usize));
    for r in 0..rounds {
        let e = r * STATE_CUBE as usize + UNIT_POS as usize;
        if e < kdim * q {
            store_cols(
                dst,
                base + (e / q) * vdim,
                col0 + 4 * (e % q),
                vdim,
                tile[e],
            );
        }
    }
}

/// Chunked KDA, step 5 (design §4.3): the output of every chunk at once from the states stored by
/// [`kda_chunk_state`](fn@kda_chunk_state),
///
/// ```text
/// O = (q ⊙ exp(G)) S + A_qk Vn  =  [qe | A_qk] · [S ; Vn]
/// ```
///
/// as one tiled product (see [`SLICE`]) of depth `kdim + len`, one cube per
/// (chunk·head, tile of `cols` value columns, [`tile_columns`](super::tile_columns)) of
/// [`tile_units`](super::tile_units)`(chunk, cols)` units. `Vn`'s rows past the chunk's length
/// (never written) are read as zeros.
///
/// `tiles = ceil(vdim / cols)` cubes per chunk·head; `out: [tokens, heads, vdim]`, rows past a
/// chunk's length are not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn kda_chunk_output(
    qe: &Array<f32>,
    a_qk: &Array<f32>,
    states: &Array<f32>,
    vn: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    out: &mut Array<f32>,
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
    let mut left = SharedMemory::<V4>::new(SLICE * rq_n);
    let mut right = SharedMemory::<V4>::new(SLICE * cq_n);
    let mut acc = zero_block();
    let rows = (tok0 * heads + h) * kdim;
    for s in 0..comptime!(kdim.div_ceil(SLICE)) {
        let d0 = s * SLICE;
        stage_rows(
            qe,
            &mut left,
            rows,
            heads * kdim,
            len,
            d0,
            kdim,
            rq_n,
            units,
        );
        let s_base = ch_h * kdim * vdim;
        stage_columns(
            states, &mut right, s_base, vdim, d0, kdim, col0, vdim, cq_n, units,
        );
        sync_cube();
        multiply_slice(&mut acc, &left, &right, rq, cq, rq_n, cq_n);
        sync_cube();
    }
    for s in 0..(len + SLICE - 1) / SLICE {
        let j0 = s * SLICE;
        stage_rows(
            a_qk,
            &mut left,
            ch_h * chunk * chunk,
            chunk,
            len,
            j0,
            chunk,
            rq_n,
            units,
        );
        let v_base = ch_h * chunk * vdim;
        stage_columns(
            vn, &mut right, v_base, vdim, j0, len, col0, vdim, cq_n, units,
        );
        sync_cube();
        multiply_slice(&mut acc, &left, &right, rq, cq, rq_n, cq_n);
        sync_cube();
    }
    let o_base = (tok0 * heads + h) * vdim;
    store_block(
        out,
        &acc,
        o_base,
        heads * vdim,
        4 * rq,
        len,
        col0 + 4 * cq,
        vdim,
    );
}
