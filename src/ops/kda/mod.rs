//! Kimi Delta Attention (KDA) ops, design §4, in the layout of the reference Python library:
//! `q, k: [B, T, H, K]`, `v: [B, T, H, V]`, `g: [B, T, H, K]` (log decay, ≤ 0), `beta: [B, T, H]`,
//! states `[N, H, K, V]`.
//!
//! Three implementations of the same map, compared against each other by the tests:
//!
//! - [`naive_recurrent_kda`]: the token-by-token recurrence of design §4.1, the ground truth;
//! - [`chunk_kda`]: the chunked form of design §4.3 for training and prefill;
//! - [`fused_recurrent_kda`]: the recurrence batched over packed sequences, for decode.
//!
//! Every op computes in f32 (f64 when the inputs are f64) whatever the input dtype, returns the
//! output in the dtype of `q` and the final state in f32 (f64). Each fixed-signature op has a
//! `try_` twin that reports bad input as an [`Error`].
//!
//! The gate helpers [`kda_gate`] and [`rms_norm_gated`] are the other two pieces of the layer's
//! arithmetic (design §4.2).

#[cfg(feature = "autodiff")]
mod autodiff;
mod chunk;
pub(crate) mod conv;
mod conv_host;
mod cpu;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod cube_chunk;
mod fused_recurrent;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod gate;
mod gate_host;
mod intra;
pub(crate) mod kernels;
mod naive;

pub use chunk::{chunk_kda, try_chunk_kda};
pub use fused_recurrent::{fused_recurrent_kda, try_fused_recurrent_kda};
pub use gate::{kda_gate, rms_norm_gated, try_kda_gate, try_rms_norm_gated};
pub use naive::{naive_recurrent_kda, try_naive_recurrent_kda};

pub(crate) use chunk::chunk_kda_inner;
pub(crate) use fused_recurrent::fused_recurrent_kda_inner;
pub(crate) use kernels::tracked_on_kernels;
pub use kernels::{KdaChunkGrads, KdaChunkSaved, KdaChunkWithin, KdaKernelInput, KdaKernels};

use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData, TensorPrimitive};

use crate::error::{Error, Result};
use crate::ops::backend;
use crate::ops::precision::{restore, widen};
use kernels::{KdaForm, KdaForwardOp};

/// The largest key head dim the ops accept (the reference kernels' limit).
pub const MAX_HEAD_DIM: usize = 256;

/// The chunk sizes [`chunk_kda`] accepts.
pub const CHUNK_SIZES: [usize; 3] = [16, 32, 64];

/// Options shared by the three KDA ops.
///
/// `Default` gives `scale = K^−1/2`, no initial state, no final state, no packing, chunk 64 and no
/// L2 norm inside the op.
#[derive(Debug, Clone)]
pub struct KdaOptions<B: Backend> {
    /// Multiplies `q`; `None`: `K^−1/2`.
    pub scale: Option<f64>,
    /// `S_0`, `[N, H, K, V]` (`N = B`, or the number of packed sequences); `None`: zeros.
    /// Computed with in f32 (f64) whatever its dtype.
    pub initial_state: Option<Tensor<B, 4>>,
    /// Return `S_T` (`[N, H, K, V]`, f32).
    pub output_final_state: bool,
    /// Packed variable-length sequences, FlashAttention style: `[0, T_1, T_1 + T_2, …, T]`.
    /// Needs `B = 1`; the recurrence restarts at every boundary and states are per sequence.
    pub cu_seqlens: Option<Vec<usize>>,
    /// Chunk length of [`chunk_kda`]: 16, 32 or 64 (ignored by the recurrent ops).
    pub chunk_size: usize,
    /// L2-normalise `q` and `k` over the head dim inside the op: `x / sqrt(Σx² + 1e-6)`.
    pub use_qk_l2norm: bool,
}

impl<B: Backend> Default for KdaOptions<B> {
    fn default() -> Self {
        Self {
            scale: None,
            initial_state: None,
            output_final_state: false,
            cu_seqlens: None,
            chunk_size: 64,
            use_qk_l2norm: false,
        }
    }
}

impl<B: Backend> KdaOptions<B> {
    /// Sets the scale applied to `q`.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets the initial state `[N, H, K, V]`.
    pub fn with_initial_state(mut self, state: Tensor<B, 4>) -> Self {
        self.initial_state = Some(state);
        self
    }

    /// Asks for the final state.
    pub fn with_final_state(mut self, output: bool) -> Self {
        self.output_final_state = output;
        self
    }

    /// Packs variable-length sequences (`[N + 1]` offsets into T).
    pub fn with_cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Self {
        self.cu_seqlens = Some(cu_seqlens);
        self
    }

    /// Sets the chunk length of [`chunk_kda`].
    pub fn with_chunk_size(mut self, chunk_size: usize) -> Self {
        self.chunk_size = chunk_size;
        self
    }

    /// L2-normalises `q` and `k` inside the op.
    pub fn with_qk_l2norm(mut self, on: bool) -> Self {
        self.use_qk_l2norm = on;
        self
    }
}

/// The sizes of one call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub k: usize,
    pub v: usize,
}

/// Validated inputs in the working precision, with `q` scaled (and normalised when asked).
pub(crate) struct Prepared<B: Backend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub g: Tensor<B, 4>,
    pub beta: Tensor<B, 3>,
    pub h0: Option<Tensor<B, 4>>,
    /// `(start, len)` of each packed sequence; `None`: `B` independent rows of length `T`.
    pub seqs: Option<Vec<(usize, usize)>>,
    pub dims: Dims,
    /// The dtype the output is returned in (that of `q`).
    pub out_dtype: DType,
    pub output_final_state: bool,
}

/// Checks `cu_seqlens` against a packed input of batch `b` and length `t`; returns `(start, len)`
/// per sequence.
pub(crate) fn check_cu_seqlens(cu: &[usize], b: usize, t: usize) -> Result<Vec<(usize, usize)>> {
    if b != 1 {
        return Err(Error::argument(
            "cu_seqlens",
            format!("packed sequences need batch size 1, got B = {b}"),
        ));
    }
    if cu.len() < 2 {
        return Err(Error::argument(
            "cu_seqlens",
            format!("needs at least two offsets [0, …, T], got {cu:?}"),
        ));
    }
    if cu[0] != 0 {
        return Err(Error::argument(
            "cu_seqlens",
            format!("must start at 0, got {cu:?}"),
        ));
    }
    if let Some(w) = cu.windows(2).find(|w| w[1] <= w[0]) {
        return Err(Error::argument(
            "cu_seqlens",
            format!(
                "must be strictly increasing, got {} then {} in {cu:?}",
                w[0], w[1]
            ),
        ));
    }
    let last = cu[cu.len() - 1];
    if last != t {
        return Err(Error::argument(
            "cu_seqlens",
            format!("must end at T = {t}, got {last}"),
        ));
    }
    Ok(cu.windows(2).map(|w| (w[0], w[1] - w[0])).collect())
}

/// `x / sqrt(Σ x² + 1e-6)` over the last dim (the L2 norm of design §4.2).
pub(crate) fn l2_norm<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let inv = x
        .clone()
        .square()
        .sum_dim(D - 1)
        .add_scalar(1e-6)
        .sqrt()
        .recip();
    x.mul(inv)
}

/// Checks the inputs of a KDA op: shapes, `K ≤ 256`, `scale`, `cu_seqlens`, the initial state
/// and (with `check_gates`, a host read-back of the largest gate: a device sync) gates `≤ 0`.
/// Returns the packed sequences as `(start, len)`.
///
/// The layer, whose gates are ≤ 0 by construction, skips the gate check.
fn validate<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    g: &Tensor<B, 4>,
    beta: &Tensor<B, 3>,
    opts: &KdaOptions<B>,
    check_gates: bool,
) -> Result<Option<Vec<(usize, usize)>>> {
    let [b, t, h, kd] = q.dims();
    let vd = v.dims()[3];
    let qk = format!("[B, T, H, K] = {:?}", q.dims());
    if k.dims() != q.dims() {
        return Err(Error::shape("k", qk, k.dims()));
    }
    if g.dims() != q.dims() {
        return Err(Error::shape("g", qk, g.dims()));
    }
    if v.dims()[..3] != q.dims()[..3] {
        return Err(Error::shape(
            "v",
            format!("[B, T, H, V] = [{b}, {t}, {h}, V]"),
            v.dims(),
        ));
    }
    if beta.dims() != [b, t, h] {
        return Err(Error::shape(
            "beta",
            format!("[B, T, H] = [{b}, {t}, {h}]"),
            beta.dims(),
        ));
    }
    if b == 0 || t == 0 || h == 0 || kd == 0 || vd == 0 {
        return Err(Error::shape(
            "q, v",
            "non-empty [B, T, H, K] and [B, T, H, V]",
            (q.dims(), v.dims()),
        ));
    }
    if kd > MAX_HEAD_DIM {
        return Err(Error::argument(
            "K",
            format!("the key head dim must be at most {MAX_HEAD_DIM}, got {kd}"),
        ));
    }
    if let Some(s) = opts.scale {
        if !s.is_finite() {
            return Err(Error::argument("scale", format!("must be finite, got {s}")));
        }
    }
    let seqs = match &opts.cu_seqlens {
        Some(cu) => Some(check_cu_seqlens(cu, b, t)?),
        None => None,
    };
    let n = seqs.as_ref().map_or(b, Vec::len);
    if let Some(s0) = &opts.initial_state {
        if s0.dims() != [n, h, kd, vd] {
            return Err(Error::shape(
                "initial_state",
                format!("[N, H, K, V] = [{n}, {h}, {kd}, {vd}]"),
                s0.dims(),
            ));
        }
    }
    if check_gates {
        let gmax: f64 = match crate::ops::backend::host::max(g) {
            Some(m) => m.into(),
            None => crate::sync::read_scalar(g.clone().max()),
        };
        if gmax.is_nan() {
            return Err(Error::NonFinite {
                what: "g".into(),
                detail: "the gates contain NaN".into(),
            });
        }
        if gmax > 0.0 {
            return Err(Error::argument(
                "g",
                format!("gates are log decays and must be <= 0, got a maximum of {gmax}"),
            ));
        }
    }

    Ok(seqs)
}

/// Validates the inputs of a KDA op ([`validate`]) and brings them to the working precision.
pub(crate) fn prepare<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
    check_gates: bool,
) -> Result<Prepared<B>> {
    let seqs = validate(&q, &k, &v, &g, &beta, &opts, check_gates)?;
    let [b, t, h, kd] = q.dims();
    let dims = Dims {
        b,
        t,
        h,
        k: kd,
        v: v.dims()[3],
    };
    let (q, out_dtype) = widen(q);
    let (k, _) = widen(k);
    let (v, _) = widen(v);
    let (g, _) = widen(g);
    let (beta, _) = widen(beta);
    let h0 = opts.initial_state.map(|s| widen(s).0);
    let (q, k) = if opts.use_qk_l2norm {
        (l2_norm(q), l2_norm(k))
    } else {
        (q, k)
    };
    let scale = opts.scale.unwrap_or(1.0 / (kd as f64).sqrt());
    Ok(Prepared {
        q: q.mul_scalar(scale),
        k,
        v,
        g,
        beta,
        h0,
        seqs,
        dims,
        out_dtype,
        output_final_state: opts.output_final_state,
    })
}

/// A KDA op's output `o` and, when asked for, the final state.
pub(crate) type KdaOutput<B> = (Tensor<B, 4>, Option<Tensor<B, 4>>);

/// The CPU host kernel as the whole op: on a CPU backend, with f32 inputs (and initial state),
/// [`chunk_kda`] and [`fused_recurrent_kda`] are one host recurrence ([`cpu_kda`]) after the op's
/// input checks. `Ok(Err(opts))`: the op goes on with its other paths. The options are taken by
/// value so that an initial state the caller hands over (a decode loop's) is updated in place.
pub(crate) fn host_forward<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    g: &Tensor<B, 4>,
    beta: &Tensor<B, 3>,
    opts: KdaOptions<B>,
    check_gates: bool,
) -> Result<std::result::Result<KdaOutput<B>, KdaOptions<B>>> {
    if !host_kernel_applies(q, k, v, g, beta, &opts) {
        return Ok(Err(opts));
    }
    let seqs = validate(q, k, v, g, beta, &opts, check_gates)?;
    Ok(Ok(cpu_kda(q, k, v, g, beta, opts, seqs)))
}

/// Whether [`cpu_kda`] runs these inputs: a CPU backend and f32 everywhere.
pub(crate) fn host_kernel_applies<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    g: &Tensor<B, 4>,
    beta: &Tensor<B, 3>,
    opts: &KdaOptions<B>,
) -> bool {
    let dtypes = [q.dtype(), k.dtype(), v.dtype(), g.dtype(), beta.dtype()];
    let f32s = dtypes.iter().all(|d| *d == DType::F32)
        && opts
            .initial_state
            .as_ref()
            .is_none_or(|s| s.dtype() == DType::F32);
    f32s && crate::ops::backend::host::is_cpu_backend::<B>()
}

/// The KDA of the layer: the recurrent form for sequences of at most `recurrent_max` tokens unless
/// an input is tracked on a kernel backend (only the chunked kernels have a fused backward), the
/// chunked form otherwise; each picks its own fastest path. The gates are not read back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
    longest: usize,
    recurrent_max: usize,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    let short = longest <= recurrent_max
        && !tracked_on_kernels(&[q.clone(), k.clone(), v.clone(), g.clone()]);
    if short {
        fused_recurrent_kda_inner(q, k, v, g, beta, opts, false)
    } else {
        chunk_kda_inner(q, k, v, g, beta, opts, false)
    }
}

/// KDA on the CPU kernel ([`cpu`]); the caller checks that the backend has one and every input
/// is f32 ([`host_kernel_applies`]). Returns `o` and, with `opts.output_final_state`, the final
/// state.
///
/// `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]`; `q` is L2-normalised (with
/// `opts.use_qk_l2norm`) and scaled (by `opts.scale`, `K^−1/2` when `None`) inside, like
/// [`prepare`] does; `seqs`: packed `(start, len)` spans along T with `B = 1`. The caller
/// validates the shapes (`opts.cu_seqlens` is not read: `seqs` is its checked form). An initial
/// state that nothing else holds becomes the final state, updated in place, on a plain backend.
pub(crate) fn cpu_kda<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    g: &Tensor<B, 4>,
    beta: &Tensor<B, 3>,
    opts: KdaOptions<B>,
    seqs: Option<Vec<(usize, usize)>>,
) -> KdaOutput<B> {
    let [b, t, h, kd] = q.dims();
    let vd = v.dims()[3];
    let n = seqs.as_ref().map_or(b, Vec::len);
    let op = cpu::KdaRecurrence {
        scale: opts.scale.unwrap_or(1.0 / (kd as f64).sqrt()) as f32,
        l2norm: opts.use_qk_l2norm,
        seqs,
        initial_state: opts.initial_state.is_some(),
        final_state: opts.output_final_state,
    };
    let prim = |x: Tensor<B, 4>| x.into_primitive().tensor();
    // Without an initial state the op's sixth input is a one-element placeholder.
    let h0 = match opts.initial_state {
        Some(s) => prim(s),
        None => Tensor::<B, 1>::zeros([1], &q.device())
            .into_primitive()
            .tensor(),
    };
    let inputs = [
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        prim(g.clone()),
        beta.clone().into_primitive().tensor(),
        h0,
    ];
    let n_o = b * t * h * vd;
    let state_shape = [n, h, kd, vd];
    if !opts.output_final_state {
        // The op's output is `o` itself, `[B, T, H, V]`.
        return (crate::ops::backend::host::run(&op, inputs), None);
    }
    // Untracked: `o` and the states as two tensors of their own shapes (splitting would copy).
    let inputs = match crate::ops::backend::host::run_parts::<B, _, 6>(&op, inputs) {
        Ok(mut parts) => {
            let s = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(parts.remove(1)));
            let o = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(parts.remove(0)));
            return (o, Some(s));
        }
        Err(inputs) => inputs,
    };
    let out: Tensor<B, 1> = crate::ops::backend::host::run(&op, inputs);
    let o = out.clone().narrow(0, 0, n_o).reshape([b, t, h, vd]);
    let s = out.narrow(0, n_o, n * h * kd * vd).reshape(state_shape);
    (o, Some(s))
}

/// A KDA CubeCL kernel ([`KdaKernels`]) on prepared inputs, when the backend has one (the chunked
/// kernels also under autodiff, with their fused backward; the recurrent kernel only when no input
/// is tracked). Hands the inputs back otherwise, and for f64 inputs (CUDA has f64): the kernels
/// compute in f32, and the op promises f64 arithmetic and an f64 state there.
#[allow(clippy::type_complexity)]
pub(crate) fn kernel_forward<B: Backend>(
    p: Prepared<B>,
    form: KdaForm,
) -> std::result::Result<(Tensor<B, 4>, Option<Tensor<B, 4>>), Prepared<B>> {
    let f32s = [&p.q, &p.k, &p.v, &p.g]
        .iter()
        .all(|t| t.dtype() == DType::F32)
        && p.beta.dtype() == DType::F32
        && p.h0.as_ref().is_none_or(|s| s.dtype() == DType::F32);
    if !f32s || !backend::kernels_available::<B>() {
        return Err(p);
    }
    let seq_starts = sequence_starts(&p);
    let Prepared {
        q,
        k,
        v,
        g,
        beta,
        h0,
        seqs,
        dims,
        out_dtype,
        output_final_state,
    } = p;
    let op = KdaForwardOp {
        q,
        k,
        v,
        g,
        beta,
        h0,
        seq_starts,
        form,
    };
    match backend::on_kernels::<B, _>(op) {
        Ok(Ok((o, s))) => Ok((restore(o, out_dtype), output_final_state.then_some(s))),
        Ok(Err(op)) | Err(op) => Err(Prepared {
            q: op.q,
            k: op.k,
            v: op.v,
            g: op.g,
            beta: op.beta,
            h0: op.h0,
            seqs,
            dims,
            out_dtype,
            output_final_state,
        }),
    }
}

/// Token offsets `[N + 1]` of the sequences along the flattened `B·T` axis.
fn sequence_starts<B: Backend>(p: &Prepared<B>) -> Vec<usize> {
    match &p.seqs {
        Some(seqs) => seqs
            .iter()
            .map(|s| s.0)
            .chain(std::iter::once(p.dims.t))
            .collect(),
        None => (0..=p.dims.b).map(|b| b * p.dims.t).collect(),
    }
}

/// Splits `x` along `dim` into its slices of length one.
///
/// Slicing is done in two levels (groups of about √n, then single slices): the backward pass of a
/// slice writes a zero tensor of its source's size, so direct slicing costs n full-size copies in
/// the backward pass and two levels cost about 2√n.
pub(crate) fn unbind<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Vec<Tensor<B, D>> {
    let n = x.dims()[dim];
    let group = (n as f64).sqrt().ceil().max(1.0) as usize;
    let mut out = Vec::with_capacity(n);
    if n <= 8 {
        out.extend((0..n).map(|i| x.clone().narrow(dim, i, 1)));
        return out;
    }
    for start in (0..n).step_by(group) {
        let len = group.min(n - start);
        let part = x.clone().narrow(dim, start, len);
        out.extend((0..len).map(|i| part.clone().narrow(dim, i, 1)));
    }
    out
}

/// Rearranges tokens along dim 1 with one gather: slot `i` of the result holds token `index[i]` of
/// `x`, or zeros where it is `None`.
///
/// Packing and unpacking variable-length sequences this way costs one `select` (and one
/// `select_assign` in the backward pass) whatever the number of sequences, where a slice per
/// sequence would cost a full-size zero tensor each in the backward pass.
pub(crate) fn gather_tokens<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    index: &[Option<usize>],
) -> Tensor<B, D> {
    let t = x.dims()[1];
    let device = x.device();
    let padded = index.iter().any(Option::is_none);
    let source = if padded {
        let zero = x.clone().narrow(1, 0, 1).zeros_like();
        Tensor::cat(vec![x, zero], 1)
    } else {
        x
    };
    let idx: Vec<i64> = index.iter().map(|i| i.unwrap_or(t) as i64).collect();
    let len = idx.len();
    source.select(
        1,
        Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [len]), &device),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_checks_report_the_values() {
        assert_eq!(
            check_cu_seqlens(&[0, 3, 7], 1, 7).unwrap(),
            vec![(0, 3), (3, 4)]
        );
        let msg = check_cu_seqlens(&[1, 7], 1, 7).unwrap_err().to_string();
        assert!(
            msg.contains("start at 0") && msg.contains("[1, 7]"),
            "{msg}"
        );
        let msg = check_cu_seqlens(&[0, 4, 4, 7], 1, 7)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("4 then 4"), "{msg}");
        let msg = check_cu_seqlens(&[0, 4, 6], 1, 7).unwrap_err().to_string();
        assert!(msg.contains("T = 7") && msg.contains("got 6"), "{msg}");
        let msg = check_cu_seqlens(&[0, 7], 2, 7).unwrap_err().to_string();
        assert!(msg.contains("B = 2"), "{msg}");
    }
}
