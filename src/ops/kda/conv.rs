//! The causal depthwise short convolution in front of KDA's q, k and v (SPEC §4.2).

use burn::tensor::{backend::Backend, Tensor};

/// Causal depthwise convolution without bias, restarted at every sequence (SPEC §4.2):
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
    let Some(seqs) = seqs else {
        return conv_rows(x, weight, tail);
    };
    let mut ys = Vec::with_capacity(seqs.len());
    let mut tails = Vec::with_capacity(seqs.len());
    for (n, &(start, len)) in seqs.iter().enumerate() {
        let tail_n = tail.clone().map(|tl| tl.narrow(0, n, 1));
        let (y, tl) = conv_rows(x.clone().narrow(1, start, len), weight.clone(), tail_n);
        ys.push(y);
        tails.push(tl);
    }
    (Tensor::cat(ys, 1), Tensor::cat(tails, 0))
}

fn conv_rows<B: Backend>(
    x: Tensor<B, 3>,
    weight: Tensor<B, 2>,
    tail: Option<Tensor<B, 3>>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let [b, t, p] = x.dims();
    let w = weight.dims()[1];
    let history = match tail {
        Some(tl) => tl.swap_dims(1, 2),
        None => Tensor::zeros([b, w - 1, p], (&x.device(), x.dtype())),
    };
    let padded = Tensor::cat(vec![history, x], 1); // [B, W − 1 + T, P]
    let taps = weight.swap_dims(0, 1); // [W, P]
    let y = (0..w)
        .map(|i| {
            let tap = taps.clone().narrow(0, i, 1).reshape([1, 1, p]);
            padded.clone().narrow(1, i, t).mul(tap)
        })
        .reduce(|acc, term| acc.add(term))
        .unwrap_or_else(|| unreachable!("W >= 2 taps"));
    let new_tail = padded.narrow(1, t, w - 1).swap_dims(1, 2);
    (y, new_tail)
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
