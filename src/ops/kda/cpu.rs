//! The CPU kernel of KDA: the recurrence of design §4.1 as one loop nest on the host, forward and
//! backward, for the CPU backends (see [`crate::ops::backend::host`]).
//!
//! The recurrence is the ground truth of every KDA form, and on a CPU it is also the cheapest one:
//! per token and head it costs two passes over the `K × V` state forward and five backward (two of
//! them recomputing the states), all of them in the L1 cache, with no cumulative sum of gates
//! anywhere — each step multiplies by its own `exp(g_t) ≤ 1`, so the numerics of design §4.3 hold
//! trivially. Its time is linear in T. The forward pass keeps the state every [`CHECKPOINT`]
//! tokens; the backward pass recomputes the states of one such span at a time and walks it
//! backwards:
//!
//! ```text
//! forward:   S' = Diag(e^{g_t}) S;  p = S'ᵀk;  e = v − p;  u = β e;  S_t = S' + k uᵀ;  o = S_tᵀ q
//! backward:  dS += q doᵀ;  dq = S_t do;  du = dSᵀk;  dk = dS u;  dβ = du·e;  dv = β du;  dp = −β du
//!            dk += S' dp;  dS' = dS + k dpᵀ;  dg = rowsum(S' ⊙ dS');  dS ← Diag(e^{g_t}) dS'
//! ```
//!
//! Each thread runs a group of consecutive heads of one sequence, a block of tokens of each in turn
//! (forward [`INTERLEAVE`] tokens, backward one checkpoint span), so that the rows it reads from
//! the `[B, T, H, X]` inputs lie side by side instead of `H · X` floats apart (one head per thread
//! fetched the same lines once per head from main memory when the inputs outgrew the last-level
//! cache; BENCHMARKS, "The heads of a sequence together"). Besides the input rows of the token a
//! few steps ahead, a thread requests the output rows it will write then, for writing
//! ([`prefetch_write`]), and the saved state it reads or writes next a piece per token, so that
//! none of its stores or its first loads of a span wait on main memory at once (BENCHMARKS,
//! "Outputs requested for writing").
//!
//! The state starts at `S_0` (an input, zeros without one) and `S_T` can be returned as well; the
//! backward pass then starts from `dS_T` and ends with `dS_0`.
//!
//! With `l2norm`, `q` and `k` are normalised over the head dim first (`x / sqrt(Σx² + 1e-6)`, design
//! §4.2) and the backward pass goes through the norm: `dx = (dy − y (y·dy)) / r`.
//!
//! The loops over the state are compiled once per SIMD instruction set and chosen at run time
//! ([`crate::ops::backend::simd`]); results are the same bits on every CPU.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use std::ops::Range;

use crate::ops::backend::host::{
    parallel_map_sized, scratch, DisjointWrites, Fresh, HostArray, HostData, HostOp, Scratch,
};
use crate::ops::backend::simd::{
    dispatch, dot, exp_in_place, load, prefetch, prefetch_write, store, Scalar, Simd, WithSimd,
};

/// Tokens between two saved states: the backward pass recomputes `CHECKPOINT + 1` states of
/// `K × V` floats at a time, which at `K = V = 64` is 132 KiB and stays in the L2 cache.
const CHECKPOINT: usize = 32;

/// KDA over `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]` and the initial state
/// `[N, H, K, V]` → `o: [B, T, H, V]` followed by the final state `[N, H, K, V]` (with
/// `final_state`), flattened into one output; every row its own sequence (or packed sequences along
/// T with `B = 1`).
#[derive(Debug, Clone)]
pub(crate) struct KdaRecurrence {
    /// Multiplies `q` (after the norm).
    pub scale: f32,
    /// L2-normalise `q` and `k` over the head dim first.
    pub l2norm: bool,
    /// Packed sequences `(start, len)` along T (`B = 1`); `None`: every row is one sequence.
    pub seqs: Option<Vec<(usize, usize)>>,
    /// The sixth input is `S_0`; otherwise it is a placeholder and the state starts at zero.
    pub initial_state: bool,
    /// The output holds `S_T` after `o`.
    pub final_state: bool,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    t: usize,
    h: usize,
    kd: usize,
    vd: usize,
}

impl Geometry {
    /// Offset of token `t` of row `b`, head `h`, in a `[B, T, H, X]` buffer of width `x`.
    fn at(&self, b: usize, t: usize, h: usize, x: usize) -> usize {
        ((b * self.t + t) * self.h + h) * x
    }

    /// Offset of token `t` of row `b`, head `h`, in a `[B, T, H]` buffer.
    fn at_scalar(&self, b: usize, t: usize, h: usize) -> usize {
        (b * self.t + t) * self.h + h
    }

    /// Offset of the state of sequence `n`, head `h`, in a `[N, H, K, V]` buffer.
    fn state(&self, n: usize, h: usize) -> usize {
        (n * self.h + h) * self.kd * self.vd
    }
}

/// One independent recurrence: row `b`, head `h`, tokens `start..start + len`, state of sequence
/// `seq`.
#[derive(Debug, Clone, Copy)]
struct Job {
    b: usize,
    h: usize,
    seq: usize,
    start: usize,
    len: usize,
}

/// What the backward pass needs besides the inputs: the state before every [`CHECKPOINT`]-th
/// token of each job, job `j`'s from `starts[j]` on, in one buffer of the [`scratch`] pool (it
/// goes back there when the autodiff graph drops it: 16 MiB of fresh pages per call at T = 8192
/// otherwise).
#[derive(Debug)]
pub(crate) struct Saved {
    states: Scratch,
    starts: Vec<usize>,
}

impl Saved {
    /// The checkpoints of job `j`.
    fn job(&self, j: usize) -> &[f32] {
        let end = self.starts.get(j + 1).copied().unwrap_or(self.states.len());
        &self.states[self.starts[j]..end]
    }
}

/// The inputs every job reads, as given, and how `q` and `k` are prepared.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    scale: f32,
    l2norm: bool,
    geo: Geometry,
}

/// One token of a job as the recurrence uses it: `q` scaled (normalised first with `l2norm`),
/// `k` (normalised), `e^g`, and the norms `|q|`, `|k|` (1 without `l2norm`).
struct Prepared {
    q: Vec<f32>,
    k: Vec<f32>,
    decay: Vec<f32>,
    q_norm: f32,
    k_norm: f32,
}

impl Prepared {
    fn new(kd: usize) -> Self {
        Self {
            q: vec![0.0; kd],
            k: vec![0.0; kd],
            decay: vec![0.0; kd],
            q_norm: 1.0,
            k_norm: 1.0,
        }
    }
}

impl Inputs<'_> {
    /// `(v, β)` of token `tk` of the job; fills `p` with its prepared `q`, `k`, `e^g`.
    #[inline(always)]
    fn token(&self, job: &Job, tk: usize, p: &mut Prepared) -> (&[f32], f32) {
        let Geometry { kd, vd, .. } = self.geo;
        let at = self.geo.at(job.b, tk, job.h, kd);
        let av = self.geo.at(job.b, tk, job.h, vd);
        p.q_norm = prepare_vector(&self.q[at..at + kd], &mut p.q, self.scale, self.l2norm);
        p.k_norm = prepare_vector(&self.k[at..at + kd], &mut p.k, 1.0, self.l2norm);
        p.decay.copy_from_slice(&self.g[at..at + kd]);
        exp_in_place(&mut p.decay);
        (
            &self.v[av..av + vd],
            self.beta[self.geo.at_scalar(job.b, tk, job.h)],
        )
    }

    /// Prefetches the job's input rows of token `tk` (see [`prefetch`]) and, when given, its row
    /// of the `[B, T, H, V]` output gradient.
    #[inline(always)]
    fn prefetch(&self, job: &Job, tk: usize, grad: Option<GradIn<'_>>) {
        let Geometry { kd, vd, .. } = self.geo;
        let at = self.geo.at(job.b, tk, job.h, kd);
        let av = self.geo.at(job.b, tk, job.h, vd);
        prefetch(&self.q[at..at + kd]);
        prefetch(&self.k[at..at + kd]);
        prefetch(&self.g[at..at + kd]);
        prefetch(&self.v[av..av + vd]);
        if let Some(grad) = grad {
            // SAFETY: the job's own row, which no slice alive now covers (see `GradIn`).
            prefetch(unsafe { grad.row(av, vd) });
        }
    }
}

/// Tokens ahead of the one in work whose rows [`Inputs::prefetch`] requests.
const PREFETCH_AHEAD: usize = 4;

/// Tokens of one job a [`ForwardGroup`] runs before the next job of the group takes over; at
/// least [`PREFETCH_AHEAD`].
const INTERLEAVE: usize = 16;

/// The most state (`K × V` floats per job) one group of jobs cycles through: half the L2 cache of
/// the smaller server cores.
const GROUP_STATE_BYTES: usize = 512 << 10;

/// `out = scale · x / |x|` with `l2norm` (`|x| = sqrt(Σx² + 1e-6)`, returned), `scale · x`
/// otherwise (returns 1).
#[inline(always)]
fn prepare_vector(x: &[f32], out: &mut [f32], scale: f32, l2norm: bool) -> f32 {
    let r = if l2norm {
        (dot(x, x) + 1e-6).sqrt()
    } else {
        1.0
    };
    let s = if l2norm { scale / r } else { scale };
    for (o, a) in out.iter_mut().zip(x) {
        *o = a * s;
    }
    r
}

/// Turns the gradient `d` of `y = scale · x / r` (`y` given) into the gradient of `x`, in place
/// (`y = scale · x` without `l2norm`).
#[inline(always)]
fn unprepare_gradient(d: &mut [f32], y: &[f32], r: f32, scale: f32, l2norm: bool) {
    if !l2norm {
        d.iter_mut().for_each(|a| *a *= scale);
        return;
    }
    // With n = x / r and y = scale · n: dn = scale · dy, dx = (dn − n (n·dn)) / r.
    let dot = dot(d, y) / scale;
    for (a, yy) in d.iter_mut().zip(y) {
        *a = (scale * *a - yy * dot) / r;
    }
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
            for (i, &(start, len)) in spans.iter().enumerate() {
                for head in 0..h {
                    jobs.push(Job {
                        b: row,
                        h: head,
                        seq: if self.seqs.is_some() { i } else { row },
                        start,
                        len,
                    });
                }
            }
        }
        jobs
    }

    /// The jobs in groups that one thread runs together, [`INTERLEAVE`] tokens of each job in
    /// turn: consecutive heads of one sequence, so that the rows a group reads from the
    /// `[B, T, H, X]` inputs (and writes to the outputs) lie side by side. One head at a time reads
    /// `X` floats of every `H · X`: once the tensors outgrow the last-level cache, the lines of the
    /// other heads are fetched again when their turn comes. As many groups as the pool has threads
    /// (the heads of a sequence split evenly), at most [`GROUP_STATE_BYTES`] of states per group,
    /// and one job per group for packed sequences, whose lengths differ (fewer, larger groups
    /// would balance worse).
    fn groups(&self, jobs: &[Job], h: usize, kv: usize) -> Vec<Range<usize>> {
        let size = if self.seqs.is_some() {
            1
        } else {
            let sequences = jobs.len() / h;
            let threads = rayon::current_num_threads().max(1);
            (h * sequences / threads)
                .min(GROUP_STATE_BYTES / (4 * kv).max(1))
                .clamp(1, h)
        };
        // Groups never cross a sequence: the heads of one come in order, `h` jobs per sequence.
        let mut groups = Vec::with_capacity(jobs.len().div_ceil(size));
        for first in (0..jobs.len()).step_by(h) {
            let mut lo = first;
            while lo < first + h {
                let hi = (lo + size).min(first + h);
                groups.push(lo..hi);
                lo = hi;
            }
        }
        groups
    }

    /// The shape `[B, T, H, V]` of `o`.
    fn output_shape(&self, inputs: &[HostArray; 6]) -> [usize; 4] {
        let (q, v) = (&inputs[0].shape, &inputs[2].shape);
        [q[0], q[1], q[2], v[3]]
    }

    /// The sizes of the output `o` and of the final states (0 without `final_state`).
    fn output_sizes(&self, inputs: &[HostArray; 6]) -> (usize, usize) {
        let (q, v) = (&inputs[0].shape, &inputs[2].shape);
        let (b, h, kd, vd) = (q[0], q[2], q[3], v[3]);
        let n_s = if self.final_state {
            self.sequences(b) * h * kd * vd
        } else {
            0
        };
        (b * q[1] * h * vd, n_s)
    }

    /// A new output of `len` floats for rows `[B, T, H, X]` that the jobs write once each: every
    /// row is zeroed as a job takes it ([`Fresh`]), unless packed sequences leave tokens to no
    /// job, when all of it is zeroed first.
    fn output(&self, len: usize, t: usize) -> Fresh {
        let mut out = Fresh::new(len);
        if !self.tiled(t) {
            out.zero_all();
        }
        out
    }

    /// Whether the jobs cover every token of a row of `t` (always, unless packed sequences
    /// leave gaps).
    fn tiled(&self, t: usize) -> bool {
        self.seqs.as_ref().is_none_or(|spans| {
            let mut end = 0;
            spans.iter().all(|&(start, len)| {
                let next = start == end;
                end = start + len;
                next
            }) && end == t
        })
    }

    /// The forward pass: `o` (`[B, T, H, V]`, each row taken once from `o`) and, with
    /// `final_state`, the final states into `s_out` (`[N, H, K, V]`), where each job's state is
    /// updated in place: `s_out` holds the initial states on entry (zeros without
    /// `initial_state`). With `save` the checkpoints of the backward pass.
    fn forward_into(
        &self,
        inputs: &[HostArray; 6],
        save: bool,
        o_writes: &DisjointWrites<'_>,
        s_out: &mut [f32],
    ) -> Option<Saved> {
        let [q, _, v, _, _, h0] = inputs;
        let &[b, t, h, kd] = q.shape.as_slice() else {
            unreachable!("q is [B, T, H, K]")
        };
        let vd = v.shape[3];
        let x = self.inputs(inputs, Geometry { t, h, kd, vd });
        let geo = x.geo;
        let jobs = self.jobs(b, t, h);
        let kv = kd * vd;
        let s_writes = DisjointWrites::new(s_out);
        // Job j's checkpoints from starts[j] on, one state per CHECKPOINT tokens.
        let mut starts = Vec::with_capacity(jobs.len());
        let mut total = 0;
        for job in &jobs {
            starts.push(total);
            total += if save {
                job.len.div_ceil(CHECKPOINT) * kv
            } else {
                0
            };
        }
        let mut states = scratch(total);
        let state_writes = DisjointWrites::new(&mut states);
        let groups = self.groups(&jobs, h, kv);
        parallel_map_sized(groups.len(), b * t * h * kv, |gi| {
            let range = groups[gi].clone();
            // Without final states to write, each job runs on a state of its own.
            let mut own: Vec<Vec<f32>> = match (self.final_state, self.initial_state) {
                (true, _) => Vec::new(),
                (false, true) => jobs[range.clone()]
                    .iter()
                    .map(|job| {
                        let at = geo.state(job.seq, job.h);
                        h0.data[at..at + kv].to_vec()
                    })
                    .collect(),
                (false, false) => vec![vec![0.0; kv]; range.len()],
            };
            let s: Vec<&mut [f32]> = if self.final_state {
                jobs[range.clone()]
                    .iter()
                    // SAFETY: the state of (sequence, head) belongs to this job alone.
                    .map(|job| unsafe { s_writes.slice(geo.state(job.seq, job.h), kv) })
                    .collect()
            } else {
                own.iter_mut().map(|s| &mut s[..]).collect()
            };
            let checkpoints = range
                .clone()
                .map(|j| {
                    let end = starts.get(j + 1).copied().unwrap_or(total);
                    // SAFETY: job j's checkpoints are its own.
                    unsafe { state_writes.slice(starts[j], end - starts[j]) }
                })
                .collect();
            dispatch(ForwardGroup {
                x: &x,
                jobs: &jobs[range],
                s,
                out: o_writes,
                states: checkpoints,
                save,
            });
        });
        save.then_some(Saved { states, starts })
    }

    /// The inputs as the jobs read them.
    fn inputs<'a>(&self, inputs: &'a [HostArray; 6], geo: Geometry) -> Inputs<'a> {
        let [q, k, v, g, beta, _] = inputs;
        Inputs {
            q: &q.data,
            k: &k.data,
            v: &v.data,
            g: &g.data,
            beta: &beta.data,
            scale: self.scale,
            l2norm: self.l2norm,
            geo,
        }
    }

    /// The number of sequences `N` of the states.
    fn sequences(&self, b: usize) -> usize {
        self.seqs.as_ref().map_or(b, Vec::len)
    }
}

/// One forward step on the `N` blocks of `S`'s lanes of the state `s [K, V]` that start at column
/// `j`, from `S_{t−1}` in `prev` (or in `s` itself when `None`): writes those columns of
/// `e = v − p`, `u = β e` and `o`, and leaves them of `S_t` in `s`.
///
/// Every column is independent (`u` of a column needs only that column of `p`), so each block of
/// columns makes both passes over the `K` rows with its accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn step_block<S: Simd, const N: usize>(
    simd: S,
    j: usize,
    s: &mut [f32],
    prev: Option<&[f32]>,
    t: &Prepared,
    v: &[f32],
    beta: f32,
    e: &mut [f32],
    u: &mut [f32],
    o: &mut [f32],
) {
    let (vd, lanes) = (v.len(), S::F32_LANES);
    let w = N * lanes;
    let zero = simd.splat_f32s(0.0);
    let mut p = [zero; N];
    // `p = S'ᵀk = Sᵀ(e^g ⊙ k)`: `S' = Diag(e^g) S` is neither formed nor stored here. The second
    // pass forms each row of it in registers, which costs one product per lane instead of a store
    // and a load of every row (BENCHMARKS, "Half the stores of a forward step").
    for (i, (&a, &k)) in t.decay.iter().zip(&t.k).enumerate() {
        let at = i * vd + j;
        let src = &prev.unwrap_or(s)[at..at + w];
        let ak = simd.splat_f32s(a * k);
        for n in 0..N {
            p[n] = simd.mul_add_e_f32s(ak, load::<S>(&src[n * lanes..]), p[n]);
        }
    }
    let beta = simd.splat_f32s(beta);
    let mut uj = [zero; N];
    for n in 0..N {
        let c = j + n * lanes;
        let ej = simd.sub_f32s(load::<S>(&v[c..]), p[n]);
        uj[n] = simd.mul_f32s(beta, ej);
        store::<S>(&mut e[c..], ej);
        store::<S>(&mut u[c..], uj[n]);
    }
    let mut oj = [zero; N];
    for (i, ((&a, &k), &q)) in t.decay.iter().zip(&t.k).zip(&t.q).enumerate() {
        let at = i * vd + j;
        let src = &prev.unwrap_or(s)[at..at + w];
        let mut x = [zero; N];
        for n in 0..N {
            x[n] = load::<S>(&src[n * lanes..]);
        }
        let (a, k, q) = (simd.splat_f32s(a), simd.splat_f32s(k), simd.splat_f32s(q));
        let row = &mut s[at..at + w];
        for n in 0..N {
            let y = simd.mul_add_e_f32s(k, uj[n], simd.mul_f32s(a, x[n]));
            store::<S>(&mut row[n * lanes..], y);
            oj[n] = simd.mul_add_e_f32s(q, y, oj[n]);
        }
    }
    for n in 0..N {
        store::<S>(&mut o[j + n * lanes..], oj[n]);
    }
}

/// The widest blocks of columns of a row of `V` floats: `(start, blocks of 4 · lanes, blocks of
/// lanes, single columns)` as column ranges, so that each loop below takes its block size.
#[inline(always)]
fn column_blocks(vd: usize, lanes: usize) -> [Range<usize>; 3] {
    let wide = vd / (4 * lanes) * 4 * lanes;
    let narrow = wide + (vd - wide) / lanes * lanes;
    [0..wide, wide..narrow, narrow..vd]
}

/// One forward step on the state `s [K, V]`, from `S_{t−1}` in `prev` (or in `s` itself when
/// `None`); writes `e = v − p`, `u = β e` and `o`, leaves `S_t` in `s`. Columns go in blocks of
/// four registers, then one register, then one at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn step<S: Simd>(
    simd: S,
    s: &mut [f32],
    prev: Option<&[f32]>,
    t: &Prepared,
    v: &[f32],
    beta: f32,
    e: &mut [f32],
    u: &mut [f32],
    o: &mut [f32],
) {
    let lanes = S::F32_LANES;
    let [wide, narrow, single] = column_blocks(v.len(), lanes);
    for j in wide.step_by(4 * lanes) {
        step_block::<S, 4>(simd, j, s, prev, t, v, beta, e, u, o);
    }
    for j in narrow.step_by(lanes) {
        step_block::<S, 1>(simd, j, s, prev, t, v, beta, e, u, o);
    }
    for j in single {
        step_block::<Scalar, 1>(Scalar, j, s, prev, t, v, beta, e, u, o);
    }
}

/// The forward recurrence of a group of jobs of the same length (see [`KdaRecurrence::groups`]),
/// [`INTERLEAVE`] tokens of each in turn, each from its state in `s` (left holding `S_T`): `o` per
/// token into `out` (`[B, T, H, V]`), and with `save` the state before every [`CHECKPOINT`]-th
/// token into the job's `states`, one after the other.
struct ForwardGroup<'a> {
    x: &'a Inputs<'a>,
    jobs: &'a [Job],
    s: Vec<&'a mut [f32]>,
    out: &'a DisjointWrites<'a>,
    states: Vec<&'a mut [f32]>,
    save: bool,
}

impl WithSimd for ForwardGroup<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Self {
            x,
            jobs,
            mut s,
            out,
            mut states,
            save,
        } = self;
        let vd = x.geo.vd;
        let len = jobs.first().map_or(0, |job| job.len);
        let mut t = Prepared::new(x.geo.kd);
        let (mut e, mut u) = (vec![0.0f32; vd], vec![0.0f32; vd]);
        for lo in (0..len).step_by(INTERLEAVE) {
            let hi = (lo + INTERLEAVE).min(len);
            for (g, job) in jobs.iter().enumerate() {
                let (s, states) = (&mut *s[g], &mut *states[g]);
                for i in lo..hi {
                    if save && i % CHECKPOINT == 0 {
                        let at = i / CHECKPOINT * s.len();
                        states[at..at + s.len()].copy_from_slice(s);
                    }
                    if save {
                        // The next checkpoint's lines, a CHECKPOINT-th of them per token, so that
                        // its copy does not wait on them all at once.
                        let slot = (i / CHECKPOINT + 1) * s.len();
                        let lines = piece(i % CHECKPOINT, CHECKPOINT, s.len());
                        if let Some(next) = states.get(slot..).and_then(|rest| rest.get(lines)) {
                            prefetch_write(next.as_ptr(), next.len());
                        }
                    }
                    if let Some((g2, i2)) = ahead(jobs.len(), len, lo, hi, g, i) {
                        let (job2, tk2) = (&jobs[g2], jobs[g2].start + i2);
                        x.prefetch(job2, tk2, None);
                        out.prefetch_write(x.geo.at(job2.b, tk2, job2.h, vd), vd);
                    }
                    let tk = job.start + i;
                    let (v, beta) = x.token(job, tk, &mut t);
                    // SAFETY: token `tk` of row `job.b`, head `job.h` belongs to this job alone.
                    let o = unsafe { out.slice(x.geo.at(job.b, tk, job.h, vd), vd) };
                    step(simd, s, None, &t, v, beta, &mut e, &mut u, o);
                }
            }
        }
    }
}

/// The job (index in its group) and token that a group of `n` jobs of `len` tokens works on
/// [`PREFETCH_AHEAD`] tokens after token `i` of job `g` in the block `lo..hi`, in the order of
/// [`ForwardGroup`]: the block's tokens of each job in turn, then the next block. `None` past the
/// end.
#[inline(always)]
fn ahead(
    n: usize,
    len: usize,
    mut lo: usize,
    mut hi: usize,
    mut g: usize,
    mut i: usize,
) -> Option<(usize, usize)> {
    let mut left = PREFETCH_AHEAD;
    loop {
        // Tokens after `i` in this job's part of the block.
        let room = hi - 1 - i;
        if left <= room {
            return Some((g, i + left));
        }
        // On to the first token of the next job's part, or of the next block.
        left -= room + 1;
        if g + 1 < n {
            g += 1;
        } else {
            (g, lo) = (0, hi);
            if lo >= len {
                return None;
            }
            hi = (lo + INTERLEAVE).min(len);
        }
        i = lo;
    }
}

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
/// one row at a time, because `dv` may be written over it ([`KdaRecurrence::backward_owned`]), and
/// a shared borrow of the whole buffer would then alias those writes. Each job reads and writes
/// only its own rows, and a step copies its row of `do` before it writes that row of `dv`.
#[derive(Clone, Copy)]
struct GradIn<'a> {
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
    fn shared(grad: &'a [f32]) -> Self {
        Self {
            ptr: grad.as_ptr(),
            len: grad.len(),
            _buffer: std::marker::PhantomData,
        }
    }

    /// Rows that `dv` is written over, through `dv`'s own pointer.
    fn under(dv: &DisjointWrites<'a>, len: usize) -> Self {
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
    unsafe fn row(&self, at: usize, len: usize) -> &'a [f32] {
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

/// Piece `k` of `0..len` cut into `of` nearly equal pieces (empty from `k = of` on): what a loop
/// of `of` steps requests per step of a buffer it reads or writes in full afterwards, so that the
/// requests are spread instead of all waiting at once.
#[inline(always)]
fn piece(k: usize, of: usize, len: usize) -> Range<usize> {
    let size = len.div_ceil(of.max(1));
    let start = (k * size).min(len);
    start..(start + size).min(len)
}

/// The span that a [`BackwardGroup`] of `n` jobs takes after span `c` of job `g`, as `(job,
/// span)`: the same span of the next job, or the span before of the first job; `None` after the
/// last.
#[inline(always)]
fn next_span(n: usize, g: usize, c: usize) -> Option<(usize, usize)> {
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

impl HostOp<6> for KdaRecurrence {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; 6], save: bool) -> (HostArray, Option<Saved>) {
        let (n_o, n_s) = self.output_sizes(inputs);
        let mut out = self.output(n_o + n_s, inputs[0].shape[1]);
        let writes = DisjointWrites::fresh(&mut out);
        // SAFETY: the states follow the `n_o` floats of `o`, whose rows are all the jobs take.
        let s = unsafe { writes.slice(n_o, n_s) };
        if self.final_state && self.initial_state {
            s.copy_from_slice(&inputs[5].data);
        }
        let saved = self.forward_into(inputs, save, &writes, s);
        // `o` alone keeps its shape (a reshape is a copy on ndarray); with the final states the
        // two are one flat output.
        let shape = if self.final_state {
            vec![n_o + n_s]
        } else {
            self.output_shape(inputs).to_vec()
        };
        // SAFETY: the jobs took every row of `o` (or `output` zeroed it all), and `s` the rest.
        let data = unsafe { out.into_vec() };
        (
            HostArray {
                data: HostData::Owned(data),
                shape,
            },
            saved,
        )
    }

    /// `o` and, with `final_state`, the final states. An initial state that nothing else holds
    /// (a decode loop's, handed over) is updated in place and becomes the final state: no new
    /// buffer, no copy. Otherwise the final states are a new buffer starting as a copy of it.
    fn forward_parts(&self, mut inputs: [HostArray; 6]) -> Vec<HostArray> {
        let (q, v) = (&inputs[0].shape, &inputs[2].shape);
        let shape = vec![self.sequences(q[0]), q[2], q[3], v[3]];
        let o_shape = self.output_shape(&inputs);
        let mut o = self.output(o_shape.iter().product(), o_shape[1]);
        let o_writes = DisjointWrites::fresh(&mut o);
        let o_array = |o: Fresh| HostArray {
            // SAFETY: the jobs took every row of `o` (or `output` zeroed it all).
            data: HostData::Owned(unsafe { o.into_vec() }),
            shape: o_shape.to_vec(),
        };
        if !self.final_state {
            self.forward_into(&inputs, false, &o_writes, &mut []);
            return vec![o_array(o)];
        }
        let mut s = if !self.initial_state {
            HostArray::zeros(&shape)
        } else if inputs[5].shape == shape && inputs[5].data.unique_mut().is_some() {
            // Moved out, so that `inputs` no longer holds the buffer the op writes.
            std::mem::replace(&mut inputs[5], HostArray::zeros(&[0]))
        } else {
            HostArray {
                data: HostData::Owned(inputs[5].data.to_vec()),
                shape,
            }
        };
        let s_out = s
            .data
            .unique_mut()
            .unwrap_or_else(|| unreachable!("owned, or checked unique above"));
        self.forward_into(&inputs, false, &o_writes, s_out);
        vec![o_array(o), s]
    }

    fn backward(&self, inputs: &[HostArray; 6], saved: &Saved, grad: &HostArray) -> [HostArray; 6] {
        let v = &inputs[2];
        let n_o = v.shape.iter().product();
        let mut dv = self.output(n_o, v.shape[1]);
        let (rows, state_grad) = grad.data.split_at(n_o);
        let [dq, dk, dg, db, dh0] = self.backward_with(
            inputs,
            saved,
            GradIn::shared(rows),
            state_grad,
            DisjointWrites::fresh(&mut dv),
        );
        let dv = HostArray {
            // SAFETY: the jobs took every token's row (or `output` zeroed it all).
            data: HostData::Owned(unsafe { dv.into_vec() }),
            shape: v.shape.clone(),
        };
        [dq, dk, dv, dg, db, dh0]
    }

    /// [`backward`](HostOp::backward), with `dv` written over the output gradient when nothing
    /// else holds it: one new buffer of `[B, T, H, V]` less per call (at T = 8192 in the `kda`
    /// bench, 8 MiB of pages that glibc had handed back to the kernel, which zeroes them again).
    /// Each step copies its row of the output gradient before it writes that row of `dv`, so
    /// the result is the same bit for bit. Not with `final_state` (the gradient then holds the
    /// final states' too), nor with packed sequences that leave tokens to no job (their rows of
    /// `dv` must be zeros).
    fn backward_owned(
        &self,
        inputs: &[HostArray; 6],
        saved: &Saved,
        mut grad: HostArray,
    ) -> [HostArray; 6] {
        let v_shape = inputs[2].shape.clone();
        let n_o = v_shape.iter().product::<usize>();
        let in_place = !self.final_state
            && grad.shape == v_shape
            && self.tiled(v_shape[1])
            && grad.data.unique_mut().is_some();
        if !in_place {
            return self.backward(inputs, saved, &grad);
        }
        let buffer = grad
            .data
            .unique_mut()
            .unwrap_or_else(|| unreachable!("checked unique above"));
        let dv = DisjointWrites::new(buffer);
        let rows = GradIn::under(&dv, n_o);
        let [dq, dk, dg, db, dh0] = self.backward_with(inputs, saved, rows, &[], dv);
        let dv = HostArray {
            data: grad.data,
            shape: v_shape,
        };
        [dq, dk, dv, dg, db, dh0]
    }
}

impl KdaRecurrence {
    /// The backward pass: the output gradient's rows `[B, T, H, V]` read through `grad`, the
    /// final states' gradient (`[N, H, K, V]`, empty without `final_state`), `dv` written
    /// through `dv`; returns `dq`, `dk`, `dg`, `dβ` and `dS_0`.
    fn backward_with(
        &self,
        inputs: &[HostArray; 6],
        saved: &Saved,
        grad: GradIn<'_>,
        state_grad: &[f32],
        dv: DisjointWrites<'_>,
    ) -> [HostArray; 5] {
        let [q, k, v, _, beta, h0] = inputs;
        let &[b, t, h, kd] = q.shape.as_slice() else {
            unreachable!("q is [B, T, H, K]")
        };
        let vd = v.shape[3];
        let x = self.inputs(inputs, Geometry { t, h, kd, vd });
        let geo = x.geo;
        let jobs = self.jobs(b, t, h);
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
        let groups = self.groups(&jobs, h, kv);
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

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{backend::Backend, Distribution, Tensor};

    use crate::ops::kda::{cpu_kda, host_kernel_applies, naive_recurrent_kda, KdaOptions};

    type B = Autodiff<NdArray<f32>>;

    struct Case {
        dims: [usize; 5],
        l2norm: bool,
        scale: Option<f64>,
        seqs: Option<Vec<usize>>,
        extreme: bool,
        /// An initial state (with its gradient) and the final state in the loss.
        state: bool,
    }

    impl Case {
        fn new(dims: [usize; 5]) -> Self {
            Self {
                dims,
                l2norm: true,
                scale: None,
                seqs: None,
                extreme: false,
                state: false,
            }
        }
    }

    fn host<const D: usize>(x: Tensor<B, D>) -> Vec<f32> {
        x.into_data().to_vec().expect("f32")
    }

    fn grad<const D: usize>(
        x: &Tensor<B, D>,
        grads: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Vec<f32> {
        x.grad(grads)
            .expect("gradient")
            .into_data()
            .to_vec()
            .expect("f32")
    }

    /// The random inputs of a case (q, k, v, g, β, S_0) and the output and state gradients
    /// (`dO`, `dS_T`) that the loss projects onto.
    struct Draw {
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        g: Tensor<B, 4>,
        beta: Tensor<B, 3>,
        h0: Tensor<B, 4>,
        d_o: Tensor<B, 4>,
        d_s: Tensor<B, 4>,
    }

    fn draw(case: &Case) -> Draw {
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
        let n = case.seqs.as_ref().map_or(b, |cu| cu.len() - 1);
        let (h0, d_o, d_s) = (
            normal([n, h, kd, vd]),
            normal([b, t, h, vd]),
            normal([n, h, kd, vd]),
        );
        Draw {
            q,
            k,
            v,
            g,
            beta,
            h0,
            d_o,
            d_s,
        }
    }

    /// The output (and final state) of KDA on the drawn inputs and the gradients of the drawn
    /// projection of them, from the host kernel or from the naive recurrence's autodiff.
    fn outputs(case: &Case, x: &Draw, host_kernel: bool) -> Vec<Vec<f32>> {
        let seqs: Option<Vec<(usize, usize)>> = case
            .seqs
            .as_ref()
            .map(|cu| cu.windows(2).map(|w| (w[0], w[1] - w[0])).collect());
        let Draw {
            q,
            k,
            v,
            g,
            beta,
            h0,
            d_o,
            d_s,
        } = x;
        let (q, k, v, g, beta, h0) = (
            q.clone().require_grad(),
            k.clone().require_grad(),
            v.clone().require_grad(),
            g.clone().require_grad(),
            beta.clone().require_grad(),
            h0.clone().require_grad(),
        );
        let mut opts = KdaOptions::default().with_qk_l2norm(case.l2norm);
        opts.scale = case.scale;
        opts.cu_seqlens = case.seqs.clone();
        if case.state {
            opts = opts.with_initial_state(h0.clone()).with_final_state(true);
        }
        let (o, s) = if host_kernel {
            assert!(host_kernel_applies(&q, &k, &v, &g, &beta, &opts));
            cpu_kda(&q, &k, &v, &g, &beta, opts, seqs.clone())
        } else {
            naive_recurrent_kda(
                q.clone(),
                k.clone(),
                v.clone(),
                g.clone(),
                beta.clone(),
                opts,
            )
        };
        assert_eq!(s.is_some(), case.state, "a final state exactly when asked");
        let mut loss = o.clone().mul(d_o.clone()).sum();
        let mut out = vec![host(o)];
        if let Some(s) = s {
            loss = loss.add(s.clone().mul(d_s.clone()).sum());
            out.push(host(s));
        }
        let grads = loss.backward();
        out.extend([
            grad(&q, &grads),
            grad(&k, &grads),
            grad(&v, &grads),
            grad(&g, &grads),
            grad(&beta, &grads),
        ]);
        if case.state {
            out.push(grad(&h0, &grads));
        }
        out
    }

    /// Output, final state and the gradients of q, k, v, g, β, S_0 against the naive recurrence's
    /// autodiff.
    fn check(case: Case) {
        let x = draw(&case);
        let (want, got) = (outputs(&case, &x, false), outputs(&case, &x, true));
        let names: &[&str] = if case.state {
            &["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS_0"]
        } else {
            &["o", "dq", "dk", "dv", "dg", "dbeta"]
        };
        assert_eq!(want.len(), names.len());
        for (name, (w, g)) in names.iter().zip(want.iter().zip(&got)) {
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
        check(Case::new([2, 150, 2, 8, 5]));
        check(Case {
            l2norm: false,
            scale: Some(0.3),
            ..Case::new([1, 70, 1, 6, 4])
        });
        check(Case {
            scale: Some(2.0),
            extreme: true,
            ..Case::new([1, 40, 2, 4, 4])
        });
        // Widths that fill the SIMD lane blocks, with and without a remainder.
        check(Case::new([1, 45, 2, 32, 16]));
        check(Case::new([1, 20, 1, 16, 37]));
    }

    #[test]
    fn initial_and_final_states_and_their_gradients() {
        check(Case {
            state: true,
            ..Case::new([2, 70, 2, 8, 16])
        });
        check(Case {
            state: true,
            l2norm: false,
            extreme: true,
            ..Case::new([1, 1, 3, 16, 5])
        });
    }

    #[test]
    fn tokens_of_no_sequence_get_zero_outputs_and_gradients() {
        use crate::ops::backend::host::{HostArray, HostData, HostOp};
        // T = 6, B = H = 1, K = V = 3; the packed spans leave tokens 0 and 5 to no sequence.
        let (t, kd) = (6, 3);
        let array = |shape: Vec<usize>, seed: usize, f: fn(f32) -> f32| {
            let n = shape.iter().product();
            let data = (0..n)
                .map(|i| f(((i * 7 + seed) % 11) as f32 * 0.1 - 0.5))
                .collect();
            HostArray {
                data: HostData::Owned(data),
                shape,
            }
        };
        let row = vec![1, t, 1, kd];
        let same = |x: f32| x;
        let inputs = [
            array(row.clone(), 1, same),
            array(row.clone(), 2, same),
            array(row.clone(), 3, same),
            array(row.clone(), 4, |g| -g.abs()),
            array(vec![1, t, 1], 5, f32::abs),
            array(vec![1, 1, kd, kd], 6, same),
        ];
        let op = super::KdaRecurrence {
            scale: 0.5,
            l2norm: true,
            seqs: Some(vec![(1, 2), (3, 2)]),
            initial_state: false,
            final_state: false,
        };
        // In tests a `Fresh` output starts full of NaN, so a row that nothing writes would show.
        let (o, saved) = op.forward(&inputs, true);
        let rows = |x: &HostArray, w: usize| -> Vec<Vec<f32>> {
            x.data.chunks(w).map(<[f32]>::to_vec).collect()
        };
        let o_rows = rows(&o, kd);
        for (tk, r) in o_rows.iter().enumerate() {
            let outside = tk == 0 || tk == t - 1;
            assert_eq!(r.iter().all(|&x| x == 0.0), outside, "o row {tk}: {r:?}");
        }
        let grads = op.backward(&inputs, &saved.expect("saved"), &array(row, 7, same));
        for (i, d) in grads[..5].iter().enumerate() {
            let w = if i == 4 { 1 } else { kd };
            for (tk, r) in rows(d, w).iter().enumerate() {
                let outside = tk == 0 || tk == t - 1;
                assert!(
                    r.iter().all(|x| x.is_finite()),
                    "gradient {i} row {tk}: {r:?}"
                );
                if outside {
                    assert!(r.iter().all(|&x| x == 0.0), "gradient {i} row {tk}: {r:?}");
                }
            }
        }
    }

    /// With an output gradient that nothing else holds, `dv` is written over it (the same
    /// buffer) and every gradient has the bits of the backward that reads a shared output
    /// gradient; with the final states in the loss, or with tokens of no sequence, the backward
    /// leaves the output gradient alone.
    #[test]
    fn the_value_gradient_is_written_over_an_output_gradient_nothing_else_holds() {
        use crate::ops::backend::host::{HostArray, HostData, HostOp};
        // V = 21: blocks of 4 and 1 registers and single columns on every instruction set.
        let [b, t, h, kd, vd] = [2, 37, 3, 16, 21];
        let array = |shape: Vec<usize>, seed: u64, f: fn(f32) -> f32| {
            let n = shape.iter().product();
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let data = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    f((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
                })
                .collect();
            HostArray {
                data: HostData::Owned(data),
                shape,
            }
        };
        let same = |x: f32| x;
        // Packed sequences take one row (B = 1) and have a state each.
        for (final_state, seqs, in_place) in [
            (false, None, true),
            (true, None, false),
            (false, Some(vec![(0, 30), (30, 7)]), true),
            (false, Some(vec![(1, 30)]), false),
        ] {
            let (b, n) = match &seqs {
                Some(spans) => (1, spans.len()),
                None => (b, b),
            };
            let inputs = [
                array(vec![b, t, h, kd], 1, same),
                array(vec![b, t, h, kd], 2, same),
                array(vec![b, t, h, vd], 3, same),
                array(vec![b, t, h, kd], 4, |g| -g.abs()),
                array(vec![b, t, h], 5, f32::abs),
                array(vec![n, h, kd, vd], 6, same),
            ];
            let op = super::KdaRecurrence {
                scale: 0.25,
                l2norm: true,
                seqs: seqs.clone(),
                initial_state: true,
                final_state,
            };
            let (o, saved) = op.forward(&inputs, true);
            let saved = saved.expect("saved");
            let grad = array(o.shape.clone(), 7, same);
            let want = op.backward(&inputs, &saved, &grad);
            let owned = grad.clone();
            let at = owned.data.as_ptr();
            let got = op.backward_owned(&inputs, &saved, owned);
            let case = format!("final_state {final_state}, sequences {seqs:?}");
            assert_eq!(got[2].data.as_ptr() == at, in_place, "{case}: dv in place");
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert_eq!(w.shape, g.shape, "{case}: gradient {i}");
                let bits = |x: &HostArray| x.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(w), bits(g), "{case}: gradient {i}");
            }
        }
    }

    #[test]
    fn packed_sequences_restart_the_state() {
        check(Case {
            seqs: Some(vec![0, 1, 65, 130, 140]),
            ..Case::new([1, 140, 2, 4, 3])
        });
        check(Case {
            seqs: Some(vec![0, 33, 40]),
            state: true,
            ..Case::new([1, 40, 2, 16, 16])
        });
    }

    /// The buffer of an ndarray `f32` tensor, for telling whether an op wrote in place.
    /// Runs `f` on a rayon pool of `threads` threads: the groups of heads that run together are
    /// sized by the pool ([`super::KdaRecurrence::groups`]), so each size is a different walk.
    fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool")
            .install(f)
    }

    #[test]
    fn heads_run_in_groups_of_any_size_as_one_at_a_time() {
        // One thread: all four heads of a sequence in one group; three: groups of two.
        for threads in [1, 3] {
            in_pool(threads, || {
                check(Case::new([2, 150, 4, 8, 5]));
                check(Case {
                    state: true,
                    ..Case::new([3, 37, 4, 16, 16])
                });
            });
        }
    }

    #[test]
    fn grouping_changes_no_bit() {
        // One thread: each sequence's heads in one group; 64: every head its own group.
        for case in [
            Case::new([2, 150, 4, 8, 5]),
            Case {
                state: true,
                ..Case::new([3, 37, 4, 16, 16])
            },
        ] {
            let x = draw(&case);
            let grouped = in_pool(1, || outputs(&case, &x, true));
            let alone = in_pool(64, || outputs(&case, &x, true));
            for (a, b) in grouped.iter().zip(&alone) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
            assert_eq!(grouped.len(), alone.len());
        }
    }

    #[test]
    fn groups_are_consecutive_heads_of_one_sequence() {
        use super::{KdaRecurrence, GROUP_STATE_BYTES};
        let op = |seqs: Option<Vec<(usize, usize)>>| KdaRecurrence {
            scale: 1.0,
            l2norm: true,
            seqs,
            initial_state: false,
            final_state: false,
        };
        // Group sizes for pools of 1, 2, 3, 5 and 16 threads: the heads of a sequence split
        // evenly over the threads, never more than a sequence's heads, and at most 512 KiB of
        // states (eight of 128 × 128).
        let cases = [
            ((1, 4, 4096), [4, 2, 1, 1, 1]),
            ((2, 4, 4096), [4, 4, 2, 1, 1]),
            ((16, 4, 4096), [4, 4, 4, 4, 4]),
            ((1, 64, 16384), [8, 8, 8, 8, 4]),
        ];
        assert_eq!(GROUP_STATE_BYTES, 512 << 10);
        for (t, threads) in [1, 2, 3, 5, 16].into_iter().enumerate() {
            in_pool(threads, || {
                for ((b, h, kv), sizes) in cases {
                    let op = op(None);
                    let jobs = op.jobs(b, 100, h);
                    let groups = op.groups(&jobs, h, kv);
                    // A partition of the jobs, in order.
                    let flat: Vec<usize> = groups.iter().flat_map(|g| g.clone()).collect();
                    assert_eq!(flat, (0..jobs.len()).collect::<Vec<_>>());
                    let size = groups[0].len();
                    assert_eq!(size, sizes[t], "b {b}, h {h}, kv {kv}, {threads} threads");
                    for g in &groups {
                        let first = &jobs[g.start];
                        assert!(!g.is_empty() && g.len() <= size);
                        for (i, job) in jobs[g.clone()].iter().enumerate() {
                            assert_eq!((job.b, job.seq, job.start, job.len), {
                                (first.b, first.seq, first.start, first.len)
                            });
                            assert_eq!(job.h, first.h + i, "consecutive heads");
                        }
                    }
                    // Every thread has a group whenever there are enough heads.
                    assert!(groups.len() >= threads.min(b * h / size.max(1)));
                }
                // Packed sequences differ in length: one job per group.
                let op = op(Some(vec![(0, 10), (10, 90)]));
                let jobs = op.jobs(1, 100, 4);
                assert!(op.groups(&jobs, 4, 64).iter().all(|g| g.len() == 1));
            });
        }
    }

    #[test]
    fn prefetches_ask_for_the_token_the_group_reads_that_many_steps_later() {
        use super::{ahead, INTERLEAVE, PREFETCH_AHEAD};
        for n in 1..4 {
            for len in [1, 3, 5, INTERLEAVE, INTERLEAVE + 1, 2 * INTERLEAVE + 7] {
                // The order of `ForwardGroup`: each block's tokens of every job in turn.
                let mut order = Vec::new();
                for lo in (0..len).step_by(INTERLEAVE) {
                    let hi = (lo + INTERLEAVE).min(len);
                    for g in 0..n {
                        order.extend((lo..hi).map(|i| (lo, hi, g, i)));
                    }
                }
                for (p, &(lo, hi, g, i)) in order.iter().enumerate() {
                    let later = order.get(p + PREFETCH_AHEAD).map(|&(_, _, g, i)| (g, i));
                    let got = ahead(n, len, lo, hi, g, i);
                    assert_eq!(got, later, "n {n}, len {len}, job {g}, token {i}");
                }
            }
        }
    }

    #[test]
    fn pieces_cover_the_buffer_once_in_order() {
        use super::piece;
        for len in [0, 1, 5, 64, 4096, 4097] {
            for of in [1, 3, 31, 32] {
                let mut end = 0;
                for k in 0..of + 2 {
                    let r = piece(k, of, len);
                    assert!(
                        r.start == end || r.is_empty(),
                        "len {len}, of {of}, piece {k}"
                    );
                    assert!(r.len() <= len.div_ceil(of), "len {len}, of {of}, piece {k}");
                    end = end.max(r.end);
                    if k >= of {
                        assert!(r.is_empty(), "len {len}, of {of}, piece {k}");
                    }
                }
                assert_eq!(end, len, "len {len}, of {of}");
            }
        }
    }

    #[test]
    fn the_backward_asks_for_the_span_it_takes_next() {
        use super::next_span;
        for n in 1..4 {
            for spans in 1..4 {
                // The order of `BackwardGroup`: the spans from the last, every job in turn.
                let order: Vec<_> = (0..spans)
                    .rev()
                    .flat_map(|c| (0..n).map(move |g| (g, c)))
                    .collect();
                for (p, &(g, c)) in order.iter().enumerate() {
                    let next = order.get(p + 1).copied();
                    assert_eq!(next_span(n, g, c), next, "n {n}, job {g}, span {c}");
                }
            }
        }
    }

    fn buffer(x: &Tensor<NdArray<f32>, 4>) -> *const f32 {
        match x.clone().into_primitive().tensor() {
            burn::backend::ndarray::NdArrayTensor::F32(storage) => storage.view().as_ptr(),
            _ => unreachable!("an f32 tensor"),
        }
    }

    /// A decode loop on the plain backend that hands its state over: the state is updated in
    /// place (same buffer), token by token, and agrees with one naive recurrence over all the
    /// tokens; a state the caller keeps a handle to is never written.
    #[test]
    fn a_handed_over_state_is_updated_in_place() {
        type P = NdArray<f32>;
        let device = Default::default();
        let [b, t, h, kd, vd] = [3, 5, 2, 16, 8];
        P::seed(&device, 7);
        let normal =
            |s: [usize; 4]| Tensor::<P, 4>::random(s, Distribution::Normal(0.0, 1.0), &device);
        let (q, k, v) = (
            normal([b, t, h, kd]),
            normal([b, t, h, kd]),
            normal([b, t, h, vd]),
        );
        let g = normal([b, t, h, kd]).neg().exp().log1p().neg();
        let beta = Tensor::<P, 3>::random([b, t, h], Distribution::Uniform(0.0, 1.0), &device);
        let h0 = normal([b, h, kd, vd]);
        let opts = || {
            KdaOptions::default()
                .with_qk_l2norm(true)
                .with_final_state(true)
        };
        let (want_o, want_s) = naive_recurrent_kda(
            q.clone(),
            k.clone(),
            v.clone(),
            g.clone(),
            beta.clone(),
            opts().with_initial_state(h0.clone()),
        );
        let want_s = want_s.expect("asked for");

        let kept = h0.clone().into_data();
        // Fresh values (not `h0` itself) so that nothing else holds the buffer.
        let mut state = h0.clone().add_scalar(0.0);
        let start = buffer(&state);
        let mut outs = Vec::new();
        for i in 0..t {
            let token = |x: &Tensor<P, 4>| x.clone().narrow(1, i, 1);
            let (o, s) = crate::ops::kda::fused_recurrent_kda(
                token(&q),
                token(&k),
                token(&v),
                token(&g),
                beta.clone().narrow(1, i, 1),
                opts().with_initial_state(state),
            );
            state = s.expect("asked for");
            assert_eq!(
                buffer(&state),
                start,
                "token {i}: the state moved to a new buffer"
            );
            outs.push(o);
        }
        let got_o = Tensor::cat(outs, 1);
        let close = |name: &str, got: Tensor<P, 4>, want: Tensor<P, 4>| {
            let scale = want.clone().abs().max().into_scalar().max(1.0);
            let err = (got - want).abs().max().into_scalar();
            assert!(
                err <= 2e-5 * scale,
                "{name}: max error {err} (scale {scale})"
            );
        };
        close("o", got_o, want_o);
        close("final state", state, want_s);

        // A handle the caller keeps: the op writes a new buffer and leaves the old one alone.
        let (_, s) = crate::ops::kda::fused_recurrent_kda(
            q.clone().narrow(1, 0, 1),
            k.clone().narrow(1, 0, 1),
            v.clone().narrow(1, 0, 1),
            g.clone().narrow(1, 0, 1),
            beta.clone().narrow(1, 0, 1),
            opts().with_initial_state(h0.clone()),
        );
        assert_ne!(buffer(&s.expect("asked for")), buffer(&h0));
        assert_eq!(h0.into_data(), kept, "a shared initial state was written");
    }
}
