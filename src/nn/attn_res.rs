//! One Attention Residuals mix (design §6): a learned softmax over depth that replaces a residual
//! sum in K3's block form.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{backend::Backend, Tensor};

use crate::error::{Error, Result};
use crate::ops::attn_res::attn_res;

/// Configuration of [`AttnResMix`].
#[derive(Config, Debug)]
pub struct AttnResConfig {
    /// Model width `d`.
    pub d_model: usize,
    /// Epsilon of the key RMSNorm (`rms_norm_eps`).
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl AttnResConfig {
    /// Checks the width and the epsilon.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 {
            return Err(Error::config("d_model", "must be positive, got 0"));
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0) {
            return Err(Error::config(
                "epsilon",
                format!("must be finite and positive, got {}", self.epsilon),
            ));
        }
        Ok(())
    }

    /// Builds the mix at its initial point (`proj = 0`, `norm = 1`: the mean of the sources), or
    /// reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<AttnResMix<B>> {
        self.validate()?;
        Ok(AttnResMix {
            proj: Param::from_tensor(Tensor::zeros([self.d_model], device)),
            norm: Param::from_tensor(Tensor::ones([self.d_model], device)),
            epsilon: self.epsilon,
        })
    }

    /// Builds the mix.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> AttnResMix<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Parameters of one mix: `2·d`.
    pub fn num_params(&self) -> u64 {
        2 * self.d_model as u64
    }
}

/// One AttnRes pseudo-query pair: `out = Σ_n softmax_n(RMSNorm_norm(V_n) · proj) · V_n` over the
/// sources `V = [blocks…, partial]` (design §6, [`attn_res`]).
///
/// **Parameterisation.** `norm` is the gain of the RMSNorm that makes the keys and starts at
/// **one**; `proj` is the pseudo-query and starts at **zero** (design §6: "the pseudo-queries start at
/// zero"). At that point every score is 0 and the mix is the mean of its sources, as design §6
/// requires. Zero for both would also give the mean, but every gradient would then vanish
/// (`∂score/∂proj = K⊙norm = 0` and `∂score/∂norm = K⊙proj = 0`), and the mix could never leave
/// the mean; with `norm = 1`, `proj` receives `K`-weighted gradients from the first step and
/// `norm` follows once `proj ≠ 0`. This is the usual init of an RMSNorm gain and a zeroed query.
///
/// Checkpoint names (per layer `model.layers.{i}.`): `self_attention_res_proj`,
/// `self_attention_res_norm` (before the mixer), `mlp_res_proj`, `mlp_res_norm` (before the FFN);
/// and `model.output_attn_res_proj`, `model.output_attn_res_norm` (before the final norm). The
/// `*_proj` tensor is the pseudo-query (`[d]`, or a `[1, d]` PyTorch `Linear(d, 1)` weight to
/// flatten), the `*_norm` tensor the RMSNorm gain `[d]`; these shapes are a reconstruction.
#[derive(Module, Debug)]
pub struct AttnResMix<B: Backend> {
    /// The pseudo-query `w_proj: [d]`.
    pub proj: Param<Tensor<B, 1>>,
    /// The key RMSNorm gain `w_norm: [d]`.
    pub norm: Param<Tensor<B, 1>>,
    /// Epsilon of the key RMSNorm.
    pub epsilon: f64,
}

impl<B: Backend> AttnResMix<B> {
    /// Mixes `partial: [B, T, d]` (the current partial sum) with the completed `blocks` (each
    /// `[B, T, d]`, the embedding first) → `[B, T, d]`. With no block this is `partial` itself.
    ///
    /// # Panics
    /// When a block's shape differs from `partial`'s, or `d` from the config's.
    pub fn forward(&self, partial: Tensor<B, 3>, blocks: &[Tensor<B, 3>]) -> Tensor<B, 3> {
        attn_res(
            partial,
            blocks,
            self.proj.val(),
            self.norm.val(),
            self.epsilon,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn counts_and_errors() {
        let device = Default::default();
        let mix = AttnResConfig::new(12).init::<NdArray<f32>>(&device);
        assert_eq!(mix.num_params() as u64, AttnResConfig::new(12).num_params());
        let err = AttnResConfig::new(0)
            .try_init::<NdArray<f32>>(&device)
            .expect_err("d")
            .to_string();
        assert!(err.contains("d_model"), "{err}");
        let err = AttnResConfig::new(4)
            .with_epsilon(0.0)
            .validate()
            .expect_err("eps")
            .to_string();
        assert!(err.contains("epsilon") && err.contains('0'), "{err}");
    }
}
