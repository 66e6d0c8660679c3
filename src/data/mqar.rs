//! Multi-query associative recall (design §10), in the Zoology convention (Arora et al. 2023,
//! `zoology/data/associative_recall.py`, `multiquery_ar`).

use super::{SeededRng, Task};
use crate::error::{Error, Result};

/// The standard MQAR grid (design §10): `(seq_len, num_pairs)`.
pub const MQAR_GRID: [(usize, usize); 4] = [(64, 4), (128, 8), (256, 16), (512, 64)];

/// The vocabulary size of the standard grid (design §10).
pub const MQAR_VOCAB: usize = 8192;

/// Multi-query associative recall: `num_pairs` key–value pairs, then a query of every key.
///
/// Layout of one sequence of length `T` with `P` pairs (Zoology's `multiquery_ar`):
///
/// - positions `0..2P`: `k₁ v₁ k₂ v₂ … k_P v_P`, keys drawn without replacement from
///   `[1, V/2)` (`[n, V/2)` with [`MqarFiller::Reserved`]`(n)`), values from `[V/2, V)`
///   (disjoint halves; token 0 is the filler);
/// - positions `2P..T`: filler, except that each key is queried once at position `2P + 2g`, where
///   the gaps `g ∈ [0, (T − 2P)/2)` are drawn without replacement with probability `∝ (g+1)^(a−1)`
///   (`a = power_a`, 0.01 by default, so queries cluster early in the query region);
/// - filler positions hold uniform random tokens from `[0, V)` (Zoology's `random_non_queries`),
///   or 0 when random filler is switched off, or what another [`MqarFiller`] says;
/// - `targets[2P + 2g]` is the queried key's value; every other target is
///   [`IGNORE_INDEX`](super::IGNORE_INDEX). In next-token terms the model, having just read the
///   query key, must emit its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Mqar {
    vocab_size: usize,
    seq_len: usize,
    num_pairs: usize,
    power_a: f64,
    filler: MqarFiller,
}

/// What fills the positions of an MQAR sequence that are neither pairs nor queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MqarFiller {
    /// Random tokens from the whole vocabulary (Zoology's default). A key can then recur as
    /// filler between its pair and its query, followed by a random token that competes with its
    /// value; with a small vocabulary that happens to a large share of the queries (about a third
    /// at vocabulary 256, sequence 256).
    #[default]
    Random,
    /// The pad token 0, never a key or a value. The same as `Reserved(1)`.
    Pad,
    /// Random tokens from the value half of the vocabulary: as varied as random filler (the
    /// model's hidden states, and so its routing, stay diverse), but never a key, so a query has
    /// exactly one earlier occurrence.
    Values,
    /// Uniform random tokens from `n` reserved filler tokens `[0, n)` that are never keys or
    /// values (keys come from `[n, V/2)`). Like [`Pad`](Self::Pad) a query has exactly one earlier
    /// occurrence and the model can tell filler from pairs by token identity alone; unlike it, a
    /// few distinct filler tokens keep the hidden states, and so the MoE routing, varied enough
    /// to balance.
    Reserved(usize),
}

impl MqarFiller {
    /// The first token a key may take: keys never collide with filler-only tokens.
    fn first_key(self) -> usize {
        match self {
            Self::Reserved(n) => n.max(1),
            _ => 1,
        }
    }
}

impl Mqar {
    /// An MQAR task with vocabulary `vocab_size`, sequences of `seq_len` tokens and `num_pairs`
    /// key–value pairs, Zoology's defaults otherwise (`power_a = 0.01`, random filler).
    ///
    /// Errors when a size is zero, when `vocab_size < 2·(num_pairs + 1)` (too few distinct keys in
    /// `[1, V/2)`) or when `seq_len < 4·num_pairs` (no room for the pairs and one query per key at
    /// even offsets).
    pub fn new(vocab_size: usize, seq_len: usize, num_pairs: usize) -> Result<Self> {
        for (field, value) in [
            ("vocab_size", vocab_size),
            ("seq_len", seq_len),
            ("num_pairs", num_pairs),
        ] {
            if value == 0 {
                return Err(Error::config(
                    format!("mqar.{field}"),
                    "must be at least 1, got 0",
                ));
            }
        }
        check_keys(vocab_size, num_pairs, 1)?;
        if seq_len < 4 * num_pairs {
            return Err(Error::config(
                "mqar.seq_len",
                format!(
                    "num_pairs {num_pairs} needs seq_len ≥ 4·num_pairs = {} (2·{num_pairs} for the \
                     pairs, then one query per key at even offsets), got {seq_len}",
                    4 * num_pairs
                ),
            ));
        }
        Ok(Self {
            vocab_size,
            seq_len,
            num_pairs,
            power_a: 0.01,
            filler: MqarFiller::Random,
        })
    }

    /// The standard grid [`MQAR_GRID`] at vocabulary `vocab_size` ([`MQAR_VOCAB`] in design §10).
    pub fn standard_grid(vocab_size: usize) -> Result<Vec<Self>> {
        MQAR_GRID
            .iter()
            .map(|&(seq_len, pairs)| Self::new(vocab_size, seq_len, pairs))
            .collect()
    }

    /// Sets the power-law exponent `a` of the query gaps (`p(g) ∝ (g+1)^(a−1)`; `a = 1` is
    /// uniform). Errors unless `a` is finite and positive.
    pub fn with_power_a(mut self, power_a: f64) -> Result<Self> {
        if !(power_a.is_finite() && power_a > 0.0) {
            return Err(Error::config(
                "mqar.power_a",
                format!("must be finite and positive, got {power_a}"),
            ));
        }
        self.power_a = power_a;
        Ok(self)
    }

    /// Random filler tokens (Zoology's default) when `true`, token 0 when `false`.
    pub fn with_random_filler(mut self, random_filler: bool) -> Self {
        self.filler = if random_filler {
            MqarFiller::Random
        } else {
            MqarFiller::Pad
        };
        self
    }

    /// The filler of the positions that are neither pairs nor queries.
    ///
    /// Errors for [`MqarFiller::Reserved`]`(0)`, and when the reserved tokens leave fewer distinct
    /// keys in `[n, V/2)` than pairs.
    pub fn with_filler(mut self, filler: MqarFiller) -> Result<Self> {
        if let MqarFiller::Reserved(n) = filler {
            if n == 0 {
                return Err(Error::config(
                    "mqar.filler",
                    "Reserved(n) needs at least one filler token, got n = 0",
                ));
            }
            check_keys(self.vocab_size, self.num_pairs, n)?;
        }
        self.filler = filler;
        Ok(self)
    }

    /// The filler in use.
    pub fn filler(&self) -> MqarFiller {
        self.filler
    }

    /// Number of key–value pairs (and of queries) per sequence.
    pub fn num_pairs(&self) -> usize {
        self.num_pairs
    }

    /// Whether filler positions hold random tokens from the whole vocabulary.
    pub fn random_filler(&self) -> bool {
        self.filler == MqarFiller::Random
    }

    /// The power-law exponent of the query gaps.
    pub fn power_a(&self) -> f64 {
        self.power_a
    }

    /// The token range keys are drawn from, `[1, V/2)` (`[n, V/2)` with
    /// [`MqarFiller::Reserved`]`(n)`).
    pub fn key_range(&self) -> std::ops::Range<i64> {
        self.filler.first_key() as i64..(self.vocab_size / 2) as i64
    }

    /// The token range values are drawn from, `[V/2, V)`.
    pub fn value_range(&self) -> std::ops::Range<i64> {
        (self.vocab_size / 2) as i64..self.vocab_size as i64
    }

    /// `count` distinct gaps from `[0, space)` with `p(g) ∝ (g+1)^(a−1)`, drawn one at a time
    /// and renormalised after each draw (numpy's `choice(replace=False, p=…)`).
    fn sample_gaps(&self, rng: &mut SeededRng, space: usize, count: usize) -> Vec<usize> {
        let mut weights: Vec<f64> = (1..=space)
            .map(|g| (g as f64).powf(self.power_a - 1.0))
            .collect();
        let mut gaps = Vec::with_capacity(count);
        for _ in 0..count {
            let total: f64 = weights.iter().sum();
            let mut u = rng.unit_f64() * total;
            // Rounding can leave `u` just past the last weight: fall back to the last free gap.
            let mut pick = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
            for (g, &w) in weights.iter().enumerate() {
                if w > 0.0 && u < w {
                    pick = g;
                    break;
                }
                u -= w;
            }
            weights[pick] = 0.0;
            gaps.push(pick);
        }
        gaps
    }
}

/// Errors unless `[first_key, V/2)` holds at least `num_pairs` distinct keys.
fn check_keys(vocab_size: usize, num_pairs: usize, first_key: usize) -> Result<()> {
    let keys = (vocab_size / 2).saturating_sub(first_key);
    if keys < num_pairs {
        return Err(Error::config(
            "mqar.vocab_size",
            format!(
                "vocab_size {vocab_size} leaves {keys} distinct keys in [{first_key}, {}), fewer \
                 than num_pairs {num_pairs}; need vocab_size ≥ {}",
                vocab_size / 2,
                2 * (num_pairs + first_key)
            ),
        ));
    }
    Ok(())
}

impl Task for Mqar {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn fill_sequence(&self, rng: &mut SeededRng, inputs: &mut [i64], targets: &mut [i64]) {
        let pairs = self.num_pairs;
        let half = self.vocab_size / 2;
        let keys = rng.distinct(self.filler.first_key(), half, pairs);
        let values = rng.distinct(half, self.vocab_size, pairs);
        let context = 2 * pairs;
        let gaps = self.sample_gaps(rng, (self.seq_len - context) / 2, pairs);

        targets.fill(super::IGNORE_INDEX);
        inputs.fill(0);
        for (i, (&k, &v)) in keys.iter().zip(&values).enumerate() {
            inputs[2 * i] = k as i64;
            inputs[2 * i + 1] = v as i64;
        }
        let mut is_query = vec![false; self.seq_len];
        for ((&gap, &k), &v) in gaps.iter().zip(&keys).zip(&values) {
            let pos = context + 2 * gap;
            inputs[pos] = k as i64;
            targets[pos] = v as i64;
            is_query[pos] = true;
        }
        let filler_range = match self.filler {
            MqarFiller::Random => Some(0..self.vocab_size),
            MqarFiller::Values => Some(half..self.vocab_size),
            MqarFiller::Reserved(n) if n > 1 => Some(0..n),
            MqarFiller::Pad | MqarFiller::Reserved(_) => None,
        };
        if let Some(range) = filler_range {
            for (pos, x) in inputs.iter_mut().enumerate().skip(context) {
                if !is_query[pos] {
                    *x = (range.start + rng.below(range.end - range.start)) as i64;
                }
            }
        }
    }
}
