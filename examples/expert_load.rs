//! Routes held-out MQAR batches through a checkpoint written by `train_tiny` and prints the
//! per-batch expert load of every MoE layer, with the balance biases frozen (inference), for a
//! few batch sizes: how much of a training run's max violation is batch-to-batch noise. It also
//! prints each layer's median selection margin (`MoeStats::median_margin`): how far the scores
//! must move to change a token's last expert.
//!
//! With `--replay N`, it then replays training's causal QB on a stream of `N` held-out batches:
//! each batch routed with the bias the batches before it set, the model itself frozen. That is
//! the violation a training run would show if its weights stopped changing: batch noise plus what
//! one QB update leaves, without a moving router.
//!
//! ```text
//! cargo run --release --example expert_load -- runs/train_tiny
//! cargo run --release --example expert_load -- runs/e1 --vocab 512 --filler-tokens 192
//! cargo run --release --example expert_load -- runs/train_tiny --replay 64
//! ```

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::Backend;
use clap::Parser;
use kimi_burn::data::{Mqar, MqarFiller, SeededRng, Task};
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::nn::{BalancerKind, MoeStats};
use kimi_burn::KimiConfig;

/// Expert load of a trained checkpoint on held-out MQAR batches.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// A `train_tiny` output folder (`config.json` and `model.safetensors`).
    run: PathBuf,
    /// MQAR vocabulary (must match the run).
    #[arg(long, default_value_t = 256)]
    vocab: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Key-value pairs per sequence.
    #[arg(long, default_value_t = 16)]
    pairs: usize,
    /// Reserved filler tokens (as `train_tiny --filler reserved --filler-tokens`).
    #[arg(long, default_value_t = 96)]
    filler_tokens: usize,
    /// Held-out sequences per batch size.
    #[arg(long, default_value_t = 256)]
    sequences: usize,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_values_t = vec![16usize, 64])]
    batches: Vec<usize>,
    /// Data seed (the run's test set uses another stream).
    #[arg(long, default_value_t = 77)]
    seed: u64,
    /// Batches to replay the causal QB update on (0: no replay; the first quarter warms the
    /// bias up and is left out of the statistics).
    #[arg(long, default_value_t = 0)]
    replay: usize,
    /// Sequences per replayed batch (`train_tiny --batch`).
    #[arg(long, default_value_t = 16)]
    replay_batch: usize,
}

fn main() {
    if let Err(msg) = run(&Args::parse()) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.replay > 0 && (args.replay < 4 || args.replay_batch == 0) {
        return Err(format!(
            "--replay must be 0 or at least 4, and --replay-batch positive, got {} and {}",
            args.replay, args.replay_batch
        ));
    }
    type B = NdArray<f32>;
    let device = Default::default();
    let config =
        KimiConfig::from_hf_config(args.run.join("config.json")).map_err(|e| e.to_string())?;
    let model = load::<B>(args, &config)?;
    let task = Mqar::new(args.vocab, args.seq_len, args.pairs)
        .and_then(|t| t.with_filler(MqarFiller::Reserved(args.filler_tokens)))
        .map_err(|e| e.to_string())?;
    if task.vocab_size() > config.vocab_size {
        return Err(format!(
            "--vocab {} exceeds the model's vocabulary {}",
            args.vocab, config.vocab_size
        ));
    }
    let mut rng = SeededRng::new(args.seed);
    println!(
        "MoE layer, batch: per-batch max violation mean / max; all batches pooled; mean median \
         selection margin; loads pooled"
    );
    for &batch in &args.batches {
        if batch == 0 || batch > args.sequences {
            return Err(format!(
                "batch sizes must lie in 1..={}, got {batch}",
                args.sequences
            ));
        }
        let mut per_batch: Vec<Vec<f32>> = Vec::new();
        let mut pooled: Vec<Vec<u64>> = Vec::new();
        let mut margins: Vec<Vec<f32>> = Vec::new();
        for _ in 0..args.sequences / batch {
            let data = task.sample_batch(batch, &mut rng);
            let (ids, _) = data.to_tensors::<B>(&device);
            let out = model.forward_with_stats(ids).map_err(|e| e.to_string())?;
            per_batch.resize(out.moe_stats.len(), Vec::new());
            pooled.resize(out.moe_stats.len(), Vec::new());
            margins.resize(out.moe_stats.len(), Vec::new());
            for (l, stats) in out.moe_stats.iter().enumerate() {
                per_batch[l].push(stats.max_violation);
                margins[l].extend(stats.median_margin);
                let loads = &mut pooled[l];
                loads.resize(stats.tokens_per_expert.len(), 0);
                loads
                    .iter_mut()
                    .zip(&stats.tokens_per_expert)
                    .for_each(|(a, b)| *a += b);
            }
        }
        for (l, (v, loads)) in per_batch.iter().zip(&pooled).enumerate() {
            let mean = v.iter().sum::<f32>() / v.len() as f32;
            let max = v.iter().copied().fold(0.0f32, f32::max);
            let all = MoeStats::from_loads(loads.clone());
            let margin = margins[l].iter().sum::<f32>() / margins[l].len().max(1) as f32;
            println!(
                "moe{l}, batch {batch}: {mean:.3} / {max:.3}; pooled {:.3}; margin {margin:.4}; \
                 {loads:?}",
                all.max_violation
            );
        }
    }
    if args.replay > 0 {
        replay(args, &config, &task)?;
    }
    Ok(())
}

fn load<B: Backend>(args: &Args, config: &KimiConfig) -> Result<KimiForCausalLM<B>, String> {
    KimiForCausalLM::<B>::from_safetensors(
        config,
        args.run.join("model.safetensors"),
        &Default::default(),
    )
    .map_err(|e| e.to_string())
}

/// Routes `--replay` held-out batches one after another with QB updating the bias after each
/// (as in training: on an autodiff backend, so the balancer counts), starting from the
/// checkpoint's bias.
fn replay(args: &Args, config: &KimiConfig, task: &Mqar) -> Result<(), String> {
    type B = Autodiff<NdArray<f32>>;
    let device = Default::default();
    let mut config = config.clone();
    config.moe.balancer = BalancerKind::quantile();
    let model = load::<B>(args, &config)?;
    let mut rng = SeededRng::new(args.seed ^ 0x7e91a7);
    let mut per_layer: Vec<Vec<f32>> = Vec::new();
    for i in 0..args.replay {
        let data = task.sample_batch(args.replay_batch, &mut rng);
        let (ids, _) = data.to_tensors::<B>(&device);
        let out = model.forward_with_stats(ids).map_err(|e| e.to_string())?;
        // Release the autodiff graph the forward recorded (nothing is trained). Burn 0.21 frees
        // graph nodes only in a backward: without it, 64 replayed batches held 14 GB, not 0.27 GB.
        let _ = out.logits.sum().backward();
        model.update_balance();
        per_layer.resize(out.moe_stats.len(), Vec::new());
        if i >= args.replay / 4 {
            for (l, stats) in out.moe_stats.iter().enumerate() {
                per_layer[l].push(stats.max_violation);
            }
        }
    }
    for (l, v) in per_layer.iter().enumerate() {
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let max = v.iter().copied().fold(0.0f32, f32::max);
        let over = v.iter().filter(|&&x| x > 0.3).count();
        println!(
            "replayed QB, moe{l}, batch {}: {mean:.3} / {max:.3}; above 0.3 in {over} of {}",
            args.replay_batch,
            v.len()
        );
    }
    Ok(())
}
