//! Attention Residuals on the CPU host kernels: per token, one pass over each source for its
//! statistics and score, the softmax over the `N` sources, and one pass for the mix; the backward
//! likewise, with the derived gradients. The reference's tensor ops make about ten passes over the
//! stacked `[N, rows, d]` sources each way, each with its autodiff node.
//!
//! Per row, with the sources `V_n`, the query `q = w_norm ⊙ w_proj`, `r_n = 1 / rms(V_n)`,
//! `a_n = V_n · q` and `s_n = a_n r_n`:
//!
//! ```text
//! P = softmax(s),   out = Σ_n P_n V_n
//! dP_n = dout · V_n,   ds_n = P_n (dP_n − Σ_m P_m dP_m)
//! dV_n = P_n dout + ds_n r_n q − (ds_n a_n r_n³ / d) V_n
//! dq   = Σ_rows Σ_n ds_n r_n V_n
//! ```
//!
//! Rows go to rayon's pool in fixed blocks when the input is large; `dq` sums each block's part,
//! then the blocks in order, so the result does not depend on the number of threads.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{
    dispatch, dot, exp_lane, update, write, ElementwiseMany, Scaled, Simd, WithSimd,
};
use crate::ops::norm::host::{inv_rms, BLOCK_ROWS, MIN_PARALLEL};

/// The AttnRes mix on the host. As `HostOp<M>`: inputs the `M − 1` sources `[.., d]` and the
/// query `[d]` last, output of a source's shape; each source is its own input, so neither the
/// forward stacks them nor the backward splits the gradient. [`Stacked`] takes them stacked.
#[derive(Debug, Clone)]
pub(crate) struct AttnResHost {
    /// Added to each source's mean square.
    pub eps: f32,
}

/// Per row and source (`[rows, N]` each): the softmax weights `P`, `r = 1 / rms(V)` and the raw
/// scores `a = V · q`.
#[derive(Debug)]
pub(crate) struct Saved {
    p: Vec<f32>,
    r: Vec<f32>,
    a: Vec<f32>,
}

/// The forward of a block of rows.
struct ForwardRows<'a> {
    /// The sources, `[rows, d]` each.
    v: &'a [&'a [f32]],
    q: &'a [f32],
    /// The block's first row.
    first: usize,
    /// The block's rows of the output.
    out: &'a mut [f32],
    /// The block's rows of `P`, `r`, `a`, `[rows, N]` each.
    p: &'a mut [f32],
    r: &'a mut [f32],
    a: &'a mut [f32],
    eps: f32,
}

impl WithSimd for ForwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            v,
            q,
            first,
            out,
            p,
            r,
            a,
            eps,
        } = self;
        let (d, n) = (q.len(), v.len());
        let source = |k: usize, t: usize| &v[k][t * d..(t + 1) * d];
        for (i, out) in out.chunks_exact_mut(d).enumerate() {
            let t = first + i;
            let (p, r, a) = (
                &mut p[i * n..(i + 1) * n],
                &mut r[i * n..(i + 1) * n],
                &mut a[i * n..(i + 1) * n],
            );
            let mut max = f32::NEG_INFINITY;
            for k in 0..n {
                let vk = source(k, t);
                r[k] = inv_rms(vk, eps);
                a[k] = dot(vk, q);
                p[k] = a[k] * r[k];
                max = max.max(p[k]);
            }
            let mut sum = 0.0f32;
            for pk in p.iter_mut() {
                *pk = exp_lane(*pk - max);
                sum += *pk;
            }
            for pk in p.iter_mut() {
                *pk /= sum;
            }
            write([&mut *out], [source(0, t)], Scaled(p[0]));
            for (k, &pk) in p.iter().enumerate().skip(1) {
                update(out, [source(k, t)], Scaled(pk));
            }
        }
    }
}

/// `p_k g + (ds r_k) q − along_v v_k` for `[g, q, v_k]`: a row of a source's gradient.
#[derive(Clone, Copy)]
struct SourceGrad {
    pk: f32,
    along_q: f32,
    along_v: f32,
}

impl ElementwiseMany<3, 1> for SourceGrad {
    #[inline(always)]
    fn apply(&self, [g, q, v]: [f32; 3]) -> [f32; 1] {
        [self.pk * g + self.along_q * q - self.along_v * v]
    }
}

/// A block of the backward: its index, its rows of every source's gradient, its part of `dq`.
type BackwardJob<'a> = (usize, Vec<&'a mut [f32]>, &'a mut [f32]);

/// The backward of a block of rows: its rows of `dv` and its part of `dq`.
struct BackwardRows<'a> {
    /// The sources, `[rows, d]` each.
    v: &'a [&'a [f32]],
    q: &'a [f32],
    grad: &'a [f32],
    saved: &'a Saved,
    first: usize,
    /// The block's rows of each source's gradient (`N` slices of `[block rows, d]`).
    dv: Vec<&'a mut [f32]>,
    /// Zeros on entry.
    dq: &'a mut [f32],
}

impl WithSimd for BackwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            v,
            q,
            grad,
            saved,
            first,
            mut dv,
            dq,
        } = self;
        let (d, n) = (q.len(), dv.len());
        let count = dv.first().map_or(0, |x| x.len() / d.max(1));
        let mut dp = vec![0.0f32; n];
        for i in 0..count {
            let t = first + i;
            let g = &grad[t * d..(t + 1) * d];
            let (p, r, a) = (
                &saved.p[t * n..(t + 1) * n],
                &saved.r[t * n..(t + 1) * n],
                &saved.a[t * n..(t + 1) * n],
            );
            let mut c = 0.0f32;
            for k in 0..n {
                let vk = &v[k][t * d..(t + 1) * d];
                dp[k] = dot(g, vk);
                c += p[k] * dp[k];
            }
            for (k, dvk) in dv.iter_mut().enumerate() {
                let vk = &v[k][t * d..(t + 1) * d];
                let dvk = &mut dvk[i * d..(i + 1) * d];
                let ds = p[k] * (dp[k] - c);
                let (pk, along_q) = (p[k], ds * r[k]);
                let along_v = ds * a[k] * r[k] * r[k] * r[k] / d as f32;
                write(
                    [&mut *dvk],
                    [g, q, vk],
                    SourceGrad {
                        pk,
                        along_q,
                        along_v,
                    },
                );
                update(dq, [vk], Scaled(along_q));
            }
        }
    }
}

impl AttnResHost {
    /// The mix of the sources (`[rows, d]` each) with the query: the output and what the
    /// backward needs.
    fn mix(&self, v: &[&[f32]], q: &[f32]) -> (Vec<f32>, Saved) {
        let (n, d) = (v.len(), q.len());
        let rows = v.first().map_or(0, |s| s.len() / d.max(1));
        let mut out = vec![0.0f32; rows * d];
        let (mut p, mut r, mut a) = (
            vec![0.0f32; rows * n],
            vec![0.0f32; rows * n],
            vec![0.0f32; rows * n],
        );
        if d > 0 && n > 0 {
            let jobs = out
                .chunks_mut(BLOCK_ROWS * d)
                .zip(p.chunks_mut(BLOCK_ROWS * n))
                .zip(r.chunks_mut(BLOCK_ROWS * n))
                .zip(a.chunks_mut(BLOCK_ROWS * n))
                .enumerate();
            let block = |(b, (((out, p), r), a)): (usize, (((&mut [f32], _), _), _))| {
                dispatch(ForwardRows {
                    v,
                    q,
                    first: b * BLOCK_ROWS,
                    out,
                    p,
                    r,
                    a,
                    eps: self.eps,
                })
            };
            if n * rows * d >= MIN_PARALLEL {
                jobs.collect::<Vec<_>>().into_par_iter().for_each(block);
            } else {
                jobs.for_each(block);
            }
        }
        (out, Saved { p, r, a })
    }

    /// The gradients of [`mix`](Self::mix): each source's into its slice of `dv`, and `dq`.
    fn grads(
        &self,
        v: &[&[f32]],
        q: &[f32],
        saved: &Saved,
        grad: &[f32],
        dv: Vec<&mut [f32]>,
    ) -> Vec<f32> {
        let (n, d) = (v.len(), q.len());
        let rows = v.first().map_or(0, |s| s.len() / d.max(1));
        let blocks = rows.div_ceil(BLOCK_ROWS);
        let mut parts = vec![0.0f32; blocks * d];
        if d > 0 && n > 0 {
            // Each block's rows of every source's gradient.
            let mut per_source: Vec<_> = dv
                .into_iter()
                .map(|s| s.chunks_mut(BLOCK_ROWS * d))
                .collect();
            let jobs: Vec<BackwardJob> = parts
                .chunks_mut(d)
                .enumerate()
                .map(|(b, dq)| {
                    let dv = per_source
                        .iter_mut()
                        .map(|s| {
                            s.next()
                                .unwrap_or_else(|| unreachable!("a block per source"))
                        })
                        .collect();
                    (b, dv, dq)
                })
                .collect();
            let block = |(b, dv, dq): BackwardJob| {
                dispatch(BackwardRows {
                    v,
                    q,
                    grad,
                    saved,
                    first: b * BLOCK_ROWS,
                    dv,
                    dq,
                })
            };
            if n * rows * d >= MIN_PARALLEL {
                jobs.into_par_iter().for_each(block);
            } else {
                jobs.into_iter().for_each(block);
            }
        }
        let mut dq = vec![0.0f32; d];
        for part in parts.chunks_exact(d.max(1)) {
            for (a, b) in dq.iter_mut().zip(part) {
                *a += b;
            }
        }
        dq
    }
}

impl<const M: usize> HostOp<M> for AttnResHost {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; M], save: bool) -> (HostArray, Option<Saved>) {
        let (q, sources) = inputs
            .split_last()
            .unwrap_or_else(|| unreachable!("the query is an input"));
        let v: Vec<&[f32]> = sources.iter().map(|s| &s.data[..]).collect();
        let (out, saved) = self.mix(&v, &q.data);
        let shape = sources.first().map_or_else(Vec::new, |s| s.shape.clone());
        let out = HostArray {
            data: out.into(),
            shape,
        };
        (out, save.then_some(saved))
    }

    fn backward(&self, inputs: &[HostArray; M], saved: &Saved, grad: &HostArray) -> [HostArray; M] {
        let (q, sources) = inputs
            .split_last()
            .unwrap_or_else(|| unreachable!("the query is an input"));
        let v: Vec<&[f32]> = sources.iter().map(|s| &s.data[..]).collect();
        let mut dv: Vec<Vec<f32>> = sources.iter().map(|s| vec![0.0f32; s.data.len()]).collect();
        let dq = self.grads(
            &v,
            &q.data,
            saved,
            &grad.data,
            dv.iter_mut().map(|x| &mut x[..]).collect(),
        );
        // The sources' gradients in input order, then the query's.
        let mut grads = dv.into_iter().map(Vec::into).chain([dq.into()]);
        std::array::from_fn(|i| HostArray {
            data: grads
                .next()
                .unwrap_or_else(|| unreachable!("one gradient per input")),
            shape: inputs[i].shape.clone(),
        })
    }
}

/// [`AttnResHost`] on stacked sources: inputs `v: [N, .., d]` and the query `[d]`; output `[.., d]`.
/// For more sources than [`AttnResHost`] takes as separate inputs.
#[derive(Debug, Clone)]
pub(crate) struct Stacked(pub AttnResHost);

/// `v: [N, ..]` cut into its `N` sources.
fn unstack(v: &HostArray) -> Vec<&[f32]> {
    let n = v.shape[0].max(1);
    v.data.chunks((v.data.len() / n).max(1)).collect()
}

impl HostOp<2> for Stacked {
    type Saved = Saved;

    fn forward(&self, [v, q]: &[HostArray; 2], save: bool) -> (HostArray, Option<Saved>) {
        let (out, saved) = self.0.mix(&unstack(v), &q.data);
        let out = HostArray {
            data: out.into(),
            shape: v.shape[1..].to_vec(),
        };
        (out, save.then_some(saved))
    }

    fn backward(&self, [v, q]: &[HostArray; 2], saved: &Saved, grad: &HostArray) -> [HostArray; 2] {
        let mut dv = vec![0.0f32; v.data.len()];
        let per = dv.len() / v.shape[0].max(1);
        let dq = self.0.grads(
            &unstack(v),
            &q.data,
            saved,
            &grad.data,
            dv.chunks_mut(per.max(1)).collect(),
        );
        [
            HostArray {
                data: dv.into(),
                shape: v.shape.clone(),
            },
            HostArray {
                data: dq.into(),
                shape: q.shape.clone(),
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backend::host::testing::{close, numeric};
    use rand::{Rng, SeedableRng};

    /// `Σ c ⊙ out` of the f64 formula.
    fn objective(v: &[f64], q: &[f64], c: &[f64], n: usize, eps: f64) -> f64 {
        let d = q.len();
        let rows = v.len() / (n * d);
        let mut total = 0.0;
        for t in 0..rows {
            let src = |k: usize| &v[(k * rows + t) * d..(k * rows + t + 1) * d];
            let s: Vec<f64> = (0..n)
                .map(|k| {
                    let x = src(k);
                    let r = 1.0 / (x.iter().map(|a| a * a).sum::<f64>() / d as f64 + eps).sqrt();
                    x.iter().zip(q).map(|(a, b)| a * b).sum::<f64>() * r
                })
                .collect();
            let m = s.iter().copied().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for j in 0..d {
                let o: f64 = (0..n).map(|k| e[k] / z * src(k)[j]).sum();
                total += c[t * d + j] * o;
            }
        }
        total
    }

    /// The mix, `dv` and `dq` against the f64 formula and its central differences, for one and
    /// several sources, widths with and without a lane tail, one block and several (the last
    /// partial), with sources of very different scales so that the softmax is far from uniform.
    #[test]
    fn attn_res_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (n, rows, d) in [(1, 3, 5), (3, 4, 19), (5, BLOCK_ROWS + 5, 16)] {
            let eps = 1e-6f32;
            let v: Vec<f64> = (0..n * rows * d)
                .map(|i| rng.random_range(-1.0..1.0) * (1.0 + (i / (rows * d)) as f64))
                .collect();
            let q: Vec<f64> = (0..d).map(|_| rng.random_range(-3.0..3.0)).collect();
            let c: Vec<f64> = (0..rows * d).map(|_| rng.random_range(-1.0..1.0)).collect();
            let f32s = |x: &[f64]| x.iter().map(|&a| a as f32).collect::<Vec<f32>>();
            let array = |x: &[f64], shape: &[usize]| HostArray {
                data: f32s(x).into(),
                shape: shape.to_vec(),
            };
            let op = AttnResHost { eps };
            let dout = array(&c, &[rows, d]);
            // Stacked, then each source its own input (`HostOp<N + 1>`).
            let stacked = [array(&v, &[n, rows, d]), array(&q, &[d])];
            let (out, saved) = Stacked(op.clone()).forward(&stacked, true);
            let [dv, dq] = Stacked(op.clone()).backward(&stacked, &saved.expect("saved"), &dout);
            let separate: Vec<HostArray> = v
                .chunks(rows * d)
                .map(|s| array(s, &[rows, d]))
                .chain([array(&q, &[d])])
                .collect();
            fn run<const M: usize>(
                op: &AttnResHost,
                inputs: Vec<HostArray>,
                dout: &HostArray,
            ) -> (HostArray, Vec<HostArray>) {
                let inputs: [HostArray; M] = inputs.try_into().expect("M inputs");
                let (out, saved) = op.forward(&inputs, true);
                (
                    out,
                    op.backward(&inputs, &saved.expect("saved"), dout).to_vec(),
                )
            }
            let (out2, grads2) = match n {
                1 => run::<2>(&op, separate, &dout),
                3 => run::<4>(&op, separate, &dout),
                _ => run::<6>(&op, separate, &dout),
            };
            assert_eq!(out2.shape, vec![rows, d]);
            assert_eq!(
                out.data, out2.data,
                "stacked and separate sources give one mix"
            );
            let dv2: Vec<f32> = grads2[..n].iter().flat_map(|g| g.data.to_vec()).collect();
            assert_eq!(
                dv.data.to_vec(),
                dv2,
                "stacked and separate sources give one dv"
            );
            assert_eq!(dq.data, grads2[n].data);
            let what = format!("N {n} rows {rows} d {d}");
            let eps = eps as f64;
            let want_out: Vec<f64> = (0..rows * d)
                .map(|i| {
                    let mut e = vec![0.0; rows * d];
                    e[i] = 1.0;
                    objective(&v, &q, &e, n, eps)
                })
                .collect();
            assert_eq!(out.shape, vec![rows, d]);
            close(&format!("{what}: out"), &want_out, &out.data, 2e-6);
            let dv_want = numeric(&v, |v| objective(v, &q, &c, n, eps));
            close(&format!("{what}: dv"), &dv_want, &dv.data, 2e-5);
            let dq_want = numeric(&q, |q| objective(&v, q, &c, n, eps));
            close(&format!("{what}: dq"), &dq_want, &dq.data, 2e-5);
        }
    }
}
