//! The hybrid causal language model (design §6, §7): embedding, decoder layers with a KDA or MLA
//! mixer and a dense or MoE FFN, optional Attention Residuals, final norm, untied `lm_head`.
//!
//! Read top to bottom: [`KimiForCausalLM::try_forward`] is the whole forward pass, for training, prefill and
//! decode alike.

use crate::ops::linear::linear;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor};

use crate::balance_sync::BalancedModule;
pub use crate::cache::{KimiCache, LayerCache};
pub use crate::config::KimiConfig;
use crate::error::{Error, Result};
use crate::nn::attn_res::{AttnResConfig, AttnResMix};
use crate::nn::{
    BalanceState, DriftMemory, GatedMla, KimiDeltaAttention, LatentMoe, MoeLoads, MoeStats,
    RmsNorm, RmsNormConfig, SituGlu, SituGluConfig,
};

/// The token mixer of a decoder layer.
// One per layer, so the size difference costs nothing; Burn's Module derive does not box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Mixer<B: Backend> {
    /// Kimi Delta Attention (linear attention with a recurrent state).
    Kda(KimiDeltaAttention<B>),
    /// Gated NoPE MLA (global softmax attention over a latent cache).
    Mla(GatedMla<B>),
}

/// The FFN of a decoder layer.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Ffn<B: Backend> {
    /// A dense SiTU-GLU / SwiGLU FFN (`mlp.*`, the first `first_k_dense_replace` layers).
    Dense(SituGlu<B>),
    /// The (Stable Latent) MoE (`block_sparse_moe.*`).
    Moe(LatentMoe<B>),
}

/// One decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Pre-mixer RMSNorm (`input_layernorm`).
    pub input_layernorm: RmsNorm<B>,
    /// KDA or MLA (`self_attn`).
    pub mixer: Mixer<B>,
    /// Pre-FFN RMSNorm (`post_attention_layernorm`).
    pub post_attention_layernorm: RmsNorm<B>,
    /// Dense FFN or MoE.
    pub ffn: Ffn<B>,
    /// AttnRes mix before the mixer (`self_attention_res_{proj,norm}`), with AttnRes on.
    pub attn_res: Option<AttnResMix<B>>,
    /// AttnRes mix before the FFN (`mlp_res_{proj,norm}`), with AttnRes on.
    pub mlp_res: Option<AttnResMix<B>>,
}

/// The Kimi hybrid causal LM (Kimi-Linear, K3, and the tiny preset).
#[derive(Module, Debug)]
pub struct KimiForCausalLM<B: Backend> {
    /// Token embedding `[vocab, d]` (`model.embed_tokens`).
    pub embed_tokens: Embedding<B>,
    /// The decoder layers (`model.layers.{i}`).
    pub layers: Vec<DecoderLayer<B>>,
    /// Final RMSNorm (`model.norm`).
    pub norm: RmsNorm<B>,
    /// The final AttnRes mix (`model.output_attn_res_{proj,norm}`), with AttnRes on.
    pub output_res: Option<AttnResMix<B>>,
    /// Output projection `[d, vocab]` (`lm_head`); `None` when tied to the embedding.
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    config: KimiConfig,
}

impl KimiConfig {
    /// Builds the model, or reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<KimiForCausalLM<B>> {
        self.validate()?;
        let d = self.hidden_size;
        let norm = |eps| RmsNormConfig::new(d).with_epsilon(eps).init(device);
        let res = AttnResConfig::new(d).with_epsilon(self.rms_norm_eps);
        let with_res = self.attn_res_block_size.is_some();
        let mut layers = Vec::with_capacity(self.num_hidden_layers);
        for i in 0..self.num_hidden_layers {
            let mixer = if self.is_mla_layer(i) {
                Mixer::Mla(self.mla_config().try_init(device)?)
            } else {
                Mixer::Kda(self.kda_config().try_init(device)?)
            };
            let ffn = if self.is_moe_layer(i) {
                Ffn::Moe(self.moe_config().try_init(device)?)
            } else {
                Ffn::Dense(
                    SituGluConfig::new(d, self.intermediate_size)
                        .with_activation(self.activation)
                        .with_qat(self.moe.qat.filter(|q| q.dense_ffn))
                        .try_init(device)?,
                )
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(self.rms_norm_eps),
                mixer,
                post_attention_layernorm: norm(self.rms_norm_eps),
                ffn,
                attn_res: with_res.then(|| res.init(device)),
                mlp_res: with_res.then(|| res.init(device)),
            });
        }
        let embed_tokens = EmbeddingConfig::new(self.vocab_size, d).init(device);
        if !crate::nn::in_skeleton() {
            let _ = embed_tokens.weight.val(); // eager: clones must share the same weights
        }
        Ok(KimiForCausalLM {
            embed_tokens,
            layers,
            norm: norm(self.rms_norm_eps),
            output_res: with_res.then(|| res.init(device)),
            lm_head: (!self.tie_word_embeddings)
                .then(|| crate::nn::linear(d, self.vocab_size, device)),
            config: self.clone(),
        })
    }

    /// Builds the model.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> KimiForCausalLM<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// What one forward pass produced.
#[derive(Debug, Clone)]
pub struct CausalLmOutput<B: Backend> {
    /// `[B, T, vocab]`.
    pub logits: Tensor<B, 3>,
    /// Expert loads of every MoE layer, in layer order, where they were counted (on the device
    /// on the kernel path; [`moe_stats`](Self::moe_stats) reads them).
    pub moe_loads: Vec<MoeLoads<B>>,
}

impl<B: Backend> CausalLmOutput<B> {
    /// Load statistics of every MoE layer, in layer order (one device read per MoE layer on the
    /// kernel path).
    pub fn moe_stats(&self) -> Vec<MoeStats> {
        self.moe_loads.iter().map(MoeLoads::stats).collect()
    }
}

/// The AttnRes state between layers (design §6): the completed block sums and the running partial sum.
pub(crate) struct Residual<B: Backend> {
    blocks: Vec<Tensor<B, 3>>,
    block_size: Option<usize>,
}

impl<B: Backend> DecoderLayer<B> {
    /// The layer on `x` (the partial sum of the current AttnRes block, or the residual stream),
    /// with the AttnRes bookkeeping of design §6, or plain pre-norm residuals. `index` is the
    /// layer's place in the stack.
    pub(crate) fn forward(
        &self,
        index: usize,
        x: Tensor<B, 3>,
        res: &mut Residual<B>,
        padding: Option<Tensor<B, 2, Bool>>,
        kda_padding: Option<&[bool]>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Result<(Tensor<B, 3>, Option<MoeLoads<B>>)> {
        let Some(size) = res.block_size else {
            let h = x.clone().add(self.mixer(
                self.input_layernorm.forward(x),
                padding.clone(),
                kda_padding,
                cache,
            )?);
            let (f, stats) = self.ffn(self.post_attention_layernorm.forward(h.clone()), padding)?;
            return Ok((h.add(f), stats));
        };
        let (Some(attn_res), Some(mlp_res)) = (&self.attn_res, &self.mlp_res) else {
            return Err(Error::config(
                "attn_res_block_size",
                format!("layer {index} has no AttnRes parameters"),
            ));
        };
        // `x` is the partial sum of the current block (the embedding before layer 0).
        let mut partial = Some(x.clone());
        let mut h = x.clone();
        if !res.blocks.is_empty() {
            h = attn_res.forward(x.clone(), &res.blocks);
        }
        if index.is_multiple_of(size) {
            res.blocks.push(x);
            partial = None;
        }
        let a = self.mixer(
            self.input_layernorm.forward(h),
            padding.clone(),
            kda_padding,
            cache,
        )?;
        let partial = match partial {
            Some(p) => p.add(a),
            None => a,
        };
        let h = mlp_res.forward(partial.clone(), &res.blocks);
        let (f, stats) = self.ffn(self.post_attention_layernorm.forward(h), padding)?;
        Ok((partial.add(f), stats))
    }

    /// The token mixer. KDA layers with a cache take the padding as a host mask (`kda_padding`,
    /// read only then, [`KimiForCausalLM::try_forward`]); without a cache they run over every
    /// position, which leaves the tokens before right padding as they are.
    fn mixer(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        kda_padding: Option<&[bool]>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Result<Tensor<B, 3>> {
        match (&self.mixer, cache) {
            (Mixer::Kda(kda), None) => kda.try_forward(x, None, None),
            (Mixer::Kda(kda), Some(LayerCache::Kda(c))) => match kda_padding {
                Some(mask) => kda.try_forward_padded(x, mask, Some(c)),
                None => kda.try_forward(x, None, Some(c)),
            },
            (Mixer::Mla(mla), None) => mla.try_forward(x, padding),
            (Mixer::Mla(mla), Some(LayerCache::Mla(c))) if c.is_empty() => {
                mla.try_prefill(x, padding, c)
            }
            (Mixer::Mla(mla), Some(LayerCache::Mla(c))) => mla.try_forward_cached(x, padding, c),
            _ => Err(Error::argument(
                "cache",
                "layer kinds differ from the model's",
            )),
        }
    }

    fn ffn(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<(Tensor<B, 3>, Option<MoeLoads<B>>)> {
        match &self.ffn {
            Ffn::Dense(glu) => Ok((glu.forward(x), None)),
            Ffn::Moe(moe) => {
                let out = moe.try_forward(x, padding)?;
                Ok((out.output, Some(out.loads)))
            }
        }
    }
}

impl<B: Backend> KimiForCausalLM<B> {
    /// A copy for another data-parallel replica on `device`: the same weights, forked (new
    /// autodiff leaves, so the replicas' graphs stay apart), and every MoE layer with its own
    /// balance state ([`BalanceState::replica`](crate::nn::BalanceState::replica)). A plain
    /// `clone` shares the balancers' counts, which suits an evaluation copy and not a replica.
    pub fn replica(&self, device: &B::Device) -> Self {
        let mut copy = self.clone().fork(device);
        for (mine, theirs) in copy.layers.iter_mut().zip(&self.layers) {
            if let (Ffn::Moe(mine), Ffn::Moe(theirs)) = (&mut mine.ffn, &theirs.ffn) {
                mine.balance = theirs.balance.replica(device);
            }
        }
        copy
    }

    /// The model with its QAT weight quantisation applied once, for inference: every weight
    /// QAT quantises (routed experts; shared experts and dense FFNs when the config says so)
    /// holds its quantised values, and forwards quantise only the activations. A QAT model
    /// otherwise fake-quantises all its experts' weights on every forward, which in a decode
    /// step is a pass over every expert of every MoE layer for one token. Logits are unchanged
    /// (quantisation is idempotent); a packed export
    /// ([`save_safetensors_packed`](Self::save_safetensors_packed)) still packs them. Training the result would update the quantised values in full
    /// precision: keep it for inference. Unchanged without QAT.
    pub fn with_quantized_weights(mut self) -> Self {
        self.layers = self
            .layers
            .into_iter()
            .map(|mut layer| {
                layer.ffn = match layer.ffn {
                    Ffn::Dense(f) => Ffn::Dense(f.with_quantized_weights()),
                    Ffn::Moe(m) => Ffn::Moe(m.with_quantized_weights()),
                };
                layer
            })
            .collect();
        self
    }

    /// The config the model was built from.
    pub fn config(&self) -> &KimiConfig {
        &self.config
    }

    /// `ids: [B, T]` → logits `[B, T, vocab]`.
    ///
    /// # Panics
    /// On a token id outside the vocabulary (see [`try_forward`](Self::try_forward)).
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.try_forward(ids, None, None)
            .unwrap_or_else(|e| panic!("{e}"))
            .logits
    }

    /// Logits and per-layer MoE statistics for `ids: [B, T]`.
    pub fn forward_with_stats(&self, ids: Tensor<B, 2, Int>) -> Result<CausalLmOutput<B>> {
        self.try_forward(ids, None, None)
    }

    /// The full forward pass.
    ///
    /// `ids: [B, T]`; `padding: [B, T]` (`true` = padding: never attended to by MLA, never routed
    /// or counted by the MoE); `cache`: continue the cached sequences and advance the cache
    /// (prefill, then decode).
    ///
    /// KDA layers and padding: without a cache they run over every position, padding included.
    /// They are causal, so right padding (the training batches' layout) leaves the tokens before
    /// it as they are, and the pass reads nothing back. With a cache, the mask is read back once
    /// per call (a prefill of prompts of different lengths, not a training step) and the KDA
    /// layers skip the padding wherever it lies
    /// ([`try_forward_padded`](crate::nn::KimiDeltaAttention::try_forward_padded)): it neither
    /// enters their state nor their convolutions' tails, so the decode steps after a padded
    /// prefill give every row what it gets alone.
    ///
    /// On the CPU backends the pass runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    ///
    /// # Errors
    /// On ids outside the vocabulary, a `padding` that is not `[B, T]`, a cache built for another
    /// model or batch, or invalid layer input. The checks that can fail run before any layer
    /// writes to the cache; a layer's own error may leave the cache partly advanced.
    pub fn try_forward(
        &self,
        ids: Tensor<B, 2, Int>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: Option<&mut KimiCache<B>>,
    ) -> Result<CausalLmOutput<B>> {
        crate::ops::backend::on_cpu_pool::<B, _>(|| self.try_forward_here(ids, padding, cache))
    }

    /// [`try_forward`](Self::try_forward) on this thread.
    fn try_forward_here(
        &self,
        ids: Tensor<B, 2, Int>,
        padding: Option<Tensor<B, 2, Bool>>,
        mut cache: Option<&mut KimiCache<B>>,
    ) -> Result<CausalLmOutput<B>> {
        let [batch, t] = ids.dims();
        if batch == 0 || t == 0 {
            return Err(Error::shape("ids", "[B ≥ 1, T ≥ 1]", [batch, t]));
        }
        self.check_ids(&ids)?;
        if let Some(p) = &padding {
            if p.dims() != [batch, t] {
                return Err(Error::shape(
                    "padding",
                    format!("[B, T] = [{batch}, {t}]"),
                    p.dims(),
                ));
            }
        }
        if let Some(c) = cache.as_deref_mut() {
            c.check(&self.config)?;
        }
        let has_kda = self.layers.iter().any(|l| matches!(l.mixer, Mixer::Kda(_)));
        let kda_padding: Option<Vec<bool>> = match (&padding, &cache) {
            (Some(p), Some(_)) if has_kda => {
                Some(crate::sync::read(p.clone()).iter::<bool>().collect())
            }
            _ => None,
        };
        let mut x = self.embed_tokens.forward(ids);
        let mut res = Residual {
            blocks: Vec::new(),
            block_size: self.config.attn_res_block_size,
        };
        let mut moe_loads = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            let (next, loads) = layer.forward(
                i,
                x,
                &mut res,
                padding.clone(),
                kda_padding.as_deref(),
                layer_cache,
            )?;
            x = next;
            moe_loads.extend(loads);
        }
        if let Some(mix) = &self.output_res {
            x = mix.forward(x, &res.blocks);
        }
        if let Some(c) = cache {
            c.advance(t);
        }
        let h = self.norm.forward(x);
        let logits = match &self.lm_head {
            Some(head) => linear(head, h),
            None => h.matmul(self.embed_tokens.weight.val().transpose().unsqueeze()),
        };
        Ok(CausalLmOutput { logits, moe_loads })
    }

    /// Token ids outside `0..vocab` are an error. The check reads the ids' range back (one read),
    /// which on a GPU drains the stream: on the kernel path (wgpu, CUDA) it runs only with
    /// [`eager_checks`](crate::sync::eager_checks) (by default in debug builds), and without
    /// them an out-of-range id is embedded as whatever the device's bounds-checked gather
    /// returns. On every other backend it always runs.
    fn check_ids(&self, ids: &Tensor<B, 2, Int>) -> Result<()> {
        if !crate::sync::eager_checks() && crate::ops::backend::kernels_available::<B>() {
            return Ok(());
        }
        let vocab = self.config.vocab_size as i64;
        let range = Tensor::cat(vec![ids.clone().min(), ids.clone().max()], 0);
        let range: Vec<i64> = crate::sync::read(range).iter::<i64>().collect();
        let (lo, hi) = (range[0], range[1]);
        if lo < 0 || hi >= vocab {
            return Err(Error::argument(
                "ids",
                format!("token ids must lie in 0..{vocab}, got values in {lo}..={hi}"),
            ));
        }
        Ok(())
    }

    /// A fresh decode cache for this model.
    pub fn new_cache(&self) -> KimiCache<B> {
        KimiCache::new(&self.config)
    }

    /// Applies every MoE layer's balancer (once per optimiser step). Counts gathered on the
    /// device (the kernel path) are read for all layers at once: one read per call.
    pub fn update_balance(&self) {
        let states = self.moe_balances();
        crate::nn::balance::flush_all(&states)
            .unwrap_or_else(|e| unreachable!("device counts have their balancer's size: {e}"));
        for state in states {
            state.update();
        }
    }

    /// Every MoE layer's drift memory ([`BalancerKind::QuantileTrend`]), in layer order (`None`
    /// for layers with another balancer). What a training checkpoint keeps besides the biases.
    ///
    /// [`BalancerKind::QuantileTrend`]: crate::nn::BalancerKind::QuantileTrend
    pub fn drift_memory(&self) -> Vec<Option<DriftMemory>> {
        self.moe_balances()
            .iter()
            .map(|s| s.drift_memory())
            .collect()
    }

    /// Restores [`drift_memory`](Self::drift_memory). Errors when the number of MoE layers
    /// differs, or as [`BalanceState::set_drift_memory`] (naming the layer).
    pub fn set_drift_memory(&self, memory: Vec<Option<DriftMemory>>) -> Result<()> {
        let states = self.balance_states();
        if memory.len() != states.len() {
            return Err(Error::argument(
                "drift memory",
                format!(
                    "has {} MoE layers, the model {}",
                    memory.len(),
                    states.len()
                ),
            ));
        }
        for ((layer, state), m) in states.into_iter().zip(memory) {
            state
                .set_drift_memory(m)
                .map_err(|e| Error::argument("drift memory", format!("MoE layer {layer}: {e}")))?;
        }
        Ok(())
    }

    /// Every MoE layer's balance state, in layer order.
    fn moe_balances(&self) -> Vec<&BalanceState<B>> {
        self.balance_states().into_iter().map(|(_, s)| s).collect()
    }
}

/// What [`KimiForCausalLM::calibrate_balance`] found, per MoE layer in layer order.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// The max violation of the calibration tokens pooled, routed with the bias the model had
    /// before the calibration.
    pub before: Vec<f32>,
    /// The same with the bias the calibration kept.
    pub after: Vec<f32>,
}

impl<B: AutodiffBackend> KimiForCausalLM<B> {
    /// Fits every MoE layer's balance bias to `batches` (token ids, `[B, T]` each) without
    /// training: the crate's own addition to design §3, for a change of data (a curriculum's
    /// next phase, fine-tuning on another corpus), where the bias of the previous data would
    /// route the first steps of the new one unbalanced.
    ///
    /// Each of `sweeps` sweeps routes all the batches (training forwards, no backward), pools
    /// their QB histograms and moves every layer's bias half-way to QB's set (a whole QB step
    /// overshoots when experts compete for tokens crowded at the cut); the sweep whose pooled
    /// loads were the most even (the smallest max violation over the layers) gives the bias
    /// kept. Parameters and optimiser state are untouched; the balancers' counts are left empty
    /// and their drift estimates ([`BalancerKind::QuantileTrend`]) forgotten. Every sweep routes
    /// the same tokens: `sweeps` forwards per batch are the cost (the last sweep's half-step is
    /// never routed, so it cannot be kept). On the kernel path each forward reads its loads back
    /// once; calibration is outside the training step.
    ///
    /// Call it between optimiser steps (after [`update_balance`](Self::update_balance)): counts
    /// observed since the last update would be pooled into the first sweep. With
    /// data-parallel replicas, give every replica the same batches: the result is then the same
    /// everywhere. Errors when a MoE layer's balancer is not QB, on `sweeps == 0` or no batches,
    /// or as [`forward_with_stats`](Self::forward_with_stats).
    ///
    /// [`BalancerKind::QuantileTrend`]: crate::nn::BalancerKind::QuantileTrend
    pub fn calibrate_balance(
        &self,
        batches: &[Tensor<B, 2, Int>],
        sweeps: usize,
    ) -> Result<Calibration> {
        if sweeps == 0 || batches.is_empty() {
            return Err(Error::argument(
                "calibration",
                format!(
                    "needs at least one sweep and one batch, got {sweeps} sweeps and {} batches",
                    batches.len()
                ),
            ));
        }
        let states = self.balance_states();
        if let Some((layer, _)) = states.iter().find(|(_, s)| !s.is_quantile()) {
            return Err(Error::argument(
                "balancer",
                format!(
                    "calibrating the bias needs Quantile Balancing; MoE layer {layer} has {:?}",
                    self.config.moe.balancer
                ),
            ));
        }
        let states: Vec<_> = states.into_iter().map(|(_, s)| s).collect();
        // Forwards on the autodiff backend count (they are training forwards), but with no
        // parameter requiring a gradient they record no graph: an autodiff graph that no backward
        // consumes would otherwise keep every saved activation alive. The copy shares the
        // balance states. What the backend still keeps per operation is released per sweep.
        let model = self.clone().no_grad();
        let mut before = Vec::new();
        // (worst layer's violation, per-layer violations, the biases that gave them).
        let mut best: Option<(f32, Vec<f32>, Vec<Vec<f32>>)> = None;
        for _ in 0..sweeps {
            let biases: Vec<Vec<f32>> = states.iter().map(|s| s.bias_host()).collect();
            let mut loads: Vec<Vec<u64>> = vec![Vec::new(); states.len()];
            for ids in batches {
                let out = model.forward_with_stats(ids.clone())?;
                for (acc, stats) in loads.iter_mut().zip(out.moe_stats()) {
                    acc.resize(stats.tokens_per_expert.len(), 0);
                    acc.iter_mut()
                        .zip(&stats.tokens_per_expert)
                        .for_each(|(a, c)| *a += c);
                }
            }
            crate::train::release_autodiff_bookkeeping::<B>(&batches[0].device());
            let pooled: Vec<f32> = loads
                .into_iter()
                .map(|l| MoeStats::from_loads(l).max_violation)
                .collect();
            if before.is_empty() {
                before = pooled.clone();
            }
            let worst = pooled.iter().copied().fold(0.0f32, f32::max);
            if best.as_ref().is_none_or(|(w, _, _)| worst < *w) {
                best = Some((worst, pooled, biases.clone()));
            }
            for (state, old) in states.iter().zip(&biases) {
                if let Some(set) = state.take_quantile_set()? {
                    let half: Vec<f32> = old.iter().zip(&set).map(|(o, q)| 0.5 * (o + q)).collect();
                    state.set_bias(&half);
                }
            }
        }
        let (_, after, kept) = best.expect("at least one sweep ran");
        for (state, bias) in states.iter().zip(&kept) {
            state.set_bias(bias);
            state.forget_drift();
        }
        Ok(Calibration { before, after })
    }
}
