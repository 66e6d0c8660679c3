//! The tiny preset: one decoder layer of each kind (KDA + MoE, MLA + MoE), forward and
//! forward+backward, and decode throughput of the whole tiny model with and without the cache.
//!
//! ```text
//! cargo bench --bench model
//! ```
//!
//! A "layer" here is a one-layer model (embedding and `lm_head` of the tiny preset included, about
//! 10% of the work), so the two kinds are comparable within the run. The decode baseline is the
//! same generation without a cache (a full forward pass over the whole prefix for every token).
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::ops::backend::on_cpu_pool;

type Cpu = NdArray<f32>;
type Ad = Autodiff<Cpu>;

fn one_layer(mla: bool) -> KimiConfig {
    let mut c = KimiConfig::tiny();
    c.num_hidden_layers = 1;
    c.first_k_dense_replace = 0;
    c.full_attn_layers = if mla { vec![0] } else { vec![] };
    c.attn_res_block_size = None;
    c
}

fn ids<B: Backend>(batch: usize, t: usize, vocab: usize, device: &B::Device) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = (0..batch * t)
        .map(|i| ((i * 7919) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(v, [batch, t]), device)
}

fn bench_layers(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("tiny_decoder_layer_8x256");
    group.sample_size(10);
    for (name, mla) in [("kda_moe", false), ("mla_moe", true)] {
        let config = one_layer(mla);
        let model: KimiForCausalLM<Cpu> = config.init(&device);
        let x = ids::<Cpu>(8, 256, config.vocab_size, &device);
        group.bench_function(BenchmarkId::new("forward", name), |b| {
            b.iter(|| model.forward(x.clone()).into_data())
        });
        let model: KimiForCausalLM<Ad> = config.init(&device);
        let x = ids::<Ad>(8, 256, config.vocab_size, &device);
        group.bench_function(BenchmarkId::new("forward_backward", name), |b| {
            // Forward and backward as one piece on rayon's pool, as a training loop of a user's
            // own runs them (`accumulate_gradients` does the same).
            b.iter(|| {
                let grads = on_cpu_pool::<Ad, _>(|| model.forward(x.clone()).sum().backward());
                model.update_balance();
                drop(grads);
                Cpu::sync(&device).unwrap();
            })
        });
    }
    group.finish();
}

fn bench_decode(c: &mut Criterion) {
    let device = Default::default();
    let config = KimiConfig::tiny();
    let model: KimiForCausalLM<Cpu> = config.init(&device);
    let prompt = ids::<Cpu>(1, 64, config.vocab_size, &device);
    let mut group = c.benchmark_group("tiny_decode_64_after_64");
    group.sample_size(10);
    group.throughput(criterion::Throughput::Elements(64));
    group.bench_function("cached", |b| {
        b.iter(|| {
            model
                .generate(prompt.clone(), 64, kimi_burn::generate::Sampling::Greedy)
                .unwrap()
                .into_data()
        })
    });
    group.bench_function("no_cache_baseline", |b| {
        b.iter(|| {
            let mut seq = prompt.clone();
            for _ in 0..64 {
                let logits = model.forward(seq.clone());
                let t = logits.dims()[1];
                let next = logits.narrow(1, t - 1, 1).argmax(2).reshape([1, 1]);
                seq = Tensor::cat(vec![seq, next], 1);
            }
            seq.into_data()
        })
    });
    group.finish();
}

criterion_group!(benches, bench_layers, bench_decode);
criterion_main!(benches);
