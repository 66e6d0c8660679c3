//! KDA op benchmarks: `chunk_kda` forward and forward + backward at B = 1, H = 4, K = V = 64 for
//! T ∈ {512, 2048, 8192}, and `fused_recurrent_kda` per decode token. On ndarray, and on wgpu with
//! `--features wgpu` (CUDA with `--features cuda`), where the forward and decode groups run twice,
//! `…-kernel` (the CubeCL KDA kernels) and `…-reference` (tensor ops, kernels switched off).
//!
//! `cargo bench --bench kda -- --warm-up-time 1 --measurement-time 3`

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kimi_burn::ops::kda::{chunk_kda, fused_recurrent_kda, KdaOptions};

const H: usize = 4;
const K: usize = 64;
const LENGTHS: [usize; 3] = [512, 2048, 8192];

struct Inputs<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Tensor<B, 4>,
}

fn inputs<B: Backend>(t: usize, device: &B::Device) -> Inputs<B> {
    B::seed(device, 0);
    let normal =
        |shape: [usize; 4]| Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device);
    // Unit-norm keys and logsigmoid(randn) gates, as in the tests.
    let unit = |x: Tensor<B, 4>| x.clone().div(x.square().sum_dim(3).sqrt());
    let gate = normal([1, t, H, K]).neg().exp().log1p().neg();
    Inputs {
        q: unit(normal([1, t, H, K])),
        k: unit(normal([1, t, H, K])),
        v: normal([1, t, H, K]),
        g: gate,
        beta: Tensor::random([1, t, H], Distribution::Uniform(0.0, 1.0), device),
        h0: normal([1, H, K, K]),
    }
}

fn sync<B: Backend>(t: Tensor<B, 4>) {
    // One element back to the host: waits for the whole graph on asynchronous backends.
    let _ = t.slice([0..1, 0..1, 0..1, 0..1]).into_data();
}

fn forward<B: Backend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    let mut group = c.benchmark_group(format!("chunk_kda_fwd/{backend}"));
    group.sample_size(10);
    for t in LENGTHS {
        let x = inputs::<B>(t, device);
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

fn forward_backward<B: AutodiffBackend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    let mut group = c.benchmark_group(format!("chunk_kda_fwd_bwd/{backend}"));
    group.sample_size(10);
    for t in LENGTHS {
        let x = inputs::<B>(t, device);
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
    let x = inputs::<B>(1, device);
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
    forward::<NdArray<f32>>(c, "ndarray", &device);
    forward_backward::<Autodiff<NdArray<f32>>>(c, "ndarray", &device);
    decode::<NdArray<f32>>(c, "ndarray", &device);
}

/// The KDA kernels against the reference tensor ops on the same CubeCL backend: `chunk_kda`
/// forward (inference, untracked inputs) and one decode token, each once with the kernels and once
/// with them switched off.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn kernel_vs_reference<B: Backend>(c: &mut Criterion, backend: &str, device: &B::Device) {
    use kimi_burn::ops::with_kernels;
    for (path, on) in [("kernel", true), ("reference", false)] {
        with_kernels(on, || {
            forward::<B>(c, &format!("{backend}-{path}"), device);
            decode::<B>(c, &format!("{backend}-{path}"), device);
        });
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    use burn::backend::Wgpu;
    let device = Default::default();
    kernel_vs_reference::<Wgpu>(c, "wgpu", &device);
    forward_backward::<Autodiff<Wgpu>>(c, "wgpu", &device);
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::backend::Cuda;
    let device = Default::default();
    kernel_vs_reference::<Cuda>(c, "cuda", &device);
    forward_backward::<Autodiff<Cuda>>(c, "cuda", &device);
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, ndarray, wgpu, cuda);
criterion_main!(benches);
