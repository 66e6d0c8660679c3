//! KDA ops and layer (SPEC §4.5): chunked vs recurrent, packed sequences, decode, gradients,
//! gate helpers and input validation.

mod common;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor};
use kimi_burn::nn::{KdaCache, KdaConfig, KimiDeltaAttention};
use kimi_burn::ops::kda::{
    kda_gate, rms_norm_gated, try_chunk_kda, try_fused_recurrent_kda, try_kda_gate, try_naive_recurrent_kda,
};
use kimi_burn::{Error, KimiConfig};
use common::*;
use kimi_burn::ops::kda::{chunk_kda, fused_recurrent_kda, naive_recurrent_kda, KdaOptions};
use rand::rngs::StdRng;

/// How the log decays `g` are drawn.
#[derive(Clone, Copy, Debug)]
enum Gates {
    /// `logsigmoid(randn) / normaliser`.
    LogSigmoid(f64),
    /// `logsigmoid(randn)` with a fraction of the entries set to −1000.
    Extreme(f64),
    /// The safe-gate range `−5 · σ(randn)`.
    Safe,
}

struct Inputs<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    h0: Tensor<B, 4>,
}

fn log_sigmoid(x: f64) -> f64 {
    -((-x).exp().ln_1p())
}

/// Random inputs: q and k L2-normalised rows, v normal, β = σ(randn), h0 normal.
fn inputs<B: Backend>(rng: &mut StdRng, b: usize, t: usize, h: usize, kd: usize, vd: usize, gates: Gates, n: usize, device: &B::Device) -> Inputs<B> {
    let unit_rows = |rng: &mut StdRng| {
        let mut x = normal_vec(rng, b * t * h * kd);
        for row in x.chunks_mut(kd) {
            let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            row.iter_mut().for_each(|v| *v /= norm);
        }
        from_f64::<B, 4>(&x, [b, t, h, kd], device)
    };
    let q = unit_rows(rng);
    let k = unit_rows(rng);
    let v = randn(rng, [b, t, h, vd], 1.0, device);
    let raw = normal_vec(rng, b * t * h * kd);
    let g: Vec<f64> = match gates {
        Gates::LogSigmoid(norm) => raw.iter().map(|&x| log_sigmoid(x) / norm).collect(),
        Gates::Extreme(frac) => {
            let u = uniform::<B, 1>(rng, [raw.len()], 0.0, 1.0, device);
            raw.iter().zip(host(u)).map(|(&x, u)| if u < frac { -1000.0 } else { log_sigmoid(x) }).collect()
        }
        Gates::Safe => raw.iter().map(|&x| -5.0 / (1.0 + (-x).exp())).collect(),
    };
    let g = from_f64(&g, [b, t, h, kd], device);
    let beta: Vec<f64> = normal_vec(rng, b * t * h).into_iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
    let beta = from_f64(&beta, [b, t, h], device);
    let h0 = randn(rng, [n, h, kd, vd], 1.0, device);
    Inputs { q, k, v, g, beta, h0 }
}

type Out<B> = (Tensor<B, 4>, Option<Tensor<B, 4>>);
type Op<B> = fn(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3>, KdaOptions<B>) -> Out<B>;

fn run<B: Backend>(op: Op<B>, x: &Inputs<B>, opts: KdaOptions<B>) -> (Vec<f64>, Vec<f64>) {
    let (o, s) = op(x.q.clone(), x.k.clone(), x.v.clone(), x.g.clone(), x.beta.clone(), opts.with_initial_state(x.h0.clone()).with_final_state(true));
    (host(o), host(s.expect("final state requested")))
}

/// Compares `op` against the naive recurrence on one case.
fn check_against_naive<B: Backend>(op: Op<B>, seed: u64, (b, t, h, kd, vd): (usize, usize, usize, usize, usize), gates: Gates, chunk: usize, device: &B::Device) {
    let x = inputs::<B>(&mut rng(seed), b, t, h, kd, vd, gates, b, device);
    let (o_ref, s_ref) = run(naive_recurrent_kda, &x, KdaOptions::default());
    let (o, s) = run(op, &x, KdaOptions::default().with_chunk_size(chunk));
    let what = format!("B={b} T={t} H={h} K={kd} V={vd} {gates:?} C={chunk}");
    assert_close(&format!("output, {what}"), &o_ref, &o, 1e-5);
    assert_close(&format!("final state, {what}"), &s_ref, &s, 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Chunked and fused recurrent ops against the naive recurrence (f32, SPEC §0 metric ≤ 1e-5).

/// A covering set of SPEC §4.5: every T, every head dim as K and as V, both head counts, every
/// gate law; initial state random, final state compared.
#[test]
fn chunk_matches_recurrence() {
    let d = Default::default();
    let cases = [
        ((1, 1, 1, 32, 32), Gates::LogSigmoid(1.0)),
        ((2, 63, 3, 60, 64), Gates::LogSigmoid(0.1)),
        ((1, 64, 1, 64, 60), Gates::LogSigmoid(10.0)),
        ((1, 65, 3, 128, 32), Gates::Extreme(0.1)),
        ((1, 160, 1, 32, 128), Gates::Safe),
        ((1, 500, 1, 64, 64), Gates::Extreme(0.05)),
        ((2, 160, 3, 60, 60), Gates::LogSigmoid(1.0)),
        ((1, 500, 1, 128, 128), Gates::LogSigmoid(0.1)),
    ];
    for (i, (shape, gates)) in cases.into_iter().enumerate() {
        check_against_naive::<Cpu>(chunk_kda, 10 + i as u64, shape, gates, 64, &d);
    }
}

/// Chunks of 16, 32 and 64 all agree with the recurrence (and so with each other), with one
/// sequence that is not a multiple of any of them.
#[test]
fn chunk_sizes_agree() {
    let d = Default::default();
    for (i, chunk) in [16, 32, 64].into_iter().enumerate() {
        check_against_naive::<Cpu>(chunk_kda, 30 + i as u64, (1, 100, 2, 60, 32), Gates::Extreme(0.1), chunk, &d);
        check_against_naive::<Cpu>(chunk_kda, 40 + i as u64, (2, 37, 1, 32, 64), Gates::Safe, chunk, &d);
    }
}

/// Dense −1000 gates: the final state is where exp(−G) or differences of large cumulative sums
/// would show (a straight port misses it by ~1e-4); here it must match to 1e-5.
#[test]
fn extreme_gates_keep_the_final_state_exact() {
    let d = Default::default();
    for (i, frac) in [0.02, 0.2, 0.5].into_iter().enumerate() {
        check_against_naive::<Cpu>(chunk_kda, 50 + i as u64, (1, 130, 2, 64, 32), Gates::Extreme(frac), 64, &d);
    }
}

/// A whole chunk of −1000 gates: every exponent that could overflow is −1000·64; the output must
/// be finite and correct.
#[test]
fn a_chunk_of_minus_1000_gates_is_finite() {
    let d: burn::tensor::Device<Cpu> = Default::default();
    let mut x = inputs::<Cpu>(&mut rng(60), 1, 128, 2, 32, 32, Gates::LogSigmoid(1.0), 1, &d);
    let mut g = host(x.g.clone());
    g[..64 * 2 * 32].iter_mut().for_each(|v| *v = -1000.0);
    x.g = from_f64(&g, [1, 128, 2, 32], &d);
    let (o_ref, s_ref) = run(naive_recurrent_kda, &x, KdaOptions::default());
    let (o, s) = run(chunk_kda, &x, KdaOptions::default());
    assert_close("output", &o_ref, &o, 1e-5);
    assert_close("final state", &s_ref, &s, 1e-5);
}

#[test]
fn fused_recurrent_matches_recurrence() {
    let d = Default::default();
    let cases = [
        ((1, 1, 1, 32, 32), Gates::LogSigmoid(1.0)),
        ((2, 15, 3, 60, 64), Gates::Extreme(0.1)),
        ((1, 65, 1, 128, 60), Gates::Safe),
        ((1, 160, 1, 64, 128), Gates::LogSigmoid(0.1)),
    ];
    for (i, (shape, gates)) in cases.into_iter().enumerate() {
        check_against_naive::<Cpu>(fused_recurrent_kda, 70 + i as u64, shape, gates, 64, &d);
    }
}

/// The op's own L2 norm and scale: raw q and k through `use_qk_l2norm` and a custom scale equal
/// pre-normalised inputs through the naive op.
#[test]
fn qk_l2norm_and_scale_inside_the_op() {
    let d: burn::tensor::Device<Cpu> = Default::default();
    let x = inputs::<Cpu>(&mut rng(80), 1, 70, 2, 32, 16, Gates::LogSigmoid(1.0), 1, &d);
    let mut r = rng(81);
    let scale_rows = |t: Tensor<Cpu, 4>, r: &mut StdRng| t.mul(uniform::<Cpu, 4>(r, [1, 70, 2, 1], 0.5, 3.0, &d));
    let raw = Inputs { q: scale_rows(x.q.clone(), &mut r), k: scale_rows(x.k.clone(), &mut r), ..x };
    let opts = || KdaOptions::default().with_scale(0.3);
    let (o_ref, s_ref) = run(naive_recurrent_kda, &Inputs { q: host_l2(&raw.q), k: host_l2(&raw.k), ..clone_inputs(&raw) }, opts());
    for op in [chunk_kda as Op<Cpu>, fused_recurrent_kda, naive_recurrent_kda] {
        let (o, s) = run(op, &raw, opts().with_qk_l2norm(true));
        assert_close("output", &o_ref, &o, 1e-5);
        assert_close("state", &s_ref, &s, 1e-5);
    }
}

fn host_l2<B: Backend>(x: &Tensor<B, 4>) -> Tensor<B, 4> {
    let dims = x.dims();
    let mut v = host(x.clone());
    for row in v.chunks_mut(dims[3]) {
        let n = (row.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
        row.iter_mut().for_each(|a| *a /= n);
    }
    from_f64(&v, dims, &x.device())
}

fn clone_inputs<B: Backend>(x: &Inputs<B>) -> Inputs<B> {
    Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), g: x.g.clone(), beta: x.beta.clone(), h0: x.h0.clone() }
}

// ---------------------------------------------------------------------------------------------
// Packed variable-length sequences.

const LENGTHS: [usize; 6] = [1, 15, 63, 64, 65, 300];

fn offsets(lengths: &[usize]) -> Vec<usize> {
    std::iter::once(0).chain(lengths.iter().scan(0, |acc, l| { *acc += l; Some(*acc) })).collect()
}

/// Each op on packed sequences equals the naive op run on each sequence alone, outputs and
/// per-sequence final states.
fn check_packed<B: Backend>(lengths: &[usize], device: &B::Device) {
    let cu = offsets(lengths);
    let total = cu[cu.len() - 1];
    let n = lengths.len();
    let x = inputs::<B>(&mut rng(90), 1, total, 2, 32, 16, Gates::Extreme(0.05), n, device);
    let mut o_ref = Vec::new();
    let mut s_ref = Vec::new();
    for (i, w) in cu.windows(2).enumerate() {
        let part = |t: Tensor<B, 4>| t.narrow(1, w[0], w[1] - w[0]);
        let xi = Inputs {
            q: part(x.q.clone()), k: part(x.k.clone()), v: part(x.v.clone()), g: part(x.g.clone()),
            beta: x.beta.clone().narrow(1, w[0], w[1] - w[0]), h0: x.h0.clone().narrow(0, i, 1),
        };
        let (o, s) = run(naive_recurrent_kda, &xi, KdaOptions::default());
        o_ref.push(o);
        s_ref.push(s);
    }
    let (o_ref, s_ref) = (o_ref.concat(), s_ref.concat());
    for (name, op) in [("chunk", chunk_kda as Op<B>), ("fused", fused_recurrent_kda), ("naive", naive_recurrent_kda)] {
        let (o, s) = run(op, &x, KdaOptions::default().with_cu_seqlens(cu.clone()));
        assert_close(&format!("{name} packed output"), &o_ref, &o, 1e-5);
        assert_close(&format!("{name} packed states"), &s_ref, &s, 1e-5);
    }
    let (o, s) = run(chunk_kda, &x, KdaOptions::default().with_cu_seqlens(cu).with_chunk_size(16));
    assert_close("chunk 16 packed output", &o_ref, &o, 1e-5);
    assert_close("chunk 16 packed states", &s_ref, &s, 1e-5);
}

#[test]
fn packed_sequences_equal_separate_runs() {
    check_packed::<Cpu>(&LENGTHS, &Default::default());
}

// ---------------------------------------------------------------------------------------------
// Gradients.

/// `Σ o ⊙ do + Σ S_T ⊙ dS_T` and the gradients of q, k, v, g, β and h0 (flattened, in that order).
fn grads<B: AutodiffBackend>(op: Op<B>, x: &Inputs<B>, d_o: &Tensor<B, 4>, d_s: &Tensor<B, 4>, opts: KdaOptions<B>) -> Vec<Vec<f64>> {
    let q = x.q.clone().require_grad();
    let k = x.k.clone().require_grad();
    let v = x.v.clone().require_grad();
    let g = x.g.clone().require_grad();
    let beta = x.beta.clone().require_grad();
    let h0 = x.h0.clone().require_grad();
    let (o, s) = op(q.clone(), k.clone(), v.clone(), g.clone(), beta.clone(), opts.with_initial_state(h0.clone()).with_final_state(true));
    let loss = o.mul(d_o.clone()).sum().add(s.expect("final state").mul(d_s.clone()).sum());
    let gr = loss.backward();
    let h = |t: Option<Tensor<B::InnerBackend, 4>>| host(t.expect("gradient"));
    vec![h(q.grad(&gr)), h(k.grad(&gr)), h(v.grad(&gr)), h(g.grad(&gr)), host(beta.grad(&gr).expect("gradient")), h(h0.grad(&gr))]
}

const GRAD_NAMES: [&str; 6] = ["dq", "dk", "dv", "dg", "dbeta", "dh0"];

/// Gradients of the chunked op equal those of the recurrence's autodiff.
fn check_grads_against_naive<B: AutodiffBackend>(device: &B::Device, (b, t, h, kd, vd): (usize, usize, usize, usize, usize), gates: Gates, chunk: usize, cu: Option<Vec<usize>>) {
    let n = cu.as_ref().map_or(b, |c| c.len() - 1);
    let mut r = rng(100 + t as u64);
    let x = inputs::<B>(&mut r, b, t, h, kd, vd, gates, n, device);
    let d_o = randn(&mut r, [b, t, h, vd], 1.0, device);
    let d_s = randn(&mut r, [n, h, kd, vd], 1.0, device);
    let opts = || {
        let o = KdaOptions::default().with_chunk_size(chunk);
        match &cu { Some(c) => o.with_cu_seqlens(c.clone()), None => o }
    };
    let reference = grads(naive_recurrent_kda, &x, &d_o, &d_s, opts());
    for (name, op) in [("chunk", chunk_kda as Op<B>), ("fused", fused_recurrent_kda)] {
        let got = grads(op, &x, &d_o, &d_s, opts());
        for ((what, r), g) in GRAD_NAMES.iter().zip(&reference).zip(&got) {
            assert_close(&format!("{name} {what} T={t} {gates:?}"), r, g, 1e-5);
        }
    }
}

#[test]
fn chunk_gradients_match_recurrence_autodiff() {
    let d = Default::default();
    check_grads_against_naive::<CpuAd>(&d, (2, 70, 2, 32, 16), Gates::LogSigmoid(1.0), 32, None);
    check_grads_against_naive::<CpuAd>(&d, (1, 100, 1, 60, 32), Gates::Extreme(0.1), 64, None);
    check_grads_against_naive::<CpuAd>(&d, (1, 45, 1, 16, 16), Gates::Safe, 16, Some(vec![0, 1, 20, 45]));
}

/// Central finite differences in f64 against the chunked op's backward, on a tiny case with two
/// chunks (one of them partial).
#[test]
fn chunk_gradients_match_finite_differences_f64() {
    let (b, t, h, kd, vd) = (1, 21, 1, 4, 3);
    let dad: burn::tensor::Device<Cpu64Ad> = Default::default();
    let mut r = rng(110);
    let x = inputs::<Cpu64Ad>(&mut r, b, t, h, kd, vd, Gates::LogSigmoid(1.0), b, &dad);
    let d_o = randn::<Cpu64Ad, 4>(&mut r, [b, t, h, vd], 1.0, &dad);
    let d_s = randn::<Cpu64Ad, 4>(&mut r, [b, h, kd, vd], 1.0, &dad);
    let analytic = grads(chunk_kda, &x, &d_o, &d_s, KdaOptions::default().with_chunk_size(16));

    let d: burn::tensor::Device<Cpu64> = Default::default();
    let inner = |t: &Tensor<Cpu64Ad, 4>| host(t.clone());
    let mut parts = vec![inner(&x.q), inner(&x.k), inner(&x.v), inner(&x.g), host(x.beta.clone()), inner(&x.h0)];
    let (d_o, d_s) = (inner(&d_o), inner(&d_s));
    let loss = |p: &[Vec<f64>]| {
        let t4 = |v: &[f64], dims| from_f64::<Cpu64, 4>(v, dims, &d);
        let (o, s) = chunk_kda(
            t4(&p[0], [b, t, h, kd]), t4(&p[1], [b, t, h, kd]), t4(&p[2], [b, t, h, vd]), t4(&p[3], [b, t, h, kd]),
            from_f64(&p[4], [b, t, h], &d),
            KdaOptions::default().with_chunk_size(16).with_initial_state(t4(&p[5], [b, h, kd, vd])).with_final_state(true),
        );
        let dot = |a: Vec<f64>, w: &[f64]| a.iter().zip(w).map(|(x, y)| x * y).sum::<f64>();
        dot(host(o), &d_o) + dot(host(s.expect("state")), &d_s)
    };
    for i in 0..parts.len() {
        let base = parts[i].clone();
        let numeric = finite_diff(&base, 1e-6, |xi| {
            parts[i] = xi.to_vec();
            let l = loss(&parts);
            parts[i] = base.clone();
            l
        });
        assert_close(&format!("{} vs finite differences", GRAD_NAMES[i]), &numeric, &analytic[i], 1e-6);
    }
}

