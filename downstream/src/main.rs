//! A Burn user's training loop on `Autodiff<burn::backend::Wgpu>`: a few steps of kimi-burn's tiny
//! model, then a check that every fused op ran its CubeCL kernel (forward and backward) and that
//! the loss fell. Exits non-zero otherwise.

use burn::backend::{Autodiff, Wgpu};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use kimi_burn::ops::{kernel_calls, FusedOp};
use kimi_burn::KimiConfig;

type B = Autodiff<Wgpu>;

fn main() {
    let device = Default::default();
    let mut config = KimiConfig::tiny();
    config.vocab_size = 64;
    let mut model = config.init::<B>(&device);
    let mut optim = AdamWConfig::new().init();
    let (batch, t, vocab) = (2, 24, config.vocab_size);
    let ids: Vec<i64> = (0..batch * t)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    let x = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, t]), &device);
    let target = x.clone().slice([0..batch, 1..t]);
    let mut losses = Vec::new();
    for _ in 0..6 {
        let logits = model.forward(x.clone()).slice([0..batch, 0..t - 1]);
        let loss = kimi_burn::data::masked_cross_entropy(logits, target.clone());
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
        model.update_balance();
    }
    let backend = std::any::type_name::<B>();
    let missing: Vec<FusedOp> = [
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
    ]
    .into_iter()
    .filter(|&op| kernel_calls(op) == 0)
    .collect();
    assert!(
        missing.is_empty(),
        "on {backend} these ops never ran their kernel: {missing:?}"
    );
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(
        last.is_finite() && last < first,
        "on {backend} the loss did not fall: {losses:?}"
    );
    println!("{backend}: every fused op ran its kernel; loss {first:.4} -> {last:.4}");
}
