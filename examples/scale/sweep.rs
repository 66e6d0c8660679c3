//! The scaling sweep behind `examples/scale`: timed training steps of the presets of
//! [`KimiConfig::scaling_presets`] at several sequence lengths on one backend, the model-FLOPs
//! formula, peak memory and the CSV. `tests/suite/scale.rs` runs the same code on the CPU.
//!
//! # One measurement
//!
//! The model is built on the autodiff backend from seed `--seed`, with the crate's optimiser
//! ([`KimiOptimizerConfig`]: per-head Muon for the hidden matrices, AdamW for the rest) at a
//! constant learning rate of [`LEARNING_RATE`]. Every step draws `batch` sequences of `T + 1`
//! uniformly random token ids from [`SeededRng`] (on the host, before the clock starts), and the
//! clock covers: the upload of the ids, forward, [`masked_cross_entropy`] on the next tokens,
//! backward, the optimiser step, [`KimiForCausalLM::update_balance`], a backend sync and the read
//! of the loss to the host, so that no device work of the step is still queued when the clock
//! stops. `--warmup` untimed steps come first (kernel compilation and autotuning on the GPU).
//!
//! # Model FLOPs per token
//!
//! ```text
//! F(T) = 6·N + 3·L_mla·H·(dn + dr + dv)·(T + 1)
//! ```
//!
//! - `N`: the active parameters ([`KimiConfig::active_params`]: the `k` routed experts, the
//!   shared experts, the router, the latent projections, the mixers, the dense layer, `lm_head`)
//!   less the input embedding, a lookup that multiplies nothing. Each weight costs one multiply-add
//!   (2 FLOPs) per token forward and two backward (the gradients of its input and of itself):
//!   `6·N`.
//! - The causal attention of the `L_mla` MLA layers, `H` heads: query `t` scores `t + 1` keys of
//!   `dn + dr` dims and sums as many values of `dv` dims, `2·H·(dn + dr + dv)·(t + 1)` FLOPs
//!   forward; averaged over `t < T` that is `H·(dn + dr + dv)·(T + 1)` per token, times 3 for
//!   forward and backward. Only the causal half of the score matrix counts, whatever the
//!   implementation computes.
//! - Not counted: KDA's state (about `7·dk·dv` FLOPs per head and token forward in the
//!   recurrent form, about `0.7·dh/d` of a KDA layer's projection FLOPs, 9% at `dh = d/8`), norms,
//!   activations, softmax, the AttnRes mixes and the optimiser (Muon's Newton–Schulz iterations).
//!
//! These are model FLOPs in the sense of PaLM's MFU (Chowdhery et al. 2022, appendix B):
//! achieved TFLOP/s = `F · tokens/s / 10¹²`, MFU = achieved / `--peak-tflops`.
//!
//! # Peak memory
//!
//! - CPU ([`ProcessPeak`]): the process's peak resident set (`VmHWM` in `/proc/self/status`),
//!   reset before each measurement by writing `5` to `/proc/self/clear_refs`; Linux only (empty
//!   elsewhere). It covers building the model and every step, plus whatever the allocator kept
//!   from earlier measurements of the same process.
//! - GPU ([`DevicePool`]): CubeCL 0.10's memory pool reports the bytes in use now
//!   (`ComputeClient::memory_usage`) but keeps no high-water mark, so one extra untimed step
//!   samples the bytes in use after the forward, after the backward and after the optimiser step
//!   (each after a sync) and the largest sample is recorded: a lower bound of the true peak,
//!   which falls inside the backward.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;
use kimi_burn::data::{masked_cross_entropy, Batch, SeededRng};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::optim::{KimiOptimizer, KimiOptimizerConfig};

/// The constant learning rate of every step (the sweep measures speed, not learning).
pub const LEARNING_RATE: f64 = 1e-3;

/// The columns of `scale.csv`, in order.
pub const CSV_COLUMNS: [&str; 16] = [
    "preset",
    "backend",
    "seq_len",
    "batch",
    "total_params",
    "active_params",
    "tokens_per_step",
    "step_time_s",
    "tokens_per_s",
    "rel_tokens_per_s",
    "flops_per_token",
    "achieved_tflops",
    "mfu",
    "peak_mem_mib",
    "mem_source",
    "loss",
];

/// What every measurement of a sweep shares.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Sequences per step.
    pub batch: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps before them.
    pub warmup: usize,
    /// Seed of the initialisation and of the token ids.
    pub seed: u64,
    /// The device's peak TFLOP/s for the MFU column (none: the column stays empty).
    pub peak_tflops: Option<f64>,
}

impl Settings {
    /// Rejects values the sweep cannot run with, naming the flag.
    pub fn check(&self) -> Result<(), String> {
        if self.batch == 0 {
            return Err("--batch must be at least 1, got 0".into());
        }
        if self.steps == 0 {
            return Err("--steps must be at least 1, got 0".into());
        }
        if let Some(peak) = self.peak_tflops {
            if !(peak.is_finite() && peak > 0.0) {
                return Err(format!(
                    "--peak-tflops must be finite and positive, got {peak}"
                ));
            }
        }
        Ok(())
    }
}

/// The presets called `names`, in that order, from [`KimiConfig::scaling_presets`]; an unknown
/// name is an error that lists the known ones.
pub fn presets(names: &[String]) -> Result<Vec<(String, KimiConfig)>, String> {
    let known = KimiConfig::scaling_presets();
    if names.is_empty() {
        return Err("--presets needs at least one preset".into());
    }
    names
        .iter()
        .map(|name| {
            known
                .iter()
                .find(|(n, _)| n == name)
                .map(|(n, c)| (n.to_string(), c.clone()))
                .ok_or_else(|| {
                    let list: Vec<&str> = known.iter().map(|(n, _)| *n).collect();
                    format!(
                        "unknown preset `{name}`; the presets are {}",
                        list.join(", ")
                    )
                })
        })
        .collect()
}

/// Checks the sequence lengths: at least one, each at least 1.
pub fn check_seq_lens(seq_lens: &[usize]) -> Result<(), String> {
    if seq_lens.is_empty() {
        return Err("--seq-lens needs at least one length".into());
    }
    if seq_lens.contains(&0) {
        return Err(format!(
            "--seq-lens must all be at least 1, got {seq_lens:?}"
        ));
    }
    Ok(())
}

/// Training model FLOPs per token at sequence length `seq_len` (the formula of the module docs).
pub fn flops_per_token(config: &KimiConfig, seq_len: usize) -> f64 {
    let embedding = (config.vocab_size * config.hidden_size) as u64;
    let dense = 6.0 * (config.active_params() - embedding) as f64;
    let m = &config.mla;
    let per_layer = (m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)) as f64;
    let mla_layers = config.full_attn_layers.len() as f64;
    dense + 3.0 * mla_layers * per_layer * (seq_len + 1) as f64
}

/// Where peak memory comes from (see the module docs).
pub trait MemoryProbe {
    /// The `mem_source` column: what the number is.
    fn source(&self) -> &'static str;
    /// Starts a new measurement.
    fn reset(&mut self) {}
    /// Whether [`sample`](Self::sample) needs an extra untimed step to see the memory.
    fn needs_samples(&self) -> bool {
        false
    }
    /// Records the memory in use now (called after a backend sync).
    fn sample(&mut self) {}
    /// The peak of this measurement in bytes, if known.
    fn peak_bytes(&mut self) -> Option<u64>;
}

/// The process's peak resident set, `VmHWM` (Linux).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessPeak;

impl MemoryProbe for ProcessPeak {
    fn source(&self) -> &'static str {
        if cfg!(target_os = "linux") {
            "process_vmhwm"
        } else {
            ""
        }
    }

    fn reset(&mut self) {
        // "5" resets the peak resident set to the current one (proc(5), clear_refs).
        if cfg!(target_os = "linux") {
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
    }

    fn peak_bytes(&mut self) -> Option<u64> {
        if !cfg!(target_os = "linux") {
            return None;
        }
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
}

/// A device memory pool read through `read` (bytes in use now); the peak is the largest sample.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub struct DevicePool<F: FnMut() -> Option<u64>> {
    read: F,
    peak: Option<u64>,
}

#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
impl<F: FnMut() -> Option<u64>> DevicePool<F> {
    /// A probe that calls `read` for the bytes in use.
    pub fn new(read: F) -> Self {
        Self { read, peak: None }
    }
}

impl<F: FnMut() -> Option<u64>> MemoryProbe for DevicePool<F> {
    fn source(&self) -> &'static str {
        "device_pool_sampled"
    }

    fn reset(&mut self) {
        self.peak = None;
    }

    fn needs_samples(&self) -> bool {
        true
    }

    fn sample(&mut self) {
        if let Some(bytes) = (self.read)() {
            self.peak = Some(self.peak.map_or(bytes, |p| p.max(bytes)));
        }
    }

    fn peak_bytes(&mut self) -> Option<u64> {
        self.peak
    }
}

/// One measurement: one preset at one sequence length on one backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Preset name.
    pub preset: String,
    /// Backend name.
    pub backend: String,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Parameters of the built model (the balance biases, buffers, not counted).
    pub total_params: u64,
    /// Parameters used per token ([`KimiConfig::active_params`]).
    pub active_params: u64,
    /// `batch · seq_len`.
    pub tokens_per_step: usize,
    /// Mean wall time of a timed step, seconds.
    pub step_time_s: f64,
    /// `tokens_per_step / step_time_s`.
    pub tokens_per_s: f64,
    /// Tokens/s over those of the sweep's first preset at the same backend and sequence length.
    pub rel_tokens_per_s: Option<f64>,
    /// Training model FLOPs per token ([`flops_per_token`]).
    pub flops_per_token: f64,
    /// `flops_per_token · tokens_per_s / 1e12`.
    pub achieved_tflops: f64,
    /// Achieved over peak TFLOP/s, when a peak was given.
    pub mfu: Option<f64>,
    /// Peak memory in MiB, where measured.
    pub peak_mem_mib: Option<f64>,
    /// What `peak_mem_mib` is ([`MemoryProbe::source`]).
    pub mem_source: String,
    /// The loss of the last timed step.
    pub loss: f64,
}

/// An optional number as a CSV or table cell: empty when absent.
fn cell(value: Option<f64>, digits: usize) -> String {
    value.map_or(String::new(), |v| format!("{v:.digits$}"))
}

impl Row {
    /// The row as a CSV line (no newline), in the order of [`CSV_COLUMNS`].
    pub fn csv_line(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{:.6},{:.1},{},{:.0},{:.6},{},{},{},{:.5}",
            self.preset,
            self.backend,
            self.seq_len,
            self.batch,
            self.total_params,
            self.active_params,
            self.tokens_per_step,
            self.step_time_s,
            self.tokens_per_s,
            cell(self.rel_tokens_per_s, 3),
            self.flops_per_token,
            self.achieved_tflops,
            cell(self.mfu, 5),
            cell(self.peak_mem_mib, 1),
            self.mem_source,
            self.loss
        )
    }

    /// The row as a line of the stdout table (see [`table_header`]).
    pub fn table_line(&self) -> String {
        format!(
            "{:<6} {:<8} {:>6} {:>5} {:>10} {:>10} {:>9.4} {:>10.0} {:>6} {:>9.4} {:>7} {:>9}",
            self.preset,
            self.backend,
            self.seq_len,
            self.batch,
            si(self.total_params as f64),
            si(self.active_params as f64),
            self.step_time_s,
            self.tokens_per_s,
            cell(self.rel_tokens_per_s, 2),
            self.achieved_tflops,
            cell(self.mfu.map(|m| 100.0 * m), 2),
            cell(self.peak_mem_mib, 0),
        )
    }
}

/// The header of the stdout table.
pub fn table_header() -> String {
    format!(
        "{:<6} {:<8} {:>6} {:>5} {:>10} {:>10} {:>9} {:>10} {:>6} {:>9} {:>7} {:>9}",
        "preset",
        "backend",
        "seq",
        "batch",
        "params",
        "active",
        "step s",
        "tokens/s",
        "rel",
        "TFLOP/s",
        "MFU %",
        "peak MiB"
    )
}

/// `x` with a k/M/B suffix and three significant digits.
pub fn si(x: f64) -> String {
    let (value, suffix) = match x {
        x if x >= 1e9 => (x / 1e9, "B"),
        x if x >= 1e6 => (x / 1e6, "M"),
        x if x >= 1e3 => (x / 1e3, "k"),
        x => (x, ""),
    };
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$}{suffix}")
}

/// `scale.csv`: the header and every row.
pub fn csv(rows: &[Row]) -> String {
    let mut out = CSV_COLUMNS.join(",");
    out.push('\n');
    for row in rows {
        let _ = writeln!(out, "{}", row.csv_line());
    }
    out
}

/// Writes [`csv`] of `rows` to `path`.
pub fn write_csv(path: &Path, rows: &[Row]) -> Result<(), String> {
    std::fs::write(path, csv(rows)).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// `batch` sequences of `seq_len + 1` random ids in `[0, vocab)`: inputs are the first
/// `seq_len`, targets the last `seq_len` (each position predicts the next token).
pub fn random_batch(batch: usize, seq_len: usize, vocab: usize, rng: &mut SeededRng) -> Batch {
    let mut inputs = Vec::with_capacity(batch * seq_len);
    let mut targets = Vec::with_capacity(batch * seq_len);
    for _ in 0..batch {
        let ids: Vec<i64> = (0..=seq_len).map(|_| rng.below(vocab) as i64).collect();
        inputs.extend_from_slice(&ids[..seq_len]);
        targets.extend_from_slice(&ids[1..]);
    }
    Batch {
        batch,
        seq_len,
        inputs,
        targets,
    }
}

/// The optimiser and the device of one measurement.
struct Trainer<B: AutodiffBackend> {
    optim: KimiOptimizer<KimiForCausalLM<B>, B>,
    device: B::Device,
}

impl<B: AutodiffBackend> Trainer<B> {
    /// One training step of `model` on `batch`: the updated model and the loss, returned once
    /// every device operation of the step has finished. With `probe`, samples memory after the
    /// forward, the backward and the step.
    fn step(
        &mut self,
        model: KimiForCausalLM<B>,
        batch: &Batch,
        mut probe: Option<&mut dyn MemoryProbe>,
    ) -> Result<(KimiForCausalLM<B>, f64), String> {
        let device = &self.device;
        let sync = || B::sync(device).map_err(|e| format!("backend sync failed: {e:?}"));
        let sample = |probe: &mut Option<&mut dyn MemoryProbe>| -> Result<(), String> {
            if let Some(p) = probe.as_deref_mut() {
                sync()?;
                p.sample();
            }
            Ok(())
        };
        let (inputs, targets) = batch.to_tensors::<B>(device);
        let logits = model
            .try_forward(inputs, None, None)
            .map_err(|e| e.to_string())?
            .logits;
        let loss = masked_cross_entropy(logits, targets);
        sample(&mut probe)?;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        sample(&mut probe)?;
        let model = self.optim.step(LEARNING_RATE, model, grads);
        model.update_balance();
        sync()?;
        if let Some(p) = probe {
            p.sample();
        }
        let loss: f64 = loss.into_scalar().elem();
        Ok((model, loss))
    }
}

/// Measures `config` at `seq_len` on backend `B` (named `backend` in the row).
pub fn measure<B: AutodiffBackend>(
    (preset, config): (&str, &KimiConfig),
    backend: &str,
    seq_len: usize,
    settings: &Settings,
    probe: &mut dyn MemoryProbe,
    device: &B::Device,
) -> Result<Row, String> {
    probe.reset();
    B::seed(device, settings.seed);
    let model: KimiForCausalLM<B> = config
        .try_init(device)
        .map_err(|e| format!("preset {preset}: {e}"))?;
    // Burn also counts the balance bias, a buffer of `n` per MoE layer.
    let moe_layers = (0..config.num_hidden_layers)
        .filter(|&i| config.is_moe_layer(i))
        .count();
    let buffers = (moe_layers * config.moe.num_experts) as u64;
    let total_params = (model.num_params() as u64).saturating_sub(buffers);
    let optim = KimiOptimizerConfig::new()
        .init(&model, model.param_roles())
        .map_err(|e| e.to_string())?;
    let mut trainer = Trainer {
        optim,
        device: device.clone(),
    };
    let mut model = model;
    let mut rng = SeededRng::new(settings.seed);
    let mut next_batch = || random_batch(settings.batch, seq_len, config.vocab_size, &mut rng);
    for _ in 0..settings.warmup {
        model = trainer.step(model, &next_batch(), None)?.0;
    }
    let mut elapsed = 0.0;
    let mut loss = f64::NAN;
    for _ in 0..settings.steps {
        let batch = next_batch();
        let start = Instant::now();
        (model, loss) = trainer.step(model, &batch, None)?;
        elapsed += start.elapsed().as_secs_f64();
    }
    if probe.needs_samples() {
        trainer.step(model, &next_batch(), Some(probe))?;
    }
    let step_time_s = elapsed / settings.steps as f64;
    let tokens_per_step = settings.batch * seq_len;
    let tokens_per_s = tokens_per_step as f64 / step_time_s;
    let flops = flops_per_token(config, seq_len);
    let achieved_tflops = flops * tokens_per_s / 1e12;
    Ok(Row {
        preset: preset.to_string(),
        backend: backend.to_string(),
        seq_len,
        batch: settings.batch,
        total_params,
        active_params: config.active_params(),
        tokens_per_step,
        step_time_s,
        tokens_per_s,
        rel_tokens_per_s: None,
        flops_per_token: flops,
        achieved_tflops,
        mfu: settings.peak_tflops.map(|peak| achieved_tflops / peak),
        peak_mem_mib: probe.peak_bytes().map(|b| b as f64 / (1024.0 * 1024.0)),
        mem_source: probe.source().to_string(),
        loss,
    })
}

/// Every preset × sequence length on backend `B`, in that order; calls `report` with each row
/// as it is measured and returns them all. `rel_tokens_per_s` is taken against the first preset's
/// row at the same sequence length.
pub fn sweep<B: AutodiffBackend>(
    backend: &str,
    presets: &[(String, KimiConfig)],
    seq_lens: &[usize],
    settings: &Settings,
    probe: &mut dyn MemoryProbe,
    device: &B::Device,
    report: &mut dyn FnMut(&Row) -> Result<(), String>,
) -> Result<Vec<Row>, String> {
    settings.check()?;
    check_seq_lens(seq_lens)?;
    let mut rows: Vec<Row> = Vec::new();
    for (name, config) in presets {
        for &seq_len in seq_lens {
            let mut row = measure::<B>((name, config), backend, seq_len, settings, probe, device)?;
            let baseline = rows
                .iter()
                .find(|r| r.seq_len == seq_len)
                .map_or(row.tokens_per_s, |r| r.tokens_per_s);
            row.rel_tokens_per_s = Some(row.tokens_per_s / baseline);
            if !row.loss.is_finite() {
                eprintln!(
                    "warning: {name} at seq {seq_len} on {backend}: the loss is {}",
                    row.loss
                );
            }
            report(&row)?;
            rows.push(row);
        }
    }
    Ok(rows)
}
