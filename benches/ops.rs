//! The smaller public ops on the CPU backend, each twice in the same run: `host` (the crate's host
//! kernel) and `reference` (its tensor-op form, the kernels switched off).
//!
//! * `kda_gate_4x512x16x64`: [`kda_gate`] forward + backward on `Autodiff<NdArray>`, the softplus
//!   gate and the safe gate (`lower_bound = −5`), `f: [4, 512, 16, 64]`.
//! * `masked_softmax_4x8x256x256` (a causal mask), `rotary_4x8x1024x64`: forward + backward on
//!   `Autodiff<NdArray>`.
//! * `adamw_update_1024x1024`, `scaled_sum_1024x1024`: one AdamW step and one `a·x + b·y` on
//!   `NdArray`, each call handing its outputs to the next as an optimiser does.
//! * `newton_schulz_8x64x256`, `newton_schulz_1x512x1536`: [`newton_schulz_batched`] (five steps)
//!   on `NdArray`, a batch of small blocks and one larger matrix.
//! * `situ_glu_4096x512`: [`situ_glu`] (K3's `β1 = 4`, `β2 = 25`) on `[4096, 512]` gate and up
//!   (the shared expert's hidden layer at the MoE bench's shape), forward on `NdArray` and
//!   forward + backward on `Autodiff<NdArray>`; forward + backward of [`situ_glu_weighted`] with a
//!   weight per row.
//! * `unary_4096x512`: [`tanh`], [`softplus`] and [`situ`] (`β1 = 4`) on `[4096, 512]`, forward +
//!   backward on `Autodiff<NdArray>`.
//!
//! `cargo bench --bench ops -- --warm-up-time 1 --measurement-time 3`
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use kimi_burn::ops::kda::kda_gate;
use kimi_burn::ops::mla::{causal_mask, masked_softmax, rotary};
use kimi_burn::ops::moe::situ::situ;
use kimi_burn::ops::optim::{adamw_update, scaled_sum, AdamWScalars};
use kimi_burn::ops::precision::{softplus, tanh};
use kimi_burn::ops::{situ_glu, situ_glu_weighted, with_kernels};
use kimi_burn::optim::{newton_schulz_batched, NS_STEPS};

type Cpu = NdArray<f32>;
type Ad = Autodiff<Cpu>;

/// The two paths of every group: `(name, kernels on)`.
const PATHS: [(&str, bool); 2] = [("host", true), ("reference", false)];

fn bench_gate(c: &mut Criterion) {
    let device = Default::default();
    let (h, k) = (16, 64);
    let f = Tensor::<Ad, 4>::random([4, 512, h, k], Distribution::Normal(0.0, 2.0), &device)
        .require_grad();
    let a_log =
        Tensor::<Ad, 1>::random([h], Distribution::Normal(0.0, 0.5), &device).require_grad();
    let dt =
        Tensor::<Ad, 1>::random([h * k], Distribution::Normal(0.0, 0.5), &device).require_grad();
    let dout = Tensor::<Ad, 4>::random([4, 512, h, k], Distribution::Normal(0.0, 1.0), &device);
    let mut group = c.benchmark_group("kda_gate_4x512x16x64");
    group.sample_size(20);
    for (gate, lower_bound) in [("softplus", None), ("safe", Some(-5.0))] {
        for (path, on) in PATHS {
            group.bench_function(format!("forward_backward_{gate}/{path}"), |b| {
                b.iter(|| {
                    with_kernels(on, || {
                        let g = kda_gate(f.clone(), a_log.clone(), dt.clone(), lower_bound);
                        g.mul(dout.clone()).sum().backward()
                    })
                })
            });
        }
    }
    group.finish();
}

fn bench_mla_helpers(c: &mut Criterion) {
    let device = Default::default();
    let randn =
        |shape: [usize; 4]| Tensor::<Ad, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let (scores, dp) = (
        randn([4, 8, 256, 256]).require_grad(),
        randn([4, 8, 256, 256]),
    );
    let mask = causal_mask::<Ad>(256, 256, &device)
        .reshape([1, 1, 256, 256])
        .expand([4, 8, 256, 256]);
    let mut group = c.benchmark_group("masked_softmax_4x8x256x256");
    group.sample_size(20);
    for (path, on) in PATHS {
        group.bench_function(format!("forward_backward/{path}"), |b| {
            b.iter(|| {
                with_kernels(on, || {
                    let p = masked_softmax(scores.clone(), mask.clone());
                    p.mul(dp.clone()).sum().backward()
                })
            })
        });
    }
    group.finish();
    let (x, dy) = (
        randn([4, 8, 1024, 64]).require_grad(),
        randn([4, 8, 1024, 64]),
    );
    let mut group = c.benchmark_group("rotary_4x8x1024x64");
    group.sample_size(20);
    for (path, on) in PATHS {
        group.bench_function(format!("forward_backward/{path}"), |b| {
            b.iter(|| {
                with_kernels(on, || {
                    let y = rotary(x.clone(), 0, 10_000.0);
                    y.mul(dy.clone()).sum().backward()
                })
            })
        });
    }
    group.finish();
}

fn bench_optim(c: &mut Criterion) {
    let device = Default::default();
    let shape = [1024, 1024];
    let randn = |std: f64| Tensor::<Cpu, 2>::random(shape, Distribution::Normal(0.0, std), &device);
    let grad = randn(1e-3);
    let scalars = AdamWScalars::new(0.9, 0.95, 1e-8, 0.1, 1e-3, 10);
    let mut group = c.benchmark_group("adamw_update_1024x1024");
    for (path, on) in PATHS {
        let mut state = Some((randn(0.5), randn(1e-3), randn(1e-6).abs()));
        group.bench_function(path, |b| {
            b.iter(|| {
                let (p, m1, m2) = state.take().expect("the state of the last call");
                state = Some(with_kernels(on, || {
                    adamw_update(p, grad.clone(), m1, m2, scalars)
                }));
            })
        });
    }
    group.finish();
    let mut group = c.benchmark_group("scaled_sum_1024x1024");
    for (path, on) in PATHS {
        let mut x = Some(randn(0.5));
        group.bench_function(path, |b| {
            b.iter(|| {
                let v = x.take().expect("the output of the last call");
                x = Some(with_kernels(on, || {
                    scaled_sum(v, 0.999, grad.clone(), -0.02)
                }));
            })
        });
    }
    group.finish();
}

fn bench_newton_schulz(c: &mut Criterion) {
    let device = Default::default();
    // A batch of small blocks (one shape of Muon's batched orthogonalisation at the tiny
    // preset's widths) and one larger matrix.
    for shape in [[8, 64, 256], [1, 512, 1536]] {
        let x = Tensor::<Cpu, 3>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let [b, m, n] = shape;
        let mut group = c.benchmark_group(format!("newton_schulz_{b}x{m}x{n}"));
        group.sample_size(20);
        for (path, on) in PATHS {
            group.bench_function(path, |bench| {
                bench.iter(|| with_kernels(on, || newton_schulz_batched(x.clone(), NS_STEPS)))
            });
        }
        group.finish();
    }
}

fn bench_situ(c: &mut Criterion) {
    let device = Default::default();
    let randn = |scale: f64| {
        Tensor::<Ad, 2>::random([4096, 512], Distribution::Normal(0.0, scale), &device)
    };
    let (g, u, dy) = (
        randn(2.0).require_grad(),
        randn(2.0).require_grad(),
        randn(1.0),
    );
    let w =
        Tensor::<Ad, 1>::random([4096], Distribution::Uniform(0.0, 1.0), &device).require_grad();
    let (g_plain, u_plain) = (g.clone().inner(), u.clone().inner());
    let mut group = c.benchmark_group("situ_glu_4096x512");
    group.sample_size(20);
    for (path, on) in PATHS {
        group.bench_function(format!("forward/{path}"), |b| {
            b.iter(|| {
                with_kernels(on, || {
                    situ_glu(g_plain.clone(), u_plain.clone(), 4.0, Some(25.0))
                })
            })
        });
        group.bench_function(format!("forward_backward/{path}"), |b| {
            b.iter(|| {
                with_kernels(on, || {
                    let y = situ_glu(g.clone(), u.clone(), 4.0, Some(25.0));
                    y.mul(dy.clone()).sum().backward()
                })
            })
        });
        group.bench_function(format!("weighted_forward_backward/{path}"), |b| {
            b.iter(|| {
                with_kernels(on, || {
                    let y = situ_glu_weighted(g.clone(), u.clone(), w.clone(), 4.0, Some(25.0));
                    y.mul(dy.clone()).sum().backward()
                })
            })
        });
    }
    group.finish();
}

fn bench_unary(c: &mut Criterion) {
    let device = Default::default();
    let x = Tensor::<Ad, 2>::random([4096, 512], Distribution::Normal(0.0, 4.0), &device)
        .require_grad();
    let dy = Tensor::<Ad, 2>::random([4096, 512], Distribution::Normal(0.0, 1.0), &device);
    type Op = fn(Tensor<Ad, 2>) -> Tensor<Ad, 2>;
    let ops: [(&str, Op); 3] = [
        ("tanh", tanh),
        ("softplus", softplus),
        ("situ", |x| situ(x, 4.0)),
    ];
    let mut group = c.benchmark_group("unary_4096x512");
    group.sample_size(10);
    for (name, op) in ops {
        for (path, on) in PATHS {
            group.bench_function(format!("{name}/forward_backward/{path}"), |b| {
                b.iter(|| with_kernels(on, || op(x.clone()).mul(dy.clone()).sum().backward()))
            });
        }
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_gate,
    bench_mla_helpers,
    bench_optim,
    bench_newton_schulz,
    bench_situ,
    bench_unary
);
criterion_main!(benches);
