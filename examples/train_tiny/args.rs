//! The command line of `train_tiny` and its checks.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use kimi_burn::data::MqarFiller;
use kimi_burn::ops::quant::{MxSpec, QatConfig};

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum TaskKind {
    /// Multi-query associative recall (design §10).
    Mqar,
    /// Reproduce a random sequence reversed.
    Palindrome,
    /// Byte-level language modelling on the corpus that ships with the crate.
    Bytes,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Pattern {
    /// 3 KDA layers then 1 MLA layer, the last layer MLA (design §7).
    Hybrid,
    /// KDA in every layer.
    Kda,
    /// MLA in every layer.
    Mla,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Balancer {
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
pub enum Filler {
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
pub fn reserved_tokens(args: &Args) -> usize {
    args.filler_tokens.unwrap_or_else(|| {
        (3 * args.vocab / 8)
            .min((args.vocab / 2).saturating_sub(args.pairs))
            .max(1)
    })
}

impl Filler {
    pub fn mqar(self, reserved_tokens: usize) -> MqarFiller {
        match self {
            Self::Values => MqarFiller::Values,
            Self::Random => MqarFiller::Random,
            Self::Pad => MqarFiller::Pad,
            Self::Reserved => MqarFiller::Reserved(reserved_tokens),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Optimiser {
    /// Per-head Muon for hidden matrices, AdamW for the rest (design §8).
    Muon,
    /// AdamW for everything.
    Adamw,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum Qat {
    /// Full precision.
    None,
    /// K3's recipe: routed experts with MXFP4 (E2M1) weights and MXFP8 (E4M3) activations.
    Mxfp4,
    /// MXFP8 (E4M3) weights and activations.
    Mxfp8,
}

impl Qat {
    pub fn config(self) -> Option<QatConfig> {
        match self {
            Self::None => None,
            Self::Mxfp4 => Some(QatConfig::mxfp4()),
            Self::Mxfp8 => Some(QatConfig::new(Some(MxSpec::mxfp8()), Some(MxSpec::mxfp8()))),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum BackendKind {
    /// Burn's CPU backend.
    Ndarray,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
    /// Burn's wgpu backend under its fusion backend, as a Burn project with default features
    /// gets it (`burn::backend::Wgpu` there): chains of elementwise ops run as one launch (build
    /// with `--features wgpu`).
    WgpuFusion,
    /// Burn's CUDA backend under its fusion backend (build with `--features cuda`).
    CudaFusion,
}

/// Train the tiny Kimi hybrid on a synthetic task.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// The task.
    #[arg(long, value_enum, default_value_t = TaskKind::Mqar)]
    pub task: TaskKind,
    /// Optimiser steps.
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    /// Sequences per micro-batch and device (per step without --accum and --devices).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Micro-batches per optimiser step (gradient accumulation): each step trains on
    /// `--accum × --batch` sequences, one forward and backward per micro-batch, the gradients
    /// summed (each loss weighted by its share of the scored targets) and the QB histograms of
    /// all of them pooled into one balance update. The expert-load columns then describe the
    /// whole step's batch.
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Data-parallel replicas (build with `--features collective`): threads of this process,
    /// each on its own device (`--backend wgpu`: discrete GPU i, `cuda`: GPU i; `ndarray`: all on
    /// the CPU). Every step trains on `--batch × --accum × --devices × --nodes` sequences, each
    /// replica on its share; one burn-collective all-reduce per step sums the gradients, the QB
    /// histograms and the metrics, so every replica applies the same update and the same bias.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// With --devices: after every step, check that all replicas hold the same parameters and
    /// biases (a digest compared by one more small all-reduce); stop with an error if not.
    #[arg(long)]
    pub check_replicas: bool,
    /// Processes (nodes) training together through burn-collective's global mode, each with
    /// --devices replicas; start `examples/orchestrator` first (`scripts/two_process.sh` runs two
    /// on localhost). Every node writes the same results into its own --out.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// This process's index among the --nodes.
    #[arg(long, default_value_t = 0)]
    pub node: usize,
    /// With --nodes: the orchestrator's address.
    #[arg(long, default_value = "ws://localhost:3000")]
    pub orchestrator: String,
    /// With --nodes: the address the other nodes reach this one at (its port serves this node's
    /// tensors); default `ws://localhost:` followed by 3001 + --node.
    #[arg(long)]
    pub node_address: Option<String>,
    /// Tokens per sequence (palindrome: twice the reversed length).
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// MQAR key-value pairs per sequence.
    #[arg(long, default_value_t = 16)]
    pub pairs: usize,
    /// MQAR: what fills the positions that are neither pairs nor queries.
    #[arg(long, value_enum, default_value_t = Filler::Reserved)]
    pub filler: Filler,
    /// MQAR: how many reserved tokens `--filler reserved` draws from (keys then start there).
    /// Default: 3/8 of the vocabulary (96 of 256: 32 keys remain), at most what leaves --pairs
    /// keys.
    #[arg(long)]
    pub filler_tokens: Option<usize>,
    /// MQAR: the fraction of the steps trained first on the shortest sequences that hold the
    /// pairs (4·pairs tokens), with proportionally more sequences per step (the same tokens per
    /// step, four times the scored queries per token at 256/16). The test set keeps --seq-len.
    /// Other tasks ignore it.
    #[arg(long, default_value_t = 0.3)]
    pub short_fraction: f64,
    /// Vocabulary size of the task (bytes: always 256).
    #[arg(long, default_value_t = 256)]
    pub vocab: usize,
    /// Mixer pattern.
    #[arg(long, value_enum, default_value_t = Pattern::Hybrid)]
    pub pattern: Pattern,
    /// Load balancer of the MoE layers.
    #[arg(long, value_enum, default_value_t = Balancer::Qb)]
    pub balancer: Balancer,
    /// QB histogram bins (default 1000, design §3).
    #[arg(long)]
    pub qb_bins: Option<usize>,
    /// `--balancer qb-trend`: the newest step's weight β ∈ (0, 1] in the drift estimate.
    #[arg(long)]
    pub qb_smoothing: Option<f32>,
    /// QB balancers: when the short phase ends, fit every MoE layer's bias to fresh
    /// full-length sequences in this many sweeps before the first full-length step
    /// (`KimiForCausalLM::calibrate_balance`; 0: no calibration). The calibration batches are
    /// `--accum × --devices × --nodes` batches of `--batch` sequences from their own generator,
    /// the same on every replica.
    #[arg(long, default_value_t = 0)]
    pub calibrate: usize,
    /// Optimiser.
    #[arg(long, value_enum, default_value_t = Optimiser::Muon)]
    pub optimiser: Optimiser,
    /// Peak learning rate (linear warm-up over 5% of the steps, cosine decay to 10%).
    #[arg(long, default_value_t = 1e-2)]
    pub lr: f64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Ndarray)]
    pub backend: BackendKind,
    /// Random seed (data and initialisation).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// After every step, route the step's own batch again through the updated model with the
    /// updated balance biases and write its max violation per MoE layer to the CSV
    /// (`moeN_rerouted_violation`): the imbalance one optimiser step and one balancer update
    /// leave on the same tokens, free of batch-to-batch noise. Costs one more forward per step.
    #[arg(long)]
    pub reroute: bool,
    /// Steps whose expert loads are pooled for `moeN_window_violation` in the CSV: the max
    /// violation of the last N steps' tokens together (N = 4: 64 sequences of 256 tokens), the
    /// balance a larger global batch would see. 1 repeats the per-step column; over the first N
    /// steps it pools the steps so far.
    #[arg(long, default_value_t = 4)]
    pub load_window: usize,
    /// Held-out sequences for the final test accuracy (`--task bytes`: windows of the corpus's
    /// last tenth, which training never sees).
    #[arg(long, default_value_t = 256)]
    pub test_sequences: usize,
    /// Quantisation-aware training of the routed experts (MX formats, design §9).
    #[arg(long, value_enum, default_value_t = Qat::None)]
    pub qat: Qat,
    /// Write a checkpoint (model, optimiser state, balance biases, data position) into
    /// `--out/checkpoints` after every N steps, keeping the latest only; 0: never. A kill leaves
    /// the last complete one (see `kimi_burn::checkpoint`).
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: usize,
    /// Continue the run in `--out` from its latest checkpoint, with the same options (the
    /// checkpoint records those that shape the run, and other values are refused by name): it
    /// ends as the uninterrupted run would (bit for bit on the CPU), and `metrics.csv` keeps the
    /// rows before the checkpoint. Every node of `--nodes` must resume from a checkpoint of the
    /// same step (the first step checks it).
    #[arg(long)]
    pub resume: bool,
    /// Start from these weights (a `model.safetensors` of an earlier run with the same model
    /// options) instead of a random initialisation; the run first reports their test accuracy.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Output folder.
    #[arg(long, default_value = "runs/train_tiny")]
    pub out: PathBuf,
}

/// Rejects flag combinations that make no sense, naming the flags.
pub fn check_args(args: &Args) -> Result<(), String> {
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
