//! The small MLA helpers on the CPU host kernels: [`masked_softmax`](super::masked_softmax) and
//! [`rotary`](super::rotary), one pass per row forward and one backward, instead of a chain of
//! tensor ops (eight for the softmax, six and a concatenation for the rotation), each a pass over
//! memory with its autodiff node.
//!
//! ```text
//! softmax:  m = max_{¬mask} s,  e_j = exp(s_j − m)·[¬mask_j],  p = e / max(Σ e, 1e−30)
//!           ds = p ⊙ (dp − Σ_j p_j dp_j)
//! rotary:   y = [a·cos − b·sin | b·cos + a·sin]
//!           da = dy₁·cos + dy₂·sin,   db = dy₂·cos − dy₁·sin
//! ```
//!
//! The softmax's backward forms `p` again from the scores rather than keeping it: one more
//! exponential per element instead of a copy of the output.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use std::sync::Arc;

use super::MASKED_SCORE;
use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{dispatch, exp_lane, Simd, WithSimd};
use crate::ops::norm::host::for_row_blocks;

/// The masked softmax on the host: inputs `scores: [.., tk]` and the mask as floats of the same
/// shape (non-zero: masked); output of the scores' shape.
#[derive(Debug, Clone)]
pub(crate) struct MaskedSoftmaxHost;

/// `p` of one row into `p`, from its scores and mask.
#[inline(always)]
fn softmax_row(s: &[f32], mask: &[f32], p: &mut [f32]) {
    let n = p.len();
    let (s, mask) = (&s[..n], &mask[..n]);
    let masked = MASKED_SCORE as f32;
    let mut m = masked;
    for j in 0..n {
        let v = if mask[j] != 0.0 { masked } else { s[j] };
        m = m.max(v);
    }
    let mut den = 0.0f32;
    for j in 0..n {
        let e = if mask[j] != 0.0 {
            0.0
        } else {
            exp_lane(s[j] - m)
        };
        p[j] = e;
        den += e;
    }
    let den = den.max(1e-30);
    for v in p.iter_mut() {
        *v /= den;
    }
}

/// The softmax over rows of `n` scores.
struct SoftmaxRows<'a> {
    s: &'a [f32],
    mask: &'a [f32],
    out: &'a mut [f32],
    n: usize,
}

impl WithSimd for SoftmaxRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self { s, mask, out, n } = self;
        for (i, p) in out.chunks_exact_mut(n).enumerate() {
            let row = i * n..(i + 1) * n;
            softmax_row(&s[row.clone()], &mask[row], p);
        }
    }
}

/// The softmax's backward over rows: `ds` from the scores, the mask and `dp`.
struct SoftmaxGradRows<'a> {
    s: &'a [f32],
    mask: &'a [f32],
    dp: &'a [f32],
    ds: &'a mut [f32],
    n: usize,
}

impl WithSimd for SoftmaxGradRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self { s, mask, dp, ds, n } = self;
        for (i, ds) in ds.chunks_exact_mut(n).enumerate() {
            let row = i * n..(i + 1) * n;
            softmax_row(&s[row.clone()], &mask[row.clone()], ds);
            let dp = &dp[row];
            let mut dot = 0.0f32;
            for j in 0..n {
                dot += ds[j] * dp[j];
            }
            for j in 0..n {
                ds[j] *= dp[j] - dot;
            }
        }
    }
}

impl HostOp<2> for MaskedSoftmaxHost {
    type Saved = ();

    fn forward(&self, [s, mask]: &[HostArray; 2], save: bool) -> (HostArray, Option<()>) {
        let n = s.shape.last().copied().unwrap_or(0);
        let (sv, mv) = (&s.data[..], &mask.data[..]);
        let mut out = vec![0.0f32; sv.len()];
        for_row_blocks(&mut out, n, |first, out| {
            let span = first * n..first * n + out.len();
            dispatch(SoftmaxRows {
                s: &sv[span.clone()],
                mask: &mv[span],
                out,
                n,
            })
        });
        let out = HostArray {
            data: out.into(),
            shape: s.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [s, mask]: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        let n = s.shape.last().copied().unwrap_or(0);
        let (sv, mv, gv) = (&s.data[..], &mask.data[..], &grad.data[..]);
        let mut ds = vec![0.0f32; sv.len()];
        for_row_blocks(&mut ds, n, |first, ds| {
            let span = first * n..first * n + ds.len();
            dispatch(SoftmaxGradRows {
                s: &sv[span.clone()],
                mask: &mv[span.clone()],
                dp: &gv[span],
                ds,
                n,
            })
        });
        // The mask comes from a boolean tensor: never tracked, its gradient is never registered.
        [
            HostArray {
                data: ds.into(),
                shape: s.shape.clone(),
            },
            HostArray::zeros(&mask.shape),
        ]
    }
}

/// The rotary embedding on the host: input `x: [B, N, T, dr]`, output of its shape, with the
/// tables `cos`, `sin: [T, dr/2]` (in f32, as the tensor-op form rounds them).
#[derive(Debug, Clone)]
pub(crate) struct RotaryHost {
    /// `cos(pos·θ_i)` per position and pair.
    pub cos: Arc<Vec<f32>>,
    /// `sin(pos·θ_i)`.
    pub sin: Arc<Vec<f32>>,
}

/// The rotation (or, with `inverse`, its transpose: the backward) of rows of `2·half` values, the
/// row `r` at position `r mod t`.
struct RotateRows<'a> {
    x: &'a [f32],
    out: &'a mut [f32],
    cos: &'a [f32],
    sin: &'a [f32],
    /// `dr / 2`.
    half: usize,
    first: usize,
    inverse: bool,
}

impl WithSimd for RotateRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            out,
            cos,
            sin,
            half,
            first,
            inverse,
        } = self;
        let t = cos.len().min(sin.len()).checked_div(half).unwrap_or(0);
        if t == 0 {
            return;
        }
        let d = 2 * half;
        for (i, y) in out.chunks_exact_mut(d).enumerate() {
            let pos = (first + i) % t;
            let (c, sn) = (
                &cos[pos * half..(pos + 1) * half],
                &sin[pos * half..(pos + 1) * half],
            );
            let xr = &x[i * d..(i + 1) * d];
            let (a, b) = xr.split_at(half);
            let (ya, yb) = y.split_at_mut(half);
            // The tensor-op form's operations in its order: `a·cos − b·sin`, `b·cos + a·sin`.
            if inverse {
                for j in 0..half {
                    ya[j] = a[j] * c[j] + b[j] * sn[j];
                    yb[j] = b[j] * c[j] - a[j] * sn[j];
                }
            } else {
                for j in 0..half {
                    ya[j] = a[j] * c[j] - b[j] * sn[j];
                    yb[j] = b[j] * c[j] + a[j] * sn[j];
                }
            }
        }
    }
}

impl RotaryHost {
    /// `x` rotated (or rotated back, with `inverse`).
    fn rotate(&self, x: &[f32], d: usize, inverse: bool) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        for_row_blocks(&mut out, d, |first, out| {
            let span = first * d..first * d + out.len();
            dispatch(RotateRows {
                x: &x[span],
                out,
                cos: &self.cos,
                sin: &self.sin,
                half: d / 2,
                first,
                inverse,
            })
        });
        out
    }
}

impl HostOp<1> for RotaryHost {
    type Saved = ();

    fn forward(&self, [x]: &[HostArray; 1], save: bool) -> (HostArray, Option<()>) {
        let d = x.shape.last().copied().unwrap_or(0);
        let out = HostArray {
            data: self.rotate(&x.data, d, false).into(),
            shape: x.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x]: &[HostArray; 1], _: &(), grad: &HostArray) -> [HostArray; 1] {
        let d = x.shape.last().copied().unwrap_or(0);
        [HostArray {
            data: self.rotate(&grad.data, d, true).into(),
            shape: x.shape.clone(),
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backend::host::testing::{close, numeric};
    use rand::{Rng, SeedableRng};

    /// The masked softmax of one row in f64 (an all-masked row all zeros).
    fn softmax64(s: &[f64], mask: &[bool]) -> Vec<f64> {
        let visible = || s.iter().zip(mask).filter(|(_, m)| !**m).map(|(v, _)| *v);
        let m = visible().fold(f64::NEG_INFINITY, f64::max);
        let den: f64 = visible().map(|v| (v - m).exp()).sum();
        s.iter()
            .zip(mask)
            .map(|(v, hidden)| if *hidden { 0.0 } else { (v - m).exp() / den })
            .collect()
    }

    /// Values and the gradient of `Σ c ⊙ p` against the f64 softmax and its central differences,
    /// row by row, with rows partly and wholly masked, at sizes of one block and of the parallel
    /// path.
    #[test]
    fn masked_softmax_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (rows, n) in [(5, 7), (4200, 64)] {
            let len = rows * n;
            let s: Vec<f64> = (0..len)
                .map(|_| rng.random_range(-6.0f64..6.0) as f32 as f64)
                .collect();
            let c: Vec<f64> = (0..len)
                .map(|_| rng.random_range(-1.0f64..1.0) as f32 as f64)
                .collect();
            // Row 1 wholly masked, the others about a third.
            let mask: Vec<bool> = (0..len)
                .map(|i| i / n == 1 || rng.random_range(0.0..1.0) < 0.3)
                .collect();
            let array = |v: Vec<f32>| HostArray {
                data: v.into(),
                shape: vec![rows, n],
            };
            let inputs = [
                array(s.iter().map(|&v| v as f32).collect()),
                array(mask.iter().map(|&m| f32::from(u8::from(m))).collect()),
            ];
            let (p, _) = MaskedSoftmaxHost.forward(&inputs, true);
            let dc = array(c.iter().map(|&v| v as f32).collect());
            let [ds, _] = MaskedSoftmaxHost.backward(&inputs, &(), &dc);
            let (mut want_p, mut want_ds) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let row = r * n..(r + 1) * n;
                let (sr, mr, cr) = (&s[row.clone()], &mask[row.clone()], &c[row]);
                want_p.extend(softmax64(sr, mr));
                want_ds.extend(numeric(sr, |x| {
                    softmax64(x, mr).iter().zip(cr).map(|(p, c)| p * c).sum()
                }));
            }
            assert!(p.data[n..2 * n].iter().all(|v| *v == 0.0), "masked row");
            close(&format!("{rows}x{n}: p"), &want_p, &p.data, 1e-6);
            close(&format!("{rows}x{n}: ds"), &want_ds, &ds.data, 1e-5);
        }
    }

    /// The rotation and its gradient against the f64 formula and its central differences, with
    /// the angles of positions `3..3 + T`, at sizes of one block and of the parallel path.
    #[test]
    fn rotary_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for (bn, t, dr) in [(3, 5, 8), (20, 410, 32)] {
            let (half, offset, base) = (dr / 2, 3, 10_000.0f64);
            let angle = |pos: usize, i: usize| pos as f64 * base.powf(-2.0 * i as f64 / dr as f64);
            let table = |f: fn(f64) -> f64| -> Vec<f32> {
                (offset..offset + t)
                    .flat_map(|pos| (0..half).map(move |i| f(angle(pos, i)) as f32))
                    .collect()
            };
            let op = RotaryHost {
                cos: Arc::new(table(f64::cos)),
                sin: Arc::new(table(f64::sin)),
            };
            let len = bn * t * dr;
            let x: Vec<f64> = (0..len)
                .map(|_| rng.random_range(-2.0f64..2.0) as f32 as f64)
                .collect();
            let c: Vec<f64> = (0..len)
                .map(|_| rng.random_range(-1.0f64..1.0) as f32 as f64)
                .collect();
            let array = |v: &[f64]| HostArray {
                data: v.iter().map(|&x| x as f32).collect::<Vec<f32>>().into(),
                shape: vec![bn, 1, t, dr],
            };
            let (y, _) = op.forward(&[array(&x)], true);
            let [dx] = op.backward(&[array(&x)], &(), &array(&c));
            // Row `r` at position `offset + r mod t`, angles in f64.
            let rotate = |row: &[f64], pos: usize| -> Vec<f64> {
                let (a, b) = row.split_at(half);
                let (cs, sn): (Vec<f64>, Vec<f64>) = (0..half)
                    .map(|i| (angle(pos, i).cos(), angle(pos, i).sin()))
                    .unzip();
                let first = (0..half).map(|i| a[i] * cs[i] - b[i] * sn[i]);
                let second = (0..half).map(|i| b[i] * cs[i] + a[i] * sn[i]);
                first.chain(second).collect()
            };
            let (mut want_y, mut want_dx) = (Vec::new(), Vec::new());
            for r in 0..bn * t {
                let span = r * dr..(r + 1) * dr;
                let pos = offset + r % t;
                want_y.extend(rotate(&x[span.clone()], pos));
                let cr = &c[span.clone()];
                want_dx.extend(numeric(&x[span], |row| {
                    rotate(row, pos).iter().zip(cr).map(|(y, c)| y * c).sum()
                }));
            }
            close(&format!("{bn}x{t}x{dr}: y"), &want_y, &y.data, 2e-6);
            close(&format!("{bn}x{t}x{dr}: dx"), &want_dx, &dx.data, 1e-5);
        }
    }
}
