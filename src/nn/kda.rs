//! The Kimi Delta Attention layer (design §4.2): projections, short convolutions, gates, the KDA
//! op, the gated output norm and the output projection.

use crate::ops::layout;
use crate::ops::linear::{linear, matmul_last};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{backend::Backend, Distribution, IndexingUpdateOp, Int, Tensor, TensorData};

use super::norm::{RmsNorm, RmsNormConfig};
use crate::error::{Error, Result};

use crate::ops::kda::conv::causal_conv1d_silu;
use crate::ops::kda::{
    check_cu_seqlens, kda_gate, layer_kda, rms_norm_gated, KdaOptions, CHUNK_SIZES, MAX_HEAD_DIM,
};
use crate::ops::precision::{sigmoid, widen};

/// Inputs whose longest sequence has at most this many tokens go through the recurrent op
/// ([`fused_recurrent_kda`](crate::ops::kda::fused_recurrent_kda)); longer ones through the
/// chunked op. 64 is where the two cost the same on ndarray (a chunked call has a fixed cost of
/// about 4 ms there, a recurrent step about 70 µs at H = 4, K = 64), and the reference library
/// switches at the same length.
pub const RECURRENT_MAX_TOKENS: usize = 64;

/// Configuration of [`KimiDeltaAttention`].
#[derive(Config, Debug)]
pub struct KdaConfig {
    /// Model width `d` (`hidden_size`).
    pub d_model: usize,
    /// KDA heads `H` (`linear_attn_config.num_heads`).
    pub num_heads: usize,
    /// Key and value head dim `K = V` (`linear_attn_config.head_dim`), at most 256.
    pub head_dim: usize,
    /// Kernel of the causal depthwise convolutions (`short_conv_kernel_size`, 4), at least 2.
    #[config(default = 4)]
    pub conv_size: usize,
    /// Lower bound `lb ∈ [−5, 0)` of the safe gate (K3: −5); `None`: the softplus gate.
    #[config(default = "None")]
    pub gate_lower_bound: Option<f32>,
    /// Full-rank output gate `g_proj` (K3) instead of the low-rank `g_a_proj`/`g_b_proj`.
    #[config(default = false)]
    pub use_full_rank_gate: bool,
    /// Epsilon of the gated output norm (`rms_norm_eps`).
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Chunk length of the chunked op: 16, 32 or 64.
    #[config(default = 64)]
    pub chunk_size: usize,
}

impl KdaConfig {
    /// Checks the widths, the conv kernel, the gate bound, the norm epsilon and the chunk size.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("d_model", self.d_model),
            ("num_heads", self.num_heads),
            ("head_dim", self.head_dim),
        ] {
            if value == 0 {
                return Err(Error::config(field, "must be positive, got 0"));
            }
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(Error::config(
                "head_dim",
                format!("must be at most {MAX_HEAD_DIM}, got {}", self.head_dim),
            ));
        }
        if self.conv_size < 2 {
            return Err(Error::config(
                "conv_size",
                format!(
                    "the short convolution needs at least 2 taps, got {}",
                    self.conv_size
                ),
            ));
        }
        if let Some(lb) = self.gate_lower_bound {
            if !(-5.0..0.0).contains(&lb) {
                return Err(Error::config(
                    "gate_lower_bound",
                    format!("must lie in [-5, 0), got {lb}"),
                ));
            }
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(Error::config(
                "norm_eps",
                format!("must be finite and positive, got {}", self.norm_eps),
            ));
        }
        if !CHUNK_SIZES.contains(&self.chunk_size) {
            return Err(Error::config(
                "chunk_size",
                format!("must be one of {CHUNK_SIZES:?}, got {}", self.chunk_size),
            ));
        }
        Ok(())
    }

    /// Width of the q, k and v projections, `P = H·K`.
    pub fn proj_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Parameters of the layer (what [`Module::num_params`] reports for it):
    /// `3dP` (q, k, v) + `3PW` (convs) + `dK + KP` (`f_a`, `f_b`) + `H` (`A_log`) + `P` (`dt_bias`)
    /// + `dH` (`b_proj`) + `dP` or `dK + KP` (output gate) + `K` (`o_norm`) + `Pd` (`o_proj`).
    pub fn num_params(&self) -> u64 {
        let d = self.d_model as u64;
        let (h, k) = (self.num_heads as u64, self.head_dim as u64);
        let p = h * k;
        let out_gate = if self.use_full_rank_gate {
            d * p
        } else {
            d * k + k * p
        };
        3 * d * p
            + 3 * p * self.conv_size as u64
            + d * k
            + k * p
            + h
            + p
            + d * h
            + out_gate
            + k
            + p * d
    }

    /// Builds the layer, or reports an invalid config.
    ///
    /// Initialisation (design §4.2): projections as Burn's `Linear`; `A_log = log U(1, 16)`;
    /// `dt_bias = softplus⁻¹(dt)` with `dt ~ logU(1e-3, 0.1)` floored at 1e-4; conv taps
    /// `U(−1/√W, 1/√W)` (PyTorch's `Conv1d` default, a reconstruction); `o_norm` weight one. All
    /// random draws use Burn's seeded generator (`B::seed`).
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<KimiDeltaAttention<B>> {
        self.validate()?;
        let (d, h, k) = (self.d_model, self.num_heads, self.head_dim);
        let p = self.proj_dim();
        let linear = |i, o| super::linear(i, o, device);
        let bound = 1.0 / (self.conv_size as f64).sqrt();
        let conv = || ShortConv {
            weight: Param::from_tensor(Tensor::random(
                [p, self.conv_size],
                Distribution::Uniform(-bound, bound),
                device,
            )),
        };
        let a_log = Tensor::<B, 1>::random([h], Distribution::Uniform(1.0, 16.0), device).log();
        let dt = Tensor::<B, 1>::random(
            [p],
            Distribution::Uniform(1e-3f64.ln(), 0.1f64.ln()),
            device,
        )
        .exp()
        .clamp_min(1e-4);
        // softplus⁻¹(dt) = dt + log(1 − e^{−dt})
        let dt_bias = dt.clone().add(dt.neg().exp().neg().add_scalar(1.0).log());
        let (g_a_proj, g_b_proj, g_proj) = if self.use_full_rank_gate {
            (None, None, Some(linear(d, p)))
        } else {
            (Some(linear(d, k)), Some(linear(k, p)), None)
        };
        Ok(KimiDeltaAttention {
            q_proj: linear(d, p),
            k_proj: linear(d, p),
            v_proj: linear(d, p),
            q_conv1d: conv(),
            k_conv1d: conv(),
            v_conv1d: conv(),
            f_a_proj: linear(d, k),
            f_b_proj: linear(k, p),
            a_log: Param::from_tensor(a_log),
            dt_bias: Param::from_tensor(dt_bias),
            b_proj: linear(d, h),
            g_a_proj,
            g_b_proj,
            g_proj,
            o_norm: RmsNormConfig::new(k)
                .with_epsilon(self.norm_eps)
                .init(device),
            o_proj: linear(p, d),
            num_heads: h,
            head_dim: k,
            gate_lower_bound: self.gate_lower_bound,
            chunk_size: self.chunk_size,
        })
    }

    /// Builds the layer.
    ///
    /// # Panics
    /// On an invalid config (see [`try_init`](Self::try_init)).
    pub fn init<B: Backend>(&self, device: &B::Device) -> KimiDeltaAttention<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A causal depthwise convolution's taps (checkpoint `{q,k,v}_conv1d.weight`, stored there as
/// `[P, 1, W]`).
#[derive(Module, Debug)]
pub struct ShortConv<B: Backend> {
    /// `[P, W]`; tap `W − 1` multiplies the current token.
    pub weight: Param<Tensor<B, 2>>,
}

/// Decode state of one [`KimiDeltaAttention`] layer for `N` sequences.
///
/// Starts empty (zero state, zero conv history); every forward pass that is given the cache reads
/// it and leaves the state after its last token. The tensors keep their autodiff graph; detach
/// them between steps when training with truncated back-propagation.
///
/// The layer takes the tensors out of the cache for the call (so that the CubeCL kernels can
/// update a state nobody else holds in place, without a copy) and puts the new ones back; a call
/// that returns an error after its input checks leaves the cache empty. Keep a clone of the
/// cache to branch from a state (the kernels then copy it first).
#[derive(Debug, Clone)]
pub struct KdaCache<B: Backend> {
    /// The recurrent state `[N, H, K, V]` in f32 (f64 on f64 backends).
    pub state: Option<Tensor<B, 4>>,
    /// The last `W − 1` raw (pre-conv) projected inputs per channel, `[N, 3·H·K, W − 1]`, channels
    /// ordered q, k, v.
    pub conv: Option<Tensor<B, 3>>,
}

impl<B: Backend> Default for KdaCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> KdaCache<B> {
    /// An empty cache: the next forward pass starts its sequences from scratch.
    pub fn new() -> Self {
        Self {
            state: None,
            conv: None,
        }
    }
}

/// Kimi Delta Attention (design §4.2):
///
/// ```text
/// q = L2Norm(SiLU(Conv(W_q x)));  k = L2Norm(SiLU(Conv(W_k x)));  v = SiLU(Conv(W_v x))
/// g = kda_gate(W_fb W_fa x, A_log, dt_bias, lb);   β = σ(W_b x)
/// o = KDA(q, k, v, g, β);   z = W_gb W_ga x  or  W_g x
/// y = W_o · concat_heads(RMSNorm_head(o) · w_norm ⊙ σ(z))
/// ```
///
/// Field names are the Hugging Face checkpoint names (`A_log` → `a_log`); Burn's `Linear` stores
/// `[in, out]`, the checkpoint `[out, in]`.
#[derive(Module, Debug)]
pub struct KimiDeltaAttention<B: Backend> {
    /// `W_q [d, H·K]`.
    pub q_proj: Linear<B>,
    /// `W_k [d, H·K]`.
    pub k_proj: Linear<B>,
    /// `W_v [d, H·K]`.
    pub v_proj: Linear<B>,
    /// Short convolution of q, `[H·K, W]`.
    pub q_conv1d: ShortConv<B>,
    /// Short convolution of k, `[H·K, W]`.
    pub k_conv1d: ShortConv<B>,
    /// Short convolution of v, `[H·K, W]`.
    pub v_conv1d: ShortConv<B>,
    /// Forget gate, low-rank down `[d, K]`.
    pub f_a_proj: Linear<B>,
    /// Forget gate, low-rank up `[K, H·K]`.
    pub f_b_proj: Linear<B>,
    /// Per-head decay rate `A_log [H]` (checkpoint `A_log`, `[1, 1, H, 1]`).
    pub a_log: Param<Tensor<B, 1>>,
    /// Gate bias `[H·K]`.
    pub dt_bias: Param<Tensor<B, 1>>,
    /// `W_b [d, H]`: one β per head.
    pub b_proj: Linear<B>,
    /// Low-rank output gate, down `[d, K]` (Kimi-Linear).
    pub g_a_proj: Option<Linear<B>>,
    /// Low-rank output gate, up `[K, H·K]` (Kimi-Linear).
    pub g_b_proj: Option<Linear<B>>,
    /// Full-rank output gate `[d, H·K]` (K3).
    pub g_proj: Option<Linear<B>>,
    /// Gated output norm, weight `[K]` shared by the heads.
    pub o_norm: RmsNorm<B>,
    /// `W_o [H·K, d]`.
    pub o_proj: Linear<B>,
    /// Heads `H`.
    #[module(skip)]
    pub num_heads: usize,
    /// Head dim `K = V`.
    #[module(skip)]
    pub head_dim: usize,
    /// Safe-gate lower bound.
    #[module(skip)]
    pub gate_lower_bound: Option<f32>,
    /// Chunk length of the chunked op.
    #[module(skip)]
    pub chunk_size: usize,
}

impl<B: Backend> KimiDeltaAttention<B> {
    /// `x: [B, T, d]` → `[B, T, d]`, every row its own sequence.
    ///
    /// With a cache, the rows continue the cached sequences (`N = B`) and the cache is advanced
    /// past them: prefill then decode token by token equals one pass over the whole sequence.
    /// Inputs with `T ≤` [`RECURRENT_MAX_TOKENS`] use the recurrent op, longer ones the chunked op
    /// (and so does training on the CubeCL backends, where only the chunked kernels have a fused
    /// backward).
    ///
    /// # Panics
    /// On a width mismatch or a cache of the wrong shape (see [`try_forward`](Self::try_forward)).
    pub fn forward(&self, x: Tensor<B, 3>, cache: Option<&mut KdaCache<B>>) -> Tensor<B, 3> {
        self.try_forward(x, None, cache)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Packed variable-length sequences: `x: [1, ΣT_n, d]` with `cu_seqlens = [0, T_1, …, ΣT_n]`
    /// → `[1, ΣT_n, d]`. The convolutions and the recurrence restart at every boundary; a cache
    /// holds one row per sequence (`N` = number of sequences).
    ///
    /// # Panics
    /// On invalid input (see [`try_forward`](Self::try_forward)).
    pub fn forward_packed(
        &self,
        x: Tensor<B, 3>,
        cu_seqlens: &[usize],
        cache: Option<&mut KdaCache<B>>,
    ) -> Tensor<B, 3> {
        self.try_forward(x, Some(cu_seqlens), cache)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Checks a decode cache's state `[N, H, K, V]` and conv tail `[N, 3·H·K, W − 1]` against
    /// this layer and `n` sequences.
    fn check_cache(&self, cache: Option<&KdaCache<B>>, n: usize) -> Result<()> {
        let (h, k) = (self.num_heads, self.head_dim);
        let p = h * k;
        let w = self.q_conv1d.weight.dims()[1];
        let (state, conv_tail) = match cache {
            Some(c) => (c.state.as_ref(), c.conv.as_ref()),
            None => (None, None),
        };
        if let Some(s) = state {
            if s.dims() != [n, h, k, k] {
                return Err(Error::shape(
                    "cache.state",
                    format!("[N, H, K, V] = [{n}, {h}, {k}, {k}]"),
                    s.dims(),
                ));
            }
        }
        if let Some(c) = conv_tail {
            if c.dims() != [n, 3 * p, w - 1] {
                return Err(Error::shape(
                    "cache.conv",
                    format!("[N, 3·H·K, W − 1] = [{n}, {}, {}]", 3 * p, w - 1),
                    c.dims(),
                ));
            }
        }
        Ok(())
    }

    /// [`forward`](Self::forward) (`cu_seqlens = None`) or
    /// [`forward_packed`](Self::forward_packed), reporting a width mismatch, a malformed
    /// `cu_seqlens` and a cache whose tensors are not `[N, H, K, K]` and `[N, 3·H·K, W − 1]`.
    ///
    /// On the CPU backends it runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    pub fn try_forward(
        &self,
        x: Tensor<B, 3>,
        cu_seqlens: Option<&[usize]>,
        cache: Option<&mut KdaCache<B>>,
    ) -> Result<Tensor<B, 3>> {
        crate::ops::backend::on_cpu_pool::<B, _>(|| self.try_forward_here(x, cu_seqlens, cache))
    }

    /// [`try_forward`](Self::try_forward) on this thread.
    fn try_forward_here(
        &self,
        x: Tensor<B, 3>,
        cu_seqlens: Option<&[usize]>,
        mut cache: Option<&mut KdaCache<B>>,
    ) -> Result<Tensor<B, 3>> {
        let [b, t, d] = x.dims();
        let d_model = self.q_proj.weight.dims()[0];
        let (h, k) = (self.num_heads, self.head_dim);
        let p = h * k;
        if d != d_model || b == 0 || t == 0 {
            return Err(Error::shape(
                "x",
                format!("[B, T, d_model] = [B ≥ 1, T ≥ 1, {d_model}]"),
                [b, t, d],
            ));
        }
        let seqs = cu_seqlens
            .map(|cu| check_cu_seqlens(cu, b, t))
            .transpose()?;
        let n = seqs.as_ref().map_or(b, Vec::len);
        let longest = seqs
            .as_ref()
            .map_or(t, |s| s.iter().map(|s| s.1).max().unwrap_or(0));
        self.check_cache(cache.as_deref(), n)?;
        // The cache hands its tensors over (rather than sharing them), so that the kernels can
        // update the recurrent state in place.
        let (state, conv_tail) = match cache.as_deref_mut() {
            Some(c) => (c.state.take(), c.conv.take()),
            None => (None, None),
        };

        let (q, k_, v, new_tail) = if cache.is_none() {
            // Without a cache (training, prefill) q, k and v each get their product and short
            // convolution: no `[B, T, 3P]` tensor to cut into three, whose cuts cost a copy each
            // forward and, backward, a zero-filled `[B, T, 3P]` gradient each, summed (about 6%
            // of the tiny model's CPU training step; BENCHMARKS).
            let part = |proj: &Linear<B>, conv: Tensor<B, 2>| {
                let y = linear(proj, x.clone());
                let (y, _) = causal_conv1d_silu(y, conv, seqs.as_deref(), None, false);
                layout::reshape(y, [b, t, h, k])
            };
            (
                part(&self.q_proj, self.q_conv1d.weight.val()),
                part(&self.k_proj, self.k_conv1d.weight.val()),
                part(&self.v_proj, self.v_conv1d.weight.val()),
                None,
            )
        } else {
            // With a cache, whose tail holds the 3P channels together: short convolutions of q, k
            // and v as one depthwise convolution over 3P channels.
            let qkv = self.qkv_proj(x.clone());
            let taps = Tensor::cat(
                vec![
                    self.q_conv1d.weight.val(),
                    self.k_conv1d.weight.val(),
                    self.v_conv1d.weight.val(),
                ],
                0,
            );
            let (qkv, new_tail) = causal_conv1d_silu(qkv, taps, seqs.as_deref(), conv_tail, true);
            let heads = |i: usize| qkv.clone().narrow(2, i * p, p).reshape([b, t, h, k]);
            (heads(0), heads(1), heads(2), new_tail)
        };

        let f = linear(&self.f_b_proj, linear(&self.f_a_proj, x.clone()));
        let g = kda_gate(
            f.reshape([b, t, h, k]),
            self.a_log.val(),
            self.dt_bias.val(),
            self.gate_lower_bound,
        );
        let beta = sigmoid(widen(linear(&self.b_proj, x.clone())).0);

        let mut opts = KdaOptions::default()
            .with_qk_l2norm(true)
            .with_chunk_size(self.chunk_size)
            .with_final_state(cache.is_some());
        opts.initial_state = state;
        opts.cu_seqlens = cu_seqlens.map(<[usize]>::to_vec);
        // The op picks its path (CPU host kernel, CubeCL kernels or tensor ops); the gates are ≤ 0
        // by construction, so it skips their host read-back.
        let (o, final_state) = layer_kda(q, k_, v, g, beta, opts, longest, RECURRENT_MAX_TOKENS)?;
        if let Some(c) = cache {
            c.state = final_state;
            c.conv = new_tail;
        }

        let z = match (&self.g_proj, &self.g_a_proj, &self.g_b_proj) {
            (Some(g_proj), _, _) => linear(g_proj, x),
            (None, Some(a), Some(b_)) => linear(b_, linear(a, x)),
            _ => unreachable!("the config builds either g_proj or g_a_proj and g_b_proj"),
        };
        let o = rms_norm_gated(
            o,
            z.reshape([b, t, h, k]),
            self.o_norm.weight.val(),
            self.o_norm.epsilon,
        );
        Ok(linear(&self.o_proj, o.reshape([b, t, p])))
    }
}

impl<B: Backend> KimiDeltaAttention<B> {
    /// The q, k and v projections of `x: [B, T, d]` side by side, `[B, T, 3P]` (the channel order
    /// of the short convolutions and of the cache's tail). With at least as many tokens as model
    /// dims (a prefill into a cache) and no biases, one product with the three weights side by
    /// side: a copy of `d × 3P` weights instead of the `B·T × 3P` outputs. A decode step's few
    /// tokens take three products and the copy of their outputs.
    fn qkv_proj(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        if b * t >= d && projections.iter().all(|l| l.bias.is_none()) {
            let w = Tensor::cat(projections.map(|l| l.weight.val()).to_vec(), 1);
            return matmul_last(x, w);
        }
        Tensor::cat(projections.map(|l| linear(l, x.clone())).to_vec(), 2)
    }
}

impl<B: Backend> KimiDeltaAttention<B> {
    /// `x: [B, T, d]` whose `padding` (`[B, T]` row-major on the host, `true` = padding) marks
    /// the positions that are not part of their row's sequence → `[B, T, d]`, zero at padding.
    ///
    /// Each row's sequence is its tokens that are not padding, in order, wherever the padding
    /// lies (left, right or in between): the padding neither enters the short convolutions nor
    /// moves the recurrent state. With a cache, the rows continue the cached sequences (`N = B`)
    /// and only their tokens advance it; a row that is all padding keeps its cached state as it
    /// is. So a prefill of prompts of different lengths, padded to one `T`, and the decode steps
    /// after it give each row what it gets alone.
    ///
    /// The rows' tokens run as packed sequences ([`forward_packed`](Self::forward_packed)); the
    /// mask is a host slice because the packing is planned on the host. Without padding this is
    /// [`try_forward`](Self::try_forward).
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward), and when `padding` does not hold `B·T` values.
    pub fn try_forward_padded(
        &self,
        x: Tensor<B, 3>,
        padding: &[bool],
        cache: Option<&mut KdaCache<B>>,
    ) -> Result<Tensor<B, 3>> {
        let [b, t, d] = x.dims();
        if padding.len() != b * t {
            return Err(Error::shape(
                "padding",
                format!("B·T = {b}·{t} = {} values", b * t),
                padding.len(),
            ));
        }
        if !padding.contains(&true) {
            return self.try_forward(x, None, cache);
        }
        let d_model = self.q_proj.weight.dims()[0];
        if d != d_model {
            return Err(Error::shape(
                "x",
                format!("[B, T, d_model] = [B ≥ 1, T ≥ 1, {d_model}]"),
                [b, t, d],
            ));
        }
        self.check_cache(cache.as_deref(), b)?;
        // The flat positions of every row's tokens, row after row; the rows that have any.
        let mut index = Vec::new();
        let mut cu = vec![0];
        let mut rows = Vec::new();
        for (row, mask) in padding.chunks_exact(t).enumerate() {
            let before = index.len();
            index.extend((0..t).filter(|&i| !mask[i]).map(|i| (row * t + i) as i64));
            if index.len() > before {
                rows.push(row);
                cu.push(index.len());
            }
        }
        let tokens = index.len();
        if tokens == 0 {
            return Ok(x.zeros_like());
        }
        let device = x.device();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [tokens]), &device);
        let packed = x
            .clone()
            .reshape([b * t, d])
            .select(0, index.clone())
            .reshape([1, tokens, d]);
        let y = match cache {
            Some(c) if rows.len() < b => {
                // Only the rows with tokens run; the others keep their cached state.
                let picked = Tensor::<B, 1, Int>::from_data(
                    TensorData::new(rows.iter().map(|&r| r as i64).collect(), [rows.len()]),
                    &device,
                );
                let mut part = KdaCache {
                    state: c.state.clone().map(|s| s.select(0, picked.clone())),
                    conv: c.conv.clone().map(|s| s.select(0, picked)),
                };
                let y = self.try_forward(packed, Some(&cu), Some(&mut part))?;
                c.state = merge_rows(c.state.take(), part.state, &rows, b);
                c.conv = merge_rows(c.conv.take(), part.conv, &rows, b);
                y
            }
            cache => self.try_forward(packed, Some(&cu), cache)?,
        };
        Ok(x.zeros_like()
            .reshape([b * t, d])
            .select_assign(0, index, y.reshape([tokens, d]), IndexingUpdateOp::Add)
            .reshape([b, t, d]))
    }
}

/// A cache tensor of `b` rows: row `rows[i]` from `new`'s row `i`, every other row from `old`
/// (zeros where `old` is `None`, as for an empty cache).
fn merge_rows<B: Backend, const D: usize>(
    old: Option<Tensor<B, D>>,
    new: Option<Tensor<B, D>>,
    rows: &[usize],
    b: usize,
) -> Option<Tensor<B, D>> {
    let Some(new) = new else {
        return old;
    };
    let parts = (0..b)
        .map(|r| match rows.iter().position(|&p| p == r) {
            Some(i) => new.clone().narrow(0, i, 1),
            None => match &old {
                Some(old) => old.clone().narrow(0, r, 1),
                None => new.clone().narrow(0, 0, 1).zeros_like(),
            },
        })
        .collect();
    Some(Tensor::cat(parts, 0))
}
