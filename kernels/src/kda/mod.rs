//! Kimi Delta Attention kernels (design §4): the token-by-token recurrence for decode, the chunked
//! form for training and prefill (forward in `chunk`, backward in `chunk_backward`, re-exported
//! here), the short convolution for prefill and decode (`conv`) and the gated output norm.
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

pub use chunk::*;
pub use chunk_backward::*;
pub use conv::*;

/// Value columns per cube of [`kda_recurrent`](fn@kda_recurrent) for a key dim `k`: the state tile
/// `[k, vt]` f32 lives in shared memory, kept at 16 KiB (lavapipe has 32 KiB).
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
/// kernel carries on with wrong values. The sequential kernels
/// ([`kda_recurrent`](fn@kda_recurrent), [`kda_chunk_state`](fn@kda_chunk_state)) keep their state
/// in global memory between launches, so the host splits long inputs into windows of tokens or
/// chunks that stay well under that limit (half of it). On GPUs this only adds a launch per window
/// (a few per 10⁴ tokens for the chunked kernel).
pub const LOOP_BUDGET: usize = 32_768;

/// Tokens per launch of [`kda_recurrent`](fn@kda_recurrent) (see [`LOOP_BUDGET`]): each token runs
/// two loops over `kdim` and one strided load loop.
pub fn recurrent_window(kdim: usize, vt: usize) -> usize {
    let per_token = 2 * kdim + kdim.div_ceil(vt) + 2;
    (LOOP_BUDGET / per_token).max(1)
}

/// The KDA recurrence (design §4.1), state in f32 and on chip, per sequence, head and tile of
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
/// `tiles = ceil(vdim / vt)` cubes of `vt` units per sequence·head (`seq_heads = N·heads` of them),
/// spread linearly over the hardware grid (no dimension of it may pass 65 535); unit `u` owns state
/// column `vt·(CUBE_POS mod tiles) + u` and the cube shares `q_t`, `k_t`, `exp(g_t)`. One launch covers the
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
    tiles: usize,
    seq_heads: usize,
    vdim: usize,
    window_lo: usize,
    window_len: usize,
    #[comptime] kdim: usize,
    #[comptime] vt: usize,
) {
    let u = UNIT_POS as usize;
    // Cubes spread over the hardware grid (`CUBE_POS` linear): `tiles` per sequence·head.
    let id = CUBE_POS;
    if id >= tiles * seq_heads {
        terminate!();
    }
    let col = (id % tiles) * vt + u;
    let nh = id / tiles;
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

/// `σ(x)` in the reference path's cancellation-free form ([`crate::situ::sigmoid_pair`]).
#[cube]
fn sigmoid(x: f32) -> f32 {
    let (s, _c) = crate::situ::sigmoid_pair(x);
    s
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

/// Gated RMSNorm forward (design §4.2): per row of `cols`,
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
/// `dw_partial: [rows, cols]` f32 is summed over rows by [`column_sum`](fn@column_sum) (no
/// atomics). Launch as [`rms_norm_gated_forward`](fn@rms_norm_gated_forward).
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
