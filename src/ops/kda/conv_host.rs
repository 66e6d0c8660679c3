//! The short convolution with its SiLU on the CPU host kernels (training and prefill without a
//! cache; untracked calls with a cache through [`ShortConvHost::forward_with_tail`], forward
//! only): each output row from the `W` input rows before it in one pass, the backward in two
//! (the gradient of the activation's input, then `dx` and the taps' part), instead of the padded
//! copy, `W` shifted products and sums, the SiLU and their autodiff nodes of the tensor ops.
//!
//! Per sequence, with `u[t, c] = Σ_i w[c, i] · x[t − W + 1 + i, c]` (rows before the sequence's
//! first token are 0) and `y = silu(u)`:
//!
//! ```text
//! du[t, c]   = dy[t, c] · silu'(u[t, c])
//! dx[s, c]   = Σ_i w[c, i] · du[s + W − 1 − i, c]   (rows of the same sequence)
//! dw[c, i]   = Σ_t du[t, c] · x[t − W + 1 + i, c]
//! ```
//!
//! Rows go to rayon's pool in fixed blocks when the input is large; the taps' gradient sums each
//! block's part, then the blocks in order, so the result does not depend on the number of threads.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use std::sync::Arc;

use rayon::prelude::*;

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{dispatch, update, AddProduct, Simd, WithSimd};
use crate::ops::norm::host::{BLOCK_ROWS, MIN_PARALLEL};
use crate::ops::precision::host::{Derivative, Silu, Value};

/// The causal depthwise convolution and SiLU on the host: inputs `x: [B, T, P]` and the taps
/// `w: [P, W]`; output of `x`'s shape.
#[derive(Debug, Clone)]
pub(crate) struct ShortConvHost {
    /// The sequences as `(first row, rows)` over the `B · T` token rows, covering every row.
    pub segments: Arc<Vec<(usize, usize)>>,
}

/// A block of rows `lo..hi` of the sequence of rows `start..end`.
#[derive(Debug, Clone, Copy)]
struct Block {
    start: usize,
    end: usize,
    lo: usize,
    hi: usize,
}

impl ShortConvHost {
    /// The blocks of at most [`BLOCK_ROWS`] rows of every sequence, in row order.
    fn blocks(&self) -> Vec<Block> {
        let mut out = Vec::new();
        for &(start, len) in self.segments.iter() {
            let end = start + len;
            for lo in (start..end).step_by(BLOCK_ROWS) {
                let hi = (lo + BLOCK_ROWS).min(end);
                out.push(Block { start, end, lo, hi });
            }
        }
        out
    }
}

/// The taps `[P, W]` as `[W, P]`: one row of `P` per tap, so that the loops over channels read
/// consecutive values.
fn taps_by_row(w: &HostArray) -> Vec<f32> {
    let (p, width) = (w.shape[0], w.shape[1]);
    let taps = &w.data[..];
    let mut out = vec![0.0f32; p * width];
    for c in 0..p {
        for i in 0..width {
            out[i * p + c] = taps[c * width + i];
        }
    }
    out
}

/// `u` of row `r` into `u` (zeros on entry): `Σ_i taps[i] ⊙ x[r − W + 1 + i]` over the rows from
/// `start` on, in tap order (as the tensor ops add them).
#[inline(always)]
fn pre_activation(u: &mut [f32], x: &[f32], taps: &[f32], start: usize, r: usize) {
    let p = u.len();
    let width = taps.len() / p.max(1);
    for i in 0..width {
        let Some(src) = (r + 1 + i).checked_sub(width) else {
            continue;
        };
        if src < start {
            continue;
        }
        let (xs, tap) = (&x[src * p..(src + 1) * p], &taps[i * p..(i + 1) * p]);
        update(u, [tap, xs], AddProduct);
    }
}

/// The forward of a block: `y = silu(u)` row by row.
struct ForwardRows<'a> {
    x: &'a [f32],
    taps: &'a [f32],
    block: Block,
    /// The block's rows of the output, `P` each.
    out: &'a mut [f32],
    p: usize,
}

impl WithSimd for ForwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            taps,
            block,
            out,
            p,
        } = self;
        for (j, y) in out.chunks_exact_mut(p).enumerate() {
            pre_activation(y, x, taps, block.start, block.lo + j);
            update(y, [], Value(Silu));
        }
    }
}

/// The first pass of the backward over a block: `du = dy ⊙ silu'(u)` row by row.
struct ActivationGrad<'a> {
    x: &'a [f32],
    taps: &'a [f32],
    dy: &'a [f32],
    block: Block,
    /// The block's rows of `du`, zeros on entry.
    du: &'a mut [f32],
    p: usize,
}

impl WithSimd for ActivationGrad<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            taps,
            dy,
            block,
            du,
            p,
        } = self;
        for (j, d) in du.chunks_exact_mut(p).enumerate() {
            let r = block.lo + j;
            pre_activation(d, x, taps, block.start, r);
            update(d, [&dy[r * p..(r + 1) * p]], Derivative(Silu));
        }
    }
}

/// The second pass of the backward over a block: its rows of `dx` and its part of the taps'
/// gradient (`[W, P]`).
struct InputGrads<'a> {
    x: &'a [f32],
    taps: &'a [f32],
    du: &'a [f32],
    block: Block,
    /// The block's rows of `dx`, zeros on entry.
    dx: &'a mut [f32],
    /// Zeros on entry.
    dtaps: &'a mut [f32],
    p: usize,
}

impl WithSimd for InputGrads<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            taps,
            du,
            block: Block { start, end, lo, .. },
            dx,
            dtaps,
            p,
        } = self;
        let width = taps.len() / p;
        for (j, dxs) in dx.chunks_exact_mut(p).enumerate() {
            let s = lo + j;
            // dx[s] = Σ_i taps[i] ⊙ du[s + W − 1 − i], for the rows of the same sequence.
            for i in 0..width {
                let t = s + width - 1 - i;
                if t >= end {
                    continue;
                }
                let (tap, dus) = (&taps[i * p..(i + 1) * p], &du[t * p..(t + 1) * p]);
                update(dxs, [tap, dus], AddProduct);
            }
            // dtaps[i] += du[s] ⊙ x[s − W + 1 + i], for the rows from the sequence's start on.
            let dus = &du[s * p..(s + 1) * p];
            for i in 0..width {
                let Some(src) = (s + 1 + i).checked_sub(width) else {
                    continue;
                };
                if src < start {
                    continue;
                }
                let (xs, dt) = (&x[src * p..(src + 1) * p], &mut dtaps[i * p..(i + 1) * p]);
                update(dt, [dus, xs], AddProduct);
            }
        }
    }
}

/// `f` on every block with its rows of `out` (`P` floats per row) and its `part` floats of
/// `parts` (a per-block partial sum; `part` may be 0): on rayon's pool when `parallel`.
#[allow(clippy::too_many_arguments)]
fn for_blocks<'a, F>(
    blocks: &[Block],
    out: &'a mut [f32],
    p: usize,
    parts: &'a mut [f32],
    part: usize,
    parallel: bool,
    f: F,
) where
    F: Fn(Block, &'a mut [f32], &'a mut [f32]) + Sync + Send,
{
    let (mut rest, mut rest_parts) = (out, parts);
    let mut jobs = Vec::with_capacity(blocks.len());
    for &block in blocks {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut((block.hi - block.lo) * p);
        let (my_part, parts_tail) = std::mem::take(&mut rest_parts).split_at_mut(part);
        jobs.push((block, mine, my_part));
        (rest, rest_parts) = (tail, parts_tail);
    }
    if parallel {
        jobs.into_par_iter()
            .for_each(|(block, out, part)| f(block, out, part));
    } else {
        jobs.into_iter()
            .for_each(|(block, out, part)| f(block, out, part));
    }
}

impl HostOp<2> for ShortConvHost {
    type Saved = ();

    fn forward(&self, [x, w]: &[HostArray; 2], save: bool) -> (HostArray, Option<()>) {
        let p = w.shape[0];
        let taps = taps_by_row(w);
        let mut out = vec![0.0f32; x.data.len()];
        let blocks = self.blocks();
        let parallel = out.len() * w.shape[1] >= MIN_PARALLEL;
        for_blocks(
            &blocks,
            &mut out,
            p,
            &mut [],
            0,
            parallel,
            |block, out, _| {
                dispatch(ForwardRows {
                    x: &x.data,
                    taps: &taps,
                    block,
                    out,
                    p,
                })
            },
        );
        let out = HostArray {
            data: out.into(),
            shape: x.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x, w]: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        let (p, width) = (w.shape[0], w.shape[1]);
        let taps = taps_by_row(w);
        let blocks = self.blocks();
        let parallel = x.data.len() * width >= MIN_PARALLEL;
        let mut du = vec![0.0f32; x.data.len()];
        for_blocks(&blocks, &mut du, p, &mut [], 0, parallel, |block, du, _| {
            dispatch(ActivationGrad {
                x: &x.data,
                taps: &taps,
                dy: &grad.data,
                block,
                du,
                p,
            })
        });
        let mut dx = vec![0.0f32; x.data.len()];
        // Each block's part of the taps' gradient (`[W, P]`), summed in block order below.
        let mut parts = vec![0.0f32; blocks.len() * width * p];
        let part = width * p;
        for_blocks(
            &blocks,
            &mut dx,
            p,
            &mut parts,
            part,
            parallel,
            |block, dx, dtaps| {
                dispatch(InputGrads {
                    x: &x.data,
                    taps: &taps,
                    du: &du,
                    block,
                    dx,
                    dtaps,
                    p,
                })
            },
        );
        let mut sum = vec![0.0f32; part];
        for block_part in parts.chunks_exact(part.max(1)) {
            for (a, b) in sum.iter_mut().zip(block_part) {
                *a += b;
            }
        }
        let mut dw = vec![0.0f32; p * width];
        for c in 0..p {
            for i in 0..width {
                dw[c * width + i] = sum[i * p + c];
            }
        }
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

/// The forward of one sequence with its history: `y = silu(u)` per row of `x` (`P` each), where
/// the `W − 1` rows before the first come from `history` (`[W − 1, P]`, oldest first); returns
/// nothing, writes `out`, and leaves the last `W − 1` rows of `[history | x]` in `history`.
struct WithHistory<'a> {
    x: &'a [f32],
    taps: &'a [f32],
    history: &'a mut [f32],
    out: &'a mut [f32],
    p: usize,
}

impl WithSimd for WithHistory<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            x,
            taps,
            history,
            out,
            p,
        } = self;
        let keep = history.len() / p.max(1);
        let width = keep + 1;
        for (j, y) in out.chunks_exact_mut(p).enumerate() {
            // Tap `i` reads row `j + i` of the padded sequence `[history | x]`.
            for i in 0..width {
                let q = j + i;
                let src = if q < keep {
                    &history[q * p..(q + 1) * p]
                } else {
                    &x[(q - keep) * p..(q - keep + 1) * p]
                };
                update(y, [&taps[i * p..(i + 1) * p], src], AddProduct);
            }
            update(y, [], Value(Silu));
        }
        // The new history: the last `W − 1` padded rows, oldest first.
        let len = out.len() / p.max(1);
        if len >= keep {
            history.copy_from_slice(&x[(len - keep) * p..len * p]);
        } else {
            history.copy_within(len * p.., 0);
            let from = (keep - len) * p;
            history[from..].copy_from_slice(&x[..len * p]);
        }
    }
}

impl ShortConvHost {
    /// The forward with a history per sequence (prefill into a cache, decode): `x: [B, T, P]`,
    /// the taps `w: [P, W]`, `tail: [N, P, W − 1]` (each sequence's last `W − 1` raw inputs before
    /// this call; zeros when `None`) → `[y, new tail]`. Untracked: no backward.
    pub(crate) fn forward_with_tail(
        &self,
        x: &HostArray,
        w: &HostArray,
        tail: Option<&HostArray>,
    ) -> [HostArray; 2] {
        let (p, width) = (w.shape[0], w.shape[1]);
        let keep = width - 1;
        let taps = taps_by_row(w);
        let n = self.segments.len();
        // The histories as rows `[N, W − 1, P]`, oldest first.
        let mut history = vec![0.0f32; n * keep * p];
        if let Some(tail) = tail {
            let tv = &tail.data[..];
            for s in 0..n {
                for c in 0..p {
                    for m in 0..keep {
                        history[(s * keep + m) * p + c] = tv[(s * p + c) * keep + m];
                    }
                }
            }
        }
        let mut out = vec![0.0f32; x.data.len()];
        let xv = &x.data[..];
        // Each sequence with its rows of the output and its history.
        let mut jobs = Vec::with_capacity(n);
        let (mut rest, mut hist) = (&mut out[..], &mut history[..]);
        for &(start, len) in self.segments.iter() {
            let (mine, tail_rows) = std::mem::take(&mut rest).split_at_mut(len * p);
            let (h, hist_rest) = std::mem::take(&mut hist).split_at_mut(keep * p);
            jobs.push((start, mine, h));
            (rest, hist) = (tail_rows, hist_rest);
        }
        let job = |(start, out, history): (usize, &mut [f32], &mut [f32])| {
            let len = out.len() / p.max(1);
            dispatch(WithHistory {
                x: &xv[start * p..(start + len) * p],
                taps: &taps,
                history,
                out,
                p,
            })
        };
        if xv.len() * width >= MIN_PARALLEL {
            jobs.into_par_iter().for_each(job);
        } else {
            jobs.into_iter().for_each(job);
        }
        let mut new_tail = vec![0.0f32; n * p * keep];
        for s in 0..n {
            for m in 0..keep {
                for c in 0..p {
                    new_tail[(s * p + c) * keep + m] = history[(s * keep + m) * p + c];
                }
            }
        }
        [
            HostArray {
                data: out.into(),
                shape: x.shape.clone(),
            },
            HostArray {
                data: new_tail.into(),
                shape: vec![n, p, keep],
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::backend::host::testing::{close, numeric};
    use rand::{Rng, SeedableRng};

    fn silu(u: f64) -> f64 {
        u / (1.0 + (-u).exp())
    }

    /// `Σ c ⊙ silu(conv(x))` of the f64 formula over the sequences `segs` of `rows` rows.
    fn objective(x: &[f64], w: &[f64], c: &[f64], segs: &[(usize, usize)], p: usize) -> f64 {
        let width = w.len() / p;
        let mut total = 0.0;
        for &(start, len) in segs {
            for r in start..start + len {
                for ch in 0..p {
                    let mut u = 0.0;
                    for i in 0..width {
                        let src = r as isize - (width as isize - 1) + i as isize;
                        if src >= start as isize {
                            u += w[ch * width + i] * x[src as usize * p + ch];
                        }
                    }
                    total += c[r * p + ch] * silu(u);
                }
            }
        }
        total
    }

    /// The forward with a history against the f64 formula over `[history | x]`, and the new
    /// tail against the last `W − 1` padded rows: sequences longer than the window, shorter than
    /// the history (the tail keeps part of the old one), empty, one row (decode), and without a
    /// history (zeros).
    #[test]
    fn short_conv_host_with_a_history_matches_the_f64_formula() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let (p, width) = (5, 4);
        let keep = width - 1;
        for segs in [
            vec![(0, 9), (9, 2), (11, 0), (11, 1)],
            vec![(0, 1), (1, 1), (2, 1)],
        ] {
            let (n, rows) = (segs.len(), segs.iter().map(|s| s.1).sum::<usize>());
            let mut draw = |len: usize| -> Vec<f64> {
                (0..len)
                    .map(|_| rng.random_range(-2.0f64..2.0) as f32 as f64)
                    .collect()
            };
            let (x, w, tail) = (draw(rows * p), draw(p * width), draw(n * p * keep));
            let array = |v: &[f64], shape: &[usize]| HostArray {
                data: v.iter().map(|&a| a as f32).collect::<Vec<f32>>().into(),
                shape: shape.to_vec(),
            };
            let op = ShortConvHost {
                segments: Arc::new(segs.clone()),
            };
            for with_tail in [true, false] {
                let tail_in = array(&tail, &[n, p, keep]);
                let [y, new_tail] = op.forward_with_tail(
                    &array(&x, &[1, rows, p]),
                    &array(&w, &[p, width]),
                    with_tail.then_some(&tail_in),
                );
                let (mut want_y, mut want_tail) = (vec![0.0; rows * p], vec![0.0; n * p * keep]);
                for (s, &(start, len)) in segs.iter().enumerate() {
                    // Channel `c` of the padded sequence, oldest first.
                    let padded = |c: usize| -> Vec<f64> {
                        let old = (0..keep).map(|m| {
                            if with_tail {
                                tail[(s * p + c) * keep + m]
                            } else {
                                0.0
                            }
                        });
                        old.chain((start..start + len).map(|r| x[r * p + c]))
                            .collect()
                    };
                    for c in 0..p {
                        let col = padded(c);
                        for j in 0..len {
                            let u: f64 = (0..width).map(|i| w[c * width + i] * col[j + i]).sum();
                            want_y[(start + j) * p + c] = silu(u);
                        }
                        for m in 0..keep {
                            want_tail[(s * p + c) * keep + m] = col[len + m];
                        }
                    }
                }
                let what = format!("segments {segs:?}, history {with_tail}");
                close(&format!("{what}: y"), &want_y, &y.data, 2e-6);
                close(&format!("{what}: tail"), &want_tail, &new_tail.data, 0.0);
                assert_eq!(new_tail.shape, [n, p, keep]);
            }
        }
    }

    /// Output, `dx` and the taps' gradient against the f64 formula and its central differences:
    /// rows of equal sequences, empty sequences, and packed sequences shorter than the window, one
    /// of them longer than a block.
    #[test]
    fn short_conv_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let cases = [
            (vec![(0, 6), (6, 6)], 3, 4),
            // Empty sequences starting where the next one does.
            (vec![(0, 0), (0, 5), (5, 0), (5, 4)], 2, 3),
            (
                vec![(0, 2), (2, 1), (3, BLOCK_ROWS + 4), (BLOCK_ROWS + 7, 5)],
                5,
                4,
            ),
            (vec![(0, 9)], 17, 2),
        ];
        for (segs, p, width) in cases {
            let rows: usize = segs.iter().map(|s| s.1).sum();
            let x: Vec<f64> = (0..rows * p).map(|_| rng.random_range(-2.0..2.0)).collect();
            let w: Vec<f64> = (0..p * width)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let c: Vec<f64> = (0..rows * p).map(|_| rng.random_range(-1.0..1.0)).collect();
            let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
            let array = |v: &[f64], shape: &[usize]| HostArray {
                data: f32s(v).into(),
                shape: shape.to_vec(),
            };
            let op = ShortConvHost {
                segments: Arc::new(segs.clone()),
            };
            let inputs = [array(&x, &[1, rows, p]), array(&w, &[p, width])];
            let (y, saved) = op.forward(&inputs, true);
            let [dx, dw] = op.backward(&inputs, &saved.expect("saved"), &array(&c, &[1, rows, p]));
            let what = format!("segments {segs:?} P {p} W {width}");
            let want_y: Vec<f64> = (0..rows * p)
                .map(|i| {
                    let mut e = vec![0.0; rows * p];
                    e[i] = 1.0;
                    objective(&x, &w, &e, &segs, p)
                })
                .collect();
            close(&format!("{what}: y"), &want_y, &y.data, 2e-6);
            let f = |x: &[f64]| objective(x, &w, &c, &segs, p);
            close(&format!("{what}: dx"), &numeric(&x, f), &dx.data, 1e-5);
            let f = |w: &[f64]| objective(&x, w, &c, &segs, p);
            close(&format!("{what}: dw"), &numeric(&w, f), &dw.data, 1e-5);
        }
    }
}
