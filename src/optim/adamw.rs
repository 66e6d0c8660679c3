//! [`KimiAdamW`]: Burn's AdamW with each parameter's step fused into one kernel on the CubeCL
//! backends.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{
    AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

use crate::error::{Error, Result};
use crate::ops::backend::kernels_available;
use crate::ops::optim::{adamw_update, AdamWScalars};

/// AdamW as Burn's `AdamW` computes it, one parameter at a time, with the same state
/// (`AdamWState`, so records and checkpoints are interchangeable with Burn's).
///
/// On the CubeCL backends each parameter's step is one kernel launch
/// ([`adamw_update`]) instead of about fourteen tensor ops; the
/// results agree with Burn's to f32 rounding (a device compiler may contract a product and a sum
/// into one fused multiply-add). Every other backend, and the AMSGrad and cautious-weight-decay
/// variants, run Burn's `AdamW` itself.
#[derive(Clone)]
pub struct KimiAdamW {
    /// Burn's optimiser, for the paths that keep its tensor ops.
    burn: AdamW,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    /// Neither AMSGrad nor cautious weight decay: the fused kernel applies.
    fusable: bool,
}

/// The values of an [`AdamWConfig`] that Burn keeps private, read through its serialised form.
#[derive(serde::Deserialize)]
struct AdamWValues {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    #[serde(default)]
    cautious_weight_decay: bool,
    #[serde(default)]
    amsgrad: bool,
    #[serde(default)]
    grad_clipping: Option<GradientClippingConfig>,
}

impl KimiAdamW {
    /// The optimiser of `config` (its gradient clipping, if any, belongs to the adaptor:
    /// [`init`](Self::init) attaches it).
    ///
    /// Errors when the config cannot be read (it always can for an `AdamWConfig` of Burn 0.21).
    pub fn new(config: &AdamWConfig) -> Result<Self> {
        Self::from_config(config).map(|(optim, _)| optim)
    }

    /// The optimiser of `config` and the gradient clipping it asks for.
    fn from_config(config: &AdamWConfig) -> Result<(Self, Option<GradientClippingConfig>)> {
        let values: AdamWValues = serde_json::to_value(config)
            .and_then(serde_json::from_value)
            .map_err(|e| Error::config("adamw", format!("cannot read the AdamW config: {e}")))?;
        let optim = Self {
            burn: config.build(),
            beta1: values.beta_1,
            beta2: values.beta_2,
            eps: values.epsilon,
            weight_decay: values.weight_decay,
            fusable: !values.amsgrad && !values.cautious_weight_decay,
        };
        Ok((optim, values.grad_clipping))
    }

    /// The adaptor Burn's `AdamWConfig::init` would build (gradient clipping included), with this
    /// optimiser inside.
    ///
    /// Errors as [`new`](Self::new).
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        config: &AdamWConfig,
    ) -> Result<OptimizerAdaptor<Self, M, B>> {
        let (optim, clipping) = Self::from_config(config)?;
        let adaptor = OptimizerAdaptor::from(optim);
        Ok(match clipping {
            Some(clipping) => adaptor.with_grad_clipping(clipping.init()),
            None => adaptor,
        })
    }
}

impl<B: Backend> SimpleOptimizer<B> for KimiAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        if !(self.fusable && kernels_available::<B>()) {
            return self.burn.step(lr, tensor, grad, state);
        }
        let (time, m1, m2) = match state {
            Some(state) => {
                let m = state.momentum;
                (m.time + 1, m.moment_1, m.moment_2)
            }
            None => (1, grad.zeros_like(), grad.zeros_like()),
        };
        let scalars = AdamWScalars::new(
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            lr,
            time as i32,
        );
        let (tensor, m1, m2) = adamw_update(tensor, grad, m1, m2, scalars);
        let momentum = AdaptiveMomentumState::new(time, m1, m2);
        (tensor, Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        <AdamW as SimpleOptimizer<B>>::to_device(state, device)
    }
}
