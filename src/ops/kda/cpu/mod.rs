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
//!
//! [`prefetch_write`]: crate::ops::backend::simd::prefetch_write

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

mod backward;
mod forward;
#[cfg(test)]
mod tests;

use std::ops::Range;

use crate::ops::backend::host::{DisjointWrites, Fresh, HostArray, HostData, HostOp, Scratch};
use crate::ops::backend::simd::{dot, exp_in_place, prefetch};

use backward::GradIn;

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
///
/// [`scratch`]: crate::ops::backend::host::scratch
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

/// What [`KdaRecurrence::pass`] sets up for a pass: the inputs, the batch size `B`, the jobs
/// and the groups of jobs the pool threads take.
struct Pass<'a> {
    x: Inputs<'a>,
    b: usize,
    jobs: Vec<Job>,
    groups: Vec<Range<usize>>,
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

/// Tokens of one job that the forward pass runs before the next job of its group takes over;
/// at least [`PREFETCH_AHEAD`].
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

    /// One pass's (forward's or backward's) view of `inputs`: their rows as the jobs read them
    /// (with the shapes from `q: [B, T, H, K]` and `v: [B, T, H, V]`), the jobs and their
    /// groups.
    fn pass<'a>(&self, inputs: &'a [HostArray; 6]) -> Pass<'a> {
        let [q, k, v, g, beta, _] = inputs;
        let &[b, t, h, kd] = q.shape.as_slice() else {
            unreachable!("q is [B, T, H, K]")
        };
        let vd = v.shape[3];
        let jobs = self.jobs(b, t, h);
        let groups = self.groups(&jobs, h, kd * vd);
        let x = Inputs {
            q: &q.data,
            k: &k.data,
            v: &v.data,
            g: &g.data,
            beta: &beta.data,
            scale: self.scale,
            l2norm: self.l2norm,
            geo: Geometry { t, h, kd, vd },
        };
        Pass { x, b, jobs, groups }
    }

    /// The number of sequences `N` of the states.
    fn sequences(&self, b: usize) -> usize {
        self.seqs.as_ref().map_or(b, Vec::len)
    }
}

/// The widest blocks of columns of a row of `V` floats: `(start, blocks of 4 · lanes, blocks of
/// lanes, single columns)` as column ranges, so that each loop of a step (forward and backward)
/// takes its block size.
#[inline(always)]
fn column_blocks(vd: usize, lanes: usize) -> [Range<usize>; 3] {
    let wide = vd / (4 * lanes) * 4 * lanes;
    let narrow = wide + (vd - wide) / lanes * lanes;
    [0..wide, wide..narrow, narrow..vd]
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
