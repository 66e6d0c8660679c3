//! SiTU-GLU, router, balancers and Stable LatentMoE on the reference path (design §1–§3).

use crate::common::*;
use burn::module::{AutodiffModule, Module};
use burn::tensor::{backend::AutodiffBackend, backend::Backend, Bool, Tensor, TensorData};
use kimi_burn::nn::balance::{
    quantile_bias_exact, quantile_bias_from_histogram, Balancer, MoeStats, QuantileBalancer,
    RoutedBatch, SignBalancer,
};
use kimi_burn::nn::{
    BalancerKind, GluActivation, LatentMoe, LatentMoeConfig, MoeLayout, RouterConfig, RouterOptions,
};
use kimi_burn::ops::moe::route::{select_top_k, Scoring, Selection, TopKOptions};
use kimi_burn::ops::{situ_glu, situ_glu_weighted, with_kernels};
use kimi_burn::Error;
use rand::Rng;

/// SiTU-GLU (capped and uncapped), its routed form with a per-row weight and SwiGLU against the f64
/// formula on the design §1 grid ([`SITU_POINTS`]: zeros of both signs, both sides of ±β, the tails
/// up to 1e4): value ≤ 1e-6, gradients ≤ 1e-5 (design §0), no NaN or infinity, on the fast path of
/// the backend (CubeCL kernel or CPU host kernel) and on the tensor-op reference.
fn check_situ_numerics<B: AutodiffBackend>(device: &B::Device) {
    let (g, v) = situ_grid();
    let n = g.len();
    let rows = SITU_POINTS.len();
    let mut r = rng(13);
    let dy = normal_vec(&mut r, n);
    let p: Vec<f64> = (0..rows).map(|_| r.random_range(0.1..2.0)).collect();
    let column = |f: &dyn Fn(usize) -> f64| (0..n).map(f).collect::<Vec<f64>>();
    for kernels in [true, false] {
        for (name, beta2, swi) in [
            ("SiTU-GLU β2 = 25", Some(25.0), false),
            ("SiTU-GLU uncapped", None, false),
            ("SwiGLU", None, true),
        ] {
            let gate = from_f64::<B, 1>(&g, [n], device).require_grad();
            let up = from_f64::<B, 1>(&v, [n], device).require_grad();
            let (y, grads) = with_kernels(kernels, || {
                let y = if swi {
                    kimi_burn::ops::moe::situ::swiglu(gate.clone(), up.clone())
                } else {
                    situ_glu(gate.clone(), up.clone(), 4.0, beta2)
                };
                let grads = y.clone().mul(from_f64(&dy, [n], device)).sum().backward();
                (y, grads)
            });
            let f64_of = |i: usize| {
                if swi {
                    swiglu64(g[i], v[i])
                } else {
                    situ64(g[i], v[i], 4.0, beta2.map(f64::from))
                }
            };
            let what = format!("{name}, kernels {kernels}");
            assert_close(
                &format!("y, {what}"),
                &column(&|i| f64_of(i).0),
                &host(y),
                1e-6,
            );
            let dg = host(gate.grad(&grads).expect("dgate"));
            let dv = host(up.grad(&grads).expect("dup"));
            assert_close(
                &format!("dgate, {what}"),
                &column(&|i| dy[i] * f64_of(i).1),
                &dg,
                1e-5,
            );
            assert_close(
                &format!("dup, {what}"),
                &column(&|i| dy[i] * f64_of(i).2),
                &dv,
                1e-5,
            );
        }

        // The routed form: y = p·A(gate)·B(up) per row, dp = Σ_row dY·A·B.
        let gate = from_f64::<B, 2>(&g, [rows, rows], device).require_grad();
        let up = from_f64::<B, 2>(&v, [rows, rows], device).require_grad();
        let weight = from_f64::<B, 1>(&p, [rows], device).require_grad();
        let (y, grads) = with_kernels(kernels, || {
            let y = situ_glu_weighted(gate.clone(), up.clone(), weight.clone(), 4.0, Some(25.0));
            let grads = y
                .clone()
                .mul(from_f64(&dy, [rows, rows], device))
                .sum()
                .backward();
            (y, grads)
        });
        let e = |i: usize| situ64(g[i], v[i], 4.0, Some(25.0));
        let what = format!("weighted, kernels {kernels}");
        assert_close(
            &format!("y, {what}"),
            &column(&|i| p[i / rows] * e(i).0),
            &host(y),
            1e-6,
        );
        let dg = host(gate.grad(&grads).expect("dgate"));
        let dp = host(weight.grad(&grads).expect("dweight"));
        let dg_ref = column(&|i| p[i / rows] * dy[i] * e(i).1);
        assert_close(&format!("dgate, {what}"), &dg_ref, &dg, 1e-5);
        let dp_ref: Vec<f64> = (0..rows)
            .map(|row| {
                (0..rows)
                    .map(|j| dy[row * rows + j] * e(row * rows + j).0)
                    .sum()
            })
            .collect();
        assert_close(&format!("dweight, {what}"), &dp_ref, &dp, 1e-5);
    }
}
on_backends!(situ_numerics, check_situ_numerics);

#[test]
fn situ_is_bounded_and_tends_to_swiglu_for_small_inputs() {
    let device = Default::default();
    let mut r = rng(12);
    let g = randn::<Cpu, 1>(&mut r, [4096], 200.0, &device);
    let v = randn::<Cpu, 1>(&mut r, [4096], 200.0, &device);
    let big = host(situ_glu(g.clone(), v.clone(), 4.0, Some(25.0)));
    // Mathematically |A·B| < 100; in floating point both caps saturate to exactly 4 and 25.
    assert!(
        big.iter().all(|y| y.is_finite() && y.abs() <= 100.0),
        "|SiTU-GLU| must stay within beta1*beta2 = 100"
    );
    let swi = |g: &[f64], v: &[f64]| -> Vec<f64> {
        g.iter()
            .zip(v)
            .map(|(&g, &v)| g * sigmoid64(g) * v)
            .collect()
    };
    let (gh, vh) = (host(g), host(v));
    let far = big
        .iter()
        .zip(swi(&gh, &vh))
        .filter(|(a, b)| (*a - b).abs() > 1.0)
        .count();
    assert!(
        far > 2000,
        "large inputs must differ from SwiGLU, only {far} of 4096 did"
    );

    let g = uniform::<Cpu, 1>(&mut r, [4096], -0.4, 0.4, &device);
    let v = uniform::<Cpu, 1>(&mut r, [4096], -1.0, 1.0, &device);
    let small = host(situ_glu(g.clone(), v.clone(), 4.0, Some(25.0)));
    let max = small
        .iter()
        .zip(swi(&host(g), &host(v)))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        max < 1e-3,
        "small inputs must match SwiGLU within 1e-3, max diff {max:e}"
    );
}

// ---------------------------------------------------------------- router

#[test]
fn top_k_ties_go_to_the_lower_index_and_bias_only_selects() {
    let scores = [0.5f32, 0.7, 0.7, 0.1, 0.7, 0.2];
    let sel = select_top_k(
        &scores,
        6,
        &[0.0; 6],
        TopKOptions {
            k: 2,
            n_group: 1,
            topk_group: 1,
        },
    )
    .unwrap();
    assert_eq!(sel.indices, vec![1, 2]);
    let sel = select_top_k(
        &scores,
        6,
        &[0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        TopKOptions {
            k: 2,
            n_group: 1,
            topk_group: 1,
        },
    )
    .unwrap();
    assert_eq!(sel.indices, vec![5, 1]);
}

/// Brute-force reference of grouped top-k: enumerate groups, then experts, with the design §2 rules.
fn grouped_reference(row: &[f32], bias: &[f32], k: usize, groups: usize, keep: usize) -> Vec<u32> {
    let n = row.len();
    let per = n / groups;
    let biased: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
    let mut gscore: Vec<(f32, usize)> = (0..groups)
        .map(|g| {
            let mut v: Vec<f32> = biased[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v.iter().take(2).sum(), g)
        })
        .collect();
    gscore.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let kept: Vec<usize> = gscore[..keep].iter().map(|x| x.1).collect();
    let mut cand: Vec<(f32, usize)> = (0..n)
        .filter(|j| kept.contains(&(j / per)))
        .map(|j| (biased[j], j))
        .collect();
    cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    cand[..k].iter().map(|x| x.1 as u32).collect()
}

#[test]
fn grouped_top_k_matches_brute_force() {
    let mut r = rng(21);
    let (m, n, k) = (64, 16, 3);
    let scores: Vec<f32> = (0..m * n).map(|_| r.random::<f32>()).collect();
    let bias: Vec<f32> = (0..n).map(|_| r.random_range(-0.2..0.2)).collect();
    let sel = select_top_k(
        &scores,
        n,
        &bias,
        TopKOptions {
            k,
            n_group: 4,
            topk_group: 2,
        },
    )
    .unwrap();
    for t in 0..m {
        let expected = grouped_reference(&scores[t * n..(t + 1) * n], &bias, k, 4, 2);
        assert_eq!(
            &sel.indices[t * k..(t + 1) * k],
            expected.as_slice(),
            "token {t}"
        );
    }
}

/// Enough tokens that the selection runs in several chunks on the thread pool (the last one
/// partial): every row as the brute force has it, and a NaN reported at its own token.
#[test]
fn top_k_of_many_tokens_matches_brute_force_and_finds_the_nan() {
    let mut r = rng(23);
    let (m, n, k) = (3000, 64, 8);
    let mut scores: Vec<f32> = (0..m * n).map(|_| r.random::<f32>()).collect();
    let bias: Vec<f32> = (0..n).map(|_| r.random_range(-0.2..0.2)).collect();
    let opts = TopKOptions {
        k,
        n_group: 1,
        topk_group: 1,
    };
    let sel = select_top_k(&scores, n, &bias, opts).unwrap();
    assert_eq!(sel.indices.len(), m * k);
    for t in 0..m {
        let expected = grouped_reference(&scores[t * n..(t + 1) * n], &bias, k, 1, 1);
        assert_eq!(
            &sel.indices[t * k..(t + 1) * k],
            expected.as_slice(),
            "token {t}"
        );
    }
    scores[2900 * n + 5] = f32::NAN;
    scores[2950 * n] = f32::NAN;
    let err = select_top_k(&scores, n, &bias, opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("token 2900, expert 5"), "{err}");
}

fn check_router_weights<B: AutodiffBackend>(device: &B::Device) {
    let mut r = rng(22);
    let (m, d, n, k) = (10, 12, 7, 3);
    for (scoring, renorm, scale) in [
        (Scoring::Sigmoid, true, 2.446),
        (Scoring::Softmax, false, 1.0),
        (Scoring::Softmax, true, 1.0),
    ] {
        let opts = RouterOptions {
            scoring,
            renormalize: renorm,
            routed_scaling_factor: scale,
            ..Default::default()
        };
        let router = RouterConfig::new(d, n, k)
            .with_options(opts)
            .init::<B>(device);
        let x = randn::<B, 2>(&mut r, [m, d], 1.0, device);
        let bias: Vec<f32> = (0..n).map(|_| r.random_range(-0.3..0.3)).collect();
        let routing = router.route(x.clone(), &bias).unwrap();
        // Independent host computation of the scores and weights.
        let w = host(router.gate.weight.val());
        let xh = host(x);
        let mut expected = Vec::new();
        for t in 0..m {
            let logits: Vec<f64> = (0..n)
                .map(|j| (0..d).map(|i| xh[t * d + i] * w[i * n + j]).sum())
                .collect();
            let s: Vec<f64> = match scoring {
                Scoring::Sigmoid => logits.iter().map(|&l| sigmoid64(l)).collect(),
                Scoring::Softmax => {
                    let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    e.iter().map(|v| v / z).collect()
                }
                other => panic!("a scoring this test does not know: {other:?}"),
            };
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                (s[b] + bias[b] as f64)
                    .total_cmp(&(s[a] + bias[a] as f64))
                    .then(a.cmp(&b))
            });
            let top = &order[..k];
            assert_eq!(
                routing.selection().indices[t * k..(t + 1) * k]
                    .iter()
                    .map(|&j| j as usize)
                    .collect::<Vec<_>>(),
                top,
                "selection of token {t}"
            );
            let sum: f64 = top.iter().map(|&j| s[j]).sum();
            for &j in top {
                let p = if renorm { s[j] / (sum + 1e-20) } else { s[j] };
                expected.push(p * scale);
            }
        }
        // The router's logits come from Burn's matmul (TF32 on CUDA).
        let tol = matmul_tol::<B>(device, 1e-5);
        assert_close("routing weights", &expected, &host(routing.weights), tol);
    }
}
on_backends!(router_weights, check_router_weights);

#[test]
fn router_rejects_bad_configs_and_inputs() {
    let device = Default::default();
    let bad_k0 = RouterConfig::new(8, 4, 0).try_init::<Cpu>(&device);
    assert!(
        matches!(bad_k0, Err(Error::Config { ref field, .. }) if field == "top_k"),
        "{bad_k0:?}"
    );
    let bad_kn = RouterConfig::new(8, 4, 4)
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(
        bad_kn.to_string().contains("top_k = 4") && bad_kn.to_string().contains("n_experts = 4"),
        "{bad_kn}"
    );
    let opts = RouterOptions {
        n_group: 3,
        ..Default::default()
    };
    let bad_group = RouterConfig::new(8, 4, 1)
        .with_options(opts)
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(bad_group.to_string().contains("n_group = 3"), "{bad_group}");

    let router = RouterConfig::new(8, 4, 2).init::<Cpu>(&device);
    let err = router
        .route(Tensor::zeros([3, 5], &device), &[0.0; 4])
        .unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("[3, 5]"),
        "{err}"
    );
    let err = router
        .route(Tensor::zeros([3, 8], &device), &[0.0; 3])
        .unwrap_err();
    assert!(err.to_string().contains("bias"), "{err}");
    let mut x = vec![0.5f32; 24];
    x[9] = f32::NAN;
    let err = router
        .route(
            Tensor::from_data(TensorData::new(x, [3, 8]), &device),
            &[0.0; 4],
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::NonFinite { .. }) && err.to_string().contains("token 1"),
        "{err}"
    );
}

// ---------------------------------------------------------------- balancers

#[test]
fn qb_recovery_reproduces_the_spec_unit_vector() {
    let (bias, bounds) = quantile_bias_from_histogram(&[0, 2, 2, 0, 2, 2, 0, 0], 4, (-1.0, 1.0), 1);
    assert_eq!(bias, vec![0.25, -0.25]);
    assert_eq!(bounds, (-1.25, 1.25));
    let (empty, same) = quantile_bias_from_histogram(&[0; 8], 4, (-1.0, 1.0), 1);
    assert!(empty.is_empty() && same == (-1.0, 1.0));
}

/// A skewed synthetic router (design §3): sigmoid scores with a strong per-expert offset.
struct SkewedRouter {
    offsets: Vec<f32>,
    rng: rand::rngs::StdRng,
}

impl SkewedRouter {
    fn new(n: usize, seed: u64) -> Self {
        let offsets = (0..n)
            .map(|j| -3.0 + 6.0 * j as f32 / (n - 1) as f32)
            .collect();
        Self {
            offsets,
            rng: rng(seed),
        }
    }

    fn batch(&mut self, m: usize) -> Vec<f32> {
        let n = self.offsets.len();
        let z = normal_vec(&mut self.rng, m * n);
        (0..m * n)
            .map(|i| 1.0 / (1.0 + (-(z[i] as f32 + self.offsets[i % n])).exp()))
            .collect()
    }
}

fn route(scores: &[f32], n: usize, bias: &[f32], k: usize) -> Selection {
    select_top_k(
        scores,
        n,
        bias,
        TopKOptions {
            k,
            n_group: 1,
            topk_group: 1,
        },
    )
    .unwrap()
}

#[test]
fn qb_exact_and_histogram_agree_within_one_bin() {
    let (m, n, k, bins) = (8192, 64, 4, 1000);
    let mut router = SkewedRouter::new(n, 31);
    let scores = router.batch(m);
    let bias: Vec<f32> = (0..n).map(|j| 0.01 * (j % 5) as f32).collect();
    let sel = route(&scores, n, &bias, k);
    let batch = RoutedBatch {
        scores: &scores,
        bias: &bias,
        selection: &sel,
        valid: None,
    };
    let exact = quantile_bias_exact(&batch).unwrap();
    let mut qb = QuantileBalancer::new(n, bins).unwrap();
    qb.observe(&batch).unwrap();
    let (lo, hi) = qb.bounds().unwrap();
    let hist = qb.update(&bias);
    let width = (hi - lo) / bins as f32;
    let worst = exact
        .iter()
        .zip(&hist)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= width,
        "exact vs histogram differ by {worst}, more than one bin ({width})"
    );
}

fn max_violation(scores: &[f32], n: usize, bias: &[f32], k: usize) -> f32 {
    MoeStats::from_selection(&route(scores, n, bias, k), None).max_violation
}

/// design §3's expectation on a skewed synthetic router (m = 8192, n = 64, k = 4). QB is causal: the
/// bias computed from one batch routes the next. The load of a *fresh* batch also carries the
/// sampling noise of 8192 tokens (about 0.1-0.2 in max violation at n = 64), so the "a few steps"
/// check measures how well the recovered bias balances the pooled batch it was computed from, and
/// the fresh-batch violation only against that noise floor.
#[test]
fn qb_balances_a_skewed_router_in_a_few_steps_where_the_sign_rule_cannot() {
    let (m, n, k) = (8192, 64, 4);
    let mut router = SkewedRouter::new(n, 32);
    let fresh = router.batch(m);
    let mut qb = QuantileBalancer::new(n, 1000).unwrap();
    let mut sign = SignBalancer::new(n, 1e-3).unwrap();
    let (mut b_qb, mut b_sign) = (vec![0.0f32; n], vec![0.0f32; n]);
    let start = max_violation(&fresh, n, &b_qb, k);
    assert!(
        start > 5.0,
        "the synthetic router must start badly skewed, got {start}"
    );
    let mut in_sample = 0.0;
    for step in 0..5 {
        let scores = router.batch(m);
        for (bal, bias) in [
            (&mut qb as &mut dyn Balancer, &mut b_qb),
            (&mut sign, &mut b_sign),
        ] {
            let sel = route(&scores, n, bias, k);
            bal.observe(&RoutedBatch {
                scores: &scores,
                bias,
                selection: &sel,
                valid: None,
            })
            .unwrap();
            *bias = bal.update(bias);
        }
        in_sample = max_violation(&scores, n, &b_qb, k);
        if step == 0 {
            let v = max_violation(&fresh, n, &b_qb, k);
            assert!(
                v < 0.5,
                "one QB step must bring the max violation of a fresh batch under 0.5, got {v}"
            );
        }
    }
    assert!(
        in_sample < 0.15,
        "after five QB steps the pooled batch must be within 0.15, got {in_sample}"
    );
    let v = max_violation(&fresh, n, &b_qb, k);
    assert!(
        v < 0.25,
        "after five QB steps a fresh batch must be within the sampling noise, got {v}"
    );
    let sign_v = max_violation(&fresh, n, &b_sign, k);
    assert!(
        sign_v > 3.0,
        "the sign rule (gamma = 1e-3) should still be far off after 5 steps, got {sign_v}"
    );
}

#[test]
fn qb_counts_pool_across_micro_batches_replicas_and_ignore_masked_tokens() {
    let (n, k, bins) = (16, 2, 100);
    let mut router = SkewedRouter::new(n, 33);
    let bias: Vec<f32> = (0..n).map(|j| 0.05 * j as f32 - 0.4).collect();
    let micro: Vec<Vec<f32>> = (0..4).map(|_| router.batch(256)).collect();
    let pooled: Vec<f32> = micro.concat();

    let mut one = QuantileBalancer::new(n, bins).unwrap();
    let sel = route(&pooled, n, &bias, k);
    one.observe(&RoutedBatch {
        scores: &pooled,
        bias: &bias,
        selection: &sel,
        valid: None,
    })
    .unwrap();

    let mut acc = QuantileBalancer::new(n, bins).unwrap();
    let mut replica = QuantileBalancer::new(n, bins).unwrap();
    for (i, mb) in micro.iter().enumerate() {
        let sel = route(mb, n, &bias, k);
        let target = if i < 2 { &mut acc } else { &mut replica };
        target
            .observe(&RoutedBatch {
                scores: mb,
                bias: &bias,
                selection: &sel,
                valid: None,
            })
            .unwrap();
    }
    acc.merge(replica.counts()).unwrap();
    assert_eq!(
        acc.counts(),
        one.counts(),
        "4 micro-batches over 2 replicas must equal one pooled batch"
    );

    // Padding tokens with wild scores, masked out, change nothing.
    let mut padded = pooled.clone();
    padded.extend(std::iter::repeat_n(0.999f32, 300 * n));
    let mut valid = vec![true; 1024];
    valid.extend(std::iter::repeat_n(false, 300));
    let mut masked = QuantileBalancer::new(n, bins).unwrap();
    let sel = route(&padded, n, &bias, k);
    masked
        .observe(&RoutedBatch {
            scores: &padded,
            bias: &bias,
            selection: &sel,
            valid: Some(&valid),
        })
        .unwrap();
    assert_eq!(masked.counts(), one.counts());
    assert_eq!(masked.update(&bias), one.clone().update(&bias));

    let mut sign = SignBalancer::new(n, 1e-3).unwrap();
    sign.observe(&RoutedBatch {
        scores: &padded,
        bias: &bias,
        selection: &sel,
        valid: Some(&valid),
    })
    .unwrap();
    let stats = MoeStats::from_selection(&route(&pooled, n, &bias, k), None);
    assert_eq!(sign.counts(), stats.tokens_per_expert.as_slice());
}

#[test]
fn moe_stats_follow_their_definitions() {
    let s = MoeStats::from_loads(vec![0, 2, 4, 2]);
    assert_eq!(s.dead_experts, 1);
    assert!((s.max_violation - 1.0).abs() < 1e-6);
    assert!((s.cv - (2.0f32).sqrt() / 2.0).abs() < 1e-6);
}

/// The median gap between each valid token's k-th and (k+1)-th biased score, by full sorts.
fn margin_reference(
    scores: &[f32],
    n: usize,
    bias: &[f32],
    k: usize,
    valid: Option<&[bool]>,
) -> Option<f64> {
    let mut gaps: Vec<f64> = scores
        .chunks(n)
        .enumerate()
        .filter(|(t, _)| valid.is_none_or(|v| v[*t]))
        .map(|(_, row)| {
            let mut z: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
            z.sort_by(|a, b| b.partial_cmp(a).unwrap());
            f64::from(z[k - 1]) - f64::from(z[k])
        })
        .collect();
    gaps.sort_by(|a, b| a.partial_cmp(b).unwrap());
    match gaps.len() {
        0 => None,
        len if len % 2 == 1 => Some(gaps[len / 2]),
        len => Some(0.5 * (gaps[len / 2 - 1] + gaps[len / 2])),
    }
}

#[test]
fn median_margin_matches_full_sorts_and_skips_masked_tokens() {
    let mut r = rng(45);
    let n = 8;
    // 8193 tokens: enough scores for the thread pool's path.
    for (m, k) in [(257, 2), (200, 3), (1, 1), (8193, 3)] {
        let scores: Vec<f32> = (0..m * n).map(|_| r.random::<f32>()).collect();
        let bias: Vec<f32> = (0..n).map(|_| r.random::<f32>() - 0.5).collect();
        let valid: Vec<bool> = (0..m).map(|t| t == 0 || r.random::<f32>() > 0.2).collect();
        let sel = route(&scores, n, &bias, k);
        for mask in [None, Some(valid.as_slice())] {
            let batch = RoutedBatch {
                scores: &scores,
                bias: &bias,
                selection: &sel,
                valid: mask,
            };
            let got = batch.median_margin().unwrap().unwrap();
            let want = margin_reference(&scores, n, &bias, k, mask).unwrap();
            assert!(
                (f64::from(got) - want).abs() < 1e-6,
                "m {m}, k {k}, masked {}: {got} vs {want}",
                mask.is_some()
            );
        }
        // Masked tokens do not count: make every masked token's margin huge.
        let mut wide = scores.clone();
        for (t, row) in wide.chunks_mut(n).enumerate() {
            if !valid[t] {
                row.iter_mut()
                    .enumerate()
                    .for_each(|(j, s)| *s = 100.0 * j as f32);
            }
        }
        let batch = RoutedBatch {
            scores: &wide,
            bias: &bias,
            selection: &route(&wide, n, &bias, k),
            valid: Some(&valid),
        };
        let want = margin_reference(&scores, n, &bias, k, Some(&valid)).unwrap();
        let got = batch.median_margin().unwrap().unwrap();
        assert!((f64::from(got) - want).abs() < 1e-6, "{got} vs {want}");
    }
    // No valid token: no margin. A bias of the wrong length: a shape error.
    let scores = [0.1f32, 0.9, 0.5, 0.4, 0.2, 0.3];
    let sel = route(&scores, 3, &[0.0; 3], 1);
    let none = RoutedBatch {
        scores: &scores,
        bias: &[0.0; 3],
        selection: &sel,
        valid: Some(&[false, false]),
    };
    assert_eq!(none.median_margin().unwrap(), None);
    let short = RoutedBatch {
        bias: &[0.0; 2],
        valid: None,
        ..none
    };
    assert!(matches!(short.median_margin(), Err(Error::Shape { .. })));
    // k = 0 has no k-th score: an error naming k, not a panic.
    let no_k = Selection {
        k: 0,
        indices: Vec::new(),
        ..sel.clone()
    };
    let err = RoutedBatch {
        selection: &no_k,
        valid: None,
        ..none
    }
    .median_margin()
    .unwrap_err();
    assert!(err.to_string().contains("k = 0"), "{err}");
    // Two tokens: the mean of their gaps (0.9 - 0.5 and 0.4 - 0.3).
    let two = RoutedBatch {
        valid: None,
        ..none
    };
    let got = two.median_margin().unwrap().unwrap();
    assert!((got - 0.25).abs() < 1e-6, "{got}");
}

/// The MoE forward reports the margin of the bias and tokens it routed with, on the host path.
#[test]
fn moe_forward_reports_the_median_margin_of_its_routing() {
    type B = CpuAd;
    let device = Default::default();
    let mut r = rng(46);
    let moe =
        moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ()).init::<B>(&device);
    let bias: Vec<f32> = (0..6).map(|j| 0.05 * j as f32).collect();
    moe.balance.set_bias(&bias);
    let x = randn::<B, 3>(&mut r, [2, 9, 12], 1.0, &device);
    let mut pad = vec![false; 18];
    pad[2] = true;
    pad[11] = true;
    let padding = Tensor::<B, 2, Bool>::from_data(TensorData::new(pad.clone(), [2, 9]), &device);
    let out = moe.try_forward(x.clone(), Some(padding)).unwrap();
    let scores: Vec<f32> = host(moe.router.scores(x.reshape([18, 12])))
        .iter()
        .map(|&v| v as f32)
        .collect();
    let valid: Vec<bool> = pad.iter().map(|p| !p).collect();
    let want = margin_reference(&scores, 6, &bias, 2, Some(&valid)).unwrap();
    let got = out
        .loads
        .median_margin()
        .expect("the host path reports a margin");
    assert!((f64::from(got) - want).abs() < 1e-6, "{got} vs {want}");
    assert_eq!(MoeStats::from_loads(vec![1, 2]).median_margin, None);
}

// ---------------------------------------------------------------- LatentMoE

fn moe_config(layout: MoeLayout, activation: GluActivation) -> LatentMoeConfig {
    LatentMoeConfig::new(12, 6, 2, 10)
        .with_layout(layout)
        .with_n_shared(1)
        .with_shared_hidden(Some(8))
        .with_activation(activation)
        .with_balancer(BalancerKind::quantile())
}

/// Every token on its own: `Σ_j p_j E_j(h_t)` with the experts called one row at a time.
fn dense_loop_reference<B: Backend>(moe: &LatentMoe<B>, x: Tensor<B, 3>) -> Vec<f64> {
    let [b, t, d] = x.dims();
    let flat = x.reshape([b * t, d]);
    let routing = moe
        .router
        .route(flat.clone(), &moe.balance.bias_host())
        .unwrap();
    let p = host(routing.weights.clone());
    let k = routing.selection().k;
    let mut rows = Vec::new();
    for tok in 0..b * t {
        let xt = flat.clone().narrow(0, tok, 1);
        let h = moe
            .down
            .as_ref()
            .map_or(xt.clone(), |down| down.forward(xt.clone()));
        let mut u = h.zeros_like();
        if let Some(up) = &moe.up {
            u = Tensor::zeros([1, up.weight.dims()[0]], &xt.device());
        }
        for s in 0..k {
            let e = routing.selection().indices[tok * k + s] as usize;
            u = u.add(
                moe.experts
                    .expert(e)
                    .forward(h.clone())
                    .mul_scalar(p[tok * k + s]),
            );
        }
        let u = moe
            .norm
            .as_ref()
            .map_or(u.clone(), |n| n.forward(u.clone()));
        let mut y = moe
            .up
            .as_ref()
            .map_or(u.clone(), |up| up.forward(u.clone()));
        if let Some(shared) = &moe.shared {
            y = y.add(shared.forward(xt));
        }
        rows.push(y);
    }
    host(Tensor::cat(rows, 0))
}

fn check_dispatch_matches_dense_loop<B: AutodiffBackend>(device: &B::Device) {
    let mut r = rng(41);
    for layout in [
        MoeLayout::Standard,
        MoeLayout::Latent { dim: 8 },
        MoeLayout::StableLatent { dim: 8 },
    ] {
        for act in [GluActivation::situ(), GluActivation::SwiGlu] {
            let moe = moe_config(layout, act).init::<B::InnerBackend>(device);
            let x = randn::<B::InnerBackend, 3>(&mut r, [2, 9, 12], 1.0, device);
            let out = moe.forward(x.clone());
            assert_eq!(out.stats().tokens_per_expert.iter().sum::<u64>(), 2 * 9 * 2);
            assert_close(
                &format!("{layout:?} {act:?}"),
                &dense_loop_reference(&moe, x),
                &host(out.output),
                // Both sides project through Burn's matmul, on different shapes (TF32 on CUDA).
                matmul_tol::<B>(device, 1e-5),
            );
        }
    }
}
on_backends!(
    dispatch_matches_dense_loop,
    check_dispatch_matches_dense_loop
);

fn check_stable_latent_is_invariant_to_weight_scale<B: AutodiffBackend>(device: &B::Device) {
    let mut r = rng(42);
    let x = randn::<B::InnerBackend, 3>(&mut r, [2, 7, 12], 1.0, device);
    // The invariance is exact for the homogeneous part of RMSNorm; a tiny eps keeps the test about
    // that (at eps = 1e-5 the tiny random experts give |u|² ~ 1e-4 and eps shows at the 1% level).
    let base = moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ())
        .with_rms_norm_eps(1e-12)
        .init::<B::InnerBackend>(device);
    let scaled_cfg = RouterOptions {
        routed_scaling_factor: 3.7,
        ..Default::default()
    };
    let mut scaled = base.clone();
    scaled.router = RouterConfig::new(12, 6, 2)
        .with_options(scaled_cfg)
        .init(device)
        .load_record(base.router.clone().into_record());
    let y0 = host(base.forward(x.clone()).output);
    let y1 = host(scaled.forward(x.clone()).output);
    assert_close("Stable LatentMoE under p -> 3.7 p", &y0, &y1, 1e-5);

    // Without the norm the same rescaling must show (the check above can fail).
    let mut plain = base.clone();
    plain.norm = None;
    let mut plain_scaled = scaled.clone();
    plain_scaled.norm = None;
    let (a, b) = (
        host(plain.forward(x.clone()).output),
        host(plain_scaled.forward(x).output),
    );
    assert!(
        rel_err(&a, &b) > 1e-2,
        "plain LatentMoE must depend on the weight scale"
    );
}
on_backends!(
    stable_latent_scale_invariance,
    check_stable_latent_is_invariant_to_weight_scale
);

fn check_training_forward_feeds_the_balancer<B: AutodiffBackend>(device: &B::Device) {
    let mut r = rng(44);
    let moe =
        moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ()).init::<B>(device);
    let x = randn::<B, 3>(&mut r, [2, 5, 12], 1.0, device);
    let mut pad = vec![false; 10];
    pad[3] = true;
    pad[7] = true;
    let padding = Tensor::<B, 2, Bool>::from_data(TensorData::new(pad, [2, 5]), device);

    // Inference (no autodiff) never counts.
    let inner = moe.valid();
    let _ = inner.forward(x.clone().inner());
    assert_eq!(moe.balance.counts().iter().sum::<u64>(), 0);

    let out = moe.try_forward(x.clone(), Some(padding.clone())).unwrap();
    assert_eq!(
        out.stats().tokens_per_expert.iter().sum::<u64>(),
        8 * 2,
        "padding must not be counted"
    );
    assert_eq!(
        moe.balance.counts().iter().sum::<u64>(),
        8 * 6,
        "8 valid tokens x 6 experts in the histogram"
    );
    let routed = host(out.output.clone().slice([0..1, 3..4]));
    let shared_only = host(
        moe.shared
            .as_ref()
            .unwrap()
            .forward(x.clone().slice([0..1, 3..4])),
    );
    let up_of_zero = host(
        moe.up.as_ref().unwrap().forward(
            moe.norm
                .as_ref()
                .unwrap()
                .forward(Tensor::<B, 3>::zeros([1, 1, 8], device)),
        ),
    );
    let expected: Vec<f64> = shared_only
        .iter()
        .zip(up_of_zero)
        .map(|(a, b)| a + b)
        .collect();
    assert_close(
        "padding tokens get no routed output",
        &expected,
        &routed,
        1e-6,
    );

    let before = moe.balance.bias_host();
    let after = moe.update_balance();
    assert_ne!(before, after, "a QB update must move the bias");
    assert_eq!(moe.balance.bias_host(), after);
    assert_eq!(
        moe.balance.counts().iter().sum::<u64>(),
        0,
        "update clears the counts"
    );

    // Every parameter that takes part gets a finite gradient; the bias is not a parameter.
    let grads = moe.forward(x).output.sum().backward();
    let g = moe.router.gate.weight.grad(&grads).unwrap();
    assert!(host(g).iter().all(|v| v.is_finite()));
    assert!(moe.experts.w1.grad(&grads).is_some());
}
on_backends!(
    training_forward_feeds_the_balancer,
    check_training_forward_feeds_the_balancer
);

#[test]
fn moe_rejects_bad_configs_and_inputs() {
    let device = Default::default();
    let err = LatentMoeConfig::new(12, 6, 6, 10)
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("top_k = 6"), "{err}");
    let err = LatentMoeConfig::new(12, 6, 0, 10)
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("top_k = 0"), "{err}");
    let err = LatentMoeConfig::new(12, 6, 2, 10)
        .with_layout(MoeLayout::Latent { dim: 20 })
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(
        err.to_string().contains("latent_dim") && err.to_string().contains("20"),
        "{err}"
    );
    let err = LatentMoeConfig::new(12, 6, 2, 10)
        .with_activation(GluActivation::Situ {
            beta1: -1.0,
            beta2: None,
        })
        .try_init::<Cpu>(&device)
        .unwrap_err();
    assert!(err.to_string().contains("activation_situ_beta"), "{err}");

    let moe =
        moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ()).init::<Cpu>(&device);
    let err = moe
        .try_forward(Tensor::zeros([2, 3, 11], &device), None)
        .unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("11"),
        "{err}"
    );
    let mut x = vec![0.1f32; 2 * 3 * 12];
    x[40] = f32::NAN;
    let err = moe
        .try_forward(
            Tensor::from_data(TensorData::new(x, [2, 3, 12]), &device),
            None,
        )
        .unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err}");
    let err = moe
        .try_forward(
            Tensor::zeros([2, 3, 12], &device),
            Some(Tensor::from_data(
                TensorData::new(vec![false; 4], [2, 2]),
                &device,
            )),
        )
        .unwrap_err();
    assert!(err.to_string().contains("padding"), "{err}");
}

/// `LatentMoeConfig::num_params` against the parameters an initialised module really holds, for
/// K3's layout at 1/64 of its widths (all 896 experts, top-16, two shared) and the other layouts;
/// the active count is the total less the unselected experts as the module counts them.
#[test]
fn num_params_counts_the_parameters_of_the_initialised_module() {
    let device = Default::default();
    let k3 = kimi_burn::KimiConfig::k3().moe_config();
    let MoeLayout::StableLatent { dim } = k3.layout else {
        panic!("K3 is a Stable LatentMoE")
    };
    let k3_small = LatentMoeConfig::new(
        k3.d_model / 64,
        k3.n_experts,
        k3.top_k,
        k3.expert_hidden / 64,
    )
    .with_layout(MoeLayout::StableLatent { dim: dim / 64 })
    .with_n_shared(k3.n_shared)
    .with_shared_hidden(k3.shared_hidden.map(|h| h / 64))
    .with_activation(k3.activation);
    let cases = [
        k3_small,
        moe_config(MoeLayout::Standard, GluActivation::SwiGlu),
        moe_config(MoeLayout::Latent { dim: 5 }, GluActivation::situ()).with_n_shared(0),
        moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ())
            .with_n_shared(2)
            .with_shared_hidden(None),
    ];
    for cfg in cases {
        let moe = cfg.init::<Cpu>(&device);
        let (total, active) = cfg.num_params();
        // Burn counts every float tensor of the module, the balance bias (one value per expert,
        // set by the balancer, never by an optimiser) included; `num_params` counts the trained ones.
        let bias = moe.balance.bias.value().dims()[0] as u64;
        assert_eq!(bias, cfg.n_experts as u64);
        assert_eq!(total + bias, moe.num_params() as u64, "total, {cfg:?}");
        let per_expert = moe.experts.expert(0).num_params() as u64;
        let unselected = (cfg.n_experts - cfg.top_k) as u64;
        assert_eq!(active, total - unselected * per_expert, "active, {cfg:?}");
    }
    // The published scale (design §2): about 29.6B routed parameters per K3 MoE layer, about 1/56
    // of them active; the shared experts, router and projections add well under 1%.
    let (total, active) = k3.num_params();
    assert!((29.5e9..29.9e9).contains(&(total as f64)), "{total}");
    assert!(active < total / 40, "{active}");
}

#[test]
fn moe_checkpoint_round_trips_and_reports_mismatches_by_name() {
    use kimi_burn::store::{HfCheckpoint, Loader, SafeTensorsReader, Saver};
    let device = Default::default();
    let mut r = rng(45);
    let cfg = moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ());
    let moe = cfg.init::<Cpu>(&device);
    moe.balance.set_bias(&[0.1, -0.2, 0.3, 0.0, -0.1, -0.1]);
    let dir = std::env::temp_dir().join(format!("kimi-burn-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("moe.safetensors");
    let mut saver = Saver::new();
    moe.save_hf("model.layers.1.block_sparse_moe.", &mut saver);
    assert!(saver
        .names()
        .any(|n| n == "model.layers.1.block_sparse_moe.experts.5.w2.weight"));
    assert_eq!(
        saver.shape("model.layers.1.block_sparse_moe.gate.weight"),
        Some(&[6, 12][..])
    );
    saver.write(&file).unwrap();

    let reader = SafeTensorsReader::open(&file).unwrap();
    let mut loader = Loader::<Cpu>::new(&reader, &device);
    let fresh = cfg
        .init::<Cpu>(&device)
        .load_hf("model.layers.1.block_sparse_moe.", &mut loader);
    loader.finish(true).unwrap();
    let x = randn::<Cpu, 3>(&mut r, [2, 5, 12], 1.0, &device);
    assert_eq!(fresh.balance.bias_host(), moe.balance.bias_host());
    assert_eq!(
        host(fresh.forward(x.clone()).output),
        host(moe.forward(x).output)
    );

    // A smaller model finds tensors it does not expect; a wider one misses and mis-shapes some.
    let small = LatentMoeConfig::new(12, 5, 2, 10)
        .with_layout(MoeLayout::StableLatent { dim: 8 })
        .with_n_shared(1)
        .with_shared_hidden(Some(8));
    let mut loader = Loader::<Cpu>::new(&reader, &device);
    let _ = small
        .init::<Cpu>(&device)
        .load_hf("model.layers.1.block_sparse_moe.", &mut loader);
    let err = loader.finish(true).unwrap_err().to_string();
    assert!(
        err.contains("unexpected tensor model.layers.1.block_sparse_moe.experts.5.w1.weight"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "wrong shape for model.layers.1.block_sparse_moe.gate.weight in {}: expected [5, 12], found [6, 12]",
            file.display()
        )),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The CPU host kernels of SiTU-GLU, sigmoid, SiLU, `tanh`, softplus, SiTU's gate and the soft
/// cap (one pass, hand-written backward) against the tensor-op reference on the same backend
/// (`with_kernels(false)`), values and gradients, on inputs wide enough to saturate every branch
/// (softplus's linear branch above 20 included).
#[test]
fn host_activation_kernels_match_the_tensor_ops() {
    use kimi_burn::ops::moe::situ::{situ, soft_cap};
    use kimi_burn::ops::precision::{sigmoid, silu, softplus, tanh};
    use kimi_burn::ops::with_kernels;
    type B = CpuAd;
    let device = Default::default();
    let mut r = rng(41);
    let g0 = randn::<B, 2>(&mut r, [33, 70], 9.0, &device);
    let v0 = randn::<B, 2>(&mut r, [33, 70], 30.0, &device);
    let dy = randn::<B, 2>(&mut r, [33, 70], 1.0, &device);
    // (value, d/dg, d/dv) of each activation, with kernels on or off.
    let run = |kernels: bool, which: usize| -> [Vec<f64>; 3] {
        with_kernels(kernels, || {
            let (g, v) = (g0.clone().require_grad(), v0.clone().require_grad());
            let y = match which {
                0 => situ_glu(g.clone(), v.clone(), 4.0, Some(25.0)),
                1 => situ_glu(g.clone(), v.clone(), 4.0, None),
                2 => sigmoid(g.clone()).mul(v.clone()),
                3 => silu(g.clone()).mul(v.clone()),
                4 => tanh(g.clone()).mul(v.clone()),
                5 => softplus(g.clone()).mul(v.clone()),
                6 => situ(g.clone(), 4.0).mul(v.clone()),
                7 => situ(g.clone(), 2.5).mul(v.clone()),
                _ => soft_cap(g.clone(), 3.0).mul(v.clone()),
            };
            let grads = y.clone().mul(dy.clone()).sum().backward();
            [
                host(y),
                host(g.grad(&grads).expect("d/dg")),
                host(v.grad(&grads).expect("d/dv")),
            ]
        })
    };
    assert!(
        host(g0.clone()).iter().any(|&x| x > 20.0),
        "the draw must reach softplus's linear branch"
    );
    let names = [
        "situ_glu",
        "situ_glu beta2 = None",
        "sigmoid",
        "silu",
        "tanh",
        "softplus",
        "situ 4",
        "situ 2.5",
        "soft_cap 3",
    ];
    for (which, name) in names.iter().enumerate() {
        let (want, got) = (run(false, which), run(true, which));
        // Apart from the sigmoid and SiLU (the same formula both ways, which may agree exactly),
        // two different implementations ran (`expm1` against a polynomial and `exp` for tanh, a
        // series against the backend's `log1p`), so some values differ in the last bits and this
        // is not the reference compared with itself.
        if !matches!(which, 2 | 3) {
            assert!(
                want[0].iter().zip(&got[0]).any(|(a, b)| a != b),
                "{name}: the kernel run matched the reference bit for bit; did the host kernel run?"
            );
        }
        for (part, (w, g)) in ["value", "d/dgate", "d/dup"]
            .iter()
            .zip(want.iter().zip(&got))
        {
            assert_close(&format!("host {name} {part}"), w, g, 1e-5);
        }
    }
}

/// `situ_glu_weighted`'s CPU host kernel (the weight applied in the same pass, its gradient summed
/// from the recomputed value) against the tensor ops (`with_kernels(false)`): the value and the
/// gradients of the gate, the up branch and the weight, with and without `β2`.
#[test]
fn host_weighted_situ_glu_matches_the_tensor_ops() {
    use kimi_burn::ops::situ_glu_weighted;
    use kimi_burn::ops::with_kernels;
    type B = CpuAd;
    let device = Default::default();
    let mut r = rng(46);
    let g0 = randn::<B, 2>(&mut r, [37, 45], 6.0, &device);
    let v0 = randn::<B, 2>(&mut r, [37, 45], 30.0, &device);
    let w0 = randn::<B, 1>(&mut r, [37], 1.0, &device);
    let dy = randn::<B, 2>(&mut r, [37, 45], 1.0, &device);
    for beta2 in [Some(25.0), None] {
        let run = |kernels: bool| -> [Vec<f64>; 4] {
            with_kernels(kernels, || {
                let g = g0.clone().require_grad();
                let v = v0.clone().require_grad();
                let w = w0.clone().require_grad();
                let y = situ_glu_weighted(g.clone(), v.clone(), w.clone(), 4.0, beta2);
                let grads = y.clone().mul(dy.clone()).sum().backward();
                [
                    host(y),
                    host(g.grad(&grads).expect("d/dg")),
                    host(v.grad(&grads).expect("d/dv")),
                    host(w.grad(&grads).expect("d/dw")),
                ]
            })
        };
        let (want, got) = (run(false), run(true));
        assert!(
            want[0].iter().zip(&got[0]).any(|(a, b)| a != b),
            "beta2 {beta2:?}: the kernel run matched the tensor ops bit for bit; did the host kernel run?"
        );
        for (part, (w, g)) in ["value", "d/dgate", "d/dup", "d/dweight"]
            .iter()
            .zip(want.iter().zip(&got))
        {
            assert_close(
                &format!("weighted situ_glu, beta2 {beta2:?}, {part}"),
                w,
                g,
                1e-5,
            );
        }
    }
}

/// SiTU's gate and the soft cap refuse a `β` that is not finite and positive before any kernel
/// runs, naming the op and the value (a zero `β` would divide by zero on every path).
#[test]
fn situ_and_soft_cap_reject_a_beta_that_is_not_finite_and_positive() {
    use kimi_burn::ops::moe::situ::{situ, soft_cap};
    let x = randn::<Cpu, 2>(&mut rng(45), [2, 3], 1.0, &Default::default());
    for beta in [0.0f32, -1.5, f32::INFINITY, f32::NAN] {
        let message = |f: &dyn Fn()| -> String {
            let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .expect_err("the op must refuse the value");
            err.downcast_ref::<String>().cloned().unwrap_or_default()
        };
        let m = message(&|| drop(situ(x.clone(), beta)));
        assert!(
            m.contains(&format!(
                "situ: beta1 must be finite and positive, got {beta}"
            )),
            "{m}"
        );
        let m = message(&|| drop(soft_cap(x.clone(), beta)));
        assert!(
            m.contains(&format!(
                "soft_cap: beta must be finite and positive, got {beta}"
            )),
            "{m}"
        );
    }
    // The accepted range still runs.
    assert_eq!(situ(x.clone(), 4.0).dims(), [2, 3]);
    assert_eq!(soft_cap(x, 0.5).dims(), [2, 3]);
}

/// `RoutedExperts::expert` on an autodiff backend: a standalone copy of expert `e` (its weights
/// equal the stack's slice) whose gradients reach its own parameters, not the stack.
#[test]
fn one_expert_cut_out_of_the_stack_is_a_trainable_copy() {
    let d = Default::default();
    let moe =
        moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ()).init::<CpuAd>(&d);
    let e = 2;
    let glu = moe.experts.expert(e);
    let [_, l, me] = moe.experts.w1.dims();
    let slice = moe.experts.w1.val().narrow(0, e, 1).reshape([l, me]);
    assert_eq!(host(glu.w1.weight.val()), host(slice));
    let x = randn::<CpuAd, 2>(&mut rng(44), [3, l], 1.0, &d);
    let grads = glu.forward(x).sum().backward();
    assert!(glu.w1.weight.grad(&grads).is_some() && glu.w2.weight.grad(&grads).is_some());
    assert!(moe.experts.w1.grad(&grads).is_none());
}

/// The precise sigmoid's kernels on the GPU (one launch forward, one backward) against the f64
/// formula, value and gradient, elementwise in the tails where a subtraction would cancel.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn gpu_sigmoid_kernels_match_f64_into_the_tails() {
    use kimi_burn::ops::precision::sigmoid;
    use kimi_burn::ops::{kernel_calls, FusedOp};
    let device = Default::default();
    // Every 0.37 across ±86.9, into both tails until `e^{−|x|}` nears f32's smallest normal number
    // (GPUs flush subnormal values to zero), then far beyond it, where nothing may overflow.
    let mut xs: Vec<f64> = (0..470).map(|i| -86.9 + 0.37 * i as f64).collect();
    xs.extend([-1000.0, -100.0, 100.0, 1000.0]);
    let n = xs.len();
    let dy: Vec<f64> = (0..n).map(|i| ((i * 7 % 13) as f64 - 6.0) / 3.0).collect();
    let x = from_f64::<GpuAd, 1>(&xs, [n], &device).require_grad();
    let (fwd, bwd) = (
        kernel_calls(FusedOp::Sigmoid),
        kernel_calls(FusedOp::SigmoidBackward),
    );
    let y = sigmoid(x.clone());
    let grads = y
        .clone()
        .mul(from_f64::<GpuAd, 1>(&dy, [n], &device))
        .sum()
        .backward();
    assert_eq!(kernel_calls(FusedOp::Sigmoid) - fwd, 1, "forward kernel");
    assert_eq!(
        kernel_calls(FusedOp::SigmoidBackward) - bwd,
        1,
        "backward kernel"
    );
    let (y, dx) = (host(y), host(x.grad(&grads).expect("dx")));
    for (i, &v) in xs.iter().enumerate() {
        // x is exact in f32 only up to rounding: evaluate the formula at the f32 input.
        let v = v as f32 as f64;
        let s = 1.0 / (1.0 + (-v).exp());
        let ds = dy[i] * (-v.abs()).exp() / (1.0 + (-v.abs()).exp()).powi(2);
        // Relative; where the exact value is below f32's smallest normal number, zero will do.
        let close = |got: f64, want: f64| {
            (got - want).abs() <= 4e-6 * want.abs() || want.abs() < 1.2e-38 && got.abs() < 1.2e-38
        };
        assert!(close(y[i], s), "σ({v}) = {} vs {s}", y[i]);
        assert!(close(dx[i], ds), "dσ({v})·{} = {} vs {ds}", dy[i], dx[i]);
    }
}

/// QB with drift compensation against plain QB on a router whose per-expert offsets drift
/// linearly from step to step (as training moves a router's inputs): plain QB routes each step
/// with the bias of the step before, one step's drift behind; the compensated balancer must
/// remove most of that lag (measured above the violation a fresh batch shows without any drift)
/// once its estimate has settled. Without drift it must not be worse than plain QB by more than
/// the sampling noise it feeds back (β = 0.3 of one step's noise).
#[test]
fn qb_drift_compensation_follows_a_drifting_router() {
    let (m, n, k) = (4096, 16, 2);
    let run = |drift: f32, trend: bool| {
        let mut router = SkewedRouter::new(n, 77);
        let base = router.offsets.clone();
        let mut qb = if trend {
            QuantileBalancer::with_trend(n, 2000, 0.3).unwrap()
        } else {
            QuantileBalancer::new(n, 2000).unwrap()
        };
        let mut bias = vec![0.0f32; n];
        let mut late = Vec::new();
        for step in 0..40 {
            // Alternate directions, so the balanced bias moves without a common offset.
            for (j, o) in router.offsets.iter_mut().enumerate() {
                let dir = if j % 2 == 0 { 1.0 } else { -1.0 };
                *o = base[j] + dir * drift * step as f32;
            }
            let scores = router.batch(m);
            if step >= 20 {
                late.push(max_violation(&scores, n, &bias, k));
            }
            let sel = route(&scores, n, &bias, k);
            qb.observe(&RoutedBatch {
                scores: &scores,
                bias: &bias,
                selection: &sel,
                valid: None,
            })
            .unwrap();
            bias = qb.update(&bias);
        }
        late.iter().sum::<f32>() / late.len() as f32
    };
    let (plain, compensated) = (run(0.05, false), run(0.05, true));
    // The violation of a fresh batch routed with an exact bias: sampling noise alone.
    let (plain0, compensated0) = (run(0.0, false), run(0.0, true));
    assert!(
        plain - plain0 > 0.15,
        "the drift must leave plain QB visibly behind: {plain} against {plain0} without drift"
    );
    assert!(
        compensated - plain0 < 0.3 * (plain - plain0),
        "drift compensation must remove most of the lag: {compensated} against plain QB's \
         {plain} (the noise floor is {plain0})"
    );
    assert!(
        compensated0 < plain0 + 0.05,
        "without drift the compensation may add only noise: {compensated0} against {plain0}"
    );
}

/// The drift memory's contract: plain QB keeps none, vectors of the wrong length are refused
/// with their length named, a smoothing outside (0, 1] is a config error, and forgetting makes
/// the next update apply QB's set as it is.
#[test]
fn qb_drift_memory_is_checked_and_forgettable() {
    use kimi_burn::nn::DriftMemory;
    let n = 4;
    for beta in [0.0, -0.1, 1.5, f32::NAN] {
        let err = QuantileBalancer::with_trend(n, 100, beta).unwrap_err();
        assert!(
            matches!(err, Error::Config { ref field, .. } if field == "smoothing"),
            "{err}"
        );
    }
    let mut plain = QuantileBalancer::new(n, 100).unwrap();
    assert!(plain.drift_memory().is_none());
    assert!(plain.set_drift_memory(DriftMemory::default()).is_err());
    let mut qb = QuantileBalancer::with_trend(n, 100, 0.5).unwrap();
    let err = qb
        .set_drift_memory(DriftMemory {
            last_set: vec![0.0; 3],
            drift: Vec::new(),
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("last_set") && err.contains('3'), "{err}");

    // Two updates on the same tokens with different offsets build a drift; forgetting it makes
    // the third update equal plain QB's.
    let mut router = SkewedRouter::new(n, 5);
    let k = 1;
    let mut bias = vec![0.0f32; n];
    let feed = |qb: &mut QuantileBalancer, scores: &[f32], bias: &[f32]| {
        let sel = route(scores, n, bias, k);
        qb.observe(&RoutedBatch {
            scores,
            bias,
            selection: &sel,
            valid: None,
        })
        .unwrap();
        qb.update(bias)
    };
    let first = router.batch(2048);
    bias = feed(&mut qb, &first, &bias);
    router.offsets[0] += 0.5;
    let second = router.batch(2048);
    let with_drift = feed(&mut qb.clone(), &second, &bias);
    let plain_set = feed(&mut plain, &second, &bias);
    assert_ne!(with_drift, plain_set, "a drift was extrapolated");
    qb.forget_drift();
    assert_eq!(
        feed(&mut qb, &second, &bias),
        plain_set,
        "forgotten: plain QB's set"
    );
}
