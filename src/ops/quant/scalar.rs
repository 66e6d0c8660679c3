//! MX quantisation of `f32` values on the host, exactly: the scalar rules every path follows and
//! the CPU host kernel and the packing are built from (design §9).
//!
//! Every step is exact in f32: scales are powers of two (multiplying by one is exact unless the
//! result leaves the normal range, where the element rounds to zero anyway), element rounding is
//! to nearest, ties to even, on a grid whose step is a power of two.

use super::{MxFormat, MxScaleRule, MX_BLOCK};

/// The element format's constants.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Elem {
    /// Exponent bits.
    pub ebits: u32,
    /// Explicit mantissa bits.
    pub mbits: i32,
    /// Exponent of the smallest normal value.
    pub emin: i32,
    /// Exponent of the largest normal binade (`emax_elem` of the MX specification).
    pub emax: i32,
    /// The largest finite value.
    pub max: f32,
}

impl MxFormat {
    pub(crate) fn elem(self) -> Elem {
        match self {
            Self::Fp4E2M1 => Elem {
                ebits: 2,
                mbits: 1,
                emin: 0,
                emax: 2,
                max: 6.0,
            },
            Self::Fp8E4M3 => Elem {
                ebits: 4,
                mbits: 3,
                emin: -6,
                emax: 8,
                max: 448.0,
            },
            Self::Fp8E5M2 => Elem {
                ebits: 5,
                mbits: 2,
                emin: -14,
                emax: 15,
                max: 57344.0,
            },
        }
    }
}

/// `2^e` for `e` in the range of f32 (normal or subnormal), exactly.
pub(crate) fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// `floor(log2 a)` for a finite `a > 0`, exactly (subnormals included).
pub(crate) fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits() & 0x7fff_ffff;
    let biased = (bits >> 23) as i32;
    if biased > 0 {
        biased - 127
    } else {
        // Subnormal: the highest set bit of the mantissa.
        -149 + (31 - bits.leading_zeros() as i32)
    }
}

/// The shared scale exponent of a block with largest magnitude `amax` (finite): `None` for an
/// all-zero block (its scale is 1). The result lies in E8M0's range `[-127, 127]`.
pub(crate) fn scale_exponent(amax: f32, format: MxFormat, rule: MxScaleRule) -> Option<i32> {
    if amax == 0.0 {
        return None;
    }
    let e = format.elem();
    let top = floor_log2(amax);
    let mut s = top - e.emax;
    if rule == MxScaleRule::Ceil {
        // amax / 2^s = r · 2^emax with r ∈ [1, 2): beyond the largest element, one binade up.
        let r = amax / pow2(top);
        if r * pow2(e.emax) > e.max {
            s += 1;
        }
    }
    Some(s.clamp(-127, 127))
}

/// `v` rounded to the element grid (nearest, ties to even), saturating at `±max`. `v` is finite.
pub(crate) fn quantize_element(v: f32, e: Elem) -> f32 {
    let a = v.abs();
    if a >= e.max {
        return e.max.copysign(v);
    }
    let exp = if a == 0.0 {
        e.emin
    } else {
        floor_log2(a).max(e.emin)
    };
    let step = pow2(exp - e.mbits);
    let q = ((a / step).round_ties_even() * step).min(e.max);
    q.copysign(v)
}

/// The code of an element value `q` (on the grid, finite): sign, biased exponent, mantissa; a
/// subnormal has exponent field 0. `±0` both encode as `+0`.
pub(crate) fn encode(q: f32, e: Elem) -> u8 {
    let a = q.abs();
    if a == 0.0 {
        return 0;
    }
    let sign = u8::from(q < 0.0) << (e.ebits + e.mbits as u32);
    let (field, mant) = if a < pow2(e.emin) {
        (0, a / pow2(e.emin - e.mbits))
    } else {
        let x = floor_log2(a);
        ((x - e.emin + 1) as u8, (a / pow2(x) - 1.0) * pow2(e.mbits))
    };
    sign | (field << e.mbits) | mant as u8
}

/// The value of an element code.
pub(crate) fn decode(code: u8, e: Elem) -> f32 {
    let mbits = e.mbits as u32;
    let mant = (code & ((1 << mbits) - 1)) as f32;
    let field = ((code >> mbits) & ((1 << e.ebits) - 1)) as i32;
    let a = if field == 0 {
        mant * pow2(e.emin - e.mbits)
    } else {
        (1.0 + mant * pow2(-e.mbits)) * pow2(field + e.emin - 1)
    };
    if code >> (e.ebits + mbits) & 1 == 1 {
        -a
    } else {
        a
    }
}

/// `X · Q(x / X)` over one block, in place; `+0.0` for every zero (so every path agrees on the
/// sign of zero). Non-finite input is the caller's to reject.
pub(crate) fn fake_quant_block(block: &mut [f32], format: MxFormat, rule: MxScaleRule) {
    let amax = block.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let s = scale_exponent(amax, format, rule).unwrap_or(0);
    let g = Grid::of(format);
    for x in block.iter_mut() {
        *x = fake_quant_bits(*x, s, &g);
    }
}

/// `x · 2^s`, exactly when the result is representable (two steps: `2^s` alone may not be).
pub(crate) fn scale_by(x: f32, s: i32) -> f32 {
    let half = s / 2;
    x * pow2(half) * pow2(s - half)
}

/// [`fake_quant_block`] over every block of 32 (the last one of a row may be shorter) of rows of
/// `len` values.
pub(crate) fn fake_quant_rows(data: &mut [f32], len: usize, format: MxFormat, rule: MxScaleRule) {
    if len == 0 {
        return;
    }
    for row in data.chunks_mut(len) {
        for block in row.chunks_mut(MX_BLOCK) {
            fake_quant_block(block, format, rule);
        }
    }
}

/// `X · Q(x / X)` for one value with the block scale `X = 2^s`, in integer arithmetic on the f32
/// bits (the algorithm of the CubeCL kernel `kimi_burn_kernels::mx`): the significand is shifted
/// to the element grid with ties to even, saturated, and the result assembled from exponent and
/// significand. Equal to `scale_by(quantize_element(scale_by(x, −s)), s)` (every zero `+0`), with
/// neither a division nor a rounding call.
#[inline]
pub(crate) fn fake_quant_bits(x: f32, s: i32, g: &Grid) -> f32 {
    let bits = x.to_bits();
    let abits = bits & 0x7fff_ffff;
    if abits == 0 {
        return 0.0;
    }
    let biased = (abits >> 23) as i32;
    let (sig, e0, top) = if biased > 0 {
        ((abits & 0x7f_ffff) | 0x80_0000, biased - 150, biased - 127)
    } else {
        (abits, -149, -118 - abits.leading_zeros() as i32)
    };
    let ev = top - s;
    let qexp = ev.max(g.emin) - g.mbits;
    let shift = qexp - (e0 - s);
    let mut q = if shift <= 0 {
        sig << (-shift) as u32
    } else if shift < 26 {
        let sh = shift as u32;
        let q = sig >> sh;
        let rem = sig & ((1 << sh) - 1);
        let half = 1u32 << (sh - 1);
        q + u32::from(rem > half || (rem == half && q & 1 == 1))
    } else {
        0
    };
    if qexp == g.emax - g.mbits && q > g.max_sig {
        q = g.max_sig;
    }
    if q == 0 {
        return 0.0;
    }
    let msb = 31 - q.leading_zeros() as i32;
    let e = qexp + s + msb;
    let out = if e >= -126 {
        (((e + 127) as u32) << 23) | ((q << (23 - msb) as u32) & 0x7f_ffff)
    } else {
        q << (qexp + s + 149) as u32
    };
    f32::from_bits(out | (bits & 0x8000_0000))
}

/// The element grid of a format for [`fake_quant_bits`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grid {
    mbits: i32,
    emin: i32,
    emax: i32,
    /// The largest element is `max_sig · 2^(emax − mbits)`.
    max_sig: u32,
}

impl Grid {
    pub(crate) fn of(format: MxFormat) -> Self {
        let e = format.elem();
        Self {
            mbits: e.mbits,
            emin: e.emin,
            emax: e.emax,
            max_sig: (e.max / pow2(e.emax - e.mbits)) as u32,
        }
    }
}

/// [`fake_quant_rows`] along the middle axis of `data` seen as `[outer, len, inner]` (row-major):
/// blocks of 32 along `len`, one scale per block and per `inner` index. No transpose: the block
/// maxima of a group of 32 rows are gathered row by row over `inner`. Large inputs are split over
/// the machine's threads by `outer` (or, for `inner = 1`, by rows).
pub(crate) fn fake_quant_axis(
    data: &mut [f32],
    [outer, len, inner]: [usize; 3],
    format: MxFormat,
    rule: MxScaleRule,
) {
    if len == 0 || inner == 0 || outer == 0 {
        return;
    }
    debug_assert_eq!(data.len(), outer * len * inner);
    let threads = if data.len() >= PARALLEL_FROM {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    };
    if inner == 1 {
        let rows = outer;
        let per = rows.div_ceil(threads.min(rows)) * len;
        for_chunks(data, per, threads, |chunk| {
            fake_quant_rows(chunk, len, format, rule)
        });
        return;
    }
    let plane = len * inner;
    let per = outer.div_ceil(threads.min(outer)) * plane;
    for_chunks(data, per, threads, |chunk| {
        let g = Grid::of(format);
        let mut amax = vec![0.0f32; inner];
        let mut scales = vec![0i32; inner];
        for p in chunk.chunks_mut(plane) {
            for b0 in (0..len).step_by(MX_BLOCK) {
                let rows = &mut p[b0 * inner..(b0 + MX_BLOCK).min(len) * inner];
                amax.fill(0.0);
                for row in rows.chunks(inner) {
                    for (m, x) in amax.iter_mut().zip(row) {
                        *m = m.max(x.abs());
                    }
                }
                for (sc, &a) in scales.iter_mut().zip(&amax) {
                    *sc = scale_exponent(a, format, rule).unwrap_or(0);
                }
                for row in rows.chunks_mut(inner) {
                    for (x, &s) in row.iter_mut().zip(&scales) {
                        *x = fake_quant_bits(*x, s, &g);
                    }
                }
            }
        }
    });
}

/// Inputs from this many values on are split over threads.
const PARALLEL_FROM: usize = 1 << 16;

/// Runs `f` on consecutive chunks of `per` values, on up to `threads` scoped threads.
fn for_chunks(data: &mut [f32], per: usize, threads: usize, f: impl Fn(&mut [f32]) + Sync) {
    if threads <= 1 || per >= data.len() {
        f(data);
        return;
    }
    std::thread::scope(|scope| {
        for chunk in data.chunks_mut(per.max(1)) {
            let f = &f;
            scope.spawn(move || f(chunk));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer form equals the float form on values spanning every binade, at every block
    /// scale that can occur for them, in every format.
    #[test]
    fn the_bit_form_equals_the_float_form() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for format in [MxFormat::Fp4E2M1, MxFormat::Fp8E4M3, MxFormat::Fp8E5M2] {
            let (e, g) = (format.elem(), Grid::of(format));
            for _ in 0..200_000 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let bits = (state as u32) & 0xff7f_ffff; // finite
                let x = f32::from_bits(bits);
                let top = if x == 0.0 { 0 } else { floor_log2(x.abs()) };
                // Any scale from the element's own binade down to 40 binades above it.
                let s = (top - e.emax + ((state >> 40) % 41) as i32).clamp(-127, 127);
                let want = scale_by(quantize_element(scale_by(x, -s), e), s) + 0.0;
                let got = fake_quant_bits(x, s, &g);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{format:?} x = {x:e}, s = {s}"
                );
            }
        }
    }

    #[test]
    fn powers_and_logs_are_exact_over_the_whole_range() {
        for e in -149..=127 {
            let p = pow2(e);
            assert_eq!(p as f64, 2f64.powi(e), "2^{e}");
            assert_eq!(floor_log2(p), e);
            if e > -149 {
                // 1.5 · 2^e (representable from 2^-148 on) is still in the binade of 2^e.
                assert_eq!(floor_log2(p * 1.5), e, "1.5 · 2^{e}");
            }
        }
    }
}
