//! The gated FFN used by every Kimi K3 FFN (dense layer, shared and routed experts), SPEC §1.

use burn::config::Config;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ops::situ::{situ_glu, swiglu};

/// The gated activation of a GLU FFN.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum GluActivation {
    /// SiTU-GLU `β1·tanh(g/β1)·σ(g) ⊙ β2·tanh(v/β2)` (K3; `β1 = 4`, `β2 = Some(25)`).
    Situ {
        /// Gate cap `activation_situ_beta`.
        beta1: f32,
        /// Linear-branch cap `activation_situ_linear_beta`; `None` leaves the branch linear.
        beta2: Option<f32>,
    },
    /// SwiGLU `SiLU(g) ⊙ v` (Kimi-Linear, DeepSeek-V3).
    SwiGlu,
}

/// The same activation as the fused kernels name it.
impl From<GluActivation> for crate::ops::fused::FusedActivation {
    fn from(a: GluActivation) -> Self {
        match a {
            GluActivation::Situ { beta1, beta2 } => Self::Situ { beta1, beta2 },
            GluActivation::SwiGlu => Self::SwiGlu,
        }
    }
}

impl Default for GluActivation {
    fn default() -> Self {
        Self::situ()
    }
}

impl GluActivation {
    /// SiTU-GLU with the K3 constants `β1 = 4`, `β2 = 25`.
    pub fn situ() -> Self {
        Self::Situ {
            beta1: 4.0,
            beta2: Some(25.0),
        }
    }

    /// Checks that the caps are finite and positive.
    pub fn validate(&self) -> Result<()> {
        if let Self::Situ { beta1, beta2 } = *self {
            if !(beta1.is_finite() && beta1 > 0.0) {
                return Err(Error::config(
                    "activation_situ_beta",
                    format!("must be finite and positive, got {beta1}"),
                ));
            }
            if let Some(b2) = beta2 {
                if !(b2.is_finite() && b2 > 0.0) {
                    return Err(Error::config(
                        "activation_situ_linear_beta",
                        format!("must be finite and positive, got {b2}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies the activation to the gate and up projections (same shape).
    pub fn apply<B: Backend, const D: usize>(
        &self,
        gate: Tensor<B, D>,
        up: Tensor<B, D>,
    ) -> Tensor<B, D> {
        match *self {
            Self::Situ { beta1, beta2 } => situ_glu(gate, up, beta1, beta2),
            Self::SwiGlu => swiglu(gate, up),
        }
    }
}

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

/// A GLU FFN `y = W2 · act(W1 x, W3 x)` (SPEC §1).
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
}

impl<B: Backend> SituGlu<B> {
    /// `x: [..., d_model]` → `[..., d_model]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.w2.forward(self.hidden(x))
    }

    /// The activated hidden state `act(W1 x, W3 x)`: `[..., d_hidden]`.
    pub fn hidden<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let gate = self.w1.forward(x.clone());
        let up = self.w3.forward(x);
        self.activation.apply(gate, up)
    }

    /// Hidden width.
    pub fn d_hidden(&self) -> usize {
        self.w1.weight.dims()[1]
    }
}
