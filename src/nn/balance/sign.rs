//! The sign-update rule of DeepSeek-V3 / K2 (design §3), the baseline QB is compared with.

use super::{add_counts, Balancer, RoutedBatch};
use crate::error::{Error, Result};

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
