//! Gradient checks in f64 (design §0): autodiff against central finite differences and analytic
//! derivatives.
//!
//! These live in their own test binary on purpose: Burn 0.21 keys each device's default dtype by the
//! device type, and `NdArray<f32>` and `NdArray<f64>` share `NdArrayDevice::Cpu`, so whichever backend
//! touches the device first in a process fixes the dtype of every tensor (and module) created
//! without an explicit dtype. Only f64 backends may run in this binary.

use crate::common::*;
use burn::module::{AutodiffModule, Param};
use kimi_burn::nn::{BalancerKind, GluActivation, LatentMoeConfig, MoeLayout};
use kimi_burn::ops::situ_glu;

fn moe_config(layout: MoeLayout, activation: GluActivation) -> LatentMoeConfig {
    LatentMoeConfig::new(12, 6, 2, 10)
        .with_layout(layout)
        .with_n_shared(1)
        .with_shared_hidden(Some(8))
        .with_activation(activation)
        .with_balancer(BalancerKind::quantile())
}

#[test]
fn f64_device_really_is_f64() {
    let t = from_f64::<Cpu64, 1>(&[1.0], [1], &Default::default());
    assert_eq!(
        t.dtype(),
        burn::tensor::DType::F64,
        "another backend fixed the NdArray device dtype first"
    );
}

#[test]
fn situ_backward_matches_analytic_and_finite_differences_f64() {
    let device = Default::default();
    let (g, v) = situ_grid();
    let n = g.len();
    let gt = from_f64::<Cpu64Ad, 1>(&g, [n], &device).require_grad();
    let vt = from_f64::<Cpu64Ad, 1>(&v, [n], &device).require_grad();
    let grads = situ_glu(gt.clone(), vt.clone(), 4.0, Some(25.0))
        .sum()
        .backward();
    let dg = host(gt.grad(&grads).unwrap());
    let dv = host(vt.grad(&grads).unwrap());
    let (eg, ev): (Vec<f64>, Vec<f64>) = g
        .iter()
        .zip(&v)
        .map(|(&g, &v)| {
            let (_, dg, dv) = situ64(g, v, 4.0, Some(25.0));
            (dg, dv)
        })
        .unzip();
    // Burn rounds scalar operands (1/β2) through f32 even on f64 tensors, hence 1e-7 rather than 1e-15.
    assert_close("dG vs the analytic derivative", &eg, &dg, 1e-7);
    assert_close("dV vs the analytic derivative", &ev, &dv, 1e-7);

    // Central differences of the op itself, elementwise (the op is elementwise).
    let f = |g: &[f64], v: &[f64]| -> Vec<f64> {
        let k = g.len();
        host(situ_glu(
            from_f64::<Cpu64, 1>(g, [k], &device),
            from_f64::<Cpu64, 1>(v, [k], &device),
            4.0,
            Some(25.0),
        ))
    };
    let eps = 1e-6;
    let shift = |x: &[f64], d: f64| x.iter().map(|a| a + d).collect::<Vec<_>>();
    let fd_g: Vec<f64> = f(&shift(&g, eps), &v)
        .iter()
        .zip(f(&shift(&g, -eps), &v))
        .map(|(p, m)| (p - m) / (2.0 * eps))
        .collect();
    let fd_v: Vec<f64> = f(&g, &shift(&v, eps))
        .iter()
        .zip(f(&g, &shift(&v, -eps)))
        .map(|(p, m)| (p - m) / (2.0 * eps))
        .collect();
    assert_close("dG vs finite differences", &fd_g, &dg, 1e-6);
    assert_close("dV vs finite differences", &fd_v, &dv, 1e-6);
}

#[test]
fn stable_latent_router_gradient_matches_finite_differences_f64() {
    let device = Default::default();
    let mut r = rng(43);
    let moe = moe_config(MoeLayout::StableLatent { dim: 8 }, GluActivation::situ())
        .init::<Cpu64Ad>(&device);
    let x = randn::<Cpu64Ad, 3>(&mut r, [1, 6, 12], 1.0, &device);
    let probe = randn::<Cpu64Ad, 3>(&mut r, [1, 6, 12], 1.0, &device);
    let grads = moe
        .forward(x.clone())
        .output
        .mul(probe.clone())
        .sum()
        .backward();
    let analytic = host(moe.router.gate.weight.grad(&grads).unwrap());
    assert!(
        analytic.iter().any(|g| g.abs() > 1e-6),
        "router gradient must not vanish through the norm"
    );

    let inner = moe.valid();
    let (x, probe) = (x.inner(), probe.inner());
    let w0 = host(inner.router.gate.weight.val());
    let fd = finite_diff(&w0, 1e-6, |w| {
        let mut m = inner.clone();
        m.router.gate.weight = Param::from_tensor(from_f64::<Cpu64, 2>(w, [12, 6], &device));
        host(m.forward(x.clone()).output.mul(probe.clone()).sum())[0]
    });
    assert_close(
        "router gradient vs finite differences",
        &fd,
        &analytic,
        1e-5,
    );
}
