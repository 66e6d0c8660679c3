//! Stable LatentMoE forward and forward+backward at n = 64, k = 8, d = 512, ℓ = 256, 4096 tokens,
//! on the reference (tensor-op) path of the CPU backend.
//!
//! Baseline measured in the same run: a dense SiTU-GLU FFN with the same active compute per token
//! (`W_down` 512→256, one FFN 256→2048→256 = 8 experts' worth, `W_up` 256→512, the shared expert), so
//! the ratio is the cost of routing plus dropless dispatch over the FLOPs it has to do anyway.
//!
//! ```text
//! cargo bench --bench moe
//! ```

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Distribution, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use kimi_burn::nn::{BalancerKind, LatentMoeConfig, MoeLayout, SituGluConfig};

type Cpu = NdArray<f32>;

fn config() -> LatentMoeConfig {
    LatentMoeConfig::new(512, 64, 8, 256)
        .with_layout(MoeLayout::StableLatent { dim: 256 })
        .with_n_shared(1)
        .with_shared_hidden(Some(512))
        .with_balancer(BalancerKind::quantile())
}

fn bench_moe(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("latent_moe_n64_k8_d512_l256_4096tok");
    group.sample_size(10);

    let moe = config().init::<Cpu>(&device);
    let x = Tensor::<Cpu, 3>::random([8, 512, 512], Distribution::Normal(0.0, 1.0), &device);
    group.bench_function("forward", |b| {
        b.iter(|| {
            let out = moe.forward(x.clone());
            Cpu::sync(&device).unwrap();
            out.stats.dead_experts
        })
    });

    let down = SituGluConfig::new(512, 512).init::<Cpu>(&device);
    let ffn = SituGluConfig::new(256, 2048).init::<Cpu>(&device);
    let proj = burn::nn::LinearConfig::new(512, 256)
        .with_bias(false)
        .init::<Cpu>(&device);
    let back = burn::nn::LinearConfig::new(256, 512)
        .with_bias(false)
        .init::<Cpu>(&device);
    group.bench_function("dense_equal_active_forward", |b| {
        b.iter(|| {
            let y = back
                .forward(ffn.forward(proj.forward(x.clone())))
                .add(down.forward(x.clone()));
            Cpu::sync(&device).unwrap();
            y
        })
    });

    type Ad = Autodiff<Cpu>;
    let moe = config().init::<Ad>(&device);
    let x = Tensor::<Ad, 3>::random([8, 512, 512], Distribution::Normal(0.0, 1.0), &device);
    group.bench_function("forward_backward", |b| {
        b.iter(|| {
            let out = moe.forward(x.clone());
            let grads = out.output.sum().backward();
            moe.balance.update();
            drop(grads);
            Cpu::sync(&device).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, bench_moe);
criterion_main!(benches);
