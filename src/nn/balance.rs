//! Load balancing for sigmoid routers (design §3): Quantile Balancing (QB) and the sign-update rule.
//!
//! Both balancers keep integer statistics on the host that **add** across micro-batches and across
//! data-parallel replicas ([`Balancer::merge`]), and turn them into a new expert bias once per
//! optimiser step ([`Balancer::update`]). The bias itself lives in the MoE module as a saved buffer
//! ([`BalanceState`]), never as a trained parameter.

use std::sync::{Arc, Mutex};

use burn::module::{
    AutodiffModule, Content, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param, ParamId,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ops::moe::route::{to_host_f32, Selection};

/// One routed (micro-)batch as the balancers see it, all on the host.
#[derive(Debug, Clone, Copy)]
pub struct RoutedBatch<'a> {
    /// Unbiased router scores `[tokens, experts]`, row-major.
    pub scores: &'a [f32],
    /// The bias the batch was routed with, `[experts]`.
    pub bias: &'a [f32],
    /// The selection that was made, `[tokens, k]`.
    pub selection: &'a Selection,
    /// `[tokens]`: `true` for tokens that count, `false` for padding. `None`: every token counts.
    pub valid: Option<&'a [bool]>,
}

impl RoutedBatch<'_> {
    fn check(&self) -> Result<()> {
        let (m, n) = (self.selection.tokens, self.selection.experts);
        if self.scores.len() != m * n {
            return Err(Error::shape(
                "scores",
                format!("[{m}, {n}]"),
                [self.scores.len()],
            ));
        }
        if self.bias.len() != n {
            return Err(Error::shape("bias", format!("[{n}]"), [self.bias.len()]));
        }
        if let Some(v) = self.valid {
            if v.len() != m {
                return Err(Error::shape("valid mask", format!("[{m}]"), [v.len()]));
            }
        }
        Ok(())
    }

    fn is_valid(&self, token: usize) -> bool {
        self.valid.is_none_or(|v| v[token])
    }

    /// The median selection margin over the valid tokens: the gap between each token's `k`-th
    /// and `(k+1)`-th largest biased score `s + b`, the smallest shift of its scores that would
    /// change its last expert. Stored in [`MoeStats::median_margin`].
    ///
    /// A margin that is small against the step-to-step drift of the scores means that most
    /// tokens sit at the cut: a per-expert bias then balances one batch, but a small drift moves
    /// much of the load to other experts before the next update. Even counts take the mean of the
    /// two middle gaps; `Ok(None)` when no token is valid. For grouped top-k the margin is that
    /// of the ungrouped order. Errors on shapes that do not match the selection.
    pub fn median_margin(&self) -> Result<Option<f32>> {
        self.check()?;
        let (n, k) = (self.selection.experts, self.selection.k);
        if k == 0 || k >= n {
            return Err(Error::argument(
                "k",
                format!("a margin needs 1 <= k < experts, got k = {k} of {n} experts"),
            ));
        }
        let gap = |row: &mut Vec<f32>, scores: &[f32]| {
            row.clear();
            row.extend(scores.iter().zip(self.bias).map(|(s, b)| s + b));
            // Descending; the k-th largest lands at k - 1, everything after it is smaller.
            row.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            let kth = row[k - 1];
            let next = row[k..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            kth - next
        };
        // The order of the gaps does not matter (a median follows): rayon's pool for large
        // batches, where this loop would otherwise run alone while the other cores wait.
        let mut gaps: Vec<f32> = if self.scores.len() >= MARGIN_PARALLEL {
            use rayon::prelude::*;
            self.scores
                .par_chunks_exact(n)
                .enumerate()
                .filter(|&(t, _)| self.is_valid(t))
                .map_init(
                    || Vec::with_capacity(n),
                    |row, (_, scores)| gap(row, scores),
                )
                .collect()
        } else {
            let mut row = Vec::with_capacity(n);
            self.scores
                .chunks_exact(n)
                .enumerate()
                .filter(|&(t, _)| self.is_valid(t))
                .map(|(_, scores)| gap(&mut row, scores))
                .collect()
        };
        if gaps.is_empty() {
            return Ok(None);
        }
        // A selection, not a sort: this runs on every forward of the host path.
        let mid = gaps.len() / 2;
        let odd = gaps.len() % 2 == 1;
        let (below, &mut upper, _) = gaps.select_nth_unstable_by(mid, f32::total_cmp);
        Ok(Some(if odd {
            upper
        } else {
            // The lower middle gap is the largest of the lower half.
            let lower = below.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            0.5 * (lower + upper)
        }))
    }
}

/// Scores (`tokens · experts`) from which [`RoutedBatch::median_margin`] runs on rayon's pool.
const MARGIN_PARALLEL: usize = 1 << 16;

/// A load balancer for a sigmoid router: accumulate, then update the bias once per step.
pub trait Balancer {
    /// Accumulates the statistics of one routed batch (masked tokens are skipped).
    fn observe(&mut self, batch: &RoutedBatch<'_>) -> Result<()>;
    /// Turns the accumulated statistics into the bias for the next step and clears them.
    /// With nothing accumulated, returns `bias` unchanged.
    fn update(&mut self, bias: &[f32]) -> Vec<f32>;
    /// The raw accumulated integer counts (their layout depends on the balancer).
    fn counts(&self) -> &[u64];
    /// Adds another replica's [`counts`](Balancer::counts) (same layout, same bias) to these.
    fn merge(&mut self, counts: &[u64]) -> Result<()>;
    /// Drops the accumulated statistics.
    fn reset(&mut self);
}

/// `dst += src` elementwise: pooling another replica's integer counts of the same layout.
fn add_counts(dst: &mut [u64], src: &[u64]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::shape(
            "counts",
            format!("[{}]", dst.len()),
            [src.len()],
        ));
    }
    dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
    Ok(())
}

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
    pending: bool,
    /// Drift compensation ([`BalancerKind::QuantileTrend`]): the smoothing and its memory.
    trend: Option<(f32, DriftMemory)>,
}

/// What QB with drift compensation ([`BalancerKind::QuantileTrend`]) carries from one optimiser
/// step to the next, per MoE layer: the last QB set and the smoothed per-step change of the set.
/// A training checkpoint keeps it ([`crate::checkpoint`]) so that a resumed run continues bit for
/// bit.
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

/// The DeepSeek-V3 / K2 loss-free rule `b_j += γ·sign(mean_load − load_j)` (design §3), the baseline
/// QB is compared with. [`counts`](Balancer::counts) are the per-expert loads `[experts]`.
#[derive(Debug, Clone)]
pub struct SignBalancer {
    gamma: f32,
    loads: Vec<u64>,
}

impl SignBalancer {
    /// A sign balancer for `experts` experts with step `gamma` (DeepSeek-V3: 1e-3).
    pub fn new(experts: usize, gamma: f32) -> Result<Self> {
        if !(gamma.is_finite() && gamma > 0.0) {
            return Err(Error::config(
                "gamma",
                format!("must be finite and positive, got {gamma}"),
            ));
        }
        Ok(Self {
            gamma,
            loads: vec![0; experts],
        })
    }
}

impl Balancer for SignBalancer {
    fn observe(&mut self, batch: &RoutedBatch<'_>) -> Result<()> {
        batch.check()?;
        if batch.selection.experts != self.loads.len() {
            return Err(Error::shape(
                "scores",
                format!("[m, {}]", self.loads.len()),
                [batch.selection.tokens, batch.selection.experts],
            ));
        }
        let k = batch.selection.k;
        for (t, sel) in batch.selection.indices.chunks_exact(k).enumerate() {
            if batch.is_valid(t) {
                for &j in sel {
                    self.loads[j as usize] += 1;
                }
            }
        }
        Ok(())
    }

    fn update(&mut self, bias: &[f32]) -> Vec<f32> {
        let total: u64 = self.loads.iter().sum();
        if total == 0 {
            return bias.to_vec();
        }
        let mean = total as f64 / self.loads.len() as f64;
        let next = bias
            .iter()
            .zip(&self.loads)
            .map(|(&b, &l)| {
                let d = mean - l as f64;
                b + self.gamma
                    * if d > 0.0 {
                        1.0
                    } else if d < 0.0 {
                        -1.0
                    } else {
                        0.0
                    }
            })
            .collect();
        self.reset();
        next
    }

    fn counts(&self) -> &[u64] {
        &self.loads
    }

    fn merge(&mut self, counts: &[u64]) -> Result<()> {
        add_counts(&mut self.loads, counts)
    }

    fn reset(&mut self) {
        self.loads.iter_mut().for_each(|c| *c = 0);
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

/// Which balancer a MoE layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[non_exhaustive]
pub enum BalancerKind {
    /// Quantile Balancing with this many histogram bins (design §3; default 1000).
    Quantile {
        /// Histogram bins.
        bins: usize,
    },
    /// Quantile Balancing with drift compensation, the crate's own extension of design §3 (not
    /// part of K3's published recipe). QB sets the bias that would have balanced the step just
    /// taken, and the next step routes with it: while training moves the router's inputs, that
    /// bias lags one step behind. This variant adds a smoothed estimate of how QB's set moves per
    /// step, `drift ← (1 − β)·drift + β·(set_t − set_{t−1})`, and routes with `set_t + drift`
    /// (a linear drift is then followed without lag; noise is damped by β). Everything else is
    /// QB's: the histogram, its pooling across micro-batches and replicas, the centring.
    /// [`BalanceState::forget_drift`] restarts the estimate after a change of data.
    QuantileTrend {
        /// Histogram bins.
        bins: usize,
        /// β ∈ (0, 1]: the newest step's weight in the drift estimate (0.3 is tested).
        smoothing: f32,
    },
    /// The sign rule with step `gamma` (DeepSeek-V3: 1e-3).
    Sign {
        /// Step size.
        gamma: f32,
    },
    /// No balancing: the bias stays at its loaded value.
    #[default]
    None,
}

impl BalancerKind {
    /// Quantile Balancing with the default 1000 bins.
    pub fn quantile() -> Self {
        Self::Quantile { bins: 1000 }
    }

    /// Quantile Balancing with drift compensation, 1000 bins and smoothing 0.3.
    pub fn quantile_trend() -> Self {
        Self::QuantileTrend {
            bins: 1000,
            smoothing: 0.3,
        }
    }

    fn build(&self, experts: usize) -> Result<Option<AnyBalancer>> {
        Ok(match *self {
            Self::Quantile { bins } => {
                Some(AnyBalancer::Quantile(QuantileBalancer::new(experts, bins)?))
            }
            Self::QuantileTrend { bins, smoothing } => Some(AnyBalancer::Quantile(
                QuantileBalancer::with_trend(experts, bins, smoothing)?,
            )),
            Self::Sign { gamma } => Some(AnyBalancer::Sign(SignBalancer::new(experts, gamma)?)),
            Self::None => None,
        })
    }
}

/// The balancers a [`BalanceState`] can hold.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyBalancer {
    /// Quantile Balancing.
    Quantile(QuantileBalancer),
    /// The sign rule.
    Sign(SignBalancer),
}

impl AnyBalancer {
    fn inner(&mut self) -> &mut dyn Balancer {
        match self {
            Self::Quantile(b) => b,
            Self::Sign(b) => b,
        }
    }
}

/// The device side of a layer's balance: the expert bias `[n]` (checkpoint name
/// `e_score_correction_bias`) with a host copy that every write keeps in step, and the counts
/// observed on the device since they were last read.
///
/// Routing reads the host copy, so a forward needs no read of the bias. Writes go through
/// [`BalanceState::set_bias`] / [`BalanceState::update`] and loading a record; both copies
/// change together. A [`ModuleMapper`] that rewrites the bias's *values* (rather than its device
/// or dtype) leaves the host copy behind: call [`BiasState::resync`] after it. The record is a
/// `Param<Tensor<B, 1>>`, as Burn's `RunningState` records it, so checkpoints written before
/// this type load unchanged.
///
/// Clones share the state (as `RunningState`'s do).
#[derive(Clone, Debug)]
pub struct BiasState<B: Backend> {
    id: ParamId,
    inner: Arc<Mutex<BiasInner<B>>>,
}

#[derive(Clone, Debug)]
struct BiasInner<B: Backend> {
    device: Tensor<B, 1>,
    host: Vec<f32>,
    /// Counts accumulated on the device since the last read, flattened as the balancer's
    /// [`counts`](Balancer::counts).
    pending: Option<Tensor<B, 1, Int>>,
}

impl<B: Backend> BiasState<B> {
    fn new(host: Vec<f32>, device: &B::Device) -> Self {
        let n = host.len();
        Self {
            id: ParamId::new(),
            inner: Arc::new(Mutex::new(BiasInner {
                device: Tensor::from_data(TensorData::new(host.clone(), [n]), device),
                host,
                pending: None,
            })),
        }
    }

    fn with_device(id: ParamId, device: Tensor<B, 1>, host: Vec<f32>) -> Self {
        Self {
            id,
            inner: Arc::new(Mutex::new(BiasInner {
                device,
                host,
                pending: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BiasInner<B>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bias on the device.
    pub fn value(&self) -> Tensor<B, 1> {
        self.lock().device.clone()
    }

    /// The bias on the host (no read: the host copy).
    pub fn host(&self) -> Vec<f32> {
        self.lock().host.clone()
    }

    /// Writes both copies.
    fn set(&self, bias: &[f32]) {
        let mut inner = self.lock();
        let device = inner.device.device();
        inner.device = Tensor::from_data(TensorData::new(bias.to_vec(), [bias.len()]), &device);
        inner.host = bias.to_vec();
    }

    /// Reads the device bias back into the host copy (one read), after a [`ModuleMapper`] that
    /// changed its values.
    pub fn resync(&self) {
        let mut inner = self.lock();
        inner.host = to_host_f32(inner.device.clone());
    }

    /// Adds counts gathered on the device to the pending ones (no read).
    fn add_pending(&self, counts: Tensor<B, 1, Int>) {
        let mut inner = self.lock();
        inner.pending = Some(match inner.pending.take() {
            Some(acc) => acc.add(counts),
            None => counts,
        });
    }

    /// Takes the pending device counts to the host (one read), if there are any.
    fn take_pending(&self) -> Option<Vec<u64>> {
        let pending = self.lock().pending.take()?;
        Some(
            crate::sync::read(pending)
                .iter::<i64>()
                .map(|c| c.max(0) as u64)
                .collect(),
        )
    }
}

impl<B: Backend> core::fmt::Display for BiasState<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "BiasState")
    }
}

impl<B: Backend> ModuleDisplayDefault for BiasState<B> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&"BiasState".to_string()).optional()
    }
}

impl<B: Backend> ModuleDisplay for BiasState<B> {}

impl<B: Backend> Module<B> for BiasState<B> {
    type Record = Param<Tensor<B, 1>>;

    fn collect_devices(&self, mut devices: Vec<B::Device>) -> Vec<B::Device> {
        let device = self.lock().device.device();
        if !devices.contains(&device) {
            devices.push(device);
        }
        devices
    }

    /// A copy of its own on `device` (the replicas and devices of data parallelism must not
    /// share one bias state), counts pending on the device included.
    fn fork(self, device: &B::Device) -> Self {
        let inner = self.lock().clone();
        Self {
            id: self.id,
            inner: Arc::new(Mutex::new(BiasInner {
                device: inner.device.to_device(device),
                host: inner.host,
                pending: inner.pending.map(|p| p.to_device(device)),
            })),
        }
    }

    fn to_device(self, device: &B::Device) -> Self {
        {
            let mut inner = self.lock();
            inner.device = inner.device.clone().to_device(device);
            inner.pending = inner.pending.take().map(|p| p.to_device(device));
        }
        self
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        visitor.visit_float(&Param::initialized(self.id, self.value()))
    }

    fn map<M: ModuleMapper<B>>(self, mapper: &mut M) -> Self {
        let (_, tensor, _) = mapper
            .map_float(Param::initialized(self.id, self.value()))
            .consume();
        self.lock().device = tensor;
        self
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        let device = self.lock().device.device();
        let value = record.val().to_device(&device);
        {
            let mut inner = self.lock();
            inner.host = to_host_f32(value.clone());
            inner.device = value;
        }
        self.id = record.id;
        self
    }

    fn into_record(self) -> Self::Record {
        Param::initialized(self.id, self.value())
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for BiasState<B> {
    type InnerModule = BiasState<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        let inner = self.lock();
        BiasState::with_device(self.id, inner.device.clone().inner(), inner.host.clone())
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        let inner = module.lock();
        BiasState::with_device(
            module.id,
            Tensor::from_inner(inner.device.clone()),
            inner.host.clone(),
        )
    }
}

/// The balance state of one MoE layer: the expert bias `[n]` (a saved buffer, checkpoint name
/// `e_score_correction_bias`, with a host copy: [`BiasState`]) and the balancer's accumulated
/// counts (not saved), on the host or, from the kernel path, on the device until the balance
/// update reads them (one read per optimiser step).
///
/// Cloning the module shares the accumulator, so clones made for evaluation keep feeding the
/// same statistics; call [`update`](BalanceState::update) once per optimiser step.
#[derive(Module, Debug)]
pub struct BalanceState<B: Backend> {
    /// The expert bias `b` added to the scores for selection only.
    pub bias: BiasState<B>,
    #[module(skip)]
    acc: Arc<Mutex<Option<AnyBalancer>>>,
}

impl<B: Backend> BalanceState<B> {
    /// A zero bias for `experts` experts and the balancer `kind`.
    pub fn new(experts: usize, kind: BalancerKind, device: &B::Device) -> Result<Self> {
        Ok(Self {
            bias: BiasState::new(vec![0.0; experts], device),
            acc: Arc::new(Mutex::new(kind.build(experts)?)),
        })
    }

    /// The current bias on the host (its host copy: no device read).
    pub fn bias_host(&self) -> Vec<f32> {
        self.bias.host()
    }

    /// Replaces the bias (e.g. after loading a checkpoint or an all-reduce).
    pub fn set_bias(&self, bias: &[f32]) {
        self.bias.set(bias);
    }

    /// Accumulates one routed batch into the balancer (no-op without a balancer).
    pub fn observe(&self, batch: &RoutedBatch<'_>) -> Result<()> {
        match self.lock().as_mut() {
            Some(b) => b.inner().observe(batch),
            None => Ok(()),
        }
    }

    /// The QB histogram a batch routed with `bias` should be counted over, for a fused kernel
    /// (`None` unless the balancer is QB).
    pub fn histogram_spec(&self, bias: &[f32]) -> Option<HistogramSpec> {
        match self.lock().as_ref() {
            Some(AnyBalancer::Quantile(q)) => Some(q.histogram_spec(bias)),
            _ => None,
        }
    }

    /// Accumulates QB counts a fused kernel gathered over [`histogram_spec`](Self::histogram_spec)
    /// for one batch routed with `bias` and `k` experts per token.
    ///
    /// Errors when the balancer is not QB, or as [`QuantileBalancer::observe_counts`].
    pub fn observe_histogram(&self, counts: &[u64], bias: &[f32], k: usize) -> Result<()> {
        match self.lock().as_mut() {
            Some(AnyBalancer::Quantile(q)) => q.observe_counts(counts, bias, k),
            _ => Err(Error::argument(
                "counts",
                "a QB histogram was given to a balancer that is not QB",
            )),
        }
    }

    /// Accumulates the device counts of one batch routed with `bias` and `k` experts per token,
    /// without reading them: the QB histogram `[n, bins]` of the fused routing kernel, or for the
    /// sign rule the expert loads `[n]` ([`expert_loads`]). They are read, once for all the
    /// batches observed so far, by [`update`](Self::update), [`counts`](Self::counts) or
    /// [`merge`](Self::merge). No-op without a balancer.
    ///
    /// Errors on counts of the wrong size, or when QB's bounds or `k` changed since the last
    /// update.
    pub fn observe_device<const D: usize>(
        &self,
        counts: Tensor<B, D, Int>,
        bias: &[f32],
        k: usize,
    ) -> Result<()> {
        let mut guard = self.lock();
        let Some(balancer) = guard.as_mut() else {
            return Ok(());
        };
        let expected = balancer.inner().counts().len();
        let dims = counts.dims();
        if counts.shape().num_elements() != expected {
            return Err(Error::shape(
                "device counts",
                format!("{expected} counts"),
                dims,
            ));
        }
        if let AnyBalancer::Quantile(q) = balancer {
            q.begin(bias, k)?;
            q.pending = true;
        }
        self.bias.add_pending(counts.reshape([expected]));
        Ok(())
    }

    /// Moves counts pending on the device into the balancer (one read, if there are any).
    fn flush(&self) -> Result<()> {
        match self.bias.take_pending() {
            Some(counts) => match self.lock().as_mut() {
                Some(b) => b.inner().merge(&counts),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Applies the balancer's update to the bias and clears its counts. Returns the new bias.
    /// Reads the counts observed on the device, if any (one read).
    pub fn update(&self) -> Vec<f32> {
        let bias = self.bias_host();
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        let next = match self.lock().as_mut() {
            Some(b) => b.inner().update(&bias),
            None => return bias,
        };
        self.set_bias(&next);
        next
    }

    /// The drift memory of QB with drift compensation ([`BalancerKind::QuantileTrend`]); `None`
    /// for every other balancer.
    pub fn drift_memory(&self) -> Option<DriftMemory> {
        match self.lock().as_ref() {
            Some(AnyBalancer::Quantile(q)) => q.drift_memory().cloned(),
            _ => None,
        }
    }

    /// Restores a drift memory (from [`drift_memory`](Self::drift_memory) of the same layer).
    /// `None` forgets the drift. Errors when `Some` is given to a layer whose balancer keeps no
    /// drift memory, or on vectors of the wrong length.
    pub fn set_drift_memory(&self, memory: Option<DriftMemory>) -> Result<()> {
        let mut guard = self.lock();
        match (guard.as_mut(), memory) {
            (Some(AnyBalancer::Quantile(q)), Some(m)) => q.set_drift_memory(m),
            (Some(AnyBalancer::Quantile(q)), None) => {
                q.forget_drift();
                Ok(())
            }
            (_, None) => Ok(()),
            (_, Some(_)) => Err(Error::argument(
                "drift memory",
                "this layer's balancer is not QB with drift compensation",
            )),
        }
    }

    /// Forgets QB's drift estimate ([`BalancerKind::QuantileTrend`]) after a change of data: the
    /// next update routes with QB's set as it is. No-op for other balancers.
    pub fn forget_drift(&self) {
        if let Some(AnyBalancer::Quantile(q)) = self.lock().as_mut() {
            q.forget_drift();
        }
    }

    /// Whether the balancer is QB (plain or with drift compensation).
    pub fn is_quantile(&self) -> bool {
        matches!(self.lock().as_ref(), Some(AnyBalancer::Quantile(_)))
    }

    /// One calibration sweep's QB set from the counts so far (which it clears), without drift
    /// compensation and leaving the drift memory alone. Errors unless the balancer is QB;
    /// `Ok(None)` with no counts.
    pub(crate) fn take_quantile_set(&self) -> Result<Option<Vec<f32>>> {
        self.flush()?;
        match self.lock().as_mut() {
            Some(AnyBalancer::Quantile(q)) => Ok(q.take_set()),
            _ => Err(Error::argument(
                "balancer",
                "calibrating the bias needs Quantile Balancing (plain or with drift compensation)",
            )),
        }
    }

    /// The raw integer counts accumulated since the last update (empty without a balancer),
    /// reading those pending on the device (one read, if there are any).
    pub fn counts(&self) -> Vec<u64> {
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        self.lock()
            .as_mut()
            .map(|b| b.inner().counts().to_vec())
            .unwrap_or_default()
    }

    /// The number of counts [`counts`](Self::counts) returns, without copying them.
    pub fn counts_len(&self) -> usize {
        self.lock().as_mut().map_or(0, |b| b.inner().counts().len())
    }

    /// A copy for another data-parallel replica on `device`: the same bias and balancer state
    /// (counts included), sharing nothing with `self`. A plain `clone` shares the accumulator
    /// and the bias state, which is what an evaluation copy wants and a replica must not have.
    pub fn replica(&self, device: &B::Device) -> Self {
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        let acc = self.lock().clone();
        let bias = BiasState::with_device(
            self.bias.id,
            self.bias.value().to_device(device),
            self.bias.host(),
        );
        Self {
            bias,
            acc: Arc::new(Mutex::new(acc)),
        }
    }

    /// Adds another replica's counts (one integer all-reduce) before [`update`](Self::update).
    pub fn merge(&self, counts: &[u64]) -> Result<()> {
        self.flush()?;
        match self.lock().as_mut() {
            Some(b) => b.inner().merge(counts),
            None => Ok(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AnyBalancer>> {
        // A poisoned lock only means another thread panicked mid-observe; the counts are plain
        // integers and stay usable.
        self.acc.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Moves the counts pending on the device of every state in `states` to their balancers with
/// **one** read for all of them (their pending tensors joined on the first one's device), so that
/// the [`update`](BalanceState::update)s and [`counts`](BalanceState::counts) that follow read
/// nothing. States without pending counts are skipped; none at all reads nothing.
pub fn flush_all<B: Backend>(states: &[&BalanceState<B>]) -> Result<()> {
    let pending: Vec<(&BalanceState<B>, Tensor<B, 1, Int>)> = states
        .iter()
        .filter_map(|s| Some((*s, s.bias.lock().pending.take()?)))
        .collect();
    let Some((_, first)) = pending.first() else {
        return Ok(());
    };
    let device = first.device();
    let lens: Vec<usize> = pending.iter().map(|(_, t)| t.dims()[0]).collect();
    let joined = Tensor::cat(
        pending
            .iter()
            .map(|(_, t)| t.clone().to_device(&device))
            .collect(),
        0,
    );
    let counts: Vec<u64> = crate::sync::read(joined)
        .iter::<i64>()
        .map(|c| c.max(0) as u64)
        .collect();
    let mut at = 0;
    for ((state, _), len) in pending.iter().zip(lens) {
        if let Some(b) = state.lock().as_mut() {
            b.inner().merge(&counts[at..at + len])?;
        }
        at += len;
    }
    Ok(())
}

/// Tokens per expert `[n]` of a selection `indices: [m, k]` on its device, counting only the
/// tokens `valid` marks (`[m]`, 1: counts), without a read.
pub fn expert_loads<B: Backend>(
    indices: &Tensor<B, 2, Int>,
    valid: Option<Tensor<B, 1, Int>>,
    experts: usize,
) -> Tensor<B, 1, Int> {
    let [m, k] = indices.dims();
    let device = indices.device();
    let ones = match valid {
        Some(v) => v.unsqueeze_dim::<2>(1).expand([m, k]),
        None => Tensor::ones([m, k], &device),
    };
    Tensor::zeros([experts], &device).scatter(
        0,
        indices.clone().reshape([m * k]),
        ones.reshape([m * k]),
        IndexingUpdateOp::Add,
    )
}

/// Per-step load statistics of one MoE layer (design §2).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeStats {
    /// Tokens routed to each expert (valid tokens only), `[experts]`.
    pub tokens_per_expert: Vec<u64>,
    /// `max_j load_j / mean_load − 1` (0 for a perfect balance).
    pub max_violation: f32,
    /// Coefficient of variation of the loads, `std / mean`.
    pub cv: f32,
    /// Experts that received no token.
    pub dead_experts: usize,
    /// The median selection margin of the batch ([`RoutedBatch::median_margin`]), where the
    /// selection was made on the host (the reference path, and every path on `NdArray`); `None`
    /// where a fused kernel selected on the device and the scores never left it, and in
    /// [`from_loads`](Self::from_loads).
    pub median_margin: Option<f32>,
}

impl MoeStats {
    /// Statistics of a selection, counting only valid tokens.
    pub fn from_selection(selection: &Selection, valid: Option<&[bool]>) -> Self {
        let mut loads = vec![0u64; selection.experts];
        for (t, sel) in selection.indices.chunks_exact(selection.k).enumerate() {
            if valid.is_none_or(|v| v[t]) {
                for &j in sel {
                    loads[j as usize] += 1;
                }
            }
        }
        Self::from_loads(loads)
    }

    /// Statistics of per-expert loads.
    pub fn from_loads(loads: Vec<u64>) -> Self {
        let n = loads.len().max(1) as f64;
        let mean = loads.iter().sum::<u64>() as f64 / n;
        let (max_violation, cv) = if mean > 0.0 {
            let max = loads.iter().copied().max().unwrap_or(0) as f64;
            let var = loads
                .iter()
                .map(|&l| (l as f64 - mean).powi(2))
                .sum::<f64>()
                / n;
            ((max / mean - 1.0) as f32, (var.sqrt() / mean) as f32)
        } else {
            (0.0, 0.0)
        };
        Self {
            dead_experts: loads.iter().filter(|&&l| l == 0).count(),
            tokens_per_expert: loads,
            max_violation,
            cv,
            median_margin: None,
        }
    }
}

/// The expert loads of one MoE forward, kept where they were counted: on the host (where the
/// selection was made there) or on the device (the kernel path), read only when asked
/// ([`stats`](Self::stats), [`tokens_per_expert`](Self::tokens_per_expert)).
#[derive(Debug, Clone)]
pub struct MoeLoads<B: Backend> {
    loads: LoadsAt<B>,
    median_margin: Option<f32>,
}

#[derive(Debug, Clone)]
enum LoadsAt<B: Backend> {
    Host(Vec<u64>),
    Device(Tensor<B, 1, Int>),
}

impl<B: Backend> MoeLoads<B> {
    /// Loads counted on the host, with the batch's median selection margin if known.
    pub fn from_host(loads: Vec<u64>, median_margin: Option<f32>) -> Self {
        Self {
            loads: LoadsAt::Host(loads),
            median_margin,
        }
    }

    /// Loads `[n]` counted on the device ([`expert_loads`]).
    pub fn from_device(loads: Tensor<B, 1, Int>) -> Self {
        Self {
            loads: LoadsAt::Device(loads),
            median_margin: None,
        }
    }

    /// Whether the loads are on the device (reading them is a device read).
    pub fn on_device(&self) -> bool {
        matches!(self.loads, LoadsAt::Device(_))
    }

    /// The loads `[n]` on `device` (uploaded if they were counted on the host), for summing
    /// several batches' loads before one read.
    pub fn to_device(&self, device: &B::Device) -> Tensor<B, 1, Int> {
        match &self.loads {
            LoadsAt::Device(t) => t.clone().to_device(device),
            LoadsAt::Host(v) => {
                let v: Vec<i64> = v.iter().map(|&c| c as i64).collect();
                let n = v.len();
                Tensor::from_data(TensorData::new(v, [n]), device)
            }
        }
    }

    /// Tokens routed to each expert (valid tokens only); one device read on the kernel path.
    pub fn tokens_per_expert(&self) -> Vec<u64> {
        match &self.loads {
            LoadsAt::Host(v) => v.clone(),
            LoadsAt::Device(t) => crate::sync::read(t.clone())
                .iter::<i64>()
                .map(|c| c.max(0) as u64)
                .collect(),
        }
    }

    /// The median selection margin ([`MoeStats::median_margin`]), known where the selection was
    /// made on the host.
    pub fn median_margin(&self) -> Option<f32> {
        self.median_margin
    }

    /// The load statistics; one device read on the kernel path.
    pub fn stats(&self) -> MoeStats {
        MoeStats {
            median_margin: self.median_margin,
            ..MoeStats::from_loads(self.tokens_per_expert())
        }
    }
}
