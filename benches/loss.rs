//! The training loss ([`masked_cross_entropy`]) on the GPU backends, each group twice in the same
//! run: `kernel` (the crate's cross-entropy kernels) and `reference` (the tensor-op form through
//! Burn's log-softmax, the kernels switched off).
//!
//! * `…_tiny_16x256x512`: the tiny model's loss (batch 16, 256 tokens, vocabulary 512).
//! * `…_1x256x32768`: a real vocabulary's width (256 tokens of 32 768 logits); on CUDA also
//!   `…_1x4096x163840`, Kimi's vocabulary.
//!
//! Forward on the backend, forward + backward on `Autodiff` over it; f32 logits, about 30% of the
//! targets ignored. Every iteration ends by reading one element back, so the time is the device's.
//!
//! `cargo bench --features wgpu --bench loss -- --warm-up-time 1 --measurement-time 3`
//!
//! [`masked_cross_entropy`]: kimi_burn::ops::loss::masked_cross_entropy
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use criterion::{criterion_group, criterion_main, Criterion};

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu {
    use burn::backend::Autodiff;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Distribution, Int, Tensor};
    use criterion::Criterion;
    use kimi_burn::data::IGNORE_INDEX;
    use kimi_burn::ops::loss::masked_cross_entropy;
    use kimi_burn::ops::with_kernels;

    /// `[batch, seq, vocab]` and the group name's suffix.
    pub type Shape = ([usize; 3], &'static str);

    pub const TINY: Shape = ([16, 256, 512], "tiny_16x256x512");
    pub const WIDE: Shape = ([1, 256, 32_768], "1x256x32768");

    /// The two paths of every group: `(name, kernels on)`.
    const PATHS: [(&str, bool); 2] = [("kernel", true), ("reference", false)];

    /// Targets in `[0, vocab)`, every third one the ignore index.
    fn targets<B: Backend>(
        batch: usize,
        seq: usize,
        vocab: usize,
        device: &B::Device,
    ) -> Tensor<B, 2, Int> {
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| {
                if i % 3 == 2 {
                    IGNORE_INDEX
                } else {
                    (i * 7919 % vocab) as i64
                }
            })
            .collect();
        Tensor::<B, 1, Int>::from_ints(ids.as_slice(), device).reshape([batch, seq])
    }

    /// Both paths' forward on `B` and forward + backward on `Autodiff<B>` at `shape`.
    pub fn group<B: Backend>(c: &mut Criterion, backend: &str, shape: Shape, device: &B::Device) {
        let ([batch, seq, vocab], name) = shape;
        B::seed(device, 0);
        let z = Tensor::<B, 3>::random([batch, seq, vocab], Distribution::Normal(0.0, 2.0), device);
        let t = targets::<B>(batch, seq, vocab, device);
        let mut group = c.benchmark_group(format!("{backend}_cross_entropy_{name}"));
        group.sample_size(10);
        for (path, on) in PATHS {
            group.bench_function(format!("forward/{path}"), |bench| {
                bench.iter(|| {
                    let l = with_kernels(on, || {
                        masked_cross_entropy(z.clone(), t.clone(), IGNORE_INDEX)
                    });
                    let _ = l.into_data();
                })
            });
        }
        type Ad<B> = Autodiff<B>;
        let za = Tensor::<Ad<B>, 3>::from_inner(z).require_grad();
        let ta = Tensor::<Ad<B>, 2, Int>::from_inner(t);
        for (path, on) in PATHS {
            group.bench_function(format!("forward_backward/{path}"), |bench| {
                bench.iter(|| {
                    let grads = with_kernels(on, || {
                        masked_cross_entropy(za.clone(), ta.clone(), IGNORE_INDEX).backward()
                    });
                    let dz = za.grad(&grads).expect("logits gradient");
                    let _ = dz.slice([0..1, 0..1, 0..1]).into_data();
                })
            });
        }
        group.finish();
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(c: &mut Criterion) {
    use burn::backend::Wgpu;
    let device = Default::default();
    for shape in [gpu::TINY, gpu::WIDE] {
        gpu::group::<Wgpu>(c, "wgpu", shape, &device);
    }
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::backend::Cuda;
    let device = Default::default();
    let kimi: gpu::Shape = ([1, 4096, 163_840], "1x4096x163840");
    for shape in [gpu::TINY, gpu::WIDE, kimi] {
        gpu::group::<Cuda>(c, "cuda", shape, &device);
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, wgpu, cuda);
criterion_main!(benches);
