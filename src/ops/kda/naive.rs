//! The token-by-token KDA recurrence (design §4.1): the ground truth the other ops are tested against.

use burn::tensor::{backend::Backend, Tensor};

use super::{prepare, unbind, KdaOptions, Prepared};
use crate::error::Result;
use crate::ops::layout;
use crate::ops::precision::restore;

/// KDA by its definition, one token at a time (design §4.1), per sequence and head:
///
/// ```text
/// S'  = Diag(exp(g_t)) · S_{t−1}
/// S_t = S' + β_t · k_t · (v_t − S'ᵀ k_t)ᵀ
/// o_t = S_tᵀ (scale · q_t)
/// ```
///
/// `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]` → `o: [B, T, H, V]` (dtype of
/// `q`) and, when asked, `S_T: [N, H, K, V]` in f32 (f64 for f64 inputs).
///
/// Written with elementwise products and sums only, so that it shares no code path with
/// [`chunk_kda`](super::chunk_kda) or [`fused_recurrent_kda`](super::fused_recurrent_kda).
///
/// # Panics
/// On invalid input; see [`try_naive_recurrent_kda`] for the checks.
pub fn naive_recurrent_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    try_naive_recurrent_kda(q, k, v, g, beta, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// [`naive_recurrent_kda`], reporting bad input as an error: mismatched shapes, `K > 256`, gates
/// above zero, a malformed `cu_seqlens` (not starting at 0, not increasing, not ending at `T`, or
/// with `B ≠ 1`) and an initial state that is not `[N, H, K, V]`.
pub fn try_naive_recurrent_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    let p = prepare(q, k, v, g, beta, opts, true)?;
    Ok(run(p))
}

fn run<B: Backend>(p: Prepared<B>) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    let Some(seqs) = p.seqs.clone() else {
        let (o, s) = recurrence(p.q, p.k, p.v, p.g, p.beta, p.h0);
        return (restore(o, p.out_dtype), p.output_final_state.then_some(s));
    };
    let mut outs = Vec::with_capacity(seqs.len());
    let mut finals = Vec::with_capacity(seqs.len());
    for (n, &(start, len)) in seqs.iter().enumerate() {
        let (o, s) = recurrence(
            p.q.clone().narrow(1, start, len),
            p.k.clone().narrow(1, start, len),
            p.v.clone().narrow(1, start, len),
            p.g.clone().narrow(1, start, len),
            p.beta.clone().narrow(1, start, len),
            p.h0.clone().map(|s| s.narrow(0, n, 1)),
        );
        outs.push(o);
        finals.push(s);
    }
    let o = restore(Tensor::cat(outs, 1), p.out_dtype);
    (o, p.output_final_state.then(|| Tensor::cat(finals, 0)))
}

/// The recurrence over `[B, T, …]` rows with state `[B, H, K, V]`; `q` is already scaled.
fn recurrence<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Option<Tensor<B, 4>>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, _, h, kd] = q.dims();
    let vd = v.dims()[3];
    let mut s = h0.unwrap_or_else(|| Tensor::zeros([b, h, kd, vd], (&q.device(), q.dtype())));
    let steps = unbind(q, 1)
        .into_iter()
        .zip(unbind(k, 1))
        .zip(unbind(v, 1))
        .zip(unbind(g, 1))
        .zip(unbind(beta, 1));
    let mut outs = Vec::new();
    for ((((qt, kt), vt), gt), bt) in steps {
        // [B, 1, H, X] → [B, H, X, 1] (a column over the key dim) or [B, H, 1, X] (a row).
        let col = |x: Tensor<B, 4>| x.swap_dims(1, 2).swap_dims(2, 3);
        let (qt, kt, gt) = (col(qt), col(kt), col(gt));
        let vt = vt.swap_dims(1, 2);
        // Not `unsqueeze_dim`: see `ops::layout` (wrong strides on CubeCL backends).
        let bt = layout::unsqueeze_dim::<B, 3, 4>(bt.swap_dims(1, 2), 3);
        s = s.mul(gt.exp());
        let predicted = s.clone().mul(kt.clone()).sum_dim(2);
        let delta = vt.sub(predicted).mul(bt);
        s = s.add(kt.mul(delta));
        outs.push(s.clone().mul(qt).sum_dim(2));
    }
    // Each output is [B, H, 1, V]; stack along T.
    let o = Tensor::cat(outs, 2).swap_dims(1, 2);
    (o, s)
}
