//! Newton–Schulz orthogonalisation (design §8), the core of Muon.

use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use crate::ops::backend::host::{
    is_cpu_backend, run_untracked, HostArray, HostData, MIN_PARALLEL_WORK,
};
use crate::ops::backend::matmul::{matmul, matmul_serial, Layout};

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
///
/// On the CPU backends (f32) every matrix runs on the host, its products through the crate's
/// `gemm` kernels, untracked on `Autodiff` (as the optimiser's updates are).
pub fn newton_schulz_batched<B: Backend>(x: Tensor<B, 3>, steps: usize) -> Tensor<B, 3> {
    let (x, dtype) = widen(x);
    let [batch, rows, cols] = x.dims();
    let x = if x.dtype() == DType::F32 && x.shape().num_elements() > 0 && is_cpu_backend::<B>() {
        let dims = [batch, rows, cols];
        match run_untracked::<B, 1, 1>([x.into_primitive().tensor()], |[x]| {
            [host_batched(&x, dims, steps)]
        }) {
            Ok([out]) => {
                return restore(Tensor::from_primitive(TensorPrimitive::Float(out)), dtype)
            }
            Err([x]) => Tensor::from_primitive(TensorPrimitive::Float(x)),
        }
    } else {
        x
    };
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

/// [`newton_schulz_batched`] of the `[batch, rows, cols]` values of `x` on the host: the same
/// iteration, its norm summed in f64 and each product by `gemm`.
fn host_batched(x: &HostArray, [batch, rows, cols]: [usize; 3], steps: usize) -> HostArray {
    use rayon::prelude::*;
    let size = rows * cols;
    // Each matrix as `[m, n]` with `m ≤ n` (transposed when tall), so that `X Xᵀ` is the
    // smaller Gram matrix.
    let tall = rows > cols;
    let (m, n) = if tall { (cols, rows) } else { (rows, cols) };
    let (a, b, c) = NS_COEFFICIENTS;
    let (a, b, c) = (a as f32, b as f32, c as f32);
    let mut out = vec![0.0f32; batch * size];
    // The matrices in parallel when there are several and enough work (the multiply-adds of
    // every step's three products), each product on its thread; otherwise one after the other,
    // each product split over the pool when large.
    let work = batch * steps * (2 * m * m * n + m * m * m);
    let across = batch > 1 && work >= MIN_PARALLEL_WORK;
    let product = if across { matmul_serial } else { matmul };
    let one = |(src, dst): (&[f32], &mut [f32])| {
        let mut x = vec![0.0f32; size];
        if tall {
            for (i, row) in src.chunks_exact(cols).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    x[j * n + i] = v;
                }
            }
        } else {
            x.copy_from_slice(src);
        }
        // Summed in f64: one running f32 sum over a large matrix would drift.
        let norm = (x
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            .sqrt()
            + NS_EPSILON) as f32;
        x.iter_mut().for_each(|v| *v /= norm);
        let (mut gram, mut square, mut step) =
            (vec![0.0; m * m], vec![0.0; m * m], vec![0.0; size]);
        // `dst = lhs · rhs` (or `lhs · rhsᵀ`) for `[rows, inner, cols]`.
        let mul = |dst: &mut [f32], lhs: &[f32], rhs: &[f32], rhs_layout, dims| {
            product(dst, lhs, Layout::Plain, rhs, rhs_layout, dims, false)
        };
        for _ in 0..steps {
            mul(&mut gram, &x, &x, Layout::Transposed, [m, n, m]);
            mul(&mut square, &gram, &gram, Layout::Plain, [m, m, m]);
            for (g, s) in gram.iter_mut().zip(&square) {
                *g = b * *g + c * s;
            }
            mul(&mut step, &gram, &x, Layout::Plain, [m, m, n]);
            for (v, s) in x.iter_mut().zip(&step) {
                *v = a * *v + s;
            }
        }
        if tall {
            for (i, row) in dst.chunks_exact_mut(cols).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = x[j * n + i];
                }
            }
        } else {
            dst.copy_from_slice(&x);
        }
    };
    let pairs = x.data.chunks_exact(size).zip(out.chunks_exact_mut(size));
    if across {
        pairs.collect::<Vec<_>>().into_par_iter().for_each(one);
    } else {
        pairs.for_each(one);
    }
    HostArray {
        data: HostData::Owned(out),
        shape: vec![batch, rows, cols],
    }
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
