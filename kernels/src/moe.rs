//! Dropless MoE dispatch on the device (design §2): a stable counting sort of the `(token, expert)`
//! pairs by expert, a grouped (segmented) matmul over the expert-contiguous rows, and the
//! un-permute as a gather-sum.
//!
//! The pairs are `[tokens, k]` row-major, pair `i = token·k + slot`. The sort is stable (pairs keep
//! their order within an expert), so the device plan equals the host `DispatchPlan`:
//!
//! 1. [`moe_block_ranks`](fn@moe_block_ranks): pairs in blocks of [`PLAN_BLOCK`]; per pair its rank among the earlier
//!    pairs of its block with the same expert, per (block, expert) the count.
//! 2. [`moe_block_scan`](fn@moe_block_scan): per expert, the exclusive scan of its block counts and its total.
//! 3. [`moe_offsets`](fn@moe_offsets): the segment offsets `[n + 1]` and the matmul tile offsets `[n + 1]`.
//! 4. [`moe_place`](fn@moe_place): each pair's sorted position; `sorted_token`, the routing weight in sorted
//!    order, and the inverse map `inv[pair] = position` ([`NONE`] for masked tokens).
//!
//! Nothing is read back to the host: buffers are sized for all `tokens·k` pairs and the kernels
//! find the segment bounds on the device. No float atomics anywhere, so every output is
//! bit-reproducible.

use cubecl::prelude::*;

use crate::situ::{glu_a, glu_b, glu_backward};
use crate::V4;

/// Pairs per block of the plan's counting sort (= the cube size of [`moe_block_ranks`](fn@moe_block_ranks)).
pub const PLAN_BLOCK: u32 = 256;
/// Rows (and columns) of one grouped-matmul output tile.
pub const TILE: u32 = 64;
/// Depth of one shared-memory slice of the grouped matmul.
pub const TILE_K: u32 = 16;
/// The grouped matmuls' tensor-core layout (and [`grouped_matmul_wgrad`](fn@grouped_matmul_wgrad)'s):
/// a `GMM_CUBE × GMM_CUBE` cube, each unit owning a 4×4 micro-tile.
pub const GMM_CUBE: u32 = 16;
/// Rows and columns of a unit's micro-tile in the scalar loop of
/// [`grouped_matmul`](fn@grouped_matmul): an 8×8 block, so per depth step four [`V4`] reads
/// from shared memory feed 64 multiply-adds (128 with the GLU epilogue's second product).
pub const GMM_MICRO: u32 = 8;
/// [`grouped_matmul`](fn@grouped_matmul)'s epilogue: the product itself.
pub const EPILOGUE_PLAIN: u32 = 0;
/// [`grouped_matmul`](fn@grouped_matmul)'s epilogue: the experts' fused first layer.
pub const EPILOGUE_GLU: u32 = 1;
/// [`grouped_matmul`](fn@grouped_matmul)'s epilogue: the fused first layer's backward.
pub const EPILOGUE_GLU_BACKWARD: u32 = 2;
/// The plane width the tensor-core path of [`grouped_matmul`](fn@grouped_matmul) is laid out for:
/// its `GMM_CUBE²` = 256 units are eight planes, each owning two 16 × 16 blocks of the tile.
pub const MMA_PLANE: u32 = 32;
/// Marks a pair that is not dispatched (its token is masked) in `inv`.
pub const NONE: u32 = u32::MAX;

/// Step 1 of the plan. `indices: [pairs]` expert of each pair, `valid: [tokens]` (read when
/// `masked`), `local_rank: [pairs]` out, `block_counts: [blocks, n]` out (zero it first).
/// Launch `ceil(pairs / PLAN_BLOCK)` cubes of `PLAN_BLOCK` units.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
#[cube(launch_unchecked)]
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
#[cube(launch_unchecked)]
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
/// and `inv: [pairs]` (sorted row of each pair, [`NONE`] when masked or when its expert index lies
/// outside `0..n`, which step 1 also leaves out). Rows past the last segment are left untouched.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
    // An expert index outside `0..n` is treated as masked, as `moe_block_ranks` does (it gave
    // such a pair no rank), so no offset is read past `n`.
    let e = u32::cast_from(indices[i]) as usize;
    let mut keep = e < n;
    if comptime!(masked) {
        keep = keep && valid[i / k] != 0u32;
    }
    if keep {
        let block = i / PLAN_BLOCK as usize;
        let pos = offsets[e] + block_base[block * n + e] + local_rank[i];
        sorted_token[pos as usize] = (i / k) as u32;
        sorted_weight[pos as usize] = weight[i];
        inv[i] = pos;
    } else {
        inv[i] = NONE;
    }
}

/// Loads element `index` of `m` as f32, or 0 when not `inside`.
#[cube]
fn load_f32<F: Float>(m: &Array<F>, index: usize, inside: bool) -> f32 {
    let mut v = 0.0f32;
    if inside {
        v = f32::cast_from(m[index]);
    }
    v
}

/// Loads `m[base + j·stride]` for the lanes `j < 4` with `j < count` as an f32 [`V4`]; lanes at
/// or past `count` (and all lanes when `count` is 0) are 0.
#[cube]
fn load_v4<F: Float>(m: &Array<F>, base: usize, stride: usize, count: usize) -> V4 {
    let mut v = V4::new(0.0f32);
    #[unroll]
    for j in 0..4usize {
        if j < count {
            v[j] = f32::cast_from(m[base + j * stride]);
        }
    }
    v
}

/// `acc[r · mc/4 + j4] += a_reg[r / 4][r % 4] · b_reg[j4]`: one depth step of a unit's
/// `mr × mc` micro-tile, with the `a` column of its rows in `a_reg` and the `b` row of its columns
/// in `b_reg`.
#[cube]
fn fma_micro(
    acc: &mut Array<V4>,
    a_reg: &Array<V4>,
    b_reg: &Array<V4>,
    #[comptime] mr: u32,
    #[comptime] mc4: u32,
) {
    #[unroll]
    for r in 0..mr as usize {
        let ar = V4::new(a_reg[r / 4][r % 4]);
        #[unroll]
        for j4 in 0..mc4 as usize {
            acc[r * mc4 as usize + j4] += ar * b_reg[j4];
        }
    }
}

/// A fresh micro-tile of `len` zero [`V4`]s.
#[cube]
fn zero_micro_tile(#[comptime] len: u32) -> Array<V4> {
    let mut acc = Array::<V4>::new(len as usize);
    #[unroll]
    for i in 0..len as usize {
        acc[i] = V4::new(0.0f32);
    }
    acc
}

/// Rows (= columns) of a unit's micro-tile in [`grouped_matmul`](fn@grouped_matmul): 4 on the
/// tensor-core layout, [`GMM_MICRO`] in the scalar loop.
pub const fn micro_rows(mma: bool) -> u32 {
    if mma {
        4
    } else {
        GMM_MICRO
    }
}

/// The cube of [`grouped_matmul`](fn@grouped_matmul) (`x` along the tile's columns, `y` along
/// its rows): one unit per micro-tile of the `TILE × TILE` output tile.
pub const fn grouped_matmul_cube(mma: bool) -> (u32, u32) {
    (TILE / micro_rows(mma), TILE / micro_rows(mma))
}

/// How many of the 4 lanes starting at `start` lie below `end`.
#[cube]
fn lanes_below(start: usize, end: usize) -> usize {
    let mut n = 0usize;
    if start < end {
        n = usize::min(end - start, 4usize);
    }
    n
}

/// Grouped matmul over the expert segments, one launch for all experts:
///
/// ```text
/// out[pos, c] (+)= Σ_r a[row(pos), r] · w[e, r, c]      pos ∈ segment e = offsets[e]..offsets[e+1]
/// ```
///
/// with `row(pos) = rows[pos]` when `gather` (rows gathered on load, e.g. the token of each
/// sorted pair) else `pos`, and `w[e]` stored `[kdim, cols]`, or `[cols, kdim]` when `transposed`.
/// `accumulate` adds to `out` instead of overwriting it. f32 accumulation. Each cube computes a
/// `TILE × TILE` output tile from `TILE_K`-deep slices in shared memory, stored as [`V4`]s
/// (`a` as four consecutive rows at one depth, `w` as four consecutive columns), and each unit a
/// [`GMM_MICRO`]² micro-tile of consecutive rows and columns: per depth step four shared reads
/// feed 64 multiply-adds (on lavapipe, which runs every shared read as a loop over the SIMD
/// lanes, the reads set the speed: 8×8 halved the time of 4×4 in the training step). Grid:
/// `x` = tiles (at least `ceil(pairs / TILE) + n` in all; spare cubes exit; launches past the
/// grid limit continue at `tile_base`), `y` = `ceil(cols / TILE)`; cube
/// [`grouped_matmul_cube`]`(mma)`.
///
/// The `epilogue` decides what is done with the product:
///
/// - [`EPILOGUE_PLAIN`]: it is stored (or added, with `accumulate`) to `out`.
/// - [`EPILOGUE_GLU`]: the experts' whole first layer (design §1, §2) in one pass: the gate
///   `g = a·w` and the up projection `u = a·w3` (same layout as `w`) from the same `a` tile, and
///   `out = p·A(g)·B(u)` with `p = weight[pos]` and the SiTU-GLU (or SwiGLU) `mode` of
///   [`crate::situ`]; `gate` and `up` receive `g` and `u` when `save` (for the backward), else
///   they are not written.
/// - [`EPILOGUE_GLU_BACKWARD`]: the product is the gradient `d` of the first layer's output
///   (`dY·W2ᵀ`); with `g = gate[o]`, `u = up[o]` the epilogue writes `out = dg = p·d·B·A'`,
///   `hidden = du = p·d·A·B'`, `act = p·A·B` (the forward's activation, for the weight
///   gradient of the second layer), and per row the partial `Σ d·A·B` over this tile's columns to
///   `dp[pos · col_tiles + tile_y]` (a fixed-order sum across the cube's units, so the result
///   is reproducible; the caller sums the column tiles).
///
/// With `mma` (half storage on a device with `16×16×16` cooperative matrices for `F × F → f32`
/// and planes of [`MMA_PLANE`] units, i.e. tensor cores on CUDA) the products run on the
/// matrix units: the slices are staged in `F` in shared memory, each plane multiplies its two
/// `16 × 16` blocks with f32 accumulation, and the blocks go through shared memory into the same
/// 4×4 micro-tiles, so the epilogues are unchanged. Without it, the scalar f32 loop above.
///
/// Products are rounded to `F` before the activation math, as the unfused path stores them, so
/// the forward gives the same bits as separate launches in every storage type. No
/// `[pairs, cols]` intermediate goes through memory. Arrays an epilogue does not use are not
/// read or written (pass any).
///
/// Long on purpose: one kernel body (a cube function cannot hand shared-memory tiles to a helper
/// cheaply), laid out as load tile, multiply, store.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn grouped_matmul<F: Float>(
    a: &Array<F>,
    w: &Array<F>,
    w3: &Array<F>,
    rows: &Array<u32>,
    offsets: &Array<u32>,
    tile_offsets: &Array<u32>,
    weight: &Array<f32>,
    out: &mut Array<F>,
    gate: &mut Array<F>,
    up: &mut Array<F>,
    hidden: &mut Array<F>,
    act: &mut Array<F>,
    dp: &mut Array<f32>,
    tile_base: u32,
    n: usize,
    kdim: usize,
    cols: usize,
    beta1: f32,
    beta2: f32,
    #[comptime] gather: bool,
    #[comptime] transposed: bool,
    #[comptime] accumulate: bool,
    #[comptime] epilogue: u32,
    #[comptime] mode: u32,
    #[comptime] save: bool,
    #[comptime] mma: bool,
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
    let q = (TILE / 4) as usize;
    let tk = TILE_K as usize;
    let row0 = (offsets[e] + (tile - tile_offsets[e]) * TILE) as usize;
    let row_end = offsets[e + 1] as usize;
    let col0 = CUBE_POS_Y as usize * TILE as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let w_base = e * kdim * cols;
    // The unit's micro-tile: `mr` rows by `mc` columns, as `mr · mc / 4` V4s
    // (`acc[r · mc/4 + j4]` holds row `r`, columns `4·j4..4·j4 + 4`).
    let mr = comptime!(micro_rows(mma) as usize);
    let mc = mr;
    let mc4 = comptime!(micro_rows(mma) as usize / 4);
    let ux = comptime!((TILE / micro_rows(mma)) as usize);

    let glu = comptime!(epilogue == EPILOGUE_GLU);
    let mut acc = zero_micro_tile(comptime!(micro_rows(mma) * micro_rows(mma) / 4));
    let mut acc3 = zero_micro_tile(comptime!(if glu {
        micro_rows(mma) * micro_rows(mma) / 4
    } else {
        1u32
    }));

    if comptime!(mma) {
        // The tensor-core layout: a 16 × 16 cube staging four rows and four columns per unit.
        let mut arows = Array::<usize>::new(4usize);
        let a_lanes = lanes_below(row0 + 4 * ty, row_end);
        #[unroll]
        for j in 0..4usize {
            let pos = row0 + 4 * ty + j;
            let mut r = pos;
            if comptime!(gather) {
                if j < a_lanes {
                    r = rows[pos] as usize;
                }
            }
            arows[j] = r;
        }
        let c_lanes = lanes_below(col0 + 4 * tx, cols);
        grouped_mma::<F>(
            a, w, w3, &arows, a_lanes, c_lanes, w_base, col0, kdim, cols, &mut acc, &mut acc3,
            transposed, glu,
        );
    } else {
        // sa[kk·q + r4]: rows 4·r4..4·r4+4 at depth kk; sb[kk·q + c4]: columns 4·c4..4·c4+4.
        let mut sa = SharedMemory::<V4>::new(tk * q);
        let mut sb = SharedMemory::<V4>::new(tk * q);
        // The up projection's slice (one element when not `glu`).
        let mut sb3 = SharedMemory::<V4>::new(comptime!(if glu {
            (TILE_K * TILE / 4) as usize
        } else {
            1usize
        }));
        // Staging: the cube's `units` units fill the `tk · q` entries of each slice, entry
        // `unit + s · units` for `s < stage`: `a` at depth `unit % tk` of the row groups
        // `unit / tk + s · units / tk`, `w` at column group `unit % q` of the depths
        // `unit / q + s · units / q`. The staged rows (gathered once) and their counts:
        let units = comptime!(((TILE / micro_rows(mma)) * (TILE / micro_rows(mma))) as usize);
        let stage = comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(mma)) * (TILE / micro_rows(mma)))) as usize
        );
        let unit = ty * ux + tx;
        let ka0 = unit % tk;
        let kb0 = unit / q;
        let cb = col0 + 4 * (unit % q);
        let b_lanes = lanes_below(cb, cols);
        let mut srows = Array::<usize>::new(comptime!(
            (4 * TILE_K * TILE / 4 / ((TILE / micro_rows(mma)) * (TILE / micro_rows(mma))))
                as usize
        ));
        let mut slanes = Array::<usize>::new(comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(mma)) * (TILE / micro_rows(mma)))) as usize
        ));
        #[unroll]
        for s in 0..stage {
            let first = row0 + 4 * (unit / tk + s * (units / tk));
            let lanes = lanes_below(first, row_end);
            slanes[s] = lanes;
            #[unroll]
            for j in 0..4usize {
                let pos = first + j;
                let mut r = pos;
                if comptime!(gather) {
                    if j < lanes {
                        r = rows[pos] as usize;
                    }
                }
                srows[4 * s + j] = r;
            }
        }
        let mut a_reg = Array::<V4>::new(comptime!((micro_rows(mma) / 4) as usize));
        let mut b_reg = Array::<V4>::new(comptime!((micro_rows(mma) / 4) as usize));
        let mut b3_reg = Array::<V4>::new(comptime!(if glu {
            (micro_rows(mma) / 4) as usize
        } else {
            1usize
        }));
        let mut k0 = 0usize;
        while k0 < kdim {
            #[unroll]
            for s in 0..stage {
                let ka = k0 + ka0;
                let mut v = V4::new(0.0f32);
                #[unroll]
                for j in 0..4usize {
                    v[j] =
                        load_f32::<F>(a, srows[4 * s + j] * kdim + ka, j < slanes[s] && ka < kdim);
                }
                sa[ka0 * q + unit / tk + s * (units / tk)] = v;
                let kb = k0 + kb0 + s * (units / q);
                let mut count = 0usize;
                if kb < kdim {
                    count = b_lanes;
                }
                let mut base = w_base + kb * cols + cb;
                let mut stride = 1usize;
                if comptime!(transposed) {
                    base = w_base + cb * kdim + kb;
                    stride = kdim;
                }
                let slot = (kb0 + s * (units / q)) * q + unit % q;
                sb[slot] = load_v4::<F>(w, base, stride, count);
                if comptime!(glu) {
                    sb3[slot] = load_v4::<F>(w3, base, stride, count);
                }
            }
            sync_cube();
            for kk in 0..tk {
                #[unroll]
                for j4 in 0..mc4 {
                    b_reg[j4] = sb[kk * q + mc4 * tx + j4];
                    if comptime!(glu) {
                        b3_reg[j4] = sb3[kk * q + mc4 * tx + j4];
                    }
                }
                #[unroll]
                for i4 in 0..mc4 {
                    a_reg[i4] = sa[kk * q + mc4 * ty + i4];
                }
                fma_micro(&mut acc, &a_reg, &b_reg, mr as u32, mc4 as u32);
                if comptime!(glu) {
                    fma_micro(&mut acc3, &a_reg, &b3_reg, mr as u32, mc4 as u32);
                }
            }
            sync_cube();
            k0 += tk;
        }
    }

    if comptime!(epilogue == EPILOGUE_GLU_BACKWARD) {
        // Per row, this unit's partial Σ d·A·B; then unit tx = 0 sums the row's `ux` partials.
        let mut rowsum =
            SharedMemory::<f32>::new(comptime!((TILE * (TILE / micro_rows(mma))) as usize));
        #[unroll]
        for r in 0..mr {
            let pos = row0 + mr * ty + r;
            let row_in = pos < row_end;
            let mut p = 0.0f32;
            if row_in {
                p = weight[pos];
            }
            let mut part = 0.0f32;
            #[unroll]
            for j4 in 0..mc4 {
                let v = acc[r * mc4 + j4];
                #[unroll]
                for j in 0..4usize {
                    let col = col0 + mc * tx + 4 * j4 + j;
                    if row_in && col < cols {
                        let o = pos * cols + col;
                        let d = f32::cast_from(F::cast_from(v[j]));
                        let g = f32::cast_from(gate[o]);
                        let u = f32::cast_from(up[o]);
                        let (dg, du, av, bv) = glu_backward(g, u, d, p, beta1, beta2, mode);
                        part += d * av * bv;
                        out[o] = F::cast_from(dg);
                        hidden[o] = F::cast_from(du);
                        // The forward's activation, same bits (`p·A·B` from the same `F` values).
                        act[o] = F::cast_from(p * av * bv);
                    }
                }
            }
            rowsum[(mr * ty + r) * ux + tx] = part;
        }
        sync_cube();
        if tx == 0 {
            #[unroll]
            for r in 0..mr {
                let pos = row0 + mr * ty + r;
                if pos < row_end {
                    let mut total = 0.0f32;
                    for t in 0..ux {
                        total += rowsum[(mr * ty + r) * ux + t];
                    }
                    dp[pos * CUBE_COUNT_Y as usize + CUBE_POS_Y as usize] = total;
                }
            }
        }
    } else {
        #[unroll]
        for r in 0..mr {
            let pos = row0 + mr * ty + r;
            let row_in = pos < row_end;
            let mut p = 1.0f32;
            if comptime!(glu) {
                if row_in {
                    p = weight[pos];
                }
            }
            #[unroll]
            for j4 in 0..mc4 {
                let v = acc[r * mc4 + j4];
                let v3 = acc3[comptime!(if glu { 1usize } else { 0usize }) * (r * mc4 + j4)];
                #[unroll]
                for j in 0..4usize {
                    let col = col0 + mc * tx + 4 * j4 + j;
                    if row_in && col < cols {
                        let o = pos * cols + col;
                        if comptime!(glu) {
                            let g = F::cast_from(v[j]);
                            let u = F::cast_from(v3[j]);
                            if comptime!(save) {
                                gate[o] = g;
                                up[o] = u;
                            }
                            let y = p
                                * glu_a(f32::cast_from(g), beta1, mode)
                                * glu_b(f32::cast_from(u), beta2, mode);
                            out[o] = F::cast_from(y);
                        } else {
                            let mut x = v[j];
                            if comptime!(accumulate) {
                                x += f32::cast_from(out[o]);
                            }
                            out[o] = F::cast_from(x);
                        }
                    }
                }
            }
        }
    }
}

/// The main loop of [`grouped_matmul`](fn@grouped_matmul) on the matrix units (its `mma`
/// path): fills the unit's 4×4 micro-tiles `acc` (and `acc3` with `glu`) with the same
/// products as the scalar loop, accumulated in f32.
///
/// Per `TILE_K` step the cube stages the `a` rows as `[TILE, TILE_K]` and the `w` (and `w3`)
/// columns as `[TILE_K, TILE]`, row-major in `F`, with the scalar loop's load pattern (zeros
/// outside the segment and the matrix); plane `p` of the eight multiplies rows
/// `16·(p / 2)..` by the two column blocks `32·(p % 2)..`. After the loop each accumulator
/// block goes to a shared f32 `[TILE, TILE]` tile, which the units read back as their
/// micro-tiles (`w3`'s blocks after `w`'s, through the same tile).
#[allow(clippy::too_many_arguments)]
#[cube]
fn grouped_mma<F: Float>(
    a: &Array<F>,
    w: &Array<F>,
    w3: &Array<F>,
    arows: &Array<usize>,
    a_lanes: usize,
    c_lanes: usize,
    w_base: usize,
    col0: usize,
    kdim: usize,
    cols: usize,
    acc: &mut Array<V4>,
    acc3: &mut Array<V4>,
    #[comptime] transposed: bool,
    #[comptime] glu: bool,
) {
    let t = TILE as usize;
    let tk = TILE_K as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let mut ha = SharedMemory::<F>::new_aligned(t * tk, 32usize);
    let mut hb = SharedMemory::<F>::new_aligned(t * tk, 32usize);
    let mut hb3 =
        SharedMemory::<F>::new_aligned(comptime!(if glu { t * tk } else { 1usize }), 32usize);
    let plane = (UNIT_POS / MMA_PLANE) as usize;
    let a_off = (plane / 2) * 16 * tk;
    let b_off = (plane % 2) * 32;
    let c_off = (plane / 2) * 16 * t + b_off;
    let m0 = zero_block();
    let m1 = zero_block();
    let u0 = zero_block();
    let u1 = zero_block();
    let zero = F::cast_from(0.0f32);
    let mut k0 = 0usize;
    while k0 < kdim {
        let ka = k0 + tx;
        #[unroll]
        for j in 0..4usize {
            let mut v = zero;
            if j < a_lanes && ka < kdim {
                v = a[arows[j] * kdim + ka];
            }
            ha[(4 * ty + j) * tk + tx] = v;
        }
        let kb = k0 + ty;
        #[unroll]
        for j in 0..4usize {
            let c = col0 + 4 * tx + j;
            let mut index = w_base + kb * cols + c;
            if comptime!(transposed) {
                index = w_base + c * kdim + kb;
            }
            let inside = j < c_lanes && kb < kdim;
            let mut v = zero;
            if inside {
                v = w[index];
            }
            hb[ty * t + 4 * tx + j] = v;
            if comptime!(glu) {
                let mut v3 = zero;
                if inside {
                    v3 = w3[index];
                }
                hb3[ty * t + 4 * tx + j] = v3;
            }
        }
        sync_cube();
        let am = cmma::Matrix::<F>::from_slice(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
            &ha.slice(a_off, t * tk),
            tk as u32,
        );
        multiply_pair::<F>(&am, &hb, b_off, &m0, &m1);
        if comptime!(glu) {
            multiply_pair::<F>(&am, &hb3, b_off, &u0, &u1);
        }
        sync_cube();
        k0 += tk;
    }
    let mut tile = SharedMemory::<f32>::new_aligned(t * t, 32usize);
    store_pair(&mut tile, c_off, &m0, &m1);
    sync_cube();
    read_micro_tile(&tile, acc);
    if comptime!(glu) {
        sync_cube();
        store_pair(&mut tile, c_off, &u0, &u1);
        sync_cube();
        read_micro_tile(&tile, acc3);
    }
}

/// A zeroed `16 × 16` f32 accumulator block of the matrix units.
#[cube]
fn zero_block() -> cmma::Matrix<f32> {
    cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        16usize,
        16usize,
        16usize,
        cmma::MatrixLayout::Undefined,
        0.0f32,
    )
}

/// `acc0 += a · B₀` and `acc1 += a · B₁` on the matrix units, with `B₀`, `B₁` the `16 × 16`
/// blocks at columns `off..` and `off + 16..` of the row-major `[TILE_K, TILE]` stage `b`.
#[cube]
fn multiply_pair<F: Float>(
    a: &cmma::Matrix<F>,
    b: &SharedMemory<F>,
    off: usize,
    acc0: &cmma::Matrix<f32>,
    acc1: &cmma::Matrix<f32>,
) {
    let t = TILE as usize;
    let len = t * TILE_K as usize;
    let b0 = cmma::Matrix::<F>::from_slice(
        cmma::MatrixIdent::B,
        16usize,
        16usize,
        16usize,
        cmma::MatrixLayout::RowMajor,
        &b.slice(off, len),
        t as u32,
    );
    let b1 = cmma::Matrix::<F>::from_slice(
        cmma::MatrixIdent::B,
        16usize,
        16usize,
        16usize,
        cmma::MatrixLayout::RowMajor,
        &b.slice(off + 16, len),
        t as u32,
    );
    cmma::execute::<F, F, f32, f32>(a, &b0, acc0, acc0);
    cmma::execute::<F, F, f32, f32>(a, &b1, acc1, acc1);
}

/// Stores two accumulator blocks side by side at `off` and `off + 16` of the shared row-major
/// `[TILE, TILE]` f32 tile.
#[cube]
fn store_pair(
    tile: &mut SharedMemory<f32>,
    off: usize,
    acc0: &cmma::Matrix<f32>,
    acc1: &cmma::Matrix<f32>,
) {
    let t = TILE as usize;
    cmma::store(
        &mut tile.slice_mut(off, t * t),
        acc0,
        t as u32,
        cmma::MatrixLayout::RowMajor,
    );
    cmma::store(
        &mut tile.slice_mut(off + 16, t * t),
        acc1,
        t as u32,
        cmma::MatrixLayout::RowMajor,
    );
}

/// The unit's 4×4 micro-tile (rows `4·ty..`, columns `4·tx..`) of a shared `[TILE, TILE]` f32
/// tile.
#[cube]
fn read_micro_tile(tile: &SharedMemory<f32>, acc: &mut Array<V4>) {
    let t = TILE as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    #[unroll]
    for i in 0..4usize {
        let mut v = V4::new(0.0f32);
        #[unroll]
        for j in 0..4usize {
            v[j] = tile[(4 * ty + i) * t + 4 * tx + j];
        }
        acc[i] = v;
    }
}

/// Grouped weight gradient, one launch for all experts:
///
/// ```text
/// out[e, r, c] = Σ_{pos ∈ segment e} a[arow(pos), r] · b[brow(pos), c]
/// ```
///
/// `a: [*, adim]`, `b: [*, bdim]`, `out: [n, adim, bdim]`; `arow(pos) = rows[pos]` when
/// `gather_a` else `pos`, likewise `brow`. Experts with an empty segment get zeros. Both shared
/// slices hold `TILE_K` pairs × `TILE` features as [`V4`]s of four consecutive features (one
/// contiguous load from a row of `a` or `b`); each unit owns a [`GMM_MICRO`]² micro-tile (4×4
/// with `mma`). With `mma` (as in [`grouped_matmul`](fn@grouped_matmul)) the products run on the
/// matrix units. Grid: `(ceil(adim / TILE), ceil(bdim / TILE), n)`; cube
/// [`grouped_matmul_cube`]`(mma)`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
    #[comptime] mma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let e = CUBE_POS_Z as usize;
    let q = (TILE / 4) as usize;
    let tk = TILE_K as usize;
    let r0 = CUBE_POS_X as usize * TILE as usize;
    let c0 = CUBE_POS_Y as usize * TILE as usize;
    let start = offsets[e] as usize;
    let end = offsets[e + 1] as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    // The unit's `mr × mr` micro-tile, as in `grouped_matmul`.
    let mr = comptime!(micro_rows(mma) as usize);
    let mc4 = comptime!(micro_rows(mma) as usize / 4);
    let mut acc = zero_micro_tile(comptime!(micro_rows(mma) * micro_rows(mma) / 4));

    if comptime!(mma) {
        let a_lanes = lanes_below(r0 + 4 * tx, adim);
        let b_lanes = lanes_below(c0 + 4 * tx, bdim);
        wgrad_mma::<F>(
            a, b, rows, start, end, r0, c0, adim, bdim, a_lanes, b_lanes, &mut acc, gather_a,
            gather_b,
        );
    } else {
        // Both slices hold `tk` pairs × `TILE` features as V4s; entry `unit + s · units` of
        // each (`s < stage`) is loaded by `unit`: features `4 · (unit % q)..` of the pair
        // `unit / q + s · units / q`.
        let mut sa = SharedMemory::<V4>::new(tk * q);
        let mut sb = SharedMemory::<V4>::new(tk * q);
        let units = comptime!(((TILE / micro_rows(mma)) * (TILE / micro_rows(mma))) as usize);
        let stage = comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(mma)) * (TILE / micro_rows(mma)))) as usize
        );
        let unit = ty * comptime!((TILE / micro_rows(mma)) as usize) + tx;
        let f4 = unit % q;
        let a_lanes = lanes_below(r0 + 4 * f4, adim);
        let b_lanes = lanes_below(c0 + 4 * f4, bdim);
        let mut a_reg = Array::<V4>::new(comptime!((micro_rows(mma) / 4) as usize));
        let mut b_reg = Array::<V4>::new(comptime!((micro_rows(mma) / 4) as usize));
        let mut p0 = start;
        while p0 < end {
            #[unroll]
            for s in 0..stage {
                let kk = unit / q + s * (units / q);
                let pos = p0 + kk;
                let inside = pos < end;
                let mut arow = pos;
                let mut brow = pos;
                if inside {
                    if comptime!(gather_a) {
                        arow = rows[pos] as usize;
                    }
                    if comptime!(gather_b) {
                        brow = rows[pos] as usize;
                    }
                }
                let mut na = 0usize;
                let mut nb = 0usize;
                if inside {
                    na = a_lanes;
                    nb = b_lanes;
                }
                sa[kk * q + f4] = load_v4::<F>(a, arow * adim + r0 + 4 * f4, 1usize, na);
                sb[kk * q + f4] = load_v4::<F>(b, brow * bdim + c0 + 4 * f4, 1usize, nb);
            }
            sync_cube();
            for kk in 0..tk {
                #[unroll]
                for i4 in 0..mc4 {
                    a_reg[i4] = sa[kk * q + mc4 * ty + i4];
                    b_reg[i4] = sb[kk * q + mc4 * tx + i4];
                }
                fma_micro(&mut acc, &a_reg, &b_reg, mr as u32, mc4 as u32);
            }
            sync_cube();
            p0 += tk;
        }
    }

    #[unroll]
    for i in 0..mr {
        let r = r0 + mr * ty + i;
        #[unroll]
        for j4 in 0..mc4 {
            let v = acc[i * mc4 + j4];
            #[unroll]
            for j in 0..4usize {
                let c = c0 + 4 * (mc4 * tx + j4) + j;
                if r < adim && c < bdim {
                    out[e * adim * bdim + r * bdim + c] = F::cast_from(v[j]);
                }
            }
        }
    }
}

/// The main loop of [`grouped_matmul_wgrad`](fn@grouped_matmul_wgrad) on the matrix units:
/// `acc` gets the unit's 4×4 micro-tile of `Σ_pos a[arow(pos)]ᵀ · b[brow(pos)]`, accumulated
/// in f32. Per `TILE_K` pairs the cube stages `a`'s and `b`'s features as `[TILE_K, TILE]`
/// row-major in `F` (zeros past the segment and the widths); `a`'s slice is the `A` operand
/// read column-major. Plane `p` of the eight owns rows `16·(p / 2)..` and the column blocks
/// `32·(p % 2)..`, as in [`grouped_mma`].
#[allow(clippy::too_many_arguments)]
#[cube]
fn wgrad_mma<F: Float>(
    a: &Array<F>,
    b: &Array<F>,
    rows: &Array<u32>,
    start: usize,
    end: usize,
    r0: usize,
    c0: usize,
    adim: usize,
    bdim: usize,
    a_lanes: usize,
    b_lanes: usize,
    acc: &mut Array<V4>,
    #[comptime] gather_a: bool,
    #[comptime] gather_b: bool,
) {
    let t = TILE as usize;
    let tk = TILE_K as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let mut ha = SharedMemory::<F>::new_aligned(t * tk, 32usize);
    let mut hb = SharedMemory::<F>::new_aligned(t * tk, 32usize);
    let plane = (UNIT_POS / MMA_PLANE) as usize;
    let a_off = (plane / 2) * 16;
    let b_off = (plane % 2) * 32;
    let c_off = (plane / 2) * 16 * t + b_off;
    let m0 = zero_block();
    let m1 = zero_block();
    let zero = F::cast_from(0.0f32);
    let mut p0 = start;
    while p0 < end {
        // Unit (tx, ty) stages features 4·tx.. of pair p0 + ty.
        let pos = p0 + ty;
        let inside = pos < end;
        let mut arow = pos;
        let mut brow = pos;
        if inside {
            if comptime!(gather_a) {
                arow = rows[pos] as usize;
            }
            if comptime!(gather_b) {
                brow = rows[pos] as usize;
            }
        }
        #[unroll]
        for j in 0..4usize {
            let mut va = zero;
            if inside && j < a_lanes {
                va = a[arow * adim + r0 + 4 * tx + j];
            }
            ha[ty * t + 4 * tx + j] = va;
            let mut vb = zero;
            if inside && j < b_lanes {
                vb = b[brow * bdim + c0 + 4 * tx + j];
            }
            hb[ty * t + 4 * tx + j] = vb;
        }
        sync_cube();
        let am = cmma::Matrix::<F>::from_slice(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::ColMajor,
            &ha.slice(a_off, t * tk),
            t as u32,
        );
        multiply_pair::<F>(&am, &hb, b_off, &m0, &m1);
        sync_cube();
        p0 += tk;
    }
    let mut tile = SharedMemory::<f32>::new_aligned(t * t, 32usize);
    store_pair(&mut tile, c_off, &m0, &m1);
    sync_cube();
    read_micro_tile(&tile, acc);
}

/// The un-permute: `out[t, c] = Σ_{q<k} y[inv[t·k + q], c]` over the dispatched pairs of token
/// `t` (in slot order, so the sum is reproducible); masked tokens get zeros. `y: [pairs, width]`,
/// `out: [tokens, width]`. One unit per output element.
#[cube(launch_unchecked)]
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
#[cube(launch_unchecked)]
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
