//! The forward pass of the host KDA recurrence: one step on the state in blocks of SIMD
//! registers, and a group of jobs run [`INTERLEAVE`] tokens at a time.

use super::{
    column_blocks, piece, Geometry, Inputs, Job, KdaRecurrence, Pass, Prepared, Saved, CHECKPOINT,
    INTERLEAVE, PREFETCH_AHEAD,
};
use crate::ops::backend::host::{parallel_map_sized, scratch, DisjointWrites, HostArray};
use crate::ops::backend::simd::{dispatch, load, prefetch_write, store, Scalar, Simd, WithSimd};

impl KdaRecurrence {
    /// The forward pass: `o` (`[B, T, H, V]`, each row taken once from `o`) and, with
    /// `final_state`, the final states into `s_out` (`[N, H, K, V]`), where each job's state is
    /// updated in place: `s_out` holds the initial states on entry (zeros without
    /// `initial_state`). With `save` the checkpoints of the backward pass.
    pub(super) fn forward_into(
        &self,
        inputs: &[HostArray; 6],
        save: bool,
        o_writes: &DisjointWrites<'_>,
        s_out: &mut [f32],
    ) -> Option<Saved> {
        let h0 = &inputs[5];
        let Pass { x, b, jobs, groups } = self.pass(inputs);
        let geo = x.geo;
        let Geometry { t, h, kd, vd } = geo;
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

/// One forward step on the state `s [K, V]`, from `S_{t−1}` in `prev` (or in `s` itself when
/// `None`); writes `e = v − p`, `u = β e` and `o`, leaves `S_t` in `s`. Columns go in blocks of
/// four registers, then one register, then one at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn step<S: Simd>(
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
pub(super) fn ahead(
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
