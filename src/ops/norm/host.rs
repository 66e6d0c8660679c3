//! RMSNorm and the gated RMSNorm of KDA's output on the CPU host kernels: one pass over each row
//! forward (its statistics, then the scaled row) and one backward, with the hand-derived
//! gradients, instead of the eight or so tensor ops (and as many passes over memory, each with
//! its autodiff node) of the reference.
//!
//! With `n = x · r`, `r = 1 / sqrt(mean(x²) + eps)` per row and the gain `w`:
//!
//! ```text
//! y  = n ⊙ w ⊙ s                 s = 1 (RMSNorm) or σ(z) (gated)
//! dn = dy ⊙ w ⊙ s
//! dx = r · (dn − n · mean(dn ⊙ n))
//! dw = Σ_rows dy ⊙ n ⊙ s
//! dz = dy ⊙ n ⊙ w ⊙ σ(z) (1 − σ(z))   (gated)
//! ```
//!
//! Rows go to rayon's pool in fixed blocks of [`BLOCK_ROWS`] when the input is large; `dw` sums
//! each block's part, then the blocks in order, so the result does not depend on the number of
//! threads.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{
    dispatch, dot, hsum, update, write, Elementwise, ElementwiseMany, Simd, WithSimd, LANES,
};
use crate::ops::precision::host::sigmoid_pair;

/// Rows per block: the unit of work of a thread and of `dw`'s partial sums.
pub(crate) const BLOCK_ROWS: usize = 32;

/// Elements below which a call stays on the calling thread (handing work to the pool costs tens
/// of microseconds, the time of about this much of it).
pub(crate) const MIN_PARALLEL: usize = 1 << 18;

/// `f` over blocks of [`BLOCK_ROWS`] rows of `n` values of `out` (`f(first row, rows of out)`),
/// on rayon's pool when `out` is large.
pub(crate) fn for_row_blocks(
    out: &mut [f32],
    n: usize,
    f: impl Fn(usize, &mut [f32]) + Send + Sync,
) {
    if n == 0 {
        return;
    }
    let parallel = parallel(out.len());
    let blocks = out.chunks_mut(BLOCK_ROWS * n).enumerate();
    let block = |(b, rows): (usize, &mut [f32])| f(b * BLOCK_ROWS, rows);
    if parallel {
        blocks.collect::<Vec<_>>().into_par_iter().for_each(block);
    } else {
        blocks.for_each(block);
    }
}

/// RMSNorm over the last dim on the host: inputs `x: [.., d]`, `w: [d]`, and with `gated` a
/// third, `z` of `x`'s shape; output of `x`'s shape.
#[derive(Debug, Clone)]
pub(crate) struct RmsNormHost {
    /// Added to the mean square.
    pub eps: f32,
}

/// [`RmsNormHost`] followed by the sigmoid gate `σ(z)` (KDA's output norm): inputs `o, z, w`.
#[derive(Debug, Clone)]
pub(crate) struct RmsNormGatedHost {
    /// Added to the mean square.
    pub eps: f32,
}

/// `Σ a_j b_j c_j`, lane by lane in blocks of [`LANES`], then across the lanes (the order of
/// [`dot`], the same on every instruction set).
#[inline(always)]
fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len();
    let (ab, at) = a.as_chunks::<LANES>();
    let (bb, bt) = b[..n].as_chunks::<LANES>();
    let (cb, ct) = c[..n].as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for ((x, y), z) in ab.iter().zip(bb).zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l] * z[l];
        }
    }
    let mut tail = 0.0f32;
    for ((x, y), z) in at.iter().zip(bt).zip(ct) {
        tail += x * y * z;
    }
    hsum(&acc) + tail
}

/// `1 / sqrt(mean(x²) + eps)` of a row, in the order of the reference (mean, then `+ eps`, the
/// square root, the reciprocal).
#[inline(always)]
pub(crate) fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// `x · r · w` for `[x, w]`, times `σ(z)` for `[x, w, z]`: a row of the output.
#[derive(Clone, Copy)]
struct Normalised {
    r: f32,
}

impl ElementwiseMany<2, 1> for Normalised {
    #[inline(always)]
    fn apply(&self, [x, w]: [f32; 2]) -> [f32; 1] {
        [x * self.r * w]
    }
}

impl ElementwiseMany<3, 1> for Normalised {
    #[inline(always)]
    fn apply(&self, [x, w, z]: [f32; 3]) -> [f32; 1] {
        [x * self.r * w * sigmoid_pair(z).0]
    }
}

/// `(dz, dy · σ(z))` for `[z, dy, x, w]`: the gate's gradient and the gradient reaching
/// `n ⊙ w`, from one sigmoid.
#[derive(Clone, Copy)]
struct GateGrads {
    r: f32,
}

impl ElementwiseMany<4, 2> for GateGrads {
    #[inline(always)]
    fn apply(&self, [z, dy, x, w]: [f32; 4]) -> [f32; 2] {
        let (s, c) = sigmoid_pair(z);
        [dy * (x * self.r * w) * (s * c), dy * s]
    }
}

/// `dx = r · (g w − n c)` for `[g, w, x]`, with `n = x r` and `c = mean(dn ⊙ n)`, `dn = g ⊙ w`.
#[derive(Clone, Copy)]
struct InputGrad {
    r: f32,
    c: f32,
}

impl ElementwiseMany<3, 1> for InputGrad {
    #[inline(always)]
    fn apply(&self, [g, w, x]: [f32; 3]) -> [f32; 1] {
        [self.r * (g * w - x * self.r * self.c)]
    }
}

/// `dw + g · n` for `[dw, g, x]`, with `n = x r`: a row's part of the gain's gradient.
#[derive(Clone, Copy)]
struct GainGrad {
    r: f32,
}

impl Elementwise<3> for GainGrad {
    #[inline(always)]
    fn apply(&self, [dw, g, x]: [f32; 3]) -> f32 {
        dw + g * (x * self.r)
    }
}

/// The forward of a block of rows: `out = (x · r) · w` (`⊙ σ(z)` with `z`), `r` per row.
struct ForwardRows<'a> {
    x: &'a [f32],
    z: Option<&'a [f32]>,
    w: &'a [f32],
    out: &'a mut [f32],
    r: &'a mut [f32],
    eps: f32,
}

impl WithSimd for ForwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            z,
            w,
            out,
            r,
            eps,
        } = self;
        let d = w.len();
        for (i, (out, r)) in out.chunks_exact_mut(d).zip(r.iter_mut()).enumerate() {
            let x = &x[i * d..(i + 1) * d];
            *r = inv_rms(x, eps);
            let rr = *r;
            match z {
                None => write([out], [x, w], Normalised { r: rr }),
                Some(z) => write([out], [x, w, &z[i * d..(i + 1) * d]], Normalised { r: rr }),
            }
        }
    }
}

/// The backward of a block of rows: `dx` (and `dz`) per row, and the block's part of `dw`.
struct BackwardRows<'a> {
    x: &'a [f32],
    z: Option<&'a [f32]>,
    w: &'a [f32],
    dy: &'a [f32],
    r: &'a [f32],
    dx: &'a mut [f32],
    dz: Option<&'a mut [f32]>,
    /// Zeros on entry.
    dw: &'a mut [f32],
    /// A row of scratch: `dy ⊙ σ(z)` of the row in work (gated only).
    gated: &'a mut [f32],
}

impl WithSimd for BackwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            z,
            w,
            dy,
            r,
            dx,
            mut dz,
            dw,
            gated,
        } = self;
        let d = w.len();
        for (i, (dx, &r)) in dx.chunks_exact_mut(d).zip(r).enumerate() {
            let rows = i * d..(i + 1) * d;
            let (x, dy) = (&x[rows.clone()], &dy[rows.clone()]);
            // `dy ⊙ s`: the gradient reaching `n ⊙ w`.
            let g: &[f32] = match (z, dz.as_deref_mut()) {
                (Some(z), Some(dz)) => {
                    let (z, dz) = (&z[rows.clone()], &mut dz[rows]);
                    write([dz, &mut gated[..]], [z, dy, x, w], GateGrads { r });
                    gated
                }
                _ => dy,
            };
            // mean(dn ⊙ n) = r · Σ g w x / d.
            let c = r * dot3(g, w, x) / d as f32;
            write([dx], [g, w, x], InputGrad { r, c });
            update(dw, [g, x], GainGrad { r });
        }
    }
}

/// Whether a call of `len` elements spreads its blocks over rayon's pool.
fn parallel(len: usize) -> bool {
    len >= MIN_PARALLEL
}

/// The forward of both ops: the output and `r` per row.
fn forward(x: &[f32], z: Option<&[f32]>, w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let rows = x.len() / d.max(1);
    let (mut out, mut r) = (vec![0.0f32; rows * d], vec![0.0f32; rows]);
    if d == 0 {
        return (out, r);
    }
    let block = |(b, (out, r)): (usize, (&mut [f32], &mut [f32]))| {
        let span = b * BLOCK_ROWS * d..(b * BLOCK_ROWS + r.len()) * d;
        dispatch(ForwardRows {
            x: &x[span.clone()],
            z: z.map(|z| &z[span]),
            w,
            out,
            r,
            eps,
        })
    };
    let blocks = out.chunks_mut(BLOCK_ROWS * d).zip(r.chunks_mut(BLOCK_ROWS));
    if parallel(rows * d) {
        blocks
            .enumerate()
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(block);
    } else {
        blocks.enumerate().for_each(block);
    }
    (out, r)
}

/// A block of the backward: its index, its rows of `dx` (and `dz`), its part of `dw`.
type BackwardJob<'a> = (
    usize,
    ((&'a mut [f32], Option<&'a mut [f32]>), &'a mut [f32]),
);

/// The backward of both ops: `dx`, `dw` and with `z` `dz`.
fn backward(
    x: &[f32],
    z: Option<&[f32]>,
    w: &[f32],
    r: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let d = w.len();
    let rows = r.len();
    let mut dx = vec![0.0f32; rows * d];
    let mut dz = z.map(|_| vec![0.0f32; rows * d]);
    let n_blocks = rows.div_ceil(BLOCK_ROWS);
    let mut parts = vec![0.0f32; n_blocks * d];
    if d == 0 {
        return (dx, vec![], dz);
    }
    let dz_blocks: Vec<Option<&mut [f32]>> = match dz.as_mut() {
        Some(dz) => dz.chunks_mut(BLOCK_ROWS * d).map(Some).collect(),
        None => (0..n_blocks).map(|_| None).collect(),
    };
    let jobs: Vec<_> = dx
        .chunks_mut(BLOCK_ROWS * d)
        .zip(dz_blocks)
        .zip(parts.chunks_mut(d))
        .enumerate()
        .collect();
    let block = |(b, ((dx, dz), dw)): BackwardJob| {
        let first = b * BLOCK_ROWS;
        let n = dx.len() / d;
        let span = first * d..(first + n) * d;
        let mut gated = if z.is_some() { vec![0.0f32; d] } else { vec![] };
        dispatch(BackwardRows {
            x: &x[span.clone()],
            z: z.map(|z| &z[span.clone()]),
            w,
            dy: &dy[span],
            r: &r[first..first + n],
            dx,
            dz,
            dw,
            gated: &mut gated,
        })
    };
    if parallel(rows * d) {
        jobs.into_par_iter().for_each(block);
    } else {
        jobs.into_iter().for_each(block);
    }
    // The blocks' parts of `dw`, summed in block order.
    let mut dw = vec![0.0f32; d];
    for part in parts.chunks_exact(d) {
        for (a, b) in dw.iter_mut().zip(part) {
            *a += b;
        }
    }
    (dx, dw, dz)
}

impl HostOp<2> for RmsNormHost {
    type Saved = Vec<f32>;

    fn forward(&self, [x, w]: &[HostArray; 2], save: bool) -> (HostArray, Option<Vec<f32>>) {
        let (out, r) = forward(&x.data, None, &w.data, self.eps);
        let out = HostArray {
            data: out.into(),
            shape: x.shape.clone(),
        };
        (out, save.then_some(r))
    }

    fn backward(&self, [x, w]: &[HostArray; 2], r: &Vec<f32>, grad: &HostArray) -> [HostArray; 2] {
        debug_assert_eq!(x.data.len() / w.data.len().max(1), r.len());
        let (dx, dw, _) = backward(&x.data, None, &w.data, r, &grad.data);
        [
            HostArray {
                data: dx.into(),
                shape: x.shape.clone(),
            },
            HostArray {
                data: dw.into(),
                shape: w.shape.clone(),
            },
        ]
    }
}

impl HostOp<3> for RmsNormGatedHost {
    type Saved = Vec<f32>;

    fn forward(&self, [o, z, w]: &[HostArray; 3], save: bool) -> (HostArray, Option<Vec<f32>>) {
        let (out, r) = forward(&o.data, Some(&z.data), &w.data, self.eps);
        let out = HostArray {
            data: out.into(),
            shape: o.shape.clone(),
        };
        (out, save.then_some(r))
    }

    fn backward(
        &self,
        [o, z, w]: &[HostArray; 3],
        r: &Vec<f32>,
        grad: &HostArray,
    ) -> [HostArray; 3] {
        let (dx, dw, dz) = backward(&o.data, Some(&z.data), &w.data, r, &grad.data);
        let dz = dz.unwrap_or_else(|| unreachable!("gated: dz is computed"));
        [
            HostArray {
                data: dx.into(),
                shape: o.shape.clone(),
            },
            HostArray {
                data: dz.into(),
                shape: z.shape.clone(),
            },
            HostArray {
                data: dw.into(),
                shape: w.shape.clone(),
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backend::host::testing::{close, numeric};
    use rand::{Rng, SeedableRng};

    fn array(data: Vec<f32>, shape: &[usize]) -> HostArray {
        HostArray {
            data: data.into(),
            shape: shape.to_vec(),
        }
    }

    /// `Σ c ⊙ y` of the f64 formula, for finite differences.
    fn objective(x: &[f64], z: Option<&[f64]>, w: &[f64], c: &[f64], eps: f64) -> f64 {
        let d = w.len();
        let mut total = 0.0;
        for (i, row) in x.chunks(d).enumerate() {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            for j in 0..d {
                let s = z.map_or(1.0, |z| 1.0 / (1.0 + (-z[i * d + j]).exp()));
                total += c[i * d + j] * row[j] * r * w[j] * s;
            }
        }
        total
    }

    /// Both ops, values and every gradient, against the f64 formula and its central differences,
    /// at widths with and without a lane tail, on one block and on several blocks run on the
    /// pool (the last one partial).
    #[test]
    fn rms_norm_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (rows, d, gated) in [
            (5, 11, false),
            (3, 40, true),
            (BLOCK_ROWS * 2 + 3, 17, true),
            (MIN_PARALLEL / 64 + 7, 64, false),
            (MIN_PARALLEL / 64 + 7, 64, true),
        ] {
            let eps = 1e-5f32;
            let mut randn = |n: usize, s: f64| -> Vec<f64> {
                (0..n).map(|_| rng.random_range(-2.0..2.0) * s).collect()
            };
            let (x, z, c) = (
                randn(rows * d, 1.0),
                randn(rows * d, 3.0),
                randn(rows * d, 1.0),
            );
            let w: Vec<f64> = (0..d).map(|j| 0.5 + (j % 7) as f64 * 0.25).collect();
            let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
            let (xa, za, wa) = (
                array(f32s(&x), &[rows, d]),
                array(f32s(&z), &[rows, d]),
                array(f32s(&w), &[d]),
            );
            let grad = array(f32s(&c), &[rows, d]);
            let zo = gated.then_some(&z[..]);
            let (y, dx, dz, dw) = if gated {
                let op = RmsNormGatedHost { eps };
                let inputs = [xa, za, wa];
                let (y, saved) = op.forward(&inputs, true);
                let [dx, dz, dw] = op.backward(&inputs, &saved.expect("saved"), &grad);
                (y, dx, Some(dz), dw)
            } else {
                let op = RmsNormHost { eps };
                let inputs = [xa, wa];
                let (y, saved) = op.forward(&inputs, true);
                let [dx, dw] = op.backward(&inputs, &saved.expect("saved"), &grad);
                (y, dx, None, dw)
            };
            let what = format!("rows {rows} d {d} gated {gated}");
            let small = rows * d <= 200;
            let eps = eps as f64;
            let mut want_y = vec![0.0; rows * d];
            for (i, row) in x.chunks(d).enumerate() {
                let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                for j in 0..d {
                    let s = zo.map_or(1.0, |z| 1.0 / (1.0 + (-z[i * d + j]).exp()));
                    want_y[i * d + j] = row[j] * r * w[j] * s;
                }
            }
            close(&format!("{what}: y"), &want_y, &y.data, 2e-6);
            if small {
                let f = |x: &[f64]| objective(x, zo, &w, &c, eps);
                close(&format!("{what}: dx"), &numeric(&x, f), &dx.data, 1e-5);
                let f = |w: &[f64]| objective(&x, zo, w, &c, eps);
                close(&format!("{what}: dw"), &numeric(&w, f), &dw.data, 1e-5);
                if let Some(dz) = dz {
                    let f = |z: &[f64]| objective(&x, Some(z), &w, &c, eps);
                    close(&format!("{what}: dz"), &numeric(&z, f), &dz.data, 1e-5);
                }
            } else {
                // Large: the closed forms in f64 (the differences would take too long).
                let mut want_dx = vec![0.0; rows * d];
                let mut want_dz = vec![0.0; rows * d];
                let mut want_dw = vec![0.0; d];
                for i in 0..rows {
                    let row = &x[i * d..(i + 1) * d];
                    let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
                    let s = |j: usize| zo.map_or(1.0, |z| 1.0 / (1.0 + (-z[i * d + j]).exp()));
                    let g: Vec<f64> = (0..d).map(|j| c[i * d + j] * s(j)).collect();
                    let m: f64 = (0..d).map(|j| g[j] * w[j] * row[j] * r).sum::<f64>() / d as f64;
                    for j in 0..d {
                        let n = row[j] * r;
                        want_dx[i * d + j] = r * (g[j] * w[j] - n * m);
                        want_dw[j] += g[j] * n;
                        want_dz[i * d + j] = c[i * d + j] * n * w[j] * s(j) * (1.0 - s(j));
                    }
                }
                close(&format!("{what}: dx"), &want_dx, &dx.data, 1e-5);
                close(&format!("{what}: dw"), &want_dw, &dw.data, 1e-5);
                if let Some(dz) = dz {
                    close(&format!("{what}: dz"), &want_dz, &dz.data, 1e-5);
                }
            }
        }
    }
}
