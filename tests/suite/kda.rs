//! KDA ops and layer (design §4.5): chunked vs recurrent, packed sequences, decode, gradients,
//! gate helpers and input validation.

use crate::common::*;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use kimi_burn::nn::{KdaCache, KdaConfig, KimiDeltaAttention};
use kimi_burn::ops::kda::{chunk_kda, fused_recurrent_kda, naive_recurrent_kda, KdaOptions};
use kimi_burn::ops::kda::{
    kda_gate, rms_norm_gated, try_chunk_kda, try_fused_recurrent_kda, try_kda_gate,
    try_naive_recurrent_kda,
};
use kimi_burn::ops::with_kernels;
use kimi_burn::{Error, KimiConfig};
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

impl<B: Backend> Inputs<B> {
    /// The same values on the ndarray reference backend (where every reference below is computed:
    /// a reference run on the backend under test would share its defects).
    fn to_cpu(&self) -> Inputs<Cpu> {
        let d = Default::default();
        let c4 = |t: &Tensor<B, 4>| from_f64::<Cpu, 4>(&host(t.clone()), t.dims(), &d);
        Inputs {
            q: c4(&self.q),
            k: c4(&self.k),
            v: c4(&self.v),
            g: c4(&self.g),
            beta: from_f64::<Cpu, 3>(&host(self.beta.clone()), self.beta.dims(), &d),
            h0: c4(&self.h0),
        }
    }
}

/// Moves a tensor's values to another backend.
fn moved<A: Backend, B: Backend, const D: usize>(
    t: &Tensor<A, D>,
    device: &B::Device,
) -> Tensor<B, D> {
    from_f64::<B, D>(&host(t.clone()), t.dims(), device)
}

fn log_sigmoid(x: f64) -> f64 {
    -((-x).exp().ln_1p())
}

/// Random inputs: q and k L2-normalised rows, v normal, β = σ(randn), h0 normal.
/// `(B, T, H, K, V)`.
type Dims = (usize, usize, usize, usize, usize);

fn inputs<B: Backend>(
    rng: &mut StdRng,
    (b, t, h, kd, vd): Dims,
    gates: Gates,
    n: usize,
    device: &B::Device,
) -> Inputs<B> {
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
            raw.iter()
                .zip(host(u))
                .map(|(&x, u)| if u < frac { -1000.0 } else { log_sigmoid(x) })
                .collect()
        }
        Gates::Safe => raw.iter().map(|&x| -5.0 / (1.0 + (-x).exp())).collect(),
    };
    let g = from_f64(&g, [b, t, h, kd], device);
    let beta: Vec<f64> = normal_vec(rng, b * t * h)
        .into_iter()
        .map(|x| 1.0 / (1.0 + (-x).exp()))
        .collect();
    let beta = from_f64(&beta, [b, t, h], device);
    let h0 = randn(rng, [n, h, kd, vd], 1.0, device);
    Inputs {
        q,
        k,
        v,
        g,
        beta,
        h0,
    }
}

type Out<B> = (Tensor<B, 4>, Option<Tensor<B, 4>>);
type Op<B> = fn(
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 3>,
    KdaOptions<B>,
) -> Out<B>;

fn run<B: Backend>(op: Op<B>, x: &Inputs<B>, opts: KdaOptions<B>) -> (Vec<f64>, Vec<f64>) {
    let (o, s) = op(
        x.q.clone(),
        x.k.clone(),
        x.v.clone(),
        x.g.clone(),
        x.beta.clone(),
        opts.with_initial_state(x.h0.clone()).with_final_state(true),
    );
    (host(o), host(s.expect("final state requested")))
}

/// Compares `op` against the naive recurrence on ndarray, on one case: `op` with the kernels on
/// and off (its reference form on `B`), and the naive recurrence itself on `B`.
fn check_against_naive<B: Backend>(
    op: Op<B>,
    seed: u64,
    (b, t, h, kd, vd): Dims,
    gates: Gates,
    chunk: usize,
    device: &B::Device,
) {
    let x = inputs::<B>(&mut rng(seed), (b, t, h, kd, vd), gates, b, device);
    let (o_ref, s_ref) = run(naive_recurrent_kda, &x.to_cpu(), KdaOptions::default());
    let what = format!("B={b} T={t} H={h} K={kd} V={vd} {gates:?} C={chunk}");
    for kernels in [true, false] {
        let (o, s) = with_kernels(kernels, || {
            run(op, &x, KdaOptions::default().with_chunk_size(chunk))
        });
        let what = format!("{what}, kernels {kernels}");
        // Kernels off, the op's reference form runs Burn's matmuls on `B` (TF32 on CUDA).
        let tol = if kernels {
            1e-5
        } else {
            matmul_tol::<B>(device, 1e-5)
        };
        assert_close(&format!("output, {what}"), &o_ref, &o, tol);
        assert_close(&format!("final state, {what}"), &s_ref, &s, tol);
    }
    let (o, s) = run(naive_recurrent_kda, &x, KdaOptions::default());
    assert_close(
        &format!("naive output on this backend, {what}"),
        &o_ref,
        &o,
        1e-5,
    );
    assert_close(
        &format!("naive final state on this backend, {what}"),
        &s_ref,
        &s,
        1e-5,
    );
}

// ---------------------------------------------------------------------------------------------
// Chunked and fused recurrent ops against the naive recurrence (f32, design §0 metric ≤ 1e-5).

/// A covering set of design §4.5: every T, every head dim as K and as V, both head counts, every
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
        check_against_naive::<Cpu>(
            chunk_kda,
            30 + i as u64,
            (1, 100, 2, 60, 32),
            Gates::Extreme(0.1),
            chunk,
            &d,
        );
        check_against_naive::<Cpu>(
            chunk_kda,
            40 + i as u64,
            (2, 37, 1, 32, 64),
            Gates::Safe,
            chunk,
            &d,
        );
    }
}

/// Dense −1000 gates: the final state is where exp(−G) or differences of large cumulative sums
/// would show (a straight port misses it by ~1e-4); here it must match to 1e-5.
#[test]
fn extreme_gates_keep_the_final_state_exact() {
    let d = Default::default();
    for (i, frac) in [0.02, 0.2, 0.5].into_iter().enumerate() {
        check_against_naive::<Cpu>(
            chunk_kda,
            50 + i as u64,
            (1, 130, 2, 64, 32),
            Gates::Extreme(frac),
            64,
            &d,
        );
    }
}

/// A whole chunk of −1000 gates: every exponent that could overflow is −1000·64; the output must
/// be finite and correct.
#[test]
fn a_chunk_of_minus_1000_gates_is_finite() {
    let d: burn::tensor::Device<Cpu> = Default::default();
    let mut x = inputs::<Cpu>(
        &mut rng(60),
        (1, 128, 2, 32, 32),
        Gates::LogSigmoid(1.0),
        1,
        &d,
    );
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
    let x = inputs::<Cpu>(
        &mut rng(80),
        (1, 70, 2, 32, 16),
        Gates::LogSigmoid(1.0),
        1,
        &d,
    );
    let mut r = rng(81);
    let scale_rows = |t: Tensor<Cpu, 4>, r: &mut StdRng| {
        t.mul(uniform::<Cpu, 4>(r, [1, 70, 2, 1], 0.5, 3.0, &d))
    };
    let raw = Inputs {
        q: scale_rows(x.q.clone(), &mut r),
        k: scale_rows(x.k.clone(), &mut r),
        ..x
    };
    let opts = || KdaOptions::default().with_scale(0.3);
    let (o_ref, s_ref) = run(
        naive_recurrent_kda,
        &Inputs {
            q: host_l2(&raw.q),
            k: host_l2(&raw.k),
            ..clone_inputs(&raw)
        },
        opts(),
    );
    for op in [
        chunk_kda as Op<Cpu>,
        fused_recurrent_kda,
        naive_recurrent_kda,
    ] {
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
    Inputs {
        q: x.q.clone(),
        k: x.k.clone(),
        v: x.v.clone(),
        g: x.g.clone(),
        beta: x.beta.clone(),
        h0: x.h0.clone(),
    }
}

// ---------------------------------------------------------------------------------------------
// Packed variable-length sequences.

const LENGTHS: [usize; 6] = [1, 15, 63, 64, 65, 300];

fn offsets(lengths: &[usize]) -> Vec<usize> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0, |acc, l| {
            *acc += l;
            Some(*acc)
        }))
        .collect()
}

/// Each op on packed sequences equals the naive op run on each sequence alone, outputs and
/// per-sequence final states.
fn check_packed<B: Backend>(lengths: &[usize], device: &B::Device) {
    let cu = offsets(lengths);
    let total = cu[cu.len() - 1];
    let n = lengths.len();
    let x = inputs::<B>(
        &mut rng(90),
        (1, total, 2, 32, 16),
        Gates::Extreme(0.05),
        n,
        device,
    );
    let mut o_ref = Vec::new();
    let mut s_ref = Vec::new();
    let cpu = x.to_cpu();
    for (i, w) in cu.windows(2).enumerate() {
        let x = &cpu;
        let part = |t: Tensor<Cpu, 4>| t.narrow(1, w[0], w[1] - w[0]);
        let xi = Inputs {
            q: part(x.q.clone()),
            k: part(x.k.clone()),
            v: part(x.v.clone()),
            g: part(x.g.clone()),
            beta: x.beta.clone().narrow(1, w[0], w[1] - w[0]),
            h0: x.h0.clone().narrow(0, i, 1),
        };
        let (o, s) = run(naive_recurrent_kda, &xi, KdaOptions::default());
        o_ref.push(o);
        s_ref.push(s);
    }
    let (o_ref, s_ref) = (o_ref.concat(), s_ref.concat());
    for (name, op) in [
        ("chunk", chunk_kda as Op<B>),
        ("fused", fused_recurrent_kda),
        ("naive", naive_recurrent_kda),
    ] {
        for kernels in [true, false] {
            let (o, s) = with_kernels(kernels, || {
                run(op, &x, KdaOptions::default().with_cu_seqlens(cu.clone()))
            });
            assert_close(
                &format!("{name} packed output, kernels {kernels}"),
                &o_ref,
                &o,
                1e-5,
            );
            assert_close(
                &format!("{name} packed states, kernels {kernels}"),
                &s_ref,
                &s,
                1e-5,
            );
        }
    }
    let (o, s) = run(
        chunk_kda,
        &x,
        KdaOptions::default()
            .with_cu_seqlens(cu)
            .with_chunk_size(16),
    );
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
fn grads<B: AutodiffBackend>(
    op: Op<B>,
    x: &Inputs<B>,
    d_o: &Tensor<B, 4>,
    d_s: &Tensor<B, 4>,
    opts: KdaOptions<B>,
) -> Vec<Vec<f64>> {
    let q = x.q.clone().require_grad();
    let k = x.k.clone().require_grad();
    let v = x.v.clone().require_grad();
    let g = x.g.clone().require_grad();
    let beta = x.beta.clone().require_grad();
    let h0 = x.h0.clone().require_grad();
    let (o, s) = op(
        q.clone(),
        k.clone(),
        v.clone(),
        g.clone(),
        beta.clone(),
        opts.with_initial_state(h0.clone()).with_final_state(true),
    );
    let loss = o
        .mul(d_o.clone())
        .sum()
        .add(s.expect("final state").mul(d_s.clone()).sum());
    let gr = loss.backward();
    let h = |t: Option<Tensor<B::InnerBackend, 4>>| host(t.expect("gradient"));
    vec![
        h(q.grad(&gr)),
        h(k.grad(&gr)),
        h(v.grad(&gr)),
        h(g.grad(&gr)),
        host(beta.grad(&gr).expect("gradient")),
        h(h0.grad(&gr)),
    ]
}

const GRAD_NAMES: [&str; 6] = ["dq", "dk", "dv", "dg", "dbeta", "dh0"];

/// Gradients of the chunked and fused ops (kernels on and off) and of the naive recurrence on `B`
/// equal those of the naive recurrence's autodiff on ndarray.
fn check_grads_against_naive<B: AutodiffBackend>(
    device: &B::Device,
    (b, t, h, kd, vd): Dims,
    gates: Gates,
    chunk: usize,
    cu: Option<Vec<usize>>,
) {
    let n = cu.as_ref().map_or(b, |c| c.len() - 1);
    let mut r = rng(100 + t as u64);
    let x = inputs::<B>(&mut r, (b, t, h, kd, vd), gates, n, device);
    let d_o = randn(&mut r, [b, t, h, vd], 1.0, device);
    let d_s = randn(&mut r, [n, h, kd, vd], 1.0, device);
    fn opts<B: Backend>(chunk: usize, cu: &Option<Vec<usize>>) -> KdaOptions<B> {
        let o = KdaOptions::default().with_chunk_size(chunk);
        match cu {
            Some(c) => o.with_cu_seqlens(c.clone()),
            None => o,
        }
    }
    let cpu: burn::tensor::Device<CpuAd> = Default::default();
    let x_cpu = x.to_cpu();
    let x_cpu = Inputs::<CpuAd> {
        q: Tensor::from_inner(x_cpu.q),
        k: Tensor::from_inner(x_cpu.k),
        v: Tensor::from_inner(x_cpu.v),
        g: Tensor::from_inner(x_cpu.g),
        beta: Tensor::from_inner(x_cpu.beta),
        h0: Tensor::from_inner(x_cpu.h0),
    };
    let reference = grads(
        naive_recurrent_kda,
        &x_cpu,
        &moved(&d_o, &cpu),
        &moved(&d_s, &cpu),
        opts(chunk, &cu),
    );
    // (name, op, kernels, tolerance). The chunked backward kernel and the naive recurrence
    // compute in f32 on every device; the chunked reference form, and the recurrent op with
    // tracked inputs (which takes it), run Burn's matmuls on `B` (TF32 on CUDA).
    let (f32_tol, ref_tol) = (1e-5, matmul_tol::<B>(device, 1e-5));
    let mut runs = vec![(
        "naive on this backend",
        naive_recurrent_kda as Op<B>,
        true,
        f32_tol,
    )];
    for kernels in [true, false] {
        let chunk_tol = if kernels { f32_tol } else { ref_tol };
        runs.push(("chunk", chunk_kda as Op<B>, kernels, chunk_tol));
        runs.push(("fused", fused_recurrent_kda, kernels, ref_tol));
    }
    for (name, op, kernels, tol) in runs {
        let got = with_kernels(kernels, || grads(op, &x, &d_o, &d_s, opts(chunk, &cu)));
        for ((what, r), g) in GRAD_NAMES.iter().zip(&reference).zip(&got) {
            let label = format!("{name} {what} T={t} {gates:?}, kernels {kernels}");
            assert_close(&label, r, g, tol);
        }
    }
}

#[test]
fn chunk_gradients_match_recurrence_autodiff() {
    let d = Default::default();
    check_grads_against_naive::<CpuAd>(&d, (2, 70, 2, 32, 16), Gates::LogSigmoid(1.0), 32, None);
    check_grads_against_naive::<CpuAd>(&d, (1, 100, 1, 60, 32), Gates::Extreme(0.1), 64, None);
    check_grads_against_naive::<CpuAd>(
        &d,
        (1, 45, 1, 16, 16),
        Gates::Safe,
        16,
        Some(vec![0, 1, 20, 45]),
    );
}

/// Central finite differences in f64 against the chunked op's backward, on a tiny case with two
/// chunks (one of them partial).
#[test]
fn chunk_gradients_match_finite_differences_f64() {
    let (b, t, h, kd, vd) = (1, 21, 1, 4, 3);
    let dad: burn::tensor::Device<Cpu64Ad> = Default::default();
    let mut r = rng(110);
    let x = inputs::<Cpu64Ad>(&mut r, (b, t, h, kd, vd), Gates::LogSigmoid(1.0), b, &dad);
    let d_o = randn::<Cpu64Ad, 4>(&mut r, [b, t, h, vd], 1.0, &dad);
    let d_s = randn::<Cpu64Ad, 4>(&mut r, [b, h, kd, vd], 1.0, &dad);
    let analytic = grads(
        chunk_kda,
        &x,
        &d_o,
        &d_s,
        KdaOptions::default().with_chunk_size(16),
    );

    let d: burn::tensor::Device<Cpu64> = Default::default();
    let inner = |t: &Tensor<Cpu64Ad, 4>| host(t.clone());
    let mut parts = vec![
        inner(&x.q),
        inner(&x.k),
        inner(&x.v),
        inner(&x.g),
        host(x.beta.clone()),
        inner(&x.h0),
    ];
    let (d_o, d_s) = (inner(&d_o), inner(&d_s));
    let loss = |p: &[Vec<f64>]| {
        let t4 = |v: &[f64], dims| from_f64::<Cpu64, 4>(v, dims, &d);
        let (o, s) = chunk_kda(
            t4(&p[0], [b, t, h, kd]),
            t4(&p[1], [b, t, h, kd]),
            t4(&p[2], [b, t, h, vd]),
            t4(&p[3], [b, t, h, kd]),
            from_f64(&p[4], [b, t, h], &d),
            KdaOptions::default()
                .with_chunk_size(16)
                .with_initial_state(t4(&p[5], [b, h, kd, vd]))
                .with_final_state(true),
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
        assert_close(
            &format!("{} vs finite differences", GRAD_NAMES[i]),
            &numeric,
            &analytic[i],
            1e-6,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Gate helpers against scalar formulas in f64.

/// design §4.2's gate in f64: `f: [.., H, K]` row-major, `a_log: [H]`, `dt_bias: [H·K]`.
fn kda_gate64(
    fv: &[f64],
    av: &[f64],
    dv: &[f64],
    (h, k): (usize, usize),
    lb: Option<f32>,
) -> Vec<f64> {
    (0..fv.len())
        .map(|i| {
            let (hi, ki) = ((i / k) % h, i % k);
            let x = fv[i] + dv[hi * k + ki];
            let a = av[hi].exp();
            match lb {
                None => -a * if x > 20.0 { x } else { x.exp().ln_1p() },
                Some(lb) => lb as f64 * sigmoid64(a * x),
            }
        })
        .collect()
}

/// design §4.2's gated norm in f64 over rows of `cols`.
fn rms_norm_gated64(ov: &[f64], zv: &[f64], wv: &[f64], cols: usize, eps: f64) -> Vec<f64> {
    let mut want = Vec::new();
    for (row, zrow) in ov.chunks(cols).zip(zv.chunks(cols)) {
        let rms = (row.iter().map(|x| x * x).sum::<f64>() / cols as f64 + eps).sqrt();
        want.extend(
            row.iter()
                .zip(zrow)
                .zip(wv)
                .map(|((x, z), w)| x / rms * w * sigmoid64(*z)),
        );
    }
    want
}

/// The gate and the gated norm on every backend, kernels on and off (the norm has a kernel on
/// wgpu; both have a tensor-op reference), against the f64 formulas of their f32 inputs.
fn check_gate_and_norm<B: AutodiffBackend>(device: &B::Device) {
    let (b, t, h, k) = (2, 3, 3, 5);
    let mut r = rng(201);
    let f = randn::<B, 4>(&mut r, [b, t, h, k], 12.0, device);
    let a_log = uniform::<B, 1>(&mut r, [h], 1.0, 16.0, device).log();
    let dt_bias = randn::<B, 1>(&mut r, [h * k], 1.0, device);
    let o = randn::<B, 4>(&mut r, [b, t, h, k], 2.0, device);
    let z = randn::<B, 4>(&mut r, [b, t, h, k], 3.0, device);
    let w = randn::<B, 1>(&mut r, [k], 1.0, device);
    let (fv, av, dv) = (host(f.clone()), host(a_log.clone()), host(dt_bias.clone()));
    let norm_want = rms_norm_gated64(
        &host(o.clone()),
        &host(z.clone()),
        &host(w.clone()),
        k,
        1e-5,
    );
    for kernels in [true, false] {
        for lb in [None, Some(-5.0f32)] {
            let got = with_kernels(kernels, || {
                host(kda_gate(f.clone(), a_log.clone(), dt_bias.clone(), lb))
            });
            let want = kda_gate64(&fv, &av, &dv, (h, k), lb);
            assert_close(
                &format!("kda_gate lb={lb:?}, kernels {kernels}"),
                &want,
                &got,
                1e-5,
            );
        }
        let got = with_kernels(kernels, || {
            host(rms_norm_gated(o.clone(), z.clone(), w.clone(), 1e-5))
        });
        assert_close(
            &format!("rms_norm_gated, kernels {kernels}"),
            &norm_want,
            &got,
            1e-5,
        );
    }
}
on_backends!(gate_and_norm_on_backends, check_gate_and_norm);

#[test]
fn kda_gate_matches_the_scalar_formula() {
    let d: burn::tensor::Device<Cpu64> = Default::default();
    let (b, t, h, k) = (2, 3, 3, 5);
    let mut r = rng(200);
    // Scaled so that some f + dt_bias exceed 20, where softplus is the identity.
    let f = randn::<Cpu64, 4>(&mut r, [b, t, h, k], 12.0, &d);
    let a_log = uniform::<Cpu64, 1>(&mut r, [h], 1.0, 16.0, &d).log();
    let dt_bias = randn::<Cpu64, 1>(&mut r, [h * k], 1.0, &d);
    let (fv, av, dv) = (host(f.clone()), host(a_log.clone()), host(dt_bias.clone()));
    assert!(
        fv.iter().any(|x| *x > 25.0),
        "the draw must reach the linear branch of softplus"
    );
    for lb in [None, Some(-5.0f32), Some(-0.5)] {
        let got = host(kda_gate(f.clone(), a_log.clone(), dt_bias.clone(), lb));
        let want = kda_gate64(&fv, &av, &dv, (h, k), lb);
        assert!(got.iter().all(|g| *g <= 0.0), "gates must be ≤ 0");
        assert_close(&format!("kda_gate lb={lb:?}"), &want, &got, 1e-12);
    }
}

#[test]
fn rms_norm_gated_matches_the_scalar_formula() {
    let d: burn::tensor::Device<Cpu64> = Default::default();
    let dims = [2, 3, 4, 6];
    let mut r = rng(210);
    let o = randn::<Cpu64, 4>(&mut r, dims, 2.0, &d);
    let z = randn::<Cpu64, 4>(&mut r, dims, 3.0, &d);
    let w = randn::<Cpu64, 1>(&mut r, [6], 1.0, &d);
    let eps = 1e-5;
    let got = host(rms_norm_gated(o.clone(), z.clone(), w.clone(), eps));
    let want = rms_norm_gated64(&host(o), &host(z), &host(w), 6, eps);
    assert_close("rms_norm_gated", &want, &got, 1e-12);
}

// ---------------------------------------------------------------------------------------------
// The layer.

fn small_configs() -> [KdaConfig; 2] {
    [
        // Kimi-Linear style: softplus gate, low-rank output gate.
        KdaConfig::new(32, 2, 16),
        // K3 style: safe gate at −5, full-rank output gate, chunks of 16.
        KdaConfig::new(32, 2, 16)
            .with_gate_lower_bound(Some(-5.0))
            .with_use_full_rank_gate(true)
            .with_chunk_size(16),
    ]
}

#[test]
fn layer_param_count_matches_config_and_presets() {
    let d = Default::default();
    for cfg in small_configs()
        .into_iter()
        .chain([KdaConfig::new(24, 3, 8).with_conv_size(3)])
    {
        let layer: KimiDeltaAttention<Cpu> = cfg.init(&d);
        assert_eq!(layer.num_params() as u64, cfg.num_params(), "{cfg:?}");
    }
    let tiny = KimiConfig::tiny();
    let layer: KimiDeltaAttention<Cpu> = tiny.kda_config().init(&d);
    assert_eq!(layer.num_params() as u64, tiny.kda_layer_params());

    let kl = KimiConfig::kimi_linear_48b().kda_config();
    assert_eq!(
        (
            kl.num_heads,
            kl.head_dim,
            kl.gate_lower_bound,
            kl.use_full_rank_gate
        ),
        (32, 128, None, false)
    );
    assert_eq!(kl.d_model, 2304);
    let k3 = KimiConfig::k3().kda_config();
    assert_eq!(
        (
            k3.num_heads,
            k3.head_dim,
            k3.gate_lower_bound,
            k3.use_full_rank_gate
        ),
        (96, 128, Some(-5.0), true)
    );
    for cfg in [&kl, &k3] {
        cfg.validate().expect("preset KDA config is valid");
    }
    assert!(KimiConfig::k3().validate().is_ok());
}

/// Prefill `t1` tokens through the cache, then decode `t2` one at a time: equal to one pass.
fn check_prefill_then_decode<B: Backend>(
    cfg: &KdaConfig,
    t1: usize,
    t2: usize,
    device: &B::Device,
) {
    B::seed(device, 7);
    let layer: KimiDeltaAttention<B> = cfg.init(device);
    let x = randn::<B, 3>(
        &mut rng(300 + t1 as u64),
        [2, t1 + t2, cfg.d_model],
        1.0,
        device,
    );
    let full = host(layer.forward(x.clone(), None));
    let mut cache = KdaCache::new();
    let mut parts = vec![layer.forward(x.clone().narrow(1, 0, t1), Some(&mut cache))];
    for t in t1..t1 + t2 {
        parts.push(layer.forward(x.clone().narrow(1, t, 1), Some(&mut cache)));
    }
    let stepped = host(Tensor::cat(parts, 1));
    assert_close(
        &format!("prefill {t1} + decode {t2}, {cfg:?}"),
        &full,
        &stepped,
        1e-5,
    );
    assert_eq!(
        cache.state.expect("state").dims(),
        [2, cfg.num_heads, cfg.head_dim, cfg.head_dim]
    );
    assert_eq!(
        cache.conv.expect("conv tail").dims(),
        [2, 3 * cfg.num_heads * cfg.head_dim, cfg.conv_size - 1]
    );
}

#[test]
fn layer_prefill_then_decode_equals_one_pass() {
    let d = Default::default();
    for cfg in &small_configs() {
        check_prefill_then_decode::<Cpu>(cfg, 70, 5, &d);
    }
    // A prefill short enough for the recurrent path, and one shorter than the conv history.
    check_prefill_then_decode::<Cpu>(&small_configs()[0], 50, 20, &d);
    check_prefill_then_decode::<Cpu>(&small_configs()[1], 2, 63, &d);
}

/// Packed sequences through the layer equal separate runs: outputs, states and conv tails; then a
/// packed decode step (one token per sequence) equals separate decode steps.
#[test]
fn layer_packed_sequences_equal_separate_runs() {
    let d: burn::tensor::Device<Cpu> = Default::default();
    let cfg = &small_configs()[1];
    let layer: KimiDeltaAttention<Cpu> = cfg.init(&d);
    let cu = offsets(&LENGTHS);
    let n = LENGTHS.len();
    let total = cu[n];
    let mut r = rng(310);
    let x = randn::<Cpu, 3>(&mut r, [1, total, cfg.d_model], 1.0, &d);
    let next = randn::<Cpu, 3>(&mut r, [1, n, cfg.d_model], 1.0, &d);

    let mut caches: Vec<KdaCache<Cpu>> = (0..n).map(|_| KdaCache::new()).collect();
    let mut want = Vec::new();
    let mut want_next = Vec::new();
    for (i, w) in cu.windows(2).enumerate() {
        want.push(host(layer.forward(
            x.clone().narrow(1, w[0], w[1] - w[0]),
            Some(&mut caches[i]),
        )));
        want_next.push(host(
            layer.forward(next.clone().narrow(1, i, 1), Some(&mut caches[i])),
        ));
    }
    let mut cache = KdaCache::new();
    let got = host(layer.forward_packed(x, &cu, Some(&mut cache)));
    assert_close("packed layer output", &want.concat(), &got, 1e-5);
    let got_next = host(layer.forward_packed(next, &offsets(&[1; 6]), Some(&mut cache)));
    assert_close("packed decode output", &want_next.concat(), &got_next, 1e-5);
    let states: Vec<f64> = caches
        .iter()
        .flat_map(|c| host(c.state.clone().expect("state")))
        .collect();
    let tails: Vec<f64> = caches
        .iter()
        .flat_map(|c| host(c.conv.clone().expect("tail")))
        .collect();
    assert_close(
        "packed states",
        &states,
        &host(cache.state.expect("state")),
        1e-5,
    );
    assert_close(
        "packed conv tails",
        &tails,
        &host(cache.conv.expect("tail")),
        1e-6,
    );
}

/// Every parameter path with its gradient's max |·| and whether it is all finite.
struct GradReport<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    path: Vec<String>,
    seen: Vec<(String, f64, bool)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradReport<'_, B> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let name = self.path.join(".");
        let g = host(
            param
                .val()
                .grad(self.grads)
                .unwrap_or_else(|| panic!("{name} has no gradient")),
        );
        let max = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        self.seen.push((name, max, g.iter().all(|v| v.is_finite())));
    }
}

fn check_layer_gradients<B: AutodiffBackend>(device: &B::Device) {
    // 70 tokens take the chunked path, 20 the recurrent one.
    for (cfg, t) in small_configs().iter().zip([70, 20]) {
        B::seed(device, 11);
        let layer: KimiDeltaAttention<B> = cfg.init(device);
        let mut r = rng(320);
        let x = randn::<B, 3>(&mut r, [2, t, cfg.d_model], 1.0, device);
        let w = randn::<B, 3>(&mut r, [2, t, cfg.d_model], 1.0, device);
        let grads = layer.forward(x, None).mul(w).sum().backward();
        let mut report = GradReport::<B> {
            grads: &grads,
            path: Vec::new(),
            seen: Vec::new(),
        };
        layer.visit(&mut report);
        assert_eq!(
            report.seen.len(),
            if cfg.use_full_rank_gate { 14 } else { 15 },
            "{:?}",
            report.seen
        );
        for (name, max, finite) in &report.seen {
            assert!(
                *finite && *max > 0.0,
                "{name}: gradient max |g| = {max}, finite = {finite}"
            );
        }
    }
}

#[test]
fn layer_parameters_all_get_gradients() {
    check_layer_gradients::<CpuAd>(&Default::default());
}

// ---------------------------------------------------------------------------------------------
// Bad input: each case gives the expected error with the offending values in the message.

fn expect_err<T>(what: &str, r: Result<T, Error>, variant: fn(&Error) -> bool, needles: &[&str]) {
    let Err(e) = r else {
        panic!("{what}: expected an error")
    };
    let msg = e.to_string();
    assert!(variant(&e), "{what}: wrong variant {e:?}");
    for n in needles {
        assert!(msg.contains(n), "{what}: message {msg:?} lacks {n:?}");
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    let d: burn::tensor::Device<Cpu> = Default::default();
    let x = inputs::<Cpu>(
        &mut rng(400),
        (1, 10, 2, 8, 4),
        Gates::LogSigmoid(1.0),
        1,
        &d,
    );
    let is_shape = |e: &Error| matches!(e, Error::Shape { .. });
    let is_arg = |e: &Error| matches!(e, Error::Argument { .. });
    let call = |x: &Inputs<Cpu>, opts: KdaOptions<Cpu>| {
        try_chunk_kda(
            x.q.clone(),
            x.k.clone(),
            x.v.clone(),
            x.g.clone(),
            x.beta.clone(),
            opts,
        )
    };

    let bad_k = Inputs {
        k: x.k.clone().narrow(3, 0, 7),
        ..clone_inputs(&x)
    };
    expect_err(
        "k shape",
        call(&bad_k, KdaOptions::default()),
        is_shape,
        &["`k`", "[1, 10, 2, 7]"],
    );
    let bad_v = Inputs {
        v: x.v.clone().narrow(1, 0, 9),
        ..clone_inputs(&x)
    };
    expect_err(
        "v shape",
        call(&bad_v, KdaOptions::default()),
        is_shape,
        &["`v`", "[1, 9, 2, 4]"],
    );
    let bad_beta = Inputs {
        beta: x.beta.clone().narrow(2, 0, 1),
        ..clone_inputs(&x)
    };
    expect_err(
        "beta shape",
        call(&bad_beta, KdaOptions::default()),
        is_shape,
        &["`beta`", "[1, 10, 1]"],
    );
    let bad_g = Inputs {
        g: x.g.clone().narrow(0, 0, 1).narrow(1, 0, 5),
        ..clone_inputs(&x)
    };
    expect_err(
        "g shape",
        call(&bad_g, KdaOptions::default()),
        is_shape,
        &["`g`", "[1, 5, 2, 8]"],
    );

    for (cu, needle) in [
        (vec![1, 10], "start at 0"),
        (vec![0, 6, 6, 10], "6 then 6"),
        (vec![0, 4, 9], "T = 10, got 9"),
    ] {
        expect_err(
            "cu_seqlens",
            call(&x, KdaOptions::default().with_cu_seqlens(cu.clone())),
            is_arg,
            &["cu_seqlens", needle],
        );
    }
    let two = inputs::<Cpu>(
        &mut rng(401),
        (2, 10, 2, 8, 4),
        Gates::LogSigmoid(1.0),
        2,
        &d,
    );
    expect_err(
        "B with cu_seqlens",
        call(&two, KdaOptions::default().with_cu_seqlens(vec![0, 10])),
        is_arg,
        &["B = 2"],
    );

    let wide = inputs::<Cpu>(
        &mut rng(402),
        (1, 3, 1, 257, 4),
        Gates::LogSigmoid(1.0),
        1,
        &d,
    );
    expect_err(
        "K > 256",
        call(&wide, KdaOptions::default()),
        is_arg,
        &["256", "257"],
    );

    let mut gv = host(x.g.clone());
    gv[17] = 0.25;
    let positive = Inputs {
        g: from_f64(&gv, [1, 10, 2, 8], &d),
        ..clone_inputs(&x)
    };
    expect_err(
        "g > 0",
        call(&positive, KdaOptions::default()),
        is_arg,
        &["`g`", "0.25"],
    );
    gv[17] = f64::NAN;
    let nan = Inputs {
        g: from_f64(&gv, [1, 10, 2, 8], &d),
        ..clone_inputs(&x)
    };
    expect_err(
        "g NaN",
        call(&nan, KdaOptions::default()),
        |e| matches!(e, Error::NonFinite { .. }),
        &["g", "NaN"],
    );
    let opts = || KdaOptions::default();
    expect_err(
        "g > 0 naive",
        try_naive_recurrent_kda(
            positive.q.clone(),
            positive.k.clone(),
            positive.v.clone(),
            positive.g.clone(),
            positive.beta.clone(),
            opts(),
        ),
        is_arg,
        &["0.25"],
    );
    expect_err(
        "g > 0 fused",
        try_fused_recurrent_kda(
            positive.q.clone(),
            positive.k.clone(),
            positive.v.clone(),
            positive.g.clone(),
            positive.beta.clone(),
            opts(),
        ),
        is_arg,
        &["0.25"],
    );

    for c in [8, 48, 128] {
        expect_err(
            "chunk size",
            call(&x, KdaOptions::default().with_chunk_size(c)),
            is_arg,
            &["chunk_size", &format!("got {c}")],
        );
    }
    let h0 = Tensor::<Cpu, 4>::zeros([1, 2, 4, 8], &d);
    expect_err(
        "initial state",
        call(&x, KdaOptions::default().with_initial_state(h0)),
        is_shape,
        &["initial_state", "[1, 2, 8, 4]", "[1, 2, 4, 8]"],
    );
    let h0 = Tensor::<Cpu, 4>::zeros([1, 2, 8, 4], &d);
    expect_err(
        "initial state per sequence",
        call(
            &x,
            KdaOptions::default()
                .with_initial_state(h0)
                .with_cu_seqlens(vec![0, 3, 10]),
        ),
        is_shape,
        &["[2, 2, 8, 4]"],
    );

    let a_log = Tensor::<Cpu, 1>::zeros([3], &d);
    let dt = Tensor::<Cpu, 1>::zeros([16], &d);
    expect_err(
        "a_log shape",
        try_kda_gate(x.g.clone(), a_log, dt.clone(), None),
        is_shape,
        &["a_log", "[3]"],
    );
    expect_err(
        "lower bound",
        try_kda_gate(x.g.clone(), Tensor::zeros([2], &d), dt, Some(-7.0)),
        is_arg,
        &["-7"],
    );

    let is_config = |e: &Error| matches!(e, Error::Config { .. });
    expect_err(
        "config head_dim",
        KdaConfig::new(32, 2, 300).try_init::<Cpu>(&d),
        is_config,
        &["head_dim", "300"],
    );
    expect_err(
        "config lower bound",
        KdaConfig::new(32, 2, 16)
            .with_gate_lower_bound(Some(0.5))
            .try_init::<Cpu>(&d),
        is_config,
        &["0.5"],
    );
    expect_err(
        "config chunk",
        KdaConfig::new(32, 2, 16)
            .with_chunk_size(100)
            .try_init::<Cpu>(&d),
        is_config,
        &["100"],
    );
    let layer: KimiDeltaAttention<Cpu> = KdaConfig::new(32, 2, 16).init(&d);
    let xs = randn::<Cpu, 3>(&mut rng(403), [2, 5, 32], 1.0, &d);
    let mut cache = KdaCache {
        state: Some(Tensor::zeros([3, 2, 16, 16], &d)),
        conv: None,
    };
    expect_err(
        "layer cache",
        layer.try_forward(xs.clone(), None, Some(&mut cache)),
        is_shape,
        &["cache.state", "[3, 2, 16, 16]"],
    );
    expect_err(
        "layer width",
        layer.try_forward(xs.narrow(2, 0, 30), None, None),
        is_shape,
        &["[2, 5, 30]"],
    );
}

// ---------------------------------------------------------------------------------------------
// Half-precision inputs: computed in f32, output in the input dtype, state in f32 (wgpu only:
// Burn's ndarray backend has no f16).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn check_half_inputs<B: Backend>(device: &B::Device) {
    use burn::tensor::{DType, FloatDType};
    let x = inputs::<B>(
        &mut rng(500),
        (1, 40, 2, 16, 16),
        Gates::LogSigmoid(1.0),
        1,
        device,
    );
    let (o_ref, s_ref) = run(naive_recurrent_kda, &x, KdaOptions::default());
    let half = |t: Tensor<B, 4>| t.cast(FloatDType::F16);
    let (o, s) = chunk_kda(
        half(x.q.clone()),
        half(x.k.clone()),
        half(x.v.clone()),
        half(x.g.clone()),
        x.beta.clone().cast(FloatDType::F16),
        KdaOptions::default()
            .with_initial_state(x.h0.clone())
            .with_final_state(true)
            .with_chunk_size(16),
    );
    let s = s.expect("state");
    assert_eq!(o.dtype(), DType::F16);
    assert_eq!(s.dtype(), DType::F32);
    assert_close("f16 output", &o_ref, &host(o), 5e-3);
    assert_close("f16 state", &s_ref, &host(s), 5e-3);
}

// ---------------------------------------------------------------------------------------------
// The same checks on every backend, ndarray and wgpu, each against references computed on ndarray
// (small shapes: CI runs lavapipe, a software Vulkan).

fn small_op_checks<B: AutodiffBackend>(device: &B::Device) {
    check_against_naive::<B>(
        chunk_kda,
        600,
        (1, 40, 2, 16, 8),
        Gates::Extreme(0.1),
        16,
        device,
    );
    check_against_naive::<B>(
        fused_recurrent_kda,
        601,
        (2, 7, 1, 16, 8),
        Gates::Safe,
        16,
        device,
    );
    // Several sequences and heads at once: the shape where the naive recurrence once went wrong
    // on wgpu (see `broadcast_over_swapped_unit_dims`).
    check_against_naive::<B>(
        chunk_kda,
        602,
        (2, 9, 3, 16, 8),
        Gates::LogSigmoid(1.0),
        16,
        device,
    );
    check_against_naive::<B>(
        fused_recurrent_kda,
        603,
        (2, 5, 3, 8, 16),
        Gates::Extreme(0.1),
        16,
        device,
    );
    check_packed::<B>(&[1, 15, 20], device);
}
on_backends!(ops_on_backends, small_op_checks);

fn small_gradient_checks<B: AutodiffBackend>(device: &B::Device) {
    check_grads_against_naive::<B>(device, (1, 20, 1, 8, 8), Gates::LogSigmoid(1.0), 16, None);
    check_grads_against_naive::<B>(device, (2, 11, 3, 8, 4), Gates::Safe, 16, None);
}
on_backends!(grads_on_backends, small_gradient_checks);

fn small_layer_checks<B: AutodiffBackend>(device: &B::Device) {
    check_prefill_then_decode::<B>(&small_configs()[1], 60, 5, device);
    check_layer_gradients::<B>(device);
}
on_backends!(layer_on_backends, small_layer_checks);

#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn half_inputs_on_wgpu() {
    check_half_inputs::<Gpu>(&Default::default());
}

/// Without an initial or a final state, `chunk_kda` and `fused_recurrent_kda` on a CPU backend are
/// one host recurrence (the path the layer uses in training): the same outputs as the naive
/// recurrence, plain and packed, with and without the q/k L2 norm, kernels on and off.
#[test]
fn stateless_ops_on_the_cpu_match_the_recurrence() {
    let d = Default::default();
    let x = inputs::<Cpu>(
        &mut rng(604),
        (2, 37, 3, 16, 8),
        Gates::LogSigmoid(1.0),
        2,
        &d,
    );
    let lengths = [5, 32];
    let packed = inputs::<Cpu>(&mut rng(605), (1, 37, 2, 8, 16), Gates::Safe, 2, &d);
    for l2 in [false, true] {
        for (x, cu) in [(&x, None), (&packed, Some(offsets(&lengths)))] {
            let opts = || {
                let o = KdaOptions::default().with_qk_l2norm(l2).with_chunk_size(16);
                match &cu {
                    Some(c) => o.with_cu_seqlens(c.clone()),
                    None => o,
                }
            };
            let call = |op: Op<Cpu>| {
                host(
                    op(
                        x.q.clone(),
                        x.k.clone(),
                        x.v.clone(),
                        x.g.clone(),
                        x.beta.clone(),
                        opts(),
                    )
                    .0,
                )
            };
            let want = call(naive_recurrent_kda);
            for kernels in [true, false] {
                for (name, op) in [
                    ("chunk", chunk_kda as Op<Cpu>),
                    ("fused", fused_recurrent_kda),
                ] {
                    let got = with_kernels(kernels, || call(op));
                    let what = format!(
                        "{name}, l2 {l2}, packed {}, kernels {kernels}",
                        cu.is_some()
                    );
                    assert_close(&what, &want, &got, 1e-5);
                }
            }
        }
    }
}
