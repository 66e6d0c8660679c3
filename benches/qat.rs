//! The cost of MX quantisation-aware training (design §9): the same module with and without QAT
//! (MXFP4 weights, MXFP8 E4M3 activations on the routed experts), in the same run.
//!
//! ```text
//! cargo bench --bench qat
//! cargo bench --bench qat --features wgpu     # adds the wgpu (kernel path) groups
//! ```
//!
//! * `qat_latent_moe_n64_k8_d512_l256_4096tok`: the Stable LatentMoE layer of `benches/moe.rs`,
//!   forward + backward on the CPU backend (host kernels).
//! * `qat_tiny_train_step_4x256`: one forward + backward of the whole tiny model (the step of
//!   `train_tiny` without the optimiser) on the CPU backend.
//! * With `wgpu`: the small MoE of `benches/moe.rs`'s GPU group and the tiny training step on the
//!   wgpu backend, kernel path (the MX kernel, and the hidden quantisation inside the fused experts).
//!
//! The ratio "with QAT / without" of each pair is the cost of QAT.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Distribution, Int, Tensor, TensorData};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::nn::{BalancerKind, LatentMoeConfig, MoeLayout};
use kimi_burn::ops::quant::QatConfig;

type Cpu = NdArray<f32>;

/// A QAT recipe, by constructor.
type Recipe = Option<fn() -> QatConfig>;

const VARIANTS: [(&str, Recipe); 2] = [
    ("full_precision", None),
    ("qat_mxfp4", Some(QatConfig::mxfp4)),
];

fn ids<B: Backend>(batch: usize, t: usize, vocab: usize, device: &B::Device) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = (0..batch * t)
        .map(|i| ((i * 7919) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [batch, t]), device)
}

/// One forward + backward of `moe` on `x`, then the balance update.
fn moe_step<B: burn::tensor::backend::AutodiffBackend>(
    moe: &kimi_burn::nn::LatentMoe<B>,
    x: &Tensor<B, 3>,
    device: &B::Device,
) {
    let out = moe.forward(x.clone());
    let grads = out.output.sum().backward();
    moe.balance.update();
    drop(grads);
    B::sync(device).unwrap();
}

/// One forward + backward of the whole model on `x`, then the balance update.
fn model_step<B: burn::tensor::backend::AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    x: &Tensor<B, 2, Int>,
    device: &B::Device,
) {
    let grads = model.forward(x.clone()).sum().backward();
    model.update_balance();
    drop(grads);
    B::sync(device).unwrap();
}

fn tiny(qat: Option<QatConfig>) -> KimiConfig {
    let mut c = KimiConfig::tiny();
    c.vocab_size = 256;
    c.moe.qat = qat;
    c
}

/// The layer of `cfg` on `x_shape` inputs, forward + backward, with and without QAT.
fn bench_moe_pair<B: burn::tensor::backend::AutodiffBackend>(
    c: &mut Criterion,
    group: &str,
    cfg: LatentMoeConfig,
    x_shape: [usize; 3],
) {
    let device = B::Device::default();
    let mut group = c.benchmark_group(group);
    group.sample_size(10);
    let x = Tensor::<B, 3>::random(x_shape, Distribution::Normal(0.0, 1.0), &device);
    for (name, qat) in VARIANTS {
        let moe = cfg.clone().with_qat(qat.map(|f| f())).init::<B>(&device);
        group.bench_function(BenchmarkId::new("forward_backward", name), |b| {
            b.iter(|| moe_step(&moe, &x, &device))
        });
    }
    group.finish();
}

/// The tiny model's step on `batch` sequences of 256 tokens, with and without QAT.
fn bench_tiny_pair<B: burn::tensor::backend::AutodiffBackend>(
    c: &mut Criterion,
    group: &str,
    batch: usize,
) {
    let device = B::Device::default();
    let mut group = c.benchmark_group(group);
    group.sample_size(10);
    let x = ids::<B>(batch, 256, 256, &device);
    for (name, qat) in VARIANTS {
        let model: KimiForCausalLM<B> = tiny(qat.map(|f| f())).init(&device);
        group.bench_function(BenchmarkId::new("forward_backward", name), |b| {
            b.iter(|| model_step(&model, &x, &device))
        });
    }
    group.finish();
}

fn bench_cpu(c: &mut Criterion) {
    type Ad = Autodiff<Cpu>;
    let device = Default::default();
    bench_moe_pair::<Ad>(
        c,
        "qat_latent_moe_n64_k8_d512_l256_4096tok",
        LatentMoeConfig::new(512, 64, 8, 256)
            .with_layout(MoeLayout::StableLatent { dim: 256 })
            .with_n_shared(1)
            .with_shared_hidden(Some(512))
            .with_balancer(BalancerKind::quantile()),
        [8, 512, 512],
    );

    // The op alone: the layer's stacked expert weights `[64, 256, 256]` along their input axis,
    // without autodiff, and with it (forward + the straight-through backward).
    let mut group = c.benchmark_group("mx_fake_quant_64x256x256_axis1");
    group.sample_size(10);
    let w = Tensor::<Cpu, 3>::random([64, 256, 256], Distribution::Normal(0.0, 1.0), &device);
    group.bench_function("forward", |b| {
        b.iter(|| QatConfig::mxfp4().weight(w.clone(), 1).into_data())
    });
    let w_ad = Tensor::<Ad, 3>::from_inner(w.clone()).require_grad();
    group.bench_function("forward_backward", |b| {
        b.iter(|| {
            let grads = QatConfig::mxfp4().weight(w_ad.clone(), 1).sum().backward();
            drop(grads);
        })
    });
    group.finish();

    bench_tiny_pair::<Ad>(c, "qat_tiny_train_step_4x256", 4);
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(c: &mut Criterion) {
    type G = Autodiff<burn::backend::Wgpu>;
    bench_moe_pair::<G>(
        c,
        "wgpu_qat_moe_n16_k4_d128_l64_1024tok",
        LatentMoeConfig::new(128, 16, 4, 128)
            .with_layout(MoeLayout::StableLatent { dim: 64 })
            .with_n_shared(1)
            .with_balancer(BalancerKind::quantile()),
        [1, 1024, 128],
    );
    bench_tiny_pair::<G>(c, "wgpu_qat_tiny_train_step_2x256", 2);
}

#[cfg(not(feature = "wgpu"))]
criterion_group!(benches, bench_cpu);
#[cfg(feature = "wgpu")]
criterion_group!(benches, bench_cpu, bench_wgpu);
criterion_main!(benches);
