//! The causal depthwise short convolution in front of KDA's q, k and v (design §4.2).

use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use super::conv_host::ShortConvHost;
use super::gather_tokens;
use super::kernels::ShortConvOp;
use crate::ops::backend::{self, FusedOp, KernelPath};
use crate::ops::precision::silu;

/// [`causal_conv1d`] followed by SiLU (design §4.2), the form in front of KDA's q, k and v; the
/// new tail only when `want_tail` (a decode cache).
///
/// On the CubeCL backends (see [`backend`]) the convolution with its SiLU is one
/// fused launch (and its backward three more under autodiff); untracked calls (prefill, decode)
/// also update the tail in one launch, tracked ones take the tail from the tensor ops so that its
/// graph reaches `x`. On the CPU backends (f32), a call without a tail in or out (training,
/// prefill without a cache) runs a host kernel forward and backward, and an untracked call with a
/// tail (prefill into a cache, decode) one host pass that also writes the new tail; a tracked
/// call with a tail takes the tensor ops.
pub(crate) fn causal_conv1d_silu<B: Backend>(
    x: Tensor<B, 3>,
    weight: Tensor<B, 2>,
    seqs: Option<&[(usize, usize)]>,
    tail: Option<Tensor<B, 3>>,
    want_tail: bool,
) -> (Tensor<B, 3>, Option<Tensor<B, 3>>) {
    let [b, t, p] = x.dims();
    let on_host = b * t * p > 0
        && backend::host::is_cpu_backend::<B>()
        && [x.dtype(), weight.dtype()] == [DType::F32; 2]
        && tail.as_ref().is_none_or(|tl| tl.dtype() == DType::F32);
    if on_host {
        let op = ShortConvHost {
            segments: std::sync::Arc::new(match seqs {
                None => (0..b).map(|i| (i * t, t)).collect(),
                Some(spans) => spans.to_vec(),
            }),
        };
        let prim = |x: Tensor<B, 3>| x.into_primitive().tensor();
        let wprim = |w: Tensor<B, 2>| w.into_primitive().tensor();
        if tail.is_none() && !want_tail {
            backend::record(FusedOp::ShortConv, KernelPath::Reference);
            return (backend::host::run(&op, [prim(x), wprim(weight)]), None);
        }
        // With a history (prefill into a cache, decode): untracked calls only; a tracked one
        // takes the tensor ops, whose graph reaches `x` through the tail too.
        if !B::ad_enabled(&x.device()) {
            backend::record(FusedOp::ShortConv, KernelPath::Reference);
            let outputs = match tail {
                Some(tl) => backend::host::run_untracked::<B, 3, 2>(
                    [prim(x), wprim(weight), prim(tl)],
                    |[x, w, tl]| op.forward_with_tail(&x, &w, Some(&tl)),
                )
                .ok(),
                None => {
                    backend::host::run_untracked::<B, 2, 2>([prim(x), wprim(weight)], |[x, w]| {
                        op.forward_with_tail(&x, &w, None)
                    })
                    .ok()
                }
            };
            let [y, new_tail] =
                outputs.unwrap_or_else(|| unreachable!("a CPU backend runs host ops untracked"));
            let tensor = |t| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(t));
            return (tensor(y), want_tail.then(|| tensor(new_tail)));
        }
    }
    let (mut x, mut weight, mut tail) = (x, weight, tail);
    if backend::kernel_dtype(x.dtype()) && backend::kernels_available::<B>() {
        let seq_starts = match seqs {
            None => (0..=b).map(|i| i * t).collect(),
            Some(spans) => std::iter::once(0)
                .chain(spans.iter().map(|&(start, len)| start + len))
                .collect(),
        };
        let (x_kept, tail_kept, weight_width) = (x.clone(), tail.clone(), weight.dims()[1]);
        let op = ShortConvOp {
            x: x.reshape([b * t, p]),
            weight,
            tail,
            seq_starts,
        };
        match backend::on_kernels::<B, _>(op) {
            Ok((y, Some(new_tail))) => {
                backend::record(FusedOp::ShortConv, KernelPath::Kernel);
                return (y.reshape([b, t, p]), want_tail.then_some(new_tail));
            }
            Ok((y, None)) => {
                // Tracked: the tail comes from the tensor ops, so that its graph reaches x (and
                // only when asked for: training without a cache needs none).
                backend::record(FusedOp::ShortConv, KernelPath::Kernel);
                let new_tail = want_tail.then(|| pad(x_kept, weight_width, seqs, tail_kept).tail);
                return (y.reshape([b, t, p]), new_tail);
            }
            Err(op) => {
                x = op.x.reshape([b, t, p]);
                weight = op.weight;
                tail = op.tail;
            }
        }
    }
    backend::record(FusedOp::ShortConv, KernelPath::Reference);
    let (y, new_tail) = causal_conv1d(x, weight, seqs, tail);
    (silu(y), want_tail.then_some(new_tail))
}

/// Causal depthwise convolution without bias, restarted at every sequence (design §4.2):
///
/// ```text
/// y[t, c] = Σ_{i=0}^{W−1} w[c, i] · x[t − W + 1 + i, c]
/// ```
///
/// (tap `W − 1` multiplies the current token; inputs before a sequence start come from `tail`,
/// or are 0). `x: [B, T, P]`, `weight: [P, W]` (`W ≥ 2`), `seqs`: packed `(start, len)` spans
/// along T with `B = 1`, or `None` for `B` rows of length `T`; `tail: [N, P, W − 1]`, the last
/// `W − 1` raw inputs of each sequence before this call.
///
/// Returns `y: [B, T, P]` and the new tail `[N, P, W − 1]`. The caller validates the shapes.
pub(crate) fn causal_conv1d<B: Backend>(
    x: Tensor<B, 3>,
    weight: Tensor<B, 2>,
    seqs: Option<&[(usize, usize)]>,
    tail: Option<Tensor<B, 3>>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let w = weight.dims()[1];
    let padded = pad(x, w, seqs, tail);
    let y = slide(padded.rows, weight);
    let y = match &padded.outputs {
        None => y,
        Some(outputs) => gather_tokens(y, outputs),
    };
    (y, padded.tail)
}

/// Every sequence's `W − 1` history rows (its tail, or zeros) in front of its tokens.
struct Padded<B: Backend> {
    /// `[B, T + W − 1, P]` unpacked; `[1, T + N·(W − 1), P]` packed.
    rows: Tensor<B, 3>,
    /// Packed: the output row of every token among the windows of `rows`.
    outputs: Option<Vec<Option<usize>>>,
    /// The new tail `[N, P, W − 1]`: the last `W − 1` rows of each padded sequence.
    tail: Tensor<B, 3>,
}

fn pad<B: Backend>(
    x: Tensor<B, 3>,
    w: usize,
    seqs: Option<&[(usize, usize)]>,
    tail: Option<Tensor<B, 3>>,
) -> Padded<B> {
    let [b, t, p] = x.dims();
    let Some(seqs) = seqs else {
        let history = match tail {
            Some(tl) => tl.swap_dims(1, 2),
            None => Tensor::zeros([b, w - 1, p], (&x.device(), x.dtype())),
        };
        let rows = Tensor::cat(vec![history, x], 1);
        let tail = rows.clone().narrow(1, t, w - 1).swap_dims(1, 2);
        return Padded {
            rows,
            outputs: None,
            tail,
        };
    };
    // Packed: all sequences with one gather, so that no window reaches into the previous one.
    let n = seqs.len();
    let history = match tail {
        Some(tl) => tl.swap_dims(1, 2).reshape([1, n * (w - 1), p]),
        None => Tensor::zeros([1, n * (w - 1), p], (&x.device(), x.dtype())),
    };
    let source = Tensor::cat(vec![x, history], 1);
    let mut slots = Vec::with_capacity(t + n * (w - 1));
    let mut outputs = Vec::with_capacity(t);
    let mut tails = Vec::with_capacity(n * (w - 1));
    for (i, &(start, len)) in seqs.iter().enumerate() {
        let offset = slots.len();
        slots.extend((0..w - 1).map(|r| Some(t + i * (w - 1) + r)));
        slots.extend((start..start + len).map(Some));
        // The window ending at padded row `offset + W − 1 + j` is output row `offset + j`.
        outputs.extend((offset..offset + len).map(Some));
        tails.extend((offset + len..offset + len + w - 1).map(Some));
    }
    let rows = gather_tokens(source, &slots);
    let tail = gather_tokens(rows.clone(), &tails)
        .reshape([n, w - 1, p])
        .swap_dims(1, 2);
    Padded {
        rows,
        outputs: Some(outputs),
        tail,
    }
}

/// The valid windows of a depthwise convolution: `[B, L, P]` with taps `[P, W]` →
/// `[B, L − W + 1, P]`, row `r` covering input rows `r … r + W − 1`.
fn slide<B: Backend>(padded: Tensor<B, 3>, weight: Tensor<B, 2>) -> Tensor<B, 3> {
    let [_, l, p] = padded.dims();
    let w = weight.dims()[1];
    let taps = weight.swap_dims(0, 1); // [W, P]
    (0..w)
        .map(|i| {
            let tap = taps.clone().narrow(0, i, 1).reshape([1, 1, p]);
            padded.clone().narrow(1, i, l - w + 1).mul(tap)
        })
        .reduce(|acc, term| acc.add(term))
        .unwrap_or_else(|| unreachable!("W >= 2 taps"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    type B = NdArray<f32>;

    /// One channel, taps [1, 10, 100, 1000]: tap W−1 (1000) multiplies the current token, and the
    /// packed second sequence does not see the first.
    #[test]
    fn taps_are_causal_and_restart_per_sequence() {
        let device = Default::default();
        let x = Tensor::<B, 3>::from_floats([[[1.0], [2.0], [3.0], [4.0], [5.0]]], &device);
        let w = Tensor::<B, 2>::from_floats([[1.0, 10.0, 100.0, 1000.0]], &device);
        let (y, tail) = causal_conv1d(x.clone(), w.clone(), None, None);
        y.into_data().assert_eq(
            &TensorData::from([[[1000.0f32], [2100.0], [3210.0], [4321.0], [5432.0]]]),
            false,
        );
        tail.into_data()
            .assert_eq(&TensorData::from([[[3.0f32, 4.0, 5.0]]]), false);
        let (y, tail) = causal_conv1d(x, w, Some(&[(0, 2), (2, 3)]), None);
        y.into_data().assert_eq(
            &TensorData::from([[[1000.0f32], [2100.0], [3000.0], [4300.0], [5430.0]]]),
            false,
        );
        tail.into_data().assert_eq(
            &TensorData::from([[[0.0f32, 1.0, 2.0]], [[3.0, 4.0, 5.0]]]),
            false,
        );
    }
}
