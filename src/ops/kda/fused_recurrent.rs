//! The decode path: the KDA recurrence as batched matrix products, all packed sequences at once.

use burn::tensor::{backend::Backend, Tensor};

use super::kernels::KdaForm;
use super::{gather_tokens, host_forward, kernel_forward, prepare, unbind, KdaOptions, Prepared};
use crate::error::Result;
use crate::ops::backend::{self, FusedOp, KernelPath};
use crate::ops::precision::restore;

/// KDA by its recurrence (design §4.1), for short inputs (decode, speculative verification):
///
/// ```text
/// S'  = Diag(exp(g_t)) · S_{t−1};   S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ;   o_t = S_tᵀ (scale · q_t)
/// ```
///
/// Same inputs and outputs as [`naive_recurrent_kda`](super::naive_recurrent_kda). Unlike the
/// naive op it runs all packed sequences side by side: `cu_seqlens` inputs are padded into a
/// `[N, max T_n]` batch with steps that leave the state unchanged (`g = 0`, `k = 0`, `β = 0`), so
/// a decode step of N sequences is one batched update. Cost grows linearly in `T` with one small
/// kernel sequence per token; use [`chunk_kda`](super::chunk_kda) for long inputs.
///
/// On the CubeCL backends (see [`backend`]) inference calls run one kernel that
/// keeps the f32 state on chip for all steps; inputs tracked by autodiff take the tensor ops.
///
/// # Panics
/// On invalid input; see [`try_fused_recurrent_kda`].
pub fn fused_recurrent_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    try_fused_recurrent_kda(q, k, v, g, beta, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// [`fused_recurrent_kda`], reporting bad input as an error (the checks of
/// [`try_naive_recurrent_kda`](super::try_naive_recurrent_kda)).
pub fn try_fused_recurrent_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    fused_recurrent_kda_inner(q, k, v, g, beta, opts, true)
}

/// [`try_fused_recurrent_kda`] with the host read-back of the gate check optional.
pub(crate) fn fused_recurrent_kda_inner<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
    check_gates: bool,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    let opts = match host_forward(&q, &k, &v, &g, &beta, opts, check_gates)? {
        Ok(out) => {
            backend::record(FusedOp::KdaRecurrent, KernelPath::Reference);
            return Ok(out);
        }
        Err(opts) => opts,
    };
    let p = prepare(q, k, v, g, beta, opts, check_gates)?;
    Ok(match kernel_forward(p, KdaForm::Recurrent) {
        Ok(out) => {
            backend::record(FusedOp::KdaRecurrent, KernelPath::Kernel);
            out
        }
        Err(p) => {
            backend::record(FusedOp::KdaRecurrent, KernelPath::Reference);
            run(p)
        }
    })
}

fn run<B: Backend>(p: Prepared<B>) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
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
    let beta = crate::ops::layout::unsqueeze_dim::<B, 3, 4>(beta, 3);
    let (q, k, v, g, beta) = match &seqs {
        None => (q, k, v, g, beta),
        Some(seqs) => (
            pad_to_batch(q, seqs),
            pad_to_batch(k, seqs),
            pad_to_batch(v, seqs),
            pad_to_batch(g, seqs),
            pad_to_batch(beta, seqs),
        ),
    };
    let [b, t, h, kd] = q.dims();
    let vd = dims.v;
    let z = b * h;
    // [B, T, H, X] → [B·H, T, X]: one independent recurrence per row.
    let rows = |x: Tensor<B, 4>| {
        let x_dim = x.dims()[3];
        x.swap_dims(1, 2).reshape([z, t, x_dim])
    };
    let decay = rows(g).exp();
    let q = rows(q);
    let k = rows(k);
    let v = rows(v);
    let kb = k.clone().mul(rows(beta));
    let mut s = match h0 {
        Some(s) => s.reshape([z, kd, vd]),
        None => Tensor::zeros([z, kd, vd], (&q.device(), q.dtype())),
    };
    let steps = unbind(q, 1)
        .into_iter()
        .zip(unbind(k, 1))
        .zip(unbind(kb, 1))
        .zip(unbind(v, 1))
        .zip(unbind(decay, 1));
    let mut outs = Vec::with_capacity(t);
    for ((((qt, kt), kbt), vt), dt) in steps {
        // qt, kt, kbt, dt: [Z, 1, K]; vt: [Z, 1, V].
        s = s.mul(dt.swap_dims(1, 2));
        let predicted = kt.matmul(s.clone());
        s = s.add(kbt.swap_dims(1, 2).matmul(vt.sub(predicted)));
        outs.push(qt.matmul(s.clone()));
    }
    let o = Tensor::cat(outs, 1).reshape([b, h, t, vd]).swap_dims(1, 2);
    let o = match &seqs {
        None => o,
        Some(seqs) => unpad_from_batch(o, seqs),
    };
    let state = output_final_state.then(|| s.reshape([b, h, kd, vd]));
    (restore(o, out_dtype), state)
}

/// `[1, ΣT_n, H, X]` packed → `[N, max T_n, H, X]`, each sequence zero-padded at its end.
fn pad_to_batch<B: Backend>(x: Tensor<B, 4>, seqs: &[(usize, usize)]) -> Tensor<B, 4> {
    let [_, _, h, d] = x.dims();
    let longest = seqs.iter().map(|s| s.1).max().unwrap_or(0);
    let slots: Vec<Option<usize>> = seqs
        .iter()
        .flat_map(|&(start, len)| (0..longest).map(move |i| (i < len).then_some(start + i)))
        .collect();
    gather_tokens(x, &slots).reshape([seqs.len(), longest, h, d])
}

/// The inverse of [`pad_to_batch`]: `[N, max T_n, H, X]` → `[1, ΣT_n, H, X]`.
fn unpad_from_batch<B: Backend>(x: Tensor<B, 4>, seqs: &[(usize, usize)]) -> Tensor<B, 4> {
    let [n, longest, h, d] = x.dims();
    let slots: Vec<Option<usize>> = seqs
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, len))| (0..len).map(move |t| Some(i * longest + t)))
        .collect();
    gather_tokens(x.reshape([1, n * longest, h, d]), &slots)
}
