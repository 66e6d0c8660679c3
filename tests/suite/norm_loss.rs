//! RMSNorm and the masked cross-entropy: the formulas and their gradients on every backend, and
//! the fused kernels (CubeCL backends) against the tensor-op reference of the same op.

use crate::common::*;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use kimi_burn::data::IGNORE_INDEX;
use kimi_burn::ops::loss::masked_cross_entropy;
use kimi_burn::ops::norm::rms_norm;
use rand::Rng;

/// Host f64 RMSNorm of `x: [rows, d]` rows with the gain `w`.
fn rms_norm64(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let d = w.len();
    x.chunks(d)
        .flat_map(|row| {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| v * r * g)
        })
        .collect()
}

/// Host f64 masked cross-entropy: the mean over scored rows of `lse − z_target`.
fn cross_entropy64(logits: &[f64], targets: &[i64], vocab: usize) -> f64 {
    let (mut sum, mut count) = (0.0, 0);
    for (row, &y) in logits.chunks(vocab).zip(targets) {
        if y == IGNORE_INDEX {
            continue;
        }
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let lse = max + row.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        sum += lse - row[y as usize];
        count += 1;
    }
    sum / count.max(1) as f64
}

/// Targets for `rows` rows of `vocab` classes, about 30% ignored.
fn targets(rng: &mut rand::rngs::StdRng, rows: usize, vocab: usize) -> Vec<i64> {
    (0..rows)
        .map(|_| {
            if rng.random_bool(0.3) {
                IGNORE_INDEX
            } else {
                rng.random_range(0..vocab as i64)
            }
        })
        .collect()
}

fn int_tensor<B: Backend>(
    values: &[i64],
    shape: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    Tensor::<B, 1, Int>::from_ints(values, device).reshape(shape)
}

/// The RMSNorm output against the f64 formula and its gradients against f64 finite differences of
/// that formula, on a random weighting of the output.
fn rms_norm_formula_and_gradients<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(70);
    let (rows, d, eps) = (5, 11, 1e-5);
    let xv = normal_vec(&mut rng, rows * d);
    let wv: Vec<f64> = (0..d).map(|_| rng.random_range(0.5..2.0)).collect();
    let cv = normal_vec(&mut rng, rows * d);
    let x = from_f64::<B, 2>(&xv, [rows, d], device).require_grad();
    let w = from_f64::<B, 1>(&wv, [d], device).require_grad();
    let y = rms_norm(x.clone(), w.clone(), eps);
    assert_close(
        "rms_norm",
        &rms_norm64(&xv, &wv, eps),
        &host(y.clone()),
        1e-5,
    );
    let grads = y
        .mul(from_f64::<B, 2>(&cv, [rows, d], device))
        .sum()
        .backward();
    let objective = |x: &[f64], w: &[f64]| -> f64 {
        rms_norm64(x, w, eps)
            .iter()
            .zip(&cv)
            .map(|(a, b)| a * b)
            .sum()
    };
    let dx = finite_diff(&xv, 1e-4, |x| objective(x, &wv));
    let dw = finite_diff(&wv, 1e-4, |w| objective(&xv, w));
    assert_close("d x", &dx, &host(x.grad(&grads).expect("x gradient")), 1e-4);
    assert_close("d w", &dw, &host(w.grad(&grads).expect("w gradient")), 1e-4);
}
on_backends!(rms_norm_formula, rms_norm_formula_and_gradients);

/// The masked cross-entropy against the f64 formula and the logits' gradient against the closed
/// form `(softmax − onehot) / scored` of scored rows; a target out of range is NaN.
fn cross_entropy_formula_and_gradient<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(71);
    let (b, t, v) = (3, 7, 13);
    let zv = normal_vec(&mut rng, b * t * v);
    let tv = targets(&mut rng, b * t, v);
    let z = from_f64::<B, 3>(&zv, [b, t, v], device).require_grad();
    let loss = masked_cross_entropy(
        z.clone(),
        int_tensor::<B>(&tv, [b, t], device),
        IGNORE_INDEX,
    );
    assert_close(
        "loss",
        &[cross_entropy64(&zv, &tv, v)],
        &host(loss.clone()),
        1e-5,
    );
    let grads = loss.backward();
    let scored = tv.iter().filter(|&&y| y != IGNORE_INDEX).count() as f64;
    let mut want = vec![0.0; zv.len()];
    for (r, &y) in tv.iter().enumerate() {
        if y == IGNORE_INDEX {
            continue;
        }
        let row = &zv[r * v..(r + 1) * v];
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let total: f64 = row.iter().map(|x| (x - max).exp()).sum();
        for c in 0..v {
            let p = (row[c] - max).exp() / total;
            want[r * v + c] = (p - if c as i64 == y { 1.0 } else { 0.0 }) / scored;
        }
    }
    assert_close(
        "d logits",
        &want,
        &host(z.grad(&grads).expect("logits gradient")),
        1e-5,
    );

    for bad in [v as i64, -3] {
        let mut tv = tv.clone();
        tv[4] = bad;
        let loss = masked_cross_entropy(
            from_f64::<B, 3>(&zv, [b, t, v], device),
            int_tensor::<B>(&tv, [b, t], device),
            IGNORE_INDEX,
        );
        assert!(host(loss)[0].is_nan(), "target {bad} of {v} classes: NaN");
    }
}
on_backends!(cross_entropy_formula, cross_entropy_formula_and_gradient);

/// The fused kernels against the tensor-op reference on the same backend.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use super::*;
    use crate::common::GpuAd;
    use burn::tensor::{DType, FloatDType};
    use kimi_burn::ops::FusedOp;

    /// `[y, dx, dw, x, w, c]` of RMSNorm on one path, with the random output gradient `c`.
    fn norm(shape: [usize; 2], seed: u64, kernel: bool, dtype: FloatDType) -> Vec<Vec<f64>> {
        let device = Default::default();
        let mut rng = rng(seed);
        let [rows, d] = shape;
        let x = randn::<GpuAd, 2>(&mut rng, shape, 1.0, &device)
            .cast(dtype)
            .require_grad();
        let w = uniform::<GpuAd, 1>(&mut rng, [d], 0.5, 2.0, &device).require_grad();
        let c = randn::<GpuAd, 2>(&mut rng, [rows, d], 1.0, &device);
        let run = || {
            let y = rms_norm(x.clone(), w.clone(), 1e-5);
            assert_eq!(y.dtype(), DType::from(dtype), "the norm keeps x's dtype");
            let grads = y
                .clone()
                .cast(FloatDType::F32)
                .mul(c.clone())
                .sum()
                .backward();
            (y, grads)
        };
        let (y, grads) = if kernel {
            on_kernel(FusedOp::RmsNormBackward, 1, || {
                on_kernel(FusedOp::RmsNorm, 1, run)
            })
        } else {
            on_reference(FusedOp::RmsNorm, run)
        };
        vec![
            host(y),
            host(x.grad(&grads).expect("x gradient")),
            host(w.grad(&grads).expect("w gradient")),
            host(x),
            host(w),
            host(c),
        ]
    }

    #[test]
    fn rms_norm_matches_the_reference() {
        // Rows across several cubes, widths wider than a plane and not a multiple of 4, columns
        // long enough that the gain's gradient is summed in blocks (over 65 535 rows, lavapipe's
        // loop limit for one unit), and rows whose two walks would pass that limit at one
        // column per loop iteration (80 000 iterations; the kernels unroll their walks).
        for (shape, seed) in [
            ([150, 40], 1),
            ([1, 1], 2),
            ([9, 129], 3),
            ([70_000, 2], 4),
            ([2, 40_003], 5),
        ] {
            let kernel = norm(shape, seed, true, FloatDType::F32);
            let reference = norm(shape, seed, false, FloatDType::F32);
            // The gain's gradient in f64 on the host: Σ_rows c·x·r.
            let (x, w, c) = (&kernel[3], &kernel[4], &kernel[5]);
            let d = shape[1];
            let y = rms_norm64(x, &vec![1.0; d], 1e-5);
            let mut dw = vec![0.0; d];
            for (i, (yv, cv)) in y.iter().zip(c).enumerate() {
                dw[i % d] += yv * cv;
            }
            assert_close(
                &format!("{shape:?}, y (f64)"),
                &rms_norm64(x, w, 1e-5),
                &kernel[0],
                1e-5,
            );
            assert_close(&format!("{shape:?}, dw (f64)"), &dw, &kernel[2], 1e-5);
            // Past 65 535 rows Burn's own sum over the rows (the reference's `dw`) stops early
            // on lavapipe, which ends every loop of an invocation there: only the f64 sum
            // above judges `dw` at that length.
            let compared = if shape[0] > 65_535 { 2 } else { 3 };
            for (i, (r, k)) in reference.iter().zip(&kernel).take(compared).enumerate() {
                assert_close(&format!("{shape:?}, output {i}"), r, k, 1e-5);
            }
        }
    }

    #[test]
    fn rms_norm_repeatable_bit_for_bit() {
        assert_eq!(
            norm([300, 24], 5, true, FloatDType::F32),
            norm([300, 24], 5, true, FloatDType::F32)
        );
    }

    /// f16 `x`: statistics in f32, the output and `dx` rounded to f16.
    #[test]
    fn rms_norm_half_storage() {
        let kernel = norm([70, 40], 6, true, FloatDType::F16);
        let reference = norm([70, 40], 6, false, FloatDType::F16);
        for (i, (r, k)) in reference.iter().zip(&kernel).enumerate() {
            assert_close(&format!("f16, output {i}"), r, k, 5e-3);
        }
    }

    /// `[loss, d logits]` of the masked cross-entropy on one path.
    fn loss(
        shape: [usize; 3],
        targets: &[i64],
        seed: u64,
        kernel: bool,
        dtype: FloatDType,
    ) -> Vec<Vec<f64>> {
        let device = Default::default();
        let mut rng = rng(seed);
        let z = randn::<GpuAd, 3>(&mut rng, shape, 2.0, &device)
            .cast(dtype)
            .require_grad();
        let t = int_tensor::<GpuAd>(targets, [shape[0], shape[1]], &device);
        let run = || {
            let l = masked_cross_entropy(z.clone(), t.clone(), IGNORE_INDEX);
            let grads = l.clone().mul_scalar(3.0).backward();
            (l, grads)
        };
        let (l, grads) = if kernel {
            on_kernel(FusedOp::CrossEntropyBackward, 1, || {
                on_kernel(FusedOp::CrossEntropy, 1, run)
            })
        } else {
            on_reference(FusedOp::CrossEntropy, run)
        };
        vec![host(l), host(z.grad(&grads).expect("logits gradient"))]
    }

    #[test]
    fn cross_entropy_matches_the_reference() {
        let mut rng = rng(72);
        // Rows across several cubes; vocabularies below and above a cube's width.
        for (shape, seed) in [([3, 50, 37], 1), ([2, 9, 300], 2), ([1, 1, 1], 3)] {
            let tv = targets(&mut rng, shape[0] * shape[1], shape[2]);
            let kernel = loss(shape, &tv, seed, true, FloatDType::F32);
            let reference = loss(shape, &tv, seed, false, FloatDType::F32);
            for (i, (r, k)) in reference.iter().zip(&kernel).enumerate() {
                assert_close(&format!("{shape:?}, output {i}"), r, k, 1e-5);
            }
        }
    }

    #[test]
    fn cross_entropy_edge_targets() {
        let shape = [2, 4, 9];
        // Nothing scored: 0 and a zero gradient, not NaN.
        let none = vec![IGNORE_INDEX; 8];
        let out = loss(shape, &none, 7, true, FloatDType::F32);
        assert_eq!(out[0], vec![0.0]);
        assert!(out[1].iter().all(|&g| g == 0.0));
        // A target out of range: NaN, as on the reference path.
        let mut bad = vec![3; 8];
        bad[5] = 9;
        let device = Default::default();
        let z = Tensor::<GpuAd, 3>::zeros(shape, &device);
        let l = on_kernel(FusedOp::CrossEntropy, 1, || {
            masked_cross_entropy(z, int_tensor::<GpuAd>(&bad, [2, 4], &device), IGNORE_INDEX)
        });
        assert!(host(l)[0].is_nan());
    }

    /// Rows longer than one unit's loops may run on lavapipe (65 535 iterations in all) take the
    /// kernels, on wgpu as on CUDA, and give the f64 loss and gradient: 70 000 logits per row (64
    /// units per row, over a thousand logits each), and one logit past what those units can
    /// walk within the loop budget, where each row gets more units.
    #[test]
    fn cross_entropy_long_rows() {
        use kimi_burn_kernels::cross_entropy::{split_for, CROSS_ENTROPY_SPLIT};
        use kimi_burn_kernels::kda::LOOP_BUDGET;
        let widest = CROSS_ENTROPY_SPLIT * LOOP_BUDGET;
        assert_eq!(split_for(widest), CROSS_ENTROPY_SPLIT);
        assert!(split_for(widest + 1) > CROSS_ENTROPY_SPLIT);
        let device = Default::default();
        for (rows, v, seed) in [(4, 70_000, 74), (1, widest + 1, 75)] {
            let mut rng = rng(seed);
            let zv = normal_vec(&mut rng, rows * v);
            let mut tv = targets(&mut rng, rows, v);
            tv[0] = (v - 1) as i64; // the last column, which the last unit of the row reads
            let z = from_f64::<GpuAd, 3>(&zv, [1, rows, v], &device).require_grad();
            let (l, grads) = on_kernel(FusedOp::CrossEntropyBackward, 1, || {
                on_kernel(FusedOp::CrossEntropy, 1, || {
                    let l = masked_cross_entropy(
                        z.clone(),
                        int_tensor::<GpuAd>(&tv, [1, rows], &device),
                        IGNORE_INDEX,
                    );
                    let grads = l.clone().backward();
                    (l, grads)
                })
            });
            let what = format!("{rows} rows of {v}");
            assert_close(
                &format!("{what}: loss"),
                &[cross_entropy64(&zv, &tv, v)],
                &host(l),
                1e-5,
            );
            // The f64 gradient, (softmax − one-hot)/scored on scored rows, scaled by the
            // vocabulary on both sides so that its entries are not all below the absolute
            // tolerance of `assert_close`.
            let scored = tv.iter().filter(|&&y| y != IGNORE_INDEX).count().max(1) as f64;
            let mut dz = vec![0.0; rows * v];
            for ((row, &y), d) in zv.chunks(v).zip(&tv).zip(dz.chunks_mut(v)) {
                if y == IGNORE_INDEX {
                    continue;
                }
                let max = row.iter().copied().fold(f64::MIN, f64::max);
                let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
                for (c, (x, d)) in row.iter().zip(d.iter_mut()).enumerate() {
                    let onehot = if c as i64 == y { 1.0 } else { 0.0 };
                    *d = ((x - max).exp() / sum - onehot) / scored * v as f64;
                }
            }
            let got: Vec<f64> = host(z.grad(&grads).expect("logits gradient"))
                .iter()
                .map(|g| g * v as f64)
                .collect();
            assert_close(&format!("{what}: gradient"), &dz, &got, 1e-5);
        }
    }

    #[test]
    fn cross_entropy_repeatable_bit_for_bit() {
        let tv: Vec<i64> = (0..120).map(|i| (i * 7 % 45) as i64).collect();
        assert_eq!(
            loss([4, 30, 45], &tv, 8, true, FloatDType::F32),
            loss([4, 30, 45], &tv, 8, true, FloatDType::F32)
        );
    }

    /// f16 logits: statistics in f32, the loss and gradient rounded to f16 (the reference runs its
    /// log-softmax in f16, hence the tolerance).
    #[test]
    fn cross_entropy_half_storage() {
        let mut rng = rng(73);
        let tv = targets(&mut rng, 60, 50);
        let kernel = loss([2, 30, 50], &tv, 9, true, FloatDType::F16);
        let reference = loss([2, 30, 50], &tv, 9, false, FloatDType::F16);
        for (i, (r, k)) in reference.iter().zip(&kernel).enumerate() {
            assert_close(&format!("f16, output {i}"), r, k, 5e-3);
        }
    }
}
