//! The building blocks of the grouped matmul and of its weight gradient: loads of 4 lanes,
//! a unit's micro-tile (zeroing, one depth step, reading it back from shared memory), and the
//! tensor-core blocks (`cmma`, or their emulation on the units) with their store to shared
//! memory.

use cubecl::cmma::Matrix as CubeMatrix;
use cubecl::prelude::*;

use super::{MMA_PLANE, TILE, TILE_K};
use crate::V4;

/// Loads element `index` of `m` as f32, or 0 when not `inside`.
#[cube]
pub(super) fn load_f32<F: Float>(m: &Array<F>, index: usize, inside: bool) -> f32 {
    let mut v = 0.0f32;
    if inside {
        v = f32::cast_from(m[index]);
    }
    v
}

/// Loads `m[base + j·stride]` for the lanes `j < 4` with `j < count` as an f32 [`V4`]; lanes at
/// or past `count` (and all lanes when `count` is 0) are 0.
#[cube]
pub(super) fn load_v4<F: Float>(m: &Array<F>, base: usize, stride: usize, count: usize) -> V4 {
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
pub(super) fn fma_micro(
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
pub(super) fn zero_micro_tile(#[comptime] len: u32) -> Array<V4> {
    let mut acc = Array::<V4>::new(len as usize);
    #[unroll]
    for i in 0..len as usize {
        acc[i] = V4::new(0.0f32);
    }
    acc
}

/// How many of the 4 lanes starting at `start` lie below `end`.
#[cube]
pub(super) fn lanes_below(start: usize, end: usize) -> usize {
    let mut n = 0usize;
    if start < end {
        n = usize::min(end - start, 4usize);
    }
    n
}

/// The row stride of the tensor-core path's shared f32 `[TILE, TILE]` accumulator tile: 16
/// bytes of padding per row, as in the stages ([`Products::stage_pad`]).
///
/// [`Products::stage_pad`]: super::Products::stage_pad
pub(super) const TILE_STRIDE: usize = TILE as usize + 4;

/// The elements of the tensor-core path's shared f32 accumulator tile.
pub(super) const TILE_LEN: usize = TILE as usize * TILE_STRIDE;

/// An `A` operand (`16 × depth`) or a `16 × 16` accumulator block of the tensor-core layout: a
/// cooperative matrix on the matrix units, or, where their products are emulated
/// ([`Products::Emulated`]), the part of the block this unit holds in registers: unit `lane` of
/// the plane ([`MMA_PLANE`] units) holds row `lane / 2` (of an `A` operand all `depth` entries,
/// of an accumulator the 8 columns from `8 · (lane % 2)`).
///
/// [`Products::Emulated`]: super::Products::Emulated
// The variants are built by the `#[cube]` expansion (`Block::new_Matrix`, …), which rustc's
// dead-code pass does not see.
#[allow(dead_code)]
#[derive(CubeType)]
pub(super) enum Block<E: Numeric> {
    /// On the matrix units.
    Matrix(CubeMatrix<E>),
    /// Emulated: this unit's entries, in f32.
    Emulated(Array<f32>),
}

/// This unit's row of its plane's emulated blocks, and the first of its 8 accumulator columns.
#[cube]
fn emulated_lane() -> (usize, usize) {
    let lane = (UNIT_POS % MMA_PLANE) as usize;
    (lane / 2, 8 * (lane % 2))
}

/// A zeroed `16 × 16` f32 accumulator block for products of `depth` (CUDA's fragments carry
/// the product's shape, the accumulator's too).
#[cube]
pub(super) fn zero_block(#[comptime] depth: usize, #[comptime] emulated: bool) -> Block<f32> {
    if comptime!(emulated) {
        let mut v = Array::<f32>::new(8usize);
        #[unroll]
        for j in 0..8usize {
            v[j] = 0.0f32;
        }
        Block::<f32>::new_Emulated(v)
    } else {
        Block::<f32>::new_Matrix(cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            16usize,
            16usize,
            depth,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        ))
    }
}

/// The `16 × depth` `A` operand at `off` of the shared stage `s` (`len` entries), row-major with
/// row stride `stride`, or column-major (column stride `stride`) when `col_major`.
#[cube]
pub(super) fn load_a<S: Float>(
    s: &SharedMemory<S>,
    off: usize,
    len: usize,
    stride: usize,
    #[comptime] col_major: bool,
    #[comptime] depth: usize,
    #[comptime] emulated: bool,
) -> Block<S> {
    if comptime!(emulated) {
        let (row, _) = emulated_lane();
        let mut v = Array::<f32>::new(depth);
        #[unroll]
        for k in 0..depth {
            let mut at = off + row * stride + k;
            if comptime!(col_major) {
                at = off + k * stride + row;
            }
            v[k] = f32::cast_from(s[at]);
        }
        Block::<S>::new_Emulated(v)
    } else {
        let layout = comptime!(if col_major {
            cmma::MatrixLayout::ColMajor
        } else {
            cmma::MatrixLayout::RowMajor
        });
        Block::<S>::new_Matrix(cmma::Matrix::<S>::from_slice(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            depth,
            layout,
            &s.slice(off, len),
            stride as u32,
        ))
    }
}

/// `acc += a · B` with `B` the `depth × 16` block at `off` of the row-major `[TILE_K, TILE]`
/// stage `b` (row stride `stride`).
#[cube]
fn multiply_block<S: Float>(
    a: &Block<S>,
    b: &SharedMemory<S>,
    off: usize,
    stride: usize,
    acc: &mut Block<f32>,
    #[comptime] depth: usize,
) {
    match a {
        Block::Matrix(am) => match acc {
            Block::Matrix(m) => {
                let bm = cmma::Matrix::<S>::from_slice(
                    cmma::MatrixIdent::B,
                    16usize,
                    16usize,
                    depth,
                    cmma::MatrixLayout::RowMajor,
                    &b.slice(off, stride * TILE_K as usize),
                    stride as u32,
                );
                cmma::execute::<S, S, f32, f32>(am, &bm, m, m);
            }
            Block::Emulated(_) => panic!("a matrix-unit operand with an emulated accumulator"),
        },
        Block::Emulated(av) => match acc {
            Block::Emulated(c) => {
                let (_, col) = emulated_lane();
                #[unroll]
                for j in 0..8usize {
                    let mut sum = c[j];
                    #[unroll]
                    for k in 0..depth {
                        sum += av[k] * f32::cast_from(b[off + k * stride + col + j]);
                    }
                    c[j] = sum;
                }
            }
            Block::Matrix(_) => panic!("an emulated operand with a matrix-unit accumulator"),
        },
    }
}

/// `acc0 += a · B₀` and `acc1 += a · B₁`, with `B₀`, `B₁` the `depth × 16` blocks at `off` and
/// `off + 16` of the row-major `[TILE_K, TILE]` stage `b` (row stride `stride`).
#[cube]
pub(super) fn multiply_pair<S: Float>(
    a: &Block<S>,
    b: &SharedMemory<S>,
    off: usize,
    stride: usize,
    acc0: &mut Block<f32>,
    acc1: &mut Block<f32>,
    #[comptime] depth: usize,
) {
    multiply_block::<S>(a, b, off, stride, acc0, depth);
    multiply_block::<S>(a, b, off + 16, stride, acc1, depth);
}

/// Stores an accumulator block at `off` of the shared row-major `[TILE, TILE]` f32 tile (row
/// stride [`TILE_STRIDE`]).
#[cube]
fn store_block(tile: &mut SharedMemory<f32>, off: usize, acc: &Block<f32>) {
    let stride = TILE_STRIDE;
    match acc {
        Block::Matrix(m) => {
            cmma::store(
                &mut tile.slice_mut(off, TILE as usize * stride),
                m,
                stride as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        Block::Emulated(c) => {
            let (row, col) = emulated_lane();
            #[unroll]
            for j in 0..8usize {
                tile[off + row * stride + col + j] = c[j];
            }
        }
    }
}

/// Stores two accumulator blocks side by side at `off` and `off + 16` of the shared row-major
/// `[TILE, TILE]` f32 tile (row stride [`TILE_STRIDE`]).
#[cube]
pub(super) fn store_pair(
    tile: &mut SharedMemory<f32>,
    off: usize,
    acc0: &Block<f32>,
    acc1: &Block<f32>,
) {
    store_block(tile, off, acc0);
    store_block(tile, off + 16, acc1);
}

/// The unit's 4×4 micro-tile (rows `4·ty..`, columns `4·tx..`) of a shared `[TILE, TILE]` f32
/// tile (row stride [`TILE_STRIDE`]).
#[cube]
pub(super) fn read_micro_tile(tile: &SharedMemory<f32>, acc: &mut Array<V4>) {
    let t = TILE_STRIDE;
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
