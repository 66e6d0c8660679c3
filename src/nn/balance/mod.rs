//! Load balancing for sigmoid routers (design §3): Quantile Balancing (QB) and the sign-update rule.
//!
//! Both balancers keep integer statistics on the host that **add** across micro-batches and across
//! data-parallel replicas ([`Balancer::merge`]), and turn them into a new expert bias once per
//! optimiser step ([`Balancer::update`]). The bias itself lives in the MoE module as a saved buffer
//! ([`BalanceState`]), never as a trained parameter.

mod quantile;
mod sign;
mod state;
mod stats;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ops::moe::route::Selection;

pub use quantile::{
    bounds_for_bias, quantile_bias_exact, quantile_bias_from_histogram, DriftMemory, HistogramSpec,
    QuantileBalancer,
};
pub use sign::SignBalancer;
pub use state::{flush_all, BalanceState, BiasState};
pub use stats::{expert_loads, MoeLoads, MoeStats};

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
