//! Memory, read from `/proc/self/status` (Linux): the peak of saving and loading a checkpoint, and
//! what calibrating the balance bias leaves behind.
//!
//! Its own test binary; each measured step runs in a fresh child process, so that nothing else
//! allocates while it measures. The model is about 30 times the tiny preset (10 M parameters, 40 MB in f32), saved in
//! shards of an eighth of its size. Print the figures with
//! `cargo test --release --test memory -- --nocapture`.

#![cfg(target_os = "linux")]
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Int, Tensor, TensorData};
use kimi_burn::config::KimiConfig;
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::store::StoreDtype;

type B = NdArray<f32>;

/// A kibibyte figure of `/proc/self/status`, in bytes.
fn status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = text
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line}"));
    kib * 1024
}

/// Resets the peak resident size to the current one (`clear_refs` 5).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5")
        .expect("resetting VmHWM via /proc/self/clear_refs");
}

/// Runs `f`; returns its value and how far the resident size rose above where it started.
fn peak_rise<R>(f: impl FnOnce() -> R) -> (R, u64) {
    reset_peak();
    let before = status("VmRSS:");
    let out = f();
    (out, status("VmHWM:").saturating_sub(before))
}

fn config() -> KimiConfig {
    let mut c = KimiConfig::tiny();
    c.vocab_size = 2048;
    c.hidden_size = 256;
    c.num_hidden_layers = 8;
    c.full_attn_layers = kimi_burn::config::hybrid_pattern(8);
    c.intermediate_size = 512;
    c.moe.num_experts = 16;
    c.moe.moe_intermediate_size = 256;
    c.moe.layout = kimi_burn::nn::MoeLayout::StableLatent { dim: 128 };
    c.kda.num_heads = 4;
    c.kda.head_dim = 64;
    c.mla.num_heads = 4;
    c.mla.q_lora_rank = Some(64);
    c.mla.kv_lora_rank = 64;
    c.mla.qk_nope_head_dim = 32;
    c.mla.qk_rope_head_dim = 16;
    c.mla.v_head_dim = 32;
    c
}

const MIB: f64 = 1024.0 * 1024.0;
const STEP: &str = "KIMI_BURN_MEMORY_STEP";
const DIR: &str = "KIMI_BURN_MEMORY_DIR";

/// One measured step in a fresh process (so that memory freed by an earlier step, which the
/// allocator keeps, cannot hide a rise): `save` builds the model, runs it once (which initialises
/// every lazily initialised parameter: the model's own memory) and measures a sharded save;
/// `load` measures loading that checkpoint. Prints `rise=<bytes>`.
#[test]
#[ignore = "one step of `loading_needs_the_model_plus_a_shard_and_saving_no_second_copy`, run by it in a child process"]
fn measured_step() {
    let step = std::env::var(STEP).expect("run by the memory test");
    let dir = std::path::PathBuf::from(std::env::var(DIR).expect("run by the memory test"));
    let config = config();
    let device = Default::default();
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new((0..24i64).map(|i| (i * 37) % 2048).collect(), [2, 12]),
        &device,
    );
    let rise = match step.as_str() {
        "save" => {
            let model = config.init::<B>(&device);
            let logits = model.forward(ids);
            let shard = config.num_params() * 4 / 8;
            let (files, rise) = peak_rise(|| {
                model
                    .save_pretrained(&dir, StoreDtype::F32, shard, false)
                    .unwrap()
            });
            assert!(files.len() > 3, "sharded: {files:?}");
            std::fs::write(
                dir.join("logits.json"),
                serde_json::to_string(&logits.into_data().to_vec::<f32>().unwrap()).unwrap(),
            )
            .unwrap();
            rise
        }
        "load" => {
            let (model, rise) = peak_rise(|| {
                KimiForCausalLM::<B>::from_safetensors(&config, &dir, &device).unwrap()
            });
            // The loaded model is the saved one.
            let want: Vec<f32> =
                serde_json::from_str(&std::fs::read_to_string(dir.join("logits.json")).unwrap())
                    .unwrap();
            assert_eq!(
                model.forward(ids).into_data().to_vec::<f32>().unwrap(),
                want
            );
            rise
        }
        "calibrate" => calibration_growth(),
        other => panic!("unknown step {other}"),
    };
    println!("rise={rise}");
}

/// Runs [`measured_step`] `step` in a child process; its rise in bytes.
fn run_step(step: &str, dir: &std::path::Path) -> u64 {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["measured_step", "--exact", "--ignored", "--nocapture"])
        .env(STEP, step)
        .env(DIR, dir)
        .output()
        .expect("running the measured step");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "step {step} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        // With one test thread the harness prints the line after `test measured_step ... `.
        .find_map(|l| l.split_once("rise=").map(|(_, v)| v))
        .and_then(|v| {
            v.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("step {step} printed no rise:\n{stdout}"))
}

/// Loading needs the model plus at most its largest shard (in fact about one tensor more: each
/// tensor's mapped pages are given back once copied, and no random values are drawn first), and
/// saving needs no second copy of the model (tensors are read from it one at a time). Each step
/// is measured in a fresh process.
#[test]
fn loading_needs_the_model_plus_a_shard_and_saving_no_second_copy() {
    let config = config();
    let model_bytes = config.num_params() * 4;
    let dir = std::env::temp_dir().join(format!("kimi-burn-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let save_rise = run_step("save", &dir);
    let load_rise = run_step("load", &dir);
    let sizes: Vec<u64> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .collect();
    let largest_shard = sizes.iter().copied().max().unwrap();
    let checkpoint: u64 = sizes.iter().sum();
    eprintln!(
        "model {:.1} MiB ({} parameters), checkpoint {:.1} MiB in {} shards, largest shard \
         {:.1} MiB: save peak +{:.1} MiB, load peak +{:.1} MiB",
        model_bytes as f64 / MIB,
        config.num_params(),
        checkpoint as f64 / MIB,
        sizes.len(),
        largest_shard as f64 / MIB,
        save_rise as f64 / MIB,
        load_rise as f64 / MIB,
    );
    // The allocator's own slack and the first use of a few code pages.
    let slack = 8 << 20;
    assert!(
        load_rise <= model_bytes + largest_shard + slack,
        "loading rose by {load_rise} bytes: more than the model ({model_bytes}) plus the largest \
         shard ({largest_shard}) plus {slack}"
    );
    assert!(
        save_rise <= largest_shard + slack,
        "saving rose by {save_rise} bytes: more than the largest shard ({largest_shard}) plus \
         {slack} (a whole host copy of the model is {model_bytes})"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `calibrate`: the resident size gained by 12 calibration sweeps after a first one (which takes
/// what the forwards need), on the autodiff backend, where calibration's forwards must count
/// without keeping the graph an unused backward would consume.
fn calibration_growth() -> u64 {
    type A = Autodiff<B>;
    let mut config = KimiConfig::tiny();
    config.vocab_size = 64;
    let device = Default::default();
    let model = config.init::<A>(&device);
    let batches: Vec<Tensor<A, 2, Int>> = (0..2i64)
        .map(|b| {
            Tensor::from_data(
                TensorData::new((0..8 * 128).map(|i| (i * 7 + b) % 64).collect(), [8, 128]),
                &device,
            )
        })
        .collect();
    model.calibrate_balance(&batches, 1).unwrap();
    let before = status("VmRSS:");
    model.calibrate_balance(&batches, 12).unwrap();
    status("VmRSS:").saturating_sub(before)
}

/// Calibrating the balance bias (`KimiForCausalLM::calibrate_balance`) runs training forwards on
/// the autodiff backend and never a backward. Nothing of them may outlive them: a graph that no
/// backward consumes keeps every activation it saved (12 sweeps after the first, 24 forwards of
/// this shape, then grow the resident size by about 1.2 GB; `train_tiny`'s calibration by about
/// 5 GB), and even untracked forwards leave Burn's per-operation bookkeeping (about 14 MiB here)
/// until a backward runs (`kimi_burn::train::release_autodiff_bookkeeping`). Both are gone: the
/// bound is the allocator's slack.
#[test]
fn calibration_keeps_no_autodiff_graph() {
    let dir = std::env::temp_dir();
    let growth = run_step("calibrate", &dir);
    eprintln!(
        "12 more calibration sweeps: +{:.1} MiB",
        growth as f64 / MIB
    );
    assert!(
        growth < 4 << 20,
        "12 calibration sweeps after the first grew the resident size by {growth} bytes: \
         their forwards leave autodiff graphs or bookkeeping behind"
    );
}
