//! Stable LatentMoE (design §2): routed experts in a narrower latent space, an RMSNorm on their
//! aggregate, full-width shared experts, and a balanced sigmoid router.

use crate::ops::backend::host;
use crate::ops::layout;
use crate::ops::linear::{linear, linear_add};
use burn::config::Config;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Bool, Tensor};
use serde::{Deserialize, Serialize};

use super::balance::{expert_loads, BalanceState, BalancerKind, MoeLoads, MoeStats, RoutedBatch};
use super::experts::RoutedExperts;
use super::norm::{RmsNorm, RmsNormConfig};
use super::router::{Router, RouterConfig, RouterOptions};
use super::situ_glu::{GluActivation, SituGlu, SituGluConfig};
use crate::error::{Error, Result};
use crate::ops::moe::dispatch::routed_experts;
use crate::ops::quant::QatConfig;

use crate::ops::moe::route::TokenMask;

/// Where the routed experts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum MoeLayout {
    /// A standard MoE: experts at full width (`ℓ = d`, no projections).
    Standard,
    /// LatentMoE: `W_down` to `ℓ`, experts at `ℓ`, `W_up` back to `d`.
    Latent {
        /// The latent width `ℓ`.
        dim: usize,
    },
    /// Stable LatentMoE (K3): LatentMoE with an RMSNorm on the aggregate before `W_up`.
    StableLatent {
        /// The latent width `ℓ`.
        dim: usize,
    },
}

impl MoeLayout {
    /// The width the experts run at for model width `d`.
    pub fn expert_width(&self, d_model: usize) -> usize {
        match *self {
            Self::Standard => d_model,
            Self::Latent { dim } | Self::StableLatent { dim } => dim,
        }
    }
}

/// Configuration of [`LatentMoe`].
#[derive(Config, Debug)]
pub struct LatentMoeConfig {
    /// Model width `d`.
    pub d_model: usize,
    /// Routed experts `n`.
    pub n_experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Hidden width of a routed expert `m_e` (`moe_intermediate_size`, `routed_expert_hidden_size`).
    pub expert_hidden: usize,
    /// Standard, Latent or Stable Latent.
    #[config(default = "MoeLayout::Standard")]
    pub layout: MoeLayout,
    /// Number of shared experts (always full width, stored fused: hidden `n_shared · shared_hidden`).
    #[config(default = 0)]
    pub n_shared: usize,
    /// Hidden width of one shared expert; `None` uses `expert_hidden`.
    #[config(default = "None")]
    pub shared_hidden: Option<usize>,
    /// Activation of every expert (routed and shared).
    #[config(default = "GluActivation::situ()")]
    pub activation: GluActivation,
    /// Router scoring, renormalisation, scaling and grouping.
    #[config(default = "RouterOptions::default()")]
    pub router: RouterOptions,
    /// The load balancer.
    #[config(default = "BalancerKind::quantile()")]
    pub balancer: BalancerKind,
    /// Epsilon of the latent RMSNorm.
    #[config(default = 1e-5)]
    pub rms_norm_eps: f64,
    /// Quantisation-aware training of the routed experts (and of the shared ones if it says so),
    /// design §9; `None`: full precision.
    #[config(default = "None")]
    pub qat: Option<QatConfig>,
}

impl LatentMoeConfig {
    /// The router config this MoE uses.
    pub fn router_config(&self) -> RouterConfig {
        RouterConfig::new(self.d_model, self.n_experts, self.top_k).with_options(self.router)
    }

    /// Checks every width, `k`, the router and the activation.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || self.expert_hidden == 0 {
            return Err(Error::config(
                "expert_hidden",
                format!(
                    "widths must be positive, got d_model = {}, expert_hidden = {}",
                    self.d_model, self.expert_hidden
                ),
            ));
        }
        if let MoeLayout::Latent { dim } | MoeLayout::StableLatent { dim } = self.layout {
            if dim == 0 || dim > self.d_model {
                return Err(Error::config(
                    "latent_dim",
                    format!(
                        "need 0 < latent_dim <= d_model = {}, got {dim}",
                        self.d_model
                    ),
                ));
            }
        }
        if self.shared_hidden == Some(0) {
            return Err(Error::config("shared_hidden", "must be positive, got 0"));
        }
        self.router_config().validate()?;
        self.activation.validate()
    }

    /// Builds the layer, or reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<LatentMoe<B>> {
        self.validate()?;
        let width = self.layout.expert_width(self.d_model);
        let experts = RoutedExperts::new(
            self.n_experts,
            width,
            self.expert_hidden,
            self.activation,
            self.qat,
            device,
        );
        let shared = (self.n_shared > 0).then(|| {
            let hidden = self.n_shared * self.shared_hidden.unwrap_or(self.expert_hidden);
            SituGluConfig::new(self.d_model, hidden)
                .with_activation(self.activation)
                .with_qat(self.qat.filter(|q| q.shared_experts))
                .init(device)
        });
        let latent = !matches!(self.layout, MoeLayout::Standard);
        Ok(LatentMoe {
            router: self.router_config().try_init(device)?,
            experts,
            shared,
            down: latent.then(|| super::linear(self.d_model, width, device)),
            up: latent.then(|| super::linear(width, self.d_model, device)),
            norm: matches!(self.layout, MoeLayout::StableLatent { .. }).then(|| {
                RmsNormConfig::new(width)
                    .with_epsilon(self.rms_norm_eps)
                    .init(device)
            }),
            balance: {
                let balance = BalanceState::new(self.n_experts, self.balancer, device)?;
                balance.set_top_k(self.top_k);
                balance
            },
        })
    }

    /// Builds the layer.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> LatentMoe<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Parameters of the layer: `(total, active per token)`.
    pub fn num_params(&self) -> (u64, u64) {
        let d = self.d_model as u64;
        let w = self.layout.expert_width(self.d_model) as u64;
        let expert = 3 * w * self.expert_hidden as u64;
        let shared =
            3 * d * (self.n_shared * self.shared_hidden.unwrap_or(self.expert_hidden)) as u64;
        let router = d * self.n_experts as u64;
        let proj = match self.layout {
            MoeLayout::Standard => 0,
            MoeLayout::Latent { .. } => 2 * d * w,
            MoeLayout::StableLatent { .. } => 2 * d * w + w,
        };
        let common = shared + router + proj;
        (
            common + self.n_experts as u64 * expert,
            common + self.top_k as u64 * expert,
        )
    }
}

/// The output of a MoE forward pass.
#[derive(Debug, Clone)]
pub struct MoeOutput<B: Backend> {
    /// `[batch, seq, d_model]`.
    pub output: Tensor<B, 3>,
    /// The expert loads of this call (valid tokens only), where they were counted: on the
    /// device on the kernel path, read only when asked.
    pub loads: MoeLoads<B>,
}

impl<B: Backend> MoeOutput<B> {
    /// The load statistics of this call (one device read on the kernel path).
    pub fn stats(&self) -> MoeStats {
        self.loads.stats()
    }
}

/// Stable LatentMoE (design §2):
///
/// ```text
/// h = W_down x;   u = Σ_{i∈T} p_i · E_i(h);   y = W_up · RMSNorm(u) + SharedFFN(x)
/// ```
///
/// with the router seeing the full-width `x`. Dispatch is dropless and routed-only.
/// In training forwards (autodiff backends) the balancer accumulates statistics; call
/// [`update_balance`](Self::update_balance) once per optimiser step.
#[derive(Module, Debug)]
pub struct LatentMoe<B: Backend> {
    /// The router (`gate`).
    pub router: Router<B>,
    /// The routed experts, stacked (`experts.{e}.{w1,w3,w2}` in checkpoints).
    pub experts: RoutedExperts<B>,
    /// The shared experts, fused (`shared_experts.{gate,up,down}_proj`).
    pub shared: Option<SituGlu<B>>,
    /// `W_down` `[d, ℓ]` (`routed_expert_down_proj`); absent for a standard MoE.
    pub down: Option<Linear<B>>,
    /// `W_up` `[ℓ, d]` (`routed_expert_up_proj`); absent for a standard MoE.
    pub up: Option<Linear<B>>,
    /// The aggregate norm of Stable LatentMoE (`routed_expert_norm`).
    pub norm: Option<RmsNorm<B>>,
    /// The balance bias (`gate.e_score_correction_bias`) and the balancer's counts.
    pub balance: BalanceState<B>,
}

impl<B: Backend> LatentMoe<B> {
    /// `x: [batch, seq, d_model]` → output and load statistics.
    ///
    /// # Panics
    /// On a width mismatch or NaN router scores (see [`try_forward`](Self::try_forward)).
    pub fn forward(&self, x: Tensor<B, 3>) -> MoeOutput<B> {
        self.try_forward(x, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `x: [batch, seq, d_model]`, `padding: [batch, seq]` (`true` marks padding tokens, which are
    /// neither dispatched nor counted; their routed output is zero).
    ///
    /// On the kernel path (the CubeCL backends) nothing is read back to the host: the routing,
    /// the balancer's counts, the expert loads and the padding mask stay on the device.
    ///
    /// On the CPU backends it runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    pub fn try_forward(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<MoeOutput<B>> {
        crate::ops::backend::on_cpu_pool::<B, _>(|| self.try_forward_here(x, padding))
    }

    /// [`try_forward`](Self::try_forward) on this thread.
    fn try_forward_here(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<MoeOutput<B>> {
        let [batch, seq, d] = x.dims();
        // Checked before anything runs: the shared expert may run beside the router, which
        // would otherwise be the first to see a wrong width.
        let d_model = self.router.gate.weight.dims()[0];
        if d != d_model {
            return Err(Error::shape(
                "moe input",
                format!("[batch, seq, {d_model}]"),
                [batch, seq, d],
            ));
        }
        let m = batch * seq;
        let valid = padding
            .map(|mask| token_mask(mask, [batch, seq]))
            .transpose()?;
        let flat = layout::reshape(x, [m, d]);
        let device = flat.device();
        let bias = self.balance.bias_host();
        let n = bias.len();
        let training = B::ad_enabled(&device);
        // On the kernel path the QB histogram is counted by the routing kernel itself.
        let spec = training
            .then(|| self.balance.histogram_spec(&bias))
            .flatten();
        let routed = || -> Result<(MoeLoads<B>, Tensor<B, 2>)> {
            let routing = self
                .router
                .route_with(flat.clone(), &bias, spec, valid.as_ref())?;
            let k = routing.indices.dims()[1];
            let host_valid = || valid.as_ref().map(TokenMask::host);
            let loads = match &routing.scores_host {
                Some(scores) => {
                    let batch = RoutedBatch {
                        scores,
                        bias: &bias,
                        selection: routing.selection(),
                        valid: host_valid(),
                    };
                    if training {
                        self.balance.observe(&batch)?;
                    }
                    let stats = MoeStats::from_selection(routing.selection(), host_valid());
                    MoeLoads::from_host(stats.tokens_per_expert, batch.median_margin()?)
                }
                None => {
                    let loads = expert_loads(
                        &routing.indices,
                        valid.as_ref().map(|v| v.device(&device)),
                        n,
                    );
                    if training {
                        match &routing.histogram {
                            Some(counts) => {
                                self.balance.observe_device(counts.clone(), &bias, k)?
                            }
                            None => self.balance.observe_device(loads.clone(), &bias, k)?,
                        }
                    }
                    MoeLoads::from_device(loads)
                }
            };
            let h = match &self.down {
                Some(down) => linear(down, flat.clone()),
                None => flat.clone(),
            };
            let h = match &self.experts.qat {
                Some(q) => q.activation(h),
                None => h,
            };
            let mut u = routed_experts(
                h,
                &routing.indices,
                routing.weights.clone(),
                || routing.selection(),
                valid.as_ref(),
                &self.experts.stacked(),
            );
            if let Some(norm) = &self.norm {
                u = norm.forward(u);
            }
            Ok((loads, u))
        };
        let shared = || {
            self.shared
                .as_ref()
                .map(|shared| shared.forward(flat.clone()))
        };
        // An untracked forward on the CPU host kernels runs the shared expert beside the routed
        // path: both are split over rayon's pool, and the pool fills the waits of one (a
        // product's synchronisation, the last expert) with the work of the other. Tracked
        // forwards stay in one order, so that the autodiff graph (and with it the summation
        // order of the gradients) is the same on every run.
        let ((loads, u), shared) = if !training && host::is_cpu_backend::<B>() {
            let (routed, shared) = crate::ops::backend::join(routed, shared);
            (routed?, shared)
        } else {
            (routed()?, shared())
        };
        let y = match (&self.up, shared) {
            (Some(up), Some(shared)) => linear_add(up, u, shared),
            (Some(up), None) => linear(up, u),
            (None, Some(shared)) => u.add(shared),
            (None, None) => u,
        };
        Ok(MoeOutput {
            output: layout::reshape(y, [batch, seq, d]),
            loads,
        })
    }

    /// This layer with its experts' QAT weight quantisation applied once (routed and shared),
    /// for inference ([`RoutedExperts::with_quantized_weights`]).
    pub fn with_quantized_weights(mut self) -> Self {
        self.experts = self.experts.with_quantized_weights();
        self.shared = self.shared.map(SituGlu::with_quantized_weights);
        self
    }

    /// Applies the balancer to the bias from the statistics accumulated since the last call
    /// (once per optimiser step, after all micro-batches). Returns the new bias.
    pub fn update_balance(&self) -> Vec<f32> {
        self.balance.update()
    }

    /// A copy for another data-parallel replica on `device`: the same weights, forked (new
    /// autodiff leaves, so the replicas' graphs stay apart), and its own balance state
    /// ([`BalanceState::replica`]).
    pub fn replica(&self, device: &B::Device) -> Self {
        let mut copy = self.clone().fork(device);
        copy.balance = self.balance.replica(device);
        copy
    }
}

/// The tokens of a `[batch, seq]` padding mask (`true`: padding) that count, on the device.
fn token_mask<B: Backend>(
    mask: Tensor<B, 2, Bool>,
    [batch, seq]: [usize; 2],
) -> Result<TokenMask<B>> {
    let dims = mask.dims();
    if dims != [batch, seq] {
        return Err(Error::shape(
            "padding mask",
            format!("[{batch}, {seq}]"),
            dims,
        ));
    }
    Ok(TokenMask::from_padding(mask))
}
