//! Trains the tiny Kimi hybrid on MQAR in Burn's own `Learner` (burn-train): the causal LM's
//! `TrainStep` / `InferenceStep` (`kimi_burn::learner`), Burn's data loaders, and burn-train's
//! metrics UI with the loss, the recall accuracy and the MoE layers' expert load (the largest
//! max violation over the layers, per batch). The balance update runs inside the train step,
//! after each optimiser step.
//!
//! ```text
//! cargo run --release --features learner --example learner
//! cargo run --release --features learner --example learner -- --epochs 4 --accum 2
//! ```
//!
//! In a terminal burn-train draws its UI; otherwise it prints the metrics. Logs go to `--out`
//! (default `runs/learner`), burn-train's checkpoints of the model and the optimiser after each
//! epoch to its `checkpoint/` folder.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::DataLoaderBuilder;
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::train::metric::LossMetric;
use burn::train::{Learner, SupervisedTraining};
use clap::Parser;
use kimi_burn::data::{Mqar, MqarFiller, Task};
use kimi_burn::learner::{ExpertLoadMetric, LmBatcher, RecallMetric, TaskDataset};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::optim::KimiOptimizerConfig;

type B = Autodiff<NdArray<f32>>;

/// Train the tiny Kimi hybrid on MQAR with burn-train's Learner.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Epochs.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Training sequences per epoch.
    #[arg(long, default_value_t = 4096)]
    sequences: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Batches per optimiser step (burn-train's gradient accumulation; the QB histograms pool
    /// over them, one balance update per step).
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// MQAR sequence length.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// MQAR key-value pairs.
    #[arg(long, default_value_t = 8)]
    pairs: usize,
    /// Learning rate (constant).
    #[arg(long, default_value_t = 5e-3)]
    lr: f64,
    /// Random seed (data and initialisation).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder (checkpoints, logs).
    #[arg(long, default_value = "runs/learner")]
    out: PathBuf,
}

fn main() {
    // Each step's freed buffers serve the next step instead of going back to the operating
    // system and being faulted in again (glibc; see `retain_freed_memory`).
    kimi_burn::ops::backend::retain_freed_memory();
    if let Err(e) = run(&Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.epochs == 0 || args.batch == 0 || args.accum == 0 || args.sequences < args.batch {
        return Err(format!(
            "--epochs, --batch and --accum must be positive and --sequences at least --batch, \
             got {}, {}, {} and {}",
            args.epochs, args.batch, args.accum, args.sequences
        ));
    }
    let task = Mqar::new(256, args.seq_len, args.pairs)
        .and_then(|t| t.with_filler(MqarFiller::Reserved(96)))
        .map_err(|e| e.to_string())?;
    let mut config = KimiConfig::tiny();
    config.vocab_size = task.vocab_size();
    let device = Default::default();
    <B as burn::tensor::backend::Backend>::seed(&device, args.seed);
    let model: KimiForCausalLM<B> = config.try_init(&device).map_err(|e| e.to_string())?;
    let optim = KimiOptimizerConfig::new()
        .init(&model, model.param_roles())
        .map_err(|e| e.to_string())?;

    let train = DataLoaderBuilder::new(LmBatcher)
        .batch_size(args.batch)
        .shuffle(args.seed)
        .build(TaskDataset::new(task.clone(), args.sequences, args.seed));
    let valid = DataLoaderBuilder::<NdArray<f32>, _, _>::new(LmBatcher)
        .batch_size(args.batch)
        .build(TaskDataset::new(task, 256, args.seed ^ 0x5eed_7e57));

    let mut training = SupervisedTraining::new(&args.out, train, valid)
        .metrics((
            LossMetric::new(),
            RecallMetric::default(),
            ExpertLoadMetric::default(),
        ))
        .num_epochs(args.epochs)
        // Full precision: the records keep the MoE balance biases (f32 buffers) exactly.
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .summary();
    if args.accum > 1 {
        training = training.grads_accumulation(args.accum);
    }
    let result = training.launch(Learner::new(model, optim, args.lr));
    let trained = result.model;
    println!(
        "trained {} parameters; checkpoints and logs in {}",
        trained.num_params(),
        args.out.display()
    );
    Ok(())
}
