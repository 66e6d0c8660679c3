//! The fused MoE-side CubeCL kernels against the reference path on the same wgpu backend, and
//! against the design formulas (design §0 tolerances): SiTU-GLU forward/backward, top-k + QB histogram,
//! the dropless grouped-matmul dispatch inside `LatentMoe`.
//!
//! Every check asserts that the kernel path actually ran ([`kernel_calls`]), so a GPU test cannot
//! pass on the reference path by accident. Shapes stay small: lavapipe is a CPU.

/// The device under test: CUDA when that feature is on (`scripts/cuda-check.sh`), else wgpu.
#[cfg(feature = "cuda")]
type Gpu = burn::backend::Cuda;
#[cfg(not(feature = "cuda"))]
type Gpu = crate::common::Gpu;
type GpuAd = burn::backend::Autodiff<Gpu>;

use crate::common::{
    assert_close, bits, from_f64, host, is_cuda, matmul_tol, on_kernel, on_reference, randn,
    require_dtype, rng, situ64, situ_grid, uniform,
};
use burn::tensor::{DType, FloatDType, Tensor};
use kimi_burn::ops::moe::situ::swiglu;
use kimi_burn::ops::{last_path, FusedOp, KernelPath};
use kimi_burn::ops::{situ_glu, situ_glu_weighted};

mod situ {
    use super::*;

    #[test]
    fn forward_backward_at_spec_points() {
        let device = Default::default();
        let (g, v) = situ_grid();
        let n = g.len();
        let gate = from_f64::<GpuAd, 1>(&g, [n], &device).require_grad();
        let up = from_f64::<GpuAd, 1>(&v, [n], &device).require_grad();
        let y = on_kernel(FusedOp::SituGlu, 1, || {
            situ_glu(gate.clone(), up.clone(), 4.0, Some(25.0))
        });
        let grads = on_kernel(FusedOp::SituGluBackward, 1, || y.clone().sum().backward());
        let expect: Vec<(f64, f64, f64)> = g
            .iter()
            .zip(&v)
            .map(|(&g, &v)| situ64(g, v, 4.0, Some(25.0)))
            .collect();
        let col = |i: usize| {
            expect
                .iter()
                .map(|e| [e.0, e.1, e.2][i])
                .collect::<Vec<_>>()
        };
        assert_close("y", &col(0), &host(y), 1e-5);
        assert_close("dG", &col(1), &host(gate.grad(&grads).unwrap()), 1e-5);
        assert_close("dV", &col(2), &host(up.grad(&grads).unwrap()), 1e-5);
    }

    #[test]
    fn sigmoid_does_not_overflow() {
        let device = Default::default();
        let g = [-1000.0, -100.0, 100.0, 1000.0];
        let v = [1.0, -2.0, 3.0, -4.0];
        let y = on_kernel(FusedOp::SituGlu, 1, || {
            situ_glu(
                from_f64::<Gpu, 1>(&g, [4], &device),
                from_f64::<Gpu, 1>(&v, [4], &device),
                4.0,
                Some(25.0),
            )
        });
        let expect: Vec<f64> = g
            .iter()
            .zip(&v)
            .map(|(&g, &v)| situ64(g, v, 4.0, Some(25.0)).0)
            .collect();
        assert_close("y at |g| >= 100", &expect, &host(y), 1e-5);
    }

    /// Kernel against the reference tensor ops on the same backend: value and both gradients.
    fn compare(shape: [usize; 3], beta2: Option<f32>, swi: bool, seed: u64) {
        let device = Default::default();
        let mut r = rng(seed);
        let g = randn::<GpuAd, 3>(&mut r, shape, 3.0, &device);
        let v = randn::<GpuAd, 3>(&mut r, shape, 10.0, &device);
        let w = randn::<GpuAd, 3>(&mut r, shape, 1.0, &device);
        let run = |kernel: bool| {
            let (g, v) = (g.clone().require_grad(), v.clone().require_grad());
            let f = || {
                let y = if swi {
                    swiglu(g.clone(), v.clone())
                } else {
                    situ_glu(g.clone(), v.clone(), 4.0, beta2)
                };
                let grads = y.clone().mul(w.clone()).sum().backward();
                (
                    host(y),
                    host(g.grad(&grads).unwrap()),
                    host(v.grad(&grads).unwrap()),
                )
            };
            if kernel {
                on_kernel(FusedOp::SituGluBackward, 1, f)
            } else {
                on_reference(FusedOp::SituGlu, f)
            }
        };
        let (rk, rr) = (run(true), run(false));
        let what = format!("{shape:?} beta2 {beta2:?} swiglu {swi}");
        assert_close(&format!("y {what}"), &rr.0, &rk.0, 1e-5);
        assert_close(&format!("dG {what}"), &rr.1, &rk.1, 1e-5);
        assert_close(&format!("dV {what}"), &rr.2, &rk.2, 1e-5);
    }

    #[test]
    fn random_against_reference() {
        // Rows of 24 (vectorised loads), 7 (scalar), 3-d batches.
        compare([2, 19, 24], Some(25.0), false, 11);
        compare([3, 5, 7], Some(25.0), false, 12);
        compare([1, 33, 16], None, false, 13);
        compare([2, 9, 12], None, true, 14);
    }

    #[test]
    fn weighted_against_reference_and_dp() {
        let device = Default::default();
        let mut r = rng(21);
        let (rows, h) = (23, 20);
        let g = randn::<GpuAd, 2>(&mut r, [rows, h], 3.0, &device);
        let v = randn::<GpuAd, 2>(&mut r, [rows, h], 10.0, &device);
        let p = uniform::<GpuAd, 1>(&mut r, [rows], 0.05, 1.0, &device);
        let w = randn::<GpuAd, 2>(&mut r, [rows, h], 1.0, &device);
        let run = |kernel: bool| {
            let (g, v, p) = (
                g.clone().require_grad(),
                v.clone().require_grad(),
                p.clone().require_grad(),
            );
            let f = || {
                let y = situ_glu_weighted(g.clone(), v.clone(), p.clone(), 4.0, Some(25.0));
                let grads = y.clone().mul(w.clone()).sum().backward();
                [
                    host(y),
                    host(g.grad(&grads).unwrap()),
                    host(v.grad(&grads).unwrap()),
                    host(p.grad(&grads).unwrap()),
                ]
            };
            if kernel {
                on_kernel(FusedOp::SituGluBackward, 1, f)
            } else {
                on_reference(FusedOp::SituGlu, f)
            }
        };
        let (k, rf) = (run(true), run(false));
        for (i, name) in ["y", "dG", "dV", "dp"].iter().enumerate() {
            assert_close(&format!("weighted {name}"), &rf[i], &k[i], 1e-5);
        }
        // dp against design §1 directly: dp_row = Σ dY ⊙ A·B with dY = w.
        let ab = host(situ_glu(g.clone(), v.clone(), 4.0, Some(25.0)));
        let wh = host(w.clone());
        let dp: Vec<f64> = (0..rows)
            .map(|i| (0..h).map(|j| ab[i * h + j] * wh[i * h + j]).sum())
            .collect();
        assert_close("dp = Σ dY·A·B", &dp, &k[3], 1e-5);
    }

    /// Same input twice gives bit-identical outputs and gradients (no races, no float atomics).
    #[test]
    fn repeatable_bit_for_bit() {
        let device = Default::default();
        let mut r = rng(31);
        let g = randn::<GpuAd, 2>(&mut r, [64, 40], 3.0, &device);
        let v = randn::<GpuAd, 2>(&mut r, [64, 40], 10.0, &device);
        let p = uniform::<GpuAd, 1>(&mut r, [64], 0.05, 1.0, &device);
        let run = || {
            on_kernel(FusedOp::SituGluBackward, 1, || {
                let (g, v, p) = (
                    g.clone().require_grad(),
                    v.clone().require_grad(),
                    p.clone().require_grad(),
                );
                let y = situ_glu_weighted(g.clone(), v.clone(), p.clone(), 4.0, Some(25.0));
                let grads = y.clone().sum().backward();
                (
                    bits(y),
                    bits(g.grad(&grads).unwrap()),
                    bits(p.grad(&grads).unwrap()),
                )
            })
        };
        assert_eq!(run(), run());
    }

    /// f16 / bf16 storage (f32 math inside) on the design §1 grid: the value and both gradients within
    /// one unit in the last place of the storage type of the f64 formula of the rounded inputs
    /// (f16: 2⁻¹⁰ relative, or its subnormal spacing 6e-8; bf16: 2⁻⁷), so the kernel loses nothing
    /// to cancellation beyond the final rounding. Where the exact value is a near-zero difference
    /// of O(1) terms (dA/dg at the minimum of A, g ≈ −1.22) f32 leaves an absolute error of a few
    /// 1e-8 of those terms: 1e-6 of the largest value allows it.
    fn half_storage_in(name: &str, dtype: DType, fdtype: FloatDType) {
        let device = Default::default();
        require_dtype::<Gpu>(&device, dtype);
        let (g, v) = situ_grid();
        let n = g.len();
        let (ulp, floor) = if dtype == DType::F16 {
            (2f64.powi(-10), 6e-8)
        } else {
            (2f64.powi(-7), 0.0)
        };
        let gate = from_f64::<GpuAd, 1>(&g, [n], &device)
            .cast(fdtype)
            .require_grad();
        let up = from_f64::<GpuAd, 1>(&v, [n], &device)
            .cast(fdtype)
            .require_grad();
        let (gr, vr) = (host(gate.clone()), host(up.clone()));
        let y = on_kernel(FusedOp::SituGlu, 1, || {
            situ_glu(gate.clone(), up.clone(), 4.0, Some(25.0))
        });
        assert_eq!(y.dtype(), dtype, "{name} output dtype");
        let grads = on_kernel(FusedOp::SituGluBackward, 1, || y.clone().sum().backward());
        let outs = [
            host(y),
            host(gate.grad(&grads).expect("dgate")),
            host(up.grad(&grads).expect("dup")),
        ];
        for (i, (what, out)) in ["y", "dgate", "dup"].iter().zip(&outs).enumerate() {
            let expect: Vec<f64> = (0..n)
                .map(|j| {
                    let e = situ64(gr[j], vr[j], 4.0, Some(25.0));
                    [e.0, e.1, e.2][i]
                })
                .collect();
            let largest = expect.iter().fold(0.0f64, |m, e| m.max(e.abs()));
            for j in 0..n {
                let expect = expect[j];
                let err = (out[j] - expect).abs();
                assert!(
                    err <= ulp * expect.abs() + floor + 1e-6 * largest && out[j].is_finite(),
                    "{name} {what} at gate {} up {}: {} vs {expect}",
                    gr[j],
                    vr[j],
                    out[j]
                );
            }
        }
    }

    crate::common::half_storage_tests!(half_storage_f16, half_storage_bf16, half_storage_in);
}

mod routing {
    use super::*;
    use burn::tensor::TensorData;
    use kimi_burn::nn::balance::{Balancer, QuantileBalancer, RoutedBatch};
    use kimi_burn::ops::moe::route::{
        route_top_k_fused, select_top_k, Selection, TokenMask, TopKOptions,
    };
    use rand::Rng;

    /// Scores on a coarse grid (many exact ties) or continuous, with a bias.
    fn batch(m: usize, n: usize, ties: bool, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut r = rng(seed);
        let scores = (0..m * n)
            .map(|_| {
                if ties {
                    r.random_range(1..16) as f32 / 16.0
                } else {
                    r.random_range(0.001f32..0.999)
                }
            })
            .collect();
        let bias = (0..n)
            .map(|_| {
                if ties {
                    r.random_range(-2..=2) as f32 / 16.0
                } else {
                    r.random_range(-0.3f32..0.3)
                }
            })
            .collect();
        (scores, bias)
    }

    /// The fused selection equals the host `select_top_k` (ties to the lower index) and the QB
    /// counts equal the host `QuantileBalancer`'s, exactly, with and without padding.
    #[test]
    fn selection_and_qb_counts_equal_the_host() {
        let device = Default::default();
        for (m, n, k, bins, masked, ties, seed) in [
            (50, 8, 2, 37, false, true, 1),
            (64, 13, 3, 100, true, true, 2),
            (70, 16, 4, 1000, true, false, 3),
            (9, 4, 1, 10, false, false, 4),
        ] {
            let (scores, bias) = batch(m, n, ties, seed);
            let mut r = rng(seed + 100);
            let valid: Option<Vec<bool>> =
                masked.then(|| (0..m).map(|_| r.random_range(0..5) > 0).collect());
            let opts = TopKOptions {
                k,
                n_group: 1,
                topk_group: 1,
            };
            let host_sel = select_top_k(&scores, n, &bias, opts).unwrap();
            let mut qb = QuantileBalancer::new(n, bins).unwrap();
            qb.observe(&RoutedBatch {
                scores: &scores,
                bias: &bias,
                selection: &host_sel,
                valid: valid.as_deref(),
            })
            .unwrap();
            let spec = qb.histogram_spec(&bias);
            let t = Tensor::<Gpu, 2>::from_data(TensorData::new(scores.clone(), [m, n]), &device);
            let mask = valid.clone().map(TokenMask::from_host);
            let fused = on_kernel(FusedOp::RouteTopK, 1, || {
                route_top_k_fused(&t, &bias, opts, mask.as_ref(), Some(spec))
            })
            .expect("kernel path on wgpu");
            assert_eq!(last_path(FusedOp::QbHistogram), Some(KernelPath::Kernel));
            let case = format!("m {m} n {n} k {k} bins {bins} masked {masked} ties {ties}");
            assert_eq!(
                Selection::from_tensor(&fused.indices, n),
                host_sel,
                "selection, {case}"
            );
            let device_idx: Vec<u32> = fused
                .indices
                .into_data()
                .iter::<i64>()
                .map(|i| i as u32)
                .collect();
            assert_eq!(device_idx, host_sel.indices, "device indices, {case}");
            let counts: Vec<u64> = fused
                .counts
                .expect("counts requested")
                .into_data()
                .iter::<i64>()
                .map(|c| c as u64)
                .collect();
            assert_eq!(counts, qb.counts(), "QB counts, {case}");
            let counted: u64 = counts[..bins].iter().sum();
            let expect = valid
                .as_ref()
                .map_or(m, |v| v.iter().filter(|&&b| b).count());
            assert_eq!(counted as usize, expect, "tokens counted, {case}");
        }
    }

    /// Through `LatentMoe`: one training forward on each path leaves identical balancer counts
    /// (QB's histogram, the sign rule's loads: counted on the device on the kernel path), the
    /// same load statistics and the same next bias, with and without padding; only the host path,
    /// which holds the scores, reports a margin.
    #[test]
    fn latent_moe_balancer_counts_match_the_host_path() {
        use burn::tensor::Bool;
        use kimi_burn::nn::{BalancerKind, LatentMoeConfig, MoeLayout, MoeStats};
        let device = Default::default();
        let bias = [0.1, -0.05, 0.0, 0.2, -0.1, 0.05, 0.0, -0.2];
        let mut r = rng(7);
        let x = randn::<GpuAd, 3>(&mut r, [3, 11, 16], 1.0, &device);
        let pad: Vec<bool> = (0..33).map(|i| i % 11 >= 8 || i == 4).collect();
        let padding = Tensor::<GpuAd, 2, Bool>::from_data(TensorData::new(pad, [3, 11]), &device);
        for balancer in [
            BalancerKind::Quantile { bins: 64 },
            BalancerKind::Sign { gamma: 1e-3 },
        ] {
            for padding in [None, Some(padding.clone())] {
                let cfg = LatentMoeConfig::new(16, 8, 2, 12)
                    .with_layout(MoeLayout::StableLatent { dim: 8 })
                    .with_balancer(balancer);
                let moe = cfg.init::<GpuAd>(&device);
                let run = |kernel: bool| {
                    moe.balance.set_bias(&bias);
                    let forward = || moe.try_forward(x.clone(), padding.clone()).unwrap();
                    let out = if kernel {
                        on_kernel(FusedOp::RouteTopK, 1, forward)
                    } else {
                        on_reference(FusedOp::RouteTopK, forward)
                    };
                    let counts = moe.balance.counts();
                    let next = moe.balance.update();
                    (counts, out.stats(), next)
                };
                let case = format!("{balancer:?}, padded {}", padding.is_some());
                let (k_counts, k_stats, k_next) = run(true);
                let (r_counts, r_stats, r_next) = run(false);
                assert!(k_counts.iter().sum::<u64>() > 0, "{case}");
                assert_eq!(k_counts, r_counts, "counts, {case}");
                assert_eq!(k_next, r_next, "next bias, {case}");
                assert_ne!(k_next, bias.to_vec(), "the update moved the bias, {case}");
                assert_eq!(k_stats.median_margin, None);
                assert!(r_stats.median_margin.is_some_and(|m| m >= 0.0));
                let loads_only = |s: MoeStats| MoeStats {
                    median_margin: None,
                    ..s
                };
                assert_eq!(loads_only(k_stats), loads_only(r_stats), "loads, {case}");
            }
        }
    }
}

mod dispatch {
    use super::*;
    use burn::module::AutodiffModule;
    use burn::tensor::{Bool, Int, TensorData};
    use kimi_burn::nn::GluActivation;
    use kimi_burn::nn::{LatentMoe, LatentMoeConfig, MoeLayout};
    use kimi_burn::ops::moe::dispatch::{dispatch, dispatch_fused, DispatchPlan, StackedExperts};
    use kimi_burn::ops::moe::route::Selection;
    use rand::Rng;

    /// A skewed selection: expert 0 takes most tokens (several matmul tiles), the last expert none.
    fn skewed(m: usize, n: usize, k: usize, seed: u64) -> Selection {
        let mut r = rng(seed);
        let mut indices = Vec::with_capacity(m * k);
        for _ in 0..m {
            let mut chosen: Vec<u32> = Vec::new();
            while chosen.len() < k {
                let e = if r.random_range(0..4) > 0 && !chosen.contains(&0) {
                    0
                } else {
                    r.random_range(1..n as u32 - 1)
                };
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            indices.extend(chosen);
        }
        Selection {
            tokens: m,
            experts: n,
            k,
            indices,
        }
    }

    struct Case {
        h: Tensor<GpuAd, 2>,
        p: Tensor<GpuAd, 2>,
        w1: Tensor<GpuAd, 3>,
        w3: Tensor<GpuAd, 3>,
        w2: Tensor<GpuAd, 3>,
        sel: Selection,
        valid: Option<Vec<bool>>,
        act: GluActivation,
    }

    impl Case {
        /// The same case with every float tensor cast to `dtype`.
        fn cast(&self, dtype: FloatDType) -> Case {
            let two = |t: &Tensor<GpuAd, 2>| t.clone().cast(dtype);
            let three = |t: &Tensor<GpuAd, 3>| t.clone().cast(dtype);
            Case {
                h: two(&self.h),
                p: two(&self.p),
                w1: three(&self.w1),
                w3: three(&self.w3),
                w2: three(&self.w2),
                sel: self.sel.clone(),
                valid: self.valid.clone(),
                act: self.act,
            }
        }
    }

    fn case(m: usize, n: usize, k: usize, l: usize, me: usize, masked: bool, seed: u64) -> Case {
        let device = Default::default();
        let mut r = rng(seed);
        let mut rr = rng(seed + 1);
        Case {
            h: randn(&mut r, [m, l], 1.0, &device),
            p: uniform(&mut r, [m, k], 0.05, 1.0, &device),
            w1: randn(&mut r, [n, l, me], 0.3, &device),
            w3: randn(&mut r, [n, l, me], 0.3, &device),
            w2: randn(&mut r, [n, me, l], 0.3, &device),
            sel: skewed(m, n, k, seed + 2),
            valid: masked.then(|| (0..m).map(|_| rr.random_range(0..6) > 0).collect()),
            act: GluActivation::Situ {
                beta1: 4.0,
                beta2: Some(25.0),
            },
        }
    }

    /// `[out, dh, dp, dW1, dW3, dW2]` on one path.
    fn run(c: &Case, kernel: bool) -> Vec<Vec<f64>> {
        let device = Default::default();
        let (h, p) = (c.h.clone().require_grad(), c.p.clone().require_grad());
        let (w1, w3, w2) = (
            c.w1.clone().require_grad(),
            c.w3.clone().require_grad(),
            c.w2.clone().require_grad(),
        );
        let [m, l] = h.dims();
        let [_, _, me] = w1.dims();
        let mut r = rng(99);
        let probe = randn::<GpuAd, 2>(&mut r, [m, l], 1.0, &device);
        let go = || {
            let out = if kernel {
                let idx = c.sel.to_tensor::<GpuAd>(&device);
                let experts = StackedExperts {
                    w1: w1.clone(),
                    w3: w3.clone(),
                    w2: w2.clone(),
                    activation: c.act,
                    hidden_quant: None,
                };
                let mask = c
                    .valid
                    .clone()
                    .map(kimi_burn::ops::moe::route::TokenMask::from_host);
                dispatch_fused(&h, &idx, &p, mask.as_ref(), &experts).expect("kernel path")
            } else {
                let plan = DispatchPlan::new(&c.sel, c.valid.as_deref());
                dispatch(h.clone(), p.clone(), &plan, l, |e, rows| {
                    let pick = |w: &Tensor<GpuAd, 3>, a: usize, b: usize| {
                        w.clone().slice([e..e + 1, 0..a, 0..b]).reshape([a, b])
                    };
                    let g = rows.clone().matmul(pick(&w1, l, me));
                    let u = rows.matmul(pick(&w3, l, me));
                    c.act.apply(g, u).matmul(pick(&w2, me, l))
                })
            };
            // The probe in the output's storage type (half storage runs end to end in it).
            let fd = match out.dtype() {
                DType::F16 => FloatDType::F16,
                DType::BF16 => FloatDType::BF16,
                _ => FloatDType::F32,
            };
            let grads = out.clone().mul(probe.clone().cast(fd)).sum().backward();
            vec![
                host(out),
                host(h.grad(&grads).unwrap()),
                host(p.grad(&grads).unwrap()),
                host(w1.grad(&grads).unwrap()),
                host(w3.grad(&grads).unwrap()),
                host(w2.grad(&grads).unwrap()),
            ]
        };
        if kernel {
            on_kernel(FusedOp::MoeExpertsBackward, 1, go)
        } else {
            on_reference(FusedOp::MoeExperts, go)
        }
    }

    /// Each weight's gradient comes back in that weight's dtype, also where the three differ (the
    /// kernels compute in the input's dtype and cast the gradients back).
    #[test]
    fn weight_gradients_keep_each_weights_dtype() {
        let device = Default::default();
        let c = case(41, 6, 3, 9, 20, false, 5);
        let (h, p) = (c.h.clone().require_grad(), c.p.clone().require_grad());
        let (w1, w3) = (c.w1.clone().require_grad(), c.w3.clone().require_grad());
        let w2 = c.w2.clone().cast(FloatDType::F16).require_grad();
        let idx = c.sel.to_tensor::<GpuAd>(&device);
        let experts = StackedExperts {
            w1: w1.clone(),
            w3: w3.clone(),
            w2: w2.clone(),
            activation: c.act,
            hidden_quant: None,
        };
        let grads = on_kernel(FusedOp::MoeExpertsBackward, 1, || {
            dispatch_fused(&h, &idx, &p, None, &experts)
                .expect("kernel path")
                .sum()
                .backward()
        });
        let dtypes = [&w1, &w3, &w2].map(|w| w.grad(&grads).expect("a gradient").dtype());
        assert_eq!(dtypes, [DType::F32, DType::F32, DType::F16]);
    }

    /// The grouped-matmul dispatch against the per-expert reference `dispatch`: output and every
    /// gradient. Segments longer than one tile, widths past one tile and the K slice, an expert with
    /// no token, padding.
    #[test]
    fn grouped_matmul_dispatch_matches_reference() {
        // The reference path multiplies with Burn's matmul (TF32 on CUDA).
        let tol = matmul_tol::<Gpu>(&Default::default(), 1e-5);
        for (m, n, k, l, me, masked, seed) in [
            (150, 5, 2, 70, 80, false, 1),
            (41, 6, 3, 9, 20, true, 2),
            (7, 3, 1, 5, 3, false, 3),
        ] {
            let mut c = case(m, n, k, l, me, masked, seed);
            // Every activation the fused epilogue computes, on the first shape.
            let acts: &[GluActivation] = if seed == 1 {
                &[
                    GluActivation::SwiGlu,
                    GluActivation::Situ {
                        beta1: 2.0,
                        beta2: None,
                    },
                    c.act,
                ]
            } else {
                &[c.act]
            };
            for &act in acts {
                c.act = act;
                let (kr, rf) = (run(&c, true), run(&c, false));
                let what = format!("m {m} n {n} k {k} ℓ {l} m_e {me} masked {masked} {act:?}");
                for (i, name) in ["out", "dh", "dp", "dW1", "dW3", "dW2"].iter().enumerate() {
                    assert_close(&format!("{name} ({what})"), &rf[i], &kr[i], tol);
                }
            }
            if masked {
                let kr = run(&c, true);
                let valid = c.valid.as_ref().unwrap();
                for (t, &v) in valid.iter().enumerate() {
                    if !v {
                        assert!(kr[0][t * l..(t + 1) * l].iter().all(|&y| y == 0.0));
                    }
                }
            }
        }
    }

    /// The tensor-core path on f32 storage (TF32 blocks of depth 8) against the per-expert
    /// reference, in the forward, the fused backward and the weight gradients, on the shapes
    /// above (partial tiles, an empty expert, padding):
    ///
    /// - with its block products emulated on the units
    ///   ([`with_tensor_core_emulation`](kimi_burn::ops::with_tensor_core_emulation)), on every
    ///   device: the 16 × 16 cube's staging, the planes' placement of their blocks, the
    ///   accumulators' way through shared memory and the 4×4 micro-tile epilogues;
    /// - on the matrix units where the device has TF32 ones (CUDA; the comparison then takes
    ///   the TF32 tolerance of `matmul_tol`, as the reference's matmuls run in TF32 there too);
    ///   elsewhere no launch may claim them, and the scalar loop runs.
    ///
    /// Half storage: `half_storage_*`.
    #[test]
    fn tensor_core_paths_match_reference() {
        use kimi_burn::ops::{tensor_core_launches, with_tensor_core_emulation, with_tensor_cores};
        let device = Default::default();
        // On CUDA the reference's matmuls and the matrix units' both run in TF32.
        let tol = matmul_tol::<Gpu>(&device, 1e-5);
        for (m, n, k, l, me, masked, seed) in [
            (150, 5, 2, 70, 80, false, 1),
            (41, 6, 3, 9, 20, true, 2),
            (7, 3, 1, 5, 3, false, 3),
        ] {
            let c = case(m, n, k, l, me, masked, seed);
            let what = format!("m {m} n {n} k {k} ℓ {l} m_e {me} masked {masked}");
            let rf = run(&c, false);
            // Forward (both layers), the backward's two products, three weight gradients.
            let all_launches = 7;
            let before = tensor_core_launches();
            let emulated = with_tensor_core_emulation(|| run(&c, true));
            let launches = tensor_core_launches() - before;
            assert!(
                launches >= all_launches,
                "only {launches} grouped launches took the emulated path ({what})"
            );
            let before = tensor_core_launches();
            let units = with_tensor_cores(true, || run(&c, true));
            let launches = tensor_core_launches() - before;
            let on_units = is_cuda::<Gpu>(&device);
            if on_units {
                assert!(
                    launches >= all_launches,
                    "CUDA has TF32 tensor cores, yet only {launches} grouped launches ran on them ({what})"
                );
            } else {
                assert_eq!(launches, 0, "this device has no matrix units ({what})");
            }
            for (i, name) in ["out", "dh", "dp", "dW1", "dW3", "dW2"].iter().enumerate() {
                assert_close(
                    &format!("{name} emulated ({what})"),
                    &rf[i],
                    &emulated[i],
                    tol,
                );
                assert_close(
                    &format!("{name} matrix units ({what})"),
                    &rf[i],
                    &units[i],
                    tol,
                );
            }
        }
    }

    /// An expert index outside `0..n` drops its pair, as padding drops a token's pairs: that
    /// token's output is the sum over its other pairs, and every row equals, bit for bit, the run
    /// where the pair keeps a valid expert with routing weight 0. The kernels run unchecked, so
    /// the plan must not read an offset past `n` or place the pair anywhere.
    #[test]
    fn out_of_range_expert_index_drops_its_pair() {
        let (m, n, k, l, me) = (41, 6, 3, 9, 20);
        let c = case(m, n, k, l, me, false, 4);
        let device = Default::default();
        let experts = StackedExperts {
            w1: c.w1.clone(),
            w3: c.w3.clone(),
            w2: c.w2.clone(),
            activation: c.act,
            hidden_quant: None,
        };
        // (token, slot, index): one past the last expert, and -1 (u32::MAX once cast).
        let bad = [(7usize, 1usize, n as i64), (20, 0, -1)];
        let valid_idx: Vec<i64> = c.sel.indices.iter().map(|&i| i as i64).collect();
        let mut bad_idx = valid_idx.clone();
        let mut zero_p: Vec<f32> = c.p.clone().into_data().to_vec().unwrap();
        for (t, q, e) in bad {
            bad_idx[t * k + q] = e;
            zero_p[t * k + q] = 0.0;
        }
        let ints =
            |v: Vec<i64>| Tensor::<GpuAd, 2, Int>::from_data(TensorData::new(v, [m, k]), &device);
        let run = |idx: Vec<i64>, p: Tensor<GpuAd, 2>| {
            on_kernel(FusedOp::MoeExperts, 1, || {
                host(dispatch_fused(&c.h, &ints(idx), &p, None, &experts).expect("kernel path"))
            })
        };
        let dropped = run(bad_idx, c.p.clone());
        let zeroed = run(
            valid_idx,
            Tensor::from_data(TensorData::new(zero_p, [m, k]), &device),
        );
        assert_eq!(dropped.len(), m * l);
        for (i, (a, b)) in dropped.iter().zip(&zeroed).enumerate() {
            assert!(a == b, "row {} column {}: {a} vs {b}", i / l, i % l);
        }
    }

    /// The backward from the gate/up projections the forward kept (the autodiff path) equals the
    /// backward that recomputes them, bit for bit, and the saving forward equals the plain one.
    #[test]
    fn backward_from_saved_projections_equals_recomputed() {
        use kimi_burn::ops::moe::{MoeExpertsInput, MoeKernels};
        let c = case(70, 5, 2, 24, 36, true, 7);
        let device = Default::default();
        let float = |t: Tensor<Gpu, 2>| t.into_primitive().tensor();
        let float3 = |t: Tensor<Gpu, 3>| t.into_primitive().tensor();
        let input = || MoeExpertsInput::<Gpu> {
            input: float(c.h.clone().inner()),
            indices: c.sel.to_tensor::<Gpu>(&device).into_primitive(),
            weights: float(c.p.clone().inner()),
            valid: c.valid.as_ref().map(|v| {
                let v: Vec<i32> = v.iter().map(|&b| b as i32).collect();
                Tensor::<Gpu, 1, burn::tensor::Int>::from_data(TensorData::new(v, [70]), &device)
                    .into_primitive()
            }),
            w1: float3(c.w1.clone().inner()),
            w3: float3(c.w3.clone().inner()),
            w2: float3(c.w2.clone().inner()),
            activation: GluActivation::Situ {
                beta1: 4.0,
                beta2: Some(25.0),
            },
            hidden_quant: None,
        };
        use burn::tensor::TensorPrimitive::Float;
        let out = |t| bits(Tensor::<Gpu, 2>::from_primitive(Float(t)));
        let out3 = |t| bits(Tensor::<Gpu, 3>::from_primitive(Float(t)));
        let plain = out(<Gpu as MoeKernels>::moe_experts(input()));
        let (y, saved) = <Gpu as MoeKernels>::moe_experts_saving(input());
        assert_eq!(plain, out(y));
        let saved = saved.expect("the CubeCL backend keeps the projections");
        let grad = || float(randn::<Gpu, 2>(&mut rng(3), [70, 24], 1.0, &device));
        let from_saved = <Gpu as MoeKernels>::moe_experts_backward(input(), grad(), Some(saved));
        let recomputed = <Gpu as MoeKernels>::moe_experts_backward(input(), grad(), None);
        for (name, a, b) in [
            ("dh", out(from_saved.input), out(recomputed.input)),
            ("dp", out(from_saved.weights), out(recomputed.weights)),
            ("dW1", out3(from_saved.w1), out3(recomputed.w1)),
            ("dW3", out3(from_saved.w3), out3(recomputed.w3)),
            ("dW2", out3(from_saved.w2), out3(recomputed.w2)),
        ] {
            assert_eq!(a, b, "{name}");
        }
    }

    /// Half storage through the grouped matmuls (forward, the fused backward and the weight
    /// gradients) against the f32 reference `dispatch` on the same rounded values, at design §0's
    /// half tolerances. Where the device has matrix units for the type (tensor cores on CUDA) the
    /// products must have run on them, and the scalar path must agree too; elsewhere (lavapipe)
    /// no launch may claim them.
    fn half_storage_in(name: &str, dtype: DType, fdtype: FloatDType) {
        use kimi_burn::ops::{tensor_core_launches, with_tensor_cores};
        let device = Default::default();
        require_dtype::<Gpu>(&device, dtype);
        let c = case(150, 5, 2, 70, 80, false, 1);
        let rounded = c.cast(fdtype);
        let reference = run(&rounded.cast(FloatDType::F32), false);
        let before = tensor_core_launches();
        let fast = with_tensor_cores(true, || run(&rounded, true));
        let matrix_units = tensor_core_launches() - before;
        let before = tensor_core_launches();
        let scalar = with_tensor_cores(false, || run(&rounded, true));
        assert_eq!(
            tensor_core_launches(),
            before,
            "{name}: switched off, yet ran on them"
        );
        if is_cuda::<Gpu>(&device) {
            // Forward (first layer, second layer) and backward (dgrad of both layers).
            assert!(
                matrix_units >= 4,
                "{name}: CUDA has tensor cores for this type, the grouped matmuls ran {matrix_units} launches on them"
            );
        } else {
            assert_eq!(matrix_units, 0, "{name}: this device has no matrix units");
        }
        let emulated = kimi_burn::ops::with_tensor_core_emulation(|| run(&rounded, true));
        let tolerances = [5e-3, 8e-3, 2e-2, 8e-3, 8e-3, 8e-3];
        for (path, out) in [
            ("matrix units", &fast),
            ("scalar", &scalar),
            ("emulated matrix units", &emulated),
        ] {
            for (i, what) in ["out", "dh", "dp", "dW1", "dW3", "dW2"].iter().enumerate() {
                assert_close(
                    &format!("{name} {what} ({path})"),
                    &reference[i],
                    &out[i],
                    tolerances[i],
                );
            }
        }
    }

    crate::common::half_storage_tests!(half_storage_f16, half_storage_bf16, half_storage_in);

    /// Same input twice: bit-identical output and gradients.
    #[test]
    fn dispatch_is_repeatable_bit_for_bit() {
        let c = case(90, 4, 2, 33, 40, true, 5);
        let to_bits = |v: Vec<Vec<f64>>| -> Vec<Vec<u64>> {
            v.into_iter()
                .map(|x| x.into_iter().map(f64::to_bits).collect())
                .collect()
        };
        assert_eq!(to_bits(run(&c, true)), to_bits(run(&c, true)));
    }

    fn config() -> LatentMoeConfig {
        LatentMoeConfig::new(16, 6, 2, 12)
            .with_layout(MoeLayout::StableLatent { dim: 8 })
            .with_n_shared(1)
    }

    /// Every parameter gradient of a module, flattened in a fixed order.
    fn grads_of(
        moe: &LatentMoe<GpuAd>,
        grads: &<GpuAd as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Vec<(String, Vec<f64>)> {
        let mut out = vec![(
            "router".to_string(),
            host(moe.router.gate.weight.grad(grads).unwrap()),
        )];
        let ex = &moe.experts;
        for (name, w) in [("w1", &ex.w1), ("w3", &ex.w3), ("w2", &ex.w2)] {
            let g = w.grad(grads).map(host).unwrap_or_default();
            out.push((format!("experts.{name}"), g));
        }
        let lin = |l: &Option<burn::nn::Linear<GpuAd>>| {
            host(l.as_ref().unwrap().weight.grad(grads).unwrap())
        };
        out.push(("down".into(), lin(&moe.down)));
        out.push(("up".into(), lin(&moe.up)));
        out.push((
            "norm".into(),
            host(moe.norm.as_ref().unwrap().weight.grad(grads).unwrap()),
        ));
        out
    }

    /// The whole Stable LatentMoE layer on the kernel path (device routing, QB histogram, fused
    /// dispatch and backward) against the reference path on the same backend: output, input
    /// gradient and every parameter gradient.
    #[test]
    fn latent_moe_forward_and_all_gradients_match_reference() {
        let device = Default::default();
        let moe = config().init::<GpuAd>(&device);
        let mut r = rng(17);
        let x = randn::<GpuAd, 3>(&mut r, [2, 9, 16], 1.0, &device);
        let probe = randn::<GpuAd, 3>(&mut r, [2, 9, 16], 1.0, &device);
        let pad: Vec<bool> = (0..18).map(|i| i % 7 == 3).collect();
        for padded in [false, true] {
            let run = |kernel: bool| {
                let x = x.clone().require_grad();
                let mask = padded.then(|| {
                    Tensor::<GpuAd, 2, Bool>::from_data(
                        TensorData::new(pad.clone(), [2, 9]),
                        &device,
                    )
                });
                let go = || {
                    let out = moe.try_forward(x.clone(), mask).unwrap();
                    let grads = out.output.clone().mul(probe.clone()).sum().backward();
                    let mut all = vec![("out".to_string(), host(out.output))];
                    all.push(("x".into(), host(x.grad(&grads).unwrap())));
                    all.extend(grads_of(&moe, &grads));
                    all
                };
                if kernel {
                    on_kernel(FusedOp::MoeExpertsBackward, 1, || {
                        on_kernel(FusedOp::MoeExperts, 1, go)
                    })
                } else {
                    on_reference(FusedOp::MoeExperts, go)
                }
            };
            let (k, rf) = (run(true), run(false));
            // The reference path multiplies with Burn's matmul (TF32 on CUDA).
            let tol = matmul_tol::<GpuAd>(&device, 1e-5);
            for ((name, a), (_, b)) in rf.iter().zip(&k) {
                assert_eq!(
                    a.len(),
                    b.len(),
                    "{name}: gradient present on one path only"
                );
                assert_close(&format!("{name} (padded {padded})"), a, b, tol);
            }
            moe.balance.update();
        }
        // Inference (no autodiff) takes the kernel path too.
        let plain = moe.valid();
        let xi = x.clone().inner();
        let yk = on_kernel(FusedOp::MoeExperts, 1, || plain.forward(xi.clone()).output);
        let yr = on_reference(FusedOp::MoeExperts, || plain.forward(xi.clone()).output);
        let tol = matmul_tol::<Gpu>(&Default::default(), 1e-5);
        assert_close("inference output", &host(yr), &host(yk), tol);
    }
}
