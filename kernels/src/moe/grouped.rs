//! The grouped matmul over the expert segments (one launch for all experts), with the experts'
//! SiTU-GLU first layer and its backward fused into its epilogue: a scalar loop over shared-memory
//! tiles everywhere, and the tensor-core (`cmma`) path where the device has matrix units.

use cubecl::prelude::*;
use cubecl::tf32;

use super::tiles::{
    fma_micro, lanes_below, load_a, load_f32, load_v4, multiply_pair, read_micro_tile, store_pair,
    zero_block, zero_micro_tile, TILE_LEN, TILE_STRIDE,
};
use super::{Products, EPILOGUE_GLU, EPILOGUE_GLU_BACKWARD, GMM_MICRO, MMA_PLANE, TILE, TILE_K};
use crate::situ::{glu_a, glu_b, glu_backward};
use crate::V4;

/// Rows (= columns) of a unit's micro-tile in [`grouped_matmul`](fn@grouped_matmul): 4 on the
/// tensor-core layout ([`Products::blocks`]), [`GMM_MICRO`] in the scalar loop.
pub const fn micro_rows(products: Products) -> u32 {
    if products.blocks() {
        4
    } else {
        GMM_MICRO
    }
}

/// The cube of [`grouped_matmul`](fn@grouped_matmul) (`x` along the tile's columns, `y` along
/// its rows): one unit per micro-tile of the `TILE × TILE` output tile.
pub const fn grouped_matmul_cube(products: Products) -> (u32, u32) {
    (TILE / micro_rows(products), TILE / micro_rows(products))
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
/// [`grouped_matmul_cube`]`(products)`.
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
/// With [`Products::MatrixUnits`] (half storage on a device with `16×16×16` cooperative matrices
/// for `F × F → f32` and planes of [`MMA_PLANE`] units, i.e. tensor cores on CUDA) the products
/// run on the matrix units: the slices are staged in `F` in shared memory, each plane multiplies
/// its two `16 × 16` blocks with f32 accumulation, and the blocks go through shared memory into
/// the same 4×4 micro-tiles, so the epilogues are unchanged. [`Products::MatrixUnitsTf32`] is
/// that path on f32 storage (stages in TF32, `16×16×8` blocks), [`Products::Emulated`] and
/// [`Products::EmulatedTf32`] are the two with the block products computed by the units, and
/// [`Products::Scalar`] is the f32 loop above.
///
/// Products are rounded to `F` before the activation math, as the unfused path stores them, so
/// the forward gives the same bits as separate launches in every storage type. No
/// `[pairs, cols]` intermediate goes through memory. Arrays an epilogue does not use are not
/// read or written (pass any).
///
/// Long on purpose: one kernel body (a cube function cannot hand shared-memory tiles to a helper
/// cheaply), laid out as load tile, multiply, store.
///
/// [`EPILOGUE_PLAIN`]: super::EPILOGUE_PLAIN
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
    #[comptime] products: Products,
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
    let mr = comptime!(micro_rows(products) as usize);
    let mc = mr;
    let mc4 = comptime!(micro_rows(products) as usize / 4);
    let ux = comptime!((TILE / micro_rows(products)) as usize);

    let glu = comptime!(epilogue == EPILOGUE_GLU);
    let mut acc = zero_micro_tile(comptime!(micro_rows(products) * micro_rows(products) / 4));
    let mut acc3 = zero_micro_tile(comptime!(if glu {
        micro_rows(products) * micro_rows(products) / 4
    } else {
        1u32
    }));

    if comptime!(products.blocks()) {
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
        // The stage's type: TF32 on the matrix units' f32 path, else the storage type.
        if comptime!(products == Products::MatrixUnitsTf32) {
            grouped_mma::<F, tf32>(
                a, w, w3, &arows, a_lanes, c_lanes, w_base, col0, kdim, cols, &mut acc, &mut acc3,
                transposed, glu, products,
            );
        } else {
            grouped_mma::<F, F>(
                a, w, w3, &arows, a_lanes, c_lanes, w_base, col0, kdim, cols, &mut acc, &mut acc3,
                transposed, glu, products,
            );
        }
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
        let units =
            comptime!(((TILE / micro_rows(products)) * (TILE / micro_rows(products))) as usize);
        let stage = comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(products)) * (TILE / micro_rows(products))))
                as usize
        );
        let unit = ty * ux + tx;
        let ka0 = unit % tk;
        let kb0 = unit / q;
        let cb = col0 + 4 * (unit % q);
        let b_lanes = lanes_below(cb, cols);
        let mut srows = Array::<usize>::new(comptime!(
            (4 * TILE_K * TILE
                / 4
                / ((TILE / micro_rows(products)) * (TILE / micro_rows(products))))
                as usize
        ));
        let mut slanes = Array::<usize>::new(comptime!(
            (TILE_K * TILE / 4 / ((TILE / micro_rows(products)) * (TILE / micro_rows(products))))
                as usize
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
        let mut a_reg = Array::<V4>::new(comptime!((micro_rows(products) / 4) as usize));
        let mut b_reg = Array::<V4>::new(comptime!((micro_rows(products) / 4) as usize));
        let mut b3_reg = Array::<V4>::new(comptime!(if glu {
            (micro_rows(products) / 4) as usize
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
            SharedMemory::<f32>::new(comptime!((TILE * (TILE / micro_rows(products))) as usize));
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

/// Unit `(tx, ty)`'s share of the `TILE_K` slice at depth `k0` in [`grouped_mma`](fn@grouped_mma), as `S`:
/// `ra[j]` = `a` at depth `k0 + tx` of its row `j` (`arows[j]`, `a_lanes` of them in the
/// segment), `rb[j]` (and `rb3[j]` with `glu`) = `w` (`w3`) at depth `k0 + ty` of column
/// `col0 + 4·tx + j` (`c_lanes` of them in the matrix); zeros elsewhere and past `kdim`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn fetch_slice<F: Float, S: Float>(
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
    k0: usize,
    ra: &mut Array<S>,
    rb: &mut Array<S>,
    rb3: &mut Array<S>,
    #[comptime] transposed: bool,
    #[comptime] glu: bool,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let zero = S::cast_from(0.0f32);
    let ka = k0 + tx;
    #[unroll]
    for j in 0..4usize {
        let mut v = zero;
        if j < a_lanes && ka < kdim {
            v = S::cast_from(a[arows[j] * kdim + ka]);
        }
        ra[j] = v;
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
            v = S::cast_from(w[index]);
        }
        rb[j] = v;
        if comptime!(glu) {
            let mut v3 = zero;
            if inside {
                v3 = S::cast_from(w3[index]);
            }
            rb3[j] = v3;
        }
    }
}

/// The main loop of [`grouped_matmul`](fn@grouped_matmul) on the matrix units (or their
/// emulation, as `products` says): fills the unit's 4×4 micro-tiles `acc` (and `acc3` with
/// `glu`) with the same products as the scalar loop, accumulated in f32.
///
/// Per `TILE_K` step the cube stages the `a` rows as `[TILE, TILE_K]` and the `w` (and `w3`)
/// columns as `[TILE_K, TILE]`, row-major in `S` (the storage type, or TF32), with the scalar
/// loop's load pattern (zeros outside the segment and the matrix), each unit's share fetched
/// into registers during the step before ([`fetch_slice`](fn@fetch_slice)); plane `p` of the eight
/// multiplies rows `16·(p / 2)..` by the two column blocks `32·(p % 2)..`, in
/// `TILE_K / depth` block products of [`Products::depth`]. After the loop each accumulator
/// block goes to a shared f32 `[TILE, TILE]` tile, which the units read back as their
/// micro-tiles (`w3`'s blocks after `w`'s, through the same tile).
#[allow(clippy::too_many_arguments)]
#[cube]
fn grouped_mma<F: Float, S: Float>(
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
    #[comptime] products: Products,
) {
    let t = TILE as usize;
    let tk = TILE_K as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let emulated = comptime!(products.emulated());
    let depth = comptime!(products.depth());
    // Row strides of the `a` stage `[TILE, TILE_K]` and of the `w` stages `[TILE_K, TILE]`,
    // padded against bank conflicts (`Products::stage_pad`).
    let sa = comptime!(TILE_K as usize + products.stage_pad());
    let sb = comptime!(TILE as usize + products.stage_pad());
    let mut ha = SharedMemory::<S>::new_aligned(comptime!(TILE as usize * sa), 32usize);
    let mut hb = SharedMemory::<S>::new_aligned(comptime!(TILE_K as usize * sb), 32usize);
    let mut hb3 = SharedMemory::<S>::new_aligned(
        comptime!(if glu { TILE_K as usize * sb } else { 1usize }),
        32usize,
    );
    let plane = (UNIT_POS / MMA_PLANE) as usize;
    let a_off = (plane / 2) * 16 * sa;
    let b_off = (plane % 2) * 32;
    let c_off = (plane / 2) * 16 * TILE_STRIDE + b_off;
    let mut m0 = zero_block(depth, emulated);
    let mut m1 = zero_block(depth, emulated);
    let mut u0 = zero_block(depth, emulated);
    let mut u1 = zero_block(depth, emulated);
    // Registers holding this unit's share of the next slice: fetched from global memory while
    // the matrix units multiply the current one, stored to the stages at the next step.
    let mut ra = Array::<S>::new(4usize);
    let mut rb = Array::<S>::new(4usize);
    let mut rb3 = Array::<S>::new(comptime!(if glu { 4usize } else { 1usize }));
    fetch_slice::<F, S>(
        a, w, w3, arows, a_lanes, c_lanes, w_base, col0, kdim, cols, 0, &mut ra, &mut rb, &mut rb3,
        transposed, glu,
    );
    let mut k0 = 0usize;
    while k0 < kdim {
        #[unroll]
        for j in 0..4usize {
            ha[(4 * ty + j) * sa + tx] = ra[j];
            hb[ty * sb + 4 * tx + j] = rb[j];
            if comptime!(glu) {
                hb3[ty * sb + 4 * tx + j] = rb3[j];
            }
        }
        sync_cube();
        fetch_slice::<F, S>(
            a,
            w,
            w3,
            arows,
            a_lanes,
            c_lanes,
            w_base,
            col0,
            kdim,
            cols,
            k0 + tk,
            &mut ra,
            &mut rb,
            &mut rb3,
            transposed,
            glu,
        );
        #[unroll]
        for ks in 0..comptime!(TILE_K as usize / products.depth()) {
            // Depths `ks · depth..` of the slice: columns of `a`'s rows, rows of `w`'s.
            let am = load_a::<S>(&ha, a_off + ks * depth, t * sa, sa, false, depth, emulated);
            let b_at = b_off + ks * depth * sb;
            multiply_pair::<S>(&am, &hb, b_at, sb, &mut m0, &mut m1, depth);
            if comptime!(glu) {
                multiply_pair::<S>(&am, &hb3, b_at, sb, &mut u0, &mut u1, depth);
            }
        }
        sync_cube();
        k0 += tk;
    }
    let mut tile = SharedMemory::<f32>::new_aligned(TILE_LEN, 32usize);
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
