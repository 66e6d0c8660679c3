//! The masked cross-entropy on the CPU host kernels: per row one pass for the maximum, one for
//! the log-sum-exp, and the backward's gradient in one more, instead of the log-softmax over the
//! whole `[rows, vocab]` logits, the gather, the mask and their autodiff nodes of the tensor ops.
//!
//! With `lse_r = log Σ_j e^{z_rj}`, the scored rows `S` (target not the ignore index) and
//! `N = max(|S|, 1)`:
//!
//! ```text
//! loss      = (1/N) Σ_{r ∈ S} (lse_r − z_{r, y_r})
//! dz_rj     = g/N · (e^{z_rj − lse_r} − [j = y_r])    (r ∈ S; 0 elsewhere)
//! ```
//!
//! A scored target outside `[0, vocab)` makes the loss NaN, as on every path. The per-row losses
//! are summed in fixed blocks of rows, then the blocks in order: the result does not depend on the
//! number of threads.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{dispatch, exp_lane, Simd, WithSimd};
use crate::ops::norm::host::{BLOCK_ROWS, MIN_PARALLEL};

/// The mean cross-entropy on the host: inputs the logits `[.., vocab]` and the targets as floats
/// (`[..]`, one per row; exact for any index below 2²⁴); output `[1]`.
#[derive(Debug, Clone)]
pub(crate) struct CrossEntropyHost {
    /// The target of rows that are not scored.
    pub ignore: i64,
}

/// A row's target class: `None` when the row is not scored, `Some(None)` when it is scored but
/// its target lies outside `[0, vocab)`.
type Class = Option<Option<usize>>;

/// What the backward needs: each row's log-sum-exp and target class (`None`: not scored;
/// `Some(None)`: scored but out of range), and the count `N`.
#[derive(Debug)]
pub(crate) struct Saved {
    lse: Vec<f32>,
    classes: Vec<Class>,
    count: f32,
}

impl CrossEntropyHost {
    /// Each row's class: `None` when ignored, `Some(None)` when out of `[0, vocab)`.
    fn classes(&self, targets: &[f32], vocab: usize) -> Vec<Class> {
        targets
            .iter()
            .map(|&y| {
                let y = y as i64;
                (y != self.ignore).then(|| usize::try_from(y).ok().filter(|&c| c < vocab))
            })
            .collect()
    }
}

/// The log-sum-exp of a row: its maximum plus the log of `Σ e^{z − max}` (summed in order).
#[inline(always)]
fn log_sum_exp(z: &[f32]) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let mut sum = 0.0f32;
    for &v in z {
        sum += exp_lane(v - max);
    }
    max + sum.ln()
}

/// The forward over a block of rows: each row's log-sum-exp and the block's sum of losses.
struct ForwardRows<'a> {
    /// The block's rows of logits.
    z: &'a [f32],
    classes: &'a [Class],
    lse: &'a mut [f32],
    vocab: usize,
}

impl WithSimd for ForwardRows<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) -> f32 {
        let Self {
            z,
            classes,
            lse,
            vocab,
        } = self;
        let mut total = 0.0f32;
        for ((row, class), lse) in z.chunks_exact(vocab).zip(classes).zip(lse.iter_mut()) {
            let Some(class) = class else {
                continue;
            };
            *lse = log_sum_exp(row);
            total += match class {
                Some(c) => *lse - row[*c],
                None => f32::NAN,
            };
        }
        total
    }
}

/// The backward over a block of rows: its rows of the logits' gradient.
struct BackwardRows<'a> {
    z: &'a [f32],
    classes: &'a [Class],
    lse: &'a [f32],
    /// The block's rows of `dz`, zeros on entry.
    dz: &'a mut [f32],
    /// `g / N`.
    scale: f32,
    vocab: usize,
}

impl WithSimd for BackwardRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            z,
            classes,
            lse,
            dz,
            scale,
            vocab,
        } = self;
        let rows = z.chunks_exact(vocab).zip(dz.chunks_exact_mut(vocab));
        for (((row, dz), class), &lse) in rows.zip(classes).zip(lse) {
            let Some(class) = class else {
                continue;
            };
            for (d, &v) in dz.iter_mut().zip(row) {
                *d = scale * exp_lane(v - lse);
            }
            match class {
                Some(c) => dz[*c] -= scale,
                None => dz.fill(f32::NAN),
            }
        }
    }
}

impl HostOp<2> for CrossEntropyHost {
    type Saved = Saved;

    fn forward(&self, [z, y]: &[HostArray; 2], save: bool) -> (HostArray, Option<Saved>) {
        let vocab = *z.shape.last().unwrap_or(&0);
        let classes = self.classes(&y.data, vocab);
        let rows = classes.len();
        let mut lse = vec![0.0f32; rows];
        let jobs: Vec<_> = lse
            .chunks_mut(BLOCK_ROWS)
            .zip(classes.chunks(BLOCK_ROWS))
            .enumerate()
            .collect();
        let block = |(b, (lse, classes)): (usize, (&mut [f32], &[Class]))| {
            let first = b * BLOCK_ROWS;
            dispatch(ForwardRows {
                z: &z.data[first * vocab..(first + lse.len()) * vocab],
                classes,
                lse,
                vocab,
            })
        };
        let parts: Vec<f32> = if vocab > 0 && rows * vocab >= MIN_PARALLEL {
            jobs.into_par_iter().map(block).collect()
        } else if vocab > 0 {
            jobs.into_iter().map(block).collect()
        } else {
            vec![]
        };
        let count = classes.iter().filter(|c| c.is_some()).count().max(1) as f32;
        let loss = parts.iter().sum::<f32>() / count;
        let out = HostArray {
            data: vec![loss].into(),
            shape: vec![1],
        };
        let saved = save.then_some(Saved {
            lse,
            classes,
            count,
        });
        (out, saved)
    }

    fn backward(&self, [z, y]: &[HostArray; 2], saved: &Saved, grad: &HostArray) -> [HostArray; 2] {
        let vocab = *z.shape.last().unwrap_or(&0);
        let mut dz = vec![0.0f32; z.data.len()];
        let scale = grad.data[0] / saved.count;
        if vocab > 0 {
            let jobs: Vec<_> = dz.chunks_mut(BLOCK_ROWS * vocab).enumerate().collect();
            let block = |(b, dz): (usize, &mut [f32])| {
                let (first, n) = (b * BLOCK_ROWS, dz.len() / vocab);
                dispatch(BackwardRows {
                    z: &z.data[first * vocab..(first + n) * vocab],
                    classes: &saved.classes[first..first + n],
                    lse: &saved.lse[first..first + n],
                    dz,
                    scale,
                    vocab,
                })
            };
            if z.data.len() >= MIN_PARALLEL {
                jobs.into_par_iter().for_each(block);
            } else {
                jobs.into_iter().for_each(block);
            }
        }
        [
            HostArray {
                data: dz.into(),
                shape: z.shape.clone(),
            },
            HostArray::zeros(&y.shape),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The loss in f64: the mean of `lse − z_target` over the scored rows.
    fn loss64(z: &[f64], y: &[i64], vocab: usize, ignore: i64) -> f64 {
        let (mut sum, mut count) = (0.0, 0);
        for (row, &t) in z.chunks(vocab).zip(y) {
            if t == ignore {
                continue;
            }
            let m = row.iter().copied().fold(f64::MIN, f64::max);
            let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            sum += lse - row[t as usize];
            count += 1;
        }
        sum / count.max(1) as f64
    }

    /// The loss and the logits' gradient against the f64 formula and its central differences,
    /// with ignored rows, one block and several run on the pool; a scored target out of range
    /// makes the loss NaN.
    #[test]
    fn cross_entropy_host_matches_the_f64_formula_and_its_differences() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let ignore = -100;
        for (rows, vocab) in [(5, 7), (BLOCK_ROWS + 3, 33), (MIN_PARALLEL / 40 + 9, 40)] {
            let z: Vec<f64> = (0..rows * vocab)
                .map(|_| rng.random_range(-4.0..4.0))
                .collect();
            let y: Vec<i64> = (0..rows)
                .map(|r| {
                    if r % 3 == 1 {
                        ignore
                    } else {
                        rng.random_range(0..vocab as i64)
                    }
                })
                .collect();
            let array = |v: Vec<f32>, shape: &[usize]| HostArray {
                data: v.into(),
                shape: shape.to_vec(),
            };
            let inputs = [
                array(z.iter().map(|&v| v as f32).collect(), &[1, rows, vocab]),
                array(y.iter().map(|&v| v as f32).collect(), &[1, rows]),
            ];
            let op = CrossEntropyHost { ignore };
            let (loss, saved) = op.forward(&inputs, true);
            let want = loss64(&z, &y, vocab, ignore);
            assert!(
                (loss.data[0] as f64 - want).abs() <= 2e-6 * want.abs(),
                "rows {rows} vocab {vocab}: loss {} vs {want}",
                loss.data[0]
            );
            let g = 0.7f32;
            let grad = array(vec![g], &[1]);
            let [dz, _] = op.backward(&inputs, &saved.expect("saved"), &grad);
            // Central differences on a sample of coordinates (all of them when small).
            let stride = (rows * vocab / 400).max(1);
            for i in (0..rows * vocab).step_by(stride) {
                let h = 1e-5;
                let (mut a, mut b) = (z.clone(), z.clone());
                a[i] += h;
                b[i] -= h;
                let num = g as f64
                    * (loss64(&a, &y, vocab, ignore) - loss64(&b, &y, vocab, ignore))
                    / (2.0 * h);
                assert!(
                    (dz.data[i] as f64 - num).abs() <= 1e-6 + 1e-4 * num.abs(),
                    "rows {rows} vocab {vocab}: dz[{i}] = {} vs {num}",
                    dz.data[i]
                );
            }
        }
        // A scored target out of range: NaN.
        let op = CrossEntropyHost { ignore };
        let inputs = [
            HostArray {
                data: vec![0.0f32; 6].into(),
                shape: vec![2, 3],
            },
            HostArray {
                data: vec![1.0f32, 3.0].into(),
                shape: vec![2],
            },
        ];
        assert!(op.forward(&inputs, false).0.data[0].is_nan());
    }
}
