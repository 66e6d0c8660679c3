//! The gated FFN used by every Kimi K3 FFN (dense layer, shared and routed experts), design §1.

use crate::error::{Error, Result};
use crate::ops::linear::linear;
use burn::config::Config;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};

use crate::ops::quant::QatConfig;

pub use crate::ops::moe::GluActivation;

/// Configuration of [`SituGlu`].
#[derive(Config, Debug)]
pub struct SituGluConfig {
    /// Input and output width.
    pub d_model: usize,
    /// Hidden width (`intermediate_size`, `moe_intermediate_size`, ...).
    pub d_hidden: usize,
    /// The gated activation; SiTU-GLU by default, SwiGLU for comparison.
    #[config(default = "GluActivation::situ()")]
    pub activation: GluActivation,
    /// Quantisation-aware training of the three matmuls (design §9); `None`: full precision.
    #[config(default = "None")]
    pub qat: Option<QatConfig>,
}

impl SituGluConfig {
    /// Checks the widths and the activation constants.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || self.d_hidden == 0 {
            return Err(Error::config(
                "d_hidden",
                format!(
                    "widths must be positive, got d_model = {}, d_hidden = {}",
                    self.d_model, self.d_hidden
                ),
            ));
        }
        self.activation.validate()
    }

    /// Builds the FFN, or reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<SituGlu<B>> {
        self.validate()?;
        Ok(SituGlu {
            w1: super::linear(self.d_model, self.d_hidden, device),
            w3: super::linear(self.d_model, self.d_hidden, device),
            w2: super::linear(self.d_hidden, self.d_model, device),
            activation: self.activation,
            qat: self.qat,
        })
    }

    /// Builds the FFN.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> SituGlu<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A GLU FFN `y = W2 · act(W1 x, W3 x)` (design §1).
///
/// Checkpoint names: `w1` gate / `w3` up / `w2` down for experts, `gate_proj` / `up_proj` /
/// `down_proj` for dense and shared FFNs.
#[derive(Module, Debug)]
pub struct SituGlu<B: Backend> {
    /// Gate projection `[d_model, d_hidden]`.
    pub w1: Linear<B>,
    /// Up projection `[d_model, d_hidden]`.
    pub w3: Linear<B>,
    /// Down projection `[d_hidden, d_model]`.
    pub w2: Linear<B>,
    /// The gated activation.
    #[module(skip)]
    pub activation: GluActivation,
    /// Quantisation-aware training: weights and inputs of `w1`, `w3` and `w2` fake-quantised.
    #[module(skip)]
    pub qat: Option<QatConfig>,
}

impl<B: Backend> SituGlu<B> {
    /// `x: [..., d_model]` → `[..., d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let h = self.hidden(x);
        match &self.qat {
            Some(q) => q.linear(&self.w2, h),
            None => linear(&self.w2, h),
        }
    }

    /// The activated hidden state `act(W1 x, W3 x)`: `[..., d_hidden]` (with QAT, from the
    /// quantised input and weights; the hidden state itself is quantised by `forward`).
    pub fn hidden<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (gate, up) = match &self.qat {
            Some(q) => {
                // Quantise the input once for both projections.
                let x = q.activation(x);
                let plain = QatConfig {
                    activations: None,
                    ..*q
                };
                (plain.linear(&self.w1, x.clone()), plain.linear(&self.w3, x))
            }
            None => (linear(&self.w1, x.clone()), linear(&self.w3, x)),
        };
        self.activation.apply(gate, up)
    }

    /// This FFN with its QAT weight quantisation applied once: the weights hold their quantised
    /// values and forwards no longer quantise them (the activations still are), for inference
    /// (see [`KimiForCausalLM::with_quantized_weights`](crate::model::KimiForCausalLM::with_quantized_weights)).
    /// Unchanged without a weight format.
    pub fn with_quantized_weights(mut self) -> Self {
        if let Some(q) = self.qat.filter(QatConfig::quantizes_weights) {
            for linear in [&mut self.w1, &mut self.w3, &mut self.w2] {
                linear.weight = linear.weight.clone().map(|w| q.weight(w, 0));
            }
            self.qat = Some(q.with_weights_quantized());
        }
        self
    }

    /// Hidden width.
    pub fn d_hidden(&self) -> usize {
        self.w1.weight.dims()[1]
    }
}
