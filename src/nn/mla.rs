//! Gated NoPE Multi-head Latent Attention (design §5): Kimi-Linear's and K3's full-attention layer.
//!
//! ```text
//! q      = W_q x   or   W_qb RMSNorm(W_qa x)                 # per head [q_nope (dn) | q_pe (dr)]
//! [c | k_pe] = W_kva x;   c = RMSNorm(c)  (eps 1e-6)          # c: [r], k_pe: [dr] shared by all heads
//! [k_nope_h | v_h] = W_kvb[h] c
//! o_h    = softmax(scale·[q_nope_h; q_pe_h]·[k_nope_h; k_pe]ᵀ + causal) · v_h,  scale = (dn + dr)^−1/2
//! y      = W_o (concat_h(o_h) ⊙ σ(W_g x))                     # the gate is optional (K3: on)
//! ```
//!
//! No rotary embedding is applied (NoPE; position comes from the KDA layers); the `dr` "rope" dims
//! are kept for checkpoint compatibility. A RoPE switch (`use_nope = false`) exists for
//! DeepSeek-style users. Training uses the expanded form ([`GatedMla::forward`]); decode
//! ([`GatedMla::forward_cached`]) caches only `c` and `k_pe` per token ([`MlaCache`]) and attends in
//! the absorbed form; [`GatedMla::prefill`] fills an empty cache through the expanded form.

use crate::ops::linear::linear;
use burn::config::Config;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Bool, Tensor};

use super::mla_cache::MlaCache;
use super::norm::{RmsNorm, RmsNormConfig};
use crate::error::{Error, Result};
use crate::ops::mla::{absorbed_attention, attention_mask, mla_attention, rotary};
use crate::ops::precision::sigmoid;

pub use crate::ops::mla::AttentionKind;

/// Configuration of [`GatedMla`]; the defaults are K3's head geometry (design §5).
#[derive(Config, Debug)]
pub struct MlaConfig {
    /// Model width `d` (`hidden_size`).
    pub d_model: usize,
    /// Attention heads `H` (`num_attention_heads`; Kimi-Linear 32, K3 96).
    pub num_heads: usize,
    /// Rank of the q LoRA (`q_lora_rank`; K3 1536); `None`: a plain `q_proj` (Kimi-Linear).
    #[config(default = "None")]
    pub q_lora_rank: Option<usize>,
    /// Width `r` of the compressed KV latent `c` (`kv_lora_rank`).
    #[config(default = 512)]
    pub kv_lora_rank: usize,
    /// Per-head q/k dims `dn` computed from the latent (`qk_nope_head_dim`).
    #[config(default = 128)]
    pub qk_nope_head_dim: usize,
    /// Per-head q dims `dr` matched against the key slice `k_pe` shared by all heads
    /// (`qk_rope_head_dim`; never rotated under NoPE).
    #[config(default = 64)]
    pub qk_rope_head_dim: usize,
    /// Per-head value dims `dv` (`v_head_dim`).
    #[config(default = 128)]
    pub v_head_dim: usize,
    /// The sigmoid output gate `g_proj` (`mla_use_output_gate`; K3 on, Kimi-Linear off).
    #[config(default = true)]
    pub use_output_gate: bool,
    /// NoPE (`mla_use_nope`): no rotary embedding. `false` rotates `q_pe` and `k_pe` (DeepSeek,
    /// "rotate half" layout, no YaRN); positions count every token, padding included, from 0 in
    /// [`GatedMla::forward`] and from the cache length in [`GatedMla::forward_cached`].
    #[config(default = true)]
    pub use_nope: bool,
    /// RoPE base, used only when `use_nope` is false.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// Epsilon of `q_a_layernorm` (`rms_norm_eps`).
    #[config(default = 1e-5)]
    pub rms_norm_eps: f64,
    /// Epsilon of `kv_a_layernorm` (1e-6 in the reference).
    #[config(default = 1e-6)]
    pub kv_norm_eps: f64,
    /// The implementation of the training / prefill attention.
    #[config(default = "AttentionKind::Fused")]
    pub attention: AttentionKind,
}

impl MlaConfig {
    /// Checks the widths and epsilons.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("d_model", self.d_model),
            ("num_heads", self.num_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(Error::config(field, "must be positive, got 0"));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err(Error::config(
                "q_lora_rank",
                "must be positive or None (a plain q_proj), got 0",
            ));
        }
        if !self.use_nope && !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(Error::config(
                "qk_rope_head_dim",
                format!(
                    "RoPE (use_nope = false) needs an even width, got {}",
                    self.qk_rope_head_dim
                ),
            ));
        }
        let theta_ok = self.rope_theta.is_finite() && self.rope_theta > 0.0;
        if !self.use_nope && !theta_ok {
            return Err(Error::config(
                "rope_theta",
                format!("must be finite and positive, got {}", self.rope_theta),
            ));
        }
        for (field, eps) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("kv_norm_eps", self.kv_norm_eps),
        ] {
            if !(eps.is_finite() && eps > 0.0) {
                return Err(Error::config(
                    field,
                    format!("must be finite and positive, got {eps}"),
                ));
            }
        }
        Ok(())
    }

    /// Builds the layer, or reports an invalid config.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<GatedMla<B>> {
        self.validate()?;
        let (d, h) = (self.d_model, self.num_heads);
        let q_width = h * self.qk_head_dim();
        let linear = |i, o| super::linear::<B>(i, o, device);
        let (q_proj, q_a_proj, q_a_layernorm, q_b_proj) = match self.q_lora_rank {
            None => (Some(linear(d, q_width)), None, None, None),
            Some(rank) => (
                None,
                Some(linear(d, rank)),
                Some(
                    RmsNormConfig::new(rank)
                        .with_epsilon(self.rms_norm_eps)
                        .init(device),
                ),
                Some(linear(rank, q_width)),
            ),
        };
        Ok(GatedMla {
            q_proj,
            q_a_proj,
            q_a_layernorm,
            q_b_proj,
            kv_a_proj_with_mqa: linear(d, self.kv_lora_rank + self.qk_rope_head_dim),
            kv_a_layernorm: RmsNormConfig::new(self.kv_lora_rank)
                .with_epsilon(self.kv_norm_eps)
                .init(device),
            kv_b_proj: linear(
                self.kv_lora_rank,
                h * (self.qk_nope_head_dim + self.v_head_dim),
            ),
            o_proj: linear(h * self.v_head_dim, d),
            g_proj: self.use_output_gate.then(|| linear(d, h * self.v_head_dim)),
            num_heads: h,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            rope: (!self.use_nope).then_some(self.rope_theta),
            attention: self.attention,
        })
    }

    /// Builds the layer.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> GatedMla<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Per-head q/k width `dn + dr` (192 in the real models).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values cached per token in decode: `kv_lora_rank + qk_rope_head_dim` (576, i.e. 1152 bytes
    /// in bf16, design §5).
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// The parameter count of the layer built from this config (norm gains included):
    ///
    /// ```text
    /// q:    d·H·(dn+dr)                      or  d·q_r + q_r + q_r·H·(dn+dr)   (q LoRA)
    /// kv:   d·(r+dr) + r + r·H·(dn+dv)
    /// out:  H·dv·d  (+ d·H·dv with the gate)
    /// ```
    pub fn num_params(&self) -> u64 {
        let d = self.d_model as u64;
        let h = self.num_heads as u64;
        let (r, dn, dr, dv) = (
            self.kv_lora_rank as u64,
            self.qk_nope_head_dim as u64,
            self.qk_rope_head_dim as u64,
            self.v_head_dim as u64,
        );
        let q = match self.q_lora_rank {
            None => d * h * (dn + dr),
            Some(q_r) => {
                let q_r = q_r as u64;
                d * q_r + q_r + q_r * h * (dn + dr)
            }
        };
        let kv = d * (r + dr) + r + r * h * (dn + dv);
        let gate = if self.use_output_gate { d * h * dv } else { 0 };
        q + kv + h * dv * d + gate
    }
}

/// Gated NoPE MLA (design §5). Field names are the Hugging Face checkpoint names under
/// `model.layers.{i}.self_attn.` (Burn's `Linear` weights are `[in, out]`, the transpose of
/// PyTorch's).
#[derive(Module, Debug)]
pub struct GatedMla<B: Backend> {
    /// Plain query projection `[d, H·(dn+dr)]` (without q LoRA).
    pub q_proj: Option<Linear<B>>,
    /// q LoRA down-projection `[d, q_lora_rank]`.
    pub q_a_proj: Option<Linear<B>>,
    /// RMSNorm of the q LoRA latent (`rms_norm_eps`).
    pub q_a_layernorm: Option<RmsNorm<B>>,
    /// q LoRA up-projection `[q_lora_rank, H·(dn+dr)]`; per head `[q_nope | q_pe]`.
    pub q_b_proj: Option<Linear<B>>,
    /// `[d, r + dr]`: the KV latent `c` then the shared key slice `k_pe`.
    pub kv_a_proj_with_mqa: Linear<B>,
    /// RMSNorm of `c` (eps 1e-6).
    pub kv_a_layernorm: RmsNorm<B>,
    /// `[r, H·(dn+dv)]`; per head the columns of `k_nope` (`W_UK`) then of `v` (`W_UV`).
    pub kv_b_proj: Linear<B>,
    /// Output projection `[H·dv, d]`.
    pub o_proj: Linear<B>,
    /// Output gate `[d, H·dv]` (full rank, per channel), when enabled.
    pub g_proj: Option<Linear<B>>,
    /// Heads `H`.
    pub num_heads: usize,
    /// `dn`.
    pub qk_nope_head_dim: usize,
    /// `dr`.
    pub qk_rope_head_dim: usize,
    /// `dv`.
    pub v_head_dim: usize,
    /// RoPE base when rotary embeddings are on; `None` under NoPE.
    #[module(skip)]
    pub rope: Option<f64>,
    /// The implementation of the expanded attention; switch it to compare paths.
    #[module(skip)]
    pub attention: AttentionKind,
}

impl<B: Backend> GatedMla<B> {
    /// Training / prefill forward with the expanded keys and values, causal.
    ///
    /// `x: [B, T, d]`, `padding: [B, T]` (`true` marks padding: those keys are never attended to,
    /// and the output at padding positions is zero) → `[B, T, d]`.
    ///
    /// # Panics
    /// On a shape mismatch (see [`try_forward`](Self::try_forward)).
    pub fn forward(&self, x: Tensor<B, 3>, padding: Option<Tensor<B, 2, Bool>>) -> Tensor<B, 3> {
        self.try_forward(x, padding)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`try_prefill`](Self::try_prefill), panicking on error.
    ///
    /// # Panics
    /// On a shape mismatch or a non-empty cache.
    pub fn prefill(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: &mut MlaCache<B>,
    ) -> Tensor<B, 3> {
        self.try_prefill(x, padding, cache)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward`](Self::forward), reporting a wrong input or mask shape as an [`Error`].
    ///
    /// On the CPU backends it runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    pub fn try_forward(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>> {
        crate::ops::backend::on_cpu_pool::<B, _>(|| self.try_forward_here(x, padding))
    }

    /// [`try_forward`](Self::try_forward) on this thread.
    fn try_forward_here(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<Tensor<B, 3>> {
        self.check_input(&x, padding.as_ref())?;
        let (y, _, _) = self.expanded(x, padding)?;
        Ok(y)
    }

    /// Prefill an **empty** cache with the expanded form: the same output as
    /// [`forward_cached`](Self::forward_cached) into an empty cache, but through the (fused)
    /// expanded attention, which for long prompts costs `dn + dr` rather than `r + dr` per score
    /// and element (192 vs 576 in the real models). Then decode with `forward_cached`.
    ///
    /// `x: [B, T, d]`, `padding: [B, T]` → `[B, T, d]`. Fails on a shape mismatch or when the
    /// cache already holds tokens (their positions would be ignored).
    pub fn try_prefill(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: &mut MlaCache<B>,
    ) -> Result<Tensor<B, 3>> {
        self.check_input(&x, padding.as_ref())?;
        if !cache.is_empty() {
            return Err(Error::argument(
                "cache",
                format!(
                    "prefill needs an empty cache, it holds {} tokens; use forward_cached",
                    cache.len()
                ),
            ));
        }
        let (y, latent, k_pe) = self.expanded(x, padding.clone())?;
        cache.append(latent, k_pe, padding)?;
        Ok(y)
    }

    /// The expanded form over positions `0..T`; also returns the cache entries `(c, k_pe)`.
    fn expanded(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>)> {
        let [batch, t, _] = x.dims();
        let (h, dn, dv) = (self.num_heads, self.qk_nope_head_dim, self.v_head_dim);
        let q = self.query_heads(x.clone(), 0)?;
        let (latent, k_pe) = self.latent(x.clone(), 0);
        // [B, T, H, dn + dv]: per head the key's first dims, then the value.
        let kv = linear(&self.kv_b_proj, latent.clone()).reshape([batch, t, h, dn + dv]);
        let o = mla_attention(q, kv, k_pe.clone(), dn, padding.clone(), self.attention);
        Ok((self.output(x, o, padding), latent, k_pe))
    }

    /// Decode / prefill through a latent cache: appends the new tokens' `c` and `k_pe` to `cache`
    /// and attends over all cached tokens in the absorbed form (design §5), causal within the new
    /// tokens. Equals [`forward`](Self::forward) over the whole sequence, position by position.
    ///
    /// `x: [B, T_new, d]`, `padding: [B, T_new]` (`true` = padding, remembered in the cache so
    /// that later tokens never attend to it) → `[B, T_new, d]`.
    ///
    /// # Panics
    /// On a shape mismatch (see [`try_forward_cached`](Self::try_forward_cached)).
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: &mut MlaCache<B>,
    ) -> Tensor<B, 3> {
        self.try_forward_cached(x, padding, cache)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`forward_cached`](Self::forward_cached), reporting a wrong input, mask or cache shape as
    /// an [`Error`]; the cache is left unchanged on error.
    ///
    /// On the CPU backends it runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    pub fn try_forward_cached(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: &mut MlaCache<B>,
    ) -> Result<Tensor<B, 3>> {
        crate::ops::backend::on_cpu_pool::<B, _>(|| self.try_forward_cached_here(x, padding, cache))
    }

    /// [`try_forward_cached`](Self::try_forward_cached) on this thread.
    fn try_forward_cached_here(
        &self,
        x: Tensor<B, 3>,
        padding: Option<Tensor<B, 2, Bool>>,
        cache: &mut MlaCache<B>,
    ) -> Result<Tensor<B, 3>> {
        let [batch, t, _] = self.check_input(&x, padding.as_ref())?;
        let start = cache.len();
        let (q_nope, q_pe) = self.query(x.clone(), start)?;
        let (latent, k_pe) = self.latent(x.clone(), start);
        cache.append(latent, k_pe, padding.clone())?;
        let (w_uk, w_uv) = self.absorbed_weights();
        let (latent, k_pe) = cache
            .tensors()
            .ok_or_else(|| Error::argument("cache", "empty after append"))?;
        let tk = start + t;
        let mask = attention_mask(batch, t, tk, cache.padding(), &x.device());
        let o = absorbed_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, mask, self.scale());
        Ok(self.output(x, o.swap_dims(1, 2), padding))
    }

    /// The attention scale `(dn + dr)^−1/2`.
    pub fn scale(&self) -> f64 {
        ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).powf(-0.5)
    }

    /// Model width `d`.
    pub fn d_model(&self) -> usize {
        self.kv_a_proj_with_mqa.weight.dims()[0]
    }

    /// Latent width `r` (`kv_lora_rank`).
    pub fn kv_lora_rank(&self) -> usize {
        self.kv_a_layernorm.weight.dims()[0]
    }

    /// The per-head up-projections of `kv_b_proj` split for the absorbed form:
    /// `W_UK: [H, dn, r]` (so that `q_lat = q_nope · W_UK[h]`) and `W_UV: [H, r, dv]`.
    pub fn absorbed_weights(&self) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (h, dn, dv) = (self.num_heads, self.qk_nope_head_dim, self.v_head_dim);
        let w = self
            .kv_b_proj
            .weight
            .val()
            .reshape([self.kv_lora_rank(), h, dn + dv])
            .swap_dims(0, 1);
        let w_uk = w.clone().narrow(2, 0, dn).swap_dims(1, 2);
        let w_uv = w.narrow(2, dn, dv);
        (w_uk, w_uv)
    }

    /// Per-head queries `(q_nope [B, H, T, dn], q_pe [B, H, T, dr])` for positions from `start`
    /// (the absorbed form takes the two apart).
    fn query(&self, x: Tensor<B, 3>, start: usize) -> Result<(Tensor<B, 4>, Tensor<B, 4>)> {
        let q = self.projected_query(x)?.swap_dims(1, 2);
        let (dn, dr) = (self.qk_nope_head_dim, self.qk_rope_head_dim);
        let q_nope = q.clone().narrow(3, 0, dn);
        let mut q_pe = q.narrow(3, dn, dr);
        if let Some(base) = self.rope {
            q_pe = rotary(q_pe, start, base);
        }
        Ok((q_nope, q_pe))
    }

    /// The queries `[B, T, H, dn + dr]` for positions from `start`, as the projection lays them
    /// out (each head's `dn` dims, then its `dr`, rotated when the layer has RoPE): what the
    /// expanded form takes whole.
    fn query_heads(&self, x: Tensor<B, 3>, start: usize) -> Result<Tensor<B, 4>> {
        let q = self.projected_query(x)?;
        let Some(base) = self.rope else {
            return Ok(q);
        };
        let (dn, dr) = (self.qk_nope_head_dim, self.qk_rope_head_dim);
        let q_pe = q.clone().narrow(3, dn, dr).swap_dims(1, 2);
        let q_pe = rotary(q_pe, start, base).swap_dims(1, 2);
        Ok(Tensor::cat(vec![q.narrow(3, 0, dn), q_pe], 3))
    }

    /// The query projection of `x: [B, T, d]` as `[B, T, H, dn + dr]`, nothing rotated.
    fn projected_query(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 4>> {
        let [batch, t, _] = x.dims();
        let width = self.qk_nope_head_dim + self.qk_rope_head_dim;
        let q =
            match (
                &self.q_proj,
                &self.q_a_proj,
                &self.q_a_layernorm,
                &self.q_b_proj,
            ) {
                (Some(q_proj), ..) => linear(q_proj, x),
                (None, Some(a), Some(norm), Some(b)) => linear(b, norm.forward(linear(a, x))),
                // `try_init` builds exactly one of the two forms; a hand-assembled module may not.
                _ => return Err(Error::config(
                    "q_proj",
                    "GatedMla needs either q_proj or all of q_a_proj, q_a_layernorm and q_b_proj",
                )),
            };
        Ok(q.reshape([batch, t, self.num_heads, width]))
    }

    /// The normalised latent `c: [B, T, r]` and the shared key slice `k_pe: [B, T, dr]` of the
    /// tokens at positions from `start` (what the decode cache stores).
    pub fn latent(&self, x: Tensor<B, 3>, start: usize) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let r = self.kv_lora_rank();
        let ckv = linear(&self.kv_a_proj_with_mqa, x);
        let c = self.kv_a_layernorm.forward(ckv.clone().narrow(2, 0, r));
        let mut k_pe = ckv.narrow(2, r, self.qk_rope_head_dim);
        if let Some(base) = self.rope {
            k_pe = rotary(k_pe.unsqueeze_dim::<4>(1), start, base).squeeze_dim(1);
        }
        (c, k_pe)
    }

    /// Heads `o: [B, T, H, dv]` → `W_o (concat_h(o_h) ⊙ σ(W_g x))`, zero at padding positions.
    fn output(
        &self,
        x: Tensor<B, 3>,
        o: Tensor<B, 4>,
        padding: Option<Tensor<B, 2, Bool>>,
    ) -> Tensor<B, 3> {
        let [batch, t, _, _] = o.dims();
        let width = self.num_heads * self.v_head_dim;
        let mut o = o.reshape([batch, t, width]);
        if let Some(g_proj) = &self.g_proj {
            o = o.mul(sigmoid(linear(g_proj, x)));
        }
        if let Some(pad) = padding {
            // A padding query may have no key to attend to; kernels disagree on what such a row
            // holds (zeros, NaN), so it is overwritten rather than trusted.
            o = o.mask_fill(pad.reshape([batch, t, 1]).expand([batch, t, width]), 0.0);
        }
        linear(&self.o_proj, o)
    }

    fn check_input(
        &self,
        x: &Tensor<B, 3>,
        padding: Option<&Tensor<B, 2, Bool>>,
    ) -> Result<[usize; 3]> {
        let dims = x.dims();
        let d = self.d_model();
        if dims[2] != d {
            return Err(Error::shape("x", format!("[batch, seq, {d}]"), dims));
        }
        if let Some(pad) = padding {
            if pad.dims() != [dims[0], dims[1]] {
                return Err(Error::shape(
                    "padding",
                    format!("[{}, {}]", dims[0], dims[1]),
                    pad.dims(),
                ));
            }
        }
        Ok(dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray<f32>;

    fn tiny() -> MlaConfig {
        MlaConfig::new(24, 3)
            .with_kv_lora_rank(10)
            .with_qk_nope_head_dim(6)
            .with_qk_rope_head_dim(4)
            .with_v_head_dim(5)
    }

    #[test]
    fn num_params_matches_the_module() {
        let device = Default::default();
        for q_lora in [None, Some(7)] {
            for gate in [false, true] {
                let config = tiny().with_q_lora_rank(q_lora).with_use_output_gate(gate);
                let module = config.init::<B>(&device);
                assert_eq!(
                    config.num_params(),
                    module.num_params() as u64,
                    "q_lora {q_lora:?}, gate {gate}"
                );
            }
        }
    }

    #[test]
    fn invalid_configs_name_the_field_and_value() {
        let device = Default::default();
        let cases = [
            (
                MlaConfig {
                    num_heads: 0,
                    ..tiny()
                },
                "num_heads",
            ),
            (tiny().with_kv_lora_rank(0), "kv_lora_rank"),
            (tiny().with_v_head_dim(0), "v_head_dim"),
            (tiny().with_q_lora_rank(Some(0)), "q_lora_rank"),
            (
                tiny().with_use_nope(false).with_qk_rope_head_dim(5),
                "qk_rope_head_dim",
            ),
            (tiny().with_kv_norm_eps(-1.0), "kv_norm_eps"),
        ];
        for (config, field) in cases {
            let err = config.try_init::<B>(&device).expect_err(field).to_string();
            assert!(err.contains(field), "{err}");
        }
        let err = tiny()
            .with_kv_norm_eps(-1.0)
            .validate()
            .expect_err("eps")
            .to_string();
        assert!(err.contains("-1"), "{err}");
    }

    #[test]
    fn wrong_shapes_are_errors() {
        let device = Default::default();
        let mla = tiny().init::<B>(&device);
        let x = Tensor::<B, 3>::zeros([2, 3, 23], &device);
        let err = mla.try_forward(x, None).expect_err("width").to_string();
        assert!(err.contains("23") && err.contains("24"), "{err}");
        let x = Tensor::<B, 3>::zeros([2, 3, 24], &device);
        let pad = Tensor::<B, 2, Bool>::from_data(
            burn::tensor::TensorData::new(vec![false; 8], [2, 4]),
            &device,
        );
        let err = mla
            .try_forward(x.clone(), Some(pad))
            .expect_err("padding")
            .to_string();
        assert!(err.contains("[2, 4]"), "{err}");
        let mut cache = MlaCache::new();
        mla.forward_cached(x, None, &mut cache);
        let x = Tensor::<B, 3>::zeros([3, 1, 24], &device);
        let err = mla
            .try_forward_cached(x, None, &mut cache)
            .expect_err("batch")
            .to_string();
        assert!(err.contains("batch"), "{err}");
        assert_eq!(cache.len(), 3, "a failed call must leave the cache alone");
    }

    #[test]
    fn cache_width_is_1152_bytes_in_bf16() {
        let config = MlaConfig::new(7168, 96);
        assert_eq!(config.cache_width() * 2, 1152);
        assert_eq!(config.qk_head_dim(), 192);
    }

    /// With RoPE on, the expanded form over the whole sequence (the query rotated whole, then
    /// [`mla_attention`]) equals the absorbed form through a cache in two pieces (the query split,
    /// its `q_pe` rotated at the cache's positions), on the host kernels and on the tensor ops.
    #[test]
    fn rope_expanded_equals_rope_absorbed() {
        use burn::tensor::{Distribution, Tolerance};
        let device = Default::default();
        let mla = tiny().with_use_nope(false).init::<B>(&device);
        let x = Tensor::<B, 3>::random([2, 9, 24], Distribution::Normal(0.0, 1.0), &device);
        for host in [true, false] {
            crate::ops::with_kernels(host, || {
                let whole = mla.forward(x.clone(), None);
                let mut cache = MlaCache::new();
                let head = mla.forward_cached(x.clone().narrow(1, 0, 5), None, &mut cache);
                let tail = mla.forward_cached(x.clone().narrow(1, 5, 4), None, &mut cache);
                Tensor::cat(vec![head, tail], 1)
                    .into_data()
                    .assert_approx_eq::<f32>(&whole.into_data(), Tolerance::rel_abs(1e-4, 1e-5));
            });
        }
    }
}
