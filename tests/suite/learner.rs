//! The causal LM in Burn's `Learner` (`kimi_burn::learner`, burn-train).

use crate::common::*;
use crate::train::{identical_models, kimi_optim, moe_biases, small_mqar};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::train::metric::LossMetric;
use burn::train::{Learner, SupervisedTraining};
use kimi_burn::data::masked_cross_entropy;
use kimi_burn::learner::{ExpertLoadMetric, LmBatch, LmBatcher, RecallMetric, TaskDataset};

type B = CpuAd;

/// One epoch of six batches through burn-train's `SupervisedTraining` (its `TrainStep`, the
/// optimiser step and the balance update in `optimize`, the metrics, a validation pass) ends
/// with the same parameters and balance biases, bit for bit, as the crate's own loop over the
/// same batches: same forward, loss, optimiser and one balance update per step.
#[test]
fn the_learner_trains_like_the_crates_own_loop() {
    let device = Default::default();
    let (task, config) = small_mqar();
    let start = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");
    let mut own = start.replica(&device);
    let optim = kimi_optim::<B>;
    let (batch, batches, lr) = (8, 6, 1e-2);
    let dataset = TaskDataset::new(task.clone(), batch * batches, 3);
    let dir = std::env::temp_dir().join(format!("kimi-burn-learner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);

    let train = DataLoaderBuilder::new(LmBatcher)
        .batch_size(batch)
        .build(dataset.clone());
    let valid = DataLoaderBuilder::<Cpu, _, _>::new(LmBatcher)
        .batch_size(batch)
        .build(TaskDataset::new(task, batch, 4));
    let optim_learner = optim(&start);
    let learned = SupervisedTraining::new(&dir, train, valid)
        .metrics((
            LossMetric::new(),
            RecallMetric::default(),
            ExpertLoadMetric::default(),
        ))
        .num_epochs(1)
        .with_application_logger(None)
        .launch(Learner::new(start, optim_learner, lr))
        .model;

    let mut own_optim = optim(&own);
    for b in 0..batches {
        let items = (b * batch..(b + 1) * batch)
            .map(|i| dataset.get(i).expect("in range"))
            .collect();
        let LmBatch { inputs, targets } = Batcher::<B, _, _>::batch(&LmBatcher, items, &device);
        let loss = masked_cross_entropy(own.forward(inputs), targets);
        let grads = GradientsParams::from_grads(loss.backward(), &own);
        own = own_optim.step(lr, own, grads);
        own.update_balance();
    }

    let own = own.valid();
    assert!(
        moe_biases(&own).iter().flatten().any(|&b| b != 0.0),
        "QB moved the biases"
    );
    assert_eq!(moe_biases(&learned), moe_biases(&own), "balance biases");
    let held_out = dataset.get(0).expect("an item");
    let inputs = Batcher::<Cpu, _, LmBatch<Cpu>>::batch(&LmBatcher, vec![held_out], &device).inputs;
    assert_eq!(
        host(learned.forward(inputs.clone())),
        host(own.forward(inputs)),
        "parameters"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Datasets of nearby seeds (a training set and a validation set, say) share no sequence, and a
/// dataset reads the same items whatever the order.
#[test]
fn datasets_of_nearby_seeds_are_disjoint() {
    let (task, _) = small_mqar();
    let train = TaskDataset::new(task.clone(), 48, 3);
    let valid = TaskDataset::new(task, 8, 4);
    let items = |d: &TaskDataset<_>| {
        (0..d.len())
            .map(|i| d.get(i).expect("an item"))
            .collect::<Vec<_>>()
    };
    let (t, v) = (items(&train), items(&valid));
    assert!(
        v.iter().all(|s| !t.contains(s)),
        "a validation item is a training item"
    );
    assert_eq!(train.get(7), Some(t[7].clone()));
}
