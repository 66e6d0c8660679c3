//! Model configuration, the presets `tiny`, `kimi_linear_48b` and `k3`, and the K3-shaped scaling
//! family `k3_scaled` / `scaling_presets` (design §2, §4, §5, §7).
//!
//! Field names follow the Hugging Face `config.json` of Kimi-Linear / K3 wherever one exists, so
//! that [`KimiConfig`] reads like the published configs.

use serde::{Deserialize, Serialize};

mod hf;

use crate::error::{Error, Result};
use crate::nn::balance::BalancerKind;
use crate::nn::kda::KdaConfig;
use crate::nn::latent_moe::{LatentMoeConfig, MoeLayout};
use crate::nn::mla::MlaConfig;
use crate::nn::router::RouterOptions;
use crate::nn::situ_glu::GluActivation;
use crate::ops::moe::route::Scoring;
use crate::ops::quant::QatConfig;

/// The MoE fields of a [`KimiConfig`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeFields {
    /// Routed experts `n` (`num_experts`).
    pub num_experts: usize,
    /// Experts per token `k` (`num_experts_per_token`).
    pub num_experts_per_token: usize,
    /// Shared experts (`num_shared_experts`), full width.
    pub num_shared_experts: usize,
    /// Hidden width `m_e` of every expert, routed and shared (`moe_intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Standard, Latent or Stable Latent (K3: Stable Latent with ℓ = `routed_expert_hidden_size` =
    /// 3584 and `latent_moe_use_norm`).
    pub layout: MoeLayout,
    /// Router scoring, renormalisation, scaling and grouping.
    pub router: RouterOptions,
    /// The load balancer used in training.
    pub balancer: BalancerKind,
    /// Quantisation-aware training of the experts (design §9); `None`: full precision. In
    /// `config.json` as `quantization_config`.
    #[serde(default)]
    pub qat: Option<QatConfig>,
}

/// The KDA fields of a [`KimiConfig`] (`linear_attn_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KdaFields {
    /// KDA heads.
    pub num_heads: usize,
    /// Key and value head dim.
    pub head_dim: usize,
    /// Causal depthwise conv kernel (4).
    pub short_conv_kernel_size: usize,
    /// Lower bound of the "safe gate" (K3: −5); `None`: the softplus gate.
    pub gate_lower_bound: Option<f32>,
    /// Full-rank output gate `g_proj` (K3) instead of the low-rank `g_a_proj`/`g_b_proj`.
    pub use_full_rank_gate: bool,
}

/// The MLA fields of a [`KimiConfig`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaFields {
    /// MLA heads (`num_attention_heads`).
    pub num_heads: usize,
    /// q LoRA rank (`q_lora_rank`); `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Compressed KV latent width (`kv_lora_rank`, 512).
    pub kv_lora_rank: usize,
    /// Per-head non-positional q/k dims (`qk_nope_head_dim`, 128).
    pub qk_nope_head_dim: usize,
    /// Per-head shared-key dims (`qk_rope_head_dim`, 64; never rotated under NoPE).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims (`v_head_dim`, 128).
    pub v_head_dim: usize,
    /// Sigmoid output gate `g_proj` (`mla_use_output_gate`; K3 on, Kimi-Linear off).
    pub use_output_gate: bool,
    /// NoPE (`mla_use_nope`): no rotary embedding anywhere.
    pub use_nope: bool,
}

/// A whole Kimi hybrid model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KimiConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width `d` (`hidden_size`).
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Hidden width of the dense FFN layers (`intermediate_size`).
    pub intermediate_size: usize,
    /// Leading layers with a dense FFN instead of the MoE (`first_k_dense_replace`).
    pub first_k_dense_replace: usize,
    /// Epsilon of every RMSNorm but `kv_a_layernorm`.
    pub rms_norm_eps: f64,
    /// Tie `lm_head` to the embedding (Kimi: false).
    pub tie_word_embeddings: bool,
    /// The FFN activation (K3: SiTU-GLU 4/25; Kimi-Linear: SwiGLU).
    pub activation: GluActivation,
    /// 0-based indices of the MLA layers; every other layer is KDA.
    pub full_attn_layers: Vec<usize>,
    /// Attention Residuals block size (K3: 12); `None`: plain pre-norm residuals.
    pub attn_res_block_size: Option<usize>,
    /// MoE fields.
    pub moe: MoeFields,
    /// KDA fields.
    pub kda: KdaFields,
    /// MLA fields.
    pub mla: MlaFields,
}

/// The 3:1 KDA:MLA pattern of design §7: MLA at every fourth layer and at the last one (0-based).
pub fn hybrid_pattern(num_layers: usize) -> Vec<usize> {
    let mut mla: Vec<usize> = (0..num_layers).filter(|i| (i + 1) % 4 == 0).collect();
    if num_layers > 0 && mla.last() != Some(&(num_layers - 1)) {
        mla.push(num_layers - 1);
    }
    mla
}

/// Experts per token of [`KimiConfig::k3_scaled`] (K3: 16); the experts are 56 times as many.
const SCALED_EXPERTS_PER_TOKEN: usize = 2;

/// Name, `hidden_size` and `num_hidden_layers` of each of [`KimiConfig::scaling_presets`].
const SCALING_SHAPES: [(&str, usize, usize); 6] = [
    ("s0", 32, 4),
    ("s1", 64, 4),
    ("s2", 128, 6),
    ("s3", 256, 8),
    ("s4", 512, 10),
    ("s5", 1024, 12),
];

impl KimiConfig {
    /// A tiny hybrid (3 KDA + 1 MLA, Stable LatentMoE with QB, SiTU-GLU, AttnRes) that trains
    /// on a CPU in minutes: the preset of `examples/train_tiny`.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 512,
            hidden_size: 64,
            num_hidden_layers: 4,
            intermediate_size: 128,
            first_k_dense_replace: 1,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            activation: GluActivation::situ(),
            full_attn_layers: hybrid_pattern(4),
            attn_res_block_size: Some(2),
            moe: MoeFields {
                num_experts: 8,
                num_experts_per_token: 2,
                num_shared_experts: 1,
                moe_intermediate_size: 64,
                layout: MoeLayout::StableLatent { dim: 32 },
                router: RouterOptions::default(),
                balancer: BalancerKind::quantile(),
                qat: None,
            },
            kda: KdaFields {
                num_heads: 2,
                head_dim: 32,
                short_conv_kernel_size: 4,
                gate_lower_bound: Some(-5.0),
                use_full_rank_gate: true,
            },
            mla: MlaFields {
                num_heads: 2,
                q_lora_rank: Some(32),
                kv_lora_rank: 32,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 8,
                v_head_dim: 16,
                use_output_gate: true,
                use_nope: true,
            },
        }
    }

    /// Kimi-Linear-48B-A3B (published: 48B total, 3B active): 27 layers, d = 2304, MLA at
    /// 0-based 3, 7, 11, 15, 19, 23, 26; 256 experts top-8 plus one shared, SwiGLU, scaling 2.446.
    pub fn kimi_linear_48b() -> Self {
        Self {
            vocab_size: 163_840,
            hidden_size: 2304,
            num_hidden_layers: 27,
            intermediate_size: 9216,
            first_k_dense_replace: 1,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            activation: GluActivation::SwiGlu,
            full_attn_layers: vec![3, 7, 11, 15, 19, 23, 26],
            attn_res_block_size: None,
            moe: MoeFields {
                num_experts: 256,
                num_experts_per_token: 8,
                num_shared_experts: 1,
                moe_intermediate_size: 1024,
                layout: MoeLayout::Standard,
                router: RouterOptions {
                    scoring: Scoring::Sigmoid,
                    renormalize: true,
                    routed_scaling_factor: 2.446,
                    n_group: 1,
                    topk_group: 1,
                    weights_from_biased_scores: false,
                },
                balancer: BalancerKind::Sign { gamma: 1e-3 },
                qat: None,
            },
            kda: KdaFields {
                num_heads: 32,
                head_dim: 128,
                short_conv_kernel_size: 4,
                gate_lower_bound: None,
                use_full_rank_gate: false,
            },
            mla: MlaFields {
                num_heads: 32,
                q_lora_rank: None,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                use_output_gate: false,
                use_nope: true,
            },
        }
    }

    /// Kimi K3 (published: about 2.8T total, about 104B active): 93 layers (69 KDA + 24 MLA),
    /// d = 7168, Stable LatentMoE 896 experts top-16 at ℓ = 3584 with 2 shared experts, SiTU-GLU,
    /// AttnRes blocks of 12. The vocabulary size (163 840, K2's) is a reconstruction.
    pub fn k3() -> Self {
        Self {
            vocab_size: 163_840,
            hidden_size: 7168,
            num_hidden_layers: 93,
            intermediate_size: 33_792,
            first_k_dense_replace: 1,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            activation: GluActivation::situ(),
            full_attn_layers: hybrid_pattern(93),
            attn_res_block_size: Some(12),
            moe: MoeFields {
                num_experts: 896,
                num_experts_per_token: 16,
                num_shared_experts: 2,
                moe_intermediate_size: 3072,
                layout: MoeLayout::StableLatent { dim: 3584 },
                router: RouterOptions::default(),
                balancer: BalancerKind::quantile(),
                qat: None,
            },
            kda: KdaFields {
                num_heads: 96,
                head_dim: 128,
                short_conv_kernel_size: 4,
                gate_lower_bound: Some(-5.0),
                use_full_rank_gate: true,
            },
            mla: MlaFields {
                num_heads: 96,
                q_lora_rank: Some(1536),
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                use_output_gate: true,
                use_nope: true,
            },
        }
    }

    /// K3's architecture at width `hidden_size` (`d`) and depth `num_hidden_layers` (`L`): the
    /// member of the scaling family behind [`scaling_presets`](Self::scaling_presets).
    ///
    /// What stays as in K3: the 3:1 KDA:MLA pattern with the last layer MLA
    /// ([`hybrid_pattern`]), one dense first layer, Stable LatentMoE with QB balancing, SiTU-GLU,
    /// AttnRes, NoPE MLA with the sigmoid output gate, the full-rank KDA output gate, the KDA gate
    /// lower bound −5, the short-conv kernel 4, 2 shared experts and untied embeddings. Every width
    /// follows from `d` (K3's value at `d = 7168` in brackets; "rounded" is to the nearest
    /// multiple):
    ///
    /// | field | rule | K3 |
    /// |---|---|---|
    /// | head dim `dh` (KDA key/value; MLA `qk_nope_head_dim`, `v_head_dim`) | `d/8` clamped to [16, 128] (reconstruction) | 128 |
    /// | KDA and MLA heads `H` | `12·d / (7·dh)` rounded, so `H·dh ≈ 12d/7` | 96 |
    /// | `qk_rope_head_dim` (shared key, never rotated) | `dh/2` | 64 |
    /// | `kv_lora_rank` | `4·dh`, at most `d/2` | 512 |
    /// | `q_lora_rank` | `3d/14` rounded to 16 | 1536 |
    /// | `intermediate_size` (dense layer 0) | `33d/7` rounded to 16 | 33 792 |
    /// | `moe_intermediate_size` `m_e` (routed and shared) | `3d/7` rounded to 16 | 3072 |
    /// | latent width ℓ | `d/2` | 3584 |
    /// | `vocab_size` | `160d/7` rounded to 256 (K3's own value is a reconstruction) | 163 840 |
    /// | `attn_res_block_size` | `max(2, ⌈L/8⌉)`: about 8 blocks as in K3, at least 2 layers each (reconstruction) | 12 |
    /// | experts `n` / per token `k` | 112 / 2, K3's `k/n = 16/896 = 1/56` (reconstruction: see below) | 896 / 16 |
    ///
    /// At `d = 7168, L = 93` every rule gives K3's value, so `k3_scaled(7168, 93)` with 896
    /// experts top-16 is [`k3`](Self::k3) (tested). The experts keep K3's sparsity `k/n = 1/56`
    /// and K3's granularity `m_e = 3d/7`, but `k = 2` instead of 16: with 16 the routed experts of
    /// one layer hold `576·d²` parameters (K3's 2.8T), which leaves no room for a model near the
    /// tiny preset, and the 112 experts each see enough tokens of a small batch for the balancer.
    /// So the routed experts' share of the active parameters is smaller than K3's.
    ///
    /// `hidden_size` should be even (ℓ = d/2) and at least 16.
    pub fn k3_scaled(hidden_size: usize, num_hidden_layers: usize) -> Self {
        let d = hidden_size;
        // `num/den` rounded to the nearest multiple of `m`, at least `m`.
        let round = |num: usize, den: usize, m: usize| ((num + den * m / 2) / (den * m)).max(1) * m;
        let head_dim = (d / 8).clamp(16, 128);
        let heads = ((12 * d + 7 * head_dim / 2) / (7 * head_dim)).max(1);
        Self {
            vocab_size: round(160 * d, 7, 256),
            hidden_size: d,
            num_hidden_layers,
            intermediate_size: round(33 * d, 7, 16),
            first_k_dense_replace: 1,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            activation: GluActivation::situ(),
            full_attn_layers: hybrid_pattern(num_hidden_layers),
            attn_res_block_size: Some(num_hidden_layers.div_ceil(8).max(2)),
            moe: MoeFields {
                num_experts: 56 * SCALED_EXPERTS_PER_TOKEN,
                num_experts_per_token: SCALED_EXPERTS_PER_TOKEN,
                num_shared_experts: 2,
                moe_intermediate_size: round(3 * d, 7, 16),
                layout: MoeLayout::StableLatent { dim: d / 2 },
                router: RouterOptions::default(),
                balancer: BalancerKind::quantile(),
                qat: None,
            },
            kda: KdaFields {
                num_heads: heads,
                head_dim,
                short_conv_kernel_size: 4,
                gate_lower_bound: Some(-5.0),
                use_full_rank_gate: true,
            },
            mla: MlaFields {
                num_heads: heads,
                q_lora_rank: Some(round(3 * d, 14, 16)),
                kv_lora_rank: (4 * head_dim).min(d / 2),
                qk_nope_head_dim: head_dim,
                qk_rope_head_dim: head_dim / 2,
                v_head_dim: head_dim,
                use_output_gate: true,
                use_nope: true,
            },
        }
    }

    /// The scaling family `s0` … `s5`: [`k3_scaled`](Self::k3_scaled) from about the tiny
    /// preset's size to about 1B parameters, each 4–6 times the one before, all with 112 experts
    /// top-2 and 2 shared experts. Parameters as [`num_params`](Self::num_params) and
    /// [`active_params`](Self::active_params) count them (embedding and `lm_head` included), printed
    /// by `cargo test --test suite scaling_presets -- --nocapture`:
    ///
    /// | preset | `d` | layers | heads × `dh` | `m_e` | dense hidden | vocabulary | total | active |
    /// |---|---|---|---|---|---|---|---|---|
    /// | `s0` | 32 | 4 | 3 × 16 | 16 | 144 | 768 | 381 145 | 127 705 |
    /// | `s1` | 64 | 4 | 7 × 16 | 32 | 304 | 1536 | 1 509 221 | 495 461 |
    /// | `s2` | 128 | 6 | 14 × 16 | 48 | 608 | 2816 | 7 293 816 | 2 225 016 |
    /// | `s3` | 256 | 8 | 14 × 32 | 112 | 1200 | 5888 | 44 015 988 | 10 899 828 |
    /// | `s4` | 512 | 10 | 14 × 64 | 224 | 2416 | 11 776 | 220 296 178 | 49 984 498 |
    /// | `s5` | 1024 | 12 | 14 × 128 | 432 | 4832 | 23 296 | 1 029 065 374 | 226 167 454 |
    ///
    /// Depths are a reconstruction: `d/L` runs from 8 to 85 (K3: 77).
    pub fn scaling_presets() -> Vec<(&'static str, KimiConfig)> {
        SCALING_SHAPES
            .iter()
            .map(|&(name, d, layers)| (name, Self::k3_scaled(d, layers)))
            .collect()
    }

    /// The MoE layer config of the MoE layers of this model.
    pub fn moe_config(&self) -> LatentMoeConfig {
        LatentMoeConfig::new(
            self.hidden_size,
            self.moe.num_experts,
            self.moe.num_experts_per_token,
            self.moe.moe_intermediate_size,
        )
        .with_layout(self.moe.layout)
        .with_n_shared(self.moe.num_shared_experts)
        .with_shared_hidden(Some(self.moe.moe_intermediate_size))
        .with_activation(self.activation)
        .with_router(self.moe.router)
        .with_balancer(self.moe.balancer)
        .with_rms_norm_eps(self.rms_norm_eps)
        .with_qat(self.moe.qat)
    }

    /// Whether layer `i` (0-based) is an MLA layer.
    pub fn is_mla_layer(&self, i: usize) -> bool {
        self.full_attn_layers.contains(&i)
    }

    /// Whether layer `i` (0-based) has a MoE FFN (else a dense one).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace
    }

    /// Checks the values the blocks need to agree on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("linear_attn_config.num_heads", self.kda.num_heads),
            ("linear_attn_config.head_dim", self.kda.head_dim),
            ("num_attention_heads", self.mla.num_heads),
            ("kv_lora_rank", self.mla.kv_lora_rank),
            ("qk_nope_head_dim", self.mla.qk_nope_head_dim),
            ("v_head_dim", self.mla.v_head_dim),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(Error::config(field, "must be positive, got 0"));
            }
        }
        if let Some(&bad) = self
            .full_attn_layers
            .iter()
            .find(|&&i| i >= self.num_hidden_layers)
        {
            return Err(Error::config(
                "full_attn_layers",
                format!(
                    "layer {bad} is out of range for num_hidden_layers = {}",
                    self.num_hidden_layers
                ),
            ));
        }
        if self.attn_res_block_size == Some(0) {
            return Err(Error::config(
                "attn_res_block_size",
                "must be positive, got 0",
            ));
        }
        if let Some(lb) = self.kda.gate_lower_bound {
            if !(-5.0..0.0).contains(&lb) {
                return Err(Error::config(
                    "linear_attn_config.gate_lower_bound",
                    format!("must lie in [-5, 0), got {lb}"),
                ));
            }
        }
        self.mla_config().validate()?;
        self.kda_config().validate()?;
        self.moe_config().validate()
    }

    /// The config of this model's KDA layers (Kimi-Linear: 32 heads × 128, softplus gate, low-rank
    /// output gate; K3: 96 × 128, safe gate at −5, full-rank output gate).
    pub fn kda_config(&self) -> KdaConfig {
        KdaConfig::new(self.hidden_size, self.kda.num_heads, self.kda.head_dim)
            .with_conv_size(self.kda.short_conv_kernel_size)
            .with_gate_lower_bound(self.kda.gate_lower_bound)
            .with_use_full_rank_gate(self.kda.use_full_rank_gate)
            .with_norm_eps(self.rms_norm_eps)
    }

    /// Parameters of one KDA layer (projections, convs, gates, norm, output).
    pub fn kda_layer_params(&self) -> u64 {
        self.kda_config().num_params()
    }

    /// The MLA layer config of the MLA layers of this model (`use_nope = false` turns on RoPE
    /// with DeepSeek's base 10 000; every Kimi preset is NoPE).
    pub fn mla_config(&self) -> MlaConfig {
        let m = &self.mla;
        MlaConfig::new(self.hidden_size, m.num_heads)
            .with_q_lora_rank(m.q_lora_rank)
            .with_kv_lora_rank(m.kv_lora_rank)
            .with_qk_nope_head_dim(m.qk_nope_head_dim)
            .with_qk_rope_head_dim(m.qk_rope_head_dim)
            .with_v_head_dim(m.v_head_dim)
            .with_use_output_gate(m.use_output_gate)
            .with_use_nope(m.use_nope)
            .with_rms_norm_eps(self.rms_norm_eps)
    }

    /// Parameters of one MLA layer.
    pub fn mla_layer_params(&self) -> u64 {
        self.mla_config().num_params()
    }

    fn params(&self, active: bool) -> u64 {
        let d = self.hidden_size as u64;
        let embed = self.vocab_size as u64 * d;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        let (moe_total, moe_active) = self.moe_config().num_params();
        let dense = 3 * d * self.intermediate_size as u64;
        let mut total = embed + head + d; // final norm
        for i in 0..self.num_hidden_layers {
            total += 2 * d; // input and post-attention norms
            total += if self.is_mla_layer(i) {
                self.mla_layer_params()
            } else {
                self.kda_layer_params()
            };
            total += if !self.is_moe_layer(i) {
                dense
            } else if active {
                moe_active
            } else {
                moe_total
            };
            if self.attn_res_block_size.is_some() {
                total += 4 * d; // two pseudo-queries with their norms
            }
        }
        if self.attn_res_block_size.is_some() {
            total += 2 * d;
        }
        total
    }

    /// Total parameters (the balance bias, a buffer, is not counted).
    pub fn num_params(&self) -> u64 {
        self.params(false)
    }

    /// Parameters used per token: the `k` selected routed experts instead of all of them
    /// (embedding included).
    pub fn active_params(&self) -> u64 {
        self.params(true)
    }
}
