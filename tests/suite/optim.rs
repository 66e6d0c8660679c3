//! Muon per head and the role-routed optimiser (design §8), against host references in f64 and
//! against Burn's own Muon and AdamW applied alone.

use crate::common::*;
use burn::module::{AutodiffModule, Module, Param, ParamId, RunningState};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamWConfig, AdjustLrFn, GradientsParams, MultiGradientsParams, Muon, MuonConfig, Optimizer,
    SimpleOptimizer,
};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{Backend, DeviceOps};
use burn::tensor::Tensor;
use kimi_burn::optim::{
    newton_schulz, newton_schulz_batched, HeadMuon, HeadSplit, KimiOptimizerConfig, ParamRole,
    ParamRoles,
};
use kimi_burn::Error;
use rand::rngs::StdRng;

// ---------------------------------------------------------------------------------------------
// Host references (f64), written independently of the crate.

/// `a: [n, k] · b: [k, m]`, row-major.
fn matmul(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * m];
    for i in 0..n {
        for p in 0..k {
            let aip = a[i * k + p];
            for j in 0..m {
                out[i * m + j] += aip * b[p * m + j];
            }
        }
    }
    out
}

fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0.0; a.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = a[i * cols + j];
        }
    }
    out
}

/// Eigenvalues of a symmetric `n × n` matrix by cyclic Jacobi rotations.
fn jacobi_eigenvalues(mut a: Vec<f64>, n: usize) -> Vec<f64> {
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j].powi(2))
            .sum();
        if off < 1e-22 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let akp = a[k * n + p];
                    let akq = a[k * n + q];
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let apk = a[p * n + k];
                    let aqk = a[q * n + k];
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
        }
    }
    (0..n).map(|i| a[i * n + i]).collect()
}

/// The `min(rows, cols)` singular values of a row-major matrix, ascending.
fn singular_values(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let xt = transpose(x, rows, cols);
    let (gram, n) = if rows <= cols {
        (matmul(x, &xt, rows, cols, rows), rows)
    } else {
        (matmul(&xt, x, cols, rows, cols), cols)
    };
    let mut s: Vec<f64> = jacobi_eigenvalues(gram, n)
        .into_iter()
        .map(|l| l.max(0.0).sqrt())
        .collect();
    s.sort_by(f64::total_cmp);
    s
}

/// design §8 Newton–Schulz on the host, on the matrix as given (no transpose: the result is the
/// same, which makes this an independent check of the crate's transposed path).
fn ns_host(x: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let (a, b, c) = (3.4445, -4.7750, 2.0315);
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
    let mut x: Vec<f64> = x.iter().map(|v| v / norm).collect();
    for _ in 0..steps {
        let g = matmul(&x, &transpose(&x, rows, cols), rows, cols, rows);
        let g2 = matmul(&g, &g, rows, rows, rows);
        let poly: Vec<f64> = g.iter().zip(&g2).map(|(g, g2)| b * g + c * g2).collect();
        let px = matmul(&poly, &x, rows, rows, cols);
        x = x.iter().zip(&px).map(|(x, px)| a * x + px).collect();
    }
    x
}

/// Column block `h` (of width `w`) of a row-major `[rows, cols]` matrix.
fn column_block(x: &[f64], rows: usize, cols: usize, h: usize, w: usize) -> Vec<f64> {
    (0..rows)
        .flat_map(|i| x[i * cols + h * w..i * cols + (h + 1) * w].to_vec())
        .collect()
}

fn randn_host(rng: &mut StdRng, len: usize) -> Vec<f64> {
    normal_vec(rng, len)
}

/// The 5-step band: design §8's coefficients send every singular value σ ≥ 0.005·‖X‖_F into
/// about [0.682, 1.155] (scalar iteration, checked on a fine grid). A missing normalisation, a
/// wrong coefficient or too few steps leaves values outside it.
const BAND: (f64, f64) = (0.66, 1.18);

fn assert_in_band(what: &str, s: &[f64]) {
    assert!(
        s.iter().all(|&v| (BAND.0..=BAND.1).contains(&v)),
        "{what}: singular values {s:?} outside {BAND:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Newton–Schulz.

#[test]
fn newton_schulz_matches_host_and_lands_in_the_band() {
    let device = Default::default();
    let mut rng = rng(11);
    for (rows, cols) in [(12, 40), (40, 12), (24, 64), (7, 19), (33, 9)] {
        let x = randn_host(&mut rng, rows * cols)
            .into_iter()
            .map(|v| 3.0 * v)
            .collect::<Vec<_>>();
        let s_in = singular_values(&x, rows, cols);
        let fro = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        // The host SVD is itself checked: Σσ² = ‖X‖²_F.
        let sum_sq: f64 = s_in.iter().map(|s| s * s).sum();
        assert!(
            (sum_sq / (fro * fro) - 1.0).abs() < 1e-9,
            "Jacobi: {sum_sq} vs {}",
            fro * fro
        );
        // Preconditions that make the band a fair claim, and that show it is not trivially met.
        assert!(
            s_in[0] / fro > 0.005,
            "{rows}x{cols}: input too ill-conditioned"
        );
        assert!(
            s_in.iter().any(|&v| v > BAND.1),
            "{rows}x{cols}: input already in band"
        );

        let out = host(newton_schulz(
            from_f64::<Cpu, 2>(&x, [rows, cols], &device),
            5,
        ));
        assert_close(
            &format!("newton_schulz {rows}x{cols}"),
            &ns_host(&x, rows, cols, 5),
            &out,
            1e-4,
        );
        assert_in_band(
            &format!("newton_schulz {rows}x{cols}"),
            &singular_values(&out, rows, cols),
        );
    }
}

#[test]
fn newton_schulz_batched_is_each_matrix_alone() {
    let device = Default::default();
    let mut rng = rng(12);
    let (batch, rows, cols) = (3, 6, 10);
    let x = randn::<Cpu, 3>(&mut rng, [batch, rows, cols], 1.0, &device);
    let all = host(newton_schulz_batched(x.clone(), 5));
    for b in 0..batch {
        let one = x
            .clone()
            .slice([b..b + 1, 0..rows, 0..cols])
            .reshape([rows, cols]);
        let expected = host(newton_schulz(one, 5));
        let got = &all[b * rows * cols..(b + 1) * rows * cols];
        assert_close(&format!("batch entry {b}"), &expected, got, 1e-6);
    }
}

// ---------------------------------------------------------------------------------------------
// Muon per head.

/// One `HeadMuon` step from zero momentum and no decay; returns `(W0 − W1) / lr`.
fn head_muon_update(w: &[f64], g: &[f64], shape: [usize; 2], split: Option<HeadSplit>) -> Vec<f64> {
    let device = Default::default();
    let lr = 0.01;
    let optim = HeadMuon::<Cpu>::new(0.95, false, 5, 0.0, split);
    let (w1, state) = optim.step(
        lr,
        from_f64::<Cpu, 2>(w, shape, &device),
        from_f64::<Cpu, 2>(g, shape, &device),
        None,
    );
    assert!(state.is_some(), "Muon keeps a momentum state");
    w.iter()
        .zip(host(w1))
        .map(|(w0, w1)| (w0 - w1) / lr)
        .collect()
}

#[test]
fn per_head_muon_orthogonalises_each_column_block() {
    let mut rng = rng(21);
    let (rows, cols, heads) = (16, 24, 3);
    let width = cols / heads;
    let w = randn_host(&mut rng, rows * cols);
    let g = randn_host(&mut rng, rows * cols);
    let update = head_muon_update(&w, &g, [rows, cols], Some(HeadSplit::columns(heads)));

    // Reconstruction: the scale uses the block's own dims, 0.2·sqrt(max(16, 8)).
    let scale = 0.2 * (rows.max(width) as f64).sqrt();
    for h in 0..heads {
        let block: Vec<f64> = column_block(&update, rows, cols, h, width)
            .into_iter()
            .map(|v| v / scale)
            .collect();
        let expected = ns_host(&column_block(&g, rows, cols, h, width), rows, width, 5);
        assert_close(&format!("head {h} update"), &expected, &block, 1e-4);
        assert_in_band(&format!("head {h}"), &singular_values(&block, rows, width));
    }

    // Whole-matrix Muon on the same gradient is a different update.
    let whole = head_muon_update(&w, &g, [rows, cols], None);
    let whole_scale = 0.2 * (rows.max(cols) as f64).sqrt();
    let expected_whole: Vec<f64> = ns_host(&g, rows, cols, 5)
        .into_iter()
        .map(|v| v * whole_scale)
        .collect();
    assert_close("whole-matrix update", &expected_whole, &whole, 1e-4);
    assert!(
        rel_err(&whole, &update) > 0.1,
        "per-head and whole-matrix updates should differ, rel err {}",
        rel_err(&whole, &update)
    );
}

#[test]
fn per_head_muon_orthogonalises_each_row_block() {
    let mut rng = rng(22);
    let (rows, cols, heads) = (24, 10, 4);
    let height = rows / heads;
    let w = randn_host(&mut rng, rows * cols);
    let g = randn_host(&mut rng, rows * cols);
    let update = head_muon_update(&w, &g, [rows, cols], Some(HeadSplit::rows(heads)));
    let scale = 0.2 * (height.max(cols) as f64).sqrt();
    for h in 0..heads {
        let range = h * height * cols..(h + 1) * height * cols;
        let block: Vec<f64> = update[range.clone()].iter().map(|v| v / scale).collect();
        assert_close(
            &format!("row head {h}"),
            &ns_host(&g[range], height, cols, 5),
            &block,
            1e-4,
        );
        assert_in_band(
            &format!("row head {h}"),
            &singular_values(&block, height, cols),
        );
    }
}

#[test]
fn stacked_matrices_are_orthogonalised_one_by_one() {
    let device = Default::default();
    let mut rng = rng(23);
    let (experts, rows, cols) = (3, 8, 12);
    let len = experts * rows * cols;
    let w = randn_host(&mut rng, len);
    let g = randn_host(&mut rng, len);
    let lr = 0.02;
    let optim = HeadMuon::<Cpu>::new(0.95, false, 5, 0.0, None);
    let (w1, _) = optim.step(
        lr,
        from_f64::<Cpu, 3>(&w, [experts, rows, cols], &device),
        from_f64::<Cpu, 3>(&g, [experts, rows, cols], &device),
        None,
    );
    let w1 = host(w1);
    let scale = 0.2 * (rows.max(cols) as f64).sqrt();
    for e in 0..experts {
        let range = e * rows * cols..(e + 1) * rows * cols;
        let update: Vec<f64> = range
            .clone()
            .map(|i| (w[i] - w1[i]) / (lr * scale))
            .collect();
        assert_close(
            &format!("expert {e}"),
            &ns_host(&g[range], rows, cols, 5),
            &update,
            1e-4,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The routed optimiser.

#[derive(Module, Debug)]
struct Tiny<B: Backend> {
    matrix: Param<Tensor<B, 2>>,
    q_proj: Param<Tensor<B, 2>>,
    vector: Param<Tensor<B, 1>>,
    buffer: RunningState<Tensor<B, 1>>,
}

const D_IN: usize = 6;
const D_OUT: usize = 8;
const HEADS: usize = 2;

impl<B: Backend> Tiny<B> {
    fn new(rng: &mut StdRng, device: &B::Device) -> Self {
        Self {
            matrix: Param::from_tensor(randn(rng, [D_IN, D_OUT], 0.5, device)),
            q_proj: Param::from_tensor(randn(rng, [D_IN, D_OUT], 0.5, device)),
            vector: Param::from_tensor(randn(rng, [D_OUT], 0.5, device)),
            buffer: RunningState::new(randn(rng, [D_OUT], 1.0, device)),
        }
    }

    /// A loss touching every parameter; the buffer enters as a constant.
    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = x.clone().matmul(self.matrix.val()) + self.vector.val().unsqueeze();
        let q = x.matmul(self.q_proj.val()).tanh();
        (h.tanh() * q).sum() + (self.vector.val() * self.buffer.value()).sum()
    }
}

fn grads_of(module: &Tiny<CpuAd>, rng: &mut StdRng) -> GradientsParams {
    let x = randn::<CpuAd, 2>(rng, [5, D_IN], 1.0, &Default::default());
    GradientsParams::from_grads(module.loss(x).backward(), module)
}

fn roles_for(module: &Tiny<CpuAd>) -> ParamRoles {
    ParamRoles::from_module(module).with(
        module.q_proj.id,
        ParamRole::muon_per_head(HeadSplit::columns(HEADS)),
    )
}

/// Keeps only the gradient of `id`.
fn only(grads: &GradientsParams, id: ParamId, rank: usize) -> GradientsParams {
    let mut out = GradientsParams::new();
    match rank {
        1 => {
            if let Some(g) = grads.get::<Cpu, 1>(id) {
                out.register(id, g)
            }
        }
        _ => {
            if let Some(g) = grads.get::<Cpu, 2>(id) {
                out.register(id, g)
            }
        }
    }
    out
}

fn params(m: &Tiny<CpuAd>) -> [Vec<f64>; 4] {
    [
        host(m.matrix.val().inner()),
        host(m.q_proj.val().inner()),
        host(m.vector.val().inner()),
        host(m.buffer.value().inner()),
    ]
}

const LR: f64 = 0.02;

#[test]
fn default_roles_follow_rank_and_skip_buffers() {
    let module = Tiny::<CpuAd>::new(&mut rng(30), &Default::default());
    let roles = ParamRoles::from_module(&module);
    assert_eq!(roles.len(), 3, "the RunningState buffer has no role");
    assert_eq!(roles.get(module.matrix.id), ParamRole::MUON);
    assert_eq!(roles.get(module.q_proj.id), ParamRole::MUON);
    assert_eq!(roles.get(module.vector.id), ParamRole::AdamW);
    assert_eq!(
        roles.get(ParamId::new()),
        ParamRole::AdamW,
        "unlisted → AdamW"
    );
}

/// Burn's own Muon with the optimiser's defaults (μ 0.95, λ 0.1, the Moonlight scale): the
/// reference for whole matrices.
fn burns_muon<M: AutodiffModule<CpuAd>>() -> OptimizerAdaptor<Muon<Cpu>, M, CpuAd> {
    MuonConfig::new()
        .with_momentum(MomentumConfig {
            momentum: 0.95,
            dampening: 0.0,
            nesterov: false,
        })
        .with_weight_decay(Some(WeightDecayConfig::new(0.1)))
        .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
        .init()
}

#[test]
fn each_group_matches_burns_optimiser_applied_alone() {
    let device = Default::default();
    let mut rng = rng(31);
    let module = Tiny::<CpuAd>::new(&mut rng, &device);
    let initial = params(&module);
    let config = KimiOptimizerConfig::new();
    let mut optim = config.init(&module, roles_for(&module)).unwrap();

    // References: Burn's Muon (Moonlight scale), a lone per-head Muon, Burn's AdamW.
    let mut muon = burns_muon::<Tiny<CpuAd>>();
    let mut heads: OptimizerAdaptor<HeadMuon<Cpu>, Tiny<CpuAd>, CpuAd> =
        HeadMuon::new(0.95, false, 5, 0.1, Some(HeadSplit::columns(HEADS))).into();
    let mut adamw = AdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.1)
        .init::<CpuAd, Tiny<CpuAd>>();

    let mut ours = module.clone();
    let mut reference = module;
    // Three steps, so momentum and Adam moments carry over.
    for step in 0..3 {
        let grads = grads_of(&ours, &mut rng);
        let (m, q, v) = (
            reference.matrix.id,
            reference.q_proj.id,
            reference.vector.id,
        );
        reference = muon.step(LR, reference, only(&grads, m, 2));
        reference = heads.step(LR, reference, only(&grads, q, 2));
        reference = adamw.step(LR, reference, only(&grads, v, 1));
        ours = optim.step(LR, ours, grads);

        let (a, b) = (params(&ours), params(&reference));
        for (name, i) in [
            ("matrix (Muon)", 0),
            ("q_proj (per head)", 1),
            ("vector (AdamW)", 2),
        ] {
            assert_close(&format!("step {step}: {name}"), &b[i], &a[i], 1e-6);
            assert!(
                rel_err(&initial[i], &a[i]) > 1e-4,
                "step {step}: {name} did not move"
            );
        }
        assert_eq!(
            a[3], initial[3],
            "step {step}: the buffer must never change"
        );
    }
}

/// An independent copy of the three parameter gradients.
fn copy_grads(module: &Tiny<CpuAd>, grads: &GradientsParams) -> GradientsParams {
    let mut copy = GradientsParams::new();
    for id in [module.matrix.id, module.q_proj.id] {
        copy.register(id, grads.get::<Cpu, 2>(id).expect("matrix gradient"));
    }
    let id = module.vector.id;
    copy.register(id, grads.get::<Cpu, 1>(id).expect("vector gradient"));
    copy
}

#[test]
fn adamw_only_is_burns_adamw() {
    let device = Default::default();
    let mut rng = rng(32);
    let module = Tiny::<CpuAd>::new(&mut rng, &device);
    let adamw_config = AdamWConfig::new().with_weight_decay(0.05);
    let mut optim = KimiOptimizerConfig::new()
        .with_adamw(adamw_config.clone())
        .init(&module, ParamRoles::adamw_only())
        .unwrap();
    let mut adamw = adamw_config.init::<CpuAd, Tiny<CpuAd>>();
    let (mut ours, mut reference) = (module.clone(), module);
    for _ in 0..2 {
        let grads = grads_of(&ours, &mut rng);
        let copy = copy_grads(&ours, &grads);
        ours = optim.step(LR, ours, grads);
        reference = adamw.step(LR, reference, copy);
    }
    let (a, b) = (params(&ours), params(&reference));
    for i in 0..4 {
        assert_close(&format!("param {i}"), &b[i], &a[i], 1e-6);
    }
}

#[test]
fn records_survive_a_save_and_load() {
    let device = Default::default();
    let mut rng = rng(33);
    let module = Tiny::<CpuAd>::new(&mut rng, &device);
    let config = KimiOptimizerConfig::new().with_nesterov(true);
    let mut first = config.init(&module, roles_for(&module)).unwrap();
    let grads = grads_of(&module, &mut rng);
    let module = first.step(LR, module, grads);

    // Through bytes, so the tuple record really serialises.
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(first.to_record(), ()).unwrap();
    let loaded = recorder.load(bytes, &device).unwrap();
    let mut restored = config
        .init(&module, roles_for(&module))
        .unwrap()
        .load_record(loaded);
    let mut fresh = config.init(&module, roles_for(&module)).unwrap();

    let grads = grads_of(&module, &mut rng);
    let (g1, g2) = (copy_grads(&module, &grads), copy_grads(&module, &grads));
    let continued = params(&first.step(LR, module.clone(), grads));
    let reloaded = params(&restored.step(LR, module.clone(), g1));
    let from_scratch = params(&fresh.step(LR, module, g2));
    for i in 0..3 {
        assert_close(
            &format!("reloaded param {i}"),
            &continued[i],
            &reloaded[i],
            1e-6,
        );
        assert!(
            rel_err(&continued[i], &from_scratch[i]) > 1e-6,
            "param {i}: the saved state should matter"
        );
    }
}

/// A parameter that moves between whole-matrix and per-head Muon across a save and load keeps
/// its momentum (the parameter's shape either way): the reloaded optimiser steps as one that
/// took the first step with the new roles, and not as a fresh one.
#[test]
fn muon_momentum_survives_a_change_between_whole_and_per_head() {
    let device = Default::default();
    let mut rng = rng(34);
    let module = Tiny::<CpuAd>::new(&mut rng, &device);
    let config = KimiOptimizerConfig::new();
    // `matrix` whole and `q_proj` per head, then the other way round.
    let swapped = |m: &Tiny<CpuAd>| {
        ParamRoles::from_module(m).with(
            m.matrix.id,
            ParamRole::muon_per_head(HeadSplit::columns(HEADS)),
        )
    };
    let mut first = config.init(&module, roles_for(&module)).unwrap();
    let mut reference = config.init(&module, swapped(&module)).unwrap();
    let grads = grads_of(&module, &mut rng);
    let g = copy_grads(&module, &grads);
    let _ = reference.step(LR, module.clone(), g);
    let module = first.step(LR, module, grads);

    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(first.to_record(), ()).unwrap();
    let mut restored = config
        .init(&module, swapped(&module))
        .unwrap()
        .load_record(recorder.load(bytes, &device).unwrap());
    let mut fresh = config.init(&module, swapped(&module)).unwrap();

    let grads = grads_of(&module, &mut rng);
    let (g1, g2) = (copy_grads(&module, &grads), copy_grads(&module, &grads));
    let want = params(&reference.step(LR, module.clone(), grads));
    let reloaded = params(&restored.step(LR, module.clone(), g1));
    let from_scratch = params(&fresh.step(LR, module, g2));
    for i in 0..2 {
        assert_close(&format!("param {i}"), &want[i], &reloaded[i], 1e-6);
        assert!(
            rel_err(&want[i], &from_scratch[i]) > 1e-6,
            "param {i}: the momentum should matter"
        );
    }
}

#[test]
fn step_multi_with_one_device_equals_step() {
    let device = Default::default();
    let mut rng = rng(34);
    let module = Tiny::<CpuAd>::new(&mut rng, &device);
    let mut single = KimiOptimizerConfig::new()
        .init(&module, roles_for(&module))
        .unwrap();
    let mut multi_optim = single.clone();
    let (mut a, mut b) = (module.clone(), module);
    for _ in 0..2 {
        let grads = grads_of(&a, &mut rng);
        let mut multi = MultiGradientsParams::default();
        multi.grads.push((copy_grads(&a, &grads), device.id()));
        a = single.step(LR, a, grads);
        b = multi_optim.step_multi(LR, b, multi);
    }
    let (pa, pb) = (params(&a), params(&b));
    for i in 0..4 {
        assert_close(&format!("param {i}"), &pa[i], &pb[i], 1e-7);
    }
}

#[test]
fn invalid_roles_and_configs_are_reported_with_values() {
    let module = Tiny::<CpuAd>::new(&mut rng(35), &Default::default());
    let config = KimiOptimizerConfig::new();
    let expect_err = |roles: ParamRoles, needle: &str| match config.init(&module, roles) {
        Err(Error::Argument { reason, .. }) => {
            assert!(reason.contains(needle), "`{reason}` lacks `{needle}`")
        }
        Err(other) => panic!("wrong error {other}"),
        Ok(_) => panic!("expected an error mentioning `{needle}`"),
    };
    expect_err(
        ParamRoles::adamw_only().with(module.vector.id, ParamRole::MUON),
        "shape [8]",
    );
    expect_err(
        ParamRoles::adamw_only().with(
            module.q_proj.id,
            ParamRole::muon_per_head(HeadSplit::columns(3)),
        ),
        "[6, 8]",
    );
    expect_err(
        ParamRoles::adamw_only().with(ParamId::new(), ParamRole::AdamW),
        "no float parameter",
    );
    let err = KimiOptimizerConfig::new()
        .with_momentum(1.0)
        .init(&module, ParamRoles::adamw_only())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("got 1"), "{err}");
}

#[test]
fn a_stable_latent_moe_trains_and_its_balance_bias_is_left_alone() {
    use kimi_burn::nn::{LatentMoeConfig, MoeLayout};

    let device = Default::default();
    let mut rng = rng(36);
    let moe = LatentMoeConfig::new(12, 6, 2, 10)
        .with_layout(MoeLayout::StableLatent { dim: 8 })
        .with_n_shared(1)
        .init::<CpuAd>(&device);
    // A non-zero bias, as after a balancing step.
    let _ = moe.forward(randn(&mut rng, [2, 9, 12], 1.0, &device));
    moe.update_balance();
    let bias_before = host(moe.balance.bias.value().inner());
    assert!(
        bias_before.iter().any(|&b| b != 0.0),
        "QB should have moved the bias"
    );

    let roles = ParamRoles::from_module(&moe);
    let bias_id = burn::module::list_param_ids(&moe.balance);
    assert_eq!(bias_id.len(), 1);
    assert!(
        roles.iter().all(|(id, _)| id != bias_id[0]),
        "the balance bias must not get an optimiser role"
    );
    assert_eq!(roles.len(), burn::module::list_param_ids(&moe).len() - 1);
    let before = moe.clone();
    let mut optim = KimiOptimizerConfig::new()
        .init(&moe, roles.clone())
        .unwrap();
    let out = moe.forward(randn(&mut rng, [2, 9, 12], 1.0, &device));
    let grads = GradientsParams::from_grads(out.output.powi_scalar(2).sum().backward(), &moe);
    let moe = optim.step(LR, moe, grads);

    assert_eq!(host(moe.balance.bias.value().inner()), bias_before);
    // Every parameter with a role moved (all of them receive a gradient here).
    let moved = |a: &burn::nn::Linear<CpuAd>, b: &burn::nn::Linear<CpuAd>| {
        rel_err(&host(a.weight.val().inner()), &host(b.weight.val().inner())) > 1e-5
    };
    let (new_up, old_up) = (moe.up.as_ref().unwrap(), before.up.as_ref().unwrap());
    assert!(moved(new_up, old_up), "W_up should have moved");
}

// ---------------------------------------------------------------------------------------------
// Muon batched across parameters.

/// Muon parameters whose blocks share shapes: `a`, `b` and the tall `c` (transposed) are all
/// `6 × 8` blocks, as are the three matrices of the stack `d`; `e`'s column heads are `6 × 4`
/// (transposed to `4 × 6`) and `f`'s row heads `4 × 8`.
#[derive(Module, Debug)]
struct Shared<B: Backend> {
    a: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 2>>,
    c: Param<Tensor<B, 2>>,
    d: Param<Tensor<B, 3>>,
    e: Param<Tensor<B, 2>>,
    f: Param<Tensor<B, 2>>,
}

impl<B: Backend> Shared<B> {
    fn new(rng: &mut StdRng, device: &B::Device) -> Self {
        Self {
            a: Param::from_tensor(randn(rng, [6, 8], 0.5, device)),
            b: Param::from_tensor(randn(rng, [6, 8], 0.5, device)),
            c: Param::from_tensor(randn(rng, [8, 6], 0.5, device)),
            d: Param::from_tensor(randn(rng, [3, 6, 8], 0.5, device)),
            e: Param::from_tensor(randn(rng, [6, 8], 0.5, device)),
            f: Param::from_tensor(randn(rng, [8, 8], 0.5, device)),
        }
    }

    /// A loss touching every parameter, with gradients of very different sizes (so each block's
    /// own normalisation matters).
    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let h =
            x.clone().matmul(self.a.val()).tanh() * x.clone().matmul(self.b.val()).mul_scalar(7.0);
        let c = h.clone().matmul(self.c.val()).tanh();
        let stack = self.d.val().sum_dim(0).squeeze_dim::<2>(0);
        let d = c.clone().matmul(stack.mul_scalar(0.1)).sin();
        let e = c.matmul(self.e.val()).powi_scalar(2);
        let f = (d + e).matmul(self.f.val());
        f.sum()
            + self
                .d
                .val()
                .narrow(0, 0, 1)
                .powi_scalar(2)
                .sum()
                .mul_scalar(3.0)
    }
}

impl Shared<CpuAd> {
    fn params(&self) -> Vec<Vec<f64>> {
        vec![
            host(self.a.val().inner()),
            host(self.b.val().inner()),
            host(self.c.val().inner()),
            host(self.d.val().inner()),
            host(self.e.val().inner()),
            host(self.f.val().inner()),
        ]
    }
}

#[test]
fn muon_batched_across_parameters_equals_each_parameter_alone() {
    let device = Default::default();
    let mut rng = rng(37);
    let module = Shared::<CpuAd>::new(&mut rng, &device);
    let initial = module.params();
    let roles = ParamRoles::from_module(&module)
        .with(module.e.id, ParamRole::muon_per_head(HeadSplit::columns(2)))
        .with(module.f.id, ParamRole::muon_per_head(HeadSplit::rows(2)));
    let mut optim = KimiOptimizerConfig::new().init(&module, roles).unwrap();

    // References, one parameter at a time: Burn's Muon for the whole matrices, a lone HeadMuon
    // for the stack and each split.
    let mut muon = burns_muon::<Shared<CpuAd>>();
    type Heads = OptimizerAdaptor<HeadMuon<Cpu>, Shared<CpuAd>, CpuAd>;
    let mut stack: Heads = HeadMuon::new(0.95, false, 5, 0.1, None).into();
    let mut columns: Heads = HeadMuon::new(0.95, false, 5, 0.1, Some(HeadSplit::columns(2))).into();
    let mut rows: Heads = HeadMuon::new(0.95, false, 5, 0.1, Some(HeadSplit::rows(2))).into();

    let (mut ours, mut reference) = (module.clone(), module);
    for step in 0..3 {
        let x = randn::<CpuAd, 2>(&mut rng, [5, 6], 1.0, &device);
        let grads = GradientsParams::from_grads(ours.loss(x).backward(), &ours);
        let take = |id: ParamId, rank: usize| {
            let mut out = GradientsParams::new();
            if rank == 3 {
                out.register(id, grads.get::<Cpu, 3>(id).expect("gradient"));
            } else {
                out.register(id, grads.get::<Cpu, 2>(id).expect("gradient"));
            }
            out
        };
        let r = &reference;
        let (ga, gb, gc, gd, ge, gf) = (
            take(r.a.id, 2),
            take(r.b.id, 2),
            take(r.c.id, 2),
            take(r.d.id, 3),
            take(r.e.id, 2),
            take(r.f.id, 2),
        );
        reference = muon.step(LR, reference, ga);
        reference = muon.step(LR, reference, gb);
        reference = muon.step(LR, reference, gc);
        reference = stack.step(LR, reference, gd);
        reference = columns.step(LR, reference, ge);
        reference = rows.step(LR, reference, gf);
        ours = optim.step(LR, ours, grads);

        let (got, want) = (ours.params(), reference.params());
        for (i, name) in [
            "a",
            "b",
            "c (tall)",
            "d (stack)",
            "e (column heads)",
            "f (row heads)",
        ]
        .iter()
        .enumerate()
        {
            assert_close(&format!("step {step}: {name}"), &want[i], &got[i], 1e-6);
            assert!(
                rel_err(&initial[i], &got[i]) > 1e-4,
                "step {step}: {name} did not move"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AdamW: the fused step against Burn's `AdamW`.

/// `(param, m1, m2)` on the host after each step of a run.
type AdamWRun = Vec<[Vec<f64>; 3]>;

/// Three steps of Burn's `AdamW` and of `adamw_update` (with zero moments before the first, as
/// `KimiAdamW` starts) on the same parameter and gradients: `(param, m1, m2)` after each step.
fn adamw_steps<B: Backend>(
    ours: bool,
    shape: [usize; 2],
    seed: u64,
    device: &B::Device,
) -> AdamWRun {
    use burn::optim::{AdamWState, AdaptiveMomentumState};
    use kimi_burn::ops::optim::{adamw_update, AdamWScalars};
    let config = AdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.1);
    let burn = config.build();
    let mut rng = rng(seed);
    let mut param = randn::<B, 2>(&mut rng, shape, 0.5, device);
    let mut state: Option<AdamWState<B, 2>> = None;
    let mut out = Vec::new();
    for step in 1..=3 {
        // Gradients of varied scale, so that ε and the bias corrections matter.
        let grad = randn::<B, 2>(&mut rng, shape, 10f64.powi(-step), device);
        let lr = 0.01 * step as f64;
        if ours {
            let (time, m1, m2) = match state.take() {
                Some(s) => (
                    s.momentum.time + 1,
                    s.momentum.moment_1,
                    s.momentum.moment_2,
                ),
                None => (1, grad.zeros_like(), grad.zeros_like()),
            };
            let s = AdamWScalars::new(0.9, 0.95, 1e-8, 0.1, lr, time as i32);
            let (p, m1, m2) = adamw_update(param, grad, m1, m2, s);
            param = p;
            state = Some(AdamWState::new(AdaptiveMomentumState::new(time, m1, m2)));
        } else {
            let (p, s) = burn.step(lr, param, grad, state.take());
            param = p;
            state = s;
        }
        let m = &state.as_ref().expect("a state after a step").momentum;
        out.push([
            host(param.clone()),
            host(m.moment_1.clone()),
            host(m.moment_2.clone()),
        ]);
    }
    out
}

/// `adamw_update` and `scaled_sum` take a gradient, moments or a second term of another dtype in
/// the parameter's (first term's) dtype, on every path: with f64 ones the f32 results are those
/// of the f32 inputs (the f64 values are f32 values widened), on ndarray and on wgpu with the
/// kernels and without.
#[test]
fn optimiser_ops_take_other_dtypes_in_the_parameters() {
    use burn::tensor::FloatDType;
    use kimi_burn::ops::optim::{adamw_update, scaled_sum, AdamWScalars};
    fn check<B: Backend>(device: &B::Device) {
        let mut r = rng(41);
        let param = randn::<B, 2>(&mut r, [5, 9], 0.5, device);
        let grad = randn::<B, 2>(&mut r, [5, 9], 0.1, device);
        let m1 = randn::<B, 2>(&mut r, [5, 9], 0.05, device);
        let m2 = randn::<B, 2>(&mut r, [5, 9], 0.01, device).abs();
        let wide = |t: &Tensor<B, 2>| t.clone().cast(FloatDType::F64);
        let s = AdamWScalars::new(0.9, 0.95, 1e-8, 0.1, 0.01, 3);
        for kernels in [true, false] {
            kimi_burn::ops::with_kernels(kernels, || {
                let same = adamw_update(param.clone(), grad.clone(), m1.clone(), m2.clone(), s);
                let mixed = adamw_update(param.clone(), wide(&grad), wide(&m1), wide(&m2), s);
                for (a, b) in [(same.0, mixed.0), (same.1, mixed.1), (same.2, mixed.2)] {
                    assert_eq!(b.dtype(), a.dtype(), "kernels {kernels}");
                    assert_eq!(host(a), host(b), "adamw, kernels {kernels}");
                }
                let same = scaled_sum(param.clone(), 0.7, grad.clone(), -1.5);
                let mixed = scaled_sum(param.clone(), 0.7, wide(&grad), -1.5);
                assert_eq!(host(same), host(mixed), "scaled sum, kernels {kernels}");
            });
        }
    }
    check::<Cpu>(&Default::default());
    #[cfg(feature = "wgpu")]
    check::<Gpu>(&Default::default());
}

/// On the CPU `adamw_update` runs its tensor-op form, which is Burn's `AdamW` operation for
/// operation: the same bits.
#[test]
fn adamw_update_on_the_cpu_is_burns_adamw_bit_for_bit() {
    let device = Default::default();
    let ours = adamw_steps::<Cpu>(true, [7, 13], 40, &device);
    let burn = adamw_steps::<Cpu>(false, [7, 13], 40, &device);
    assert_eq!(ours, burn);
    assert_eq!(
        kimi_burn::ops::last_path(kimi_burn::ops::FusedOp::AdamW),
        Some(kimi_burn::ops::KernelPath::Reference)
    );
}

/// The CPU host passes of `adamw_update` and `scaled_sum` against their tensor-op forms (the
/// kernels switched off), bit for bit: with inputs that something else still holds (the host
/// writes new buffers and leaves those alone) and with inputs handed over (it writes in place),
/// at a size split over the thread pool, plain and under `Autodiff` (untracked there).
fn optimiser_updates_on_the_host_are_their_tensor_ops<B: Backend>() {
    use kimi_burn::ops::optim::{adamw_update, scaled_sum, AdamWScalars};
    use kimi_burn::ops::with_kernels;
    let device = Default::default();
    let mut rng = rng(44);
    for shape in [[7, 13], [600, 500]] {
        let x = randn::<B, 2>(&mut rng, shape, 0.5, &device);
        let y = randn::<B, 2>(&mut rng, shape, 0.1, &device);
        let m2 = randn::<B, 2>(&mut rng, shape, 0.01, &device).abs();
        let before = [host(x.clone()), host(y.clone()), host(m2.clone())];
        for (a, b) in [(0.999, -0.02), (1.0, -0.5), (0.95, 1.0)] {
            let want = host(with_kernels(false, || {
                scaled_sum(x.clone(), a, y.clone(), b)
            }));
            let shared = host(scaled_sum(x.clone(), a, y.clone(), b));
            let handed_over = host(scaled_sum(
                Tensor::<B, 2>::from_data(x.to_data(), &device),
                a,
                y.clone(),
                b,
            ));
            assert_eq!(shared, want, "scaled_sum {shape:?}, a {a}, b {b}");
            assert_eq!(
                handed_over, want,
                "scaled_sum in place {shape:?}, a {a}, b {b}"
            );
        }
        for (time, weight_decay) in [(1, 0.1), (7, 0.0)] {
            let s = AdamWScalars::new(0.9, 0.95, 1e-8, weight_decay, 0.01, time);
            let step = |p: Tensor<B, 2>, m1: Tensor<B, 2>, m2: Tensor<B, 2>| {
                let (p, m1, m2) = adamw_update(p, y.clone(), m1, m2, s);
                [host(p), host(m1), host(m2)]
            };
            let want = with_kernels(false, || step(x.clone(), y.clone(), m2.clone()));
            let shared = step(x.clone(), y.clone(), m2.clone());
            let copy = |t: &Tensor<B, 2>| Tensor::<B, 2>::from_data(t.to_data(), &device);
            let handed_over = step(copy(&x), copy(&y), copy(&m2));
            assert_eq!(shared, want, "adamw {shape:?}, step {time}");
            assert_eq!(handed_over, want, "adamw in place {shape:?}, step {time}");
        }
        let after = [host(x), host(y), host(m2)];
        assert_eq!(before, after, "inputs held elsewhere are left alone");
    }
}

#[test]
fn optimiser_updates_on_the_host_are_their_tensor_ops_on_ndarray() {
    optimiser_updates_on_the_host_are_their_tensor_ops::<Cpu>();
    optimiser_updates_on_the_host_are_their_tensor_ops::<CpuAd>();
}

#[cfg(all(feature = "cuda", not(feature = "wgpu")))]
use kimi_burn::backends::{CudaCube as GpuCube, CudaFusion as GpuFusion};
/// The GPU backend under test without Burn's fusion, and with it.
#[cfg(feature = "wgpu")]
use kimi_burn::backends::{WgpuCube as GpuCube, WgpuFusion as GpuFusion};

/// The fused kernel (one launch per step) against Burn's `AdamW` on the same GPU and on ndarray,
/// on a shape that is not a multiple of the cube, on the plain `CubeBackend` and on `Fusion`.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn adamw_kernel_matches_burns_adamw() {
    use kimi_burn::ops::{kernel_calls, last_path, FusedOp, KernelPath};
    let shape = [37, 29];
    let cpu = adamw_steps::<Cpu>(false, shape, 41, &Default::default());
    fn on<B: Backend>(shape: [usize; 2]) -> (AdamWRun, AdamWRun) {
        let device = Default::default();
        let before = kernel_calls(FusedOp::AdamW);
        let ours = adamw_steps::<B>(true, shape, 41, &device);
        assert_eq!(
            kernel_calls(FusedOp::AdamW) - before,
            3,
            "one kernel per step"
        );
        assert_eq!(last_path(FusedOp::AdamW), Some(KernelPath::Kernel));
        (ours, adamw_steps::<B>(false, shape, 41, &device))
    }
    for (name, (ours, burn)) in [
        ("CubeBackend", on::<GpuCube>(shape)),
        ("Fusion", on::<GpuFusion>(shape)),
    ] {
        for (step, ((o, b), c)) in ours.iter().zip(&burn).zip(&cpu).enumerate() {
            for (i, what) in ["param", "m1", "m2"].iter().enumerate() {
                let what = format!("{name}, step {step}, {what}");
                assert_close(
                    &format!("{what}: kernel vs Burn on the GPU"),
                    &b[i],
                    &o[i],
                    1e-6,
                );
                assert_close(&format!("{what}: kernel vs ndarray"), &c[i], &o[i], 1e-6);
            }
        }
    }
}

/// `KimiAdamW`'s state is Burn's `AdamWState`: a record saved by either adaptor loads into the
/// other, which then continues as the saving optimiser would have (and not as a fresh one). On
/// the GPU this crosses implementations: the fused kernel's state continued by Burn's tensor ops.
fn adamw_records_cross<B: burn::tensor::backend::AutodiffBackend>(device: &B::Device) {
    use kimi_burn::optim::KimiAdamW;
    let mut rng = rng(42);
    let module = Tiny::<B>::new(&mut rng, device);
    let config = AdamWConfig::new().with_weight_decay(0.05);
    let x1 = randn::<B, 2>(&mut rng, [5, D_IN], 1.0, device);
    let x2 = randn::<B, 2>(&mut rng, [5, D_IN], 1.0, device);
    let grads = |m: &Tiny<B>, x: &Tensor<B, 2>| {
        GradientsParams::from_grads(m.loss(x.clone()).backward(), m)
    };
    let values = |m: &Tiny<B>| {
        [
            host(m.matrix.val().inner()),
            host(m.q_proj.val().inner()),
            host(m.vector.val().inner()),
        ]
    };
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let mut ours = KimiAdamW::init::<B, Tiny<B>>(&config).unwrap();
    let mut burn = config.init::<B, Tiny<B>>();
    let a = ours.step(LR, module.clone(), grads(&module, &x1));
    let g = grads(&module, &x1);
    let b = burn.step(LR, module, g);
    let ours_bytes = recorder.record(ours.to_record(), ()).unwrap();
    let burn_bytes = recorder.record(burn.to_record(), ()).unwrap();
    let mut burn_from_ours = config
        .init::<B, Tiny<B>>()
        .load_record(recorder.load(ours_bytes, device).unwrap());
    let mut ours_from_burn = KimiAdamW::init::<B, Tiny<B>>(&config)
        .unwrap()
        .load_record(recorder.load(burn_bytes, device).unwrap());
    let mut fresh = config.init::<B, Tiny<B>>();
    let tol = 1e-6;
    let cont_ours = values(&ours.step(LR, a.clone(), grads(&a, &x2)));
    let cont_burn = values(&burn.step(LR, b.clone(), grads(&b, &x2)));
    let via_burn = values(&burn_from_ours.step(LR, a.clone(), grads(&a, &x2)));
    let via_ours = values(&ours_from_burn.step(LR, b.clone(), grads(&b, &x2)));
    let from_scratch = values(&fresh.step(LR, a.clone(), grads(&a, &x2)));
    for i in 0..3 {
        assert_close(
            &format!("param {i}: our record in Burn's AdamW"),
            &cont_ours[i],
            &via_burn[i],
            tol,
        );
        assert_close(
            &format!("param {i}: Burn's record in ours"),
            &cont_burn[i],
            &via_ours[i],
            tol,
        );
        assert!(
            rel_err(&cont_ours[i], &from_scratch[i]) > 1e-4,
            "param {i}: the loaded state should matter"
        );
    }
}

on_backends!(kimi_adamw_records_are_burns, adamw_records_cross);

/// `scaled_sum`'s kernel against its tensor-op form on ndarray, with a factor of exactly 1 and
/// without, on the plain `CubeBackend` and on `Fusion`.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn scaled_sum_kernel_matches_the_tensor_ops() {
    use kimi_burn::ops::optim::scaled_sum;
    use kimi_burn::ops::{kernel_calls, FusedOp};
    fn run<B: Backend>(a: f64, b: f64) -> Vec<f64> {
        let device = Default::default();
        let mut rng = rng(43);
        let x = randn::<B, 3>(&mut rng, [3, 37, 11], 1.0, &device);
        let y = randn::<B, 3>(&mut rng, [3, 37, 11], 0.1, &device);
        host(scaled_sum(x, a, y, b))
    }
    for (a, b) in [(0.999, -0.02), (1.0, -0.5), (0.95, 1.0)] {
        let want = run::<Cpu>(a, b);
        for (name, got) in [
            ("CubeBackend", {
                let before = kernel_calls(FusedOp::ScaledSum);
                let got = run::<GpuCube>(a, b);
                assert_eq!(kernel_calls(FusedOp::ScaledSum) - before, 1, "kernel path");
                got
            }),
            ("Fusion", run::<GpuFusion>(a, b)),
        ] {
            assert_close(&format!("{name}, a = {a}, b = {b}"), &want, &got, 1e-6);
        }
    }
}

/// Three steps of the whole optimiser (Muon whole and per head, AdamW) on a module, the same
/// inputs on every backend: the parameters after each step.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn optimiser_steps<B: burn::tensor::backend::AutodiffBackend>(
    device: &B::Device,
) -> Vec<[Vec<f64>; 4]> {
    let mut rng = rng(44);
    let mut module = Tiny::<B>::new(&mut rng, device);
    let roles = ParamRoles::from_module(&module).with(
        module.q_proj.id,
        ParamRole::muon_per_head(HeadSplit::columns(HEADS)),
    );
    let mut optim = KimiOptimizerConfig::new().init(&module, roles).unwrap();
    let mut out = Vec::new();
    for _ in 0..3 {
        let x = randn::<B, 2>(&mut rng, [5, D_IN], 1.0, device);
        let grads = GradientsParams::from_grads(module.loss(x).backward(), &module);
        module = optim.step(LR, module, grads);
        out.push([
            host(module.matrix.val().inner()),
            host(module.q_proj.val().inner()),
            host(module.vector.val().inner()),
            host(module.buffer.value().inner()),
        ]);
    }
    out
}

/// The optimiser on the GPU (its AdamW and Muon updates fused kernels) against ndarray (Burn's
/// tensor ops).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn the_optimiser_on_the_gpu_matches_ndarray() {
    use kimi_burn::ops::{kernel_calls, FusedOp};
    let device = Default::default();
    let want = optimiser_steps::<CpuAd>(&device);
    let (adamw, sums) = (
        kernel_calls(FusedOp::AdamW),
        kernel_calls(FusedOp::ScaledSum),
    );
    let got = optimiser_steps::<GpuAd>(&Default::default());
    assert_eq!(
        kernel_calls(FusedOp::AdamW) - adamw,
        3,
        "AdamW: one vector, three steps"
    );
    // Per step: Muon's update of two matrices, and two per Newton–Schulz iteration of each of
    // the two block shapes (the whole matrix, the per-head blocks).
    assert_eq!(
        kernel_calls(FusedOp::ScaledSum) - sums,
        3 * (2 + 2 * 2 * kimi_burn::optim::NS_STEPS as u64),
        "fused Muon steps"
    );
    // The Newton–Schulz products run on Burn's matmul (TF32 on CUDA).
    let tol = matmul_tol::<GpuAd>(&Default::default(), 1e-5);
    for (step, (w, g)) in want.iter().zip(&got).enumerate() {
        for (i, name) in ["matrix", "q_proj", "vector", "buffer"].iter().enumerate() {
            assert_close(&format!("step {step}: {name}"), &w[i], &g[i], tol);
        }
    }
}
