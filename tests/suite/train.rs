//! The tiny hybrid learns: a short MQAR run (few pairs, short sequences) on the CPU backend must cut
//! the loss by a large factor and recall held-out pairs, with the same loop as `examples/train_tiny`
//! (per-head Muon for hidden matrices, AdamW for the rest, QB balancing between steps).

use crate::common::*;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::ElementConversion;
use kimi_burn::data::{accuracy_from_logits, masked_cross_entropy, Mqar, SeededRng, Task};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::optim::KimiOptimizerConfig;

#[test]
fn two_hundred_steps_of_mqar_cut_the_loss() {
    type B = CpuAd;
    let device = Default::default();
    B::seed(&device, 7);
    // 2 pairs in 16 tokens, 7 possible keys and 8 values: chance loss is ln 8 ≈ 2.08.
    let task = Mqar::new(16, 16, 2).expect("a valid MQAR setting");
    let mut config = KimiConfig::tiny();
    config.vocab_size = task.vocab_size();
    let mut model: KimiForCausalLM<B> = config.try_init(&device).expect("tiny preset");
    let mut optim = KimiOptimizerConfig::new()
        .init(&model, model.param_roles())
        .expect("per-head Muon roles");
    let mut rng = SeededRng::new(7);
    let mut losses = Vec::new();
    for step in 0..200 {
        let batch = task.sample_batch(32, &mut rng);
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let logits = model
            .try_forward(inputs, None, None)
            .expect("forward")
            .logits;
        let loss = masked_cross_entropy(logits, targets);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        // Linear warm-up over 10 steps, then a constant rate.
        let lr = 1e-2 * ((step + 1) as f64 / 10.0).min(1.0);
        model = optim.step(lr, model, grads);
        model.update_balance();
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[190..]));
    assert!(
        last < first / 5.0,
        "loss went from {first:.3} (first 10 steps) to {last:.3} (last 10): expected a 5x cut"
    );
    // Held-out sequences from another seed, without autodiff.
    let eval = model.valid();
    let batch = task.sample_batch(64, &mut SeededRng::new(99));
    let (inputs, _) = batch.to_tensors(&device);
    let acc = accuracy_from_logits(eval.forward(inputs), &batch.targets).expect("targets");
    let frac = acc.fraction().expect("scored tokens");
    assert!(
        frac > 0.8,
        "held-out recall accuracy {frac:.3}, expected > 0.8"
    );
}
