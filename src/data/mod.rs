//! Synthetic tasks for small-scale validation (design §10), generated in Rust, no downloads.
//!
//! Every task is a [`Task`]: it knows its vocabulary and sequence length and fills batches of
//! `inputs` and `targets` (`[batch, seq]`, row-major `i64`) from a [`SeededRng`]. Targets follow
//! the next-token convention (`targets[t]` is what the model should emit after reading
//! `inputs[..=t]`), and positions that are not scored hold [`IGNORE_INDEX`].
//!
//! - [`Mqar`]: multi-query associative recall (Zoology convention).
//! - [`Palindrome`]: reproduce a random sequence reversed.
//! - [`ByteLm`]: byte-level language modelling on a corpus that ships with the crate.

mod byte_lm;
mod mqar;
mod palindrome;
mod rng;

pub use byte_lm::{ByteLm, BUILTIN_CORPUS};
pub use mqar::{Mqar, MqarFiller, MQAR_GRID, MQAR_VOCAB};
pub use palindrome::Palindrome;
pub use rng::SeededRng;

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::error::{Error, Result};

/// The target value of positions that are not scored (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// A synthetic sequence task.
pub trait Task {
    /// Number of distinct tokens; every input and scored target lies in `[0, vocab_size)`.
    fn vocab_size(&self) -> usize;

    /// Length of every sequence.
    fn seq_len(&self) -> usize;

    /// Fills one sequence: `inputs` and `targets` both have length [`Task::seq_len`].
    fn fill_sequence(&self, rng: &mut SeededRng, inputs: &mut [i64], targets: &mut [i64]);

    /// `batch` independent sequences drawn from `rng`.
    fn sample_batch(&self, batch: usize, rng: &mut SeededRng) -> Batch {
        let seq_len = self.seq_len();
        let mut inputs = vec![0; batch * seq_len];
        let mut targets = vec![IGNORE_INDEX; batch * seq_len];
        for (x, y) in inputs
            .chunks_mut(seq_len.max(1))
            .zip(targets.chunks_mut(seq_len.max(1)))
        {
            self.fill_sequence(rng, x, y);
        }
        Batch {
            batch,
            seq_len,
            inputs,
            targets,
        }
    }
}

/// A batch of sequences on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Number of sequences.
    pub batch: usize,
    /// Length of each sequence.
    pub seq_len: usize,
    /// Input tokens, `[batch, seq_len]` row-major.
    pub inputs: Vec<i64>,
    /// Target tokens, `[batch, seq_len]` row-major; [`IGNORE_INDEX`] where nothing is scored.
    pub targets: Vec<i64>,
}

impl Batch {
    /// The inputs and targets as Burn tensors, both `[batch, seq_len]`.
    pub fn to_tensors<B: Backend>(
        &self,
        device: &B::Device,
    ) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let shape = [self.batch, self.seq_len];
        let inputs = Tensor::from_data(TensorData::new(self.inputs.clone(), shape), device);
        let targets = Tensor::from_data(TensorData::new(self.targets.clone(), shape), device);
        (inputs, targets)
    }

    /// The batch cut into `parts` micro-batches of consecutive sequences, for gradient
    /// accumulation: weighting micro-batch `i`'s mean loss by `scored_i / scored` makes the summed
    /// gradients those of the whole batch's mean loss. Errors unless `parts` divides the number
    /// of sequences.
    pub fn split(&self, parts: usize) -> Result<Vec<Batch>> {
        if parts == 0 || !self.batch.is_multiple_of(parts) {
            return Err(Error::argument(
                "parts",
                format!(
                    "{parts} micro-batches do not divide a batch of {} sequences",
                    self.batch
                ),
            ));
        }
        let rows = self.batch / parts;
        let len = rows * self.seq_len;
        Ok((0..parts)
            .map(|i| Batch {
                batch: rows,
                seq_len: self.seq_len,
                inputs: self.inputs[i * len..(i + 1) * len].to_vec(),
                targets: self.targets[i * len..(i + 1) * len].to_vec(),
            })
            .collect())
    }

    /// Number of scored (non-ignored) targets.
    pub fn scored(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }

    /// Accuracy of `predictions` (`[batch, seq_len]` row-major) on the scored targets.
    pub fn accuracy(&self, predictions: &[i64]) -> Result<Accuracy> {
        accuracy(predictions, &self.targets)
    }
}

/// Correct and scored counts; add them up over batches with `+=`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// Scored positions whose prediction equals the target.
    pub correct: usize,
    /// Scored positions (targets other than [`IGNORE_INDEX`]).
    pub total: usize,
}

impl Accuracy {
    /// `correct / total`, or `None` when nothing was scored.
    pub fn fraction(&self) -> Option<f64> {
        (self.total > 0).then(|| self.correct as f64 / self.total as f64)
    }
}

impl std::ops::AddAssign for Accuracy {
    fn add_assign(&mut self, other: Self) {
        self.correct += other.correct;
        self.total += other.total;
    }
}

/// Counts `predictions[i] == targets[i]` over the positions where `targets[i] != IGNORE_INDEX`.
///
/// Both slices are `[batch, seq]` row-major; their lengths must match.
pub fn accuracy(predictions: &[i64], targets: &[i64]) -> Result<Accuracy> {
    if predictions.len() != targets.len() {
        return Err(Error::shape(
            "predictions",
            format!("{} values, one per target", targets.len()),
            predictions.len(),
        ));
    }
    let mut acc = Accuracy::default();
    for (&p, &t) in predictions.iter().zip(targets) {
        if t != IGNORE_INDEX {
            acc.total += 1;
            acc.correct += usize::from(p == t);
        }
    }
    Ok(acc)
}

/// [`accuracy`] of the arg-max predictions of `logits: [batch, seq, vocab]` against
/// `targets: [batch·seq]` (row-major, as in [`Batch::targets`]).
pub fn accuracy_from_logits<B: Backend>(logits: Tensor<B, 3>, targets: &[i64]) -> Result<Accuracy> {
    let [batch, seq, _] = logits.dims();
    if batch * seq != targets.len() {
        return Err(Error::shape(
            "logits",
            format!("[batch, seq, vocab] with batch·seq = {}", targets.len()),
            logits.dims(),
        ));
    }
    let predictions: Vec<i64> = crate::sync::read(logits.argmax(2)).iter::<i64>().collect();
    accuracy(&predictions, targets)
}

/// Mean cross-entropy over the scored positions, `−(1/N)·Σ_{t: y_t ≠ ignore} log softmax(z_t)[y_t]`.
///
/// - `logits`: `[batch, seq, vocab]`
/// - `targets`: `[batch, seq]`, [`IGNORE_INDEX`] where nothing is scored
///
/// Returns a `[1]` tensor; `0` when nothing is scored, NaN when a target is outside `[0, vocab)`
/// and not [`IGNORE_INDEX`]. Burn's `CrossEntropyLoss` masks only non-negative pad tokens, hence
/// this helper for the tasks' `−100`. It is
/// [`ops::loss::masked_cross_entropy`](crate::ops::loss::masked_cross_entropy) with
/// [`IGNORE_INDEX`]: a fused kernel on the CubeCL backends.
pub fn masked_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    crate::ops::loss::masked_cross_entropy(logits, targets, IGNORE_INDEX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_skips_ignored_targets() {
        let targets = [3, IGNORE_INDEX, 5, IGNORE_INDEX, 7];
        let predictions = [3, 9, 4, 9, 7];
        let acc = accuracy(&predictions, &targets).unwrap();
        assert_eq!(
            acc,
            Accuracy {
                correct: 2,
                total: 3
            }
        );
        assert_eq!(Accuracy::default().fraction(), None);
        assert!(accuracy(&predictions[..4], &targets).is_err());
    }
}
