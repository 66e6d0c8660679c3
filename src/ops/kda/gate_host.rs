//! The KDA forget gate on the CPU host kernels: one pass over `f` forward and one backward, with
//! the derived gradients, instead of the bias add, the exponentials, softplus (or the sigmoid) and
//! the products of the tensor ops, each a pass over memory with its autodiff node.
//!
//! With `x = f + dt_bias` and `a = e^{A_log}` of the head:
//!
//! ```text
//! softplus gate:  g = −a · softplus(x)    dg/dx = −a · σ(x)  (−a above 20, where softplus is x)
//!                                         dg/dA_log = g
//! safe gate:      g = lb · σ(a·x)         dg/dx = lb · σ(a·x)(1 − σ(a·x)) · a
//!                                         dg/dA_log = lb · σ(a·x)(1 − σ(a·x)) · a·x
//! ```
//!
//! `softplus(x) = max(x, 0) + log1p(e^{−|x|})` as in the tensor ops ([`softplus`], with the
//! `log1p` of `ln_1p_unit_lane`), and `1 − σ` never formed by a subtraction ([`sigmoid_pair`]).
//!
//! The gradients of `dt_bias` and `A_log` sum fixed blocks of rows, then the blocks in order, so
//! they do not depend on the number of threads. Where a gate has saturated, a gradient below
//! `f32`'s normal range is written as 0 ([`flush_subnormal`]: a subnormal costs every x86
//! instruction that touches it a microcode assist, here and in the products that read it).

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{dispatch, flush_subnormal, Simd, WithSimd};
use crate::ops::norm::host::{for_row_blocks, BLOCK_ROWS, MIN_PARALLEL};
use crate::ops::precision::host::{sigmoid_pair, softplus, SOFTPLUS_LINEAR};

/// The gate on the host: inputs `f: [.., H, K]`, `A_log: [H]`, `dt_bias: [H·K]`; output of `f`'s
/// shape.
#[derive(Debug, Clone)]
pub(crate) struct KdaGateHost {
    /// The safe gate's lower bound, or none for the softplus gate.
    pub lower_bound: Option<f32>,
}

/// One of the two gates as branch-free lane functions (so that the loops over a row vectorise).
trait Gate: Copy + Send + Sync {
    /// `g` at `x` for the head's `a = e^{A_log}`.
    fn value(self, x: f32, a: f32) -> f32;
    /// `(dg/dx, dg/dA_log)` at `x`.
    fn slopes(self, x: f32, a: f32) -> (f32, f32);
}

/// `g = −a · softplus(x)`.
#[derive(Clone, Copy)]
struct Softplus;

impl Gate for Softplus {
    #[inline(always)]
    fn value(self, x: f32, a: f32) -> f32 {
        -(softplus(x).0 * a)
    }

    #[inline(always)]
    fn slopes(self, x: f32, a: f32) -> (f32, f32) {
        let (sp, e) = softplus(x);
        // σ(x) from the same exponential: 1/(1 + e) for x ≥ 0, e/(1 + e) below.
        let sigma = if x >= 0.0 { 1.0 } else { e } / (1.0 + e);
        let slope = if x > SOFTPLUS_LINEAR { 1.0 } else { sigma };
        (-a * slope, -(sp * a))
    }
}

/// `g = lb · σ(a·x)`.
#[derive(Clone, Copy)]
struct Safe(f32);

impl Gate for Safe {
    #[inline(always)]
    fn value(self, x: f32, a: f32) -> f32 {
        sigmoid_pair(x * a).0 * self.0
    }

    #[inline(always)]
    fn slopes(self, x: f32, a: f32) -> (f32, f32) {
        let y = x * a;
        let (s, c) = sigmoid_pair(y);
        let d = self.0 * (s * c);
        (d * a, d * y)
    }
}

/// The gate over rows of `H·K` values: `out = g(f + dt, a)` with `a` given per column.
struct Rows<'a, G> {
    gate: G,
    f: &'a [f32],
    dt: &'a [f32],
    /// `e^{A_log}` of each column's head.
    a: &'a [f32],
    out: &'a mut [f32],
}

impl<G: Gate> WithSimd for Rows<'_, G> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            gate,
            f,
            dt,
            a,
            out,
        } = self;
        let w = dt.len();
        let (dt, a) = (&dt[..w], &a[..w]);
        for (out, f) in out.chunks_exact_mut(w).zip(f.chunks_exact(w)) {
            let (out, f) = (&mut out[..w], &f[..w]);
            for j in 0..w {
                out[j] = gate.value(f[j] + dt[j], a[j]);
            }
        }
    }
}

/// The gate's gradients over rows of `H·K` values: `df`, and the rows' parts of the gradients of
/// `dt_bias` and of `A_log` (per column, summed per head later) added into `pdt` and `pa`.
struct GradRows<'a, G> {
    gate: G,
    f: &'a [f32],
    dt: &'a [f32],
    a: &'a [f32],
    grad: &'a [f32],
    df: &'a mut [f32],
    pdt: &'a mut [f32],
    pa: &'a mut [f32],
}

impl<G: Gate> WithSimd for GradRows<'_, G> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            gate,
            f,
            dt,
            a,
            grad,
            df,
            pdt,
            pa,
        } = self;
        let w = dt.len();
        let (dt, a, pdt, pa) = (&dt[..w], &a[..w], &mut pdt[..w], &mut pa[..w]);
        let rows = df
            .chunks_exact_mut(w)
            .zip(f.chunks_exact(w))
            .zip(grad.chunks_exact(w));
        for ((df, f), grad) in rows {
            let (df, f, grad) = (&mut df[..w], &f[..w], &grad[..w]);
            for j in 0..w {
                let (dx, dalog) = gate.slopes(f[j] + dt[j], a[j]);
                // Where the gate has saturated its slopes are tiny, and their products with the
                // gradient can fall below f32's normal range: flushed to 0.
                let d = flush_subnormal(grad[j] * dx);
                df[j] = d;
                pdt[j] += d;
                pa[j] += flush_subnormal(grad[j] * dalog);
            }
        }
    }
}

/// `e^{A_log}` of each of the `H·K` columns (head-major).
fn column_decays(a_log: &HostArray, dt: &HostArray) -> Vec<f32> {
    let h = a_log.data.len();
    let k = dt.data.len() / h.max(1);
    a_log
        .data
        .iter()
        .flat_map(|v| std::iter::repeat_n(v.exp(), k))
        .collect()
}

impl KdaGateHost {
    /// The forward over `f` (rows of `dt.len()` values).
    fn forward_rows<G: Gate>(&self, gate: G, f: &[f32], dt: &[f32], a: &[f32]) -> Vec<f32> {
        let w = dt.len();
        let mut out = vec![0.0f32; f.len()];
        for_row_blocks(&mut out, w, |first, out| {
            let span = first * w..first * w + out.len();
            dispatch(Rows {
                gate,
                f: &f[span],
                dt,
                a,
                out,
            })
        });
        out
    }

    /// `(df, d dt_bias, dg/dA_log per column)` over `f`.
    fn backward_rows<G: Gate>(
        &self,
        gate: G,
        f: &[f32],
        dt: &[f32],
        a: &[f32],
        grad: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let w = dt.len();
        let mut df = vec![0.0f32; f.len()];
        let (mut ddt, mut da) = (vec![0.0f32; w], vec![0.0f32; w]);
        if w == 0 {
            return (df, ddt, da);
        }
        let span = BLOCK_ROWS * w;
        // Each block: its rows of `df`, and its parts of the two parameter gradients.
        let block = |(b, df): (usize, &mut [f32])| -> Vec<f32> {
            let mut parts = vec![0.0f32; 2 * w];
            let (pdt, pa) = parts.split_at_mut(w);
            let rows = b * span..b * span + df.len();
            dispatch(GradRows {
                gate,
                f: &f[rows.clone()],
                dt,
                a,
                grad: &grad[rows],
                df,
                pdt,
                pa,
            });
            parts
        };
        let jobs = df.chunks_mut(span).enumerate();
        let parts: Vec<Vec<f32>> = if f.len() >= MIN_PARALLEL {
            jobs.collect::<Vec<_>>()
                .into_par_iter()
                .map(block)
                .collect()
        } else {
            jobs.map(block).collect()
        };
        for part in parts {
            let (pdt, pa) = part.split_at(w);
            for (s, p) in ddt.iter_mut().zip(pdt).chain(da.iter_mut().zip(pa)) {
                *s += p;
            }
        }
        (df, ddt, da)
    }
}

impl HostOp<3> for KdaGateHost {
    type Saved = ();

    fn forward(&self, [f, a_log, dt]: &[HostArray; 3], save: bool) -> (HostArray, Option<()>) {
        let a = column_decays(a_log, dt);
        // Slices taken once: an ndarray tensor's values are looked up on every `data` access.
        let (fv, dtv) = (&f.data[..], &dt.data[..]);
        let out = match self.lower_bound {
            None => self.forward_rows(Softplus, fv, dtv, &a),
            Some(lb) => self.forward_rows(Safe(lb), fv, dtv, &a),
        };
        let out = HostArray {
            data: out.into(),
            shape: f.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(
        &self,
        [f, a_log, dt]: &[HostArray; 3],
        _: &(),
        grad: &HostArray,
    ) -> [HostArray; 3] {
        let a = column_decays(a_log, dt);
        let (fv, dtv, gv) = (&f.data[..], &dt.data[..], &grad.data[..]);
        let (df, ddt, da_columns) = match self.lower_bound {
            None => self.backward_rows(Softplus, fv, dtv, &a, gv),
            Some(lb) => self.backward_rows(Safe(lb), fv, dtv, &a, gv),
        };
        let k = dtv.len() / a_log.data.len().max(1);
        let da: Vec<f32> = da_columns
            .chunks(k.max(1))
            .map(|head| head.iter().sum())
            .collect();
        [
            HostArray {
                data: df.into(),
                shape: f.shape.clone(),
            },
            HostArray {
                data: da.into(),
                shape: a_log.shape.clone(),
            },
            HostArray {
                data: ddt.into(),
                shape: dt.shape.clone(),
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backend::host::testing::close;
    use rand::{Rng, SeedableRng};

    /// The gate at `x` in f64 for the head's `A_log`.
    fn gate(x: f64, a_log: f64, lb: Option<f64>) -> f64 {
        let a = a_log.exp();
        match lb {
            None => {
                let sp = if x > 20.0 {
                    x
                } else {
                    x.max(0.0) + (-x.abs()).exp().ln_1p()
                };
                -a * sp
            }
            Some(lb) => lb / (1.0 + (-(a * x)).exp()),
        }
    }

    /// The central difference of `f` at `x` (step 1e-6).
    fn slope(x: f64, f: impl Fn(f64) -> f64) -> f64 {
        (f(x + 1e-6) - f(x - 1e-6)) / 2e-6
    }

    /// Both gates, values and the three gradients (for the weights `c` of `Σ c ⊙ g`), against the
    /// f64 formula and its central differences, with inputs on both sides of softplus's switch to
    /// the identity, at sizes of one block, a few, and enough for the parallel path.
    #[test]
    fn kda_gate_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for (rows, h, k) in [(3, 2, 5), (BLOCK_ROWS + 2, 3, 4), (2100, 4, 32)] {
            for lb in [None, Some(-5.0f32)] {
                let n = rows * h * k;
                // f32 values, so that the f64 reference sees the kernel's inputs exactly.
                let mut draw = |len: usize, lo: f64, hi: f64| -> Vec<f64> {
                    (0..len)
                        .map(|_| rng.random_range(lo..hi) as f32 as f64)
                        .collect()
                };
                let f = draw(n, -30.0, 30.0);
                let a_log = draw(h, -1.0, 1.5);
                let dt = draw(h * k, -1.0, 1.0);
                let c = draw(n, -1.0, 1.0);
                let array = |v: &[f64], shape: &[usize]| HostArray {
                    data: v.iter().map(|&x| x as f32).collect::<Vec<f32>>().into(),
                    shape: shape.to_vec(),
                };
                let inputs = [
                    array(&f, &[rows, h, k]),
                    array(&a_log, &[h]),
                    array(&dt, &[h * k]),
                ];
                let op = KdaGateHost { lower_bound: lb };
                let (g, _) = op.forward(&inputs, true);
                let [df, da, ddt] = op.backward(&inputs, &(), &array(&c, &[rows, h, k]));
                assert_eq!(g.shape, [rows, h, k]);
                let lb = lb.map(f64::from);
                let (mut want_g, mut want_df) = (vec![0.0; n], vec![0.0; n]);
                let (mut want_da, mut want_ddt) = (vec![0.0; h], vec![0.0; h * k]);
                for i in 0..n {
                    let j = i % (h * k);
                    let (x, al) = (f[i] + dt[j], a_log[j / k]);
                    want_g[i] = gate(x, al, lb);
                    want_df[i] = c[i] * slope(x, |x| gate(x, al, lb));
                    want_ddt[j] += want_df[i];
                    want_da[j / k] += c[i] * slope(al, |al| gate(x, al, lb));
                }
                let what = format!("rows {rows} H {h} K {k} lb {lb:?}");
                close(&format!("{what}: g"), &want_g, &g.data, 2e-6);
                close(&format!("{what}: df"), &want_df, &df.data, 1e-5);
                close(&format!("{what}: dA_log"), &want_da, &da.data, 1e-5);
                close(&format!("{what}: d dt_bias"), &want_ddt, &ddt.data, 1e-5);
            }
        }
    }

    /// Where the gate has saturated (`a·x` far below 0), its slopes are near `e^{a·x}` and their
    /// products with the gradient span f32's subnormal range: the kernel writes none (each such
    /// gradient is 0, below f32's normal range), and every gradient is still the f64 one to
    /// 1e-5 of its size, or within 1e-35 of it where `exp` itself stops (−87.3).
    #[test]
    fn saturated_gate_gradients_have_no_subnormals() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, h, k) = (64, 2, 8);
        let n = rows * h * k;
        for lb in [None, Some(-5.0f32)] {
            let f: Vec<f32> = (0..n).map(|_| rng.random_range(-100.0..-80.0)).collect();
            // Gradients from 1e-8 to 1 in size, of both signs.
            let c: Vec<f32> = (0..n)
                .map(|_| {
                    let size = 10f32.powf(rng.random_range(-8.0..0.0));
                    if rng.random_bool(0.5) {
                        size
                    } else {
                        -size
                    }
                })
                .collect();
            let array = |v: Vec<f32>, shape: &[usize]| HostArray {
                data: v.into(),
                shape: shape.to_vec(),
            };
            let inputs = [
                array(f.clone(), &[rows, h, k]),
                array(vec![0.0; h], &[h]),
                array(vec![0.0; h * k], &[h * k]),
            ];
            let op = KdaGateHost { lower_bound: lb };
            let [df, da, ddt] = op.backward(&inputs, &(), &array(c.clone(), &[rows, h, k]));
            let lb = lb.map(f64::from);
            let (mut want_da, mut want_ddt) = (vec![0.0; h], vec![0.0; h * k]);
            let mut underflows = 0;
            for i in 0..n {
                let (x, j) = (f[i] as f64, i % (h * k));
                let want = c[i] as f64 * slope(x, |x| gate(x, 0.0, lb));
                underflows += usize::from(want.abs() < f32::MIN_POSITIVE as f64);
                want_ddt[j] += want;
                want_da[j / k] += c[i] as f64 * slope(0.0, |al| gate(x, al, lb));
                let got = df.data[i];
                assert!(!got.is_subnormal(), "lb {lb:?}: df[{i}] = {got:e}");
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * want.abs() + 1e-35,
                    "lb {lb:?}: df[{i}] = {got:e}, want {want:e}"
                );
            }
            // The case under test occurs: most of the exact gradients underflow.
            assert!(
                underflows > n / 2,
                "lb {lb:?}: {underflows} of {n} underflow"
            );
            for (name, got, want) in [
                ("dA_log", &da.data, &want_da),
                ("d dt_bias", &ddt.data, &want_ddt),
            ] {
                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(!g.is_subnormal(), "lb {lb:?}: {name}[{i}] = {g:e}");
                    assert!(
                        (*g as f64 - w).abs() <= 1e-5 * w.abs() + 1e-35,
                        "lb {lb:?}: {name}[{i}] = {g:e}, want {w:e}"
                    );
                }
            }
        }
    }
}
