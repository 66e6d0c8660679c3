//! Reading and writing the Hugging Face `config.json` of Kimi-Linear and K3 (design §7).
//!
//! Kimi-Linear keeps its fields at the top level (`model_type: "kimi_linear"`); K3 nests the text
//! model under `text_config`. Values this crate cannot honour (an unknown activation, RoPE, multi-token
//! prediction heads, MoE layers that skip) are rejected with an error naming the field, never ignored.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::{KdaFields, KimiConfig, MlaFields, MoeFields};
use crate::error::{Error, Result};
use crate::nn::balance::BalancerKind;
use crate::nn::latent_moe::MoeLayout;
use crate::nn::router::RouterOptions;
use crate::nn::situ_glu::GluActivation;
use crate::ops::moe::route::Scoring;
use crate::ops::quant::{MxFormat, MxScaleRule, MxSpec, QatConfig};

/// Typed access to one JSON object, with errors that name the field by its full path.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::config(self.name(key), "required field is missing"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                Error::config(
                    self.name(key),
                    format!("expected a non-negative integer, got {v}"),
                )
            }),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| {
                Error::config(self.name(key), format!("expected a number, got {v}"))
            }),
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|_| self.f64_or(key, 0.0)).transpose()
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                Error::config(self.name(key), format!("expected true or false, got {v}"))
            }),
        }
    }

    fn str_or(&self, key: &str, default: &'a str) -> Result<&'a str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_str().ok_or_else(|| {
                Error::config(self.name(key), format!("expected a string, got {v}"))
            }),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || {
            Error::config(
                self.name(key),
                format!("expected a list of layer numbers, got {v}"),
            )
        };
        let arr = v.as_array().ok_or_else(bad)?;
        arr.iter()
            .map(|x| x.as_u64().map(|n| n as usize).ok_or_else(bad))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

impl KimiConfig {
    /// Reads a Hugging Face `config.json` of Kimi-Linear (`model_type: "kimi_linear"`) or K3 (the text
    /// model nested under `text_config`), e.g. `KimiConfig::from_hf_config("Kimi-Linear-48B-A3B/config.json")`.
    ///
    /// Errors name the offending field: a missing required value, a value of the wrong type, or a
    /// value this crate does not support (e.g. `hidden_act = "gelu"`, `mla_use_nope = false`).
    ///
    /// The load balancer is a training choice that published checkpoints do not record. The crate
    /// writes it as `load_balancer` ([`to_hf_json`](Self::to_hf_json)) and reads it back; without
    /// that field a sigmoid router gets its family's published rule: the sign update (γ = 1e-3)
    /// for Kimi-Linear, whose checkpoint carries the bias that rule trains
    /// (`e_score_correction_bias`, as in Moonlight and DeepSeek-V3), and Quantile Balancing for K3
    /// (a `text_config` document). A softmax router gets none.
    pub fn from_hf_config(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_hf_json(&value)
    }

    /// [`from_hf_config`](Self::from_hf_config) on an already parsed document.
    pub fn from_hf_json(value: &Value) -> Result<Self> {
        let root = value.as_object().ok_or_else(|| {
            Error::config("config.json", "expected a JSON object at the top level")
        })?;
        let (obj, prefix) = match root.get("text_config").and_then(Value::as_object) {
            Some(text) => (text, "text_config."),
            None => (root, ""),
        };
        if let Some(mt) = obj.get("model_type").and_then(Value::as_str) {
            if mt != "kimi_linear" && mt != "kimi_k3" {
                return Err(Error::config(
                    format!("{prefix}model_type"),
                    format!(
                        "expected \"kimi_linear\" (or a K3 config with text_config), got {mt:?}"
                    ),
                ));
            }
        }
        let f = Fields { obj, prefix };
        let hidden_size = f.usize("hidden_size")?;
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let activation = activation_of(&f)?;
        reject_unsupported(&f)?;
        let moe = moe_of(&f, hidden_size, prefix == "text_config.")?;
        let (full_attn_layers, kda) = linear_attention_of(obj, &f, num_hidden_layers)?;
        let mla = mla_of(&f)?;
        let mut moe = moe;
        // `quantization_config` sits at the top level of a Hugging Face config, also for K3.
        // An explicit `null` means none, as an absent key does (and does not hide a nested one).
        let quant = [root, obj]
            .into_iter()
            .find_map(|o| o.get("quantization_config").filter(|v| !v.is_null()));
        moe.qat = quant.map(qat_of).transpose()?;
        let config = Self {
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            num_hidden_layers,
            intermediate_size: f.usize("intermediate_size")?,
            first_k_dense_replace: f.opt_usize("first_k_dense_replace")?.unwrap_or(0),
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-5)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            activation,
            full_attn_layers,
            attn_res_block_size: f.opt_usize("attn_res_block_size")?,
            moe,
            kda,
            mla,
        };
        config.validate()?;
        Ok(config)
    }

    /// The Hugging Face `config.json` fields of this config (Kimi-Linear layout, top level), the
    /// inverse of [`from_hf_json`](Self::from_hf_json), with one exception: a plain latent MoE
    /// ([`MoeLayout::Latent`], no norm) as wide as the model reads back as the standard layout,
    /// as such a width means in published configs. The crate's own choices that Hugging Face
    /// configs lack are written as `load_balancer` and `moe_router_weights_from_biased_scores`.
    pub fn to_hf_json(&self) -> Value {
        let mut value = self.hf_fields();
        if let (Some(q), Some(obj)) = (self.moe.qat, value.as_object_mut()) {
            obj.insert("quantization_config".into(), qat_json(&q));
        }
        value
    }

    fn hf_fields(&self) -> Value {
        let (latent, norm) = match self.moe.layout {
            MoeLayout::Standard => (Value::Null, false),
            MoeLayout::Latent { dim } => (json!(dim), false),
            MoeLayout::StableLatent { dim } => (json!(dim), true),
        };
        let (act, b1, b2) = match self.activation {
            GluActivation::SwiGlu => ("silu", Value::Null, Value::Null),
            GluActivation::Situ { beta1, beta2 } => ("situ", json!(beta1), json!(beta2)),
        };
        let full: Vec<usize> = self.full_attn_layers.iter().map(|i| i + 1).collect();
        let kda: Vec<usize> = (1..=self.num_hidden_layers)
            .filter(|i| !full.contains(i))
            .collect();
        let mut value = json!({
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": act,
            "activation_situ_beta": b1,
            "activation_situ_linear_beta": b2,
            "attn_res_block_size": self.attn_res_block_size,
            "num_attention_heads": self.mla.num_heads,
            "q_lora_rank": self.mla.q_lora_rank,
            "kv_lora_rank": self.mla.kv_lora_rank,
            "qk_nope_head_dim": self.mla.qk_nope_head_dim,
            "qk_rope_head_dim": self.mla.qk_rope_head_dim,
            "v_head_dim": self.mla.v_head_dim,
            "mla_use_nope": self.mla.use_nope,
            "mla_use_output_gate": self.mla.use_output_gate,
            "num_experts": self.moe.num_experts,
            "num_experts_per_token": self.moe.num_experts_per_token,
            "num_shared_experts": self.moe.num_shared_experts,
            "moe_intermediate_size": self.moe.moe_intermediate_size,
            "routed_expert_hidden_size": latent,
            "latent_moe_use_norm": norm,
            "moe_renormalize": self.moe.router.renormalize,
            "moe_router_activation_func": match self.moe.router.scoring {
                Scoring::Sigmoid => "sigmoid",
                Scoring::Softmax => "softmax",
            },
            "routed_scaling_factor": self.moe.router.routed_scaling_factor,
            "num_expert_group": self.moe.router.n_group,
            "topk_group": self.moe.router.topk_group,
            "topk_method": "noaux_tc",
            "load_balancer": self.moe.balancer,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": kda,
                "num_heads": self.kda.num_heads,
                "head_dim": self.kda.head_dim,
                "short_conv_kernel_size": self.kda.short_conv_kernel_size,
                "gate_lower_bound": self.kda.gate_lower_bound,
                "use_full_rank_gate": self.kda.use_full_rank_gate,
            },
        });
        // Beside the macro: one more field there passes its recursion limit.
        if let Some(obj) = value.as_object_mut() {
            obj.insert(
                WEIGHTS_FROM_BIASED_SCORES.into(),
                json!(self.moe.router.weights_from_biased_scores),
            );
        }
        value
    }
}

/// This crate's field for [`RouterOptions::weights_from_biased_scores`] (design §2's compatibility
/// switch); Hugging Face configs do not have it, and without it the weights come from the
/// unbiased scores.
const WEIGHTS_FROM_BIASED_SCORES: &str = "moe_router_weights_from_biased_scores";

/// Converts 1-based layer numbers to 0-based indices, checking the range.
fn one_based(layers: &[usize], num_layers: usize, field: &str) -> Result<Vec<usize>> {
    layers
        .iter()
        .map(|&l| {
            if l == 0 || l > num_layers {
                Err(Error::config(
                    field,
                    format!("layer numbers are 1-based in 1..={num_layers}, got {l}"),
                ))
            } else {
                Ok(l - 1)
            }
        })
        .collect()
}

/// `hidden_act` and its SiTU caps. Without `hidden_act`, a config that gives a SiTU cap is SiTU
/// and any other SwiGLU. Design §1's defaults: `β1 = 4` when `activation_situ_beta` is absent,
/// `β2 = 25` when `activation_situ_linear_beta` is absent; an explicit `null` β2 is no cap (what
/// [`KimiConfig::to_hf_json`] writes for one).
fn activation_of(f: &Fields<'_>) -> Result<GluActivation> {
    let caps = ["activation_situ_beta", "activation_situ_linear_beta"];
    let default = if caps.iter().any(|c| f.get(c).is_some()) {
        "situ"
    } else {
        "silu"
    };
    let activation = match f.str_or("hidden_act", default)? {
        "silu" | "swiglu" => GluActivation::SwiGlu,
        "situ" => GluActivation::Situ {
            beta1: f.f64_or("activation_situ_beta", 4.0)? as f32,
            beta2: match f.obj.get(caps[1]) {
                None => Some(25.0),
                Some(_) => f.opt_f64(caps[1])?.map(|b| b as f32),
            },
        },
        other => {
            return Err(Error::config(
                f.name("hidden_act"),
                format!("expected \"silu\" or \"situ\", got {other:?}"),
            ))
        }
    };
    Ok(activation)
}

/// Rejects the values this crate cannot honour: RoPE MLA, multi-token prediction, MoE layers that
/// are not every layer after the dense ones.
fn reject_unsupported(f: &Fields<'_>) -> Result<()> {
    if !f.bool_or("mla_use_nope", true)? {
        return Err(Error::config(
            f.name("mla_use_nope"),
            "false (rotary MLA) is not supported: Kimi's MLA layers are NoPE",
        ));
    }
    let mtp = f.opt_usize("num_nextn_predict_layers")?.unwrap_or(0);
    if mtp != 0 {
        return Err(Error::config(
            f.name("num_nextn_predict_layers"),
            format!("multi-token prediction layers are not supported, got {mtp}"),
        ));
    }
    let freq = f.opt_usize("moe_layer_freq")?.unwrap_or(1);
    if freq != 1 {
        return Err(Error::config(
            f.name("moe_layer_freq"),
            format!("only 1 (every layer after the dense ones is MoE) is supported, got {freq}"),
        ));
    }
    Ok(())
}

/// The MoE fields: experts, router and the balancer (see [`balancer_of`]).
fn moe_of(f: &Fields<'_>, hidden_size: usize, k3: bool) -> Result<MoeFields> {
    let scoring = match f.str_or("moe_router_activation_func", "sigmoid")? {
        "sigmoid" => Scoring::Sigmoid,
        "softmax" => Scoring::Softmax,
        other => {
            return Err(Error::config(
                f.name("moe_router_activation_func"),
                format!("expected \"sigmoid\" or \"softmax\", got {other:?}"),
            ))
        }
    };
    let topk_method = f.str_or("topk_method", "noaux_tc")?;
    if !matches!(topk_method, "noaux_tc" | "greedy" | "group_limited_greedy") {
        return Err(Error::config(
            f.name("topk_method"),
            format!("expected \"noaux_tc\", \"greedy\" or \"group_limited_greedy\", got {topk_method:?}"),
        ));
    }
    let n_group = f.opt_usize("num_expert_group")?.unwrap_or(1);
    if topk_method != "noaux_tc" && n_group > 1 {
        // One group: every method picks the top k of the scores (plus a bias that starts at zero).
        // Groups are scored as noaux_tc scores them (design §2); the others score them otherwise.
        return Err(Error::config(
            f.name("topk_method"),
            format!(
                "{topk_method:?} with num_expert_group = {n_group} is not supported: grouped \
                 top-k scores a group by its two best biased scores (\"noaux_tc\")"
            ),
        ));
    }
    // A latent width equal to the model width is the standard layout in configs that give the
    // field anyway; with its norm (Stable LatentMoE) it is a latent layout whatever its width.
    let latent = f.opt_usize("routed_expert_hidden_size")?;
    let norm = f.bool_or("latent_moe_use_norm", false)?;
    let layout = match latent {
        Some(l) if norm => MoeLayout::StableLatent { dim: l },
        Some(l) if l != hidden_size => MoeLayout::Latent { dim: l },
        _ => MoeLayout::Standard,
    };
    let moe = MoeFields {
        num_experts: f.usize("num_experts")?,
        num_experts_per_token: f.usize("num_experts_per_token")?,
        num_shared_experts: f.opt_usize("num_shared_experts")?.unwrap_or(0),
        moe_intermediate_size: f.usize("moe_intermediate_size")?,
        layout,
        router: RouterOptions {
            scoring,
            renormalize: f.bool_or("moe_renormalize", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)?,
            n_group,
            topk_group: f.opt_usize("topk_group")?.unwrap_or(1),
            weights_from_biased_scores: f.bool_or(WEIGHTS_FROM_BIASED_SCORES, false)?,
        },
        balancer: balancer_of(f, k3, scoring)?,
        qat: None,
    };
    Ok(moe)
}

/// `linear_attn_config`: the 0-based MLA layers and the KDA fields.
fn linear_attention_of(
    obj: &Map<String, Value>,
    f: &Fields<'_>,
    num_hidden_layers: usize,
) -> Result<(Vec<usize>, KdaFields)> {
    let prefix = f.prefix;
    let la_obj = obj
        .get("linear_attn_config")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::config(f.name("linear_attn_config"), "required object is missing"))?;
    let la_prefix = format!("{prefix}linear_attn_config.");
    let la = Fields {
        obj: la_obj,
        prefix: &la_prefix,
    };
    let full_attn_layers = match (
        la.usize_list("full_attn_layers")?,
        la.usize_list("kda_layers")?,
    ) {
        (Some(full), _) => one_based(&full, num_hidden_layers, &la.name("full_attn_layers"))?,
        (None, Some(kda)) => {
            let kda = one_based(&kda, num_hidden_layers, &la.name("kda_layers"))?;
            (0..num_hidden_layers)
                .filter(|i| !kda.contains(i))
                .collect()
        }
        (None, None) => {
            return Err(Error::config(
                la.name("full_attn_layers"),
                "neither full_attn_layers nor kda_layers is given",
            ))
        }
    };
    let kda = KdaFields {
        num_heads: la.usize("num_heads")?,
        head_dim: la.usize("head_dim")?,
        short_conv_kernel_size: la.opt_usize("short_conv_kernel_size")?.unwrap_or(4),
        gate_lower_bound: la.opt_f64("gate_lower_bound")?.map(|v| v as f32),
        // Inside `linear_attn_config` (where this crate writes it) or beside it.
        use_full_rank_gate: match la.get("use_full_rank_gate") {
            Some(_) => la.bool_or("use_full_rank_gate", false)?,
            None => f.bool_or("use_full_rank_gate", false)?,
        },
    };
    Ok((full_attn_layers, kda))
}

/// The MLA fields (NoPE always: [`reject_unsupported`] has refused RoPE).
fn mla_of(f: &Fields<'_>) -> Result<MlaFields> {
    Ok(MlaFields {
        num_heads: f.usize("num_attention_heads")?,
        q_lora_rank: f.opt_usize("q_lora_rank")?,
        kv_lora_rank: f.usize("kv_lora_rank")?,
        qk_nope_head_dim: f.usize("qk_nope_head_dim")?,
        qk_rope_head_dim: f.usize("qk_rope_head_dim")?,
        v_head_dim: f.usize("v_head_dim")?,
        use_output_gate: f.bool_or("mla_use_output_gate", false)?,
        use_nope: true,
    })
}

/// The `quantization_config` of a QAT config (design §9).
///
/// Hugging Face's MXFP4 models (`quant_method: "mxfp4"`) record only that the experts' weights are
/// MXFP4. The crate adds what QAT also needs, with its own field names: `weight_format` and
/// `activation_format` (`"e2m1"`, `"e4m3"`, `"e5m2"` or null), their scale rules
/// (`"floor"`, `"ceil"`), and whether the shared experts and dense FFNs are quantised too.
fn qat_json(q: &QatConfig) -> Value {
    let format = |s: Option<MxSpec>| s.map(|s| format_name(s.format));
    let rule = |s: Option<MxSpec>| s.map(|s| rule_name(s.rule));
    let method = match q.weights.map(|w| w.format) {
        Some(MxFormat::Fp4E2M1) => "mxfp4",
        _ => "mx",
    };
    json!({
        "quant_method": method,
        "weight_format": format(q.weights),
        "weight_scale_rule": rule(q.weights),
        "activation_format": format(q.activations),
        "activation_scale_rule": rule(q.activations),
        "quantize_shared_experts": q.shared_experts,
        "quantize_dense_ffn": q.dense_ffn,
    })
}

fn format_name(f: MxFormat) -> &'static str {
    match f {
        MxFormat::Fp4E2M1 => "e2m1",
        MxFormat::Fp8E4M3 => "e4m3",
        MxFormat::Fp8E5M2 => "e5m2",
    }
}

fn rule_name(r: MxScaleRule) -> &'static str {
    match r {
        MxScaleRule::Floor => "floor",
        MxScaleRule::Ceil => "ceil",
    }
}

/// Reads [`qat_json`]'s document; a plain Hugging Face `{"quant_method": "mxfp4"}` means MXFP4
/// weights (specification scale rule) and full-precision activations. The scale rule `"rceil"`
/// (SPEC §9's name) reads as `"ceil"`.
fn qat_of(v: &Value) -> Result<QatConfig> {
    let obj = v.as_object().ok_or_else(|| {
        Error::config(
            "quantization_config",
            format!("expected an object, got {v}"),
        )
    })?;
    let f = Fields {
        obj,
        prefix: "quantization_config.",
    };
    let method = f.str_or("quant_method", "")?;
    if method != "mxfp4" && method != "mx" {
        return Err(Error::config(
            f.name("quant_method"),
            format!("only MX quantisation (\"mxfp4\", \"mx\") is supported, got {method:?}"),
        ));
    }
    let spec =
        |fmt_key: &str, rule_key: &str, default: Option<MxFormat>| -> Result<Option<MxSpec>> {
            let format = match f.get(fmt_key) {
                None if !obj.contains_key(fmt_key) => default,
                None => None,
                Some(_) => Some(match f.str_or(fmt_key, "")? {
                    "e2m1" => MxFormat::Fp4E2M1,
                    "e4m3" => MxFormat::Fp8E4M3,
                    "e5m2" => MxFormat::Fp8E5M2,
                    other => {
                        return Err(Error::config(
                            f.name(fmt_key),
                            format!("expected \"e2m1\", \"e4m3\", \"e5m2\" or null, got {other:?}"),
                        ))
                    }
                }),
            };
            let rule = match f.str_or(rule_key, "floor")? {
                "floor" => MxScaleRule::Floor,
                // "rceil" is SPEC §9's name of the rule.
                "ceil" | "rceil" => MxScaleRule::Ceil,
                other => {
                    return Err(Error::config(
                        f.name(rule_key),
                        format!("expected \"floor\" or \"ceil\" (\"rceil\"), got {other:?}"),
                    ))
                }
            };
            Ok(format.map(|format| MxSpec::new(format, rule)))
        };
    let weights = spec(
        "weight_format",
        "weight_scale_rule",
        (method == "mxfp4").then_some(MxFormat::Fp4E2M1),
    )?;
    let activations = spec("activation_format", "activation_scale_rule", None)?;
    Ok(QatConfig::new(weights, activations)
        .with_shared_experts(f.bool_or("quantize_shared_experts", false)?)
        .with_dense_ffn(f.bool_or("quantize_dense_ffn", false)?))
}

/// The balancer of a `config.json` (see [`KimiConfig::from_hf_config`]): the crate's own
/// `load_balancer` field when present, else the family's published rule for a sigmoid router.
fn balancer_of(f: &Fields<'_>, k3: bool, scoring: Scoring) -> Result<BalancerKind> {
    if let Some(v) = f.obj.get("load_balancer") {
        return serde_json::from_value(v.clone()).map_err(|e| {
            Error::config(
                f.name("load_balancer"),
                format!("expected a balancer such as {{\"Quantile\": {{\"bins\": 1000}}}}, {{\"QuantileTrend\": {{\"bins\": 1000, \"smoothing\": 0.3}}}}, {{\"Sign\": {{\"gamma\": 0.001}}}} or \"None\": {e}"),
            )
        });
    }
    Ok(match (scoring, k3) {
        (Scoring::Softmax, _) => BalancerKind::None,
        (Scoring::Sigmoid, true) => BalancerKind::quantile(),
        (Scoring::Sigmoid, false) => BalancerKind::Sign { gamma: 1e-3 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published Kimi-Linear-48B-A3B `config.json` fields (values as released).
    fn kimi_linear_json() -> Value {
        json!({
            "model_type": "kimi_linear",
            "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 27, "num_attention_heads": 32, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": false,
            "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": true,
            "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
            "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": true, "routed_scaling_factor": 2.446,
            "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
            "linear_attn_config": {
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4
            }
        })
    }

    #[test]
    fn kimi_linear_config_json_gives_the_preset() {
        // The whole value, balancer included: the file has none, so Kimi-Linear's sign rule.
        let parsed = KimiConfig::from_hf_json(&kimi_linear_json()).unwrap();
        assert_eq!(parsed, KimiConfig::kimi_linear_48b());
    }

    #[test]
    fn the_balancer_defaults_by_family_and_round_trips_when_written() {
        let mut nested = json!({ "text_config": kimi_linear_json() });
        let k3_default = KimiConfig::from_hf_json(&nested).unwrap().moe.balancer;
        assert_eq!(k3_default, BalancerKind::quantile());
        nested["text_config"]["moe_router_activation_func"] = json!("softmax");
        let softmax = KimiConfig::from_hf_json(&nested).unwrap().moe.balancer;
        assert_eq!(softmax, BalancerKind::None);
        for balancer in [
            BalancerKind::Quantile { bins: 37 },
            BalancerKind::QuantileTrend {
                bins: 37,
                smoothing: 0.25,
            },
            BalancerKind::Sign { gamma: 0.25 },
            BalancerKind::None,
        ] {
            let mut config = KimiConfig::kimi_linear_48b();
            config.moe.balancer = balancer;
            assert_eq!(
                KimiConfig::from_hf_json(&config.to_hf_json()).unwrap(),
                config
            );
        }
        let e = error_with(|o| {
            o.insert("load_balancer".into(), json!("Median"));
        });
        assert!(e.contains("load_balancer") && e.contains("Median"), "{e}");
    }

    #[test]
    fn k3_nested_text_config_gives_the_preset_and_round_trips() {
        let k3 = KimiConfig::k3();
        let nested = json!({ "model_type": "kimi_k3", "text_config": k3.to_hf_json() });
        assert_eq!(KimiConfig::from_hf_json(&nested).unwrap(), k3);
        let tiny = KimiConfig::tiny();
        assert_eq!(KimiConfig::from_hf_json(&tiny.to_hf_json()).unwrap(), tiny);
    }

    /// What [`to_hf_json`](KimiConfig::to_hf_json) writes reads back: the routing weights'
    /// compatibility switch, and a Stable LatentMoE as wide as the model.
    #[test]
    fn router_switch_and_a_full_width_stable_latent_moe_round_trip() {
        let mut config = KimiConfig::tiny();
        config.moe.router.weights_from_biased_scores = true;
        assert_eq!(
            KimiConfig::from_hf_json(&config.to_hf_json()).unwrap(),
            config
        );
        let mut config = KimiConfig::tiny();
        config.moe.layout = MoeLayout::StableLatent {
            dim: config.hidden_size,
        };
        assert_eq!(
            KimiConfig::from_hf_json(&config.to_hf_json()).unwrap(),
            config
        );
        // Without the norm, a latent width equal to the model's is the standard layout.
        let mut v = kimi_linear_json();
        v["routed_expert_hidden_size"] = json!(2304);
        let parsed = KimiConfig::from_hf_json(&v).unwrap();
        assert_eq!(parsed.moe.layout, MoeLayout::Standard);
    }

    /// SiTU's caps: design §1's β1 = 4 and β2 = 25 where a config leaves them out, no cap on the
    /// linear branch where it says `null`, SiTU where a config gives a cap but no `hidden_act`.
    #[test]
    fn situ_caps_default_to_the_design_values() {
        let situ = |edit: &dyn Fn(&mut Map<String, Value>)| {
            let mut v = kimi_linear_json();
            let o = v.as_object_mut().unwrap();
            o.insert("hidden_act".into(), json!("situ"));
            edit(o);
            KimiConfig::from_hf_json(&v).unwrap().activation
        };
        assert_eq!(situ(&|_| {}), GluActivation::situ());
        assert_eq!(
            situ(&|o| {
                o.insert("activation_situ_linear_beta".into(), Value::Null);
            }),
            GluActivation::Situ {
                beta1: 4.0,
                beta2: None
            }
        );
        assert_eq!(
            situ(&|o| {
                o.remove("hidden_act");
                o.insert("activation_situ_beta".into(), json!(3.0));
            }),
            GluActivation::Situ {
                beta1: 3.0,
                beta2: Some(25.0)
            }
        );
        let mut v = kimi_linear_json();
        v.as_object_mut().unwrap().remove("hidden_act");
        let parsed = KimiConfig::from_hf_json(&v).unwrap();
        assert_eq!(parsed.activation, GluActivation::SwiGlu);
    }

    #[test]
    fn the_full_rank_gate_may_sit_beside_linear_attn_config() {
        let mut v = kimi_linear_json();
        v["use_full_rank_gate"] = json!(true);
        assert!(KimiConfig::from_hf_json(&v).unwrap().kda.use_full_rank_gate);
        v["linear_attn_config"]["use_full_rank_gate"] = json!(false);
        assert!(!KimiConfig::from_hf_json(&v).unwrap().kda.use_full_rank_gate);
    }

    fn error_with(edit: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v = kimi_linear_json();
        edit(v.as_object_mut().unwrap());
        KimiConfig::from_hf_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn unsupported_or_missing_values_are_rejected_by_name() {
        let e = error_with(|o| {
            o.insert("hidden_act".into(), json!("gelu"));
        });
        assert!(e.contains("hidden_act") && e.contains("gelu"), "{e}");
        let e = error_with(|o| {
            o.remove("kv_lora_rank");
        });
        assert!(e.contains("kv_lora_rank") && e.contains("missing"), "{e}");
        let e = error_with(|o| {
            o.insert("mla_use_nope".into(), json!(false));
        });
        assert!(e.contains("mla_use_nope"), "{e}");
        let e = error_with(|o| {
            o["linear_attn_config"]["full_attn_layers"] = json!([4, 28]);
        });
        assert!(
            e.contains("linear_attn_config.full_attn_layers") && e.contains("28"),
            "{e}"
        );
        let e = error_with(|o| {
            o.insert("moe_router_activation_func".into(), json!("relu"));
        });
        assert!(
            e.contains("moe_router_activation_func") && e.contains("relu"),
            "{e}"
        );
        let e = error_with(|o| {
            o.insert("num_experts_per_token".into(), json!(256));
        });
        assert!(e.contains("top_k = 256"), "{e}");
        let e = error_with(|o| {
            o.insert("model_type".into(), json!("llama"));
        });
        assert!(e.contains("model_type") && e.contains("llama"), "{e}");
        let e = error_with(|o| {
            o.insert("hidden_size".into(), json!("wide"));
        });
        assert!(e.contains("hidden_size") && e.contains("wide"), "{e}");
        let e = error_with(|o| {
            o.insert("topk_method".into(), json!("group_limited_greedy"));
            o.insert("num_expert_group".into(), json!(8));
            o.insert("topk_group".into(), json!(4));
        });
        assert!(
            e.contains("topk_method") && e.contains("group_limited_greedy") && e.contains("8"),
            "{e}"
        );
    }
}
