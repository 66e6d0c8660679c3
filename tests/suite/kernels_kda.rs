//! The KDA CubeCL kernels against the reference ops on the same backend (design §0 tolerances,
//! design §4.5 grid): the recurrent decode kernel, the chunked forward kernels and the gated output
//! norm.
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
    assert_close, bits, from_f64, host, matmul_tol, normal_vec, on_kernel, on_reference, randn,
    rel_err, require_dtype, rng,
};
use burn::tensor::{backend::Backend, DType, FloatDType, Tensor};
use kimi_burn::ops::kda::{
    chunk_kda, fused_recurrent_kda, naive_recurrent_kda, rms_norm_gated, KdaOptions,
};
use kimi_burn::ops::{kernel_calls, last_path, with_kernels, FusedOp, KernelPath};
use rand::rngs::StdRng;
use rand::Rng;

/// How the log decays are drawn (design §4.5).
#[derive(Clone, Copy, Debug)]
enum Gates {
    /// `logsigmoid(randn) / normaliser`.
    LogSigmoid(f64),
    /// `logsigmoid(randn)` with this fraction set to −1000.
    Extreme(f64),
    /// The safe-gate range `−5·σ(randn)`.
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
    fn new(
        r: &mut StdRng,
        [b, t, h, kd, vd]: [usize; 5],
        n: usize,
        gates: Gates,
        device: &B::Device,
    ) -> Self {
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let g: Vec<f64> = normal_vec(r, b * t * h * kd)
            .into_iter()
            .map(|x| match gates {
                Gates::LogSigmoid(norm) => sig(x).ln() / norm,
                Gates::Extreme(frac) => {
                    if r.random::<f64>() < frac {
                        -1000.0
                    } else {
                        sig(x).ln()
                    }
                }
                Gates::Safe => -5.0 * sig(x),
            })
            .collect();
        let beta: Vec<f64> = normal_vec(r, b * t * h).into_iter().map(sig).collect();
        Self {
            q: randn(r, [b, t, h, kd], 1.0, device),
            k: randn(r, [b, t, h, kd], 1.0, device),
            v: randn(r, [b, t, h, vd], 1.0, device),
            g: from_f64(&g, [b, t, h, kd], device),
            beta: from_f64(&beta, [b, t, h], device),
            h0: randn(r, [n, h, kd, vd], 1.0, device),
        }
    }

    /// The same inputs with q, k and v cast to `dtype` (storage tests round them to f16 / bf16,
    /// and widen the rounded values back for the f32 reference).
    fn with_qkv_dtype(&self, dtype: FloatDType) -> Self {
        Self {
            q: self.q.clone().cast(dtype),
            k: self.k.clone().cast(dtype),
            v: self.v.clone().cast(dtype),
            g: self.g.clone(),
            beta: self.beta.clone(),
            h0: self.h0.clone(),
        }
    }

    /// `opts` with the initial state, the final state and the in-op L2 norm (the layer's setting;
    /// it keeps random keys in the range where the delta rule is stable).
    fn opts(&self) -> KdaOptions<B> {
        KdaOptions::default()
            .with_initial_state(self.h0.clone())
            .with_final_state(true)
            .with_qk_l2norm(true)
    }
}

/// The naive recurrence on the CPU (ndarray): the ground truth. (`naive_recurrent_kda` on wgpu
/// itself disagrees with ndarray when `B > 1` and `H > 1`, a Burn wgpu quirk with broadcasts over
/// swapped size-1 dims, so it is not used as the reference here.)
fn naive_cpu(x: &Inputs<Gpu>, opts: KdaOptions<Gpu>) -> (Tensor<Gpu, 4>, Tensor<Gpu, 4>) {
    use crate::common::Cpu;
    let device = Default::default();
    let cpu4 = |t: Tensor<Gpu, 4>| Tensor::<Cpu, 4>::from_data(t.into_data(), &device);
    let gpu4 = |t: Tensor<Cpu, 4>| Tensor::<Gpu, 4>::from_data(t.into_data(), &Default::default());
    let mut o = KdaOptions::<Cpu>::default()
        .with_final_state(true)
        .with_qk_l2norm(opts.use_qk_l2norm)
        .with_chunk_size(opts.chunk_size);
    if let Some(s) = opts.initial_state {
        o = o.with_initial_state(cpu4(s));
    }
    if let Some(cu) = opts.cu_seqlens {
        o = o.with_cu_seqlens(cu);
    }
    let (out, s) = naive_recurrent_kda(
        cpu4(x.q.clone()),
        cpu4(x.k.clone()),
        cpu4(x.v.clone()),
        cpu4(x.g.clone()),
        Tensor::<Cpu, 3>::from_data(x.beta.clone().into_data(), &device),
        o,
    );
    (gpu4(out), gpu4(s.expect("final state requested")))
}

type Op<B> = fn(
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 4>,
    Tensor<B, 3>,
    KdaOptions<B>,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>);

fn run<B: Backend>(op: Op<B>, x: &Inputs<B>, opts: KdaOptions<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let (o, s) = op(
        x.q.clone(),
        x.k.clone(),
        x.v.clone(),
        x.g.clone(),
        x.beta.clone(),
        opts,
    );
    (o, s.expect("final state requested"))
}

mod recurrent {
    use super::*;

    /// A sequence long enough that one unit would run past the software rasteriser's
    /// per-invocation loop limit (65 535 iterations: ~250 tokens at K = 128) in a single launch:
    /// the host must split it into windows of tokens.
    #[test]
    fn long_sequence_in_windows() {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(14), [1, 600, 2, 128, 32], 1, Gates::Safe, &device);
        let (o_ref, s_ref) = naive_cpu(&x, x.opts());
        let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &x, x.opts())
        });
        assert_close("long o", &host(o_ref), &host(o), 1e-5);
        assert_close("long S_T", &host(s_ref), &host(s), 1e-5);
    }

    /// The recurrent kernel against the naive recurrence: T not a multiple of anything, K and V
    /// in {32, 60, 64, 128}, every gate law of design §4.5, random initial state.
    #[test]
    fn matches_naive_on_the_spec_grid() {
        let device = Default::default();
        let cases = [
            ([2, 7, 2, 32, 60], Gates::LogSigmoid(1.0)),
            ([1, 9, 3, 60, 32], Gates::LogSigmoid(0.1)),
            ([1, 5, 1, 128, 64], Gates::LogSigmoid(10.0)),
            ([2, 3, 2, 64, 128], Gates::Extreme(0.2)),
            ([1, 6, 2, 60, 60], Gates::Safe),
        ];
        for (i, (dims, gates)) in cases.into_iter().enumerate() {
            let x = Inputs::<Gpu>::new(&mut rng(100 + i as u64), dims, dims[0], gates, &device);
            let (o_ref, s_ref) = naive_cpu(&x, x.opts());
            let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
                run(fused_recurrent_kda, &x, x.opts())
            });
            let what = format!("{dims:?} {gates:?}");
            assert_close(&format!("o {what}"), &host(o_ref), &host(o), 1e-5);
            assert_close(&format!("S_T {what}"), &host(s_ref), &host(s), 1e-5);
        }
    }

    /// Packed sequences of lengths 1, 15, 4 with per-sequence initial and final states.
    #[test]
    fn packed_sequences() {
        let device = Default::default();
        let cu = vec![0, 1, 16, 20];
        let x = Inputs::<Gpu>::new(
            &mut rng(7),
            [1, 20, 2, 32, 48],
            3,
            Gates::Extreme(0.1),
            &device,
        );
        let opts = || x.opts().with_cu_seqlens(cu.clone());
        let (o_ref, s_ref) = naive_cpu(&x, opts());
        let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &x, opts())
        });
        assert_close("packed o", &host(o_ref), &host(o), 1e-5);
        assert_close("packed S_T", &host(s_ref), &host(s), 1e-5);
    }

    /// Prefill by the chunked kernels, then decode token by token with the recurrent kernel,
    /// equals one pass of the naive recurrence over the whole sequence (design §4.4).
    #[test]
    fn prefill_then_decode_equals_one_pass() {
        let device = Default::default();
        let (t1, t2) = (70, 3);
        let x = Inputs::<Gpu>::new(
            &mut rng(9),
            [2, t1 + t2, 2, 32, 32],
            2,
            Gates::Safe,
            &device,
        );
        let whole = naive_cpu(&x, x.opts());
        let part = |t: &Tensor<Gpu, 4>, a: usize, n: usize| t.clone().narrow(1, a, n);
        let (o1, mut s) = on_kernel(FusedOp::KdaChunk, 1, || {
            chunk_kda(
                part(&x.q, 0, t1),
                part(&x.k, 0, t1),
                part(&x.v, 0, t1),
                part(&x.g, 0, t1),
                x.beta.clone().narrow(1, 0, t1),
                x.opts(),
            )
        });
        let mut outs = vec![o1];
        for t in t1..t1 + t2 {
            let opts = KdaOptions::default()
                .with_initial_state(s.expect("state"))
                .with_final_state(true)
                .with_qk_l2norm(true);
            let (o, s_next) = on_kernel(FusedOp::KdaRecurrent, 1, || {
                fused_recurrent_kda(
                    part(&x.q, t, 1),
                    part(&x.k, t, 1),
                    part(&x.v, t, 1),
                    part(&x.g, t, 1),
                    x.beta.clone().narrow(1, t, 1),
                    opts,
                )
            });
            outs.push(o);
            s = s_next;
        }
        let o = Tensor::cat(outs, 1);
        assert_close("decoded o", &host(whole.0), &host(o), 1e-5);
        assert_close("decoded S_T", &host(whole.1), &host(s.unwrap()), 1e-5);
    }

    /// The caller's initial state is not modified by the in-place update.
    #[test]
    fn initial_state_is_not_overwritten() {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(3), [1, 4, 1, 32, 32], 1, Gates::Safe, &device);
        let before = host(x.h0.clone());
        on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &x, x.opts())
        });
        assert_eq!(before, host(x.h0.clone()));
    }

    /// Same input twice: bit-identical output and state.
    #[test]
    fn repeatable_bit_for_bit() {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(
            &mut rng(5),
            [2, 6, 2, 60, 64],
            2,
            Gates::Extreme(0.1),
            &device,
        );
        let go = || {
            let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
                run(fused_recurrent_kda, &x, x.opts())
            });
            (bits(o), bits(s))
        };
        assert_eq!(go(), go());
    }

    /// Inputs tracked by autodiff take the reference path (the kernel has no backward) and get
    /// their gradients; untracked autodiff inputs take the kernel.
    #[test]
    fn tracked_inputs_take_the_reference_path() {
        let device = Default::default();
        let x = Inputs::<GpuAd>::new(&mut rng(4), [1, 3, 1, 32, 32], 1, Gates::Safe, &device);
        let q = x.q.clone().require_grad();
        let (o, _) = with_kernels(true, || {
            fused_recurrent_kda(
                q.clone(),
                x.k.clone(),
                x.v.clone(),
                x.g.clone(),
                x.beta.clone(),
                x.opts(),
            )
        });
        assert_eq!(
            last_path(FusedOp::KdaRecurrent),
            Some(KernelPath::Reference)
        );
        let grads = o.sum().backward();
        assert!(q.grad(&grads).is_some());
        on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &x, x.opts())
        });
    }

    /// f16 / bf16 inputs (widened to f32 by the op) against the f32 reference of the rounded
    /// inputs within the half tolerance; the output comes back in the input dtype.
    fn half_storage_in(name: &str, dtype: DType, fdtype: FloatDType) {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(6), [1, 5, 2, 64, 64], 1, Gates::Safe, &device);
        require_dtype::<Gpu>(&device, dtype);
        let half = x.with_qkv_dtype(fdtype);
        let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &half, half.opts())
        });
        assert_eq!(o.dtype(), dtype, "{name} output dtype");
        let widened = half.with_qkv_dtype(FloatDType::F32);
        let (o_ref, s_ref) = naive_cpu(&widened, widened.opts());
        assert_close(&format!("{name} o"), &host(o_ref), &host(o), 5e-3);
        assert_close(&format!("{name} S_T"), &host(s_ref), &host(s), 5e-3);
    }

    crate::common::half_storage_tests!(half_storage_f16, half_storage_bf16, half_storage_in);
}

mod chunked {
    use super::*;

    /// A sequence long enough that one unit of the sequential state pass would run past the
    /// software rasteriser's per-invocation loop limit (65 535 iterations: ~2300 tokens at
    /// K = 128) in a single launch: the host must split it into windows.
    #[test]
    fn long_sequence_in_windows() {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(13), [1, 2600, 1, 128, 32], 1, Gates::Safe, &device);
        let (o_ref, s_ref) = on_reference(FusedOp::KdaChunk, || run(chunk_kda, &x, x.opts()));
        let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &x, x.opts()));
        let tol = matmul_tol::<Gpu>(&device, 1e-5);
        assert_close("long o", &host(o_ref), &host(o), tol);
        assert_close("long S_T", &host(s_ref), &host(s), tol);
    }

    /// The chunked kernels against the naive recurrence and against the reference `chunk_kda`
    /// (tensor ops, same backend) on the design §4.5 grid: T ∈ {1, 63, 64, 65, 160}, K and V in
    /// {32, 60, 64, 128}, every gate law (−1000 gates, safe gate), random initial state.
    #[test]
    fn matches_naive_and_reference_on_the_spec_grid() {
        let device = Default::default();
        // The reference path's matmuls run on the device (TF32 on CUDA).
        let tol = matmul_tol::<Gpu>(&device, 1e-5);
        let cases = [
            ([1, 1, 2, 32, 32], Gates::LogSigmoid(1.0), 64),
            ([2, 63, 1, 60, 32], Gates::LogSigmoid(0.1), 64),
            ([1, 64, 2, 32, 60], Gates::LogSigmoid(10.0), 64),
            ([1, 65, 1, 64, 64], Gates::Extreme(0.1), 64),
            ([1, 160, 1, 128, 32], Gates::Safe, 64),
            ([1, 100, 1, 32, 128], Gates::Extreme(0.3), 64),
            ([2, 45, 1, 32, 32], Gates::LogSigmoid(1.0), 16),
            ([1, 77, 2, 60, 60], Gates::Safe, 32),
        ];
        for (i, (dims, gates, chunk)) in cases.into_iter().enumerate() {
            let x = Inputs::<Gpu>::new(&mut rng(200 + i as u64), dims, dims[0], gates, &device);
            let opts = || x.opts().with_chunk_size(chunk);
            let (o_naive, s_naive) = naive_cpu(&x, opts());
            let (o_ref, s_ref) = on_reference(FusedOp::KdaChunk, || run(chunk_kda, &x, opts()));
            let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &x, opts()));
            let (o, s) = (host(o), host(s));
            let what = format!("{dims:?} {gates:?} C={chunk}");
            assert_close(&format!("o vs naive, {what}"), &host(o_naive), &o, 1e-5);
            assert_close(&format!("S_T vs naive, {what}"), &host(s_naive), &s, 1e-5);
            assert_close(&format!("o vs chunk_kda, {what}"), &host(o_ref), &o, tol);
            assert_close(&format!("S_T vs chunk_kda, {what}"), &host(s_ref), &s, tol);
        }
    }

    /// f64 inputs (CUDA has f64; wgpu has not) keep f64: the kernels compute in f32, so the op
    /// takes its tensor ops, whose output and final state match the naive recurrence in f64 on
    /// ndarray far below f32's rounding.
    #[cfg(feature = "cuda")]
    #[test]
    fn f64_inputs_keep_f64() {
        use crate::common::{from_f64, Cpu64};
        let device = Default::default();
        let dims = [1, 70, 2, 32, 32];
        let x = Inputs::<Gpu>::new(&mut rng(230), dims, 1, Gates::Safe, &device);
        let wide = |t: &Tensor<Gpu, 4>| t.clone().cast(FloatDType::F64);
        let x64 = Inputs {
            q: wide(&x.q),
            k: wide(&x.k),
            v: wide(&x.v),
            g: wide(&x.g),
            beta: x.beta.clone().cast(FloatDType::F64),
            h0: wide(&x.h0),
        };
        let before = kernel_calls(FusedOp::KdaChunk);
        let (o, s) = with_kernels(true, || run(chunk_kda, &x64, x64.opts()));
        assert_eq!(
            kernel_calls(FusedOp::KdaChunk),
            before,
            "f64 took the kernels"
        );
        assert_eq!((o.dtype(), s.dtype()), (DType::F64, DType::F64));
        let cpu = Default::default();
        let on_cpu = |t: &Tensor<Gpu, 4>| from_f64::<Cpu64, 4>(&host(t.clone()), t.dims(), &cpu);
        let (o_naive, s_naive) = naive_recurrent_kda(
            on_cpu(&x.q),
            on_cpu(&x.k),
            on_cpu(&x.v),
            on_cpu(&x.g),
            from_f64::<Cpu64, 3>(&host(x.beta.clone()), x.beta.dims(), &cpu),
            KdaOptions::default()
                .with_initial_state(on_cpu(&x.h0))
                .with_final_state(true)
                .with_qk_l2norm(true),
        );
        let s_naive = s_naive.expect("final state requested");
        assert!(rel_err(&host(o_naive), &host(o)) < 1e-10, "o");
        assert!(rel_err(&host(s_naive), &host(s)) < 1e-10, "S_T");
    }

    /// Packed sequences of lengths 1, 15, 63, 64, 65, 130 against per-sequence naive runs (design
    /// §4.4), per-sequence initial and final states.
    #[test]
    fn packed_sequences() {
        let device = Default::default();
        let lens = [1usize, 15, 63, 64, 65, 130];
        let mut cu = vec![0];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        let total = *cu.last().unwrap();
        let x = Inputs::<Gpu>::new(
            &mut rng(8),
            [1, total, 1, 32, 32],
            lens.len(),
            Gates::Extreme(0.05),
            &device,
        );
        let opts = || x.opts().with_cu_seqlens(cu.clone());
        let (o_ref, s_ref) = naive_cpu(&x, opts());
        let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &x, opts()));
        assert_close("packed o", &host(o_ref), &host(o), 1e-5);
        assert_close("packed S_T", &host(s_ref), &host(s), 1e-5);
    }

    /// Same input twice: bit-identical output and state.
    #[test]
    fn repeatable_bit_for_bit() {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(
            &mut rng(10),
            [1, 150, 2, 64, 60],
            1,
            Gates::Extreme(0.1),
            &device,
        );
        let go = || {
            let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &x, x.opts()));
            (bits(o), bits(s))
        };
        assert_eq!(go(), go());
    }

    /// `dq, dk, dv, dg, dβ, dS_0` of `Σ o ⊙ R_o + Σ S_T ⊙ R_s` (random weights) with the kernels
    /// on or off. With them on, the fused backward must have run.
    fn grads(
        x: &Inputs<GpuAd>,
        opts: impl Fn() -> KdaOptions<GpuAd>,
        kernel: bool,
    ) -> Vec<Vec<f64>> {
        let device = x.q.device();
        let mut r = rng(99);
        let leaves = [
            x.q.clone().require_grad(),
            x.k.clone().require_grad(),
            x.v.clone().require_grad(),
            x.g.clone().require_grad(),
        ];
        let beta = x.beta.clone().require_grad();
        let h0 = x.h0.clone().require_grad();
        let before = kernel_calls(FusedOp::KdaChunkBackward);
        let (o, s) = with_kernels(kernel, || {
            chunk_kda(
                leaves[0].clone(),
                leaves[1].clone(),
                leaves[2].clone(),
                leaves[3].clone(),
                beta.clone(),
                opts().with_initial_state(h0.clone()),
            )
        });
        let s = s.expect("final state requested");
        let w_o: Tensor<GpuAd, 4> = randn(&mut r, o.dims(), 1.0, &device);
        let w_s: Tensor<GpuAd, 4> = randn(&mut r, s.dims(), 1.0, &device);
        // In f32: `o` comes back in the dtype of `q` (f16 / bf16 in the half-storage test).
        let loss = o.cast(FloatDType::F32).mul(w_o).sum().add(s.mul(w_s).sum());
        let g = with_kernels(kernel, || loss.backward());
        let ran = kernel_calls(FusedOp::KdaChunkBackward) - before;
        assert_eq!(
            ran > 0,
            kernel,
            "fused backward ran {ran} times, kernels {kernel}"
        );
        let mut out: Vec<Vec<f64>> = leaves
            .iter()
            .map(|t| host(t.grad(&g).expect("gradient")))
            .collect();
        out.push(host(beta.grad(&g).expect("dβ")));
        out.push(host(h0.grad(&g).expect("dS_0")));
        out
    }

    const GRAD_NAMES: [&str; 6] = ["dq", "dk", "dv", "dg", "dβ", "dS_0"];

    /// The fused backward against the autodiff of the reference `chunk_kda` (tensor ops, same
    /// backend) on the design §4.5 grid, with the in-op L2 norm of q and k in the graph.
    #[test]
    fn gradients_match_reference_on_the_spec_grid() {
        let device = Default::default();
        let cases = [
            ([1, 1, 2, 32, 32], Gates::LogSigmoid(1.0), 64),
            ([2, 63, 1, 60, 32], Gates::LogSigmoid(0.1), 64),
            ([1, 64, 2, 32, 60], Gates::LogSigmoid(10.0), 64),
            ([1, 65, 1, 64, 64], Gates::Extreme(0.1), 64),
            ([1, 160, 1, 128, 32], Gates::Safe, 64),
            ([1, 100, 1, 32, 128], Gates::Extreme(0.3), 64),
            ([2, 45, 1, 32, 32], Gates::LogSigmoid(1.0), 16),
            ([1, 77, 2, 60, 60], Gates::Safe, 32),
        ];
        // The reference path's matmuls run on the device (TF32 on CUDA).
        let tol = matmul_tol::<GpuAd>(&device, 1e-5);
        for (i, (dims, gates, chunk)) in cases.into_iter().enumerate() {
            let x = Inputs::<GpuAd>::new(&mut rng(300 + i as u64), dims, dims[0], gates, &device);
            let opts = || x.opts().with_chunk_size(chunk);
            let reference = grads(&x, opts, false);
            let kernel = grads(&x, opts, true);
            for ((name, r), k) in GRAD_NAMES.iter().zip(&reference).zip(&kernel) {
                eprintln!("{dims:?} {gates:?} C={chunk} {name}: {:.2e}", rel_err(r, k));
                assert_close(&format!("{name}, {dims:?} {gates:?} C={chunk}"), r, k, tol);
            }
        }
    }

    /// More sequence·heads than one dimension of a launch grid holds (65 535): the sequential
    /// passes and the solves spread their cubes over the whole grid. Forward against the naive
    /// recurrence; the backward against the same kernels run on slices of 64 heads.
    #[test]
    fn more_sequence_heads_than_a_grid_dimension() {
        let device = Default::default();
        let dims = [1, 3, 66_000, 4, 4];
        let x = Inputs::<Gpu>::new(&mut rng(23), dims, 1, Gates::Safe, &device);
        let opts = || x.opts().with_chunk_size(16);
        let (o_ref, s_ref) = naive_cpu(&x, opts());
        let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &x, opts()));
        assert_close("chunked o", &host(o_ref.clone()), &host(o), 1e-5);
        assert_close("chunked S_T", &host(s_ref.clone()), &host(s), 1e-5);
        let (o, s) = on_kernel(FusedOp::KdaRecurrent, 1, || {
            run(fused_recurrent_kda, &x, x.opts())
        });
        assert_close("recurrent o", &host(o_ref), &host(o), 1e-5);
        assert_close("recurrent S_T", &host(s_ref), &host(s), 1e-5);
        // Backward: the same kernels on a few heads at a time (which fit in one grid dimension)
        // give the same gradients, head for head.
        let xa = Inputs::<GpuAd>::new(&mut rng(23), dims, 1, Gates::Safe, &device);
        let w_o: Tensor<GpuAd, 4> = randn(&mut rng(24), [1, 3, 66_000, 4], 1.0, &device);
        let w_s: Tensor<GpuAd, 4> = randn(&mut rng(25), [1, 66_000, 4, 4], 1.0, &device);
        let heads =
            |t: &Tensor<GpuAd, 4>, dim: usize, a: usize, n: usize| t.clone().narrow(dim, a, n);
        let part = |a: usize, n: usize| {
            let leaves = [
                heads(&xa.q, 2, a, n).require_grad(),
                heads(&xa.k, 2, a, n).require_grad(),
                heads(&xa.v, 2, a, n).require_grad(),
                heads(&xa.g, 2, a, n).require_grad(),
            ];
            let beta = xa.beta.clone().narrow(2, a, n).require_grad();
            let h0 = heads(&xa.h0, 1, a, n).require_grad();
            let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || {
                chunk_kda(
                    leaves[0].clone(),
                    leaves[1].clone(),
                    leaves[2].clone(),
                    leaves[3].clone(),
                    beta.clone(),
                    KdaOptions::default()
                        .with_initial_state(h0.clone())
                        .with_final_state(true)
                        .with_qk_l2norm(true)
                        .with_chunk_size(16),
                )
            });
            let loss = o
                .mul(heads(&w_o, 2, a, n))
                .sum()
                .add(s.unwrap().mul(heads(&w_s, 1, a, n)).sum());
            let g = loss.backward();
            let mut out: Vec<Tensor<GpuAd, 4>> = leaves
                .iter()
                .map(|t| Tensor::from_inner(t.grad(&g).unwrap()))
                .collect();
            out.push(Tensor::from_inner(beta.grad(&g).unwrap()).unsqueeze_dim(3));
            out.push(Tensor::from_inner(h0.grad(&g).unwrap()));
            out
        };
        let whole = part(0, 66_000);
        // The first heads, the middle ones and the last ones: where the whole run's cubes spill
        // into the grid's second dimension (CubeCL spreads 66 000 cubes as 33 000 × 2 under a
        // limit of 65 535, so the middle slice straddles the two rows). Heads are independent:
        // a slice's gradients are the whole run's gradients of those heads.
        for start in [0, 32_968, 65_936] {
            let slice = part(start, 64);
            for (i, name) in GRAD_NAMES.iter().enumerate() {
                let dim = if i == 5 { 1 } else { 2 };
                assert_close(
                    &format!("many heads {name}, heads {start}.."),
                    &host(slice[i].clone()),
                    &host(whole[i].clone().narrow(dim, start, 64)),
                    1e-6,
                );
            }
        }
    }

    /// The fused backward on packed sequences against the reference autodiff.
    #[test]
    fn packed_gradients() {
        let device = Default::default();
        let lens = [1usize, 15, 63, 64, 65, 130];
        let mut cu = vec![0];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        let total = *cu.last().unwrap();
        let x = Inputs::<GpuAd>::new(
            &mut rng(15),
            [1, total, 1, 32, 32],
            lens.len(),
            Gates::Extreme(0.05),
            &device,
        );
        let opts = || x.opts().with_cu_seqlens(cu.clone());
        let reference = grads(&x, opts, false);
        let kernel = grads(&x, opts, true);
        for ((name, r), k) in GRAD_NAMES.iter().zip(&reference).zip(&kernel) {
            assert_close(
                &format!("packed {name}"),
                r,
                k,
                matmul_tol::<GpuAd>(&device, 1e-5),
            );
        }
        assert!(
            kernel == grads(&x, opts, true),
            "backward not bit-for-bit repeatable"
        );
    }

    /// Past the software rasteriser's loop limit in one launch (see `long_sequence_in_windows`),
    /// the reverse state pass must run in windows too.
    #[test]
    fn long_sequence_gradients() {
        let device = Default::default();
        let x = Inputs::<GpuAd>::new(&mut rng(16), [1, 2600, 1, 128, 16], 1, Gates::Safe, &device);
        let reference = grads(&x, || x.opts(), false);
        let kernel = grads(&x, || x.opts(), true);
        for ((name, r), k) in GRAD_NAMES.iter().zip(&reference).zip(&kernel) {
            assert_close(
                &format!("long {name}"),
                r,
                k,
                matmul_tol::<GpuAd>(&device, 1e-5),
            );
        }
    }

    /// The backward from the within-chunk work the forward kept equals, bit for bit, the backward
    /// that recomputes it (what `Autodiff` does under `BalancedCheckpointing`).
    #[test]
    fn kept_within_chunk_work_equals_recomputed() {
        use kimi_burn::ops::kda::{KdaKernelInput, KdaKernels};
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(18), [2, 90, 2, 32, 48], 2, Gates::Safe, &device);
        let mut r = rng(19);
        let grad_o: Tensor<Gpu, 4> = randn(&mut r, [2, 90, 2, 48], 1.0, &device);
        let grad_s: Tensor<Gpu, 4> = randn(&mut r, [2, 2, 32, 48], 1.0, &device);
        let prim = |t: &Tensor<Gpu, 4>| t.clone().into_primitive().tensor();
        let input = || KdaKernelInput::<Gpu> {
            q: prim(&x.q),
            k: prim(&x.k),
            v: prim(&x.v),
            g: prim(&x.g),
            beta: x.beta.clone().into_primitive().tensor(),
            initial_state: Some(prim(&x.h0)),
            seq_starts: vec![0, 90, 180],
        };
        let run = |keep: bool| {
            let (_, _, saved) = Gpu::kda_chunk_forward_saving(input(), 64, keep);
            assert_eq!(saved.within.is_some(), keep, "within kept only when asked");
            let d = Gpu::kda_chunk_backward(input(), 64, saved, prim(&grad_o), Some(prim(&grad_s)));
            [d.q, d.k, d.v, d.g, d.initial_state].map(|t| {
                bits(Tensor::<Gpu, 4>::from_primitive(
                    burn::tensor::TensorPrimitive::Float(t),
                ))
            })
        };
        assert_eq!(run(true), run(false));
    }

    /// No initial state and no use of `S_T`: the backward still runs, and `q`, `k`, … get the
    /// reference gradients of `Σ o ⊙ R`.
    #[test]
    fn gradients_without_initial_state() {
        let device = Default::default();
        let x = Inputs::<GpuAd>::new(
            &mut rng(17),
            [2, 70, 2, 32, 48],
            2,
            Gates::Extreme(0.1),
            &device,
        );
        let run = |kernel: bool| {
            let leaves = [
                x.q.clone().require_grad(),
                x.k.clone().require_grad(),
                x.v.clone().require_grad(),
                x.g.clone().require_grad(),
            ];
            let beta = x.beta.clone().require_grad();
            let (o, s) = with_kernels(kernel, || {
                chunk_kda(
                    leaves[0].clone(),
                    leaves[1].clone(),
                    leaves[2].clone(),
                    leaves[3].clone(),
                    beta.clone(),
                    KdaOptions::default().with_qk_l2norm(true),
                )
            });
            assert!(s.is_none());
            let w: Tensor<GpuAd, 4> = randn(&mut rng(18), o.dims(), 1.0, &device);
            let g = with_kernels(kernel, || o.mul(w).sum().backward());
            let mut out: Vec<Vec<f64>> = leaves.iter().map(|t| host(t.grad(&g).unwrap())).collect();
            out.push(host(beta.grad(&g).unwrap()));
            out
        };
        let before = kernel_calls(FusedOp::KdaChunkBackward);
        let kernel = run(true);
        assert!(kernel_calls(FusedOp::KdaChunkBackward) > before);
        for ((name, r), k) in GRAD_NAMES.iter().zip(&run(false)).zip(&kernel) {
            assert_close(
                &format!("no S_0 {name}"),
                r,
                k,
                matmul_tol::<GpuAd>(&device, 1e-5),
            );
        }
    }

    /// The fused backward with f16 / bf16 q, k, v against the reference autodiff of the rounded
    /// inputs in f32: design §0's half tolerances (dq, dk, dv, dS_0 8e-3; dg, dβ 2e-2).
    fn half_storage_gradients_in(name: &str, dtype: DType, fdtype: FloatDType) {
        let device = Default::default();
        let x = Inputs::<GpuAd>::new(&mut rng(19), [1, 70, 2, 32, 32], 1, Gates::Safe, &device);
        require_dtype::<GpuAd>(&device, dtype);
        let half = x.with_qkv_dtype(fdtype);
        let widened = half.with_qkv_dtype(FloatDType::F32);
        let kernel = grads(&half, || half.opts(), true);
        let reference = grads(&widened, || widened.opts(), false);
        for (i, ((n, r), k)) in GRAD_NAMES.iter().zip(&reference).zip(&kernel).enumerate() {
            let tol = if i == 3 || i == 4 { 2e-2 } else { 8e-3 };
            assert_close(&format!("{name} {n}"), r, k, tol);
        }
    }

    crate::common::half_storage_tests!(
        half_storage_gradients_f16,
        half_storage_gradients_bf16,
        half_storage_gradients_in
    );

    /// f16 / bf16 q, k, v against the f32 naive recurrence of the rounded inputs (5e-3).
    fn half_storage_in(name: &str, dtype: DType, fdtype: FloatDType) {
        let device = Default::default();
        let x = Inputs::<Gpu>::new(&mut rng(12), [1, 70, 2, 32, 32], 1, Gates::Safe, &device);
        require_dtype::<Gpu>(&device, dtype);
        let half = x.with_qkv_dtype(fdtype);
        let (o, s) = on_kernel(FusedOp::KdaChunk, 1, || run(chunk_kda, &half, half.opts()));
        assert_eq!(o.dtype(), dtype, "{name} output dtype");
        let widened = half.with_qkv_dtype(FloatDType::F32);
        let (o_ref, s_ref) = naive_cpu(&widened, widened.opts());
        assert_close(&format!("{name} o"), &host(o_ref), &host(o), 5e-3);
        assert_close(&format!("{name} S_T"), &host(s_ref), &host(s), 5e-3);
    }

    crate::common::half_storage_tests!(half_storage_f16, half_storage_bf16, half_storage_in);
}

mod norm {
    use super::*;

    /// `[y, do, dz, dw]` of the gated norm on one path, with a random output gradient.
    fn run_norm(shape: [usize; 3], seed: u64, kernel: bool) -> Vec<Vec<f64>> {
        let device = Default::default();
        let mut r = rng(seed);
        let o = randn::<GpuAd, 3>(&mut r, shape, 2.0, &device).require_grad();
        let z = randn::<GpuAd, 3>(&mut r, shape, 3.0, &device).require_grad();
        let w = randn::<GpuAd, 1>(&mut r, [shape[2]], 1.0, &device).require_grad();
        let dy = randn::<GpuAd, 3>(&mut r, shape, 1.0, &device);
        let go = || {
            let y = rms_norm_gated(o.clone(), z.clone(), w.clone(), 1e-5);
            let grads = y.clone().mul(dy.clone()).sum().backward();
            vec![
                host(y),
                host(o.grad(&grads).unwrap()),
                host(z.grad(&grads).unwrap()),
                host(w.grad(&grads).unwrap()),
            ]
        };
        if kernel {
            on_kernel(FusedOp::RmsNormGatedBackward, 1, || {
                on_kernel(FusedOp::RmsNormGated, 1, go)
            })
        } else {
            on_reference(FusedOp::RmsNormGated, go)
        }
    }

    /// Forward and all three gradients against Burn's autodiff of the reference ops, for widths
    /// below, at and above the cube size.
    #[test]
    fn forward_backward_match_reference() {
        for (i, shape) in [[2, 5, 60], [1, 7, 128], [3, 2, 17], [1, 1, 256]]
            .into_iter()
            .enumerate()
        {
            let (k, rf) = (
                run_norm(shape, 50 + i as u64, true),
                run_norm(shape, 50 + i as u64, false),
            );
            for (j, name) in ["y", "do", "dz", "dw"].iter().enumerate() {
                assert_close(&format!("{name} {shape:?}"), &rf[j], &k[j], 1e-5);
            }
        }
    }

    /// Same input twice: bit-identical output and gradients.
    #[test]
    fn repeatable_bit_for_bit() {
        let a = run_norm([4, 9, 64], 60, true);
        let b = run_norm([4, 9, 64], 60, true);
        let to_bits = |v: Vec<Vec<f64>>| -> Vec<Vec<u64>> {
            v.into_iter()
                .map(|x| x.into_iter().map(f64::to_bits).collect())
                .collect()
        };
        assert_eq!(to_bits(a), to_bits(b));
    }

    /// f16 / bf16 storage within 5e-3 of the f32 reference of the rounded inputs.
    fn half_storage_in(name: &str, dtype: DType, fdtype: FloatDType) {
        let device = Default::default();
        let mut r = rng(61);
        let o = randn::<Gpu, 2>(&mut r, [9, 64], 2.0, &device);
        let z = randn::<Gpu, 2>(&mut r, [9, 64], 3.0, &device);
        let w = randn::<Gpu, 1>(&mut r, [64], 1.0, &device);
        require_dtype::<Gpu>(&device, dtype);
        let (oh, zh) = (o.clone().cast(fdtype), z.clone().cast(fdtype));
        let y = on_kernel(FusedOp::RmsNormGated, 1, || {
            rms_norm_gated(oh.clone(), zh.clone(), w.clone(), 1e-5)
        });
        assert_eq!(y.dtype(), dtype, "{name} output dtype");
        let y_ref = on_reference(FusedOp::RmsNormGated, || {
            rms_norm_gated(
                oh.clone().cast(FloatDType::F32),
                zh.clone().cast(FloatDType::F32),
                w.clone(),
                1e-5,
            )
        });
        assert_close(&format!("{name} y"), &host(y_ref), &host(y), 5e-3);
    }

    crate::common::half_storage_tests!(half_storage_f16, half_storage_bf16, half_storage_in);
}

mod conv {
    use super::*;
    use kimi_burn::nn::{KdaCache, KdaConfig, KimiDeltaAttention};

    /// Outputs, conv tail and state after a prefill and decode steps through the layer's cache.
    type Steps = (Vec<f64>, Vec<f64>, Vec<f64>);

    fn steps(
        layer: &KimiDeltaAttention<Gpu>,
        calls: &[(Tensor<Gpu, 3>, Option<Vec<usize>>)],
        kernel: bool,
    ) -> Steps {
        with_kernels(kernel, || {
            let mut cache = KdaCache::new();
            let outs: Vec<Tensor<Gpu, 3>> = calls
                .iter()
                .map(|(x, cu)| match cu {
                    None => layer.forward(x.clone(), Some(&mut cache)),
                    Some(cu) => layer.forward_packed(x.clone(), cu, Some(&mut cache)),
                })
                .collect();
            (
                host(Tensor::cat(outs, 1)),
                host(cache.conv.expect("conv tail")),
                host(cache.state.expect("state")),
            )
        })
    }

    /// The KDA layer on the device, a prefill shorter than the conv history and then decode
    /// steps through its cache, unpacked and packed: with the fused short convolution (and the
    /// other KDA kernels) equal to the same calls on the reference path — outputs, conv tails and
    /// states.
    #[test]
    fn layer_steps_match_reference() {
        let device = Default::default();
        for cfg in [
            KdaConfig::new(32, 2, 16),
            KdaConfig::new(24, 3, 8).with_conv_size(3),
        ] {
            <Gpu as Backend>::seed(&device, 7);
            let layer: KimiDeltaAttention<Gpu> = cfg.init(&device);
            let d = cfg.d_model;
            let mut r = rng(20);
            let x: Tensor<Gpu, 3> = randn(&mut r, [2, 9, d], 1.0, &device);
            let mut unpacked = vec![(x.clone().narrow(1, 0, 2), None)];
            unpacked.extend((2..9).map(|t| (x.clone().narrow(1, t, 1), None)));
            let xp: Tensor<Gpu, 3> = randn(&mut r, [1, 9, d], 1.0, &device);
            let next: Tensor<Gpu, 3> = randn(&mut r, [1, 3, d], 1.0, &device);
            let packed = vec![(xp, Some(vec![0, 1, 4, 9])), (next, Some(vec![0, 1, 2, 3]))];
            for (what, calls) in [("unpacked", unpacked), ("packed", packed)] {
                let before = kernel_calls(FusedOp::ShortConv);
                let kernel = steps(&layer, &calls, true);
                assert_eq!(
                    kernel_calls(FusedOp::ShortConv) - before,
                    calls.len() as u64,
                    "{what}: the fused short convolution ran for every call"
                );
                let reference = steps(&layer, &calls, false);
                let name = format!("{what} {cfg:?}");
                // The layer's projections and the reference KDA run Burn's matmuls.
                let tol = matmul_tol::<Gpu>(&device, 1e-5);
                assert_close(&format!("{name} outputs"), &reference.0, &kernel.0, tol);
                assert_close(&format!("{name} conv tail"), &reference.1, &kernel.1, 1e-6);
                assert_close(&format!("{name} state"), &reference.2, &kernel.2, tol);
            }
        }
    }
}

mod layer {
    use super::*;
    use kimi_burn::nn::{KdaCache, KdaConfig, KimiDeltaAttention};

    /// One training forward through the layer.
    type LayerCall = dyn Fn(&KimiDeltaAttention<GpuAd>) -> Tensor<GpuAd, 3>;

    /// Parameter gradients of `Σ out ⊙ R` for `out = forward(layer)`, in a fixed order.
    fn layer_grads(
        layer: &KimiDeltaAttention<GpuAd>,
        forward: &LayerCall,
        kernel: bool,
    ) -> Vec<Vec<f64>> {
        let g = with_kernels(kernel, || {
            let out = forward(layer);
            let w: Tensor<GpuAd, 3> = randn(&mut rng(21), out.dims(), 1.0, &out.device());
            out.mul(w).sum().backward()
        });
        let lin = |l: &burn::nn::Linear<GpuAd>| host(l.weight.val().grad(&g).expect("grad"));
        vec![
            lin(&layer.q_proj),
            lin(&layer.k_proj),
            lin(&layer.v_proj),
            lin(&layer.b_proj),
            lin(&layer.f_b_proj),
            lin(&layer.o_proj),
            host(layer.q_conv1d.weight.val().grad(&g).expect("conv grad")),
            host(layer.v_conv1d.weight.val().grad(&g).expect("conv grad")),
            host(layer.a_log.val().grad(&g).expect("A_log grad")),
            host(layer.dt_bias.val().grad(&g).expect("dt_bias grad")),
        ]
    }

    /// Training through the KDA layer on `Autodiff<Wgpu>`: short (20 tokens, which inference
    /// runs recurrently), long and packed inputs, and two calls through a cache (gradients flow
    /// through the carried state and conv tail) take the chunked kernels and the short convolution
    /// with their fused backward passes, and every parameter gradient matches the reference
    /// path's.
    #[test]
    fn training_gradients_match_reference() {
        let device = Default::default();
        let cfg = KdaConfig::new(32, 2, 16).with_chunk_size(16);
        <GpuAd as Backend>::seed(&device, 11);
        let layer: KimiDeltaAttention<GpuAd> = cfg.init(&device);
        let d = cfg.d_model;
        let mut r = rng(22);
        let x20: Tensor<GpuAd, 3> = randn(&mut r, [2, 20, d], 1.0, &device);
        let x70: Tensor<GpuAd, 3> = randn(&mut r, [2, 70, d], 1.0, &device);
        let xp: Tensor<GpuAd, 3> = randn(&mut r, [1, 40, d], 1.0, &device);
        let (x1, x2): (Tensor<GpuAd, 3>, Tensor<GpuAd, 3>) = (
            randn(&mut r, [2, 10, d], 1.0, &device),
            randn(&mut r, [2, 2, d], 1.0, &device),
        );
        let cases: Vec<(&str, Box<LayerCall>)> = vec![
            ("T = 20", Box::new(move |l| l.forward(x20.clone(), None))),
            ("T = 70", Box::new(move |l| l.forward(x70.clone(), None))),
            (
                "packed",
                Box::new(move |l| l.forward_packed(xp.clone(), &[0, 5, 21, 40], None)),
            ),
            (
                "cache",
                Box::new(move |l| {
                    let mut cache = KdaCache::new();
                    let a = l.forward(x1.clone(), Some(&mut cache));
                    let b = l.forward(x2.clone(), Some(&mut cache));
                    Tensor::cat(vec![a, b], 1)
                }),
            ),
        ];
        for (what, forward) in &cases {
            let (chunk, conv) = (
                kernel_calls(FusedOp::KdaChunkBackward),
                kernel_calls(FusedOp::ShortConvBackward),
            );
            let kernel = layer_grads(&layer, forward.as_ref(), true);
            assert!(
                kernel_calls(FusedOp::KdaChunkBackward) > chunk,
                "{what}: the fused chunked backward did not run"
            );
            assert!(
                kernel_calls(FusedOp::ShortConvBackward) > conv,
                "{what}: the fused convolution backward did not run"
            );
            let reference = layer_grads(&layer, forward.as_ref(), false);
            // The layer's projections and the reference KDA run Burn's matmuls.
            let tol = matmul_tol::<GpuAd>(&device, 1e-5);
            for (i, (r, k)) in reference.iter().zip(&kernel).enumerate() {
                assert_close(&format!("{what}, parameter {i}"), r, k, tol);
            }
        }
    }
}
