//! The KDA recurrence, one token at a time with the state on chip (decode), and the state buffer
//! it updates in place.

use cubecl::prelude::*;

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
/// ([`kda_recurrent`](fn@kda_recurrent), [`kda_chunk_state`](fn@super::chunk::kda_chunk_state)) keep their state
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
#[cube(launch_unchecked)]
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

/// `out[i] = src[i]` when `copy`, else 0, for `i < len` (a fresh state buffer the recurrence may
/// update in place). One unit per element.
#[cube(launch_unchecked)]
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
