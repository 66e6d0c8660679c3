//! Dropless MoE dispatch on the device (SPEC §2): a stable counting sort of the `(token, expert)`
//! pairs by expert, a grouped (segmented) matmul over the expert-contiguous rows, and the
//! un-permute as a gather-sum.
//!
//! The pairs are `[tokens, k]` row-major, pair `i = token·k + slot`. The sort is stable (pairs keep
//! their order within an expert), so the device plan equals the host `DispatchPlan`:
//!
//! 1. [`moe_block_ranks`]: pairs in blocks of [`PLAN_BLOCK`]; per pair its rank among the earlier
//!    pairs of its block with the same expert, per (block, expert) the count.
//! 2. [`moe_block_scan`]: per expert, the exclusive scan of its block counts and its total.
//! 3. [`moe_offsets`]: the segment offsets `[n + 1]` and the matmul tile offsets `[n + 1]`.
//! 4. [`moe_place`]: each pair's sorted position; `sorted_token`, the routing weight in sorted
//!    order, and the inverse map `inv[pair] = position` ([`NONE`] for masked tokens).
//!
//! Nothing is read back to the host: buffers are sized for all `tokens·k` pairs and the kernels
//! find the segment bounds on the device. No float atomics anywhere, so every output is
//! bit-reproducible.

use cubecl::prelude::*;

/// Pairs per block of the plan's counting sort (= the cube size of [`moe_block_ranks`]).
pub const PLAN_BLOCK: u32 = 256;
/// Rows (and columns) of one grouped-matmul output tile.
pub const TILE: u32 = 64;
/// Depth of one shared-memory slice of the grouped matmul.
pub const TILE_K: u32 = 16;
/// The grouped matmuls run on a `GMM_CUBE × GMM_CUBE` cube, each unit owning a 4×4 micro-tile.
pub const GMM_CUBE: u32 = 16;
/// Marks a pair that is not dispatched (its token is masked) in `inv`.
pub const NONE: u32 = u32::MAX;

/// Step 1 of the plan. `indices: [pairs]` expert of each pair, `valid: [tokens]` (read when
/// `masked`), `local_rank: [pairs]` out, `block_counts: [blocks, n]` out (zero it first).
/// Launch `ceil(pairs / PLAN_BLOCK)` cubes of `PLAN_BLOCK` units.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn moe_block_ranks<I: Int>(
    indices: &Array<I>,
    valid: &Array<u32>,
    local_rank: &mut Array<u32>,
    block_counts: &mut Array<u32>,
    pairs: usize,
    k: usize,
    n: usize,
    #[comptime] masked: bool,
    #[define(I)] _dtype: StorageType,
) {
    let block = CUBE_POS;
    if block * PLAN_BLOCK as usize >= pairs {
        terminate!();
    }
    let u = UNIT_POS as usize;
    let i = block * PLAN_BLOCK as usize + u;
    let mut e = n as u32;
    if i < pairs {
        e = u32::cast_from(indices[i]);
        if comptime!(masked) {
            if valid[i / k] == 0u32 {
                e = n as u32;
            }
        }
    }
    let mut experts = SharedMemory::<u32>::new(PLAN_BLOCK as usize);
    experts[u] = e;
    sync_cube();
    if e < n as u32 {
        let mut before: u32 = 0;
        let mut later: u32 = 0;
        for j in 0..PLAN_BLOCK as usize {
            let same = experts[j] == e;
            if same && j < u {
                before += 1u32;
            }
            if same && j > u {
                later += 1u32;
            }
        }
        local_rank[i] = before;
        if later == 0u32 {
            block_counts[block * n + e as usize] = before + 1u32;
        }
    }
}

/// Step 2 of the plan: one unit per expert scans its column of `block_counts: [blocks, n]` into
/// `block_base: [blocks, n]` (exclusive) and writes the expert's total to `totals: [n]`.
#[cube(launch)]
pub fn moe_block_scan(
    block_counts: &Array<u32>,
    block_base: &mut Array<u32>,
    totals: &mut Array<u32>,
    blocks: usize,
    n: usize,
) {
    let e = ABSOLUTE_POS;
    if e >= n {
        terminate!();
    }
    let mut run = 0u32;
    for b in 0..blocks {
        let c = block_counts[b * n + e];
        block_base[b * n + e] = run;
        run += c;
    }
    totals[e] = run;
}

/// Step 3 of the plan (a single unit; `n` is at most a few thousand): segment offsets
/// `offsets: [n + 1]` and grouped-matmul tile offsets `tile_offsets: [n + 1]` (expert `e` owns
/// tiles `tile_offsets[e]..tile_offsets[e+1]`, [`TILE`] rows each).
#[cube(launch)]
pub fn moe_offsets(
    totals: &Array<u32>,
    offsets: &mut Array<u32>,
    tile_offsets: &mut Array<u32>,
    n: usize,
) {
    if ABSOLUTE_POS == 0 {
        let mut acc = 0u32;
        let mut tiles = 0u32;
        for e in 0..n {
            offsets[e] = acc;
            tile_offsets[e] = tiles;
            let c = totals[e];
            acc += c;
            tiles += (c + TILE - 1u32) / TILE;
        }
        offsets[n] = acc;
        tile_offsets[n] = tiles;
    }
}

/// Step 4 of the plan, one unit per pair: `sorted_token: [pairs]` (token of each sorted row),
/// `sorted_weight: [pairs]` (the pair's routing weight from `weight: [pairs]` f32, in sorted order)
/// and `inv: [pairs]` (sorted row of each pair, [`NONE`] when masked). Rows past the last segment
/// are left untouched.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn moe_place<I: Int>(
    indices: &Array<I>,
    valid: &Array<u32>,
    weight: &Array<f32>,
    local_rank: &Array<u32>,
    block_base: &Array<u32>,
    offsets: &Array<u32>,
    sorted_token: &mut Array<u32>,
    sorted_weight: &mut Array<f32>,
    inv: &mut Array<u32>,
    pairs: usize,
    k: usize,
    n: usize,
    #[comptime] masked: bool,
    #[define(I)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= pairs {
        terminate!();
    }
    let mut keep = true;
    if comptime!(masked) {
        keep = valid[i / k] != 0u32;
    }
    if keep {
        let e = u32::cast_from(indices[i]) as usize;
        let block = i / PLAN_BLOCK as usize;
        let pos = offsets[e] + block_base[block * n + e] + local_rank[i];
        sorted_token[pos as usize] = (i / k) as u32;
        sorted_weight[pos as usize] = weight[i];
        inv[i] = pos;
    } else {
        inv[i] = NONE;
    }
}

/// Loads element `(row, col)` of a row-major `[rows, cols]` matrix as f32, or 0 outside `bounds`.
#[cube]
fn load_f32<F: Float>(m: &Array<F>, index: usize, inside: bool) -> f32 {
    let mut v = 0.0f32;
    if inside {
        v = f32::cast_from(m[index]);
    }
    v
}

/// Grouped matmul over the expert segments, one launch for all experts:
///
/// ```text
/// out[pos, c] (+)= Σ_r a[row(pos), r] · w[e, r, c]      pos ∈ segment e = offsets[e]..offsets[e+1]
/// ```
///
/// with `row(pos) = rows[pos]` when `gather` (rows gathered on load, e.g. the token of each
/// sorted pair) else `pos`, and `w[e]` stored `[kdim, cols]`, or `[cols, kdim]` when `transposed`.
/// `accumulate` adds to `out` instead of overwriting it. f32 accumulation, tiles in shared
/// memory. Grid: `x` = tiles (at least `ceil(pairs / TILE) + n` in all; spare cubes exit;
/// launches past the grid limit continue at `tile_base`), `y` = `ceil(cols / TILE)`; cube
/// `GMM_CUBE × GMM_CUBE`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn grouped_matmul<F: Float>(
    a: &Array<F>,
    w: &Array<F>,
    rows: &Array<u32>,
    offsets: &Array<u32>,
    tile_offsets: &Array<u32>,
    out: &mut Array<F>,
    tile_base: u32,
    n: usize,
    kdim: usize,
    cols: usize,
    #[comptime] gather: bool,
    #[comptime] transposed: bool,
    #[comptime] accumulate: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tile = CUBE_POS_X + tile_base;
    if tile >= tile_offsets[n] {
        terminate!();
    }
    // The expert owning this tile: tile_offsets[lo] <= tile < tile_offsets[lo + 1].
    let mut lo = 0usize;
    let mut hi = n;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if tile_offsets[mid] <= tile {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let e = lo;
    let t = TILE as usize;
    let tk = TILE_K as usize;
    let row0 = (offsets[e] + (tile - tile_offsets[e]) * TILE) as usize;
    let row_end = offsets[e + 1] as usize;
    let col0 = CUBE_POS_Y as usize * t;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * GMM_CUBE as usize + tx;
    let units = (GMM_CUBE * GMM_CUBE) as usize;
    let w_base = e * kdim * cols;

    let mut sa = SharedMemory::<f32>::new((TILE * TILE_K) as usize);
    let mut sb = SharedMemory::<f32>::new((TILE_K * TILE) as usize);
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for q in 0..16usize {
        acc[q] = 0.0f32;
    }

    let mut k0 = 0usize;
    while k0 < kdim {
        #[unroll]
        for q in 0..(TILE * TILE_K / (GMM_CUBE * GMM_CUBE)) as usize {
            let idx = q * units + unit;
            // A slice [TILE rows][TILE_K]
            let r = idx / tk;
            let kk = idx % tk;
            let pos = row0 + r;
            let inside_a = pos < row_end && k0 + kk < kdim;
            let mut arow = pos;
            if comptime!(gather) {
                if inside_a {
                    arow = rows[pos] as usize;
                }
            }
            sa[idx] = load_f32::<F>(a, arow * kdim + k0 + kk, inside_a);
            // W slice [TILE_K][TILE cols]
            let kb = idx / t;
            let c = idx % t;
            let inside_b = k0 + kb < kdim && col0 + c < cols;
            let mut wi = w_base + (k0 + kb) * cols + col0 + c;
            if comptime!(transposed) {
                wi = w_base + (col0 + c) * kdim + k0 + kb;
            }
            sb[idx] = load_f32::<F>(w, wi, inside_b);
        }
        sync_cube();
        for kk in 0..tk {
            #[unroll]
            for i in 0..4usize {
                let av = sa[(ty + i * GMM_CUBE as usize) * tk + kk];
                #[unroll]
                for j in 0..4usize {
                    acc[i * 4 + j] += av * sb[kk * t + tx + j * GMM_CUBE as usize];
                }
            }
        }
        sync_cube();
        k0 += tk;
    }

    #[unroll]
    for i in 0..4usize {
        let pos = row0 + ty + i * GMM_CUBE as usize;
        #[unroll]
        for j in 0..4usize {
            let c = col0 + tx + j * GMM_CUBE as usize;
            if pos < row_end && c < cols {
                let o = pos * cols + c;
                let mut v = acc[i * 4 + j];
                if comptime!(accumulate) {
                    v += f32::cast_from(out[o]);
                }
                out[o] = F::cast_from(v);
            }
        }
    }
}

/// Grouped weight gradient, one launch for all experts:
///
/// ```text
/// out[e, r, c] = Σ_{pos ∈ segment e} a[arow(pos), r] · b[brow(pos), c]
/// ```
///
/// `a: [*, adim]`, `b: [*, bdim]`, `out: [n, adim, bdim]`; `arow(pos) = rows[pos]` when
/// `gather_a` else `pos`, likewise `brow`. Experts with an empty segment get zeros. Grid:
/// `(ceil(adim / TILE), ceil(bdim / TILE), n)`; cube `GMM_CUBE × GMM_CUBE`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn grouped_matmul_wgrad<F: Float>(
    a: &Array<F>,
    b: &Array<F>,
    rows: &Array<u32>,
    offsets: &Array<u32>,
    out: &mut Array<F>,
    adim: usize,
    bdim: usize,
    #[comptime] gather_a: bool,
    #[comptime] gather_b: bool,
    #[define(F)] _dtype: StorageType,
) {
    let e = CUBE_POS_Z as usize;
    let t = TILE as usize;
    let tk = TILE_K as usize;
    let r0 = CUBE_POS_X as usize * t;
    let c0 = CUBE_POS_Y as usize * t;
    let start = offsets[e] as usize;
    let end = offsets[e + 1] as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unit = ty * GMM_CUBE as usize + tx;
    let units = (GMM_CUBE * GMM_CUBE) as usize;

    let mut sa = SharedMemory::<f32>::new((TILE_K * TILE) as usize);
    let mut sb = SharedMemory::<f32>::new((TILE_K * TILE) as usize);
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for q in 0..16usize {
        acc[q] = 0.0f32;
    }

    let mut p0 = start;
    while p0 < end {
        #[unroll]
        for q in 0..(TILE * TILE_K / (GMM_CUBE * GMM_CUBE)) as usize {
            // Both slices are [TILE_K pairs][TILE features].
            let idx = q * units + unit;
            let kk = idx / t;
            let f = idx % t;
            let pos = p0 + kk;
            let inside_a = pos < end && r0 + f < adim;
            let mut arow = pos;
            if comptime!(gather_a) {
                if inside_a {
                    arow = rows[pos] as usize;
                }
            }
            sa[idx] = load_f32::<F>(a, arow * adim + r0 + f, inside_a);
            let inside_b = pos < end && c0 + f < bdim;
            let mut brow = pos;
            if comptime!(gather_b) {
                if inside_b {
                    brow = rows[pos] as usize;
                }
            }
            sb[idx] = load_f32::<F>(b, brow * bdim + c0 + f, inside_b);
        }
        sync_cube();
        for kk in 0..tk {
            #[unroll]
            for i in 0..4usize {
                let av = sa[kk * t + ty + i * GMM_CUBE as usize];
                #[unroll]
                for j in 0..4usize {
                    acc[i * 4 + j] += av * sb[kk * t + tx + j * GMM_CUBE as usize];
                }
            }
        }
        sync_cube();
        p0 += tk;
    }

    #[unroll]
    for i in 0..4usize {
        let r = r0 + ty + i * GMM_CUBE as usize;
        #[unroll]
        for j in 0..4usize {
            let c = c0 + tx + j * GMM_CUBE as usize;
            if r < adim && c < bdim {
                out[e * adim * bdim + r * bdim + c] = F::cast_from(acc[i * 4 + j]);
            }
        }
    }
}

/// The un-permute: `out[t, c] = Σ_{q<k} y[inv[t·k + q], c]` over the dispatched pairs of token
/// `t` (in slot order, so the sum is reproducible); masked tokens get zeros. `y: [pairs, width]`,
/// `out: [tokens, width]`. One unit per output element.
#[cube(launch)]
pub fn moe_combine<F: Float>(
    y: &Array<F>,
    inv: &Array<u32>,
    out: &mut Array<F>,
    tokens: usize,
    width: usize,
    k: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= tokens * width {
        terminate!();
    }
    let t = i / width;
    let c = i % width;
    let mut acc = 0.0f32;
    for q in 0..k {
        let pos = inv[t * k + q];
        if pos != NONE {
            acc += f32::cast_from(y[pos as usize * width + c]);
        }
    }
    out[i] = F::cast_from(acc);
}

/// `out[pair] = src[inv[pair]]`, 0 for masked pairs: brings a per-row value of the sorted order
/// (e.g. the routing-weight gradient) back to the `[tokens, k]` layout.
#[cube(launch)]
pub fn moe_pair_gather(src: &Array<f32>, inv: &Array<u32>, out: &mut Array<f32>, pairs: usize) {
    let i = ABSOLUTE_POS;
    if i >= pairs {
        terminate!();
    }
    let pos = inv[i];
    let mut v = 0.0f32;
    if pos != NONE {
        v = src[pos as usize];
    }
    out[i] = v;
}
