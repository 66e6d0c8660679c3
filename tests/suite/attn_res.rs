//! Attention Residuals (design §6): the mix against a host formula and its gradients, on every
//! backend.

use crate::common::*;
use burn::module::Param;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use kimi_burn::nn::{AttnResConfig, AttnResMix};
use kimi_burn::ops::attn_res::attn_res;
use rand::rngs::StdRng;
use rand::Rng;

/// design §0: f32 against an f64 reference.
const TOL: f64 = 1e-5;

/// Host f64 evaluation of the design §6 formula.
fn attn_res_reference(sources: &[Vec<f64>], w_proj: &[f64], w_norm: &[f64], eps: f64) -> Vec<f64> {
    let d = w_proj.len();
    let tokens = sources[0].len() / d;
    let mut out = vec![0.0; sources[0].len()];
    for t in 0..tokens {
        let scores: Vec<f64> = sources
            .iter()
            .map(|v| {
                let row = &v[t * d..(t + 1) * d];
                let inv = 1.0 / (row.iter().map(|x| x * x).sum::<f64>() / d as f64 + eps).sqrt();
                (0..d).map(|k| row[k] * inv * w_norm[k] * w_proj[k]).sum()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for (v, en) in sources.iter().zip(&e) {
            for k in 0..d {
                out[t * d + k] += en / z * v[t * d + k];
            }
        }
    }
    out
}

fn random_sources<B: Backend>(
    rng: &mut StdRng,
    n: usize,
    shape: [usize; 3],
    device: &B::Device,
) -> Vec<Tensor<B, 3>> {
    // Sources of very different scales, as residual streams are.
    (0..n)
        .map(|_| {
            let scale = rng.random_range(0.2..4.0);
            randn(rng, shape, scale, device)
        })
        .collect()
}

/// At init the mix is the mean of its sources; with random parameters it follows the formula.
fn attn_res_matches_formula<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(21);
    let shape = [2, 3, 10];
    for n in [1, 2, 4] {
        let sources = random_sources::<B>(&mut rng, n, shape, device);
        let (partial, blocks) = sources.split_last().expect("n ≥ 1");
        let mix: AttnResMix<B> = AttnResConfig::new(10).init(device);
        let hosts: Vec<Vec<f64>> = sources.iter().map(|s| host(s.clone())).collect();
        let mean: Vec<f64> = (0..hosts[0].len())
            .map(|k| hosts.iter().map(|h| h[k]).sum::<f64>() / n as f64)
            .collect();
        assert_close(
            &format!("mean of {n}"),
            &mean,
            &host(mix.forward(partial.clone(), blocks)),
            TOL,
        );
        let w_proj = randn::<B, 1>(&mut rng, [10], 1.0, device);
        let w_norm = uniform::<B, 1>(&mut rng, [10], 0.5, 2.0, device);
        let expected =
            attn_res_reference(&hosts, &host(w_proj.clone()), &host(w_norm.clone()), 1e-5);
        let out = attn_res(partial.clone(), blocks, w_proj, w_norm, 1e-5);
        assert_close(
            &format!("formula with {n} sources"),
            &expected,
            &host(out),
            TOL,
        );
    }
}
on_backends!(attn_res_formula, attn_res_matches_formula);

/// From the zero-query init, the pseudo-query gets a non-zero gradient (so training can leave
/// the mean); once it is non-zero, so does the norm gain.
fn attn_res_parameters_learn<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(22);
    let shape = [2, 3, 10];
    let sources = random_sources::<B>(&mut rng, 3, shape, device);
    let (partial, blocks) = sources.split_last().expect("3 sources");
    let weights = randn::<B, 3>(&mut rng, shape, 1.0, device);
    let mut mix: AttnResMix<B> = AttnResConfig::new(10).init(device);
    let grads = mix
        .forward(partial.clone(), blocks)
        .mul(weights.clone())
        .sum()
        .backward();
    let g_proj = host(mix.proj.grad(&grads).expect("proj grad"));
    assert!(
        g_proj.iter().all(|v| v.is_finite()) && g_proj.iter().any(|v| v.abs() > 1e-6),
        "proj gradient {g_proj:?}"
    );
    mix.proj = Param::from_tensor(randn(&mut rng, [10], 0.5, device));
    let grads = mix
        .forward(partial.clone(), blocks)
        .mul(weights)
        .sum()
        .backward();
    let g_norm = host(mix.norm.grad(&grads).expect("norm grad"));
    assert!(
        g_norm.iter().all(|v| v.is_finite()) && g_norm.iter().any(|v| v.abs() > 1e-6),
        "norm gradient {g_norm:?}"
    );
}
on_backends!(attn_res_gradients, attn_res_parameters_learn);

/// The fused kernels (CubeCL backends) against the tensor-op reference of the same op: the mix
/// and the gradients of every input, for several source counts and a width that is not a
/// multiple of the cube, and bit-identical reruns.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use super::*;
    use crate::common::GpuAd;
    use burn::tensor::{DType, FloatDType};
    use kimi_burn::ops::{kernel_calls, with_kernels, FusedOp};

    /// `[out, d sources…, d w_proj, d w_norm]` on one path of `B`, with a fixed random output
    /// gradient; the same seed gives the same inputs on every backend.
    fn run_on<B: AutodiffBackend>(
        n: usize,
        shape: [usize; 3],
        seed: u64,
        kernel: bool,
        dtype: FloatDType,
    ) -> Vec<Vec<f64>> {
        let device: B::Device = Default::default();
        let mut rng = rng(seed);
        let d = shape[2];
        let sources: Vec<Tensor<B, 3>> = random_sources::<B>(&mut rng, n, shape, &device)
            .into_iter()
            .map(|s| s.cast(dtype).require_grad())
            .collect();
        let w_proj = randn::<B, 1>(&mut rng, [d], 1.0, &device).require_grad();
        let w_norm = uniform::<B, 1>(&mut rng, [d], 0.5, 2.0, &device).require_grad();
        let weights = randn::<B, 3>(&mut rng, shape, 1.0, &device);
        let (partial, blocks) = sources.split_last().expect("n ≥ 1");
        let (calls, back_calls) = (
            kernel_calls(FusedOp::AttnRes),
            kernel_calls(FusedOp::AttnResBackward),
        );
        let out = with_kernels(kernel, || {
            attn_res(
                partial.clone(),
                blocks,
                w_proj.clone(),
                w_norm.clone(),
                1e-5,
            )
        });
        assert_eq!(
            out.dtype(),
            DType::from(dtype),
            "the mix keeps the sources' dtype"
        );
        let grads = with_kernels(kernel, || {
            out.clone()
                .cast(FloatDType::F32)
                .mul(weights)
                .sum()
                .backward()
        });
        let ran = kernel_calls(FusedOp::AttnRes) - calls;
        let ran_back = kernel_calls(FusedOp::AttnResBackward) - back_calls;
        assert_eq!(
            (ran, ran_back),
            if kernel { (1, 1) } else { (0, 0) },
            "kernel path taken"
        );
        let mut all = vec![host(out)];
        all.extend(
            sources
                .iter()
                .map(|s| host(s.grad(&grads).expect("source gradient"))),
        );
        all.push(host(w_proj.grad(&grads).expect("w_proj gradient")));
        all.push(host(w_norm.grad(&grads).expect("w_norm gradient")));
        all
    }

    /// The kernel path and the reference path on the GPU, each against the reference path on
    /// ndarray, so that a failure names the side that is wrong.
    #[test]
    fn matches_the_reference_forward_and_backward() {
        for (n, shape) in [
            (1, [2, 5, 40]),
            (2, [1, 9, 64]),
            (3, [2, 7, 40]),
            (5, [3, 4, 33]),
        ] {
            let seed = 40 + n as u64;
            let cpu = run_on::<CpuAd>(n, shape, seed, false, FloatDType::F32);
            let kernel = run_on::<GpuAd>(n, shape, seed, true, FloatDType::F32);
            let reference = run_on::<GpuAd>(n, shape, seed, false, FloatDType::F32);
            for (i, ((c, k), r)) in cpu.iter().zip(&kernel).zip(&reference).enumerate() {
                let what = format!("{n} sources, output {i}");
                assert_close(&format!("{what}: kernel vs ndarray"), c, k, 1e-5);
                assert_close(&format!("{what}: reference path vs ndarray"), c, r, 1e-5);
            }
        }
    }

    /// K3's widest mix: nine sources (93 layers in blocks of 12 give the embedding, seven finished
    /// blocks and the partial sum) at its hidden width, 7168. A unit walks its token's sources
    /// twice each way, which ran past lavapipe's loop limit (65 535 iterations per unit in all)
    /// before the kernels unrolled their walks.
    #[test]
    fn k3_sources_at_k3_width() {
        let (n, shape, seed) = (9, [1, 3, 7168], 48);
        let loops = kimi_burn_kernels::attn_res::attn_res_loops(n, shape[2]);
        assert!(
            loops <= kimi_burn_kernels::kda::LOOP_BUDGET,
            "{loops} iterations"
        );
        let cpu = run_on::<CpuAd>(n, shape, seed, false, FloatDType::F32);
        let kernel = run_on::<GpuAd>(n, shape, seed, true, FloatDType::F32);
        for (i, (c, k)) in cpu.iter().zip(&kernel).enumerate() {
            assert_close(&format!("output {i}: kernel vs ndarray"), c, k, 1e-5);
        }
    }

    #[test]
    fn repeatable_bit_for_bit() {
        let a = run_on::<GpuAd>(4, [2, 6, 48], 50, true, FloatDType::F32);
        let b = run_on::<GpuAd>(4, [2, 6, 48], 50, true, FloatDType::F32);
        assert_eq!(a, b);
    }

    /// f16 sources: statistics in f32, output and source gradients rounded to f16.
    #[test]
    fn half_storage() {
        let kernel = run_on::<GpuAd>(3, [2, 5, 40], 60, true, FloatDType::F16);
        let reference = run_on::<GpuAd>(3, [2, 5, 40], 60, false, FloatDType::F16);
        for (i, (r, k)) in reference.iter().zip(&kernel).enumerate() {
            assert_close(&format!("f16, output {i}"), r, k, 5e-3);
        }
    }
}
