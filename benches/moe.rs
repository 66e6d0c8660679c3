//! Stable LatentMoE forward and forward+backward at n = 64, k = 8, d = 512, ℓ = 256, 4096 tokens,
//! on the CPU backend (its host kernels; `KIMI_BURN_REFERENCE=1` runs the tensor-op reference).
//!
//! Baseline measured in the same run: a dense SiTU-GLU FFN with the same active compute per token
//! (`W_down` 512→256, one FFN 256→2048→256 = 8 experts' worth, `W_up` 256→512, the shared expert), so
//! the ratio is the cost of routing plus dropless dispatch over the FLOPs it has to do anyway.
//!
//! ```text
//! cargo bench --bench moe
//! cargo bench --bench moe --features wgpu     # adds the wgpu kernel-vs-reference group
//! ```
//!
//! With `wgpu` (or `cuda`) a second group runs a small MoE on the GPU backend twice in the same
//! run: the fused CubeCL kernels (device top-k + QB histogram, grouped-matmul dispatch, fused
//! SiTU-GLU) and the reference tensor-op path (`kimi_burn::ops::set_kernels(false)`). The sizes
//! are small enough for a software Vulkan device (lavapipe).
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

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
            out.loads.on_device()
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

/// Kernel vs reference path of the same module on a GPU backend `G`.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn bench_gpu<G: burn::tensor::backend::Backend>(c: &mut Criterion, name: &str, tokens: usize) {
    use kimi_burn::ops::set_kernels;
    let device = G::Device::default();
    // n = 16 experts, top-4, d = 128, ℓ = 64, expert hidden 128, one shared expert.
    let cfg = LatentMoeConfig::new(128, 16, 4, 128)
        .with_layout(MoeLayout::StableLatent { dim: 64 })
        .with_n_shared(1)
        .with_balancer(BalancerKind::quantile());
    let mut group = c.benchmark_group(format!("{name}_moe_n16_k4_d128_l64_{tokens}tok"));
    group.sample_size(10);
    type GAd<G> = Autodiff<G>;
    let moe = cfg.init::<G>(&device);
    let moe_ad = cfg.init::<GAd<G>>(&device);
    let x = Tensor::<G, 3>::random([1, tokens, 128], Distribution::Normal(0.0, 1.0), &device);
    let x_ad = Tensor::<GAd<G>, 3>::from_inner(x.clone());
    for (path, kernels) in [("kernel", true), ("reference", false)] {
        set_kernels(kernels);
        group.bench_function(format!("forward_{path}"), |b| {
            b.iter(|| {
                let out = moe.forward(x.clone());
                G::sync(&device).unwrap();
                out.loads.on_device()
            })
        });
        group.bench_function(format!("forward_backward_{path}"), |b| {
            b.iter(|| {
                let out = moe_ad.forward(x_ad.clone());
                let grads = out.output.sum().backward();
                moe_ad.balance.update();
                drop(grads);
                G::sync(&device).unwrap();
            })
        });
    }
    set_kernels(true);
    group.finish();
}

/// The routed experts alone (the part the dispatch kernels replace) at the shape of
/// [`bench_gpu`]: `dispatch_fused` (sort on the device, grouped matmuls, gather-sum) against the
/// reference `dispatch` (host plan, per-expert `select` + SiTU-GLU, `select_assign`), forward and
/// forward+backward, on the same backend in the same run.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn bench_gpu_experts<G: burn::tensor::backend::Backend>(
    c: &mut Criterion,
    name: &str,
    tokens: usize,
) {
    use burn::tensor::{Int, TensorData};
    use kimi_burn::data::SeededRng;
    use kimi_burn::ops::moe::dispatch::{dispatch, dispatch_fused, DispatchPlan, StackedExperts};
    use kimi_burn::ops::moe::route::{select_top_k, TopKOptions};
    type GAd<G> = Autodiff<G>;
    let device = G::Device::default();
    let (n, k, l, me) = (16, 4, 64, 128);
    let mut rng = SeededRng::new(5);
    let scores: Vec<f32> = (0..tokens * n).map(|_| rng.unit_f64() as f32).collect();
    let opts = TopKOptions {
        k,
        n_group: 1,
        topk_group: 1,
    };
    let selection = select_top_k(&scores, n, &vec![0.0; n], opts).unwrap();
    let plan = DispatchPlan::new(&selection, None);
    let indices = Tensor::<GAd<G>, 2, Int>::from_data(
        TensorData::new(
            selection
                .indices
                .iter()
                .map(|&i| i as i64)
                .collect::<Vec<_>>(),
            [tokens, k],
        ),
        &device,
    );
    let experts: Vec<_> = (0..n)
        .map(|_| SituGluConfig::new(l, me).init::<GAd<G>>(&device))
        .collect();
    let h = Tensor::<GAd<G>, 2>::random([tokens, l], Distribution::Normal(0.0, 1.0), &device)
        .require_grad();
    let weights =
        Tensor::<GAd<G>, 2>::random([tokens, k], Distribution::Uniform(0.1, 0.5), &device)
            .require_grad();
    let activation = experts[0].activation;
    let stacked = || StackedExperts {
        w1: Tensor::stack::<3>(experts.iter().map(|e| e.w1.weight.val()).collect(), 0),
        w3: Tensor::stack::<3>(experts.iter().map(|e| e.w3.weight.val()).collect(), 0),
        w2: Tensor::stack::<3>(experts.iter().map(|e| e.w2.weight.val()).collect(), 0),
        activation,
        hidden_quant: None,
    };
    let fused = |h: Tensor<GAd<G>, 2>| {
        dispatch_fused(&h, &indices, &weights, None, &stacked()).expect("kernel path")
    };
    let reference = |h: Tensor<GAd<G>, 2>| {
        dispatch(h, weights.clone(), &plan, l, |e, rows| {
            experts[e].forward(rows)
        })
    };
    let mut group = c.benchmark_group(format!("{name}_experts_n16_k4_l64_me128_{tokens}tok"));
    group.sample_size(10);
    type Run<'a, G> = &'a dyn Fn(Tensor<GAd<G>, 2>) -> Tensor<GAd<G>, 2>;
    let paths: [(&str, Run<G>); 2] = [("kernel", &fused), ("reference", &reference)];
    for (path, run) in paths {
        let x = h.clone().inner();
        group.bench_function(format!("forward_{path}"), |b| {
            b.iter(|| {
                // The forward alone, without an autodiff graph.
                let y = run(Tensor::from_inner(x.clone()));
                let y = y.inner();
                G::sync(&device).unwrap();
                y
            })
        });
        group.bench_function(format!("forward_backward_{path}"), |b| {
            b.iter(|| {
                let grads = run(h.clone()).sum().backward();
                G::sync(&device).unwrap();
                grads
            })
        });
    }
    group.finish();
}

/// The MoE layer's forward against the sum of its matrix products on a GPU backend `G`, in the
/// same run, at a shape large enough for a data-centre GPU to be busy (issue: the layer forward
/// within 1.3× of its matmuls). `matmuls` runs every product of the layer's forward through
/// Burn's own matmul, at its real shape and with an even split of the routed rows over the
/// experts (one batched product per expert layer): the router, `W_down`, the experts' gate|up
/// and down, `W_up`, and the shared expert's gate|up and down. The layer also routes, sorts the
/// pairs, applies SiTU-GLU and gathers: the ratio is what all of that costs on top.
#[cfg(feature = "cuda")]
fn bench_gpu_vs_matmuls<G: burn::tensor::backend::Backend>(c: &mut Criterion, name: &str) {
    let device = G::Device::default();
    let (tokens, d, n, k, l, me, sh) = (8192, 2048, 64, 8, 1024, 1024, 2048);
    let cfg = LatentMoeConfig::new(d, n, k, me)
        .with_layout(MoeLayout::StableLatent { dim: l })
        .with_n_shared(1)
        .with_shared_hidden(Some(sh))
        .with_balancer(BalancerKind::quantile());
    let moe = cfg.init::<G>(&device);
    let x = Tensor::<G, 3>::random([1, tokens, d], Distribution::Normal(0.0, 1.0), &device);
    let mut group = c.benchmark_group(format!(
        "{name}_moe_vs_matmuls_n{n}_k{k}_d{d}_l{l}_me{me}_sh{sh}_{tokens}tok"
    ));
    group.sample_size(10);
    // The layer with the grouped matmuls' products on the tensor cores (TF32 for this f32
    // storage, as Burn's own f32 matmuls on CUDA) and on the scalar loop (the default for now).
    for (suffix, on) in [("_tensor_cores", true), ("", false)] {
        group.bench_function(format!("layer_forward{suffix}"), |b| {
            b.iter(|| {
                kimi_burn::ops::with_tensor_cores(on, || {
                    let out = moe.forward(x.clone());
                    G::sync(&device).unwrap();
                    out.loads.on_device()
                })
            })
        });
    }
    let rand =
        |dims: [usize; 2]| Tensor::<G, 2>::random(dims, Distribution::Normal(0.0, 0.02), &device);
    let rand3 =
        |dims: [usize; 3]| Tensor::<G, 3>::random(dims, Distribution::Normal(0.0, 0.02), &device);
    let flat = x.clone().reshape([tokens, d]);
    let (router, down, up) = (rand([d, n]), rand([d, l]), rand([l, d]));
    let (shared_in, shared_out) = (rand([d, 2 * sh]), rand([sh, d]));
    let rows = tokens * k / n;
    let (experts_in, experts_out) = (rand3([n, l, 2 * me]), rand3([n, me, l]));
    let h_rows = rand3([n, rows, l]);
    let a_rows = rand3([n, rows, me]);
    let u = rand([tokens, l]);
    let s = rand([tokens, sh]);
    group.bench_function("matmuls", |b| {
        b.iter(|| {
            let outs = (
                flat.clone().matmul(router.clone()),
                flat.clone().matmul(down.clone()),
                h_rows.clone().matmul(experts_in.clone()),
                a_rows.clone().matmul(experts_out.clone()),
                u.clone().matmul(up.clone()),
                flat.clone().matmul(shared_in.clone()),
                s.clone().matmul(shared_out.clone()),
            );
            G::sync(&device).unwrap();
            outs
        })
    });
    group.finish();
    bench_gpu_experts_dtypes::<G>(c, name, [tokens, n, k, l, me]);
}

/// The routed experts alone (`dispatch_fused`: sort, grouped matmuls with the fused SiTU-GLU,
/// gather-sum) against Burn's batched matmul of the same products (an even split of the rows),
/// forward, in f32 and in bf16 storage, each with the tensor cores on and off. On CUDA this is
/// the grouped matmul against cubek's matmul, and the matrix units against the scalar loop.
#[cfg(feature = "cuda")]
fn bench_gpu_experts_dtypes<G: burn::tensor::backend::Backend>(
    c: &mut Criterion,
    name: &str,
    [tokens, n, k, l, me]: [usize; 5],
) {
    use burn::tensor::{FloatDType, Int, TensorData};
    use kimi_burn::nn::GluActivation;
    use kimi_burn::ops::moe::dispatch::{dispatch_fused, StackedExperts};
    use kimi_burn::ops::with_tensor_cores;
    let device = G::Device::default();
    // Expert of pair (t, j): (t + j·n/k) mod n, an even split with k distinct experts per token.
    let indices: Vec<i64> = (0..tokens * k)
        .map(|i| ((i / k + (i % k) * (n / k)) % n) as i64)
        .collect();
    let indices = Tensor::<G, 2, Int>::from_data(TensorData::new(indices, [tokens, k]), &device);
    let rows = tokens * k / n;
    let mut group = c.benchmark_group(format!("{name}_experts_n{n}_k{k}_l{l}_me{me}_{tokens}tok"));
    group.sample_size(10);
    for (dtype_name, dtype) in [("f32", FloatDType::F32), ("bf16", FloatDType::BF16)] {
        let rand = |dims: [usize; 3]| {
            Tensor::<G, 3>::random(dims, Distribution::Normal(0.0, 0.02), &device).cast(dtype)
        };
        let h = Tensor::<G, 2>::random([tokens, l], Distribution::Normal(0.0, 1.0), &device)
            .cast(dtype);
        let weights = Tensor::<G, 2>::random([tokens, k], Distribution::Uniform(0.1, 0.5), &device)
            .cast(dtype);
        let experts = StackedExperts {
            w1: rand([n, l, me]),
            w3: rand([n, l, me]),
            w2: rand([n, me, l]),
            activation: GluActivation::Situ {
                beta1: 4.0,
                beta2: Some(25.0),
            },
            hidden_quant: None,
        };
        // Tensor cores (TF32 for f32 storage, bf16 products for bf16) and the scalar loop.
        for (suffix, on) in [("", true), ("_scalar", false)] {
            group.bench_function(format!("fused_{dtype_name}{suffix}"), |b| {
                b.iter(|| {
                    with_tensor_cores(on, || {
                        let y = dispatch_fused(&h, &indices, &weights, None, &experts)
                            .expect("kernel path");
                        G::sync(&device).unwrap();
                        y
                    })
                })
            });
        }
        let w13 = Tensor::cat(vec![experts.w1.clone(), experts.w3.clone()], 2);
        let h_rows = rand([n, rows, l]);
        let a_rows = rand([n, rows, me]);
        group.bench_function(format!("matmuls_{dtype_name}"), |b| {
            b.iter(|| {
                let outs = (
                    h_rows.clone().matmul(w13.clone()),
                    a_rows.clone().matmul(experts.w2.clone()),
                );
                G::sync(&device).unwrap();
                outs
            })
        });
    }
    group.finish();
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(c: &mut Criterion) {
    bench_gpu::<burn::backend::Wgpu>(c, "wgpu", 512);
    bench_gpu_experts::<burn::backend::Wgpu>(c, "wgpu", 512);
}

#[cfg(feature = "cuda")]
fn bench_cuda(c: &mut Criterion) {
    bench_gpu::<burn::backend::Cuda>(c, "cuda", 4096);
    bench_gpu_experts::<burn::backend::Cuda>(c, "cuda", 4096);
    bench_gpu_vs_matmuls::<burn::backend::Cuda>(c, "cuda");
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
criterion_group!(benches, bench_moe);
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
criterion_group!(benches, bench_moe, bench_wgpu);
#[cfg(all(feature = "cuda", not(feature = "wgpu")))]
criterion_group!(benches, bench_moe, bench_cuda);
#[cfg(all(feature = "cuda", feature = "wgpu"))]
criterion_group!(benches, bench_moe, bench_wgpu, bench_cuda);
criterion_main!(benches);
