//! MX (OCP Microscaling v1.0) fake quantisation (design §9): `X · Q(x / X)` per block of
//! [`MX_BLOCK`] values along the rows of a contiguous f32 array, one unit per block.
//!
//! Everything after the load is integer arithmetic on the f32 bits: the block's largest magnitude
//! is a `u32` maximum, the scale exponent comes from the exponent field, each element is rounded
//! to its grid (nearest, ties to even) by shifting its significand, and the result is assembled
//! from its exponent and significand. The answer is exact and does not depend on how a device
//! treats subnormal floats (several flush them to zero), so it equals the host loop bit for bit.

use cubecl::prelude::*;

/// Values per block.
pub const MX_BLOCK: usize = 32;

/// `floor(log2 a)` of a positive f32 given its magnitude bits (subnormals included).
#[cube]
fn floor_log2_bits(abits: u32) -> i32 {
    let biased = abits >> 23;
    let mut r = i32::cast_from(biased) - 127;
    if biased == 0 {
        r = -118 - i32::cast_from(u32::leading_zeros(abits));
    }
    r
}

/// `(sig, e0)` with `a = sig · 2^e0` for the f32 with magnitude bits `abits` (the implicit bit
/// made explicit for normal values).
#[cube]
fn significand(abits: u32) -> (u32, i32) {
    let biased = abits >> 23;
    let mut sig = abits;
    let mut e0 = i32::cast_from(biased) - 150;
    if biased > 0 {
        sig = (abits & 0x7f_ffffu32) | 0x80_0000u32;
    } else {
        e0 = 1i32 - 150;
    }
    (sig, e0)
}

/// Fake quantisation of the rows `[rows, len]` of `x` into `y` (same layout), blocks of 32 from the
/// start of each row (the last block of a row may be shorter).
///
/// The element format is given by `mbits` (explicit mantissa bits), `emin` (exponent of its
/// smallest normal value), `emax` (of its largest binade) and `max_sig` (its largest value is
/// `max_sig · 2^(emax − mbits)`). `ceil_above`: the scale is raised one binade when the 23-bit
/// fraction of `amax`'s significand exceeds it (the "ceil" rule: the block maximum would not fit);
/// `u32::MAX` gives the specification's "floor" rule. All-zero blocks have scale 1; every zero
/// comes out as `+0`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn mx_fake_quant(
    x: &Array<f32>,
    y: &mut Array<f32>,
    rows: usize,
    len: usize,
    blocks_per_row: usize,
    mbits: i32,
    emin: i32,
    emax: i32,
    max_sig: u32,
    ceil_above: u32,
) {
    let block = ABSOLUTE_POS;
    if block >= rows * blocks_per_row {
        terminate!();
    }
    let row = block / blocks_per_row;
    let start = row * len + (block % blocks_per_row) * MX_BLOCK;
    let end = usize::min(start + MX_BLOCK, row * len + len);
    let mut amax = 0u32;
    for i in start..end {
        let a = u32::reinterpret(x[i]) & 0x7fff_ffffu32;
        if a > amax {
            amax = a;
        }
    }
    let mut s = 0i32;
    if amax > 0 {
        s = floor_log2_bits(amax) - emax;
        let (sig, _e0) = significand(amax);
        // The fraction of amax normalised to [1, 2), as 23 bits.
        let fraction = (sig << (u32::leading_zeros(sig) - 8)) & 0x7f_ffff;
        if fraction > ceil_above {
            s += 1;
        }
        s = i32::max(i32::min(s, 127), -127);
    }
    for i in start..end {
        let bits = u32::reinterpret(x[i]);
        let abits = bits & 0x7fff_ffffu32;
        let mut out = 0u32;
        if abits > 0 {
            let (sig, e0) = significand(abits);
            // v = x / 2^s = sig · 2^(e0 − s), in binade ev; grid step 2^qexp.
            let ev = floor_log2_bits(abits) - s;
            let qexp = i32::max(ev, emin) - mbits;
            let shift = qexp - (e0 - s);
            let mut q = 0u32;
            if shift <= 0 {
                q = sig << u32::cast_from(-shift);
            } else if shift < 26 {
                let sh = u32::cast_from(shift);
                q = sig >> sh;
                let rem = sig & ((1u32 << sh) - 1);
                let half = 1u32 << (sh - 1);
                if rem > half || (rem == half && (q & 1) == 1) {
                    q += 1;
                }
            }
            if qexp == emax - mbits && q > max_sig {
                q = max_sig;
            }
            if q > 0 {
                // y = q · 2^(qexp + s): normal or subnormal f32, always representable.
                let top = 31 - i32::cast_from(u32::leading_zeros(q));
                let e = qexp + s + top;
                if e >= -126 {
                    out = (u32::cast_from(e + 127) << 23)
                        | ((q << u32::cast_from(23 - top)) & 0x7f_ffffu32);
                } else {
                    out = q << u32::cast_from(qexp + s + 149);
                }
                out |= bits & 0x8000_0000u32;
            }
        }
        y[i] = f32::reinterpret(out);
    }
}
