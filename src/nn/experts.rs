//! The routed experts of a MoE layer as three stacked parameters (design §2).

use burn::module::{Module, Param, ParamId};
use burn::tensor::{backend::Backend, Distribution, Shape, Tensor};

use super::situ_glu::{GluActivation, SituGlu, SituGluConfig};
use crate::ops::moe::dispatch::StackedExperts;
use crate::ops::quant::QatConfig;

/// The `n` routed experts of a MoE layer, each a bias-free GLU FFN `W2ᵀ·act(W1ᵀh, W3ᵀh)` of width
/// `ℓ` and hidden width `m_e`, stored stacked along a leading expert axis so that the grouped
/// kernels and the reference path use the parameters as they are (no restacking per forward, no
/// split of the gradient).
///
/// Checkpoints keep one matrix per expert (`experts.{e}.w1.weight` is `W1[e]ᵀ`, PyTorch's
/// `[out, in]`); [`crate::store`] splits and joins at save and load. The optimiser treats each
/// expert's matrix as its own matrix: a rank-3 parameter with the Muon role is orthogonalised per
/// leading index (a batched Newton–Schulz over `n`).
#[derive(Module, Debug)]
pub struct RoutedExperts<B: Backend> {
    /// Gate projections `W1: [n, ℓ, m_e]`.
    pub w1: Param<Tensor<B, 3>>,
    /// Up projections `W3: [n, ℓ, m_e]`.
    pub w3: Param<Tensor<B, 3>>,
    /// Down projections `W2: [n, m_e, ℓ]`.
    pub w2: Param<Tensor<B, 3>>,
    /// The experts' activation.
    #[module(skip)]
    pub activation: GluActivation,
    /// Quantisation-aware training of the three matmuls (design §9).
    #[module(skip)]
    pub qat: Option<QatConfig>,
}

/// A lazily initialised stack `[n, fan_in, fan_out]`, uniform in `±1/sqrt(fan_in)`.
fn lazy_stack<B: Backend>(shape: [usize; 3], device: &B::Device) -> Param<Tensor<B, 3>> {
    let bound = 1.0 / (shape[1].max(1) as f64).sqrt();
    Param::uninitialized(
        ParamId::new(),
        move |device: &B::Device, require_grad| {
            Tensor::<B, 3>::random(shape, Distribution::Uniform(-bound, bound), device)
                .set_require_grad(require_grad)
        },
        device.clone(),
        true,
        Shape::new(shape),
    )
}

impl<B: Backend> RoutedExperts<B> {
    /// `n` experts of width `width` (`ℓ`) and hidden width `hidden` (`m_e`), initialised like
    /// Burn's `Linear` (uniform in `±1/sqrt(fan_in)`), expert by expert in the order `n`
    /// separate [`SituGlu`] FFNs would draw them, so a seed gives the same weights either way.
    pub fn new(
        n: usize,
        width: usize,
        hidden: usize,
        activation: GluActivation,
        qat: Option<QatConfig>,
        device: &B::Device,
    ) -> Self {
        if super::in_skeleton() {
            return Self {
                w1: lazy_stack([n, width, hidden], device),
                w3: lazy_stack([n, width, hidden], device),
                w2: lazy_stack([n, hidden, width], device),
                activation,
                qat,
            };
        }
        let config = SituGluConfig::new(width, hidden);
        let mut parts: [Vec<Tensor<B, 2>>; 3] = Default::default();
        for _ in 0..n {
            let e = config.init::<B>(device);
            parts[0].push(e.w1.weight.val());
            parts[1].push(e.w3.weight.val());
            parts[2].push(e.w2.weight.val());
        }
        let shapes = [[width, hidden], [width, hidden], [hidden, width]];
        let [w1, w3, w2] = std::array::from_fn(|i| {
            let p = std::mem::take(&mut parts[i]);
            Param::from_tensor(if p.is_empty() {
                Tensor::zeros([0, shapes[i][0], shapes[i][1]], device)
            } else {
                Tensor::stack::<3>(p, 0).detach()
            })
        });
        Self {
            w1,
            w3,
            w2,
            activation,
            qat,
        }
    }

    /// The number of experts `n`.
    pub fn len(&self) -> usize {
        self.w1.lazy_shape()[0]
    }

    /// True without experts.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The experts' width `ℓ`.
    pub fn width(&self) -> usize {
        self.w1.lazy_shape()[1]
    }

    /// The experts' hidden width `m_e`.
    pub fn hidden(&self) -> usize {
        self.w1.lazy_shape()[2]
    }

    /// Expert `e` as a standalone [`SituGlu`] (`w1`, `w3`: `[ℓ, m_e]`, `w2`: `[m_e, ℓ]`; new
    /// parameters holding copies of its weights, not tracked back to the stack; for inspection and
    /// tests).
    ///
    /// # Panics
    /// If `e ≥ n`.
    pub fn expert(&self, e: usize) -> SituGlu<B> {
        assert!(e < self.len(), "expert {e} of {}", self.len());
        let pick = |p: &Param<Tensor<B, 3>>| {
            let [_, a, b] = p.dims();
            // A copy cut out of the stack (detached: a new leaf parameter, not a view).
            let w: Tensor<B, 2> = p.val().narrow(0, e, 1).reshape([a, b]).detach();
            burn::nn::Linear {
                weight: Param::from_tensor(w),
                bias: None,
            }
        };
        SituGlu {
            w1: pick(&self.w1),
            w3: pick(&self.w3),
            w2: pick(&self.w2),
            activation: self.activation,
            qat: self.qat,
        }
    }

    /// The weights the matmuls read, with QAT's weight quantisation applied (blocks along each
    /// matrix's input dimension), and the hidden quantisation: what
    /// [`routed_experts`](crate::ops::moe::dispatch::routed_experts) takes.
    pub fn stacked(&self) -> StackedExperts<B> {
        let w = |p: &Param<Tensor<B, 3>>| match &self.qat {
            Some(q) => q.weight(p.val(), 1),
            None => p.val(),
        };
        StackedExperts {
            w1: w(&self.w1),
            w3: w(&self.w3),
            w2: w(&self.w2),
            activation: self.activation,
            hidden_quant: self.qat.and_then(|q| q.activations),
        }
    }

    /// These experts with their QAT weight quantisation applied once, for inference: the
    /// stacks hold their quantised values and [`stacked`](Self::stacked) no longer quantises
    /// every expert's weights on each forward (a decode step then costs the routed experts'
    /// work, not a pass over all of them). Unchanged without a weight format.
    pub fn with_quantized_weights(mut self) -> Self {
        if let Some(q) = self.qat.filter(QatConfig::quantizes_weights) {
            for stack in [&mut self.w1, &mut self.w3, &mut self.w2] {
                *stack = stack.clone().map(|w| q.weight(w, 1));
            }
            self.qat = Some(q.with_weights_quantized());
        }
        self
    }
}
