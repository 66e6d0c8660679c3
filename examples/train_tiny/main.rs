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
//! cargo run --release --features cuda --example train_tiny -- --backend cuda-fusion
//!                                  # on a GPU, under Burn's fusion backend (what `burn::backend::Cuda`
//!                                  # is in a project with Burn's default features)
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

mod args;
#[path = "../common/font.rs"]
mod font;
mod options;
#[cfg_attr(not(feature = "collective"), path = "no_parallel.rs")]
mod parallel;
mod plot;
mod report;
mod resume;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use clap::Parser;
use indicatif::ProgressBar;
use kimi_burn::checkpoint::{Checkpoints, LoopState};
use kimi_burn::config::hybrid_pattern;
use kimi_burn::data::{accuracy_from_logits, Accuracy, ByteLm, Mqar, Palindrome, SeededRng, Task};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::nn::{BalancerKind, MoeStats};
use kimi_burn::optim::{KimiOptimizerConfig, ParamRoles};
use kimi_burn::train::accumulate_gradients;

use args::{
    check_args, reserved_tokens, Args, BackendKind, Balancer, Optimiser, Pattern, TaskKind,
};
use report::{csv_header, log_step, print_banner, progress_bar, report, report_init};

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
        #[cfg(feature = "wgpu")]
        BackendKind::WgpuFusion => {
            type WgpuFusion = burn_fusion::Fusion<
                burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>,
            >;
            train::<burn::backend::Autodiff<WgpuFusion>>(
                args,
                match args.devices {
                    1 => vec![Default::default()],
                    n => (0..n).map(burn::backend::wgpu::WgpuDevice::DiscreteGpu).collect(),
                },
            )
        }
        #[cfg(feature = "cuda")]
        BackendKind::CudaFusion => {
            type CudaFusion = burn_fusion::Fusion<
                burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>,
            >;
            train::<burn::backend::Autodiff<CudaFusion>>(
                args,
                (0..args.devices).map(burn::backend::cuda::CudaDevice::new).collect(),
            )
        }
        #[allow(unreachable_patterns)]
        other => Err(format!(
            "--backend {other:?} needs the crate feature {}: cargo run --release --features {} --example train_tiny",
            feature(other),
            feature(other)
        )),
    }
}

/// The crate feature a backend needs.
#[allow(dead_code)]
fn feature(backend: BackendKind) -> &'static str {
    match backend {
        BackendKind::Ndarray => "ndarray",
        BackendKind::Wgpu | BackendKind::WgpuFusion => "wgpu",
        BackendKind::Cuda | BackendKind::CudaFusion => "cuda",
    }
}

/// The share of the byte corpus kept out of training for `--task bytes`' test accuracy.
const BYTES_HOLDOUT: f64 = 0.1;

/// The task trained on and the task the test accuracy is measured on.
type TrainAndTest = (Box<dyn Task>, Box<dyn Task>);

/// The training task.
fn make_task(args: &Args) -> Result<Box<dyn Task>, String> {
    Ok(make_tasks(args)?.0)
}

/// The training task and the task the test accuracy is measured on: for the generated tasks the
/// same generator (the test draws from another seed, [`test_rng_of`]); for `--task bytes` the
/// corpus's first 90% and its last 10%, so that no test window was seen in training.
fn make_tasks(args: &Args) -> Result<TrainAndTest, String> {
    if args.task == TaskKind::Bytes {
        let (train, test) = ByteLm::builtin(args.seq_len)
            .and_then(|task| task.split(BYTES_HOLDOUT))
            .map_err(|e| e.to_string())?;
        return Ok((Box::new(train), Box::new(test)));
    }
    Ok((generated_task(args)?, generated_task(args)?))
}

/// `--task mqar` or `--task palindrome`.
fn generated_task(args: &Args) -> Result<Box<dyn Task>, String> {
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
        TaskKind::Bytes => unreachable!("make_tasks splits the byte corpus"),
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
    let (task, test_task) = make_tasks(args)?;
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
            report_init(&model, &config, path, test_task.as_ref(), args, &device)?;
            model
        }
    };
    let model = if args.resume {
        let folder = latest_checkpoint(&Checkpoints::new(args.out.join("checkpoints")))?;
        let state = Checkpoints::state(&folder).map_err(|e| e.to_string())?;
        options::check_options(&state.extra["options"], args)?;
        if state.step >= args.steps {
            return Err(format!(
                "--resume: the checkpoint in {} is at step {}, --steps {} leaves nothing to train",
                folder.display(),
                state.step,
                args.steps
            ));
        }
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
        steps_run,
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
    let test = held_out_accuracy(&eval, test_task.as_ref(), args, &mut test_rng, &device)?;
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
        let again = held_out_accuracy(
            &back,
            test_task.as_ref(),
            args,
            &mut test_rng_of(args),
            &device,
        )?;
        println!(
            "packed MX export {} ({} bytes, f32 {} bytes): test accuracy {:.4} loaded back",
            packed.display(),
            file_len(&packed),
            file_len(&args.out.join("model.safetensors")),
            again.fraction().unwrap_or(0.0)
        );
        if (again.correct, again.total) != (test.correct, test.total) {
            return Err(format!(
                "the packed export {} scores {} of {} held-out targets loaded back, the model \
                 it was written from {} of {}",
                packed.display(),
                again.correct,
                again.total,
                test.correct,
                test.total
            ));
        }
    }
    let labelled = font::register_font();
    plot::write_plots(&args.out, &rows, labelled, args.load_window)?;

    report(
        args,
        &rows,
        (steps_run, train_time),
        tokens_per_step,
        &test,
        labelled,
    );
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
    /// Seconds of the steps this run took (after `--resume`, only the steps it resumed with).
    train_time: f64,
    /// The steps this run took.
    steps_run: usize,
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
    /// `--resume`: errors unless every replica (every node) resumes from the same step.
    same_step: Box<dyn Fn(usize) -> Result<(), String>>,
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
/// the same global batch of `--batch × --accum × --devices × --nodes` sequences and trains on
/// its shard; replica 0 logs, and returns what it trained. The others return `None`.
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
        // Nodes read their own checkpoints: one killed between two nodes' saves is a step
        // behind, and summing its gradients with the others' would mix two models.
        if let Some(dp) = &dp {
            (dp.same_step)(first_step)?;
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
            state.extra = serde_json::json!({
                "recent_loads": recent_loads,
                "options": options::run_options(args),
            });
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
        steps_run: args.steps - first_step,
    }))
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
