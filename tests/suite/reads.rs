//! Device-to-host reads of a training step on the kernel path (wgpu): none in the forward and
//! the backward, none in the optimiser step, one in the balance update (all MoE layers' counts
//! at once). The crate's counter ([`kimi_burn::sync`]) sees every read it makes (its lint
//! configuration forbids the tensor read methods anywhere else).

use crate::common::*;
use crate::train::{kimi_optim, small_mqar};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{Bool, Tensor, TensorData};
use kimi_burn::data::{masked_cross_entropy, SeededRng, Task};
use kimi_burn::model::{Ffn, KimiForCausalLM};
use kimi_burn::ops::FusedOp;
use kimi_burn::sync::{count_reads, set_eager_checks};

#[test]
fn a_training_step_on_the_kernel_path_reads_only_the_balance_counts_once() {
    type B = GpuAd;
    let device = Default::default();
    set_eager_checks(false);
    let (task, config) = small_mqar();
    let mut model: KimiForCausalLM<B> = config.try_init(&device).expect("tiny preset");
    let moe_layers = model
        .layers
        .iter()
        .filter(|l| matches!(l.ffn, Ffn::Moe(_)))
        .count() as u64;
    assert!(moe_layers >= 2, "the tiny preset has MoE layers");
    let mut optim = kimi_optim(&model);
    let mut rng = SeededRng::new(5);
    for step in 0..3 {
        let batch = task.sample_batch(6, &mut rng);
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let [b, t] = inputs.dims();
        // The last tokens of the last row are padding from step 1 on: the mask stays on the
        // device too.
        let padding = (step > 0).then(|| {
            let pad: Vec<bool> = (0..b * t).map(|i| i >= b * t - 3).collect();
            Tensor::<B, 2, Bool>::from_data(TensorData::new(pad, [b, t]), &device)
        });
        let (grads, reads) = on_kernel(FusedOp::MoeExperts, moe_layers, || {
            count_reads(|| {
                let out = model
                    .try_forward(inputs.clone(), padding.clone(), None)
                    .expect("forward");
                let loss = masked_cross_entropy(out.logits, targets.clone());
                GradientsParams::from_grads(loss.backward(), &model)
            })
        });
        assert_eq!(
            reads, 0,
            "step {step}: reads in the forward and the backward"
        );
        let (next, reads) = count_reads(|| optim.step(1e-3, model.clone(), grads));
        model = next;
        assert_eq!(reads, 0, "step {step}: reads in the optimiser step");
        let (_, reads) = count_reads(|| model.update_balance());
        assert_eq!(reads, 1, "step {step}: one read for all MoE layers' counts");
    }
    // The balance update found the counts: QB moved the biases off zero.
    assert!(crate::train::moe_biases(&model)
        .iter()
        .all(|b| b.iter().any(|&v| v != 0.0)));

    // With the eager checks on, the counter sees the reads they make: the token-id range once,
    // and each MoE layer's NaN check of the router scores.
    set_eager_checks(true);
    let batch = task.sample_batch(6, &mut rng);
    let (inputs, _) = batch.to_tensors::<B>(&device);
    let (_, reads) = count_reads(|| model.try_forward(inputs, None, None).expect("forward"));
    assert_eq!(
        reads,
        1 + moe_layers,
        "eager checks: ids once, scores per MoE layer"
    );
}

#[test]
fn a_decode_step_with_a_cache_reads_nothing_back() {
    type B = Gpu;
    let device = Default::default();
    set_eager_checks(false);
    let (task, config) = small_mqar();
    let model: KimiForCausalLM<B> = config.try_init(&device).expect("tiny preset");
    let batch = task.sample_batch(2, &mut SeededRng::new(9));
    let (inputs, _) = batch.to_tensors::<B>(&device);
    let [b, t] = inputs.dims();
    let mut cache = model.new_cache();
    let ((), reads) = count_reads(|| {
        let prompt = inputs.clone().narrow(1, 0, t - 4);
        model
            .try_forward(prompt, None, Some(&mut cache))
            .expect("prefill");
        for i in t - 4..t {
            let token = inputs.clone().narrow(1, i, 1);
            let out = model
                .try_forward(token, None, Some(&mut cache))
                .expect("decode step");
            assert_eq!(out.logits.dims()[..2], [b, 1]);
        }
    });
    assert_eq!(reads, 0, "reads in the prefill and four decode steps");
}

/// Generation on a GPU backend picks greedy tokens on the device and reads back only the picked
/// ids: one `[batch]` read per step; sampled ones too with `sample_on_device`, and otherwise
/// from one read of the step's logits. The tokens are those the host sampler picks from the
/// same logits with the same uniform numbers, whichever path.
#[test]
fn generation_reads_back_only_the_picked_ids() {
    use kimi_burn::generate::{GenerateOptions, Sampling};
    use kimi_burn::sync::device_read_bytes;
    type B = Gpu;
    let device = Default::default();
    set_eager_checks(false);
    let (task, config) = small_mqar();
    let model: KimiForCausalLM<B> = config.try_init(&device).expect("tiny preset");
    let batch = task.sample_batch(2, &mut SeededRng::new(4));
    let (inputs, _) = batch.to_tensors::<B>(&device);
    let [b, t] = inputs.dims();
    let prompt = inputs.narrow(1, 0, t / 2);
    let steps = 6;
    let sampled = Sampling::TopKTopP {
        temperature: 0.8,
        top_k: 12,
        top_p: 0.7,
        seed: 7,
    };
    let vocab = config.vocab_size;
    for (sampling, on_device) in [(Sampling::Greedy, false), (sampled, true), (sampled, false)] {
        let options = GenerateOptions::new(steps)
            .with_sampling(sampling)
            .with_sampling_on_device(on_device);
        let bytes = device_read_bytes();
        let (out, reads) = count_reads(|| {
            model
                .generate_stream(prompt.clone(), &options, |_| true)
                .expect("generate")
        });
        assert_eq!(reads, steps as u64, "{sampling:?}: one read per step");
        let per_step = match (sampling, on_device) {
            (Sampling::Greedy, _) | (_, true) => b * prompt.dtype().size(),
            _ => b * vocab * 4,
        };
        assert_eq!(
            device_read_bytes() - bytes,
            (steps * per_step) as u64,
            "{sampling:?}, on the device {on_device}: each read is the step's ids or logits"
        );
        let out: Vec<i64> = out.into_data().iter::<i64>().collect();

        // The host sampler on the same logits, step by step.
        let mut rng = SeededRng::new(7);
        let mut cache = model.new_cache();
        let mut input = prompt.clone();
        let width = t / 2 + steps;
        for step in 0..steps {
            let logits = model
                .try_forward(input, None, Some(&mut cache))
                .expect("decode")
                .logits;
            let [_, len, vocab] = logits.dims();
            let last: Vec<f32> = logits
                .narrow(1, len - 1, 1)
                .into_data()
                .iter::<f32>()
                .collect();
            let mut ids = Vec::new();
            for (row, logits) in last.chunks(vocab).enumerate() {
                let u = match sampling {
                    Sampling::Greedy => 0.0,
                    _ => rng.unit_f64(),
                };
                let id = sampling.pick(logits, u).unwrap() as i64;
                assert_eq!(
                    out[row * width + t / 2 + step],
                    id,
                    "{sampling:?}: row {row}, step {step}"
                );
                ids.push(id);
            }
            input = Tensor::from_data(TensorData::new(ids, [b, 1]), &device);
        }
    }

    // Rows with NaN, +∞ and only −∞ (Burn's reductions on the GPU start from the lowest finite
    // f32): the device picks the host's token, greedy and sampled.
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let rows: [[f32; 5]; 4] = [
        [0.5, nan, 2.0, 1.0, nan],
        [0.5, inf, 2.0, inf, -1.0],
        [f32::NEG_INFINITY; 5],
        [nan, f32::NEG_INFINITY, nan, nan, nan],
    ];
    let logits =
        Tensor::<B, 2>::from_data(TensorData::new(rows.concat(), [rows.len(), 5]), &device);
    for sampling in [Sampling::Greedy, sampled] {
        for u in [0.05, 0.5, 0.95] {
            let us = [u; 4];
            let got: Vec<i64> = sampling
                .pick_on_device(logits.clone(), &us)
                .unwrap()
                .into_data()
                .iter::<i64>()
                .collect();
            let want: Vec<i64> = rows
                .iter()
                .map(|row| sampling.pick(row, u).unwrap() as i64)
                .collect();
            assert_eq!(got, want, "{sampling:?}, u {u}");
        }
    }
}
