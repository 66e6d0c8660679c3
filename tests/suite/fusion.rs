//! The kernels on Burn's `Fusion` backend: what `burn::backend::Wgpu` is in a project with Burn's
//! default features. Training takes the kernel path of every fused op forward and backward (with
//! and without checkpointing) and gives the numbers of the plain `CubeBackend`; inference
//! (prefill, then decode through the cache) matches one full pass.

use crate::common::*;
use crate::model::{check_prefill_then_decode_equals_one_pass, logits_and_grads, small};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use kimi_burn::backends::{WgpuCube, WgpuFusion};
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::ops::quant::QatConfig;
use kimi_burn::ops::{kernel_calls, FusedOp};
use kimi_burn::KimiConfig;
use rand::Rng;

/// The fused ops a training step of the small model runs, forward and backward.
const TRAINING_KERNELS: [FusedOp; 22] = [
    FusedOp::SituGlu,
    FusedOp::SituGluBackward,
    FusedOp::RouteTopK,
    FusedOp::QbHistogram,
    FusedOp::MoeExperts,
    FusedOp::MoeExpertsBackward,
    FusedOp::KdaChunk,
    FusedOp::KdaChunkBackward,
    FusedOp::ShortConv,
    FusedOp::ShortConvBackward,
    FusedOp::RmsNormGated,
    FusedOp::RmsNormGatedBackward,
    FusedOp::AttnRes,
    FusedOp::AttnResBackward,
    FusedOp::RmsNorm,
    FusedOp::RmsNormBackward,
    FusedOp::CrossEntropy,
    FusedOp::CrossEntropyBackward,
    FusedOp::Attention,
    FusedOp::AttentionBackward,
    FusedOp::Sigmoid,
    FusedOp::SigmoidBackward,
];

type Snapshot = (Vec<f64>, Vec<crate::model::ParamState>);

/// One training forward and backward of `file`'s weights on `B`, and how many times each training
/// kernel ran in it.
fn step<B: AutodiffBackend>(
    config: &KimiConfig,
    file: &std::path::Path,
    ids: &[i64],
    shape: [usize; 2],
    kernels: &[FusedOp],
) -> (Snapshot, Vec<u64>) {
    let device = Default::default();
    let model = KimiForCausalLM::<B>::from_safetensors(config, file, &device).unwrap();
    let before: Vec<u64> = kernels.iter().map(|&op| kernel_calls(op)).collect();
    let out = logits_and_grads(&model, ids, shape, &device);
    let ran = kernels
        .iter()
        .zip(before)
        .map(|(&op, b)| kernel_calls(op) - b)
        .collect();
    (out, ran)
}

#[test]
fn training_on_fusion_takes_every_kernel_and_matches_the_plain_backend() {
    check_fusion_training(&small(), "plain", &TRAINING_KERNELS);
}

/// Quantisation-aware training (routed and shared experts, dense FFNs) on `Fusion` takes the MX
/// kernel and gives the numbers of the plain backend.
#[test]
fn qat_training_on_fusion_takes_the_mx_kernel_and_matches_the_plain_backend() {
    let mut config = small();
    config.moe.qat = Some(
        QatConfig::mxfp4()
            .with_shared_experts(true)
            .with_dense_ffn(true),
    );
    let mut kernels = TRAINING_KERNELS.to_vec();
    kernels.push(FusedOp::MxFakeQuant);
    check_fusion_training(&config, "qat", &kernels);
}

/// One training step of `config` on the plain CubeCL backend and on `Fusion` (with and without
/// checkpointing): each of `kernels` ran, and logits and gradients agree.
fn check_fusion_training(config: &KimiConfig, tag: &str, kernels: &[FusedOp]) {
    let dir = std::env::temp_dir().join(format!("kimi-burn-fusion-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    config
        .init::<Cpu>(&Default::default())
        .save_safetensors(&file)
        .unwrap();
    let mut r = rng(58);
    let shape = [2, 13];
    let ids: Vec<i64> = (0..26)
        .map(|_| r.random_range(0..config.vocab_size as i64))
        .collect();
    let ((logits_ref, grads_ref), ran) =
        step::<Autodiff<WgpuCube>>(config, &file, &ids, shape, kernels);
    assert!(ran.iter().all(|&n| n > 0), "plain backend kernels {ran:?}");
    let runs = [
        (
            "Autodiff<Fusion>",
            step::<Autodiff<WgpuFusion>>(config, &file, &ids, shape, kernels),
        ),
        (
            "Autodiff<Fusion, BalancedCheckpointing>",
            step::<Autodiff<WgpuFusion, BalancedCheckpointing>>(
                config, &file, &ids, shape, kernels,
            ),
        ),
    ];
    for (name, ((logits, grads), ran)) in runs {
        for (op, n) in kernels.iter().zip(&ran) {
            assert!(*n > 0, "{name}: {op:?} did not run its kernel");
        }
        assert_close(&format!("{name} logits"), &logits_ref, &logits, 1e-5);
        assert_eq!(grads.len(), grads_ref.len());
        for ((param, _, want), (_, _, got)) in grads_ref.iter().zip(&grads) {
            match (want, got) {
                (Some(w), Some(g)) => assert_close(&format!("{name} d {param}"), w, g, 1e-5),
                (None, None) => {}
                _ => panic!("{name}: {param} has a gradient on one backend only"),
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn decoding_on_fusion_takes_the_recurrent_kernel_and_matches_one_pass() {
    let before = kernel_calls(FusedOp::KdaRecurrent);
    check_prefill_then_decode_equals_one_pass::<Autodiff<WgpuFusion>>(&Default::default());
    assert!(
        kernel_calls(FusedOp::KdaRecurrent) > before,
        "decode did not run the recurrent kernel"
    );
}

/// Marks the child process of [`a_half_default_backend_keeps_f32_where_the_design_says`].
const HALF_CHILD: &str = "KIMI_BURN_HALF_DEFAULT_CHILD";

/// On a backend whose default float is half (`Wgpu<f16>` under `Fusion`, as a Burn user with
/// `burn::backend::Wgpu<half::f16>` has it), tensors the crate creates for f32 values stay f32:
/// the QB bias decides between equal scores by 2⁻¹², which f16 would round away; routing with
/// `weights_from_biased_scores`, the reference dispatch, a training step and sampled generation
/// do not mix f16 and f32 tensors (a `Fusion` panic). Burn fixes a device's default dtype at its
/// first tensor, so this runs in a process of its own.
#[test]
fn a_half_default_backend_keeps_f32_where_the_design_says() {
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "fusion::half_default_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HALF_CHILD, "1")
        .output()
        .expect("the child process runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("half-default checks passed"),
        "the child failed or did not run: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "the child process of a_half_default_backend_keeps_f32_where_the_design_says"]
fn half_default_child() {
    use burn::module::{AutodiffModule, Param};
    use burn::tensor::{Int, Tensor, TensorData};
    use kimi_burn::generate::{GenerateOptions, Sampling};
    use kimi_burn::nn::{RouterConfig, RouterOptions};
    use kimi_burn::ops::with_kernels;
    assert!(
        std::env::var_os(HALF_CHILD).is_some(),
        "run by its parent test, in a process of its own"
    );
    type H = WgpuFusion<half::f16>;
    let device = Default::default();
    let x_of = |m: usize, d: usize| {
        let x: Vec<f32> = (0..m * d).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        Tensor::<H, 2>::from_data(TensorData::new(x, [m, d]), &device)
    };

    // Experts 0 and 1 have the same gate column, so the same scores: the bias decides.
    let (m, d, n) = (4, 8, 3);
    let w: Vec<f32> = (0..d * n)
        .map(|i| match i % n {
            2 => -1.0,
            _ => 0.1 * (i / n) as f32,
        })
        .collect();
    let bias = [0.5, 0.5 + 2f32.powi(-12), 0.0];
    for biased_weights in [false, true] {
        let options = RouterOptions {
            weights_from_biased_scores: biased_weights,
            ..Default::default()
        };
        let mut router = RouterConfig::new(d, n, 1)
            .with_options(options)
            .init::<H>(&device);
        router.gate.weight = Param::from_tensor(Tensor::from_data(
            TensorData::new(w.clone(), [d, n]),
            &device,
        ));
        for kernels in [true, false] {
            let routing = with_kernels(kernels, || router.route(x_of(m, d), &bias).unwrap());
            let chosen: Vec<i64> = routing.indices.into_data().iter::<i64>().collect();
            assert_eq!(
                chosen,
                vec![1; m],
                "kernels {kernels}: the exact bias decides"
            );
            let weights: Vec<f32> = routing.weights.into_data().iter::<f32>().collect();
            assert!(weights.iter().all(|w| w.is_finite()), "{weights:?}");
        }
    }

    // The small model: a training step with the kernels on `Fusion` and on both paths on the
    // plain backend (the tensor-op reference on `Fusion<Wgpu<f16>>` fails inside Burn's fusion
    // compiler: `x · 1/mean(x²)` over the last dim, in f16, panics in burn-cubecl-fusion 0.21),
    // then sampled generation on `Fusion`.
    let config = crate::model::small();
    let ids: Vec<i64> = (0..2 * 9)
        .map(|i| (i * 7 % config.vocab_size) as i64)
        .collect();
    let dir = std::env::temp_dir().join(format!("kimi-burn-half-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    config
        .init::<WgpuCube<half::f16>>(&device)
        .save_safetensors(&file)
        .unwrap();
    let step = |kernels: bool, fused: bool| {
        fn run<B: burn::tensor::backend::AutodiffBackend>(
            config: &KimiConfig,
            file: &std::path::Path,
            ids: &[i64],
            kernels: bool,
            device: &B::Device,
        ) -> (KimiForCausalLM<B>, Vec<f64>) {
            let model = KimiForCausalLM::<B>::from_safetensors(config, file, device).unwrap();
            let (logits, grads) = with_kernels(kernels, || {
                crate::model::logits_and_grads(&model, ids, [2, 9], device)
            });
            assert!(logits.iter().all(|l| l.is_finite()), "kernels {kernels}");
            assert!(grads.iter().any(|g| g.2.is_some()), "kernels {kernels}");
            (model, logits)
        }
        if fused {
            let (model, logits) =
                run::<burn::backend::Autodiff<H>>(&config, &file, &ids, kernels, &device);
            (Some(model), logits)
        } else {
            let plain = run::<burn::backend::Autodiff<WgpuCube<half::f16>>>;
            (None, plain(&config, &file, &ids, kernels, &device).1)
        }
    };
    let (_, reference) = step(false, false);
    let (_, kernels) = step(true, false);
    let (model, fused) = step(true, true);
    let model = model.expect("the fused model");
    std::fs::remove_dir_all(&dir).ok();
    // f16 activations: the paths agree to f16's rounding of logits of size ~1.
    assert_close("kernels vs reference, f16", &reference, &kernels, 3e-2);
    assert_close("Fusion vs plain, f16", &kernels, &fused, 3e-2);
    let model = model.valid();
    let prompt =
        Tensor::<H, 2, Int>::from_data(TensorData::new(ids[..8].to_vec(), [2, 4]), &device);
    let sampling = Sampling::TopKTopP {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.8,
        seed: 3,
    };
    let out = model
        .generate_stream(
            prompt,
            &GenerateOptions::new(4).with_sampling(sampling),
            |_| true,
        )
        .expect("generate");
    let out: Vec<i64> = out.into_data().iter::<i64>().collect();
    assert!(out
        .iter()
        .all(|&id| (0..config.vocab_size as i64).contains(&id)));
    println!("half-default checks passed");
}
