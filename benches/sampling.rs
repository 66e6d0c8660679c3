//! Picking the next tokens from a decode step's logits `[rows, vocab]` on the GPU backends, each
//! group's two ways in the same run: `device` (`Sampling::pick_on_device`, then one read of the
//! `[rows]` ids: what `generate` does there) and `host` (one read of the logits, then
//! `Sampling::pick` per row on the host: what it did before). Greedy, top-k 50 with top-p 0.9,
//! and top-p 0.9 over the whole vocabulary (the device's most expensive case: two threshold
//! searches of 36 halvings).
//!
//! * `…_8x512`: the tiny model's vocabulary, 8 sequences.
//! * `…_1x163840`: Kimi's vocabulary, one sequence; on CUDA also `…_8x163840`.
//!
//! `cargo bench --features wgpu --bench sampling -- --warm-up-time 1 --measurement-time 3`
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use criterion::{criterion_group, criterion_main, Criterion};

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu {
    use burn::tensor::backend::Backend;
    use burn::tensor::{Distribution, Tensor};
    use criterion::Criterion;
    use kimi_burn::generate::Sampling;

    /// The rules compared, by name.
    fn rules() -> [(&'static str, Sampling); 3] {
        [
            ("greedy", Sampling::Greedy),
            (
                "top_k50_p0.9",
                Sampling::TopKTopP {
                    temperature: 0.8,
                    top_k: 50,
                    top_p: 0.9,
                    seed: 1,
                },
            ),
            (
                "top_p0.9",
                Sampling::TopP {
                    temperature: 0.8,
                    top_p: 0.9,
                    seed: 1,
                },
            ),
        ]
    }

    /// Both ways of every rule at `[rows, vocab]` logits drawn from N(0, 3²).
    pub fn group<B: Backend>(c: &mut Criterion, backend: &str, [rows, vocab]: [usize; 2]) {
        let device = Default::default();
        B::seed(&device, 0);
        let logits = Tensor::<B, 2>::random([rows, vocab], Distribution::Normal(0.0, 3.0), &device);
        let u: Vec<f64> = (0..rows).map(|r| (r as f64 + 0.5) / rows as f64).collect();
        let mut group = c.benchmark_group(format!("{backend}_sampling_{rows}x{vocab}"));
        group.sample_size(10);
        for (name, rule) in rules() {
            group.bench_function(format!("{name}/device"), |bench| {
                bench.iter(|| {
                    let ids = rule
                        .pick_on_device(logits.clone(), &u)
                        .expect("a valid rule");
                    let _ = ids.into_data();
                })
            });
            group.bench_function(format!("{name}/host"), |bench| {
                bench.iter(|| {
                    let values: Vec<f32> = logits.clone().into_data().iter::<f32>().collect();
                    let ids: Vec<usize> = values
                        .chunks_exact(vocab)
                        .zip(&u)
                        .map(|(row, &u)| rule.pick(row, u).expect("a valid rule"))
                        .collect();
                    std::hint::black_box(ids);
                })
            });
        }
        group.finish();
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    use burn::backend::Wgpu;
    for shape in [[8, 512], [1, 163_840]] {
        gpu::group::<Wgpu>(c, "wgpu", shape);
    }
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::backend::Cuda;
    for shape in [[8, 512], [1, 163_840], [8, 163_840]] {
        gpu::group::<Cuda>(c, "cuda", shape);
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, wgpu, cuda);
criterion_main!(benches);
