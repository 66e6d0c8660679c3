//! KDA op benchmarks: `chunk_kda` forward and forward + backward at B = 1, H = 4, K = V = 64 for
//! T ∈ {512, 2048, 8192}, and `fused_recurrent_kda` per decode token; on CUDA also the target
//! shape B = 1, H = 64, K = V = 128, T = 16384. On ndarray, and on wgpu with
//! `--features wgpu` (CUDA with `--features cuda`), where every group runs twice, `…-kernel` (the
//! CubeCL KDA kernels) and `…-reference` (tensor ops, kernels switched off).
//!
//! `cargo bench --bench kda -- --warm-up-time 1 --measurement-time 3`

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kimi_burn::ops::kda::{chunk_kda, fused_recurrent_kda, KdaOptions};

/// Heads, key = value dim and lengths of a bench group; `name` is appended to the group name.
struct Dims {
    name: &'static str,
    h: usize,
    k: usize,
    lengths: &'static [usize],
}

/// B = 1, H = 4, K = V = 64: the shape every backend runs.
const SMALL: Dims = Dims {
    name: "",
    h: 4,
    k: 64,
    lengths: &[512, 2048, 8192],
};

/// The CUDA target of issue #7: B = 1, H = 64, K = V = 128, T = 16384 (f32 storage).
#[cfg(feature = "cuda")]
const K3: Dims = Dims {
    name: "_h64_k128",
    h: 64,
    k: 128,
    lengths: &[16384],
};

struct Inputs<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Tensor<B, 4>,
}

fn inputs<B: Backend>(t: usize, dims: &Dims, device: &B::Device) -> Inputs<B> {
    let (h, k) = (dims.h, dims.k);
    B::seed(device, 0);
    let normal =
        |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    // Unit-norm keys and logsigmoid(randn) gates, as in the tests.
    let unit = |x: Tensor<B, 4>| x.clone().div(x.square().sum_dim(3).sqrt());
    let gate = normal([1, t, h, k]).neg().exp().log1p().neg();
    Inputs {
        q: unit(normal([1, t, h, k])),
        k: unit(normal([1, t, h, k])),
        v: normal([1, t, h, k]),
        g: gate,
        beta: Tensor::random([1, t, h], Distribution::Uniform(0.0, 1.0), device),
        h0: normal([1, h, k, k]),
    }
}

fn sync<B: Backend>(t: Tensor<B, 4>) {
    // One element back to the host: waits for the whole graph on asynchronous backends.
    let _ = t.slice([0..1, 0..1, 0..1, 0..1]).into_data();
}

fn forward<B: Backend>(c: &mut Criterion, backend: &str, dims: &Dims, device: &B::Device) {
    let mut group = c.benchmark_group(format!("chunk_kda_fwd{}/{backend}", dims.name));
    group.sample_size(10);
    for &t in dims.lengths {
        let x = inputs::<B>(t, dims, device);
        group.throughput(Throughput::Elements(t as u64));
        group.bench_with_input(BenchmarkId::from_parameter(t), &t, |bench, _| {
            bench.iter(|| {
                let (o, _) = chunk_kda(
                    x.q.clone(),
                    x.k.clone(),
                    x.v.clone(),
                    x.g.clone(),
                    x.beta.clone(),
                    KdaOptions::default().with_initial_state(x.h0.clone()),
                );
                sync(o);
            })
        });
    }
    group.finish();
}

fn forward_backward<B: AutodiffBackend>(
    c: &mut Criterion,
    backend: &str,
    dims: &Dims,
    device: &B::Device,
) {
    let mut group = c.benchmark_group(format!("chunk_kda_fwd_bwd{}/{backend}", dims.name));
    group.sample_size(10);
    for &t in dims.lengths {
        let x = inputs::<B>(t, dims, device);
        group.throughput(Throughput::Elements(t as u64));
        group.bench_with_input(BenchmarkId::from_parameter(t), &t, |bench, _| {
            bench.iter(|| {
                let q = x.q.clone().require_grad();
                let k = x.k.clone().require_grad();
                let v = x.v.clone().require_grad();
                let g = x.g.clone().require_grad();
                let beta = x.beta.clone().require_grad();
                let (o, s) = chunk_kda(
                    q.clone(),
                    k,
                    v,
                    g,
                    beta,
                    KdaOptions::default()
                        .with_initial_state(x.h0.clone())
                        .with_final_state(true),
                );
                let loss = o
                    .sum()
                    .add(s.map_or_else(|| q.zeros_like().sum(), |s| s.sum()));
                let grads = loss.backward();
                if let Some(dq) = q.grad(&grads) {
                    let _ = dq.slice([0..1, 0..1, 0..1, 0..1]).into_data();
                }
            })
        });
    }
    group.finish();
}

fn decode<B: Backend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    let x = inputs::<B>(1, &SMALL, device);
    let mut state = x.h0.clone();
    c.bench_function(
        &format!("fused_recurrent_kda_decode_token/{backend}"),
        |bench| {
            bench.iter(|| {
                let (o, s) = fused_recurrent_kda(
                    x.q.clone(),
                    x.k.clone(),
                    x.v.clone(),
                    x.g.clone(),
                    x.beta.clone(),
                    KdaOptions::default()
                        .with_initial_state(state.clone())
                        .with_final_state(true),
                );
                if let Some(s) = s {
                    state = s;
                }
                sync(o);
            })
        },
    );
}

fn ndarray(c: &mut Criterion) {
    let device = Default::default();
    forward::<NdArray<f32>>(c, "ndarray", &SMALL, &device);
    forward_backward::<Autodiff<NdArray<f32>>>(c, "ndarray", &SMALL, &device);
    decode::<NdArray<f32>>(c, "ndarray", &device);
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
            forward::<B>(c, &format!("{backend}-{path}"), dims, device);
            if dims.name.is_empty() {
                decode::<B>(c, &format!("{backend}-{path}"), device);
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
            forward_backward::<B>(c, &format!("{backend}-{path}"), dims, device);
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
