//! The auxiliary-loss-free router (design §2).

use burn::config::Config;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{activation::softmax, backend::Backend, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::nn::balance::HistogramSpec;
use crate::ops::moe::route::{
    route_top_k_fused, select_top_k, to_host_f32, Scoring, Selection, TokenMask, TopKOptions,
};
use crate::ops::precision::{sigmoid, widen};

/// Routing options shared by [`RouterConfig`] and the MoE config.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterOptions {
    /// Score function (`moe_router_activation_func`): sigmoid (Kimi) or softmax.
    pub scoring: Scoring,
    /// Renormalise the selected weights to sum to one (`moe_renormalize`).
    pub renormalize: bool,
    /// Multiplies the final weights (`routed_scaling_factor`; K3 1.0, Kimi-Linear 2.446).
    pub routed_scaling_factor: f64,
    /// Expert groups for grouped top-k (`num_expert_group`); 1 disables grouping.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`).
    pub topk_group: usize,
    /// Compatibility switch: take the weights from the *biased* scores, as the Hugging Face
    /// `modeling_kimi.py` of Kimi-Linear does. Off by default (DeepSeek-V3, vLLM: unbiased).
    pub weights_from_biased_scores: bool,
}

impl Default for RouterOptions {
    fn default() -> Self {
        Self {
            scoring: Scoring::Sigmoid,
            renormalize: true,
            routed_scaling_factor: 1.0,
            n_group: 1,
            topk_group: 1,
            weights_from_biased_scores: false,
        }
    }
}

/// Configuration of [`Router`].
#[derive(Config, Debug)]
pub struct RouterConfig {
    /// Width of the (full-width) input `x`.
    pub d_model: usize,
    /// Routed experts `n`.
    pub n_experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Scoring, renormalisation, scaling and grouping.
    #[config(default = "RouterOptions::default()")]
    pub options: RouterOptions,
}

impl RouterConfig {
    /// Checks `1 ≤ k < n`, the grouping and the scaling factor.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 {
            return Err(Error::config("d_model", "must be positive, got 0"));
        }
        self.topk_options().validate(self.n_experts)?;
        let s = self.options.routed_scaling_factor;
        if !(s.is_finite() && s > 0.0) {
            return Err(Error::config(
                "routed_scaling_factor",
                format!("must be finite and positive, got {s}"),
            ));
        }
        Ok(())
    }

    fn topk_options(&self) -> TopKOptions {
        TopKOptions {
            k: self.top_k,
            n_group: self.options.n_group,
            topk_group: self.options.topk_group,
        }
    }

    /// Builds the router, or reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<Router<B>> {
        self.validate()?;
        Ok(Router {
            gate: super::linear(self.d_model, self.n_experts, device),
            top_k: self.top_k,
            n_group: self.options.n_group,
            topk_group: self.options.topk_group,
            options: self.options,
        })
    }

    /// Builds the router.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Router<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The result of routing `m` tokens.
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// Unbiased scores `[m, n]` in f32 (differentiable).
    pub scores: Tensor<B, 2>,
    /// Selected experts `[m, k]`, best first.
    pub indices: Tensor<B, 2, Int>,
    /// Routing weights `p` `[m, k]` in f32 (differentiable), aligned with `indices`.
    pub weights: Tensor<B, 2>,
    /// The same selection on the host: made there on the host path, read back from `indices`
    /// only when asked on the kernel path ([`selection`](Self::selection)).
    selection: std::sync::OnceLock<Selection>,
    /// The unbiased scores on the host, `[m, n]` row-major, when the selection was made on the
    /// host; `None` when a fused kernel selected on the device (the scores never left it).
    pub scores_host: Option<Vec<f32>>,
    /// The QB histogram `[n, bins]` counted by the fused kernel together with the selection, on
    /// the device, when [`Router::route_with`] asked for one and the kernel path ran.
    pub histogram: Option<Tensor<B, 2, Int>>,
}

impl<B: Backend> Routing<B> {
    /// The selection on the host (one device read the first time, where a kernel selected on the
    /// device).
    pub fn selection(&self) -> &Selection {
        self.selection
            .get_or_init(|| Selection::from_tensor(&self.indices, self.scores.dims()[1]))
    }

    /// Whether the selection was made on the device (the kernel path): then the scores, the
    /// selection and the histogram stay there unless asked for.
    pub fn on_device(&self) -> bool {
        self.scores_host.is_none()
    }
}

/// Sigmoid (or softmax) router with a selection-only balance bias (design §2):
///
/// ```text
/// s = σ(W_r x)  (f32)      T = top_k(s + b)      p_i = s_i / (Σ_{j∈T} s_j + 1e-20) · routed_scaling_factor
/// ```
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// `W_r` as a bias-free linear `[d_model, n_experts]` (checkpoint `gate.weight`, `[n, d]`).
    pub gate: Linear<B>,
    /// Experts per token.
    pub top_k: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    #[module(skip)]
    options: RouterOptions,
}

impl<B: Backend> Router<B> {
    /// Number of routed experts.
    pub fn n_experts(&self) -> usize {
        self.gate.weight.dims()[1]
    }

    /// The routing options.
    pub fn options(&self) -> &RouterOptions {
        &self.options
    }

    /// Unbiased scores `[m, n]` in f32 for `x: [m, d_model]`.
    pub fn scores(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let (x, _) = widen(x);
        let (w, _) = widen(self.gate.weight.val());
        let logits = crate::ops::linear::matmul_last(x, w);
        match self.options.scoring {
            Scoring::Sigmoid => sigmoid(logits),
            Scoring::Softmax => softmax(logits, 1),
        }
    }

    /// Routes `x: [m, d_model]` with the balance bias `bias: [n]` (selection only).
    ///
    /// On the CubeCL backends the top-k runs as a fused kernel on the device (same selection,
    /// ties to the lower index); elsewhere, or with grouped top-k, on the host.
    ///
    /// Errors on a width mismatch, a bias of the wrong length, or NaN scores.
    pub fn route(&self, x: Tensor<B, 2>, bias: &[f32]) -> Result<Routing<B>> {
        self.route_with(x, bias, None, None)
    }

    /// [`route`](Self::route), and on the kernel path also the QB histogram `histogram` of the
    /// margins over the `valid` tokens (`[m]`, `false` for padding) in the same pass, returned in
    /// [`Routing::histogram`]. On the host path `Routing::histogram` is `None` and the caller
    /// feeds [`Routing::scores_host`] to the balancer. The kernel path reads nothing back.
    pub fn route_with(
        &self,
        x: Tensor<B, 2>,
        bias: &[f32],
        histogram: Option<HistogramSpec>,
        valid: Option<&TokenMask<B>>,
    ) -> Result<Routing<B>> {
        let [m, d] = x.dims();
        let d_model = self.gate.weight.dims()[0];
        if d != d_model {
            return Err(Error::shape(
                "router input",
                format!("[m, {d_model}]"),
                [m, d],
            ));
        }
        let n = self.n_experts();
        let scores = self.scores(x);
        let opts = TopKOptions {
            k: self.top_k,
            n_group: self.n_group,
            topk_group: self.topk_group,
        };
        let device = scores.device();
        let selection = std::sync::OnceLock::new();
        let (indices, scores_host, histogram) =
            match route_top_k_fused(&scores, bias, opts, valid, histogram) {
                Some(fused) => (fused.indices, None, fused.counts),
                None => {
                    let host = to_host_f32(scores.clone());
                    let chosen = select_top_k(&host, n, bias, opts)?;
                    let indices = chosen.to_tensor::<B>(&device);
                    let _ = selection.set(chosen);
                    (indices, Some(host), None)
                }
            };
        let source = if self.options.weights_from_biased_scores {
            let b = Tensor::<B, 1>::from_data(
                TensorData::new(bias.to_vec(), [bias.len()]),
                (&device, scores.dtype()),
            )
            .unsqueeze::<2>();
            scores.clone().add(b)
        } else {
            scores.clone()
        };
        let mut weights = source.gather(1, indices.clone());
        if self.options.renormalize {
            let denom = weights.clone().sum_dim(1).add_scalar(1e-20);
            weights = weights.div(denom);
        }
        if self.options.routed_scaling_factor != 1.0 {
            weights = weights.mul_scalar(self.options.routed_scaling_factor);
        }
        Ok(Routing {
            scores,
            indices,
            weights,
            selection,
            scores_host,
            histogram,
        })
    }
}
