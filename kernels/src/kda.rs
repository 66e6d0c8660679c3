//! Kimi Delta Attention kernels (SPEC §4): the token-by-token recurrence for decode and the gated
//! output norm.
//!
//! Layout: tokens of every sequence are contiguous along one axis (`[B·T, H, X]` for `B` rows of
//! length `T`, or the packed `[ΣT_n, H, X]`); `seq_start: [N + 1]` gives each sequence's token
//! range, so unpacked and packed batches take the same kernels. States are `[N, H, K, V]` f32.
//! Inputs arrive in f32 with `q` already scaled (and L2-normalised when asked).
//!
//! No float atomics: every output element has one writer, so reruns are bit-identical.

use cubecl::prelude::*;

/// Value columns per cube of [`kda_recurrent`] for a key dim `k`: the state tile `[k, vt]` f32
/// lives in shared memory, kept at 16 KiB (lavapipe has 32 KiB).
pub fn recurrent_columns(k: usize) -> usize {
    if k <= 128 {
        32
    } else {
        16
    }
}

/// Loop iterations one unit of a sequential KDA kernel may run per launch.
///
/// Mesa's software rasteriser (llvmpipe, and lavapipe, its Vulkan driver) stops every loop of a
/// shader invocation once the invocation has run 65 535 loop iterations in total, silently: the
/// kernel carries on with wrong values. The sequential kernels ([`kda_recurrent`],
/// [`kda_chunk_state`]) keep their state in global memory between launches, so the host splits
/// long inputs into windows of tokens or chunks that stay well under that limit (half of it).
/// On GPUs this only adds a launch per window (a few per 10⁴ tokens for the chunked kernel).
pub const LOOP_BUDGET: usize = 32_768;

/// Tokens per launch of [`kda_recurrent`] (see [`LOOP_BUDGET`]): each token runs two loops over
/// `kdim` and one strided load loop.
pub fn recurrent_window(kdim: usize, vt: usize) -> usize {
    let per_token = 2 * kdim + kdim.div_ceil(vt) + 2;
    (LOOP_BUDGET / per_token).max(1)
}

/// Chunks per launch of [`kda_chunk_state`] (see [`LOOP_BUDGET`]) for chunks of `chunk` tokens
/// and a state tile `[kdim, vt]`.
pub fn chunk_state_window(kdim: usize, vt: usize, chunk: usize) -> usize {
    let cube = STATE_CUBE as usize;
    let v_rounds = (chunk * vt).div_ceil(cube);
    let s_rounds = (kdim * vt).div_ceil(cube);
    let per_chunk = v_rounds * (2 * kdim + chunk + 2) + s_rounds * (chunk + 1) + 1;
    (LOOP_BUDGET / per_chunk).max(1)
}

/// The KDA recurrence (SPEC §4.1), state in f32 and on chip, per sequence, head and tile of
/// value columns:
///
/// ```text
/// S ← Diag(exp(g_t)) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ q_t
/// ```
///
/// `q, k, g: [tokens, heads, kdim]`, `v: [tokens, heads, vdim]`, `beta: [tokens, heads]`,
/// `seq_start: [N + 1]`, `state: [N, heads, kdim, vdim]` (read as `S_0`, overwritten with `S_T`:
/// updated in place), `out: [tokens, heads, vdim]`.
///
/// Grid `(ceil(vdim / vt), N·heads)`, cubes of `vt` units; unit `u` owns state column
/// `vt·CUBE_POS_X + u` and the cube shares `q_t`, `k_t`, `exp(g_t)`. One launch covers the
/// tokens `[window_lo, window_lo + window_len)` of every sequence (counted from its start; see
/// [`recurrent_window`]); the host launches successive windows.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn kda_recurrent(
    q: &Array<f32>,
    k: &Array<f32>,
    v: &Array<f32>,
    g: &Array<f32>,
    beta: &Array<f32>,
    seq_start: &Array<u32>,
    state: &mut Array<f32>,
    out: &mut Array<f32>,
    heads: usize,
    vdim: usize,
    window_lo: usize,
    window_len: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
) {
    let u = UNIT_POS as usize;
    let col = CUBE_POS_X as usize * vt + u;
    let nh = CUBE_POS_Y as usize;
    let n = nh / heads;
    let h = nh % heads;
    let active = col < vdim;
    let mut sq = SharedMemory::<f32>::new(kdim);
    let mut sk = SharedMemory::<f32>::new(kdim);
    let mut sd = SharedMemory::<f32>::new(kdim);
    let mut s = SharedMemory::<f32>::new(kdim * vt);
    let base = nh * kdim * vdim;
    for d in 0..kdim {
        let mut x = 0.0f32;
        if active {
            x = state[base + d * vdim + col];
        }
        s[d * vt + u] = x;
    }
    let seq_end = seq_start[n + 1] as usize;
    let start = usize::min(seq_start[n] as usize + window_lo, seq_end);
    let end = usize::min(start + window_len, seq_end);
    for tok in start..end {
        let row = tok * heads + h;
        // The previous step's reads of sq, sk, sd are done before they are overwritten.
        sync_cube();
        let mut d = u;
        while d < kdim {
            sq[d] = q[row * kdim + d];
            sk[d] = k[row * kdim + d];
            sd[d] = f32::exp(g[row * kdim + d]);
            d += vt;
        }
        sync_cube();
        if active {
            let mut pred = 0.0f32;
            for d in 0..kdim {
                let x = s[d * vt + u] * sd[d];
                s[d * vt + u] = x;
                pred += x * sk[d];
            }
            let delta = beta[row] * (v[row * vdim + col] - pred);
            let mut o = 0.0f32;
            for d in 0..kdim {
                let x = s[d * vt + u] + sk[d] * delta;
                s[d * vt + u] = x;
                o += x * sq[d];
            }
            out[row * vdim + col] = o;
        }
    }
    if active {
        for d in 0..kdim {
            state[base + d * vdim + col] = s[d * vt + u];
        }
    }
}

/// Units per cube of the row-wise norm kernels (a power of two).
pub const NORM_CUBE: u32 = 32;

/// `σ(x) = ½ + ½·tanh(x/2)`, the reference path's formula; cannot overflow.
// `f32::clamp` is not part of CubeCL's cube-function surface; min/max is.
#[allow(clippy::manual_clamp)]
#[cube]
fn sigmoid(x: f32) -> f32 {
    0.5 + 0.5 * f32::tanh(f32::min(f32::max(x * 0.5, -15.0), 15.0))
}

/// Sum of `x` over the cube, by a fixed-order tree in shared memory (every unit gets the result).
#[cube]
fn cube_sum(x: f32, #[comptime] cube: u32) -> f32 {
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

/// Gated RMSNorm forward (SPEC §4.2): per row of `cols`,
/// `y = o / sqrt(mean(o²) + eps) · w ⊙ σ(z)`, statistics and gate in f32.
///
/// `o, z, y: [rows, cols]` in `F`, `weight: [cols]` f32. One cube of [`NORM_CUBE`] units per row
/// (`rows` cubes; extras exit).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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
/// `dw_partial: [rows, cols]` f32 is summed over rows by [`column_sum`] (no atomics). Launch as
/// [`rms_norm_gated_forward`].
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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

/// `out[c] = Σ_row x[row, c]` in row order (deterministic), one unit per column.
#[cube(launch)]
pub fn column_sum(x: &Array<f32>, out: &mut Array<f32>, rows: usize, cols: usize) {
    let c = ABSOLUTE_POS;
    if c >= cols {
        terminate!();
    }
    let mut acc = 0.0f32;
    for r in 0..rows {
        acc += x[r * cols + c];
    }
    out[c] = acc;
}

/// `out[i] = src[i]` when `copy`, else 0, for `i < len` (a fresh state buffer the recurrence may
/// update in place). One unit per element.
#[cube(launch)]
pub fn init_state(src: &Array<f32>, out: &mut Array<f32>, len: usize, #[comptime] copy: bool) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    if comptime!(copy) {
        out[i] = src[i];
    } else {
        out[i] = 0.0f32;
    }
}

/// Value columns per cube of [`kda_chunk_state`]: its shared state tile `[k, vt]` and `Vn` tile
/// `[chunk, vt]` (f32) stay within 16 KiB.
pub fn chunk_state_columns(k: usize, chunk: usize) -> usize {
    let mut vt = 32;
    while vt > 4 && (k + chunk) * vt * 4 > 16 * 1024 {
        vt /= 2;
    }
    vt
}

/// Rows of a sub-chunk: the anchoring block of the chunked kernels (SPEC §4.3).
pub const SUB: usize = 16;
/// Units per cube of [`kda_chunk_intra`].
pub const INTRA_CUBE: u32 = 256;
/// Units per cube of [`kda_chunk_solve`].
pub const SOLVE_CUBE: u32 = 64;

/// Chunked KDA, step 0 (SPEC §4.3): the gate sums of every chunk, one unit per (chunk, head,
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
#[cube(launch)]
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

/// Chunked KDA, steps 1 and 4a (SPEC §4.3): the within-chunk matrices, one cube of
/// [`INTRA_CUBE`] units per (chunk, head), each unit a fixed set of entries `(i, j)`:
///
/// ```text
/// A_qk[i,j] = Σ_d q_i k_j exp(G_i − G_j)          (j ≤ i)
/// A_kk[i,j] = β_i Σ_d k_i k_j exp(G_i − G_j)      (j < i)
/// ```
///
/// Pairs in different sub-chunks `bj < bi` use the anchored factors of [`kda_chunk_gates`]:
/// `exp(G_i − G_j) = exp(P_i) · Π_{bj<b<bi} exp(sum of b) · exp(X_j)`, a product of factors ≤ 1.
/// Pairs inside one sub-chunk sum their (at most 15) gates directly. `a_qk`, `a_kk:
/// [chunks, heads, chunk, chunk]`, zero above the diagonal and past the chunk's length.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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
    let per_unit = comptime!(chunk * chunk / INTRA_CUBE as usize);
    for r in 0..per_unit {
        let e = r * INTRA_CUBE as usize + UNIT_POS as usize;
        let i = e / chunk;
        let j = e % chunk;
        let mut aqk = 0.0f32;
        let mut akk = 0.0f32;
        if j <= i && i < len {
            let row_i = (tok0 + i) * heads + h;
            let row_j = (tok0 + j) * heads + h;
            let bi = i / SUB;
            let bj = j / SUB;
            if bi == bj {
                for d in 0..kdim {
                    let mut s = 0.0f32;
                    for u in j + 1..i + 1 {
                        s += g[((tok0 + u) * heads + h) * kdim + d];
                    }
                    let kj = k[row_j * kdim + d] * f32::exp(s);
                    aqk += q[row_i * kdim + d] * kj;
                    akk += k[row_i * kdim + d] * kj;
                }
            } else {
                for d in 0..kdim {
                    let mut m = ks[row_j * kdim + d];
                    for b in bj + 1..bi {
                        m *= sub_decay[(ch_h * subs + b) * kdim + d];
                    }
                    aqk += qp[row_i * kdim + d] * m;
                    akk += kp[row_i * kdim + d] * m;
                }
            }
            if j < i {
                akk *= beta[row_i];
            } else {
                akk = 0.0f32;
            }
        }
        a_qk[base + i * chunk + j] = aqk;
        a_kk[base + i * chunk + j] = akk;
    }
}

/// Chunked KDA, steps 2 and 3 (SPEC §4.3): `W = T̃ (exp(G) ⊙ K)` and `U = T̃ V` with
/// `T̃ = (I + A_kk)^{-1} Diag(β)`, by forward substitution on the unit lower-triangular system
/// `(I + A_kk) X = Diag(β) Y`, grid `(ceil((kdim + vdim) / SOLVE_CUBE), chunks·heads)` of
/// [`SOLVE_CUBE`] units, each unit solving one column of `Y = [we | V]` (no synchronisation: a
/// column depends only on itself).
///
/// `w: [chunks, heads, chunk, kdim]`, `u: [chunks, heads, chunk, vdim]`; rows past the chunk's
/// length are not written.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
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
    kdim: usize,
    vdim: usize,
    #[comptime] chunk: usize,
) {
    // One column per unit and no loop over column blocks: a `while` loop over column blocks
    // around these row loops miscompiled on wgpu/lavapipe (wrong results from the third block on).
    let ch_h = CUBE_POS_Y as usize;
    let col = CUBE_POS_X as usize * SOLVE_CUBE as usize + UNIT_POS as usize;
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

/// Units per cube of [`kda_chunk_state`].
pub const STATE_CUBE: u32 = 256;

/// Chunked KDA, step 4 (SPEC §4.3): the sequential pass over the chunks of each sequence, one
/// cube of [`STATE_CUBE`] units per (value tile, sequence·head) holding the state tile `[kdim, vt]`
/// (f32) and the tile of `Vn` in shared memory. Per chunk, three phases separated by barriers,
/// each spreading its entries over the cube:
///
/// ```text
/// Vn = U − W S;   O = (q ⊙ exp(G)) S + A_qk Vn;   S ← Diag(exp(G_last)) S + (K ⊙ exp(G_last − G))ᵀ Vn
/// ```
///
/// Every entry has one writer, so reruns are bit-identical. Columns past `vdim` in the last
/// tile compute zeros and are not written. `seq_chunk: [N + 1]` gives each sequence's chunk
/// range; one launch covers its chunks `[window_lo, window_lo + window_len)` (see
/// [`chunk_state_window`]); `state: [N, heads, kdim, vdim]` holds `S_0` on entry and `S_T` on exit;
/// `out: [tokens, heads, vdim]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn kda_chunk_state(
    qe: &Array<f32>,
    ke: &Array<f32>,
    decay: &Array<f32>,
    w: &Array<f32>,
    u: &Array<f32>,
    a_qk: &Array<f32>,
    chunk_tok: &Array<u32>,
    chunk_len: &Array<u32>,
    seq_chunk: &Array<u32>,
    state: &mut Array<f32>,
    out: &mut Array<f32>,
    heads: usize,
    vdim: usize,
    window_lo: usize,
    window_len: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
    #[comptime] chunk: usize,
) {
    let unit = UNIT_POS as usize;
    let col0 = CUBE_POS_X as usize * vt;
    let nh = CUBE_POS_Y as usize;
    let n = nh / heads;
    let h = nh % heads;
    let cube = STATE_CUBE as usize;
    // Loops over a comptime count of strided entries (`while` loops around these bodies have
    // miscompiled on lavapipe).
    let s_rounds = comptime!((kdim * vt).div_ceil(STATE_CUBE as usize));
    let v_rounds = comptime!((chunk * vt).div_ceil(STATE_CUBE as usize));
    let mut s = SharedMemory::<f32>::new(kdim * vt);
    let mut vn = SharedMemory::<f32>::new(chunk * vt);
    let s_base = nh * kdim * vdim;
    for r in 0..s_rounds {
        let e = r * cube + unit;
        if e < kdim * vt {
            let col = col0 + e % vt;
            let mut x = 0.0f32;
            if col < vdim {
                x = state[s_base + (e / vt) * vdim + col];
            }
            s[e] = x;
        }
    }
    sync_cube();
    let seq_last = seq_chunk[n + 1] as usize;
    let first = usize::min(seq_chunk[n] as usize + window_lo, seq_last);
    let last = usize::min(first + window_len, seq_last);
    for ch in first..last {
        let ch_h = ch * heads + h;
        let tok0 = chunk_tok[ch] as usize;
        let len = chunk_len[ch] as usize;
        for r in 0..v_rounds {
            let e = r * cube + unit;
            let i = e / vt;
            let c = e % vt;
            if i < len {
                let col = col0 + c;
                let mut x = 0.0f32;
                if col < vdim {
                    x = u[(ch_h * chunk + i) * vdim + col];
                }
                let w_row = (ch_h * chunk + i) * kdim;
                for d in 0..kdim {
                    x -= w[w_row + d] * s[d * vt + c];
                }
                vn[e] = x;
            }
        }
        sync_cube();
        for r in 0..v_rounds {
            let e = r * cube + unit;
            let i = e / vt;
            let c = e % vt;
            let col = col0 + c;
            if i < len && col < vdim {
                let row = (tok0 + i) * heads + h;
                let mut o = 0.0f32;
                for d in 0..kdim {
                    o += qe[row * kdim + d] * s[d * vt + c];
                }
                let a_row = (ch_h * chunk + i) * chunk;
                for j in 0..i + 1 {
                    o += a_qk[a_row + j] * vn[j * vt + c];
                }
                out[row * vdim + col] = o;
            }
        }
        sync_cube();
        for r in 0..s_rounds {
            let e = r * cube + unit;
            if e < kdim * vt {
                let d = e / vt;
                let c = e % vt;
                let mut x = decay[ch_h * kdim + d] * s[e];
                for i in 0..len {
                    x += ke[((tok0 + i) * heads + h) * kdim + d] * vn[i * vt + c];
                }
                s[e] = x;
            }
        }
        sync_cube();
    }
    for r in 0..s_rounds {
        let e = r * cube + unit;
        let col = col0 + e % vt;
        if e < kdim * vt && col < vdim {
            state[s_base + (e / vt) * vdim + col] = s[e];
        }
    }
}
