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

mod grouped;
mod tiles;
mod wgrad;

use cubecl::prelude::*;

pub use grouped::{grouped_matmul, grouped_matmul_cube, micro_rows};
pub use wgrad::grouped_matmul_wgrad;

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
///
/// [`V4`]: crate::V4
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
/// How [`grouped_matmul`](fn@grouped_matmul) and [`grouped_matmul_wgrad`](fn@grouped_matmul_wgrad)
/// compute their products (a comptime switch of both).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Products {
    /// The scalar f32 loop: [`GMM_MICRO`]² micro-tiles in cubes of 64 units. Every device.
    Scalar,
    /// The matrix units (`cmma`, tensor cores on CUDA) on half storage: `16 × 16 × 16` block
    /// products of f16 or bf16 with f32 accumulation, two blocks per plane of [`MMA_PLANE`]
    /// units, 4×4 micro-tiles in cubes of [`GMM_CUBE`]² units.
    MatrixUnits,
    /// The matrix units on f32 storage: the same layout, with the slices staged in TF32 (f32's
    /// range, a 10-bit significand: what Burn's own f32 matmuls use on CUDA's tensor cores) and
    /// `16 × 16 × 8` block products, two per `TILE_K` step.
    MatrixUnitsTf32,
    /// [`MatrixUnits`](Self::MatrixUnits)' tiles, staging, block placement and epilogues, with
    /// each block product computed in f32 by the plane's units instead (a unit per half row of
    /// the block, as the 32 units of a plane share a block's 256 entries). No device feature
    /// needed: this is how a device without matrix units (lavapipe in CI) tests everything of
    /// the tensor-core path but the `cmma` instructions. Slower than [`Scalar`](Self::Scalar),
    /// never a speed-up.
    Emulated,
    /// The emulation of [`MatrixUnitsTf32`](Self::MatrixUnitsTf32): its `16 × 16 × 8` blocks,
    /// staged in f32.
    EmulatedTf32,
}

impl Products {
    /// Whether the products are laid out in the matrix units' `16 × 16` blocks.
    pub const fn blocks(self) -> bool {
        !matches!(self, Self::Scalar)
    }

    /// Whether the block products are emulated on the units.
    pub const fn emulated(self) -> bool {
        matches!(self, Self::Emulated | Self::EmulatedTf32)
    }

    /// The depth of one block product: 16, or 8 in the TF32 shape.
    pub const fn depth(self) -> usize {
        match self {
            Self::MatrixUnitsTf32 | Self::EmulatedTf32 => 8,
            _ => 16,
        }
    }

    /// Elements of padding after each row of the tensor-core path's shared stages: 16 bytes
    /// (8 halves, or 4 f32 in the TF32 shape), so that the eight rows of an `8 × 8` piece of a
    /// fragment load start 16 bytes apart modulo 128 (one bank group each) instead of on the
    /// same banks: unpadded, the `[TILE_K, TILE]` stages' rows are a multiple of 128 bytes
    /// long. Fragment starts stay 32-byte aligned and strides a multiple of 16 bytes, as the
    /// matrix loads require.
    pub const fn stage_pad(self) -> usize {
        if self.depth() == 8 {
            4
        } else {
            8
        }
    }
}

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
