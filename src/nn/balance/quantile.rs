//! Quantile Balancing (design §3): the integer histogram of the margins `r = α − s`, its
//! recovery step, the exact form the tests compare it with, and drift compensation.

use serde::{Deserialize, Serialize};

use super::{add_counts, Balancer, RoutedBatch};
use crate::error::{Error, Result};

/// The per-token cut `α_i = (k+1)`-th largest of `s_i + b` (design §3).
fn cutoff(row: &[f32], bias: &[f32], k: usize, buf: &mut Vec<f32>) -> f32 {
    buf.clear();
    buf.extend(row.iter().zip(bias).map(|(s, b)| s + b));
    let (_, kth, _) = buf.select_nth_unstable_by(k, |a, b| b.total_cmp(a));
    *kth
}

/// The histogram bounds implied by a bias: `[min b − 1, max b + 1]` (scores lie in (0, 1)).
pub fn bounds_for_bias(bias: &[f32]) -> (f32, f32) {
    let lo = bias.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = bias.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if bias.is_empty() {
        (-1.0, 1.0)
    } else {
        (lo - 1.0, hi + 1.0)
    }
}

/// QB recovery step (design §3): turns the integer histogram of `r_ij = α_i − s_ij` into the new bias.
///
/// `counts` is `[experts, bins]` row-major, gathered over `bounds = (lo, hi)`; `k` is the number of
/// experts per token. Returns the centred bias `b = b̂ − mean(b̂)` and the bounds for the next step,
/// `[min b − 1, max b + 1]`. The error is at most one bin width. With no counts at all (every token
/// masked) it returns an empty bias, meaning "keep the current one", and the bounds unchanged.
///
/// # Panics
/// If `bins` is 0, `counts.len()` is not a multiple of `bins`, or `lo >= hi`.
pub fn quantile_bias_from_histogram(
    counts: &[u64],
    bins: usize,
    bounds: (f32, f32),
    k: usize,
) -> (Vec<f32>, (f32, f32)) {
    assert!(
        bins > 0,
        "quantile_bias_from_histogram: bins must be positive"
    );
    assert!(
        counts.len().is_multiple_of(bins),
        "quantile_bias_from_histogram: counts.len() = {} is not a multiple of bins = {bins}",
        counts.len()
    );
    let (lo, hi) = bounds;
    assert!(
        lo < hi,
        "quantile_bias_from_histogram: bounds must satisfy lo < hi, got ({lo}, {hi})"
    );
    let n = counts.len() / bins;
    let width = (hi as f64 - lo as f64) / bins as f64;
    let total: u64 = counts.iter().take(bins).sum();
    if n == 0 || total == 0 {
        return (Vec::new(), bounds);
    }
    let qf = total as f64 * k as f64 / n as f64;
    let target = qf.ceil().max(1.0) as u64;
    let raw: Vec<f64> = counts
        .chunks_exact(bins)
        .map(|row| {
            let mut cum = 0u64;
            for (bin, &h) in row.iter().enumerate() {
                let before = cum;
                cum += h;
                if cum >= target {
                    let frac = ((qf - before as f64) / h.max(1) as f64).clamp(0.0, 1.0);
                    return lo as f64 + (bin as f64 + frac) * width;
                }
            }
            hi as f64
        })
        .collect();
    let mean = raw.iter().sum::<f64>() / n as f64;
    let bias: Vec<f32> = raw.iter().map(|b| (b - mean) as f32).collect();
    let next = bounds_for_bias(&bias);
    (bias, next)
}

/// QB in its exact form (for tests and small batches): `b̂_j` is the `(q+1)`-th smallest `r_ij`
/// over the valid tokens, with `q = ⌊M·k/n⌋`, then centred. Same contract as
/// [`quantile_bias_from_histogram`] without the binning; returns `bias` unchanged when no token is
/// valid.
pub fn quantile_bias_exact(batch: &RoutedBatch<'_>) -> Result<Vec<f32>> {
    batch.check()?;
    let (m, n, k) = (
        batch.selection.tokens,
        batch.selection.experts,
        batch.selection.k,
    );
    let mut r: Vec<Vec<f32>> = vec![Vec::with_capacity(m); n];
    let mut buf = Vec::with_capacity(n);
    for (t, row) in batch.scores.chunks_exact(n).enumerate() {
        if !batch.is_valid(t) {
            continue;
        }
        let alpha = cutoff(row, batch.bias, k, &mut buf);
        for (j, &s) in row.iter().enumerate() {
            r[j].push(alpha - s);
        }
    }
    let tokens = r[0].len();
    if tokens == 0 {
        return Ok(batch.bias.to_vec());
    }
    let q = (tokens * k / n).min(tokens - 1);
    let raw: Vec<f64> = r
        .iter_mut()
        .map(|col| {
            let (_, v, _) = col.select_nth_unstable_by(q, f32::total_cmp);
            *v as f64
        })
        .collect();
    let mean = raw.iter().sum::<f64>() / n as f64;
    Ok(raw.iter().map(|b| (b - mean) as f32).collect())
}

/// Quantile Balancing, histogram form (design §3): absolute, learning-rate free, causal.
///
/// [`counts`](Balancer::counts) is the integer histogram `[experts, bins]` over the bounds implied by
/// the current bias ([`bounds_for_bias`]).
#[derive(Debug, Clone)]
pub struct QuantileBalancer {
    experts: usize,
    bins: usize,
    k: Option<usize>,
    bounds: Option<(f32, f32)>,
    counts: Vec<u64>,
    /// Counts of a batch are pending on the device (see [`BalanceState::observe_device`]).
    ///
    /// [`BalanceState::observe_device`]: super::BalanceState::observe_device
    pub(super) pending: bool,
    /// Drift compensation ([`BalancerKind::QuantileTrend`]): the smoothing and its memory.
    ///
    /// [`BalancerKind::QuantileTrend`]: super::BalancerKind::QuantileTrend
    trend: Option<(f32, DriftMemory)>,
}

/// What QB with drift compensation ([`BalancerKind::QuantileTrend`]) carries from one optimiser
/// step to the next, per MoE layer: the last QB set and the smoothed per-step change of the set.
/// A training checkpoint keeps it ([`crate::checkpoint`]) so that a resumed run continues bit for
/// bit.
///
/// [`BalancerKind::QuantileTrend`]: super::BalancerKind::QuantileTrend
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriftMemory {
    /// The previous update's QB set `b̂ − mean(b̂)`, `[n]`; empty before the first update.
    pub last_set: Vec<f32>,
    /// The smoothed change of the set per update, `[n]`; empty (zero) before the second.
    pub drift: Vec<f32>,
}

impl DriftMemory {
    fn check(&self, experts: usize) -> Result<()> {
        for (name, v) in [("last_set", &self.last_set), ("drift", &self.drift)] {
            if !v.is_empty() && v.len() != experts {
                return Err(Error::shape(
                    format!("drift memory {name}"),
                    format!("[{experts}] or empty"),
                    [v.len()],
                ));
            }
        }
        Ok(())
    }

    /// Records QB's new `set` and returns the bias to route the next step with:
    /// `set + drift`, where `drift ← (1 − β)·drift + β·(set − last_set)`.
    fn advance(&mut self, set: Vec<f32>, smoothing: f32) -> Vec<f32> {
        if self.last_set.len() != set.len() {
            // The first update (or the first after `forget`): nothing to extrapolate from.
            self.last_set = set.clone();
            self.drift.clear();
            return set;
        }
        self.drift.resize(set.len(), 0.0);
        for ((d, last), &now) in self.drift.iter_mut().zip(&mut self.last_set).zip(&set) {
            *d = (1.0 - smoothing) * *d + smoothing * (now - *last);
            *last = now;
        }
        set.iter().zip(&self.drift).map(|(b, d)| b + d).collect()
    }
}

impl QuantileBalancer {
    /// A balancer for `experts` experts with `bins` histogram bins (default in configs: 1000).
    pub fn new(experts: usize, bins: usize) -> Result<Self> {
        if experts < 2 {
            return Err(Error::config(
                "n_experts",
                format!("QB needs at least 2 experts, got {experts}"),
            ));
        }
        if bins < 2 {
            return Err(Error::config(
                "bins",
                format!("QB needs at least 2 bins, got {bins}"),
            ));
        }
        Ok(Self {
            experts,
            bins,
            k: None,
            bounds: None,
            counts: vec![0; experts * bins],
            pending: false,
            trend: None,
        })
    }

    /// QB with drift compensation ([`BalancerKind::QuantileTrend`]): `smoothing` is the weight
    /// β ∈ (0, 1] of the newest step in the smoothed per-step change of QB's set.
    ///
    /// [`BalancerKind::QuantileTrend`]: super::BalancerKind::QuantileTrend
    pub fn with_trend(experts: usize, bins: usize, smoothing: f32) -> Result<Self> {
        if !(smoothing > 0.0 && smoothing <= 1.0) {
            return Err(Error::config(
                "smoothing",
                format!("QB's drift smoothing must lie in (0, 1], got {smoothing}"),
            ));
        }
        Ok(Self {
            trend: Some((smoothing, DriftMemory::default())),
            ..Self::new(experts, bins)?
        })
    }

    /// The drift smoothing β (`None`: plain QB).
    pub fn smoothing(&self) -> Option<f32> {
        self.trend.as_ref().map(|(beta, _)| *beta)
    }

    /// The drift memory (`None`: plain QB).
    pub fn drift_memory(&self) -> Option<&DriftMemory> {
        self.trend.as_ref().map(|(_, m)| m)
    }

    /// Replaces the drift memory (from a checkpoint). Errors for plain QB, or on vectors that
    /// are neither empty nor `[experts]`.
    pub fn set_drift_memory(&mut self, memory: DriftMemory) -> Result<()> {
        memory.check(self.experts)?;
        match self.trend.as_mut() {
            Some((_, m)) => {
                *m = memory;
                Ok(())
            }
            None => Err(Error::argument(
                "drift memory",
                "this layer balances with plain QB, which keeps no drift memory",
            )),
        }
    }

    /// Forgets the drift (after the data changed, or a calibration): the next update applies
    /// QB's set as it is and starts a new estimate. No-op for plain QB.
    pub fn forget_drift(&mut self) {
        if let Some((_, m)) = self.trend.as_mut() {
            *m = DriftMemory::default();
        }
    }

    /// QB's set `b̂ − mean(b̂)`, `[experts]`, from the counts so far, which it clears, without the
    /// drift compensation and without touching its memory. `None` with no counts.
    pub fn take_set(&mut self) -> Option<Vec<f32>> {
        let (k, bounds) = (self.k?, self.bounds?);
        let (set, _) = quantile_bias_from_histogram(&self.counts, self.bins, bounds, k);
        self.reset();
        (!set.is_empty()).then_some(set)
    }

    /// Number of histogram bins.
    pub fn bins(&self) -> usize {
        self.bins
    }

    /// The bounds the current counts were gathered over (`None` before the first observation).
    pub fn bounds(&self) -> Option<(f32, f32)> {
        self.bounds
    }

    /// Number of tokens accumulated since the last update.
    pub fn tokens(&self) -> u64 {
        self.counts[..self.bins].iter().sum()
    }

    /// The histogram a batch routed with `bias` is counted over: the bounds of
    /// [`bounds_for_bias`] and this balancer's bins (what a fused kernel needs to count it).
    pub fn histogram_spec(&self, bias: &[f32]) -> HistogramSpec {
        let (lo, hi) = bounds_for_bias(bias);
        HistogramSpec {
            lo,
            hi,
            bins: self.bins,
        }
    }

    /// Accumulates a histogram counted elsewhere (a fused kernel) for one batch routed with
    /// `bias` and `k` experts per token: `counts: [experts, bins]` over
    /// [`histogram_spec`](Self::histogram_spec)`(bias)`. Same checks and effect as
    /// [`observe`](Balancer::observe) on that batch.
    pub fn observe_counts(&mut self, counts: &[u64], bias: &[f32], k: usize) -> Result<()> {
        if counts.len() != self.counts.len() {
            return Err(Error::shape(
                "counts",
                format!("[{}, {}]", self.experts, self.bins),
                [counts.len()],
            ));
        }
        if bias.len() != self.experts {
            return Err(Error::shape(
                "bias",
                format!("[{}]", self.experts),
                [bias.len()],
            ));
        }
        self.begin(bias, k)?;
        for (a, b) in self.counts.iter_mut().zip(counts) {
            *a += b;
        }
        Ok(())
    }

    /// The top-k of the batches to come, where none has been observed yet (a later batch with
    /// another `k` is an error, as between any two batches).
    pub(crate) fn set_top_k(&mut self, k: usize) {
        self.k.get_or_insert(k);
    }

    /// Counts merged from other replicas into a balancer that observed no batch since its last
    /// update (a replica without a share of this step) are pooled over `bias`, which every
    /// replica routed with (the balance packet checks it), and the `k` of this balancer's earlier
    /// batches, so that its [`update`](Balancer::update) gives the others' bias.
    ///
    /// # Errors
    /// When this balancer knows no `k` (never given one by [`set_top_k`](Self::set_top_k), never
    /// given a batch).
    pub(crate) fn adopt_merged(&mut self, bias: &[f32]) -> Result<()> {
        if self.bounds.is_some() || self.tokens() == 0 {
            return Ok(());
        }
        if self.k.is_none() {
            return Err(Error::argument(
                "balance counts",
                "merged into a QB balancer that knows no top-k (built alone, never given a batch); \
                 a LatentMoe's balancer knows its router's",
            ));
        }
        self.bounds = Some(bounds_for_bias(bias));
        Ok(())
    }

    /// Checks that a batch routed with `bias` and `k` may be pooled with the counts so far, and
    /// records both.
    pub(crate) fn begin(&mut self, bias: &[f32], k: usize) -> Result<(f32, f32)> {
        if self.k.is_some_and(|k0| k0 != k) {
            return Err(Error::argument(
                "k",
                format!("changed from {:?} to {k} between updates", self.k),
            ));
        }
        let bounds = bounds_for_bias(bias);
        if (self.pending || self.tokens() > 0) && self.bounds != Some(bounds) {
            return Err(Error::argument(
                "bias",
                "changed between observations without an update(); counts of different biases cannot be pooled",
            ));
        }
        self.k = Some(k);
        self.bounds = Some(bounds);
        Ok(bounds)
    }
}

impl Balancer for QuantileBalancer {
    fn observe(&mut self, batch: &RoutedBatch<'_>) -> Result<()> {
        batch.check()?;
        let (n, k) = (batch.selection.experts, batch.selection.k);
        if n != self.experts {
            return Err(Error::shape(
                "scores",
                format!("[m, {}]", self.experts),
                [batch.selection.tokens, n],
            ));
        }
        let bounds = self.begin(batch.bias, k)?;
        // The same f32 scale the fused kernel is given (HistogramSpec::scale), so both bin alike.
        let scale = self.histogram_spec(batch.bias).scale();
        let (lo, _) = bounds;
        let last = (self.bins - 1) as f32;
        let mut buf = Vec::with_capacity(n);
        for (t, row) in batch.scores.chunks_exact(n).enumerate() {
            if !batch.is_valid(t) {
                continue;
            }
            let alpha = cutoff(row, batch.bias, k, &mut buf);
            for (j, &s) in row.iter().enumerate() {
                let bin = ((alpha - s - lo) * scale).floor().clamp(0.0, last) as usize;
                self.counts[j * self.bins + bin] += 1;
            }
        }
        Ok(())
    }

    fn update(&mut self, bias: &[f32]) -> Vec<f32> {
        let Some(set) = self.take_set() else {
            return bias.to_vec();
        };
        match self.trend.as_mut() {
            Some((smoothing, memory)) => memory.advance(set, *smoothing),
            None => set,
        }
    }

    fn counts(&self) -> &[u64] {
        &self.counts
    }

    fn merge(&mut self, counts: &[u64]) -> Result<()> {
        add_counts(&mut self.counts, counts)
    }

    fn reset(&mut self) {
        self.counts.iter_mut().for_each(|c| *c = 0);
        self.bounds = None;
        self.pending = false;
    }
}

/// What the QB histogram is gathered over (design §3), as the QB balancer asks for it and the routing kernel
/// fills it: `bins` bins on `[lo, hi]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HistogramSpec {
    /// Lower bound of the margins `r = α − s`.
    pub lo: f32,
    /// Upper bound.
    pub hi: f32,
    /// Number of bins.
    pub bins: usize,
}

impl HistogramSpec {
    /// `bins / (hi − lo)` in f32, computed exactly as the host balancer computes it (so both bin
    /// every margin identically).
    pub fn scale(&self) -> f32 {
        self.bins as f32 / (self.hi - self.lo)
    }
}
