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
//! With `--oracle N`, it fits each layer's bias to `N` pooled held-out sequences (damped QB
//! sweeps on their pooled histogram), freezes it and routes fresh batches of `--replay-batch`
//! sequences. The bias then fits the population of batches, not the last one, and the model
//! does not move: what is left is each batch's own noise, which any bias set before the batch is
//! seen (any causal balancer, design §3) carries into training.
//!
//! ```text
//! cargo run --release --example expert_load -- runs/train_tiny
//! cargo run --release --example expert_load -- runs/e1 --vocab 512 --filler-tokens 192
//! cargo run --release --example expert_load -- runs/train_tiny --replay 64
//! cargo run --release --example expert_load -- runs/train_tiny --oracle 512 --oracle-batches 128
//! ```
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use std::path::PathBuf;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::tensor::backend::Backend;
use clap::Parser;
use kimi_burn::data::{Mqar, MqarFiller, SeededRng, Task};
use kimi_burn::model::{Ffn, KimiForCausalLM};
use kimi_burn::nn::{BalancerKind, MoeStats};
use kimi_burn::KimiConfig;

/// The training backend of the replays: forwards on it feed the balancer.
type Ad = Autodiff<NdArray<f32>>;

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
    /// Sequences per replayed batch (`train_tiny --batch`), also the batch of `--oracle`.
    #[arg(long, default_value_t = 16)]
    replay_batch: usize,
    /// Held-out sequences the pooled (oracle) bias is set from (0: no oracle run).
    #[arg(long, default_value_t = 0)]
    oracle: usize,
    /// Fresh batches routed with the frozen oracle bias.
    #[arg(long, default_value_t = 64)]
    oracle_batches: usize,
}

fn main() {
    if let Err(msg) = run(&Args::parse()) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.oracle > 0
        && (args.replay_batch == 0 || args.oracle < args.replay_batch || args.oracle_batches == 0)
    {
        return Err(format!(
            "--oracle must be 0 or at least --replay-batch (positive), and --oracle-batches \
             positive, got --oracle {}, --replay-batch {}, --oracle-batches {}",
            args.oracle, args.replay_batch, args.oracle_batches
        ));
    }
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
            per_batch.resize(out.moe_stats().len(), Vec::new());
            pooled.resize(out.moe_stats().len(), Vec::new());
            margins.resize(out.moe_stats().len(), Vec::new());
            for (l, stats) in out.moe_stats().iter().enumerate() {
                per_batch[l].push(stats.max_violation);
                margins[l].extend(stats.median_margin);
                add_loads(&mut pooled[l], stats);
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
    if args.oracle > 0 {
        oracle(args, &config, &task)?;
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
    let model = load_training(args, config, BalancerKind::quantile())?;
    let mut rng = SeededRng::new(args.seed ^ 0x7e91a7);
    let mut per_layer: Vec<Vec<f32>> = Vec::new();
    for i in 0..args.replay {
        let stats = route_training(&model, task, args.replay_batch, &mut rng)?;
        model.update_balance();
        per_layer.resize(stats.len(), Vec::new());
        if i >= args.replay / 4 {
            for (v, s) in per_layer.iter_mut().zip(&stats) {
                v.push(s.max_violation);
            }
        }
    }
    for (l, v) in per_layer.iter().enumerate() {
        println!(
            "replayed QB, moe{l}, batch {}: {}",
            args.replay_batch,
            violation_summary(v)
        );
    }
    Ok(())
}

/// The checkpoint on the autodiff backend with `balancer`, so that its forwards count for the
/// balancer as training forwards do.
fn load_training(
    args: &Args,
    config: &KimiConfig,
    balancer: BalancerKind,
) -> Result<KimiForCausalLM<Ad>, String> {
    let mut config = config.clone();
    config.moe.balancer = balancer;
    load::<Ad>(args, &config)
}

/// Routes one fresh batch of `batch` sequences through `model` as a training forward (the
/// balancer counts it) and returns every MoE layer's load statistics.
fn route_training(
    model: &KimiForCausalLM<Ad>,
    task: &Mqar,
    batch: usize,
    rng: &mut SeededRng,
) -> Result<Vec<MoeStats>, String> {
    let data = task.sample_batch(batch, rng);
    let device = Default::default();
    let (ids, _) = data.to_tensors::<Ad>(&device);
    // Nothing is trained: a no-grad copy records no graph (it shares the balance state, so it
    // still counts), and the release frees what Burn keeps of every forward until a backward.
    let out = model
        .clone()
        .no_grad()
        .forward_with_stats(ids)
        .map_err(|e| e.to_string())?;
    let stats = out.moe_stats();
    kimi_burn::train::release_autodiff_bookkeeping::<Ad>(&device);
    Ok(stats)
}

/// `acc += stats.tokens_per_expert`, growing `acc` to the number of experts.
fn add_loads(acc: &mut Vec<u64>, stats: &MoeStats) {
    acc.resize(stats.tokens_per_expert.len(), 0);
    acc.iter_mut()
        .zip(&stats.tokens_per_expert)
        .for_each(|(a, b)| *a += b);
}

/// `"mean / max; above 0.3 in N of M"` for per-batch max violations.
fn violation_summary(v: &[f32]) -> String {
    let mean = v.iter().sum::<f32>() / v.len().max(1) as f32;
    let max = v.iter().copied().fold(0.0f32, f32::max);
    let over = v.iter().filter(|&&x| x > 0.3).count();
    format!("{mean:.3} / {max:.3}; above 0.3 in {over} of {}", v.len())
}

/// Fits every layer's bias on `--oracle` pooled held-out sequences, then routes
/// `--oracle-batches` fresh batches with that bias frozen and prints their per-batch violation.
///
/// The fit is `KimiForCausalLM::calibrate_balance` with [`ORACLE_SWEEPS`] sweeps over the same
/// sequences: each pools the QB histogram over all of them (counts add across batches, design
/// §3) and moves every bias half-way to QB's set (a full QB step overshoots when experts compete
/// for tokens crowded at the cut); the sweep whose pooled loads were the most even, over all
/// layers, gives the frozen bias.
fn oracle(args: &Args, config: &KimiConfig, task: &Mqar) -> Result<(), String> {
    // Fine bins: the deeper layers' tokens crowd within about 0.005 of their cut.
    let model = load_training(args, config, BalancerKind::Quantile { bins: 20_000 })?;
    let moes: Vec<_> = model
        .layers
        .iter()
        .filter_map(|layer| match &layer.ffn {
            Ffn::Moe(moe) => Some(moe),
            Ffn::Dense(_) => None,
        })
        .collect();
    let fit_batches = args.oracle / args.replay_batch;
    // The same fit sequences in every sweep.
    let mut rng = SeededRng::new(args.seed ^ 0xac1e);
    let device = Default::default();
    let fit: Vec<_> = (0..fit_batches)
        .map(|_| {
            task.sample_batch(args.replay_batch, &mut rng)
                .to_tensors::<Ad>(&device)
                .0
        })
        .collect();
    let pooled = model
        .calibrate_balance(&fit, ORACLE_SWEEPS)
        .map_err(|e| e.to_string())?
        .after;
    let mut rng = SeededRng::new(args.seed ^ 0x005e_ed0a);
    let mut per_layer: Vec<Vec<f32>> = vec![Vec::new(); moes.len()];
    for _ in 0..args.oracle_batches {
        let stats = route_training(&model, task, args.replay_batch, &mut rng)?;
        per_layer
            .iter_mut()
            .zip(&stats)
            .for_each(|(v, s)| v.push(s.max_violation));
    }
    for (l, v) in per_layer.iter().enumerate() {
        println!(
            "fitted bias, moe{l}, batch {}: {} (the {} fit sequences pooled: {:.3})",
            args.replay_batch,
            violation_summary(v),
            fit_batches * args.replay_batch,
            pooled.get(l).copied().unwrap_or(f32::NAN)
        );
    }
    Ok(())
}

/// Damped QB sweeps of the `--oracle` fit.
const ORACLE_SWEEPS: usize = 8;
