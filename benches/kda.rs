//! KDA op benchmarks: `chunk_kda` forward and forward + backward at B = 1, H = 4, K = V = 64 for
//! T ∈ {512, 2048, 8192} (on ndarray also B = 4 at T = 2048, the `…_b4` groups, and both on inputs
//! out of every cache, the `…_cold` groups), and `fused_recurrent_kda` per decode token at
//! B = 1 and 16; on CUDA also the target shape B = 1, H = 64, K = V = 128, T = 16384. On ndarray,
//! and on wgpu with `--features wgpu` (CUDA with `--features cuda`), where every group runs twice:
//! `…-kernel` (the CubeCL KDA kernels) and `…-reference` (tensor ops, kernels switched off).
//!
//! The plain groups measure what `../shared/baselines/torch_blocks.py kda` measures, so that
//! `scripts/cpu-vs-torch.sh` can put them side by side: a zero initial state, the output only, and
//! for the backward `sum(o · dout)` with a fixed random `dout`. The `…_state` groups (the GPU
//! backends, and T = 2048 on ndarray) start from a random state, return the final state and take
//! the gradient of `sum(o) + sum(S_T)` as well.
//!
//! `cargo bench --bench kda -- --warm-up-time 1 --measurement-time 3`
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kimi_burn::ops::kda::{chunk_kda, fused_recurrent_kda, KdaOptions};

#[path = "common/kda_inputs.rs"]
mod kda_inputs;
use kda_inputs::{inputs, Inputs};

/// Rows, heads, key = value dim and lengths of a bench group; `name` is appended to the group
/// name.
struct Dims {
    name: &'static str,
    batch: usize,
    h: usize,
    k: usize,
    lengths: &'static [usize],
}

/// B = 1, H = 4, K = V = 64: the shape every backend runs.
const SMALL: Dims = Dims {
    name: "",
    batch: 1,
    h: 4,
    k: 64,
    lengths: &[512, 2048, 8192],
};

/// The CUDA target of issue #7: B = 1, H = 64, K = V = 128, T = 16384 (f32 storage).
#[cfg(feature = "cuda")]
const K3: Dims = Dims {
    name: "_h64_k128",
    batch: 1,
    h: 64,
    k: 128,
    lengths: &[16384],
};

/// The options of a call: from a zero state with the output only (`state` false), or from the
/// random initial state with the final state returned.
fn options<B: Backend>(x: &Inputs<B>, state: bool) -> KdaOptions<B> {
    if state {
        KdaOptions::default()
            .with_initial_state(x.h0.clone())
            .with_final_state(true)
    } else {
        KdaOptions::default()
    }
}

/// The group name suffix of the stateful variant.
fn suffix(state: bool) -> &'static str {
    if state {
        "_state"
    } else {
        ""
    }
}

fn sync<B: Backend>(t: Tensor<B, 4>) {
    // One element back to the host: waits for the whole graph on asynchronous backends.
    let _ = t.slice([0..1, 0..1, 0..1, 0..1]).into_data();
}

/// One `chunk_kda` forward on `x`, waited for.
fn call<B: Backend>(x: &Inputs<B>, state: bool) {
    let (o, _) = chunk_kda(
        x.q.clone(),
        x.k.clone(),
        x.v.clone(),
        x.g.clone(),
        x.beta.clone(),
        options(x, state),
    );
    sync(o);
}

/// The inputs of the `…_cold` groups span at least this many bytes: beyond any last-level cache.
const COLD_BYTES: usize = 256 << 20;

/// The sets of inputs that the calls of a bench take in turn: one set, reused (it stays in the
/// last-level cache from call to call when small), or with `cold` copies spanning at least
/// [`COLD_BYTES`], so that each call reads inputs that the calls before it have pushed out of
/// every cache, as in training, where a layer's inputs were produced a whole layer earlier. Made
/// when the bench first runs, so that a filtered-out group costs nothing.
fn input_sets<B: Backend>(t: usize, dims: &Dims, cold: bool, device: &B::Device) -> Vec<Inputs<B>> {
    // q, k, g, v, dout and o: six rows of K = V floats per token and head.
    let bytes = dims.batch * t * dims.h * dims.k * 6 * 4;
    let copies = if cold {
        COLD_BYTES.div_ceil(bytes).max(2)
    } else {
        1
    };
    (0..copies)
        .map(|_| inputs::<B>([dims.batch, t, dims.h, dims.k], device))
        .collect()
}

/// The group name suffix of the inputs out of every cache.
fn cold_suffix(cold: bool) -> &'static str {
    if cold {
        "_cold"
    } else {
        ""
    }
}

/// `chunk_kda` forward (`…_cold`: on inputs out of every cache, see [`input_sets`]).
fn forward<B: Backend>(
    c: &mut Criterion,
    backend: &str,
    dims: &Dims,
    state: bool,
    cold: bool,
    device: &B::Device,
) {
    let name = format!(
        "chunk_kda_fwd{}{}{}/{backend}",
        dims.name,
        suffix(state),
        cold_suffix(cold)
    );
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    for &t in dims.lengths {
        let (mut sets, mut turn) = (None, 0usize);
        group.throughput(Throughput::Elements((dims.batch * t) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(t), &t, |bench, _| {
            let sets = sets.get_or_insert_with(|| input_sets::<B>(t, dims, cold, device));
            bench.iter(|| {
                turn += 1;
                call(&sets[turn % sets.len()], state)
            })
        });
    }
    group.finish();
}

/// `chunk_kda` forward and the backward of its loss (`…_cold`: on inputs out of every cache).
fn forward_backward<B: AutodiffBackend>(
    c: &mut Criterion,
    backend: &str,
    dims: &Dims,
    state: bool,
    cold: bool,
    device: &B::Device,
) {
    let name = format!(
        "chunk_kda_fwd_bwd{}{}{}/{backend}",
        dims.name,
        suffix(state),
        cold_suffix(cold)
    );
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    for &t in dims.lengths {
        let (mut sets, mut turn) = (None, 0usize);
        group.throughput(Throughput::Elements((dims.batch * t) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(t), &t, |bench, _| {
            let sets = sets.get_or_insert_with(|| input_sets::<B>(t, dims, cold, device));
            bench.iter(|| {
                turn += 1;
                let x = &sets[turn % sets.len()];
                let q = x.q.clone().require_grad();
                let k = x.k.clone().require_grad();
                let v = x.v.clone().require_grad();
                let g = x.g.clone().require_grad();
                let beta = x.beta.clone().require_grad();
                let (o, s) = chunk_kda(q.clone(), k, v, g, beta, options(x, state));
                let loss = match s {
                    Some(s) => o.sum().add(s.sum()),
                    None => o.mul(x.dout.clone()).sum(),
                };
                let grads = loss.backward();
                if let Some(dq) = q.grad(&grads) {
                    let _ = dq.slice([0..1, 0..1, 0..1, 0..1]).into_data();
                }
            })
        });
    }
    group.finish();
}

/// One decode token of `batch` sequences, carrying the state from call to call. The state is
/// handed over (moved), as a decode loop does, so that the op may update it in place (as PyTorch's
/// baseline step does).
fn decode<B: Backend>(c: &mut Criterion, backend: &str, batch: usize, device: &B::Device) {
    let x = inputs::<B>([batch, 1, SMALL.h, SMALL.k], device);
    let mut state = Some(x.h0.clone());
    let rows = if batch == 1 {
        String::new()
    } else {
        format!("_b{batch}")
    };
    c.bench_function(
        &format!("fused_recurrent_kda_decode_token{rows}/{backend}"),
        |bench| {
            bench.iter(|| {
                let (o, s) = fused_recurrent_kda(
                    x.q.clone(),
                    x.k.clone(),
                    x.v.clone(),
                    x.g.clone(),
                    x.beta.clone(),
                    KdaOptions::default()
                        .with_initial_state(state.take().expect("the last step's state"))
                        .with_final_state(true),
                );
                state = s;
                sync(o);
            })
        },
    );
}

fn ndarray(c: &mut Criterion) {
    let device = Default::default();
    type A = Autodiff<NdArray<f32>>;
    for cold in [false, true] {
        forward::<NdArray<f32>>(c, "ndarray", &SMALL, false, cold, &device);
        forward_backward::<A>(c, "ndarray", &SMALL, false, cold, &device);
    }
    let one = Dims {
        lengths: &[2048],
        ..SMALL
    };
    forward_backward::<A>(c, "ndarray", &one, true, false, &device);
    // The tokens of T = 8192 in four rows, as a training batch brings them: every row's heads
    // can run together on one thread.
    let rows = Dims {
        name: "_b4",
        batch: 4,
        lengths: &[2048],
        ..SMALL
    };
    forward::<NdArray<f32>>(c, "ndarray", &rows, false, false, &device);
    forward_backward::<A>(c, "ndarray", &rows, false, false, &device);
    for batch in [1, 16] {
        decode::<NdArray<f32>>(c, "ndarray", batch, &device);
    }
}

/// The KDA kernels against the reference tensor ops on the same CubeCL backend: `chunk_kda`
/// forward (inference, untracked inputs) and one decode token, each once with the kernels and once
/// with them switched off.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_vs_reference<B: Backend>(
    c: &mut Criterion,
    backend: &str,
    dims: &Dims,
    device: &B::Device,
) {
    use kimi_burn::ops::with_kernels;
    for (path, on) in [("kernel", true), ("reference", false)] {
        with_kernels(on, || {
            forward::<B>(c, &format!("{backend}-{path}"), dims, true, false, device);
            if dims.name.is_empty() {
                decode::<B>(c, &format!("{backend}-{path}"), 1, device);
            }
        });
    }
}

/// `chunk_kda` forward + backward (training) with the fused kernels and with the reference
/// tensor ops' autodiff, on the same CubeCL backend.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_vs_reference_backward<B: AutodiffBackend>(
    c: &mut Criterion,
    backend: &str,
    dims: &Dims,
    device: &B::Device,
) {
    use kimi_burn::ops::with_kernels;
    for (path, on) in [("kernel", true), ("reference", false)] {
        with_kernels(on, || {
            forward_backward::<B>(c, &format!("{backend}-{path}"), dims, true, false, device);
        });
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    use burn::backend::Wgpu;
    let device = Default::default();
    kernel_vs_reference::<Wgpu>(c, "wgpu", &SMALL, &device);
    kernel_vs_reference_backward::<Autodiff<Wgpu>>(c, "wgpu", &SMALL, &device);
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::backend::Cuda;
    let device = Default::default();
    for dims in [&SMALL, &K3] {
        kernel_vs_reference::<Cuda>(c, "cuda", dims, &device);
        kernel_vs_reference_backward::<Autodiff<Cuda>>(c, "cuda", dims, &device);
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, ndarray, wgpu, cuda);
criterion_main!(benches);
