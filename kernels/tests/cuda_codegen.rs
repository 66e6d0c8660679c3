//! Every kernel of the crate, in the configurations `kimi-burn` launches on CUDA, translated to
//! CUDA C++ by CubeCL's CUDA compiler and compiled by NVRTC to machine code for the data-centre
//! GPUs (`sm_80`: A100, `sm_90a`: H100/H200), without a GPU.
//!
//! It checks what can go wrong before a kernel ever runs on a GPU: CubeCL's translation (an
//! instruction its CUDA dialect lacks), the C++ (the tensor-core `wmma` fragments of the grouped
//! matmuls, the half-precision conversions), and the resources of the compiled code: a cube whose
//! registers or shared memory do not fit one streaming multiprocessor fails at launch. It also
//! fails on f64 arithmetic, and unless the grouped matmuls' PTX has tensor-core instructions
//! exactly in the configurations that ask for them. It prints each kernel's registers, spills and
//! shared memory.
//!
//! What it cannot check is the numbers: those need a GPU (`scripts/cuda-check.sh`).
//!
//! Needs NVRTC and a CUDA toolkit's include folder (`$CUDA_PATH/include`, with `crt/mma.h`):
//! `scripts/cuda-codegen.sh` finds them and runs this test. The kernel definitions are built with a wgpu client (any adapter, lavapipe
//! included): CubeCL asks a client for its device properties, though nothing is launched.

// The kernels' argument lists stay grouped by kind there, a row of arrays, a row of scalars and
// a row of comptime values, as the kernels declare them; rustfmt would give each its own line.
#[rustfmt::skip]
#[path = "cuda_codegen/cases.rs"]
mod cases;

use cubecl::cuda::CudaCompiler;
use cubecl::prelude::*;
use cubecl::server::ExecutionMode;
use cubecl::Compiler;
use std::ffi::CString;

use cases::Case;

/// The architectures compiled for unless `KIMI_CUDA_ARCHS` names others (comma-separated, from
/// [`KNOWN`]): the A100 and the H100/H200.
const DEFAULT_ARCHS: &str = "sm_80,sm_90a";

/// Architectures this test knows, with the most shared memory one cube may opt in to (bytes).
const KNOWN: [Arch; 6] = [
    arch("sm_80", 163),
    arch("sm_86", 99),
    arch("sm_89", 99),
    arch("sm_90a", 227),
    arch("sm_100a", 227),
    arch("sm_120", 99),
];

/// A GPU architecture to compile for.
#[derive(Clone, Copy)]
struct Arch {
    name: &'static str,
    shared_max: usize,
}

const fn arch(name: &'static str, shared_kib: usize) -> Arch {
    Arch {
        name,
        shared_max: shared_kib * 1024,
    }
}

fn archs() -> Vec<Arch> {
    let wanted = std::env::var("KIMI_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    wanted
        .split(',')
        .map(|name| {
            *KNOWN
                .iter()
                .find(|a| a.name == name.trim())
                .unwrap_or_else(|| {
                    let known: Vec<_> = KNOWN.iter().map(|a| a.name).collect();
                    panic!("KIMI_CUDA_ARCHS: unknown architecture {name:?}; known: {known:?}")
                })
        })
        .collect()
}

/// Registers of one streaming multiprocessor (every architecture from `sm_50` on).
const REGISTERS_PER_SM: u32 = 65_536;
/// Registers are allocated per warp in units of this many.
const REGISTER_UNIT: u32 = 256;
const WARP: u32 = 32;

/// The compilation options CubeCL's CUDA runtime uses on a device of compute capability 9.0
/// (`cubecl-cuda`'s runtime, `compute_capability ≥ 90`, CUDA ≥ 12.8).
fn options() -> Options {
    let mut features = Options::default().supports_features;
    features.fast_math = true;
    features.grid_constants = true;
    features.fast_tanh = true;
    features.clusters = true;
    features.elect_sync = true;
    Options {
        warp_size: WARP,
        supports_features: features,
    }
}

/// CubeCL's options for its CUDA compiler.
type Options = <CudaCompiler as Compiler>::CompilationOptions;

/// A kernel translated to CUDA C++.
struct Source {
    label: String,
    entry: String,
    text: String,
    threads: u32,
    shared: usize,
    tensor_cores: bool,
}

fn translate(case: Case) -> Source {
    let Case {
        label,
        definition,
        address,
        tensor_cores,
    } = case;
    let entry = definition.options.kernel_name.clone();
    let threads = definition.cube_dim.num_elems();
    let kernel = CudaCompiler::default()
        .compile(definition, &options(), ExecutionMode::Unchecked, address)
        .unwrap_or_else(|e| panic!("{label}: CubeCL's CUDA compiler failed: {e}"));
    Source {
        label,
        entry,
        shared: kernel.shared_memory_size(),
        text: kernel.to_string(),
        threads,
        tensor_cores,
    }
}

/// What ptxas reported for one kernel on one architecture.
#[derive(Debug, Default)]
struct Usage {
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    static_shared: u32,
    /// Whether the PTX has matrix-multiply-accumulate instructions (`wmma.mma` or `mma`).
    mma: bool,
}

/// NVRTC's result for one kernel and architecture: the ptxas report, or the compiler's log.
fn compile(source: &Source, arch: &Arch, include: &[String]) -> Result<Usage, String> {
    use cudarc::nvrtc::result as nvrtc;
    let text = CString::new(source.text.as_str()).expect("no NUL in CUDA source");
    let program = nvrtc::create_program(&text, None).map_err(|e| format!("{e:?}"))?;
    let mut options = vec![
        format!("--gpu-architecture={}", arch.name),
        "--ptxas-options=-v".to_string(),
        "-lineinfo".to_string(),
    ];
    options.extend(include.iter().map(|dir| format!("--include-path={dir}")));
    // SAFETY: `program` comes from `create_program` above and is destroyed once, last.
    let (compiled, log, ptx) = unsafe {
        let compiled = nvrtc::compile_program(program, &options);
        let log = nvrtc::get_program_log(program);
        let ptx = compiled.is_ok().then(|| nvrtc::get_ptx(program));
        let _ = nvrtc::destroy_program(program);
        (compiled, log, ptx)
    };
    let log = c_text(&log.map_err(|e| format!("{e:?}"))?);
    if let Err(e) = compiled {
        return Err(format!("{e:?}\n{log}"));
    }
    let ptx = match ptx {
        Some(Ok(ptx)) => c_text(&ptx),
        Some(Err(e)) => return Err(format!("{e:?}")),
        None => unreachable!("the PTX is read after a successful compile"),
    };
    let mut usage = parse_ptxas(&log, &source.entry);
    usage.mma = ptx.contains("wmma.mma") || ptx.contains("mma.sync");
    Ok(usage)
}

/// NVRTC's NUL-terminated text as a string.
fn c_text(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&c| c != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The numbers of `ptxas -v` for the function `entry`.
fn parse_ptxas(log: &str, entry: &str) -> Usage {
    let mut usage = Usage::default();
    let mut ours = false;
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if line.contains("Compiling entry function") || line.contains("Function properties for") {
            ours = line.contains(entry);
        }
        if !ours {
            continue;
        }
        if let Some(n) = number_before(line, "bytes spill stores") {
            usage.spill_stores = n;
        }
        if let Some(n) = number_before(line, "bytes spill loads") {
            usage.spill_loads = n;
        }
        if let Some(n) = number_before(line, "registers") {
            usage.registers = n;
        }
        if let Some(n) = number_before(line, "bytes smem") {
            usage.static_shared = n;
        }
    }
    usage
}

/// Registers one cube of `threads` units takes from the SM's file.
fn cube_registers(registers: u32, threads: u32) -> u32 {
    let per_warp = (registers * WARP).div_ceil(REGISTER_UNIT) * REGISTER_UNIT;
    per_warp * threads.div_ceil(WARP)
}

/// The CUDA headers NVRTC needs: `$CUDA_PATH/include` and its `cccl` folder.
fn include_dirs() -> Vec<String> {
    let root = std::env::var("CUDA_PATH").expect(
        "CUDA_PATH is not set: point it at a CUDA toolkit (or run scripts/cuda-codegen.sh, \
         which finds one)",
    );
    let include = std::path::Path::new(&root).join("include");
    // `cuda_runtime.h` for every kernel, `crt/mma.h` (through `mma.h`) for the tensor-core ones.
    for header in ["cuda_runtime.h", "crt/mma.h"] {
        assert!(
            include.join(header).exists(),
            "{} has no {header}: CUDA_PATH must name a CUDA toolkit",
            include.display()
        );
    }
    let mut dirs = vec![include.display().to_string()];
    let cccl = include.join("cccl");
    if cccl.exists() {
        dirs.push(cccl.display().to_string());
    }
    dirs
}

/// What one kernel configuration gave on every architecture.
struct Checked {
    /// Its row of the report.
    row: String,
    /// What failed, with NVRTC's log or the numbers.
    failures: Vec<String>,
}

fn check(source: &Source, archs: &[Arch], include: &[String]) -> Checked {
    let mut failures = Vec::new();
    // The kernels compute in f32 (the crate's docs say so); a stray f64 literal or cast would
    // run at a small fraction of the f32 rate on most GPUs.
    if source.text.contains("double") {
        failures.push(format!("{}: the CUDA source computes in f64", source.label));
    }
    let mut row = format!(
        "| {} | {} | {} |",
        source.label, source.threads, source.shared
    );
    for arch in archs {
        let usage = match compile(source, arch, include) {
            Ok(usage) => usage,
            Err(log) => {
                row.push_str(" error |");
                failures.push(format!(
                    "{} on {}: NVRTC failed: {log}",
                    source.label, arch.name
                ));
                continue;
            }
        };
        if usage.mma != source.tensor_cores {
            let has = if usage.mma { "has" } else { "lacks" };
            failures.push(format!(
                "{} on {}: its PTX {has} tensor-core instructions",
                source.label, arch.name
            ));
        }
        let spills = usage.spill_stores + usage.spill_loads;
        row.push_str(&format!(" {} / {} |", usage.registers, spills));
        let file = cube_registers(usage.registers, source.threads);
        if usage.registers == 0 || file > REGISTERS_PER_SM {
            failures.push(format!(
                "{} on {}: {} registers × {} units need {file} of the SM's {REGISTERS_PER_SM} \
                 (ptxas: {usage:?})",
                source.label, arch.name, usage.registers, source.threads
            ));
        }
        let shared = source.shared.max(usage.static_shared as usize);
        if shared > arch.shared_max {
            failures.push(format!(
                "{} on {}: {shared} bytes of shared memory, a cube may have {}",
                source.label, arch.name, arch.shared_max
            ));
        }
    }
    Checked { row, failures }
}

#[test]
fn every_kernel_compiles_for_the_data_centre_gpus_and_fits_a_multiprocessor() {
    let include = include_dirs();
    let archs = archs();
    let client = cubecl::wgpu::WgpuRuntime::client(&Default::default());
    let sources: Vec<Source> = cases::all(&client).into_iter().map(translate).collect();
    if let Some(dir) = std::env::var_os("KIMI_CUDA_DUMP").map(std::path::PathBuf::from) {
        std::fs::create_dir_all(&dir).expect("create the KIMI_CUDA_DUMP folder");
        for source in &sources {
            let name = source.label.replace([' ', '/', '=', '(', ')', ','], "_");
            std::fs::write(dir.join(format!("{name}.cu")), &source.text).expect("write a source");
        }
    }
    // NVRTC compiles independent programs on several threads.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Vec<(usize, Checked)>> = std::thread::scope(|scope| {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(source) = sources.get(i) else {
                            break done;
                        };
                        done.push((i, check(source, &archs, &include)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a compile thread panicked"))
            .collect()
    });
    let mut results: Vec<_> = results.into_iter().flatten().collect();
    results.sort_by_key(|(i, _)| *i);
    let columns: Vec<String> = archs
        .iter()
        .map(|a| format!("{} regs / spill B", a.name))
        .collect();
    println!("| kernel | units | shared B | {} |", columns.join(" | "));
    println!("|---|---:|---:|{}", "---:|".repeat(archs.len()));
    let mut failures = Vec::new();
    for (_, checked) in results {
        println!("{}", checked.row);
        failures.extend(checked.failures);
    }
    println!(
        "{} kernel configurations on {}",
        sources.len(),
        archs.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_ptxas_report_is_read_per_function() {
    let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'first' for 'sm_90a'
ptxas info    : Function properties for first
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
ptxas info    : Compiling entry function 'second' for 'sm_90a'
ptxas info    : Function properties for second
ptxas         .     48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8192 bytes smem
";
    let first = parse_ptxas(log, "first");
    assert_eq!(
        (first.registers, first.spill_stores, first.static_shared),
        (16, 0, 0)
    );
    let second = parse_ptxas(log, "second");
    assert_eq!(
        (
            second.registers,
            second.spill_stores,
            second.spill_loads,
            second.static_shared
        ),
        (255, 40, 36, 8192)
    );
    // 255 registers fit 256 units (the file holds 65 536); 1024 units of 128 do not.
    assert_eq!(cube_registers(255, 256), REGISTERS_PER_SM);
    assert!(cube_registers(128, 1024) > REGISTERS_PER_SM);
    // Registers go to a warp in units of 256: 33 per unit take 40 per unit's worth.
    assert_eq!(cube_registers(33, 32), 1280);
}
