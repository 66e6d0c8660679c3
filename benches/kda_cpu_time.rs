//! Where KDA's time on the CPU goes as T grows: `chunk_kda` forward, and forward + backward, on
//! `Autodiff<NdArray<f32>>` at B = 1, H = 4, K = V = 64 (the `kda` bench's shape, inputs and
//! loss, `sum(o · dout)`), per token, split into the wall-clock time, the CPU time the process
//! spent in its own code (user) and in the kernel (system), and the page faults per call.
//!
//! The `kda` bench gives the wall-clock time only. This one tells how much of its growth with T
//! is the op's own work (user time per token, which a linear-time op keeps constant) and how much
//! the operating system's: the kernel zeroing and mapping fresh pages for outputs that the
//! allocator had handed back to it (glibc trims the top of its heap once more than its trim
//! threshold is free there; see `ops::backend::retain_freed_memory`).
//!
//! ```text
//! cargo bench --bench kda_cpu_time                 # the allocator as the process found it
//! cargo bench --bench kda_cpu_time -- --retain     # after ops::backend::retain_freed_memory()
//! ```
//!
//! Options: `--rounds N` (default 5; each round measures every length once, in turn, so that a
//! neighbour's load on a shared machine hits them alike), `--tokens N` (tokens per measurement,
//! default 131072), `--retain`. The times come from `getrusage` over all the process's threads;
//! the table shows the median of the rounds. Keep the machine otherwise idle. Run without
//! `--bench` (as `cargo test --benches` does), it makes one quick round of two calls per length.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::Tensor;
use kimi_burn::ops::kda::{chunk_kda, KdaOptions};

// The `kda` bench's inputs; the initial state goes unused here.
#[allow(dead_code)]
#[path = "common/kda_inputs.rs"]
mod kda_inputs;
use kda_inputs::{inputs, Inputs};

type B = Autodiff<NdArray<f32>>;

/// Heads and key = value dim: the `kda` bench's shape.
const H: usize = 4;
const K: usize = 64;
const LENGTHS: [usize; 3] = [512, 2048, 8192];

/// The process's CPU time so far, user and system (seconds), and its minor page faults.
fn usage() -> (f64, f64, i64) {
    // SAFETY: `getrusage` fills the struct it is given; all-zero is a valid `rusage`.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (secs(u.ru_utime), secs(u.ru_stime), u.ru_minflt)
}

/// One call: the forward alone, or the forward and the backward of `sum(o · dout)`.
fn call(x: &Inputs<B>, backward: bool) {
    let tracked = |t: &Tensor<B, 4>| {
        if backward {
            t.clone().require_grad()
        } else {
            t.clone()
        }
    };
    let q = tracked(&x.q);
    let beta = if backward {
        x.beta.clone().require_grad()
    } else {
        x.beta.clone()
    };
    let (o, _) = chunk_kda(
        q.clone(),
        tracked(&x.k),
        tracked(&x.v),
        tracked(&x.g),
        beta,
        KdaOptions::default(),
    );
    if backward {
        let grads = o.mul(x.dout.clone()).sum().backward();
        let dq = q.grad(&grads).expect("q takes part in the loss");
        let _ = dq.slice([0..1, 0..1, 0..1, 0..1]).into_data();
    } else {
        let _ = o.slice([0..1, 0..1, 0..1, 0..1]).into_data();
    }
}

/// Per token: wall, user and system time (ns), and page faults per call.
#[derive(Clone, Copy)]
struct Sample {
    wall: f64,
    user: f64,
    system: f64,
    faults: f64,
}

fn measure(x: &Inputs<B>, t: usize, tokens: usize, backward: bool) -> Sample {
    // Two calls first: the allocator and the scratch pool settle at this length.
    call(x, backward);
    call(x, backward);
    let calls = tokens.div_ceil(t).max(2);
    let (u0, s0, f0) = usage();
    let start = Instant::now();
    for _ in 0..calls {
        call(x, backward);
    }
    let wall = start.elapsed().as_secs_f64();
    let (u1, s1, f1) = usage();
    let per_token = 1e9 / (calls * t) as f64;
    Sample {
        wall: wall * per_token,
        user: (u1 - u0) * per_token,
        system: (s1 - s0) * per_token,
        faults: (f1 - f0) as f64 / calls as f64,
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`) one quick round, as
    // criterion's benches run once there.
    let quick = !args.iter().any(|a| a == "--bench");
    let (mut rounds, mut tokens) = if quick { (1, 1) } else { (5, 131_072) };
    let mut retain = false;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a positive number"))
        };
        match arg.as_str() {
            "--rounds" => rounds = number("--rounds").max(1),
            "--tokens" => tokens = number("--tokens").max(1),
            "--retain" => retain = true,
            // What `cargo bench` adds (`--bench`) and criterion-style filters: not ours.
            _ => {}
        }
    }
    let kept = retain && kimi_burn::ops::backend::retain_freed_memory();
    println!(
        "chunk_kda on Autodiff<NdArray<f32>>, B = 1, H = {H}, K = V = {K}; {rounds} rounds of \
         {tokens} tokens per length; freed memory {}",
        if kept {
            "kept in the process (retain_freed_memory)"
        } else {
            "as the allocator treats it by default"
        }
    );
    let device = Default::default();
    let sets: Vec<Inputs<B>> = LENGTHS
        .iter()
        .map(|&t| inputs([1, t, H, K], &device))
        .collect();
    for (backward, name) in [(false, "forward"), (true, "forward + backward")] {
        // samples[length][round]
        let mut samples = vec![Vec::with_capacity(rounds); LENGTHS.len()];
        for _ in 0..rounds {
            for (i, &t) in LENGTHS.iter().enumerate() {
                samples[i].push(measure(&sets[i], t, tokens, backward));
            }
        }
        let med = |i: usize, f: fn(&Sample) -> f64| median(samples[i].iter().map(f).collect());
        println!();
        println!("{name}, per token (median of {rounds} rounds):");
        println!("| T | wall (ns) | user CPU (ns) | system CPU (ns) | page faults per call |");
        println!("|---|---|---|---|---|");
        for (i, t) in LENGTHS.iter().enumerate() {
            println!(
                "| {t} | {:.0} | {:.0} | {:.0} | {:.0} |",
                med(i, |s| s.wall),
                med(i, |s| s.user),
                med(i, |s| s.system),
                med(i, |s| s.faults)
            );
        }
        // Time per 4x T = 4 x the ratio of the times per token.
        let growth = |f: fn(&Sample) -> f64| {
            (1..LENGTHS.len())
                .map(|i| format!("{:.2}x", 4.0 * med(i, f) / med(i - 1, f)))
                .collect::<Vec<_>>()
                .join(" then ")
        };
        println!(
            "time per 4x T ({}): wall {}; user + system CPU {}; user CPU alone {}",
            LENGTHS.map(|t| t.to_string()).join(" -> "),
            growth(|s| s.wall),
            growth(|s| s.user + s.system),
            growth(|s| s.user)
        );
    }
}
