//! What `train_tiny` prints and writes as it goes: the banner, the progress bar, the per-step
//! log line, `metrics.csv` and the plots.

use std::collections::VecDeque;
use std::fmt::Write as _;

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use indicatif::{ProgressBar, ProgressStyle};
use kimi_burn::data::{Accuracy, Task};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::nn::MoeStats;

use crate::args::{reserved_tokens, Args, Filler, TaskKind};
use crate::{held_out_accuracy, plot, test_rng_of};

/// The run's first lines: task, model size, balancer, optimiser.
pub fn print_banner(args: &Args, config: &KimiConfig) {
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
pub fn progress_bar(steps: usize) -> Result<ProgressBar, String> {
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:28} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
        )
        .map_err(|e| e.to_string())?,
    );
    Ok(bar)
}

/// Appends one step's row of `metrics.csv` to `csv` (loss, accuracy, throughput, learning rate,
/// and per MoE layer the max violation, dead experts, the pooled window violation, the median margin and,
/// with `--reroute`, the rerouted violation) and returns the step's plot row.
pub fn log_step(
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

/// The header of `metrics.csv` for `moe_layers` MoE layers.
pub fn csv_header(moe_layers: usize, reroute: bool) -> String {
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

/// `--init`: the test accuracy of the loaded weights in full precision and, with `--qat`, with
/// the quantisation applied before any training (post-training quantisation).
pub fn report_init<B: AutodiffBackend>(
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
pub fn report(
    args: &Args,
    rows: &[plot::Row],
    (steps_run, train_time): (usize, f64),
    tokens_per_step: f64,
    test: &Accuracy,
    labelled: bool,
) {
    let last = rows.last().map_or(Vec::new(), |r| r.load.clone());
    let resumed = if steps_run < args.steps {
        format!(", {steps_run} of them in this run")
    } else {
        String::new()
    };
    println!(
        "finished {} steps{resumed} in {train_time:.0} s ({:.0} tokens/s)",
        args.steps,
        steps_run as f64 * tokens_per_step / train_time
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
pub fn window_violation(recent: &mut VecDeque<Vec<u64>>, stats: &MoeStats, window: usize) -> f32 {
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
