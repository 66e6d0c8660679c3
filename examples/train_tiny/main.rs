//! Trains the tiny Kimi hybrid (KDA 3:1 MLA, Stable LatentMoE with Quantile Balancing, SiTU-GLU,
//! Attention Residuals) on a synthetic task, on the CPU by default.
//!
//! ```text
//! cargo run --release --example train_tiny                       # MQAR, 16 pairs in 256 tokens
//! cargo run --release --example train_tiny -- --pattern kda      # KDA-only stack
//! cargo run --release --example train_tiny -- --balancer none    # see experts die
//! cargo run --release --example train_tiny -- --qat mxfp4 --init runs/train_tiny/model.safetensors \
//!     --steps 150 --lr 3e-3 --out runs/qat                          # QAT fine-tune, as K3 from SFT on
//! cargo run --release --example train_tiny -- --steps 600 --resume # continue a killed run
//! cargo run --release --example train_tiny -- --accum 4 --balancer qb-trend --calibrate 6 \
//!     --out runs/accum4_trend                  # 64 sequences per step, QB with drift compensation
//! cargo run --release --features collective --example train_tiny -- --devices 2 --batch 8
//!                                                                 # data parallel, 2 replicas
//! cargo run --release --example train_tiny -- --help
//! ```
//!
//! Writes into `--out` (default `runs/train_tiny`): `metrics.csv`, `loss_accuracy.png`,
//! `expert_load.png` (per step), `expert_load_window.png` (the last `--load-window` steps
//! pooled), `model.safetensors` and `config.json` (loadable with
//! `KimiForCausalLM::from_safetensors` and `KimiConfig::from_hf_config`); with `--qat`, also
//! `model.mx.safetensors`, the experts' weights packed in MX storage. Every `--checkpoint-every`
//! steps it writes `checkpoints/` (model, optimiser, data position), from which `--resume`
//! continues a killed run bit for bit (`scripts/kill_resume.sh` checks it).
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

#[path = "../common/font.rs"]
mod font;
#[cfg_attr(not(feature = "collective"), path = "no_parallel.rs")]
mod parallel;
mod plot;
mod resume;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kimi_burn::checkpoint::{Checkpoints, LoopState};
use kimi_burn::config::hybrid_pattern;
use kimi_burn::data::{
    accuracy_from_logits, Accuracy, ByteLm, Mqar, MqarFiller, Palindrome, SeededRng, Task,
};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::nn::{BalancerKind, MoeStats};
use kimi_burn::ops::quant::{MxSpec, QatConfig};
use kimi_burn::optim::{KimiOptimizerConfig, ParamRoles};
use kimi_burn::train::accumulate_gradients;

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum TaskKind {
    /// Multi-query associative recall (design §10).
    Mqar,
    /// Reproduce a random sequence reversed.
    Palindrome,
    /// Byte-level language modelling on the corpus that ships with the crate.
    Bytes,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Pattern {
    /// 3 KDA layers then 1 MLA layer, the last layer MLA (design §7).
    Hybrid,
    /// KDA in every layer.
    Kda,
    /// MLA in every layer.
    Mla,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Balancer {
    /// Quantile Balancing (design §3).
    Qb,
    /// Quantile Balancing with drift compensation (the crate's extension of design §3: QB's set
    /// plus a smoothed estimate of its change per step; see `BalancerKind::QuantileTrend`).
    QbTrend,
    /// The sign rule, γ = 1e-3.
    Sign,
    /// No balancing.
    None,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Filler {
    /// Random tokens from the value half of the vocabulary: never a key, so each query has one
    /// earlier occurrence, and as varied as random filler (diverse routing for the MoE layers).
    Values,
    /// Random tokens from the whole vocabulary (Zoology's default): a key can recur as filler
    /// between its pair and its query, which a small vocabulary makes common.
    Random,
    /// The pad token 0, never a key or a value (most tokens then look alike to the router).
    Pad,
    /// Random tokens from --filler-tokens reserved tokens that are never keys or values: a query
    /// has one earlier occurrence, filler is told apart by token identity, and the few distinct
    /// filler tokens keep the routing varied enough to balance.
    Reserved,
}

/// `--filler-tokens`, or its default: 3/8 of the vocabulary, leaving at least `pairs` keys.
fn reserved_tokens(args: &Args) -> usize {
    args.filler_tokens.unwrap_or_else(|| {
        (3 * args.vocab / 8)
            .min((args.vocab / 2).saturating_sub(args.pairs))
            .max(1)
    })
}

impl Filler {
    fn mqar(self, reserved_tokens: usize) -> MqarFiller {
        match self {
            Self::Values => MqarFiller::Values,
            Self::Random => MqarFiller::Random,
            Self::Pad => MqarFiller::Pad,
            Self::Reserved => MqarFiller::Reserved(reserved_tokens),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Optimiser {
    /// Per-head Muon for hidden matrices, AdamW for the rest (design §8).
    Muon,
    /// AdamW for everything.
    Adamw,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum Qat {
    /// Full precision.
    None,
    /// K3's recipe: routed experts with MXFP4 (E2M1) weights and MXFP8 (E4M3) activations.
    Mxfp4,
    /// MXFP8 (E4M3) weights and activations.
    Mxfp8,
}

impl Qat {
    fn config(self) -> Option<QatConfig> {
        match self {
            Self::None => None,
            Self::Mxfp4 => Some(QatConfig::mxfp4()),
            Self::Mxfp8 => Some(QatConfig::new(Some(MxSpec::mxfp8()), Some(MxSpec::mxfp8()))),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum BackendKind {
    /// Burn's CPU backend.
    Ndarray,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

/// Train the tiny Kimi hybrid on a synthetic task.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// The task.
    #[arg(long, value_enum, default_value_t = TaskKind::Mqar)]
    task: TaskKind,
    /// Optimiser steps.
    #[arg(long, default_value_t = 600)]
    steps: usize,
    /// Sequences per micro-batch and device (per step without --accum and --devices).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Micro-batches per optimiser step (gradient accumulation): each step trains on
    /// `--accum × --batch` sequences, one forward and backward per micro-batch, the gradients
    /// summed (each loss weighted by its share of the scored targets) and the QB histograms of
    /// all of them pooled into one balance update. The expert-load columns then describe the
    /// whole step's batch.
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// Data-parallel replicas (build with `--features collective`): threads of this process,
    /// each on its own device (`--backend wgpu`: discrete GPU i, `cuda`: GPU i; `ndarray`: all on
    /// the CPU). Every step trains on `--batch × --accum × --devices` sequences, each replica on
    /// its share; one burn-collective all-reduce per step sums the gradients, the QB histograms
    /// and the metrics, so every replica applies the same update and the same bias.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// With --devices: after every step, check that all replicas hold the same parameters and
    /// biases (a digest compared by one more small all-reduce); stop with an error if not.
    #[arg(long)]
    check_replicas: bool,
    /// Processes (nodes) training together through burn-collective's global mode, each with
    /// --devices replicas; start `examples/orchestrator` first (`scripts/two_process.sh` runs two
    /// on localhost). Every node writes the same results into its own --out.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// This process's index among the --nodes.
    #[arg(long, default_value_t = 0)]
    node: usize,
    /// With --nodes: the orchestrator's address.
    #[arg(long, default_value = "ws://localhost:3000")]
    orchestrator: String,
    /// With --nodes: the address the other nodes reach this one at (its port serves this node's
    /// tensors); default `ws://localhost:` followed by 3001 + --node.
    #[arg(long)]
    node_address: Option<String>,
    /// Tokens per sequence (palindrome: twice the reversed length).
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// MQAR key-value pairs per sequence.
    #[arg(long, default_value_t = 16)]
    pairs: usize,
    /// MQAR: what fills the positions that are neither pairs nor queries.
    #[arg(long, value_enum, default_value_t = Filler::Reserved)]
    filler: Filler,
    /// MQAR: how many reserved tokens `--filler reserved` draws from (keys then start there).
    /// Default: 3/8 of the vocabulary (96 of 256: 32 keys remain), at most what leaves --pairs
    /// keys.
    #[arg(long)]
    filler_tokens: Option<usize>,
    /// MQAR: the fraction of the steps trained first on the shortest sequences that hold the
    /// pairs (4·pairs tokens), with proportionally more sequences per step (the same tokens per
    /// step, four times the scored queries per token at 256/16). The test set keeps --seq-len.
    /// Other tasks ignore it.
    #[arg(long, default_value_t = 0.3)]
    short_fraction: f64,
    /// Vocabulary size of the task (bytes: always 256).
    #[arg(long, default_value_t = 256)]
    vocab: usize,
    /// Mixer pattern.
    #[arg(long, value_enum, default_value_t = Pattern::Hybrid)]
    pattern: Pattern,
    /// Load balancer of the MoE layers.
    #[arg(long, value_enum, default_value_t = Balancer::Qb)]
    balancer: Balancer,
    /// QB histogram bins (default 1000, design §3).
    #[arg(long)]
    qb_bins: Option<usize>,
    /// `--balancer qb-trend`: the newest step's weight β ∈ (0, 1] in the drift estimate.
    #[arg(long)]
    qb_smoothing: Option<f32>,
    /// QB balancers: when the short phase ends, fit every MoE layer's bias to fresh
    /// full-length sequences in this many sweeps before the first full-length step
    /// (`KimiForCausalLM::calibrate_balance`; 0: no calibration). The calibration batches are
    /// `--accum × --devices` batches of `--batch` sequences from their own generator, the same on
    /// every replica.
    #[arg(long, default_value_t = 0)]
    calibrate: usize,
    /// Optimiser.
    #[arg(long, value_enum, default_value_t = Optimiser::Muon)]
    optimiser: Optimiser,
    /// Peak learning rate (linear warm-up over 5% of the steps, cosine decay to 10%).
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Ndarray)]
    backend: BackendKind,
    /// Random seed (data and initialisation).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// After every step, route the step's own batch again through the updated model with the
    /// updated balance biases and write its max violation per MoE layer to the CSV
    /// (`moeN_rerouted_violation`): the imbalance one optimiser step and one balancer update
    /// leave on the same tokens, free of batch-to-batch noise. Costs one more forward per step.
    #[arg(long)]
    reroute: bool,
    /// Steps whose expert loads are pooled for `moeN_window_violation` in the CSV: the max
    /// violation of the last N steps' tokens together (N = 4: 64 sequences of 256 tokens), the
    /// balance a larger global batch would see. 1 repeats the per-step column; over the first N
    /// steps it pools the steps so far.
    #[arg(long, default_value_t = 4)]
    load_window: usize,
    /// Held-out sequences for the final test accuracy.
    #[arg(long, default_value_t = 256)]
    test_sequences: usize,
    /// Quantisation-aware training of the routed experts (MX formats, design §9).
    #[arg(long, value_enum, default_value_t = Qat::None)]
    qat: Qat,
    /// Write a checkpoint (model, optimiser state, balance biases, data position) into
    /// `--out/checkpoints` after every N steps, keeping the latest only; 0: never. A kill leaves
    /// the last complete one (see `kimi_burn::checkpoint`).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Continue the run in `--out` from its latest checkpoint, with the same options: it ends as
    /// the uninterrupted run would (bit for bit on the CPU), and `metrics.csv` keeps the rows
    /// before the checkpoint.
    #[arg(long)]
    resume: bool,
    /// Start from these weights (a `model.safetensors` of an earlier run with the same model
    /// options) instead of a random initialisation; the run first reports their test accuracy.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Output folder.
    #[arg(long, default_value = "runs/train_tiny")]
    out: PathBuf,
}

fn main() {
    let args = Args::parse();
    // Each step's freed buffers serve the next step instead of going back to the operating
    // system and being faulted in again (glibc; see `retain_freed_memory`).
    kimi_burn::ops::backend::retain_freed_memory();
    if let Err(msg) = dispatch(&args) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
}

fn dispatch(args: &Args) -> Result<(), String> {
    match args.backend {
        BackendKind::Ndarray => train::<burn::backend::Autodiff<burn::backend::NdArray<f32>>>(
            args,
            vec![Default::default(); args.devices],
        ),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => train::<burn::backend::Autodiff<burn::backend::Wgpu>>(
            args,
            match args.devices {
                1 => vec![Default::default()],
                n => (0..n).map(burn::backend::wgpu::WgpuDevice::DiscreteGpu).collect(),
            },
        ),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => train::<burn::backend::Autodiff<burn::backend::Cuda>>(
            args,
            (0..args.devices).map(burn::backend::cuda::CudaDevice::new).collect(),
        ),
        #[allow(unreachable_patterns)]
        other => Err(format!(
            "--backend {other:?} needs the crate feature of the same name: cargo run --release --features {} --example train_tiny",
            format!("{other:?}").to_lowercase()
        )),
    }
}

fn make_task(args: &Args) -> Result<Box<dyn Task>, String> {
    let task: Box<dyn Task> = match args.task {
        TaskKind::Mqar => Box::new(
            Mqar::new(args.vocab, args.seq_len, args.pairs)
                .map_err(|e| e.to_string())?
                .with_filler(args.filler.mqar(reserved_tokens(args)))
                .map_err(|e| e.to_string())?,
        ),
        TaskKind::Palindrome => {
            if args.seq_len < 2 || !args.seq_len.is_multiple_of(2) {
                return Err(format!(
                    "palindrome needs an even --seq-len >= 2, got {}",
                    args.seq_len
                ));
            }
            Box::new(Palindrome::new(args.vocab, args.seq_len / 2).map_err(|e| e.to_string())?)
        }
        TaskKind::Bytes => Box::new(ByteLm::builtin(args.seq_len).map_err(|e| e.to_string())?),
    };
    Ok(task)
}

/// The first phase of `--short-fraction`: the short MQAR, its batch size and its steps.
struct ShortPhase {
    task: Box<dyn Task>,
    batch: usize,
    steps: usize,
}

/// The short phase, when `--short-fraction` gives it steps.
fn short_phase(args: &Args) -> Result<Option<ShortPhase>, String> {
    if !(0.0..=1.0).contains(&args.short_fraction) {
        return Err(format!(
            "--short-fraction must lie in [0, 1], got {}",
            args.short_fraction
        ));
    }
    let steps = (args.short_fraction * args.steps as f64).round() as usize;
    if steps == 0 || args.task != TaskKind::Mqar {
        return Ok(None);
    }
    let short_len = 4 * args.pairs;
    let task = Mqar::new(args.vocab, short_len, args.pairs)
        .map_err(|e| e.to_string())?
        .with_filler(args.filler.mqar(reserved_tokens(args)))
        .map_err(|e| e.to_string())?;
    let batch = (args.batch * args.seq_len).div_ceil(short_len);
    Ok(Some(ShortPhase {
        task: Box::new(task),
        batch,
        steps,
    }))
}

fn model_config(args: &Args, vocab: usize) -> Result<KimiConfig, String> {
    let mut c = KimiConfig::tiny();
    c.vocab_size = vocab;
    c.full_attn_layers = match args.pattern {
        Pattern::Hybrid => hybrid_pattern(c.num_hidden_layers),
        Pattern::Kda => vec![],
        Pattern::Mla => (0..c.num_hidden_layers).collect(),
    };
    c.moe.balancer = match args.balancer {
        Balancer::Qb => BalancerKind::Quantile {
            bins: args.qb_bins.unwrap_or(1000),
        },
        Balancer::QbTrend => BalancerKind::QuantileTrend {
            bins: args.qb_bins.unwrap_or(1000),
            smoothing: args.qb_smoothing.unwrap_or(0.3),
        },
        Balancer::Sign => BalancerKind::Sign { gamma: 1e-3 },
        Balancer::None => BalancerKind::None,
    };
    c.moe.qat = args.qat.config();
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

fn learning_rate(args: &Args, step: usize) -> f64 {
    let warmup = (args.steps / 20).max(1);
    if step < warmup {
        return args.lr * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (args.steps - warmup).max(1) as f64;
    args.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

fn train<B: AutodiffBackend>(args: &Args, devices: Vec<B::Device>) -> Result<(), String> {
    check_args(args)?;
    let task = make_task(args)?;
    let config = model_config(args, task.vocab_size())?;
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let device = devices[0].clone();
    B::seed(&device, args.seed);
    let model: KimiForCausalLM<B> = match &args.init {
        None => config.try_init(&device).map_err(|e| e.to_string())?,
        Some(path) => {
            let model = KimiForCausalLM::from_safetensors(&config, path, &device)
                .map_err(|e| format!("--init {}: {e}", path.display()))?;
            report_init(&model, &config, path, task.as_ref(), args, &device)?;
            model
        }
    };
    let model = if args.resume {
        let folder = latest_checkpoint(&Checkpoints::new(args.out.join("checkpoints")))?;
        let state = Checkpoints::state(&folder).map_err(|e| e.to_string())?;
        println!("resuming from {} (step {})", folder.display(), state.step);
        Checkpoints::load_model(&folder, model, &device).map_err(|e| e.to_string())?
    } else {
        model
    };
    print_banner(args, &config);
    let Trained {
        model,
        rows,
        train_time,
    } = if devices.len() * args.nodes == 1 {
        train_loop(args, model, &device, None)?.ok_or("the only replica reports")?
    } else {
        parallel::train_replicas(args, &model, &devices)?
    };
    let tokens_per_step =
        (args.batch * args.accum * args.devices * args.nodes * task.seq_len()) as f64;
    let mut test_rng = test_rng_of(args);

    // Held-out sequences, evaluated without autodiff.
    let eval = model.valid();
    let test = held_out_accuracy(&eval, task.as_ref(), args, &mut test_rng, &device)?;
    let write = |name: &str, text: &str| {
        let path = args.out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write(
        "config.json",
        &serde_json::to_string_pretty(&config.to_hf_json()).map_err(|e| e.to_string())?,
    )?;
    eval.save_safetensors(args.out.join("model.safetensors"))
        .map_err(|e| e.to_string())?;
    if config.moe.qat.is_some() {
        let packed = args.out.join("model.mx.safetensors");
        eval.save_safetensors_packed(&packed)
            .map_err(|e| e.to_string())?;
        // The packed file must give the model that was evaluated.
        let back = KimiForCausalLM::<B::InnerBackend>::from_safetensors(&config, &packed, &device)
            .map_err(|e| e.to_string())?;
        let again = held_out_accuracy(&back, task.as_ref(), args, &mut test_rng_of(args), &device)?;
        println!(
            "packed MX export {} ({} bytes, f32 {} bytes): test accuracy {:.4} loaded back",
            packed.display(),
            file_len(&packed),
            file_len(&args.out.join("model.safetensors")),
            again.fraction().unwrap_or(0.0)
        );
    }
    let labelled = font::register_font();
    plot::write_plots(&args.out, &rows, labelled, args.load_window)?;

    report(args, &rows, train_time, tokens_per_step, &test, labelled);
    Ok(())
}

/// `--resume`: the latest checkpoint under `--out`, or an error saying there is none.
fn latest_checkpoint(checkpoints: &Checkpoints) -> Result<PathBuf, String> {
    checkpoints
        .latest()
        .map_err(|e| format!("--resume: {e}"))?
        .ok_or_else(|| {
            format!(
                "--resume: no checkpoint in {} (written every --checkpoint-every steps)",
                checkpoints.dir().display()
            )
        })
}

/// What the reporting replica's training loop hands back.
struct Trained<B: AutodiffBackend> {
    model: KimiForCausalLM<B>,
    rows: Vec<plot::Row>,
    train_time: f64,
}

/// One replica's data-parallel membership in the training loop (see `parallel.rs`).
struct Replication<B: AutodiffBackend> {
    /// This replica's index among all replicas (its shard of the global batch).
    rank: usize,
    /// Replicas in all processes.
    replicas: usize,
    /// Whether this replica logs and writes `--out`: the first of each process.
    reports: bool,
    /// Sums the gradients, the balance counts and the given values over the replicas.
    sync: SyncFn<B>,
    /// `--check-replicas`: errors unless every replica holds the same parameters and biases.
    check: Option<CheckFn<B>>,
}

type SyncFn<B> = Box<
    dyn FnMut(
        &KimiForCausalLM<B>,
        GradientsParams,
        &[f32],
    ) -> Result<(GradientsParams, Vec<f32>), String>,
>;
type CheckFn<B> = Box<dyn Fn(&KimiForCausalLM<B>) -> Result<(), String>>;

/// The training loop of one replica (the only one without `--devices`): every replica samples
/// the same global batch of `--batch × --accum × --devices` sequences and trains on its shard;
/// replica 0 logs, and returns what it trained. The others return `None`.
fn train_loop<B: AutodiffBackend>(
    args: &Args,
    mut model: KimiForCausalLM<B>,
    device: &B::Device,
    mut dp: Option<Replication<B>>,
) -> Result<Option<Trained<B>>, String> {
    let task = make_task(args)?;
    let short = short_phase(args)?;
    let (rank, replicas, reporting) = dp
        .as_ref()
        .map_or((0, 1, true), |d| (d.rank, d.replicas, d.reports));
    let config = model.config().clone();
    let roles = match args.optimiser {
        Optimiser::Muon => model.param_roles(),
        Optimiser::Adamw => ParamRoles::adamw_only(),
    };
    let mut optim = KimiOptimizerConfig::new()
        .init(&model, roles)
        .map_err(|e| e.to_string())?;
    let mut rng = SeededRng::new(args.seed);
    let moe_layers = config.num_hidden_layers - config.first_k_dense_replace;
    let mut csv = csv_header(moe_layers, args.reroute);
    let mut recent_loads: Vec<VecDeque<Vec<u64>>> = vec![VecDeque::new(); moe_layers];
    let mut rows = Vec::new();
    let checkpoints = Checkpoints::new(args.out.join("checkpoints"));
    let mut first_step = 0;
    // Appended row by row as the run goes, so a run stopped early keeps its metrics.
    let metrics_path = args.out.join("metrics.csv");
    if args.resume {
        let folder = latest_checkpoint(&checkpoints)?;
        let state = Checkpoints::state(&folder).map_err(|e| e.to_string())?;
        optim = Checkpoints::load_optimizer(&folder, optim, device).map_err(|e| e.to_string())?;
        rng = state.rng();
        first_step = state.step;
        if reporting {
            recent_loads = serde_json::from_value(state.extra["recent_loads"].clone())
                .map_err(|e| format!("--resume: {}: {e}", folder.display()))?;
            let (kept, before) =
                resume::metrics_before(&metrics_path, &csv, first_step, moe_layers)?;
            // Replaced in one rename, so a kill now still leaves the rows before the checkpoint.
            let tmp = args.out.join("metrics.csv.tmp");
            std::fs::write(&tmp, kept)
                .and_then(|()| std::fs::rename(&tmp, &metrics_path))
                .map_err(|e| format!("cannot write {}: {e}", metrics_path.display()))?;
            csv.clear();
            rows = before;
        }
    }
    let mut metrics = if reporting {
        let file = if args.resume {
            std::fs::OpenOptions::new().append(true).open(&metrics_path)
        } else {
            std::fs::File::create(&metrics_path)
        };
        Some(file.map_err(|e| format!("cannot open {}: {e}", metrics_path.display()))?)
    } else {
        None
    };
    let bar = if reporting {
        progress_bar(args.steps)?
    } else {
        ProgressBar::hidden()
    };
    bar.set_position(first_step as u64);
    let started = Instant::now();
    let tokens_per_step = (args.batch * args.accum * replicas * task.seq_len()) as f64;
    let mut window = Accuracy::default();
    for step in first_step..args.steps {
        let sequences = args.accum * replicas;
        let batch = match &short {
            Some(phase) if step < phase.steps => {
                phase.task.sample_batch(phase.batch * sequences, &mut rng)
            }
            _ => task.sample_batch(args.batch * sequences, &mut rng),
        };
        if args.calibrate > 0 && short.as_ref().is_some_and(|phase| phase.steps == step) {
            calibrate(args, &model, task.as_ref(), sequences, reporting, device)?;
        }
        let shard = if replicas > 1 {
            batch
                .split(replicas)
                .map_err(|e| e.to_string())?
                .swap_remove(rank)
        } else {
            batch.clone()
        };
        let local = accumulate_gradients(&model, &shard, args.accum, batch.scored(), device)
            .map_err(|e| e.to_string())?;
        let margins = local.median_margins.clone();
        let (grads, loss_value, acc, loads) = match dp.as_mut() {
            None => (local.grads, local.loss, local.accuracy, local.loads),
            Some(dp) => {
                let mut extra = vec![
                    local.loss as f32,
                    local.accuracy.correct as f32,
                    local.accuracy.total as f32,
                ];
                extra.extend(local.loads.iter().flatten().map(|&l| l as f32));
                let (grads, summed) = (dp.sync)(&model, local.grads, &extra)?;
                let acc = Accuracy {
                    correct: summed[1] as usize,
                    total: summed[2] as usize,
                };
                let mut at = 3;
                let loads = local
                    .loads
                    .iter()
                    .map(|l| {
                        let pooled = summed[at..at + l.len()].iter().map(|&c| c as u64).collect();
                        at += l.len();
                        pooled
                    })
                    .collect();
                (grads, f64::from(summed[0]), acc, loads)
            }
        };
        if !loss_value.is_finite() {
            return Err(format!(
                "the loss became {loss_value} at step {step}; try a smaller --lr"
            ));
        }
        let lr = learning_rate(args, step);
        model = optim.step(lr, model, grads);
        model.update_balance();
        if let Some(check) = dp.as_ref().and_then(|d| d.check.as_ref()) {
            check(&model).map_err(|e| format!("step {step}: {e}"))?;
        }
        let Some(metrics) = metrics.as_mut() else {
            continue;
        };
        let moe_stats: Vec<MoeStats> = loads
            .into_iter()
            .zip(&margins)
            .map(|(l, &m)| MoeStats {
                median_margin: m.filter(|_| replicas == 1),
                ..MoeStats::from_loads(l)
            })
            .collect();
        let rerouted = if args.reroute {
            rerouted_violations(&model, &batch, device)?
        } else {
            Vec::new()
        };

        window.correct += acc.correct;
        window.total += acc.total;
        let tps =
            (step + 1 - first_step) as f64 * tokens_per_step / started.elapsed().as_secs_f64();
        let row = log_step(
            &mut csv,
            &mut recent_loads,
            (step, loss_value, lr, tps),
            &acc,
            &moe_stats,
            &rerouted,
            args.load_window,
        );
        std::io::Write::write_all(metrics, csv.as_bytes())
            .map_err(|e| format!("cannot write {}: {e}", metrics_path.display()))?;
        csv.clear();
        let load = row.load.clone();
        rows.push(row);
        let worst = load.iter().map(|l| l.0).fold(0.0, f64::max);
        let dead: usize = load.iter().map(|l| l.1).sum();
        bar.set_message(format!(
            "loss {loss_value:.3} acc {:.3} | max violation {worst:.2} dead {dead} | {tps:.0} tok/s",
            window.fraction().unwrap_or(0.0)
        ));
        if step % 10 == 9 {
            window = Accuracy::default();
        }
        bar.inc(1);
        if args.checkpoint_every > 0
            && (step + 1) % args.checkpoint_every == 0
            && step + 1 < args.steps
        {
            let mut state = LoopState::new(step + 1, &rng);
            state.extra = serde_json::json!({ "recent_loads": recent_loads });
            checkpoints
                .save(&model, &optim, &state)
                .map_err(|e| format!("checkpoint after step {}: {e}", step + 1))?;
        }
    }
    bar.finish();
    let train_time = started.elapsed().as_secs_f64();
    Ok(reporting.then_some(Trained {
        model,
        rows,
        train_time,
    }))
}

/// The run's first lines: task, model size, balancer, optimiser.
fn print_banner(args: &Args, config: &KimiConfig) {
    println!(
    "kimi-burn train_tiny: {:?} on {:?}, {} layers ({:?}), {} params ({} active), {:?} balancer, {:?}",
    args.task,
    args.backend,
    config.num_hidden_layers,
    args.pattern,
    config.num_params(),
    config.active_params(),
    args.balancer,
    args.optimiser
);
    if let Some(q) = config.moe.qat {
        println!(
            "QAT: routed experts, weights {:?}, activations {:?}",
            q.weights, q.activations
        );
    }
    if args.task == TaskKind::Mqar {
        let filler = match args.filler {
            Filler::Reserved => format!("reserved filler ({} tokens)", reserved_tokens(args)),
            other => format!("{other:?} filler").to_lowercase(),
        };
        let mut batch = format!("batch {}", args.batch);
        if args.accum > 1 {
            batch += &format!(" × {} micro-batches", args.accum);
        }
        if args.devices * args.nodes > 1 {
            batch += &format!(" × {} replicas", args.devices * args.nodes);
        }
        println!(
            "MQAR: vocabulary {}, {} tokens, {} pairs, {filler}; {batch}, {} steps, lr {}",
            args.vocab, args.seq_len, args.pairs, args.steps, args.lr
        );
    }
}

/// The progress bar over `steps` steps.
fn progress_bar(steps: usize) -> Result<ProgressBar, String> {
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:28} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .map_err(|e| e.to_string())?,
    );
    Ok(bar)
}

/// `--calibrate`: fits the balance biases to `batches` fresh batches of the full-length task
/// (their own generator, so the training data stays where it was and every replica routes the
/// same sequences).
fn calibrate<B: AutodiffBackend>(
    args: &Args,
    model: &KimiForCausalLM<B>,
    task: &dyn Task,
    batches: usize,
    reporting: bool,
    device: &B::Device,
) -> Result<(), String> {
    let mut rng = SeededRng::new(args.seed ^ CALIBRATION_SEED);
    let ids: Vec<_> = (0..batches)
        .map(|_| {
            task.sample_batch(args.batch, &mut rng)
                .to_tensors::<B>(device)
                .0
        })
        .collect();
    let fit = model
        .calibrate_balance(&ids, args.calibrate)
        .map_err(|e| e.to_string())?;
    if reporting {
        let show = |v: &[f32]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>();
        eprintln!(
            "calibrated the balance biases to {} full-length sequences: pooled max violation {:?} -> {:?}",
            batches * args.batch,
            show(&fit.before),
            show(&fit.after)
        );
    }
    Ok(())
}

/// Mixed into `--seed` for `--calibrate`'s sequences.
const CALIBRATION_SEED: u64 = 0xca1b;

/// `--reroute`: the max violation per MoE layer of this step's batch routed again after the
/// optimiser step and the balancer update (on the inference backend: the balancer does not count
/// this pass).
fn rerouted_violations<B: AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    batch: &kimi_burn::data::Batch,
    device: &B::Device,
) -> Result<Vec<f32>, String> {
    let (inputs, _) = batch.to_tensors(device);
    let again = model
        .valid()
        .forward_with_stats(inputs)
        .map_err(|e| e.to_string())?;
    Ok(again.moe_stats().iter().map(|s| s.max_violation).collect())
}

/// Appends one step's row of `metrics.csv` to `csv` (loss, accuracy, throughput, learning rate,
/// and per MoE layer the max violation, dead experts, the pooled window violation, the median margin and,
/// with `--reroute`, the rerouted violation) and returns the step's plot row.
fn log_step(
    csv: &mut String,
    recent_loads: &mut [VecDeque<Vec<u64>>],
    (step, loss_value, lr, tps): (usize, f64, f64, f64),
    acc: &Accuracy,
    stats: &[MoeStats],
    rerouted: &[f32],
    load_window: usize,
) -> plot::Row {
    let load: Vec<(f64, usize)> = stats
        .iter()
        .map(|s| (s.max_violation as f64, s.dead_experts))
        .collect();
    let _ = write!(
        csv,
        "{step},{loss_value:.6},{:.6},{tps:.1},{lr:.3e}",
        acc.fraction().unwrap_or(0.0)
    );
    for (v, d) in &load {
        let _ = write!(csv, ",{v:.4},{d}");
    }
    let pooled: Vec<f64> = recent_loads
        .iter_mut()
        .zip(stats)
        .map(|(recent, stats)| window_violation(recent, stats, load_window) as f64)
        .collect();
    for v in &pooled {
        let _ = write!(csv, ",{v:.4}");
    }
    for stats in stats {
        // Empty where a fused kernel selected on the device (the scores stayed there).
        match stats.median_margin {
            Some(m) => {
                let _ = write!(csv, ",{m:.5}");
            }
            None => csv.push(','),
        }
    }
    for v in rerouted {
        let _ = write!(csv, ",{v:.4}");
    }
    csv.push('\n');
    plot::Row {
        step,
        loss: loss_value,
        accuracy: acc.fraction().unwrap_or(0.0),
        load,
        window: pooled,
    }
}

/// Rejects flag combinations that make no sense, naming the flags.
fn check_args(args: &Args) -> Result<(), String> {
    if args.steps == 0 || args.batch == 0 || args.accum == 0 || args.devices == 0 {
        return Err(format!(
            "--steps, --batch, --accum and --devices must be positive, got {}, {}, {} and {}",
            args.steps, args.batch, args.accum, args.devices
        ));
    }
    if args.resume && args.init.is_some() {
        return Err(
            "--resume continues from the checkpoint, --init starts afresh: not both".into(),
        );
    }
    if args.nodes == 0 || args.node >= args.nodes {
        return Err(format!(
            "--node {} of --nodes {}: needs 0 <= node < nodes",
            args.node, args.nodes
        ));
    }
    if args.check_replicas && args.devices * args.nodes == 1 {
        return Err("--check-replicas compares the replicas of --devices or --nodes > 1".into());
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr must be finite and positive, got {}", args.lr));
    }
    if args.load_window == 0 {
        return Err(
            "--load-window must be at least 1 (1 repeats the per-step column), got 0".into(),
        );
    }
    if args.filler_tokens.is_some()
        && (args.task != TaskKind::Mqar || args.filler != Filler::Reserved)
    {
        return Err("--filler-tokens only applies to --task mqar with --filler reserved".into());
    }
    let quantile = matches!(args.balancer, Balancer::Qb | Balancer::QbTrend);
    if let (Some(bins), false) = (args.qb_bins, quantile) {
        return Err(format!(
            "--qb-bins {bins} only applies to --balancer qb or qb-trend, got --balancer {:?}",
            args.balancer
        ));
    }
    if let (Some(beta), false) = (
        args.qb_smoothing,
        matches!(args.balancer, Balancer::QbTrend),
    ) {
        return Err(format!(
            "--qb-smoothing {beta} only applies to --balancer qb-trend, got --balancer {:?}",
            args.balancer
        ));
    }
    if args.calibrate > 0 && !quantile {
        return Err(format!(
            "--calibrate {} needs --balancer qb or qb-trend, got --balancer {:?}",
            args.calibrate, args.balancer
        ));
    }
    let short_steps = (args.short_fraction * args.steps as f64).round() as usize;
    if args.calibrate > 0 && (short_steps == 0 || args.task != TaskKind::Mqar) {
        return Err(format!(
            "--calibrate {} calibrates at the end of MQAR's short phase, and this run has none \
             (--task {:?}, --short-fraction {} of {} steps)",
            args.calibrate, args.task, args.short_fraction, args.steps
        ));
    }
    Ok(())
}

/// The header of `metrics.csv` for `moe_layers` MoE layers.
fn csv_header(moe_layers: usize, reroute: bool) -> String {
    let mut csv = String::from("step,loss,accuracy,tokens_per_s,lr");
    for l in 0..moe_layers {
        let _ = write!(csv, ",moe{l}_max_violation,moe{l}_dead_experts");
    }
    for l in 0..moe_layers {
        let _ = write!(csv, ",moe{l}_window_violation");
    }
    for l in 0..moe_layers {
        let _ = write!(csv, ",moe{l}_median_margin");
    }
    if reroute {
        for l in 0..moe_layers {
            let _ = write!(csv, ",moe{l}_rerouted_violation");
        }
    }
    csv.push('\n');
    csv
}

/// The recall accuracy on `args.test_sequences` fresh sequences, without autodiff.
fn held_out_accuracy<B: Backend>(
    eval: &KimiForCausalLM<B>,
    task: &dyn Task,
    args: &Args,
    test_rng: &mut SeededRng,
    device: &B::Device,
) -> Result<Accuracy, String> {
    let mut test = Accuracy::default();
    let mut left = args.test_sequences;
    while left > 0 {
        let n = left.min(args.batch);
        let batch = task.sample_batch(n, test_rng);
        let (inputs, _) = batch.to_tensors(device);
        let acc = accuracy_from_logits(eval.forward(inputs), &batch.targets)
            .map_err(|e| e.to_string())?;
        test.correct += acc.correct;
        test.total += acc.total;
        left -= n;
    }
    Ok(test)
}

/// The held-out test sequences' generator (the same sequences for every evaluation of a run).
fn test_rng_of(args: &Args) -> SeededRng {
    SeededRng::new(args.seed ^ 0x5eed_7e57)
}

fn file_len(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// `--init`: the test accuracy of the loaded weights in full precision and, with `--qat`, with
/// the quantisation applied before any training (post-training quantisation).
fn report_init<B: AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    config: &KimiConfig,
    path: &std::path::Path,
    task: &dyn Task,
    args: &Args,
    device: &B::Device,
) -> Result<(), String> {
    let mut plain = config.clone();
    plain.moe.qat = None;
    let full = KimiForCausalLM::<B::InnerBackend>::from_safetensors(&plain, path, device)
        .map_err(|e| e.to_string())?;
    let acc = held_out_accuracy(&full, task, args, &mut test_rng_of(args), device)?;
    println!(
        "--init {}: test accuracy {:.4} in full precision",
        path.display(),
        acc.fraction().unwrap_or(0.0)
    );
    if config.moe.qat.is_some() {
        let acc = held_out_accuracy(&model.valid(), task, args, &mut test_rng_of(args), device)?;
        println!(
            "  with {:?} quantisation before training: {:.4}",
            args.qat,
            acc.fraction().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// The closing summary on stdout.
fn report(
    args: &Args,
    rows: &[plot::Row],
    train_time: f64,
    tokens_per_step: f64,
    test: &Accuracy,
    labelled: bool,
) {
    let last = rows.last().map_or(Vec::new(), |r| r.load.clone());
    println!(
        "finished {} steps in {train_time:.0} s ({:.0} tokens/s)",
        args.steps,
        args.steps as f64 * tokens_per_step / train_time
    );
    println!(
        "test accuracy {:.4} on {} scored tokens of {} held-out sequences",
        test.fraction().unwrap_or(0.0),
        test.total,
        args.test_sequences
    );
    println!(
        "final expert load: max violation {:?}, dead experts {:?}",
        last.iter()
            .map(|l| format!("{:.2}", l.0))
            .collect::<Vec<_>>(),
        last.iter().map(|l| l.1).collect::<Vec<_>>()
    );
    println!("wrote metrics.csv, loss_accuracy.png, expert_load.png, expert_load_window.png, model.safetensors and config.json to {}", args.out.display());
    if !labelled {
        println!("(no TrueType font found: the plots have no axis labels)");
    }
}

/// Adds this step's expert loads to the last `window` steps' (`recent`) and returns the max
/// violation of the pooled loads.
fn window_violation(recent: &mut VecDeque<Vec<u64>>, stats: &MoeStats, window: usize) -> f32 {
    recent.push_back(stats.tokens_per_expert.clone());
    while recent.len() > window {
        recent.pop_front();
    }
    let mut pooled = vec![0u64; stats.tokens_per_expert.len()];
    for loads in recent.iter() {
        for (p, &l) in pooled.iter_mut().zip(loads) {
            *p += l;
        }
    }
    MoeStats::from_loads(pooled).max_violation
}
