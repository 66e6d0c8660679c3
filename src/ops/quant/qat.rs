//! Quantisation-aware training with MX formats (design §9): which tensors of a matmul are
//! fake-quantised, and the helpers the modules call.

use burn::nn::Linear;
use burn::tensor::{backend::Backend, Tensor};
use serde::{Deserialize, Serialize};

use super::{mx_fake_quant, MxFormat, MxScaleRule};

/// An MX format with its scale rule: what one fake quantisation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MxSpec {
    /// The element format.
    pub format: MxFormat,
    /// How each block's scale is chosen.
    pub rule: MxScaleRule,
}

impl MxSpec {
    /// A format and a rule.
    pub fn new(format: MxFormat, rule: MxScaleRule) -> Self {
        Self { format, rule }
    }

    /// MXFP4 (E2M1) with the specification's scale rule.
    pub fn mxfp4() -> Self {
        Self::new(MxFormat::Fp4E2M1, MxScaleRule::Floor)
    }

    /// MXFP8 E4M3 with the specification's scale rule.
    pub fn mxfp8() -> Self {
        Self::new(MxFormat::Fp8E4M3, MxScaleRule::Floor)
    }

    /// [`mx_fake_quant`] of `x` along `axis` (straight-through gradient).
    pub fn fake_quant<B: Backend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        axis: usize,
    ) -> Tensor<B, D> {
        mx_fake_quant(x, self.format, self.rule, axis)
    }
}

/// Quantisation-aware training of the expert matmuls (K3 trains its routed experts with MXFP4
/// weights and MXFP8 activations): every weight is fake-quantised in blocks along its input
/// (reduction) dimension and every activation entering the matmul along its feature dimension, so
/// each block is one the matmul reduces over, as an MX matmul would read it. Gradients pass
/// straight through.
///
/// The routed experts always follow it when a [`LatentMoeConfig`](crate::nn::LatentMoeConfig)
/// carries one; the shared experts and the dense FFN layers when asked. Any other `Linear` can use
/// [`linear`](Self::linear).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct QatConfig {
    /// The weights' format; `None` keeps them in full precision.
    pub weights: Option<MxSpec>,
    /// The format of the activations entering the matmuls; `None` keeps them in full precision.
    pub activations: Option<MxSpec>,
    /// Also quantise the shared experts of every MoE layer.
    #[serde(default)]
    pub shared_experts: bool,
    /// Also quantise the dense FFN layers.
    #[serde(default)]
    pub dense_ffn: bool,
    /// The weights already hold their quantised values
    /// ([`KimiForCausalLM::with_quantized_weights`](crate::model::KimiForCausalLM::with_quantized_weights)):
    /// [`weight`](Self::weight) passes them through instead of quantising them again on every
    /// forward. A property of a module's weights, not of the recipe: configs neither write nor
    /// read it.
    #[serde(skip)]
    pub weights_quantized: bool,
}

impl QatConfig {
    /// Weights and activations in the given formats, routed experts only.
    pub fn new(weights: Option<MxSpec>, activations: Option<MxSpec>) -> Self {
        Self {
            weights,
            activations,
            shared_experts: false,
            dense_ffn: false,
            weights_quantized: false,
        }
    }

    /// K3's recipe: MXFP4 (E2M1) weights and MXFP8 (E4M3) activations, the specification's scale
    /// rule, routed experts only.
    pub fn mxfp4() -> Self {
        Self::new(Some(MxSpec::mxfp4()), Some(MxSpec::mxfp8()))
    }

    /// Also (or no longer) the shared experts.
    pub fn with_shared_experts(mut self, on: bool) -> Self {
        self.shared_experts = on;
        self
    }

    /// Also (or no longer) the dense FFN layers.
    pub fn with_dense_ffn(mut self, on: bool) -> Self {
        self.dense_ffn = on;
        self
    }

    /// A weight fake-quantised along `axis`, its input dimension (0 for a Burn `Linear`'s
    /// `[d_in, d_out]`; 1 for stacked experts `[n, d_in, d_out]`); unchanged without a weight format.
    pub fn weight<B: Backend, const D: usize>(&self, w: Tensor<B, D>, axis: usize) -> Tensor<B, D> {
        match self.weights {
            Some(spec) if !self.weights_quantized => spec.fake_quant(w, axis),
            _ => w,
        }
    }

    /// Whether [`weight`](Self::weight) quantises (a weight format, weights not yet quantised).
    pub(crate) fn quantizes_weights(&self) -> bool {
        self.weights.is_some() && !self.weights_quantized
    }

    /// This config for weights that already hold their quantised values.
    pub(crate) fn with_weights_quantized(self) -> Self {
        Self {
            weights_quantized: true,
            ..self
        }
    }

    /// An activation `[..., features]` fake-quantised along its last axis; unchanged without an
    /// activation format.
    pub fn activation<B: Backend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self.activations {
            Some(spec) => spec.fake_quant(x, D - 1),
            None => x,
        }
    }

    /// `linear.forward(x)` with its weight and its input fake-quantised (the bias stays in full
    /// precision).
    pub fn linear<B: Backend, const D: usize>(
        &self,
        linear: &Linear<B>,
        x: Tensor<B, D>,
    ) -> Tensor<B, D> {
        burn::tensor::module::linear(
            self.activation(x),
            self.weight(linear.weight.val(), 0),
            linear.bias.as_ref().map(|b| b.val()),
        )
    }
}
