//! A scaling sweep: training throughput of the K3-shaped presets `s0` … `s5`
//! (`KimiConfig::scaling_presets`) over presets × sequence lengths × backends.
//!
//! ```text
//! cargo run --release --example scale                                  # s0,s1 × 64,128 on the CPU
//! cargo run --release --example scale -- --presets s0,s1,s2 --seq-lens 64,256 --steps 5
//! cargo run --release --features cuda --example scale -- --backend cuda \
//!     --presets s3,s4,s5 --seq-lens 1024,4096 --batch 8 --peak-tflops PEAK   # PEAK: the GPU's f32 TFLOP/s
//! cargo run --release --example scale -- --help
//! ```
//!
//! Each measurement builds the preset on `Autodiff<backend>` and times `--steps` training steps
//! (after `--warmup` untimed ones) on random token ids; `sweep.rs` documents what a step covers,
//! the model-FLOPs formula behind the TFLOP/s and MFU columns, and how peak memory is measured.
//! Prints a table as it goes and writes into `--out` (default `runs/scale`): `scale.csv` (after
//! every measurement), `tokens_per_s.png` and `step_time.png`.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

#[path = "../common/font.rs"]
mod font;
mod plot;
mod sweep;

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use sweep::{Row, Settings};

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
enum BackendKind {
    /// Burn's CPU backend.
    Ndarray,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

impl BackendKind {
    fn name(self) -> &'static str {
        match self {
            Self::Ndarray => "ndarray",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }

    /// Whether this build has the backend, or the flag that adds it.
    fn available(self) -> Result<(), String> {
        match self {
            Self::Ndarray => Ok(()),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => Ok(()),
            #[cfg(feature = "cuda")]
            Self::Cuda => Ok(()),
            #[allow(unreachable_patterns)]
            other => Err(format!(
                "--backend {0} needs the crate feature of the same name: cargo run --release --features {0} --example scale",
                other.name()
            )),
        }
    }
}

/// Time training steps of the K3-shaped presets over sizes, sequence lengths and backends.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Presets, comma-separated (s0 … s5, from about 0.4M to about 1B parameters).
    #[arg(long, value_delimiter = ',', default_value = "s0,s1")]
    presets: Vec<String>,
    /// Tokens per sequence, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,128")]
    seq_lens: Vec<usize>,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Backends, comma-separated (wgpu and cuda need the crate feature of the same name).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ndarray")]
    backend: Vec<BackendKind>,
    /// Timed training steps per measurement.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps before them (kernel compilation and autotuning on the GPU).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// The device's peak TFLOP/s at the training precision (f32 here), for the MFU column;
    /// without it the column stays empty.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Seed of the initialisation and of the token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output folder.
    #[arg(long, default_value = "runs/scale")]
    out: PathBuf,
}

fn main() {
    let args = Args::parse();
    // Each step's freed buffers serve the next step instead of going back to the operating
    // system and being faulted in again (glibc; see `retain_freed_memory`).
    kimi_burn::ops::backend::retain_freed_memory();
    if let Err(msg) = run(&args) {
        eprintln!("error: {msg}");
        std::process::exit(2);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let presets = sweep::presets(&args.presets)?;
    sweep::check_seq_lens(&args.seq_lens)?;
    let settings = Settings {
        batch: args.batch,
        steps: args.steps,
        warmup: args.warmup,
        seed: args.seed,
        peak_tflops: args.peak_tflops,
    };
    settings.check()?;
    for &backend in &args.backend {
        backend.available()?;
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let csv_path = args.out.join("scale.csv");

    println!(
        "kimi-burn scale: batch {}, {} timed steps after {} warm-up, seed {}",
        args.batch, args.steps, args.warmup, args.seed
    );
    for (name, config) in &presets {
        println!(
            "  {name}: d {}, {} layers, {} experts top-{}, {} params ({} active)",
            config.hidden_size,
            config.num_hidden_layers,
            config.moe.num_experts,
            config.moe.num_experts_per_token,
            sweep::si(config.num_params() as f64),
            sweep::si(config.active_params() as f64)
        );
    }
    println!("{}", sweep::table_header());
    let mut rows: Vec<Row> = Vec::new();
    for &backend in &args.backend {
        // Rows print as they come, and the CSV is rewritten after each: a stopped sweep keeps
        // what it measured.
        let mut report = |row: &Row| -> Result<(), String> {
            println!("{}", row.table_line());
            rows.push(row.clone());
            sweep::write_csv(&csv_path, &rows)
        };
        sweep_backend(backend, &presets, args, &settings, &mut report)?;
    }
    sweep::write_csv(&csv_path, &rows)?;
    let labelled = font::register_font();
    plot::write_plots(&args.out, &rows, labelled)?;
    println!(
        "wrote scale.csv, tokens_per_s.png and step_time.png to {}",
        args.out.display()
    );
    if !labelled {
        println!("(no TrueType font found: the plots have no axis labels)");
    }
    Ok(())
}

/// The sweep on one backend, with that backend's memory probe.
fn sweep_backend(
    backend: BackendKind,
    presets: &[(String, kimi_burn::KimiConfig)],
    args: &Args,
    settings: &Settings,
    report: &mut dyn FnMut(&Row) -> Result<(), String>,
) -> Result<Vec<Row>, String> {
    let name = backend.name();
    let lens = &args.seq_lens;
    match backend {
        BackendKind::Ndarray => {
            type B = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
            let mut probe = sweep::ProcessPeak;
            sweep::sweep::<B>(
                name,
                presets,
                lens,
                settings,
                &mut probe,
                &Default::default(),
                report,
            )
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
            use cubecl::Runtime;
            type B = burn::backend::Autodiff<burn::backend::Wgpu>;
            let device = WgpuDevice::default();
            let pool = device.clone();
            let mut probe = sweep::DevicePool::new(move || {
                WgpuRuntime::client(&pool)
                    .memory_usage()
                    .ok()
                    .map(|u| u.bytes_in_use)
            });
            sweep::sweep::<B>(name, presets, lens, settings, &mut probe, &device, report)
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            use burn::backend::cuda::CudaDevice;
            use cubecl::cuda::CudaRuntime;
            use cubecl::Runtime;
            type B = burn::backend::Autodiff<burn::backend::Cuda>;
            let device = CudaDevice::default();
            let pool = device.clone();
            let mut probe = sweep::DevicePool::new(move || {
                CudaRuntime::client(&pool)
                    .memory_usage()
                    .ok()
                    .map(|u| u.bytes_in_use)
            });
            sweep::sweep::<B>(name, presets, lens, settings, &mut probe, &device, report)
        }
        #[allow(unreachable_patterns)]
        other => other.available().map(|()| Vec::new()),
    }
}
