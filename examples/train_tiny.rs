//! Trains a tiny Stable LatentMoE language model on the CPU and shows Quantile Balancing at work.
//!
//! ```text
//! cargo run --release --example train_tiny -- --steps 300
//! ```
//!
//! The model is `embedding → Stable LatentMoE (SiTU-GLU experts, QB) → lm_head`, trained with AdamW
//! on a synthetic next-token task whose answer depends on the current token only, so a token-wise
//! FFN can solve it. The full hybrid model (KDA + MLA) and the MQAR task replace it once they land.

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kimi_burn::nn::{BalancerKind, LatentMoe, LatentMoeConfig, MoeLayout, MoeStats};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[derive(Parser, Debug)]
#[command(about = "Train a tiny Stable LatentMoE model on the CPU")]
struct Args {
    /// Optimiser steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Vocabulary size (at least 8).
    #[arg(long, default_value_t = 256)]
    vocab: usize,
    /// Load balancer: qb, sign or none.
    #[arg(long, default_value = "qb")]
    balancer: String,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Module, Debug)]
struct TinyMoeLm<B: Backend> {
    embed: Embedding<B>,
    moe: LatentMoe<B>,
    head: Linear<B>,
}

impl<B: Backend> TinyMoeLm<B> {
    fn forward(&self, ids: Tensor<B, 2, Int>) -> (Tensor<B, 3>, MoeStats) {
        let x = self.embed.forward(ids);
        let out = self.moe.forward(x.clone());
        (self.head.forward(x.add(out.output)), out.stats)
    }
}

type B = Autodiff<NdArray<f32>>;

fn main() {
    let args = Args::parse();
    if let Err(msg) = run(&args) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.vocab < 8 || args.steps == 0 || args.batch == 0 || args.seq_len == 0 {
        return Err(format!(
            "need --vocab >= 8 and positive --steps/--batch/--seq-len, got vocab {}, steps {}, batch {}, seq-len {}",
            args.vocab, args.steps, args.batch, args.seq_len
        ));
    }
    let balancer = match args.balancer.as_str() {
        "qb" => BalancerKind::quantile(),
        "sign" => BalancerKind::Sign { gamma: 1e-3 },
        "none" => BalancerKind::None,
        other => {
            return Err(format!(
                "--balancer must be qb, sign or none, got {other:?}"
            ))
        }
    };
    let device = Default::default();
    B::seed(&device, args.seed);
    let d = 64;
    let moe = LatentMoeConfig::new(d, 8, 2, 64)
        .with_layout(MoeLayout::StableLatent { dim: 32 })
        .with_n_shared(1)
        .with_balancer(balancer)
        .try_init(&device)
        .map_err(|e| e.to_string())?;
    let mut model = TinyMoeLm::<B> {
        embed: EmbeddingConfig::new(args.vocab, d).init(&device),
        moe,
        head: LinearConfig::new(d, args.vocab).init(&device),
    };
    let mut optim = AdamWConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let table: Vec<i64> = (0..args.vocab)
        .map(|_| rng.random_range(0..args.vocab as i64))
        .collect();

    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .map_err(|e| e.to_string())?,
    );
    let started = std::time::Instant::now();
    let (mut loss_v, mut acc, mut stats) = (f32::NAN, 0.0, MoeStats::default());
    for _ in 0..args.steps {
        let tokens: Vec<i64> = (0..args.batch * args.seq_len)
            .map(|_| rng.random_range(0..args.vocab as i64))
            .collect();
        let targets: Vec<i64> = tokens.iter().map(|&t| table[t as usize]).collect();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(tokens, [args.batch, args.seq_len]),
            &device,
        );
        let tgt = Tensor::<B, 1, Int>::from_data(
            TensorData::new(targets, [args.batch * args.seq_len]),
            &device,
        );
        let (logits, s) = model.forward(ids);
        let logits = logits.reshape([args.batch * args.seq_len, args.vocab]);
        let pred = logits
            .clone()
            .argmax(1)
            .reshape([args.batch * args.seq_len]);
        acc = pred.equal(tgt.clone()).int().sum().into_scalar() as f32
            / (args.batch * args.seq_len) as f32;
        let loss = loss_fn.forward(logits, tgt);
        loss_v = loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
        model.moe.update_balance();
        stats = s;
        let tps = (bar.position() + 1) as f64 * (args.batch * args.seq_len) as f64
            / started.elapsed().as_secs_f64();
        bar.set_message(format!(
            "loss {loss_v:.3} acc {acc:.3} max-violation {:.2} dead {} | {tps:.0} tok/s",
            stats.max_violation, stats.dead_experts
        ));
        bar.inc(1);
    }
    bar.finish();
    let _ = model.valid();
    println!(
        "done: {} steps in {:.1}s, final loss {loss_v:.3}, accuracy {acc:.3}, expert loads {:?} (max violation {:.2}, dead {})",
        args.steps,
        started.elapsed().as_secs_f64(),
        stats.tokens_per_expert,
        stats.max_violation,
        stats.dead_experts
    );
    Ok(())
}
