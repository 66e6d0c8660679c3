//! The machine's f32 matrix-multiply rate: the physical limit the MoE layer is measured against
//! (issue: "the forward within 1.25× of the time of its matmul FLOPs").
//!
//! `gemm`: the `gemm` crate's f32 kernels (`gemm-f32`) on rayon's pool, as the CPU host kernels
//! call them; `ndarray`: Burn's
//! `NdArray` `matmul` (`matrixmultiply`, one thread), for comparison. Throughput is in
//! multiply-adds · 2 (FLOPs).
//!
//! `cargo bench --bench matmul`

use burn::backend::NdArray;
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// `[m, k] x [k, n]`: the shapes of the MoE bench's largest products.
const SHAPES: [[usize; 3]; 2] = [[4096, 512, 512], [4096, 256, 2048]];

fn gemm_into(c: &mut [f32], a: &[f32], b: &[f32], [m, k, n]: [usize; 3]) {
    // SAFETY: row-major `[m, k]`, `[k, n]`, `[m, n]` buffers of exactly those sizes; computed as
    // Cᵀ = Bᵀ·Aᵀ, the kernels' preferred (column-major) destination.
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            n,
            m,
            k,
            c.as_mut_ptr(),
            n as isize,
            1,
            false,
            b.as_ptr(),
            n as isize,
            1,
            a.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm_common::Parallelism::Rayon(0),
        )
    }
}

fn matmul_rate(c: &mut Criterion) {
    let mut group = c.benchmark_group("matmul_rate");
    group.sample_size(20);
    for dims in SHAPES {
        let [m, k, n] = dims;
        let id = format!("{m}x{k}x{n}");
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut out = vec![0.0f32; m * n];
        group.bench_with_input(BenchmarkId::new("gemm", &id), &dims, |bench, &dims| {
            bench.iter(|| gemm_into(&mut out, &a, &b, dims))
        });
        let device = Default::default();
        let x = Tensor::<NdArray<f32>, 2>::random([m, k], Distribution::Default, &device);
        let w = Tensor::<NdArray<f32>, 2>::random([k, n], Distribution::Default, &device);
        group.bench_with_input(BenchmarkId::new("ndarray", &id), &dims, |bench, _| {
            bench.iter(|| x.clone().matmul(w.clone()))
        });
    }
    group.finish();
}

criterion_group!(benches, matmul_rate);
criterion_main!(benches);
