//! The weight gradients of the grouped matmul: per expert, `Aᵀ · dY` over its segment, on the same
//! shared-memory tiles (and matrix units) as the forward.

use cubecl::prelude::*;
use cubecl::tf32;

use super::grouped::micro_rows;
use super::tiles::{
    fma_micro, lanes_below, load_a, load_v4, multiply_pair, read_micro_tile, store_pair,
    zero_block, zero_micro_tile, TILE_LEN, TILE_STRIDE,
};
use super::{Products, MMA_PLANE, TILE, TILE_K};
use crate::V4;

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
/// on the tensor-core layout). `products` chooses the scalar loop, the matrix units or their
/// emulation, as in [`grouped_matmul`]. Grid: `(ceil(adim / TILE), ceil(bdim / TILE), n)`;
/// cube [`grouped_matmul_cube`]`(products)`.
///
/// [`GMM_MICRO`]: super::GMM_MICRO
/// [`grouped_matmul`]: fn@super::grouped_matmul
/// [`grouped_matmul_cube`]: super::grouped_matmul_cube
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
    #[comptime] products: Products,
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
    let mr = comptime!(micro_rows(products) as usize);
    let mc4 = comptime!(micro_rows(products) as usize / 4);
    let mut acc = zero_micro_tile(comptime!(micro_rows(products) * micro_rows(products) / 4));

    if comptime!(products.blocks()) {
        let a_lanes = lanes_below(r0 + 4 * tx, adim);
        let b_lanes = lanes_below(c0 + 4 * tx, bdim);
        // The stage's type: TF32 on the matrix units' f32 path, else the storage type.
        if comptime!(products == Products::MatrixUnitsTf32) {
            wgrad_mma::<F, tf32>(
                a, b, rows, start, end, r0, c0, adim, bdim, a_lanes, b_lanes, &mut acc, gather_a,
                gather_b, products,
            );
        } else {
            wgrad_mma::<F, F>(
                a, b, rows, start, end, r0, c0, adim, bdim, a_lanes, b_lanes, &mut acc, gather_a,
                gather_b, products,
            );
        }
    } else {
        // Both slices hold `tk` pairs × `TILE` features as V4s; entry `unit + s · units` of
        // each (`s < stage`) is loaded by `unit`: features `4 · (unit % q)..` of the pair
        // `unit / q + s · units / q`.
        let mut sa = SharedMemory::<V4>::new(tk * q);
        let mut sb = SharedMemory::<V4>::new(tk * q);
        let units =
            comptime!(((TILE / micro_rows(products)) * (TILE / micro_rows(products))) as usize);
        let stage = comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(products)) * (TILE / micro_rows(products))))
                as usize
        );
        let unit = ty * comptime!((TILE / micro_rows(products)) as usize) + tx;
        let f4 = unit % q;
        let a_lanes = lanes_below(r0 + 4 * f4, adim);
        let b_lanes = lanes_below(c0 + 4 * f4, bdim);
        let mut a_reg = Array::<V4>::new(comptime!((micro_rows(products) / 4) as usize));
        let mut b_reg = Array::<V4>::new(comptime!((micro_rows(products) / 4) as usize));
        let mut p0 = start;
        while p0 < end {
            #[unroll]
            for s in 0..stage {
                let kk = unit / q + s * (units / q);
                let pos = p0 + kk;
                let inside = pos < end;
                let (arow, brow) = pair_rows(rows, pos, inside, gather_a, gather_b);
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

/// The rows of `a` and of `b` that the sorted pair at `pos` reads: `rows[pos]` for a gathered
/// operand, else `pos` (also for a pair past the segment, `!inside`, whose loads are masked).
#[cube]
fn pair_rows(
    rows: &Array<u32>,
    pos: usize,
    inside: bool,
    #[comptime] gather_a: bool,
    #[comptime] gather_b: bool,
) -> (usize, usize) {
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
    (arow, brow)
}

/// Unit `(tx, ty)`'s share of the `TILE_K` pairs from `p0` in [`wgrad_mma`](fn@wgrad_mma), as `S`: features
/// `r0 + 4·tx..` (`a_lanes` of them) of `a`'s row and `c0 + 4·tx..` (`b_lanes`) of `b`'s row of
/// the pair `p0 + ty`; zeros for lanes past the widths and for a pair at or past `end`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn fetch_pairs<F: Float, S: Float>(
    a: &Array<F>,
    b: &Array<F>,
    rows: &Array<u32>,
    p0: usize,
    end: usize,
    r0: usize,
    c0: usize,
    adim: usize,
    bdim: usize,
    a_lanes: usize,
    b_lanes: usize,
    ra: &mut Array<S>,
    rb: &mut Array<S>,
    #[comptime] gather_a: bool,
    #[comptime] gather_b: bool,
) {
    let tx = UNIT_POS_X as usize;
    let pos = p0 + UNIT_POS_Y as usize;
    let inside = pos < end;
    let (arow, brow) = pair_rows(rows, pos, inside, gather_a, gather_b);
    let zero = S::cast_from(0.0f32);
    #[unroll]
    for j in 0..4usize {
        let mut va = zero;
        if inside && j < a_lanes {
            va = S::cast_from(a[arow * adim + r0 + 4 * tx + j]);
        }
        ra[j] = va;
        let mut vb = zero;
        if inside && j < b_lanes {
            vb = S::cast_from(b[brow * bdim + c0 + 4 * tx + j]);
        }
        rb[j] = vb;
    }
}

/// The main loop of [`grouped_matmul_wgrad`](fn@grouped_matmul_wgrad) on the matrix units (or
/// their emulation, as `products` says): `acc` gets the unit's 4×4 micro-tile of
/// `Σ_pos a[arow(pos)]ᵀ · b[brow(pos)]`, accumulated in f32. Per `TILE_K` pairs the cube stages
/// `a`'s and `b`'s features as `[TILE_K, TILE]` row-major in `S` (the storage type, or TF32;
/// zeros past the segment and the widths), each unit's share fetched into registers during the
/// step before ([`fetch_pairs`](fn@fetch_pairs)), multiplied in `TILE_K / depth` block products of
/// [`Products::depth`]; `a`'s slice is the `A` operand read column-major. Plane `p` of the eight owns rows `16·(p / 2)..` and the column blocks
/// `32·(p % 2)..`, as in the grouped matmul's tensor-core loop.
#[allow(clippy::too_many_arguments)]
#[cube]
fn wgrad_mma<F: Float, S: Float>(
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
    #[comptime] products: Products,
) {
    let tk = TILE_K as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let emulated = comptime!(products.emulated());
    let depth = comptime!(products.depth());
    // The stages' row stride, padded against bank conflicts (`Products::stage_pad`).
    let st = comptime!(TILE as usize + products.stage_pad());
    let mut ha = SharedMemory::<S>::new_aligned(comptime!(TILE_K as usize * st), 32usize);
    let mut hb = SharedMemory::<S>::new_aligned(comptime!(TILE_K as usize * st), 32usize);
    let plane = (UNIT_POS / MMA_PLANE) as usize;
    let a_off = (plane / 2) * 16;
    let b_off = (plane % 2) * 32;
    let c_off = (plane / 2) * 16 * TILE_STRIDE + b_off;
    let mut m0 = zero_block(depth, emulated);
    let mut m1 = zero_block(depth, emulated);
    // Registers holding this unit's share of the next pairs: fetched from global memory while
    // the matrix units multiply the current ones, stored to the stages at the next step.
    let mut ra = Array::<S>::new(4usize);
    let mut rb = Array::<S>::new(4usize);
    fetch_pairs::<F, S>(
        a, b, rows, start, end, r0, c0, adim, bdim, a_lanes, b_lanes, &mut ra, &mut rb, gather_a,
        gather_b,
    );
    let mut p0 = start;
    while p0 < end {
        #[unroll]
        for j in 0..4usize {
            ha[ty * st + 4 * tx + j] = ra[j];
            hb[ty * st + 4 * tx + j] = rb[j];
        }
        sync_cube();
        fetch_pairs::<F, S>(
            a,
            b,
            rows,
            p0 + tk,
            end,
            r0,
            c0,
            adim,
            bdim,
            a_lanes,
            b_lanes,
            &mut ra,
            &mut rb,
            gather_a,
            gather_b,
        );
        #[unroll]
        for ks in 0..comptime!(TILE_K as usize / products.depth()) {
            // Pairs `ks · depth..` of the slice.
            let at = ks * depth * st;
            let am = load_a::<S>(&ha, a_off + at, tk * st, st, true, depth, emulated);
            multiply_pair::<S>(&am, &hb, b_off + at, st, &mut m0, &mut m1, depth);
        }
        sync_cube();
        p0 += tk;
    }
    let mut tile = SharedMemory::<f32>::new_aligned(TILE_LEN, 32usize);
    store_pair(&mut tile, c_off, &m0, &m1);
    sync_cube();
    read_micro_tile(&tile, acc);
}
