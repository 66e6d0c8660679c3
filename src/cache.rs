//! Decode state of the whole model: per layer the KDA recurrent state and conv tail, or the MLA
//! latent cache (design §4.4, §5).

use burn::tensor::backend::Backend;

use crate::config::KimiConfig;
use crate::error::{Error, Result};
use crate::nn::{KdaCache, MlaCache};

/// The decode state of one layer.
#[derive(Debug, Clone)]
pub enum LayerCache<B: Backend> {
    /// KDA: f32 state `[N, H, K, V]` and conv tail `[N, 3·H·K, W − 1]`.
    Kda(KdaCache<B>),
    /// MLA: latent `c [B, T, r]` and `k_pe [B, T, dr]`.
    Mla(MlaCache<B>),
}

/// The decode state of a [`KimiForCausalLM`](crate::model::KimiForCausalLM): one entry per layer,
/// plus the number of tokens seen. AttnRes and the MoE act per token and need no state.
#[derive(Debug, Clone)]
pub struct KimiCache<B: Backend> {
    /// One cache per decoder layer, in layer order.
    pub layers: Vec<LayerCache<B>>,
    seen: usize,
}

impl<B: Backend> KimiCache<B> {
    /// An empty cache for a model built from `config`.
    pub fn new(config: &KimiConfig) -> Self {
        Self::with_capacity(config, 0)
    }

    /// An empty cache whose MLA layers hold `tokens` positions per sequence before their buffers
    /// grow (prompt plus new tokens for a generation; see [`MlaCache`]).
    pub fn with_capacity(config: &KimiConfig, tokens: usize) -> Self {
        Self {
            layers: (0..config.num_hidden_layers)
                .map(|i| {
                    if config.is_mla_layer(i) {
                        LayerCache::Mla(MlaCache::with_capacity(tokens))
                    } else {
                        LayerCache::Kda(KdaCache::new())
                    }
                })
                .collect(),
            seen: 0,
        }
    }

    /// Tokens processed so far (per sequence).
    pub fn len(&self) -> usize {
        self.seen
    }

    /// Whether no token has been processed yet.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// Checks that this cache was made for a model of `config`'s layer pattern.
    pub(crate) fn check(&self, config: &KimiConfig) -> Result<()> {
        let fits = self.layers.len() == config.num_hidden_layers
            && self
                .layers
                .iter()
                .enumerate()
                .all(|(i, c)| matches!(c, LayerCache::Mla(_)) == config.is_mla_layer(i));
        if fits {
            Ok(())
        } else {
            Err(Error::argument(
                "cache",
                format!(
                    "made for {} layers of another pattern; the model has {} layers with MLA at {:?}",
                    self.layers.len(),
                    config.num_hidden_layers,
                    config.full_attn_layers
                ),
            ))
        }
    }

    pub(crate) fn advance(&mut self, tokens: usize) {
        self.seen += tokens;
    }
}
