//! The building blocks of the grouped matmul and of its weight gradient: loads of 4 lanes,
//! a unit's micro-tile (zeroing, one depth step, reading it back from shared memory), and the
//! tensor-core blocks (`cmma`) with their store to shared memory.

use cubecl::prelude::*;

use super::{TILE, TILE_K};
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

/// A zeroed `16 × 16` f32 accumulator block of the matrix units.
#[cube]
pub(super) fn zero_block() -> cmma::Matrix<f32> {
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
pub(super) fn multiply_pair<F: Float>(
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
pub(super) fn store_pair(
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
pub(super) fn read_micro_tile(tile: &SharedMemory<f32>, acc: &mut Array<V4>) {
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
