//! Per-step load statistics of a MoE layer, counted where the selection was made and read only
//! when asked.

use burn::tensor::{backend::Backend, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::ops::moe::route::Selection;

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
    ///
    /// [`RoutedBatch::median_margin`]: super::RoutedBatch::median_margin
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
