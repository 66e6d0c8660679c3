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
    let e = format.elem();
    let (down, up) = (Scale::new(-s), Scale::new(s));
    for x in block.iter_mut() {
        *x = up.apply(quantize_element(down.apply(*x), e)) + 0.0;
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

/// `x · 2^s` by two precomputed factors (see [`scale_by`]).
#[derive(Clone, Copy)]
struct Scale([f32; 2]);

impl Scale {
    fn new(s: i32) -> Self {
        let half = s / 2;
        Self([pow2(half), pow2(s - half)])
    }

    fn apply(self, x: f32) -> f32 {
        x * self.0[0] * self.0[1]
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
        let e = format.elem();
        let mut amax = vec![0.0f32; inner];
        let mut scales = vec![(Scale::new(0), Scale::new(0)); inner];
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
                    let s = scale_exponent(a, format, rule).unwrap_or(0);
                    *sc = (Scale::new(-s), Scale::new(s));
                }
                for row in rows.chunks_mut(inner) {
                    for (x, &(down, up)) in row.iter_mut().zip(&scales) {
                        *x = up.apply(quantize_element(down.apply(*x), e)) + 0.0;
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
