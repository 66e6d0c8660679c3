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
