//! Palindrome (design §10): read a random sequence, then emit it reversed.

use super::{SeededRng, Task, IGNORE_INDEX};
use crate::error::{Error, Result};

/// Reproduce a random sequence reversed.
///
/// With `L = length` and separator `s = V − 1` (content tokens are `[0, V − 1)`), a sequence of
/// `2L` tokens reads `x₀ … x_{L−1} s x_{L−1} … x₁` and its targets are
///
/// - `targets[t] = IGNORE_INDEX` for `t < L` (the first half is not predictable),
/// - `targets[L + i] = x_{L−1−i}` for `i ∈ [0, L)`: from the separator on, the next token of the
///   reversed sequence. Together the scored targets spell `x` reversed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Palindrome {
    vocab_size: usize,
    length: usize,
}

impl Palindrome {
    /// A palindrome task over `vocab_size` tokens (the last one is the separator) reversing
    /// sequences of `length` tokens; [`Task::seq_len`] is `2·length`.
    ///
    /// Errors when `vocab_size < 3` (fewer than two content tokens) or `length == 0`.
    pub fn new(vocab_size: usize, length: usize) -> Result<Self> {
        if vocab_size < 3 {
            return Err(Error::config(
                "palindrome.vocab_size",
                format!(
                    "needs at least 3 (two content tokens and the separator), got {vocab_size}"
                ),
            ));
        }
        if length == 0 {
            return Err(Error::config(
                "palindrome.length",
                "must be at least 1, got 0",
            ));
        }
        Ok(Self { vocab_size, length })
    }

    /// Length of the sequence to reverse (half of [`Task::seq_len`]).
    pub fn length(&self) -> usize {
        self.length
    }

    /// The separator token, `vocab_size − 1`.
    pub fn separator(&self) -> i64 {
        self.vocab_size as i64 - 1
    }
}

impl Task for Palindrome {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn seq_len(&self) -> usize {
        2 * self.length
    }

    fn fill_sequence(&self, rng: &mut SeededRng, inputs: &mut [i64], targets: &mut [i64]) {
        let n = self.length;
        let content: Vec<i64> = (0..n)
            .map(|_| rng.below(self.vocab_size - 1) as i64)
            .collect();
        inputs[..n].copy_from_slice(&content);
        inputs[n] = self.separator();
        targets[..n].fill(IGNORE_INDEX);
        for i in 0..n {
            let reversed = content[n - 1 - i];
            targets[n + i] = reversed;
            if i + 1 < n {
                inputs[n + 1 + i] = reversed;
            }
        }
    }
}
