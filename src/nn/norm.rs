//! RMSNorm module with f32 statistics.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Tensor};

use crate::ops::norm::rms_norm;

/// Configuration of [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Width of the normalised (last) dimension.
    pub d_model: usize,
    /// Added to the mean square (`rms_norm_eps`; 1e-5 in Kimi, 1e-6 for `kv_a_layernorm`).
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl RmsNormConfig {
    /// Builds the norm with its weight at one.
    pub fn init<B: Backend>(&self, device: &B::Device) -> RmsNorm<B> {
        RmsNorm {
            weight: Param::from_tensor(Tensor::ones([self.d_model], device)),
            epsilon: self.epsilon,
        }
    }
}

/// `y = x / sqrt(mean(x²) + eps) · weight` over the last dimension, statistics in f32.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Per-channel gain `[d_model]` (checkpoint name `weight`).
    pub weight: Param<Tensor<B, 1>>,
    /// The epsilon added to the mean square.
    pub epsilon: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// `x: [..., d_model]` → same shape and dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        rms_norm(x, self.weight.val(), self.epsilon)
    }
}
