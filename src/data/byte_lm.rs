//! Byte-level language modelling on a small corpus that ships with the crate.

use std::sync::Arc;

use super::{SeededRng, Task};
use crate::error::{Error, Result};

/// The built-in corpus (`data/corpus.txt`, about 150 KB of ASCII).
///
/// Self-written and procedurally generated (`cargo run --example make_corpus`), so it is free of
/// copyright and needs no download: short stories from a small grammar, counting and arithmetic
/// facts, and a few hand-written paragraphs. It has enough structure for a tiny model's loss to
/// fall well below the 8 bits of a uniform byte.
pub const BUILTIN_CORPUS: &[u8] = include_bytes!("../../data/corpus.txt");

/// Byte-level language modelling: tokens are bytes (vocabulary 256), sequences are random
/// windows of the corpus, `targets[t] = corpus[start + t + 1]` (every position is scored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteLm {
    corpus: Arc<[u8]>,
    seq_len: usize,
}

impl ByteLm {
    /// Windows of `seq_len` bytes from `corpus`.
    ///
    /// Errors when `seq_len == 0` or the corpus is shorter than `seq_len + 1` bytes (one window
    /// plus its last target).
    pub fn new(corpus: impl Into<Arc<[u8]>>, seq_len: usize) -> Result<Self> {
        let corpus = corpus.into();
        if seq_len == 0 {
            return Err(Error::config(
                "byte_lm.seq_len",
                "must be at least 1, got 0",
            ));
        }
        if corpus.len() < seq_len + 1 {
            return Err(Error::config(
                "byte_lm.seq_len",
                format!(
                    "a window of {seq_len} bytes needs a corpus of at least {} bytes, got {}",
                    seq_len + 1,
                    corpus.len()
                ),
            ));
        }
        Ok(Self { corpus, seq_len })
    }

    /// Windows of `seq_len` bytes from [`BUILTIN_CORPUS`].
    pub fn builtin(seq_len: usize) -> Result<Self> {
        Self::new(BUILTIN_CORPUS, seq_len)
    }

    /// Splits the corpus into a training task (the first `1 − holdout` of the bytes) and a
    /// held-out task (the rest), both with this task's `seq_len`.
    ///
    /// Errors when `holdout` is not in `(0, 1)` or either part is too short for one window.
    pub fn split(&self, holdout: f64) -> Result<(Self, Self)> {
        if !(holdout > 0.0 && holdout < 1.0) {
            return Err(Error::argument(
                "holdout",
                format!("must lie in (0, 1), got {holdout}"),
            ));
        }
        let cut = ((1.0 - holdout) * self.corpus.len() as f64).round() as usize;
        let train = Self::new(&self.corpus[..cut], self.seq_len)?;
        let held_out = Self::new(&self.corpus[cut..], self.seq_len)?;
        Ok((train, held_out))
    }

    /// The corpus bytes.
    pub fn corpus(&self) -> &[u8] {
        &self.corpus
    }
}

impl Task for ByteLm {
    fn vocab_size(&self) -> usize {
        256
    }

    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn fill_sequence(&self, rng: &mut SeededRng, inputs: &mut [i64], targets: &mut [i64]) {
        let start = rng.below(self.corpus.len() - self.seq_len);
        let window = &self.corpus[start..start + self.seq_len + 1];
        for (t, pair) in window.windows(2).enumerate() {
            inputs[t] = i64::from(pair[0]);
            targets[t] = i64::from(pair[1]);
        }
    }
}
