//! The backward pass of the host KDA recurrence: each checkpoint span's states recomputed, then
//! walked back one token at a time with `dS` in blocks of SIMD registers.

use super::forward::step;
use super::{
    column_blocks, piece, unprepare_gradient, Geometry, Inputs, Job, KdaRecurrence, Pass, Prepared,
    Saved, CHECKPOINT, PREFETCH_AHEAD,
};
use crate::ops::backend::host::{
    parallel_map_sized, scratch, DisjointWrites, HostArray, HostData, Scratch,
};
use crate::ops::backend::simd::{dispatch, load, prefetch, store, Scalar, Simd, WithSimd};

/// Where the backward pass writes the input gradients, in the layout of the inputs.
struct GradsOut<'a> {
    dq: DisjointWrites<'a>,
    dk: DisjointWrites<'a>,
    dv: DisjointWrites<'a>,
    dg: DisjointWrites<'a>,
    dbeta: DisjointWrites<'a>,
}

impl GradsOut<'_> {
    /// Requests the gradient rows of token `tk` of the job for writing (see
    /// [`DisjointWrites::prefetch_write`]). Not `dβ`'s: one line of it holds several tokens of
    /// every head, so most requests would repeat one already made, and other threads write it too.
    #[inline(always)]
    fn prefetch_write(&self, geo: Geometry, job: &Job, tk: usize) {
        let (at, av) = (
            geo.at(job.b, tk, job.h, geo.kd),
            geo.at(job.b, tk, job.h, geo.vd),
        );
        self.dq.prefetch_write(at, geo.kd);
        self.dk.prefetch_write(at, geo.kd);
        self.dg.prefetch_write(at, geo.kd);
        self.dv.prefetch_write(av, geo.vd);
    }
}

/// The output gradient's rows `[B, T, H, V]` as the backward pass reads them: through a pointer,
/// one row at a time, because `dv` may be written over it ([`HostOp::backward_owned`]), and
/// a shared borrow of the whole buffer would then alias those writes. Each job reads and writes
/// only its own rows, and a step copies its row of `do` before it writes that row of `dv`.
///
/// [`HostOp::backward_owned`]: crate::ops::backend::host::HostOp::backward_owned
#[derive(Clone, Copy)]
pub(super) struct GradIn<'a> {
    ptr: *const f32,
    len: usize,
    _buffer: std::marker::PhantomData<&'a [f32]>,
}

// SAFETY: a read-only view; which rows a thread may read is `row`'s contract.
unsafe impl Send for GradIn<'_> {}
// SAFETY: as above.
unsafe impl Sync for GradIn<'_> {}

impl<'a> GradIn<'a> {
    /// Rows that nothing writes.
    pub(super) fn shared(grad: &'a [f32]) -> Self {
        Self {
            ptr: grad.as_ptr(),
            len: grad.len(),
            _buffer: std::marker::PhantomData,
        }
    }

    /// Rows that `dv` is written over, through `dv`'s own pointer.
    pub(super) fn under(dv: &DisjointWrites<'a>, len: usize) -> Self {
        Self {
            ptr: dv.as_ptr(),
            len,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Elements `at..at + len`.
    ///
    /// # Safety
    /// No mutable slice of these elements may be alive while the returned slice is.
    ///
    /// # Panics
    /// When the range is out of bounds.
    #[inline(always)]
    pub(super) unsafe fn row(&self, at: usize, len: usize) -> &'a [f32] {
        assert!(
            at <= self.len && len <= self.len - at,
            "row {at}..{} of an output gradient of {}",
            at + len,
            self.len
        );
        // SAFETY: in bounds (checked above); no writes overlap (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }
}

/// What one backward step reads besides the running `dS`: the states around the token, its
/// output gradient, `u`, `e`, the prepared token and `β`.
struct Rows<'a> {
    s_now: &'a [f32],
    s_prev: &'a [f32],
    dout: &'a [f32],
    u: &'a [f32],
    e: &'a [f32],
    t: &'a Prepared,
    beta: f32,
}

/// Per-row partial sums of one backward step (`dq`, `dk` and `dg` of each row of the state), one
/// register of lanes per row.
struct RowSums<V> {
    q: Vec<V>,
    k: Vec<V>,
    g: Vec<V>,
}

impl<V: Copy> RowSums<V> {
    fn new(kd: usize, zero: V) -> Self {
        Self {
            q: vec![zero; kd],
            k: vec![zero; kd],
            g: vec![zero; kd],
        }
    }

    fn fill(&mut self, zero: V) {
        self.q.fill(zero);
        self.k.fill(zero);
        self.g.fill(zero);
    }
}

/// One backward step on the `N` blocks of `S`'s lanes of `dS` that start at column `j` (updated
/// from `dS_t` to `dS_{t−1}`): adds the columns' parts of each row's `dq`, `dk`, `dg` to `sums`,
/// writes the columns of `dv`, and returns their lanes of `dβ`:
///
/// ```text
/// dS += q doᵀ;  dq = S_t do;  du = dSᵀk;  dk = dS u;  dv = β du;  dp = −β du;  dβ = du·e
/// dk += S' dp;  dS' = dS + k dpᵀ;  dg = rowsum(S' ⊙ dS');  dS ← Diag(e^g) dS'
/// ```
///
/// As in the forward step every column is independent (`dp` of a column needs only that column of
/// `du`). The first pass does not store `dS + q doᵀ`; the second recomputes it.
#[inline(always)]
fn backward_block<S: Simd, const N: usize>(
    simd: S,
    j: usize,
    ds: &mut [f32],
    r: &Rows,
    sums: &mut RowSums<S::f32s>,
    dv: &mut [f32],
) -> S::f32s {
    let (vd, lanes) = (r.dout.len(), S::F32_LANES);
    let w = N * lanes;
    let zero = simd.splat_f32s(0.0);
    let (mut dout, mut u, mut du) = ([zero; N], [zero; N], [zero; N]);
    for n in 0..N {
        dout[n] = load::<S>(&r.dout[j + n * lanes..]);
        u[n] = load::<S>(&r.u[j + n * lanes..]);
    }
    for (i, (&q, &k)) in r.t.q.iter().zip(&r.t.k).enumerate() {
        let at = i * vd + j;
        let (q, k) = (simd.splat_f32s(q), simd.splat_f32s(k));
        let (row, now) = (&ds[at..at + w], &r.s_now[at..at + w]);
        let (mut pq, mut pk) = (zero, zero);
        for n in 0..N {
            let d = simd.mul_add_e_f32s(q, dout[n], load::<S>(&row[n * lanes..]));
            du[n] = simd.mul_add_e_f32s(d, k, du[n]);
            pq = simd.mul_add_e_f32s(load::<S>(&now[n * lanes..]), dout[n], pq);
            pk = simd.mul_add_e_f32s(d, u[n], pk);
        }
        sums.q[i] = simd.add_f32s(sums.q[i], pq);
        sums.k[i] = simd.add_f32s(sums.k[i], pk);
    }
    let (beta, mut dbeta, mut dp) = (simd.splat_f32s(r.beta), zero, [zero; N]);
    for n in 0..N {
        let c = j + n * lanes;
        dbeta = simd.mul_add_e_f32s(du[n], load::<S>(&r.e[c..]), dbeta);
        let beta_du = simd.mul_f32s(beta, du[n]);
        store::<S>(&mut dv[c..], beta_du);
        dp[n] = simd.neg_f32s(beta_du);
    }
    for (i, ((&a, &k), &q)) in r.t.decay.iter().zip(&r.t.k).zip(&r.t.q).enumerate() {
        let at = i * vd + j;
        let (a, k, q) = (simd.splat_f32s(a), simd.splat_f32s(k), simd.splat_f32s(q));
        let prev = &r.s_prev[at..at + w];
        let row = &mut ds[at..at + w];
        let (mut pk, mut pg) = (zero, zero);
        for n in 0..N {
            let d = simd.mul_add_e_f32s(q, dout[n], load::<S>(&row[n * lanes..]));
            let dd = simd.mul_add_e_f32s(k, dp[n], d);
            let sp = simd.mul_f32s(a, load::<S>(&prev[n * lanes..]));
            pk = simd.mul_add_e_f32s(sp, dp[n], pk);
            pg = simd.mul_add_e_f32s(sp, dd, pg);
            store::<S>(&mut row[n * lanes..], simd.mul_f32s(a, dd));
        }
        sums.k[i] = simd.add_f32s(sums.k[i], pk);
        sums.g[i] = simd.add_f32s(sums.g[i], pg);
    }
    dbeta
}

/// One backward step over all columns of `dS`, in blocks as in [`step`]: the lanes of `dβ` and,
/// in `sums` / `tail`, the per-row partial sums of the register blocks / the single columns.
#[inline(always)]
fn backward_columns<S: Simd>(
    simd: S,
    ds: &mut [f32],
    r: &Rows,
    sums: &mut RowSums<S::f32s>,
    tail: &mut RowSums<f32>,
    dv: &mut [f32],
) -> f32 {
    let lanes = S::F32_LANES;
    let [wide, narrow, single] = column_blocks(r.dout.len(), lanes);
    let mut dbeta = simd.splat_f32s(0.0);
    for j in wide.step_by(4 * lanes) {
        let d = backward_block::<S, 4>(simd, j, ds, r, sums, dv);
        dbeta = simd.add_f32s(dbeta, d);
    }
    for j in narrow.step_by(lanes) {
        let d = backward_block::<S, 1>(simd, j, ds, r, sums, dv);
        dbeta = simd.add_f32s(dbeta, d);
    }
    let mut rest = 0.0f32;
    for j in single {
        rest += backward_block::<Scalar, 1>(Scalar, j, ds, r, tail, dv);
    }
    simd.reduce_sum_f32s(dbeta) + rest
}

/// The backward recurrence of a group of jobs of the same length (see [`KdaRecurrence::groups`]),
/// one [`CHECKPOINT`] span of each job in turn from the last span back: `ds[g]` holds job `g`'s
/// `dS_T` on entry and its `dS_0` on exit; `states[g]` are its saved checkpoints and `grad` the
/// output gradient (`[B, T, H, V]`, the final state gradient may follow); the jobs' rows of the
/// input gradients go to `out`.
struct BackwardGroup<'a> {
    x: &'a Inputs<'a>,
    jobs: &'a [Job],
    states: Vec<&'a [f32]>,
    grad: GradIn<'a>,
    ds: &'a mut [Vec<f32>],
    out: &'a GradsOut<'a>,
}

impl WithSimd for BackwardGroup<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Self {
            x,
            jobs,
            states,
            grad,
            ds,
            out,
        } = self;
        let Geometry { kd, vd, .. } = x.geo;
        let (n, kv) = (jobs.first().map_or(0, |job| job.len), kd * vd);
        let mut work = SpanWork::new(simd, kd, vd);
        for c in (0..n.div_ceil(CHECKPOINT)).rev() {
            let first = c * CHECKPOINT;
            for (g, job) in jobs.iter().enumerate() {
                let next = next_span(jobs.len(), g, c).map(|(g2, c2)| {
                    let state = &states[g2][c2 * kv..(c2 + 1) * kv];
                    (&jobs[g2], c2 * CHECKPOINT, state)
                });
                let span = Span {
                    job,
                    first,
                    len: CHECKPOINT.min(n - first),
                    state: &states[g][c * kv..(c + 1) * kv],
                    next,
                };
                work.backward(simd, x, &span, &mut ds[g], grad, out);
            }
        }
    }
}

/// The span that a [`BackwardGroup`] of `n` jobs takes after span `c` of job `g`, as `(job,
/// span)`: the same span of the next job, or the span before of the first job; `None` after the
/// last.
#[inline(always)]
pub(super) fn next_span(n: usize, g: usize, c: usize) -> Option<(usize, usize)> {
    if g + 1 < n {
        Some((g + 1, c))
    } else {
        c.checked_sub(1).map(|c| (0, c))
    }
}

/// One checkpoint span of a job in the backward pass: tokens `first..first + len` (from the job's
/// start), the saved state before them, and the span the group takes next (a job, its first token
/// and its saved state), whose rows and state are requested ahead.
struct Span<'a> {
    job: &'a Job,
    first: usize,
    len: usize,
    state: &'a [f32],
    next: Option<(&'a Job, usize, &'a [f32])>,
}

/// The working buffers of the backward pass, reused from span to span: the states `S_{t−1}`,
/// `S_t` of one span, per token its prepared inputs, `e` and `u`, and the per-row partial sums.
struct SpanWork<V> {
    states: Scratch,
    tokens: Vec<Prepared>,
    es: Vec<f32>,
    us: Vec<f32>,
    o: Vec<f32>,
    /// The row of the output gradient in work, copied out of it (`dv` may be written over it).
    dout: Vec<f32>,
    sums: RowSums<V>,
    tail: RowSums<f32>,
}

impl<V: Copy> SpanWork<V> {
    fn new<S: Simd<f32s = V>>(simd: S, kd: usize, vd: usize) -> Self {
        Self {
            states: scratch((CHECKPOINT + 1) * kd * vd),
            tokens: (0..CHECKPOINT).map(|_| Prepared::new(kd)).collect(),
            es: vec![0.0; CHECKPOINT * vd],
            us: vec![0.0; CHECKPOINT * vd],
            o: vec![0.0; vd],
            dout: vec![0.0; vd],
            sums: RowSums::new(kd, simd.splat_f32s(0.0)),
            tail: RowSums::new(kd, 0.0),
        }
    }

    /// Recomputes the span's states from its checkpoint, then walks it back: `ds` goes from
    /// `dS` after the span to `dS` before it, and the span's rows of the input gradients go to
    /// `out`.
    #[inline(always)]
    fn backward<S: Simd<f32s = V>>(
        &mut self,
        simd: S,
        x: &Inputs,
        span: &Span,
        ds: &mut [f32],
        grad: GradIn<'_>,
        out: &GradsOut,
    ) {
        let Self {
            states,
            tokens,
            es,
            us,
            o,
            dout,
            sums,
            tail,
        } = self;
        let Span {
            job, first, len, ..
        } = *span;
        let geo = x.geo;
        let Geometry { kd, vd, .. } = geo;
        let kv = kd * vd;
        // Every state of the span is written before it is read (the first from the checkpoint).
        states[..kv].copy_from_slice(span.state);
        for (i, t) in tokens.iter_mut().enumerate().take(len) {
            // The output gradient rows too: the walk back below reads them.
            if i + PREFETCH_AHEAD < len {
                x.prefetch(job, job.start + first + i + PREFETCH_AHEAD, Some(grad));
            }
            // The walk back below writes the last tokens' gradient rows first.
            if i + PREFETCH_AHEAD >= len {
                out.prefetch_write(geo, job, job.start + first + i);
            }
            let (v, beta) = x.token(job, job.start + first + i, t);
            let (done, rest) = states.split_at_mut((i + 1) * kv);
            let (e, u) = (&mut es[i * vd..(i + 1) * vd], &mut us[i * vd..(i + 1) * vd]);
            step(
                simd,
                &mut rest[..kv],
                Some(&done[i * kv..]),
                t,
                v,
                beta,
                e,
                u,
                o,
            );
        }
        let zero = simd.splat_f32s(0.0);
        for i in (0..len).rev() {
            let tk = job.start + first + i;
            // The first rows of the next span, which the loop above reads next.
            if let Some((next, at, state)) = span.next {
                if i < PREFETCH_AHEAD {
                    x.prefetch(next, next.start + at + i, Some(grad));
                }
                // Its saved state, a `len`-th per token: written a whole forward pass ago.
                prefetch(&state[piece(len - 1 - i, len, kv)]);
            }
            if i >= PREFETCH_AHEAD {
                out.prefetch_write(geo, job, tk - PREFETCH_AHEAD);
            }
            let (at, av) = (geo.at(job.b, tk, job.h, kd), geo.at(job.b, tk, job.h, vd));
            let t = &tokens[i];
            // SAFETY: this job's row, and no slice of `dv` is alive (see `GradIn`).
            dout.copy_from_slice(unsafe { grad.row(av, vd) });
            let rows = Rows {
                s_now: &states[(i + 1) * kv..(i + 2) * kv],
                s_prev: &states[i * kv..(i + 1) * kv],
                dout,
                u: &us[i * vd..(i + 1) * vd],
                e: &es[i * vd..(i + 1) * vd],
                t,
                beta: x.beta[geo.at_scalar(job.b, tk, job.h)],
            };
            // SAFETY (every `slice` below): token `tk` of row `job.b`, head `job.h` belongs to
            // this job alone.
            let dv = unsafe { out.dv.slice(av, vd) };
            sums.fill(zero);
            tail.fill(0.0);
            let dbeta = unsafe { out.dbeta.slice(geo.at_scalar(job.b, tk, job.h), 1) };
            dbeta[0] = backward_columns(simd, ds, &rows, sums, tail, dv);
            let dq = unsafe { out.dq.slice(at, kd) };
            let dk = unsafe { out.dk.slice(at, kd) };
            let dg = unsafe { out.dg.slice(at, kd) };
            for i2 in 0..kd {
                dq[i2] = simd.reduce_sum_f32s(sums.q[i2]) + tail.q[i2];
                dk[i2] = simd.reduce_sum_f32s(sums.k[i2]) + tail.k[i2];
                dg[i2] = simd.reduce_sum_f32s(sums.g[i2]) + tail.g[i2];
            }
            // Through the scale and the norms: q_s = scale · q / |q|, k_n = k / |k|.
            unprepare_gradient(dq, &t.q, t.q_norm, x.scale, x.l2norm);
            unprepare_gradient(dk, &t.k, t.k_norm, 1.0, x.l2norm);
        }
    }
}

impl KdaRecurrence {
    /// The backward pass: the output gradient's rows `[B, T, H, V]` read through `grad`, the
    /// final states' gradient (`[N, H, K, V]`, empty without `final_state`), `dv` written
    /// through `dv`; returns `dq`, `dk`, `dg`, `dβ` and `dS_0`.
    pub(super) fn backward_with(
        &self,
        inputs: &[HostArray; 6],
        saved: &Saved,
        grad: GradIn<'_>,
        state_grad: &[f32],
        dv: DisjointWrites<'_>,
    ) -> [HostArray; 5] {
        let [q, k, _, _, beta, h0] = inputs;
        let Pass { x, b, jobs, groups } = self.pass(inputs);
        let geo = x.geo;
        let Geometry { t, h, kd, vd } = geo;
        let kv = kd * vd;
        // Every token's rows of the input gradients are written once, by the job that owns them.
        let [mut dq, mut dk, mut dg, mut db] = [&q.shape, &k.shape, &q.shape, &beta.shape]
            .map(|shape| self.output(shape.iter().product(), t));
        let mut dh0 = HostArray::zeros(&h0.shape);
        let out = GradsOut {
            dq: DisjointWrites::fresh(&mut dq),
            dk: DisjointWrites::fresh(&mut dk),
            dv,
            dg: DisjointWrites::fresh(&mut dg),
            dbeta: DisjointWrites::fresh(&mut db),
        };
        let dh0_writes = DisjointWrites::new(&mut dh0.data);
        parallel_map_sized(groups.len(), 3 * b * t * h * kv, |gi| {
            let range = groups[gi].clone();
            let mut ds: Vec<Vec<f32>> = jobs[range.clone()]
                .iter()
                .map(|job| {
                    let at = geo.state(job.seq, job.h);
                    if self.final_state {
                        state_grad[at..at + kv].to_vec()
                    } else {
                        vec![0.0f32; kv]
                    }
                })
                .collect();
            dispatch(BackwardGroup {
                x: &x,
                jobs: &jobs[range.clone()],
                states: range.clone().map(|j| saved.job(j)).collect(),
                grad,
                ds: &mut ds,
                out: &out,
            });
            if self.initial_state {
                for (job, ds) in jobs[range].iter().zip(&ds) {
                    let at = geo.state(job.seq, job.h);
                    // SAFETY: the state of (sequence, head) belongs to this job alone.
                    unsafe { dh0_writes.slice(at, kv) }.copy_from_slice(ds);
                }
            }
        });
        let [dq, dk, dg, db] = [(dq, q), (dk, k), (dg, q), (db, beta)].map(|(d, x)| {
            HostArray {
                // SAFETY: the jobs took every token's row (or `output` zeroed it all).
                data: HostData::Owned(unsafe { d.into_vec() }),
                shape: x.shape.clone(),
            }
        });
        [dq, dk, dg, db, dh0]
    }
}
