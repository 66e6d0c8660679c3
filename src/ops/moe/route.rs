//! Top-k expert selection and routing weights (design §2).
//!
//! Selection is a discrete decision, so the reference path makes it on the host with an exact,
//! backend-independent tie-break (the lower expert index wins); the routing weights are then
//! gathered from the device scores so that the router stays differentiable.

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ops::backend::host::parallel_map_sized;

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[non_exhaustive]
pub enum Scoring {
    /// `s = σ(logits)` per expert (DeepSeek-V3, Kimi K2/K3): auxiliary-loss-free routing.
    #[default]
    Sigmoid,
    /// `s = softmax(logits)` over the experts (Mixtral-style standard MoE).
    Softmax,
}

/// Host-side result of the top-k selection for `m` tokens over `n` experts.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// Number of tokens.
    pub tokens: usize,
    /// Number of experts.
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
    /// `[tokens, k]` row-major: each token's experts, best first (ties: lower index first).
    pub indices: Vec<u32>,
}

/// Options of [`select_top_k`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKOptions {
    /// Experts per token, `1 ≤ k < n`.
    pub k: usize,
    /// Number of expert groups (DeepSeek-V3 `n_group`); 1 disables grouping.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`), `k` experts are then chosen among them.
    pub topk_group: usize,
}

impl TopKOptions {
    /// Checks `1 ≤ k < n`, `n_group` divides `n` and the kept groups hold at least `k` experts.
    pub fn validate(&self, n: usize) -> Result<()> {
        if self.k == 0 || self.k >= n {
            return Err(Error::config(
                "top_k",
                format!(
                    "need 1 <= top_k < n_experts, got top_k = {} with n_experts = {n}",
                    self.k
                ),
            ));
        }
        if self.n_group == 0 || !n.is_multiple_of(self.n_group) {
            return Err(Error::config(
                "n_group",
                format!(
                    "n_group = {} must be positive and divide n_experts = {n}",
                    self.n_group
                ),
            ));
        }
        let per_group = n / self.n_group;
        if self.topk_group == 0
            || self.topk_group > self.n_group
            || self.topk_group * per_group < self.k
        {
            return Err(Error::config(
                "topk_group",
                format!(
                    "topk_group = {} must be in 1..={} and keep at least top_k = {} experts ({} per group)",
                    self.topk_group, self.n_group, self.k, per_group
                ),
            ));
        }
        Ok(())
    }
}

/// Orders `(value, index)` pairs best first: larger value, then lower index.
fn better(a: (f32, usize), b: (f32, usize)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Selects each token's top-k experts by `scores + bias` (design §2), on the host.
///
/// `scores: [m, n]` row-major, `bias: [n]`. With `n_group > 1`, a group's score is the sum of its
/// two best biased scores (its best one for groups of one expert), only the `topk_group` best
/// groups stay eligible, and ties between groups or experts go to the lower index.
///
/// Errors on a NaN score or bias, or options that do not fit `n`.
pub fn select_top_k(
    scores: &[f32],
    n: usize,
    bias: &[f32],
    opts: TopKOptions,
) -> Result<Selection> {
    opts.validate(n)?;
    if bias.len() != n {
        return Err(Error::shape("bias", format!("[{n}]"), [bias.len()]));
    }
    if !scores.len().is_multiple_of(n) {
        return Err(Error::shape("scores", format!("[m, {n}]"), [scores.len()]));
    }
    if let Some(j) = bias.iter().position(|b| !b.is_finite()) {
        return Err(Error::NonFinite {
            what: "balance bias".into(),
            detail: format!("bias[{j}] = {}", bias[j]),
        });
    }
    let m = scores.len() / n;
    // Rows in chunks, on rayon's pool when there are several: each row is independent, and on a
    // CPU backend this loop otherwise runs alone while the other cores wait for the experts.
    let chunks: Vec<Result<Vec<u32>>> =
        parallel_map_sized(m.div_ceil(TOP_K_CHUNK), scores.len() * opts.k.max(1), |c| {
            let rows = c * TOP_K_CHUNK..((c + 1) * TOP_K_CHUNK).min(m);
            select_rows(
                &scores[rows.start * n..rows.end * n],
                rows.start,
                n,
                bias,
                opts,
            )
        });
    let mut indices = Vec::with_capacity(m * opts.k);
    for chunk in chunks {
        indices.extend(chunk?);
    }
    Ok(Selection {
        tokens: m,
        experts: n,
        k: opts.k,
        indices,
    })
}

/// Tokens per task of [`select_top_k`].
const TOP_K_CHUNK: usize = 256;

/// [`select_top_k`] of the rows `scores: [rows, n]`, the first of which is token `first`.
fn select_rows(
    scores: &[f32],
    first: usize,
    n: usize,
    bias: &[f32],
    opts: TopKOptions,
) -> Result<Vec<u32>> {
    let k = opts.k;
    let per_group = n / opts.n_group;
    let mut indices = Vec::with_capacity(scores.len() / n * k);
    let mut biased: Vec<(f32, usize)> = Vec::with_capacity(n);
    let mut groups: Vec<(f32, usize)> = Vec::with_capacity(opts.n_group);
    for (t, row) in scores.chunks_exact(n).enumerate() {
        biased.clear();
        for (j, (&s, &b)) in row.iter().zip(bias).enumerate() {
            if s.is_nan() {
                return Err(Error::NonFinite {
                    what: "router scores".into(),
                    detail: format!("token {}, expert {j} is NaN", first + t),
                });
            }
            biased.push((s + b, j));
        }
        if opts.n_group > 1 && opts.topk_group < opts.n_group {
            groups.clear();
            for (gi, grp) in biased.chunks_exact(per_group).enumerate() {
                let mut best = [f32::NEG_INFINITY; 2];
                for &(v, _) in grp {
                    if v > best[0] {
                        best = [v, best[0]];
                    } else if v > best[1] {
                        best[1] = v;
                    }
                }
                let score = if per_group == 1 {
                    best[0]
                } else {
                    best[0] + best[1]
                };
                groups.push((score, gi));
            }
            groups.sort_by(|&a, &b| better(a, b));
            let mut keep = vec![false; opts.n_group];
            for &(_, gi) in &groups[..opts.topk_group] {
                keep[gi] = true;
            }
            biased.retain(|&(_, j)| keep[j / per_group]);
        }
        biased.select_nth_unstable_by(k - 1, |&a, &b| better(a, b));
        let top = &mut biased[..k];
        top.sort_by(|&a, &b| better(a, b));
        indices.extend(top.iter().map(|&(_, j)| j as u32));
    }
    Ok(indices)
}

impl Selection {
    /// The selected indices as a device tensor `[tokens, k]`.
    pub fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        let data: Vec<i64> = self.indices.iter().map(|&i| i as i64).collect();
        Tensor::from_data(TensorData::new(data, [self.tokens, self.k]), device)
    }
}

/// Reads a float tensor of any dtype back to the host as `f32`s (row-major).
pub fn to_host_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    if let Some(v) = crate::ops::backend::host::read_in_place(&t, <[f32]>::to_vec) {
        return v;
    }
    let data = crate::sync::read(t);
    match data.dtype {
        burn::tensor::DType::F32 => data
            .into_vec::<f32>()
            .unwrap_or_else(|e| unreachable!("f32 data: {e:?}")),
        _ => data.iter::<f32>().collect(),
    }
}

/// Which of `m` tokens count (`false`: padding), kept on the host, on the device or both: each
/// side is made from the other the first time it is asked for. A mask made from a device tensor
/// ([`from_padding`](Self::from_padding)) is read back only if a host path asks
/// ([`host`](Self::host)); the kernel path never does.
#[derive(Debug, Clone)]
pub struct TokenMask<B: Backend> {
    len: usize,
    host: std::sync::OnceLock<Vec<bool>>,
    device: std::sync::OnceLock<Tensor<B, 1, Int>>,
}

impl<B: Backend> TokenMask<B> {
    /// A mask from host flags (`true`: the token counts).
    pub fn from_host(valid: Vec<bool>) -> Self {
        Self {
            len: valid.len(),
            host: valid.into(),
            device: std::sync::OnceLock::new(),
        }
    }

    /// The tokens of a `[batch, seq]` padding mask (`true`: padding) that count, flattened, on
    /// the device (no read).
    pub fn from_padding(padding: Tensor<B, 2, burn::tensor::Bool>) -> Self {
        let [batch, seq] = padding.dims();
        Self {
            len: batch * seq,
            host: std::sync::OnceLock::new(),
            device: padding.bool_not().int().reshape([batch * seq]).into(),
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a mask of no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The flags on the host (one device read the first time, for a mask made on the device).
    pub fn host(&self) -> &[bool] {
        self.host.get_or_init(|| {
            let device = self
                .device
                .get()
                .unwrap_or_else(|| unreachable!("a mask is made on one side or the other"));
            crate::sync::read(device.clone())
                .iter::<i64>()
                .map(|v| v != 0)
                .collect()
        })
    }

    /// The flags on `device` as `[m]` integers (1: the token counts), uploaded the first time
    /// for a mask made on the host.
    pub fn device(&self, device: &B::Device) -> Tensor<B, 1, Int> {
        self.device
            .get_or_init(|| {
                let v: Vec<i32> = self
                    .host
                    .get()
                    .unwrap_or_else(|| unreachable!("a mask is made on one side or the other"))
                    .iter()
                    .map(|&b| b as i32)
                    .collect();
                Tensor::from_data(TensorData::new(v, [self.len]), device)
            })
            .clone()
    }
}

/// The result of [`route_top_k_fused`], on the device.
#[derive(Debug, Clone)]
pub struct FusedRouting<B: Backend> {
    /// Selected experts `[m, k]`, best first (ties: lower index).
    pub indices: Tensor<B, 2, Int>,
    /// The QB histogram counts `[n, bins]`, when requested.
    pub counts: Option<Tensor<B, 2, Int>>,
}

/// Top-k selection, and optionally the QB histogram (design §3), by one fused kernel on the CubeCL
/// backends, without a read: the results stay on the device. `None` elsewhere (or with the
/// kernels switched off), where the caller runs the host path ([`select_top_k`],
/// `QuantileBalancer::observe`).
///
/// `scores: [m, n]` unbiased f32 scores, `bias: [n]`; `valid: [m]` (`false`: padding, not counted
/// in the histogram; still selected). The selection equals [`select_top_k`] without grouping and
/// the counts equal the host balancer's on the same input, exactly. Returns `None` as well for
/// grouped top-k options (the host handles those) and, with [`eager_checks`](crate::sync::eager_checks)
/// on, for NaN scores (so the host path reports them with the token and expert); without them
/// NaN scores propagate to the routing weights, the output and the loss.
pub fn route_top_k_fused<B: Backend>(
    scores: &Tensor<B, 2>,
    bias: &[f32],
    opts: TopKOptions,
    valid: Option<&TokenMask<B>>,
    histogram: Option<crate::nn::balance::HistogramSpec>,
) -> Option<FusedRouting<B>> {
    use crate::ops::backend::{self, FusedOp, KernelPath};
    let [m, n] = scores.dims();
    let grouped = opts.n_group > 1 && opts.topk_group < opts.n_group;
    let usable = !grouped
        && opts.validate(n).is_ok()
        && bias.len() == n
        && bias.iter().all(|b| b.is_finite())
        && valid.is_none_or(|v| v.len() == m)
        && m > 0
        && backend::kernels_available::<B>();
    if !usable {
        backend::record(FusedOp::RouteTopK, KernelPath::Reference);
        return None;
    }
    let has_nan = crate::sync::eager_checks()
        && crate::sync::read(scores.clone().is_nan().any())
            .iter::<bool>()
            .next()
            .unwrap_or(false);
    if has_nan {
        backend::record(FusedOp::RouteTopK, KernelPath::Reference);
        return None;
    }
    let device = scores.device();
    let op = crate::ops::moe::kernels::RouteOp {
        scores: scores.clone(),
        // f32 whatever the backend's default float (SPEC §0: the QB bias is an f32 island).
        bias: Tensor::<B, 1>::from_data(
            TensorData::new(bias.to_vec(), [n]),
            (&device, burn::tensor::DType::F32),
        ),
        valid: valid.map(|v| v.device(&device)),
        k: opts.k,
        histogram,
    };
    let (indices, counts) = backend::on_kernels::<B, _>(op).ok()?;
    backend::record(FusedOp::RouteTopK, KernelPath::Kernel);
    if histogram.is_some() {
        backend::record(FusedOp::QbHistogram, KernelPath::Kernel);
    }
    Some(FusedRouting { indices, counts })
}

impl Selection {
    /// Reads a device selection `[tokens, k]` over `experts` experts back to the host (one read).
    pub fn from_tensor<B: Backend>(indices: &Tensor<B, 2, Int>, experts: usize) -> Self {
        let [tokens, k] = indices.dims();
        Self {
            tokens,
            experts,
            k,
            indices: crate::sync::read(indices.clone())
                .iter::<i64>()
                .map(|i| i as u32)
                .collect(),
        }
    }
}
