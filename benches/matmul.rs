//! The machine's f32 matrix-multiply rate: the physical limit the MoE layer is measured against
//! (issue: "the forward within 1.25× of the time of its matmul FLOPs").
//!
//! `gemm`: the `gemm` crate's f32 kernels (`gemm-f32`) on rayon's pool, as the CPU host kernels
//! call them; `ndarray`: Burn's
//! `NdArray` `matmul` (`matrixmultiply`, one thread), for comparison. Throughput is in
//! multiply-adds · 2 (FLOPs).
//!
//! `moe_forward_products`: every matrix product of the MoE bench's forward (`benches/moe.rs`: 4096
//! tokens, d 512, n 64 experts, k 8, ℓ 256, m_e 256, one shared expert of 512) at its real shape,
//! called as the host kernels call them: the dense products on rayon's pool, the 64 experts'
//! (512 rows each, an even split) one serial product per expert, experts spread over the pool.
//! Its time is the floor the layer's forward can reach with these kernels: the arithmetic the
//! layer has to do, at the rate these kernels reach on those shapes.
//!
//! `cargo bench --bench matmul`
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::NdArray;
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// `[m, k] x [k, n]`: the shapes of the MoE bench's largest products.
const SHAPES: [[usize; 3]; 2] = [[4096, 512, 512], [4096, 256, 2048]];

fn gemm_into(c: &mut [f32], a: &[f32], b: &[f32], dims: [usize; 3]) {
    gemm_with(c, a, b, dims, gemm_common::Parallelism::Rayon(0));
}

fn gemm_with(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    [m, k, n]: [usize; 3],
    parallelism: gemm_common::Parallelism,
) {
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
            parallelism,
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

/// Buffers of one product `[m, k] x [k, n]`.
struct Product {
    dims: [usize; 3],
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Product {
    fn new(dims: [usize; 3]) -> Self {
        let [m, k, n] = dims;
        Self {
            dims,
            a: (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect(),
            b: (0..k * n).map(|i| (i % 13) as f32 * 0.01).collect(),
            c: vec![0.0; m * n],
        }
    }

    fn flops(&self) -> usize {
        2 * self.dims.iter().product::<usize>()
    }
}

fn moe_forward_products(c: &mut Criterion) {
    use rayon::prelude::*;
    const TOKENS: usize = 4096;
    const EXPERTS: usize = 64;
    let rows = TOKENS * 8 / EXPERTS;
    // Router, W_down, W_up, the shared expert's gate|up and down.
    let mut dense: Vec<Product> = [
        [TOKENS, 512, 64],
        [TOKENS, 512, 256],
        [TOKENS, 256, 512],
        [TOKENS, 512, 1024],
        [TOKENS, 512, 512],
    ]
    .into_iter()
    .map(Product::new)
    .collect();
    // Per expert: gate, up, down (ℓ 256 → m_e 256 → ℓ 256).
    let mut experts: Vec<[Product; 3]> = (0..EXPERTS)
        .map(|_| [[rows, 256, 256]; 3].map(Product::new))
        .collect();
    let flops: usize = dense.iter().map(Product::flops).sum::<usize>()
        + experts.iter().flatten().map(Product::flops).sum::<usize>();
    let mut group = c.benchmark_group("moe_forward_products");
    group.sample_size(20);
    group.throughput(Throughput::Elements(flops as u64));
    group.bench_function("gemm", |bench| {
        bench.iter(|| {
            for p in &mut dense {
                gemm_into(&mut p.c, &p.a, &p.b, p.dims);
            }
            experts.par_iter_mut().for_each(|e| {
                for p in e {
                    gemm_with(&mut p.c, &p.a, &p.b, p.dims, gemm_common::Parallelism::None);
                }
            });
        })
    });
    group.finish();
}

criterion_group!(benches, matmul_rate, moe_forward_products);
criterion_main!(benches);
