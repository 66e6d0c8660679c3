//! Newton–Schulz orthogonalisation (design §8), the core of Muon.

use burn::tensor::{backend::Backend, Tensor};

use crate::ops::optim::scaled_sum;
use crate::ops::precision::{restore, widen};

/// The quintic's coefficients `(a, b, c)` (design §8, Keller Jordan's Muon).
pub const NS_COEFFICIENTS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// The number of iterations Muon runs (design §8).
pub const NS_STEPS: usize = 5;

/// Added to the Frobenius norm before normalising, so a zero matrix stays zero (design §8).
pub const NS_EPSILON: f64 = 1e-7;

/// Approximately orthogonalises `x: [rows, cols]` (replaces its singular values by values near
/// 1, keeping its singular vectors); returns `[rows, cols]`.
///
/// design §8: transpose when `rows > cols`, `X ← X / (‖X‖_F + 1e-7)`, then `steps` times
/// `A = X Xᵀ; X = a·X + (b·A + c·A²)·X` with `(a, b, c) =` [`NS_COEFFICIENTS`], and transpose back.
/// After 5 steps a singular value `σ ≥ 0.005·‖X‖_F` lands in about `[0.68, 1.16]` (the iteration
/// trades exactness for a steep slope at 0); smaller ones are only pushed up.
///
/// Computed in f32 (half-precision inputs are widened and the result cast back; f64 stays f64).
pub fn newton_schulz<B: Backend>(x: Tensor<B, 2>, steps: usize) -> Tensor<B, 2> {
    let [rows, cols] = x.dims();
    newton_schulz_batched(x.reshape([1, rows, cols]), steps).reshape([rows, cols])
}

/// [`newton_schulz`] on each matrix of `x: [batch, rows, cols]` independently (each is
/// normalised by its own Frobenius norm); returns `[batch, rows, cols]`.
pub fn newton_schulz_batched<B: Backend>(x: Tensor<B, 3>, steps: usize) -> Tensor<B, 3> {
    let (x, dtype) = widen(x);
    let [_, rows, cols] = x.dims();
    // X Xᵀ is then the smaller Gram matrix; the result is the same, only cheaper.
    let tall = rows > cols;
    let mut x = if tall { x.swap_dims(1, 2) } else { x };
    let norm = x
        .clone()
        .square()
        .sum_dim(2)
        .sum_dim(1)
        .sqrt()
        .add_scalar(NS_EPSILON);
    x = x.div(norm);
    let (a, b, c) = NS_COEFFICIENTS;
    for _ in 0..steps {
        let gram = x.clone().matmul(x.clone().swap_dims(1, 2));
        // Each `s·P + t·Q` is one fused op on the CubeCL backends (three tensor ops elsewhere).
        let square = gram.clone().matmul(gram.clone());
        let poly = scaled_sum(gram, b, square, c);
        let step = poly.matmul(x.clone());
        x = scaled_sum(x, a, step, 1.0);
    }
    let x = if tall { x.swap_dims(1, 2) } else { x };
    restore(x, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    type B = NdArray<f32>;

    #[test]
    fn zero_stays_zero_and_batch_entries_are_independent() {
        let device = Default::default();
        let zero = newton_schulz(Tensor::<B, 2>::zeros([3, 5], &device), NS_STEPS);
        assert!(zero.into_data().iter::<f32>().all(|v| v == 0.0));

        // Scaling one batch entry must not change the other's result.
        let base: Vec<f32> = (0..30).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
        let mut scaled = base.clone();
        scaled[15..].iter_mut().for_each(|v| *v *= 40.0);
        let run = |v: Vec<f32>| {
            let x = Tensor::<B, 3>::from_data(TensorData::new(v, [2, 3, 5]), &device);
            newton_schulz_batched(x, NS_STEPS)
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>()
        };
        let (a, b) = (run(base), run(scaled));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
