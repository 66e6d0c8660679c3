//! The causal attention of MLA's training and prefill ([`causal_attention`], the expanded form)
//! on the GPU backends, each group twice in the same run: `kernel` (the crate's tiled attention
//! kernels, `AttentionKind::Fused`) and `reference` (the plain tensor-op form that stores the
//! `T × T` scores, `AttentionKind::Plain`).
//!
//! * `…_tiny_16x2x256_24x16`: the tiny model's MLA layer (batch 16, 2 heads, 256 tokens,
//!   `d_qk` = 24, `d_v` = 16).
//! * `…_mla_1x8x1024_192x128`: MLA's head sizes (`d_qk` = 192, `d_v` = 128), 8 heads, 1024
//!   tokens; on CUDA also 16 heads at 4096 tokens.
//!
//! Forward on the backend, forward + backward (`sum(o · dout)` with a fixed random `dout`) on
//! `Autodiff` over it; f32 storage. Every iteration ends by reading one element back, so the time
//! is the device's.
//!
//! `cargo bench --features wgpu --bench attention -- --warm-up-time 1 --measurement-time 3`
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use criterion::{criterion_group, criterion_main, Criterion};

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu {
    use burn::backend::Autodiff;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Distribution, Tensor};
    use criterion::Criterion;
    use kimi_burn::ops::mla::{causal_attention, AttentionKind};

    /// `[batch, heads, t, dqk, dv]` and the group name's suffix.
    pub type Shape = ([usize; 5], &'static str);

    pub const TINY: Shape = ([16, 2, 256, 24, 16], "tiny_16x2x256_24x16");
    pub const MLA: Shape = ([1, 8, 1024, 192, 128], "mla_1x8x1024_192x128");

    const PATHS: [(&str, AttentionKind); 2] = [
        ("kernel", AttentionKind::Fused),
        ("reference", AttentionKind::Plain),
    ];

    fn sync<B: Backend>(t: Tensor<B, 4>) {
        let _ = t.slice([0..1, 0..1, 0..1, 0..1]).into_data();
    }

    fn input<B: Backend>(shape: [usize; 4], device: &B::Device) -> Tensor<B, 4> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
    }

    /// Both paths' forward on `B` and forward + backward on `Autodiff<B>` at `shape`.
    pub fn group<B: Backend>(c: &mut Criterion, backend: &str, shape: Shape, device: &B::Device) {
        let ([b, h, t, dqk, dv], name) = shape;
        B::seed(device, 0);
        let q = input::<B>([b, h, t, dqk], device);
        let k = input::<B>([b, h, t, dqk], device);
        let v = input::<B>([b, h, t, dv], device);
        let dout = input::<B>([b, h, t, dv], device);
        let mut group = c.benchmark_group(format!("{backend}_attention_{name}"));
        group.sample_size(10);
        for (path, kind) in PATHS {
            group.bench_function(format!("forward/{path}"), |bench| {
                bench.iter(|| {
                    sync(causal_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        None,
                        kind,
                    ))
                })
            });
        }
        type Ad<B> = Autodiff<B>;
        let track = |x: &Tensor<B, 4>| Tensor::<Ad<B>, 4>::from_inner(x.clone()).require_grad();
        let (qa, ka, va) = (track(&q), track(&k), track(&v));
        let da = Tensor::<Ad<B>, 4>::from_inner(dout);
        for (path, kind) in PATHS {
            group.bench_function(format!("forward_backward/{path}"), |bench| {
                bench.iter(|| {
                    let o = causal_attention(qa.clone(), ka.clone(), va.clone(), None, kind);
                    let grads = o.mul(da.clone()).sum().backward();
                    sync(qa.grad(&grads).expect("dq"));
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
    for shape in [gpu::TINY, gpu::MLA] {
        gpu::group::<Wgpu>(c, "wgpu", shape, &device);
    }
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &mut Criterion) {}

#[cfg(feature = "cuda")]
fn cuda(c: &mut Criterion) {
    use burn::backend::Cuda;
    let device = Default::default();
    let long: gpu::Shape = ([1, 16, 4096, 192, 128], "mla_1x16x4096_192x128");
    for shape in [gpu::TINY, gpu::MLA, long] {
        gpu::group::<Cuda>(c, "cuda", shape, &device);
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &mut Criterion) {}

criterion_group!(benches, wgpu, cuda);
criterion_main!(benches);
