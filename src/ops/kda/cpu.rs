//! The CPU kernel of KDA: the recurrence of design §4.1 as one loop nest on the host, forward and
//! backward, for the CPU backends (see [`crate::ops::backend::host`]).
//!
//! The recurrence is the ground truth of every KDA form, and on a CPU it is also the cheapest one:
//! per token and head it costs two passes over the `K × V` state forward and four backward (two of
//! them recomputing the states), with no cumulative sum of gates anywhere — each step multiplies by
//! its own `exp(g_t) ≤ 1`, so the numerics of design §4.3 hold trivially. The forward pass keeps the
//! state every [`CHECKPOINT`] tokens; the backward pass recomputes the states of one such span at
//! a time and walks it backwards:
//!
//! ```text
//! forward:   S' = Diag(e^{g_t}) S;  p = S'ᵀk;  e = v − p;  u = β e;  S_t = S' + k uᵀ;  o = S_tᵀ q
//! backward:  dS += q doᵀ;  dq = S_t do;  du = dSᵀk;  dk = dS u;  dβ = du·e;  dv = β du;  dp = −β du
//!            dk += S' dp;  dS' = dS + k dpᵀ;  dg = rowsum(S' ⊙ dS');  dS ← Diag(e^{g_t}) dS'
//! ```
//!
//! With `l2norm`, `q` and `k` are normalised over the head dim first (`x / sqrt(Σx² + 1e-6)`, design
//! §4.2) and the backward pass goes through the norm: `dx = (dy − y (y·dy)) / r`.

use crate::ops::backend::host::{parallel_map, HostArray, HostOp};

/// Tokens between two saved states.
const CHECKPOINT: usize = 64;

/// KDA over `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]` → `o: [B, T, H, V]`, from
/// a zero state, every row its own sequence (or packed sequences along T with `B = 1`).
#[derive(Debug, Clone)]
pub(crate) struct KdaRecurrence {
    /// Multiplies `q` (after the norm).
    pub scale: f32,
    /// L2-normalise `q` and `k` over the head dim first.
    pub l2norm: bool,
    /// Packed sequences `(start, len)` along T (`B = 1`); `None`: every row is one sequence.
    pub seqs: Option<Vec<(usize, usize)>>,
}

/// Sizes and strides of one call.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    t: usize,
    h: usize,
}

impl Geometry {
    /// Offset of token `t` of row `b`, head `h`, in a `[B, T, H, X]` buffer of width `x`.
    fn at(&self, b: usize, t: usize, h: usize, x: usize) -> usize {
        ((b * self.t + t) * self.h + h) * x
    }
}

/// One independent recurrence: row `b`, head `h`, tokens `start..start + len`.
#[derive(Debug, Clone, Copy)]
struct Job {
    b: usize,
    h: usize,
    start: usize,
    len: usize,
}

/// What the backward pass needs: the scaled (normalised) `q`, the normalised `k`, their norms, and
/// the state before every [`CHECKPOINT`]-th token of each job.
#[derive(Debug)]
pub(crate) struct Saved {
    q: Vec<f32>,
    k: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    states: Vec<Vec<f32>>,
}

impl KdaRecurrence {
    fn jobs(&self, b: usize, t: usize, h: usize) -> Vec<Job> {
        let spans = match &self.seqs {
            Some(s) => s.clone(),
            None => vec![(0, t)],
        };
        let rows = if self.seqs.is_some() { 1 } else { b };
        let mut jobs = Vec::with_capacity(rows * spans.len() * h);
        for row in 0..rows {
            for &(start, len) in &spans {
                for head in 0..h {
                    jobs.push(Job {
                        b: row,
                        h: head,
                        start,
                        len,
                    });
                }
            }
        }
        jobs
    }

    /// `x` per `K`-vector scaled by `scale`, normalised first with `l2norm`; and the norms.
    fn prepare(&self, x: &[f32], k: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
        let mut out = x.to_vec();
        let mut norms = Vec::new();
        if self.l2norm {
            norms.reserve(x.len() / k);
            for row in out.chunks_exact_mut(k) {
                let r = (row.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
                norms.push(r);
                let s = scale / r;
                row.iter_mut().for_each(|a| *a *= s);
            }
        } else if scale != 1.0 {
            out.iter_mut().for_each(|a| *a *= scale);
        }
        (out, norms)
    }
}

/// One forward step on the state `s [K, V]`; writes `e = v − p` and `o`, leaves `S_t` in `s`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    e: &mut [f32],
    u: &mut [f32],
    o: &mut [f32],
) {
    let vd = v.len();
    e.fill(0.0);
    for (i, row) in s.chunks_exact_mut(vd).enumerate() {
        let (a, ki) = (g[i].exp(), k[i]);
        for (x, p) in row.iter_mut().zip(e.iter_mut()) {
            *x *= a;
            *p += ki * *x;
        }
    }
    for ((ej, uj), vj) in e.iter_mut().zip(u.iter_mut()).zip(v) {
        *ej = vj - *ej;
        *uj = beta * *ej;
    }
    o.fill(0.0);
    for (i, row) in s.chunks_exact_mut(vd).enumerate() {
        let (ki, qi) = (k[i], q[i]);
        for ((x, uj), oj) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
            *x += ki * uj;
            *oj += qi * *x;
        }
    }
}

impl HostOp<5> for KdaRecurrence {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; 5], save: bool) -> (HostArray, Option<Saved>) {
        let [q, k, v, g, beta] = inputs;
        let &[b, t, h, kd] = q.shape.as_slice() else {
            unreachable!("q is [B, T, H, K]")
        };
        let vd = v.shape[3];
        let geo = Geometry { t, h };
        let scale = self.scale;
        let (qs, q_norm) = self.prepare(&q.data, kd, scale);
        let (ks, k_norm) = self.prepare(&k.data, kd, 1.0);
        let jobs = self.jobs(b, t, h);
        let results = parallel_map(jobs.len(), |j| {
            let job = jobs[j];
            let mut s = vec![0.0f32; kd * vd];
            let (mut e, mut u) = (vec![0.0f32; vd], vec![0.0f32; vd]);
            let mut o = vec![0.0f32; job.len * vd];
            let mut states = Vec::new();
            for (i, oi) in o.chunks_exact_mut(vd).enumerate() {
                if save && i % CHECKPOINT == 0 {
                    states.extend_from_slice(&s);
                }
                let tk = job.start + i;
                let at = geo.at(job.b, tk, job.h, kd);
                let av = geo.at(job.b, tk, job.h, vd);
                step(
                    &mut s,
                    &qs[at..at + kd],
                    &ks[at..at + kd],
                    &v.data[av..av + vd],
                    &g.data[at..at + kd],
                    beta.data[(job.b * t + tk) * h + job.h],
                    &mut e,
                    &mut u,
                    oi,
                );
            }
            (o, states)
        });
        let mut out = HostArray::zeros(&[b, t, h, vd]);
        let mut states = Vec::with_capacity(jobs.len());
        for (job, (o, st)) in jobs.iter().zip(results) {
            for (i, oi) in o.chunks_exact(vd).enumerate() {
                let av = geo.at(job.b, job.start + i, job.h, vd);
                out.data[av..av + vd].copy_from_slice(oi);
            }
            states.push(st);
        }
        let saved = save.then_some(Saved {
            q: qs,
            k: ks,
            q_norm,
            k_norm,
            states,
        });
        (out, saved)
    }

    // Long on purpose: the reverse recurrence of one (sequence, head) job keeps its running state
    // gradient and per-token scratch in locals across the whole loop; split, every piece would
    // take the same dozen slices.
    fn backward(&self, inputs: &[HostArray; 5], saved: &Saved, grad: &HostArray) -> [HostArray; 5] {
        let [q, k, v, g, beta] = inputs;
        let &[b, t, h, kd] = q.shape.as_slice() else {
            unreachable!("q is [B, T, H, K]")
        };
        let vd = v.shape[3];
        let geo = Geometry { t, h };
        let jobs = self.jobs(b, t, h);
        let (qs, ks) = (&saved.q, &saved.k);
        let results = parallel_map(jobs.len(), |j| {
            let job = jobs[j];
            let (n, kv) = (job.len, kd * vd);
            let mut dq = vec![0.0f32; n * kd];
            let mut dk = vec![0.0f32; n * kd];
            let mut dg = vec![0.0f32; n * kd];
            let mut dv = vec![0.0f32; n * vd];
            let mut db = vec![0.0f32; n];
            let mut ds = vec![0.0f32; kv];
            // States S_{t−1}, S_t of one checkpoint span, and e, u per token.
            let mut span = vec![0.0f32; (CHECKPOINT + 1) * kv];
            let mut es = vec![0.0f32; CHECKPOINT * vd];
            let mut us = vec![0.0f32; CHECKPOINT * vd];
            let mut o = vec![0.0f32; vd];
            let (mut du, mut dp) = (vec![0.0f32; vd], vec![0.0f32; vd]);
            let spans = n.div_ceil(CHECKPOINT);
            for c in (0..spans).rev() {
                let first = c * CHECKPOINT;
                let len = CHECKPOINT.min(n - first);
                span[..kv].copy_from_slice(&saved.states[j][c * kv..(c + 1) * kv]);
                for i in 0..len {
                    let tk = job.start + first + i;
                    let at = geo.at(job.b, tk, job.h, kd);
                    let av = geo.at(job.b, tk, job.h, vd);
                    let (done, rest) = span.split_at_mut((i + 1) * kv);
                    let next = &mut rest[..kv];
                    next.copy_from_slice(&done[i * kv..]);
                    step(
                        next,
                        &qs[at..at + kd],
                        &ks[at..at + kd],
                        &v.data[av..av + vd],
                        &g.data[at..at + kd],
                        beta.data[(job.b * t + tk) * h + job.h],
                        &mut es[i * vd..(i + 1) * vd],
                        &mut us[i * vd..(i + 1) * vd],
                        &mut o,
                    );
                }
                for i in (0..len).rev() {
                    let local = first + i;
                    let tk = job.start + local;
                    let at = geo.at(job.b, tk, job.h, kd);
                    let av = geo.at(job.b, tk, job.h, vd);
                    let (qt, kt, gt) = (&qs[at..at + kd], &ks[at..at + kd], &g.data[at..at + kd]);
                    let bt = beta.data[(job.b * t + tk) * h + job.h];
                    let dout = &grad.data[av..av + vd];
                    let (e, u) = (&es[i * vd..(i + 1) * vd], &us[i * vd..(i + 1) * vd]);
                    let s_prev = &span[i * kv..(i + 1) * kv];
                    let s_now = &span[(i + 1) * kv..(i + 2) * kv];
                    let dqt = &mut dq[local * kd..(local + 1) * kd];
                    let dkt = &mut dk[local * kd..(local + 1) * kd];
                    // dS += q doᵀ; dq = S_t do; du = dSᵀ k; dk = dS u.
                    du.fill(0.0);
                    for i2 in 0..kd {
                        let (qi, ki) = (qt[i2], kt[i2]);
                        let row = &mut ds[i2 * vd..(i2 + 1) * vd];
                        let srow = &s_now[i2 * vd..(i2 + 1) * vd];
                        let (mut acc_q, mut acc_k) = (0.0f32, 0.0f32);
                        for j2 in 0..vd {
                            row[j2] += qi * dout[j2];
                            acc_q += srow[j2] * dout[j2];
                            du[j2] += row[j2] * ki;
                            acc_k += row[j2] * u[j2];
                        }
                        dqt[i2] = acc_q;
                        dkt[i2] = acc_k;
                    }
                    let mut dbeta = 0.0f32;
                    for j2 in 0..vd {
                        dbeta += du[j2] * e[j2];
                        dv[local * vd + j2] = bt * du[j2];
                        dp[j2] = -bt * du[j2];
                    }
                    db[local] = dbeta;
                    // S' = Diag(e^g) S_{t−1}: dk += S' dp; dS' = dS + k dpᵀ; dg = rowsum(S' ⊙ dS').
                    let dgt = &mut dg[local * kd..(local + 1) * kd];
                    for i2 in 0..kd {
                        let (a, ki) = (gt[i2].exp(), kt[i2]);
                        let row = &mut ds[i2 * vd..(i2 + 1) * vd];
                        let prow = &s_prev[i2 * vd..(i2 + 1) * vd];
                        let (mut acc_k, mut acc_g) = (0.0f32, 0.0f32);
                        for j2 in 0..vd {
                            let sp = a * prow[j2];
                            acc_k += sp * dp[j2];
                            let d = row[j2] + ki * dp[j2];
                            acc_g += sp * d;
                            row[j2] = a * d;
                        }
                        dkt[i2] += acc_k;
                        dgt[i2] = acc_g;
                    }
                }
            }
            (dq, dk, dv, dg, db)
        });
        let mut dq = HostArray::zeros(&q.shape);
        let mut dk = HostArray::zeros(&k.shape);
        let mut dv = HostArray::zeros(&v.shape);
        let mut dg = HostArray::zeros(&g.shape);
        let mut db = HostArray::zeros(&beta.shape);
        for (job, (jq, jk, jv, jg, jb)) in jobs.iter().zip(results) {
            for i in 0..job.len {
                let tk = job.start + i;
                let at = geo.at(job.b, tk, job.h, kd);
                let av = geo.at(job.b, tk, job.h, vd);
                dq.data[at..at + kd].copy_from_slice(&jq[i * kd..(i + 1) * kd]);
                dk.data[at..at + kd].copy_from_slice(&jk[i * kd..(i + 1) * kd]);
                dg.data[at..at + kd].copy_from_slice(&jg[i * kd..(i + 1) * kd]);
                dv.data[av..av + vd].copy_from_slice(&jv[i * vd..(i + 1) * vd]);
                db.data[(job.b * t + tk) * h + job.h] = jb[i];
            }
        }
        // Through the scale and the norms: q_s = scale · q / r_q, k_n = k / r_k.
        self.unnormalise(&mut dq.data, qs, &saved.q_norm, kd, self.scale);
        self.unnormalise(&mut dk.data, ks, &saved.k_norm, kd, 1.0);
        [dq, dk, dv, dg, db]
    }
}

impl KdaRecurrence {
    /// Turns the gradient of `y = scale · x / r` (given `y`) into the gradient of `x`, in place.
    fn unnormalise(&self, dy: &mut [f32], y: &[f32], norms: &[f32], k: usize, scale: f32) {
        if !self.l2norm {
            if scale != 1.0 {
                dy.iter_mut().for_each(|d| *d *= scale);
            }
            return;
        }
        for ((d, yv), r) in dy.chunks_exact_mut(k).zip(y.chunks_exact(k)).zip(norms) {
            // With n = x / r and y = scale · n: dn = scale · dy, dx = (dn − n (n·dn)) / r.
            let dot: f32 = d.iter().zip(yv).map(|(a, b)| a * b).sum::<f32>() / scale;
            for (a, yy) in d.iter_mut().zip(yv) {
                *a = (scale * *a - yy * dot) / r;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{backend::Backend, Distribution, Tensor};

    use crate::ops::kda::{cpu_kda, naive_recurrent_kda, KdaOptions};

    type B = Autodiff<NdArray<f32>>;

    struct Case {
        dims: [usize; 5],
        l2norm: bool,
        scale: Option<f64>,
        seqs: Option<Vec<usize>>,
        extreme: bool,
    }

    fn host<const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
        x.into_data().to_vec().expect("f32")
    }

    /// Output and the gradients of q, k, v, g, β against the naive recurrence's autodiff.
    fn check(case: Case) {
        let device = Default::default();
        let [b, t, h, kd, vd] = case.dims;
        B::seed(&device, t as u64);
        let normal =
            |s: [usize; 4]| Tensor::<B, 4>::random(s, Distribution::Normal(0.0, 1.0), &device);
        let q = normal([b, t, h, kd]);
        let k = normal([b, t, h, kd]);
        let v = normal([b, t, h, vd]);
        // log σ(x) gates, a tenth of them −1000 in the extreme case.
        let mut g = normal([b, t, h, kd]).neg().exp().log1p().neg();
        if case.extreme {
            let mask =
                Tensor::<B, 4>::random([b, t, h, kd], Distribution::Uniform(0.0, 1.0), &device)
                    .lower_elem(0.1);
            g = g.mask_fill(mask, -1000.0);
        }
        let beta = Tensor::<B, 3>::random([b, t, h], Distribution::Uniform(0.0, 1.0), &device);
        let d_o = normal([b, t, h, vd]);
        let seqs = case
            .seqs
            .as_ref()
            .map(|cu| cu.windows(2).map(|w| (w[0], w[1] - w[0])).collect());
        let run = |host_kernel: bool| {
            let (q, k, v, g, beta) = (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone().require_grad(),
                g.clone().require_grad(),
                beta.clone().require_grad(),
            );
            let o = if host_kernel {
                cpu_kda(&q, &k, &v, &g, &beta, case.scale, case.l2norm, seqs.clone())
                    .expect("ndarray has the CPU kernel")
            } else {
                let mut opts = KdaOptions::default().with_qk_l2norm(case.l2norm);
                opts.scale = case.scale;
                opts.cu_seqlens = case.seqs.clone();
                naive_recurrent_kda(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    g.clone(),
                    beta.clone(),
                    opts,
                )
                .0
            };
            let grads = o.clone().mul(d_o.clone()).sum().backward();
            let inner = |x: Option<Tensor<NdArray<f32>, 4>>| -> Vec<f32> {
                x.expect("gradient").into_data().to_vec().expect("f32")
            };
            vec![
                host(o),
                inner(q.grad(&grads)),
                inner(k.grad(&grads)),
                inner(v.grad(&grads)),
                inner(g.grad(&grads)),
                beta.grad(&grads)
                    .expect("gradient")
                    .into_data()
                    .to_vec()
                    .expect("f32"),
            ]
        };
        let (want, got) = (run(false), run(true));
        for (name, (w, g)) in ["o", "dq", "dk", "dv", "dg", "dbeta"]
            .iter()
            .zip(want.iter().zip(&got))
        {
            let scale = w.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = w
                .iter()
                .zip(g)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 2e-5 * scale,
                "{name}: max error {err} (max |want| {scale}) at dims {:?}, l2norm {}",
                case.dims,
                case.l2norm
            );
        }
    }

    #[test]
    fn matches_the_naive_recurrence_and_its_gradients() {
        // Several checkpoint spans, the last one partial; unnormalised q, k of any scale.
        check(Case {
            dims: [2, 150, 2, 8, 5],
            l2norm: true,
            scale: None,
            seqs: None,
            extreme: false,
        });
        check(Case {
            dims: [1, 70, 1, 6, 4],
            l2norm: false,
            scale: Some(0.3),
            seqs: None,
            extreme: false,
        });
        check(Case {
            dims: [1, 40, 2, 4, 4],
            l2norm: true,
            scale: Some(2.0),
            seqs: None,
            extreme: true,
        });
    }

    #[test]
    fn packed_sequences_restart_the_state() {
        check(Case {
            dims: [1, 140, 2, 4, 3],
            l2norm: true,
            scale: None,
            seqs: Some(vec![0, 1, 65, 130, 140]),
            extreme: false,
        });
    }
}
