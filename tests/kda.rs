//! KDA ops and layer (SPEC §4.5): chunked vs recurrent, packed sequences, decode, gradients,
//! gate helpers and input validation.

mod common;

use burn::tensor::{backend::Backend, Tensor};
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

#[test]
fn chunk_matches_recurrence_smoke() {
    let d = Default::default();
    check_against_naive::<Cpu>(chunk_kda, 1, (1, 65, 1, 32, 32), Gates::LogSigmoid(1.0), 64, &d);
}
