//! MX fake quantisation and packing (design §9) against values worked out by hand from the OCP
//! Microscaling v1.0 rules, and every path against every other bit for bit.

use crate::common::*;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use kimi_burn::ops::quant::{
    dequantize_mx, mx_fake_quant, mx_fake_quant_with, quantize_mx, try_mx_fake_quant, MxFormat,
    MxGradient, MxScaleRule,
};
use kimi_burn::ops::quant::{MxSpec, QatConfig};
use kimi_burn::ops::{last_path, with_kernels, FusedOp, KernelPath};
use kimi_burn::{Error, KimiConfig};
use rand::Rng;

const FORMATS: [MxFormat; 3] = [MxFormat::Fp4E2M1, MxFormat::Fp8E4M3, MxFormat::Fp8E5M2];
const RULES: [MxScaleRule; 2] = [MxScaleRule::Floor, MxScaleRule::Ceil];

/// Every finite non-negative value of a format, from the specification's tables: E2M1 listed,
/// E4M3 (bias 7, no infinities, S.1111.111 is NaN) and E5M2 (bias 15, exponent 31 reserved) from
/// their fields.
fn representable(format: MxFormat) -> Vec<f32> {
    let (ebits, mbits, bias, skip_top) = match format {
        MxFormat::Fp4E2M1 => return vec![0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
        MxFormat::Fp8E4M3 => (4, 3, 7, false),
        MxFormat::Fp8E5M2 => (5, 2, 15, true),
        _ => unreachable!(),
    };
    let mut out = Vec::new();
    for field in 0..(1 << ebits) {
        if skip_top && field == (1 << ebits) - 1 {
            continue;
        }
        for mant in 0..(1 << mbits) {
            if !skip_top && field == (1 << ebits) - 1 && mant == (1 << mbits) - 1 {
                continue; // E4M3 NaN
            }
            let m = mant as f64 / (1 << mbits) as f64;
            let v = if field == 0 {
                m * 2f64.powi(1 - bias)
            } else {
                (1.0 + m) * 2f64.powi(field - bias)
            };
            out.push(v as f32);
        }
    }
    out
}

fn max_of(format: MxFormat) -> f32 {
    *representable(format).last().unwrap()
}

fn tensor<B: Backend, const D: usize>(
    v: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(v.to_vec(), shape), device)
}

fn bits_of<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    t.into_data().iter::<f32>().map(f32::to_bits).collect()
}

#[test]
fn every_representable_value_round_trips() {
    let d = Default::default();
    for format in FORMATS {
        let values = representable(format);
        assert_eq!(
            max_of(format),
            [6.0, 448.0, 57344.0][FORMATS.iter().position(|f| *f == format).unwrap()]
        );
        // Blocks holding the format's maximum have scale 1 under both rules.
        let mut all: Vec<f32> = values.iter().flat_map(|&v| [v, -v]).collect();
        all.retain(|v| *v != 0.0 || v.is_sign_positive());
        for chunk in all.chunks(31) {
            let mut block = chunk.to_vec();
            block.push(max_of(format));
            let n = block.len();
            for rule in RULES {
                let x = tensor::<Cpu, 1>(&block, [n], &d);
                let y = mx_fake_quant(x.clone(), format, rule, 0);
                assert_eq!(bits_of(y), bits_of(x.clone()), "{format:?} {rule:?}");
                let mx = quantize_mx(x.clone(), format, rule, 0).unwrap();
                let back: Tensor<Cpu, 1> = dequantize_mx(&mx, &d).unwrap();
                assert_eq!(bits_of(back), bits_of(x), "{format:?} {rule:?} packed");
            }
        }
    }
}

/// One block of E2M1 worked by hand. Floor: amax 7 → 2^(2 − 2) = 1; ties go to the even
/// mantissa; 7 saturates to 6. Ceil: 7 / 4 = 1.75 beyond 6 / 4 → X = 2.
#[test]
fn hand_computed_e2m1_blocks() {
    let d = Default::default();
    let x = [7.0, 0.25, 0.75, 1.25, 2.5, 5.0, -3.5, 0.1];
    // Floor, X = 1: 0.25 ties 0 and 0.5 → 0; 0.75 ties 0.5 and 1 → 1; 1.25 → 1; 2.5 → 2; 5 → 4;
    // 3.5 ties 3 and 4 → 4 (each tie to the even mantissa).
    let floor = [6.0, 0.0, 1.0, 1.0, 2.0, 4.0, -4.0, 0.0];
    // Ceil, X = 2 (halves: 3.5, 0.125, 0.375, 0.625, 1.25, 2.5, −1.75, 0.05): 3.5 → 4 → 8;
    // 0.375 and 0.625 → 0.5 → 1; 1.25 → 1 → 2; 2.5 → 2 → 4; 1.75 ties 1.5 and 2 → 2 → 4.
    let ceil = [8.0, 0.0, 1.0, 1.0, 2.0, 4.0, -4.0, 0.0];
    for (rule, want) in [(MxScaleRule::Floor, floor), (MxScaleRule::Ceil, ceil)] {
        let y = mx_fake_quant(tensor::<Cpu, 1>(&x, [8], &d), MxFormat::Fp4E2M1, rule, 0);
        assert_eq!(host(y), want.map(f64::from).to_vec(), "{rule:?}");
    }
    // The floor rule clips the block's largest value by up to 25%: 7.9 → 6.
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&[7.9, 1.0], [2], &d),
        MxFormat::Fp4E2M1,
        MxScaleRule::Floor,
        0,
    );
    assert_eq!(host(y), vec![6.0, 1.0]);
    // A block of zeros keeps scale 1 and stays zero (every zero +0).
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&[0.0, -0.0], [2], &d),
        MxFormat::Fp4E2M1,
        MxScaleRule::Ceil,
        0,
    );
    assert_eq!(bits_of(y), vec![0, 0]);
}

/// FP8 subnormals, ties and saturation, worked by hand.
#[test]
fn hand_computed_fp8_blocks() {
    let d = Default::default();
    let s = 2f32.powi(-9); // E4M3's subnormal spacing (scale 1: the block holds 448)
    let x = [448.0, 3.0 * s, 0.5 * s, 1.5 * s, 460.0, -100.0];
    // 0.5·s ties 0 and s → 0 (even); 1.5·s ties s (mantissa 1) and 2s (mantissa 2) → 2s; 460 > 448
    // saturates; 100 ties 96 and 104 (step 8 in [64, 128)) → 96.
    let want = [448.0, 3.0 * s, 0.0, 2.0 * s, 448.0, -96.0];
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&x, [6], &d),
        MxFormat::Fp8E4M3,
        MxScaleRule::Floor,
        0,
    );
    assert_eq!(host(y), want.map(f64::from).to_vec());
    // E5M2: 60000 has floor(log2) = 15 = emax → scale 1, saturates to 57344 under the floor rule;
    // the ceil rule takes X = 2 (60000 / 32768 > 1.75) and 30000 → 28672 (step 4096, 30000 is
    // nearer 28672 than 32768) → 57344.
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&[60000.0], [1], &d),
        MxFormat::Fp8E5M2,
        MxScaleRule::Floor,
        0,
    );
    assert_eq!(host(y), vec![57344.0]);
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&[60000.0], [1], &d),
        MxFormat::Fp8E5M2,
        MxScaleRule::Ceil,
        0,
    );
    assert_eq!(host(y), vec![57344.0]);
}

/// A row of 40 values is a block of 32 and one of 8, each with its own scale; the axis can be
/// any dimension.
#[test]
fn the_last_partial_block_has_its_own_scale_on_any_axis() {
    let d = Default::default();
    let mut row = vec![1.0f32; 40];
    row[0] = 6.0; // first block: amax 6 → scale 1
    row[32..].fill(0.5);
    row[32] = 0.75; // second block: amax 0.75 → 2^(−1 − 2) = 1/8
    row[33] = 0.1; // 0.8 in units of 1/8 → 1 → 0.125
    let want: Vec<f64> = row
        .iter()
        .enumerate()
        .map(|(i, &v)| match i {
            33 => 0.125,
            _ => v as f64,
        })
        .collect();
    let y = mx_fake_quant(
        tensor::<Cpu, 1>(&row, [40], &d),
        MxFormat::Fp4E2M1,
        MxScaleRule::Floor,
        0,
    );
    assert_eq!(host(y), want);
    // The same values along axis 0 of a [40, 2] tensor.
    let cols: Vec<f32> = row.iter().flat_map(|&v| [v, v]).collect();
    let y = mx_fake_quant(
        tensor::<Cpu, 2>(&cols, [40, 2], &d),
        MxFormat::Fp4E2M1,
        MxScaleRule::Floor,
        0,
    );
    let y = host(y);
    for (i, w) in want.iter().enumerate() {
        assert_eq!((y[2 * i], y[2 * i + 1]), (*w, *w), "row {i}");
    }
}

/// Random inputs spanning many binades, including subnormal and huge blocks.
fn wide_random(seed: u64, n: usize) -> Vec<f32> {
    let mut r = rng(seed);
    normal_vec(&mut r, 2 * n)
        .chunks(2)
        .enumerate()
        .map(|(i, p)| {
            let exp = match i / 32 % 4 {
                0 => (p[1] * 3.0) as i32,
                1 => -120 - (p[1].abs() * 20.0) as i32,
                2 => 100 + (p[1].abs() * 20.0) as i32,
                _ => (p[1] * 40.0) as i32,
            };
            (p[0] * 2f64.powi(exp.clamp(-148, 125))) as f32
        })
        .collect()
}

/// The host loop, the tensor-op reference on ndarray and on wgpu, and the packed round trip all
/// give the same bits; the fake quantisation is idempotent.
fn check_paths_agree<B: AutodiffBackend>(device: &B::Device) {
    let cpu = Default::default();
    let v = wide_random(71, 3 * 45 * 4);
    for format in FORMATS {
        for rule in RULES {
            for axis in [0, 1] {
                let on = |d: &B::Device, kernels: bool| {
                    with_kernels(kernels, || {
                        bits_of(mx_fake_quant(
                            tensor::<B, 2>(&v, [3 * 45, 4], d),
                            format,
                            rule,
                            axis,
                        ))
                    })
                };
                let host_bits = with_kernels(true, || {
                    bits_of(mx_fake_quant(
                        tensor::<Cpu, 2>(&v, [3 * 45, 4], &cpu),
                        format,
                        rule,
                        axis,
                    ))
                });
                let what = format!("{format:?} {rule:?} axis {axis}");
                assert_eq!(
                    on(device, true),
                    host_bits,
                    "{what}: this backend's path vs the host loop"
                );
                if is_gpu::<B>() {
                    assert_eq!(
                        last_path(FusedOp::MxFakeQuant),
                        Some(KernelPath::Kernel),
                        "{what}: the kernel must run on wgpu"
                    );
                }
                assert_eq!(
                    on(device, false),
                    host_bits,
                    "{what}: the reference vs the host loop"
                );
                let x = tensor::<Cpu, 2>(&v, [3 * 45, 4], &cpu);
                let mx = quantize_mx(x, format, rule, axis).unwrap();
                let back: Tensor<Cpu, 2> = dequantize_mx(&mx, &cpu).unwrap();
                assert_eq!(bits_of(back), host_bits, "{what}: packed round trip");
                let again: Vec<f32> = host_bits.iter().map(|b| f32::from_bits(*b)).collect();
                let twice = bits_of(mx_fake_quant(
                    tensor::<Cpu, 2>(&again, [3 * 45, 4], &cpu),
                    format,
                    rule,
                    axis,
                ));
                assert_eq!(twice, host_bits, "{what}: idempotent");
            }
        }
    }
}
on_backends!(paths_agree, check_paths_agree);

/// The packed size: 4.25 bits per FP4 value (a code nibble and a scale byte per 32), 8.25 for FP8.
#[test]
fn packed_storage_has_the_mx_size() {
    let d = Default::default();
    let v = wide_random(72, 64 * 4);
    let x = tensor::<Cpu, 2>(&v, [64, 4], &d);
    let fp4 = quantize_mx(x.clone(), MxFormat::Fp4E2M1, MxScaleRule::Floor, 0).unwrap();
    assert_eq!((fp4.codes.len(), fp4.scales.len()), (128, 8));
    let fp8 = quantize_mx(x, MxFormat::Fp8E4M3, MxScaleRule::Floor, 0).unwrap();
    assert_eq!((fp8.codes.len(), fp8.scales.len()), (256, 8));
    let mut broken = fp8.clone();
    broken.scales.pop();
    let err = dequantize_mx::<Cpu, 2>(&broken, &d).unwrap_err();
    assert!(err.to_string().contains("scales"), "{err}");
}

/// Straight-through: the gradient is the upstream one; with `ZeroWhereClipped` it is zero exactly
/// where a value was clipped (E2M1 floor: 7 and −7.5 in a block whose scale is 1).
fn check_gradients<B: AutodiffBackend>(device: &B::Device) {
    let x = [7.0f32, 0.3, -7.5, 2.0, 5.0];
    let up = [0.5f32, -1.0, 2.0, 3.0, -4.0];
    for (gradient, want) in [
        (MxGradient::StraightThrough, up),
        (MxGradient::ZeroWhereClipped, [0.0, -1.0, 0.0, 3.0, -4.0]),
    ] {
        for kernels in [true, false] {
            let t = tensor::<B, 1>(&x, [5], device).require_grad();
            let grads = with_kernels(kernels, || {
                mx_fake_quant_with(
                    t.clone(),
                    MxFormat::Fp4E2M1,
                    MxScaleRule::Floor,
                    0,
                    gradient,
                )
                .mul(tensor::<B, 1>(&up, [5], device))
                .sum()
                .backward()
            });
            let g = host(t.grad(&grads).unwrap());
            assert_eq!(
                g,
                want.map(f64::from).to_vec(),
                "{gradient:?}, kernels {kernels}"
            );
        }
    }
}
on_backends!(gradients, check_gradients);

#[test]
fn non_finite_input_and_a_bad_axis_are_errors() {
    let d = Default::default();
    let x = tensor::<Cpu, 2>(&[1.0, f32::NAN, 2.0, 3.0], [2, 2], &d);
    let err = try_mx_fake_quant(x.clone(), MxFormat::Fp8E4M3, MxScaleRule::Floor, 1).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err}");
    let err = quantize_mx(x.clone(), MxFormat::Fp8E4M3, MxScaleRule::Floor, 1).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err}");
    let err = try_mx_fake_quant(x, MxFormat::Fp8E4M3, MxScaleRule::Floor, 2).unwrap_err();
    assert!(err.to_string().contains("axis"), "{err}");
}

/// Whether `B` is the wgpu test backend (where the kernels must run).
#[cfg_attr(
    not(any(feature = "wgpu", feature = "cuda")),
    allow(clippy::extra_unused_type_parameters)
)]
fn is_gpu<B: 'static>() -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        std::any::TypeId::of::<B>() == std::any::TypeId::of::<GpuAd>()
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        false
    }
}

/// The kernel on random rows of every length from 1 to 70 (full, partial and single-value blocks)
/// and with values that sit exactly on rounding ties, against the host loop, bit for bit.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn the_kernel_matches_the_host_loop_on_ties_and_ragged_rows() {
    let cpu = Default::default();
    let gpu = Default::default();
    let mut r = rng(73);
    for len in [1usize, 5, 31, 32, 33, 64, 70] {
        let rows = 6;
        let mut v = wide_random(74 + len as u64, rows * len);
        // Ties: k + 0.5 steps of the E2M1 / E4M3 grid at a block maximum of 6 or 448.
        for (i, x) in v.iter_mut().enumerate().take(rows * len / 2) {
            let tie = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.125][i % 8];
            *x = if r.random_bool(0.5) { tie } else { -tie * 64.0 };
        }
        for format in FORMATS {
            for rule in RULES {
                let want = bits_of(mx_fake_quant(
                    tensor::<Cpu, 2>(&v, [rows, len], &cpu),
                    format,
                    rule,
                    1,
                ));
                let got = with_kernels(true, || {
                    bits_of(mx_fake_quant(
                        tensor::<Gpu, 2>(&v, [rows, len], &gpu),
                        format,
                        rule,
                        1,
                    ))
                });
                assert_eq!(last_path(FusedOp::MxFakeQuant), Some(KernelPath::Kernel));
                assert_eq!(got, want, "{format:?} {rule:?} rows of {len}");
            }
        }
    }
}

/// A weight-only QAT layer is the plain layer with fake-quantised weights (blocks along each
/// matrix's input dimension), bit for bit on the CPU; and a SiTU-GLU FFN with QAT is
/// `Q(act(Q(x)·Q(W1), Q(x)·Q(W3)))·Q(W2)` spelled out with the op.
#[test]
fn qat_quantises_each_matmul_along_its_reduction_dimension() {
    use burn::module::Param;
    use kimi_burn::nn::{LatentMoeConfig, MoeLayout, SituGluConfig};
    let d = Default::default();
    let cfg = LatentMoeConfig::new(48, 6, 2, 40)
        .with_layout(MoeLayout::StableLatent { dim: 40 })
        .with_n_shared(1);
    let weights_only = QatConfig::new(Some(MxSpec::mxfp4()), None).with_shared_experts(true);
    let qat = cfg.clone().with_qat(Some(weights_only)).init::<Cpu>(&d);
    let mut plain = qat.clone();
    let fq = |p: Param<Tensor<Cpu, 2>>| {
        p.map(|w| mx_fake_quant(w, MxFormat::Fp4E2M1, MxScaleRule::Floor, 0))
    };
    // Stacked `[n, in, out]`: blocks along axis 1.
    let fq3 = |p: Param<Tensor<Cpu, 3>>| {
        p.map(|w| mx_fake_quant(w, MxFormat::Fp4E2M1, MxScaleRule::Floor, 1))
    };
    let ex = &mut plain.experts;
    ex.qat = None;
    ex.w1 = fq3(ex.w1.clone());
    ex.w3 = fq3(ex.w3.clone());
    ex.w2 = fq3(ex.w2.clone());
    for e in plain.shared.iter_mut() {
        e.qat = None;
        e.w1.weight = fq(e.w1.weight.clone());
        e.w3.weight = fq(e.w3.weight.clone());
        e.w2.weight = fq(e.w2.weight.clone());
    }
    let x = randn::<Cpu, 3>(&mut rng(75), [2, 9, 48], 1.0, &d);
    for kernels in [true, false] {
        with_kernels(kernels, || {
            let a = qat.forward(x.clone()).output;
            let b = plain.forward(x.clone()).output;
            assert_eq!(bits_of(a), bits_of(b), "weight-only QAT, kernels {kernels}");
        });
    }

    let ffn = SituGluConfig::new(40, 70)
        .with_qat(Some(QatConfig::mxfp4()))
        .init::<Cpu>(&d);
    let x = randn::<Cpu, 2>(&mut rng(76), [5, 40], 1.0, &d);
    let q8 = |t: Tensor<Cpu, 2>| mx_fake_quant(t, MxFormat::Fp8E4M3, MxScaleRule::Floor, 1);
    let q4 = |t: Tensor<Cpu, 2>| mx_fake_quant(t, MxFormat::Fp4E2M1, MxScaleRule::Floor, 0);
    let xq = q8(x.clone());
    let gate = xq.clone().matmul(q4(ffn.w1.weight.val()));
    let up = xq.matmul(q4(ffn.w3.weight.val()));
    let want = q8(ffn.activation.apply(gate, up)).matmul(q4(ffn.w2.weight.val()));
    assert!(ffn.w2.bias.is_none(), "the Kimi FFNs have no biases");
    assert_eq!(bits_of(ffn.forward(x)), bits_of(want), "SiTU-GLU with QAT");
}

/// With full QAT (MXFP4 weights, MXFP8 activations) the routed experts quantise their input and
/// their hidden activations as a standalone QAT SiTU-GLU does: the MoE equals
/// `Σ_k p_k · expert_k(x)` with each expert cut out of the stack as its own QAT FFN, on both
/// paths; dropping either activation quantisation moves the output far beyond the tolerance
/// (checked against the weight-only layer).
#[test]
fn qat_routed_experts_quantise_their_activations_like_a_qat_ffn() {
    use kimi_burn::nn::{LatentMoeConfig, MoeLayout};
    let d = Default::default();
    let (m, width, n, k) = (18, 64, 6, 2);
    let cfg = LatentMoeConfig::new(width, n, k, 40)
        .with_layout(MoeLayout::Standard)
        .with_n_shared(0);
    let full = cfg
        .clone()
        .with_qat(Some(QatConfig::mxfp4()))
        .init::<Cpu>(&d);
    let mut weights_only = full.clone();
    weights_only.experts.qat = Some(QatConfig::new(Some(MxSpec::mxfp4()), None));
    let x = randn::<Cpu, 3>(&mut rng(79), [2, 9, width], 1.0, &d);
    let flat = x.clone().reshape([m, width]);
    let routing = full
        .router
        .route(flat.clone(), &full.balance.bias_host())
        .unwrap();
    let chosen: Vec<i64> = routing.indices.into_data().iter::<i64>().collect();
    let p = host(routing.weights);
    let mut want = vec![0.0f64; m * width];
    for e in 0..n {
        let out = host(full.experts.expert(e).forward(flat.clone()));
        for (slot, _) in chosen.iter().enumerate().filter(|(_, &c)| c == e as i64) {
            let t = slot / k;
            for j in 0..width {
                want[t * width + j] += p[slot] * out[t * width + j];
            }
        }
    }
    for kernels in [true, false] {
        let got = with_kernels(kernels, || host(full.forward(x.clone()).output));
        assert_close(
            &format!("full QAT MoE, kernels {kernels}"),
            &want,
            &got,
            1e-5,
        );
    }
    let without = host(weights_only.forward(x).output);
    let gap = want
        .iter()
        .zip(&without)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    assert!(
        gap > 1e-3 * scale,
        "activation quantisation changes the output: {gap} of {scale}"
    );
}

/// `with_quantized_weights` quantises once what QAT quantised on every forward: the same logits
/// bit for bit (ndarray and wgpu), and a forward then runs only the activations' fake
/// quantisations: three fewer per QAT FFN (its `W1`, `W3`, `W2`), counted on wgpu where each is
/// a kernel launch. Applying it twice changes nothing more.
#[test]
fn quantized_weights_give_the_same_logits_without_requantising() {
    use burn::tensor::Int;
    use kimi_burn::model::{Ffn, KimiForCausalLM};
    fn logits<B: Backend>(model: &KimiForCausalLM<B>, device: &B::Device) -> (Vec<u32>, u64) {
        let ids: Vec<i64> = (0..14).map(|i| (i * 5 % 64) as i64).collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, 7]), device);
        let before = kimi_burn::ops::kernel_calls(FusedOp::MxFakeQuant);
        let bits = bits_of(model.forward(ids));
        (
            bits,
            kimi_burn::ops::kernel_calls(FusedOp::MxFakeQuant) - before,
        )
    }
    fn check<B: Backend>(kernel_launches: bool) {
        let device = Default::default();
        let mut config = crate::model::small();
        config.moe.qat = Some(
            QatConfig::mxfp4()
                .with_shared_experts(true)
                .with_dense_ffn(true),
        );
        let model = config.init::<B>(&device);
        let ffns: u64 = model
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Dense(_) => 1,
                Ffn::Moe(m) => 1 + u64::from(m.shared.is_some()),
            })
            .sum();
        let (want, calls) = logits(&model, &device);
        let once = model.with_quantized_weights();
        let (got, calls_once) = logits(&once, &device);
        assert_eq!(want, got, "the same logits");
        let (again, calls_twice) = logits(&once.with_quantized_weights(), &device);
        assert_eq!(want, again, "the same logits, quantised twice");
        if kernel_launches {
            assert_eq!(calls - calls_once, 3 * ffns, "{calls} vs {calls_once}");
            assert_eq!(calls_once, calls_twice);
        }
    }
    check::<Cpu>(false);
    #[cfg(feature = "wgpu")]
    check::<Gpu>(true);
}

/// The whole small model with MXFP4 weights everywhere (routed and shared experts, dense FFNs) on
/// wgpu, with the kernels and on the reference, against ndarray: logits and every gradient. Both
/// backends load the same weights, so their quantised values agree to the bit and the model keeps
/// the unquantised model's tolerance.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn the_weight_quantised_model_on_wgpu_matches_ndarray_on_both_paths() {
    let mut config = crate::model::small();
    config.moe.qat = Some(
        QatConfig::new(Some(MxSpec::mxfp4()), None)
            .with_shared_experts(true)
            .with_dense_ffn(true),
    );
    crate::model::check_wgpu_matches_ndarray(&config, "qat-weights", 1e-4);
}

/// K3's whole recipe (MXFP8 activations too) on the same model. Activations differ between the
/// backends by f32 rounding, and a difference that crosses an E4M3 rounding boundary moves that
/// element by a whole step (up to 1/8 of its block's scale), so a few such flips are expected:
/// one flip among the thousands of hidden values gives a relative error of order 1e-4 (seen:
/// 1.5e-4 on a shared-expert gradient). The tolerance admits a handful of flips and still fails
/// on any systematic difference (a wrong axis, block or scale is an error of order 1e-1).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn the_qat_model_on_wgpu_matches_ndarray_on_both_paths() {
    let mut config = crate::model::small();
    config.moe.qat = Some(
        QatConfig::mxfp4()
            .with_shared_experts(true)
            .with_dense_ffn(true),
    );
    crate::model::check_wgpu_matches_ndarray(&config, "qat", 2e-3);
}

/// The QAT config round-trips through `config.json` as `quantization_config`; a Hugging Face MXFP4
/// config (`quant_method` only) means MXFP4 weights; other methods and formats are errors.
#[test]
fn qat_round_trips_through_the_hf_config() {
    let mut config = KimiConfig::tiny();
    for qat in [
        QatConfig::mxfp4(),
        QatConfig::new(
            Some(MxSpec::new(MxFormat::Fp8E5M2, MxScaleRule::Ceil)),
            None,
        )
        .with_dense_ffn(true),
        QatConfig::new(None, Some(MxSpec::mxfp8())).with_shared_experts(true),
    ] {
        config.moe.qat = Some(qat);
        let json = config.to_hf_json();
        assert_eq!(KimiConfig::from_hf_json(&json).unwrap(), config, "{json}");
    }
    let mut json = KimiConfig::tiny().to_hf_json();
    assert_eq!(KimiConfig::from_hf_json(&json).unwrap().moe.qat, None);
    json["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    assert_eq!(
        KimiConfig::from_hf_json(&json).unwrap().moe.qat,
        Some(QatConfig::new(Some(MxSpec::mxfp4()), None))
    );
    // SPEC §9 calls the no-clip rule "rceil"; an explicit null is no quantisation.
    json["quantization_config"] = serde_json::json!({"quant_method": "mx", "weight_format": "e2m1",
        "weight_scale_rule": "rceil", "activation_format": null});
    assert_eq!(
        KimiConfig::from_hf_json(&json).unwrap().moe.qat,
        Some(QatConfig::new(
            Some(MxSpec::new(MxFormat::Fp4E2M1, MxScaleRule::Ceil)),
            None
        ))
    );
    json["quantization_config"] = serde_json::Value::Null;
    assert_eq!(KimiConfig::from_hf_json(&json).unwrap().moe.qat, None);
    // A null at the top does not hide one under `text_config` (K3's layout).
    let mut inner = KimiConfig::tiny();
    inner.moe.qat = Some(QatConfig::mxfp4());
    let wrapped = serde_json::json!({
        "text_config": inner.to_hf_json(),
        "quantization_config": null,
    });
    assert_eq!(
        KimiConfig::from_hf_json(&wrapped).unwrap().moe.qat,
        Some(QatConfig::mxfp4())
    );
    json["quantization_config"] = serde_json::json!({"quant_method": "gptq"});
    let err = KimiConfig::from_hf_json(&json).unwrap_err().to_string();
    assert!(
        err.contains("quantization_config.quant_method") && err.contains("gptq"),
        "{err}"
    );
    json["quantization_config"] =
        serde_json::json!({"quant_method": "mx", "weight_format": "e3m0"});
    let err = KimiConfig::from_hf_json(&json).unwrap_err().to_string();
    assert!(
        err.contains("weight_format") && err.contains("e3m0"),
        "{err}"
    );
}

/// The packed export of a QAT model: the experts' weights as MXFP4 blocks and scales in Hugging
/// Face's layout (decoded here from the E2M1 table and the E8M0 bytes, independently of the crate),
/// a file smaller than the f32 one, and loaded back the same logits bit for bit on the CPU.
#[test]
fn the_packed_export_loads_back_to_the_same_logits() {
    use burn::tensor::Int;
    use kimi_burn::model::KimiForCausalLM;
    use kimi_burn::store::SafeTensorsReader;
    let d = Default::default();
    let mut config = crate::model::small();
    config.moe.qat = Some(QatConfig::mxfp4().with_shared_experts(true));
    let model = config.init::<Cpu>(&d);
    let dir = std::env::temp_dir().join(format!("kimi-burn-mx-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (packed, plain) = (
        dir.join("packed.safetensors"),
        dir.join("plain.safetensors"),
    );
    model.save_safetensors_packed(&packed).unwrap();
    model.save_safetensors(&plain).unwrap();
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
    assert!(
        size(&packed) < size(&plain),
        "{} vs {}",
        size(&packed),
        size(&plain)
    );

    let reader = SafeTensorsReader::open(&packed).unwrap();
    let names: Vec<&str> = reader.names().collect();
    let name = "model.layers.1.block_sparse_moe.experts.0.w1.weight";
    assert!(
        !names.contains(&name) && names.contains(&"model.layers.1.block_sparse_moe.gate.weight")
    );
    assert!(names.contains(&"model.layers.1.block_sparse_moe.shared_experts.up_proj.weight_scales"));
    assert!(
        names.contains(&"model.layers.0.mlp.up_proj.weight"),
        "dense FFNs stay in f32"
    );
    assert_eq!(reader.metadata("mx_format"), Some("e2m1"));
    let (bshape, blocks) = reader.read_u8(&format!("{name}_blocks")).unwrap().unwrap();
    let (sshape, scales) = reader.read_u8(&format!("{name}_scales")).unwrap().unwrap();
    let [out, nb] = [sshape[0], sshape[1]];
    assert_eq!(bshape, [out, nb, 16]);
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let decoded: Vec<f32> = (0..out * nb * 32)
        .map(|i| {
            let byte = blocks[i / 2];
            let code = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
            let v = E2M1[(code & 7) as usize] * 2f32.powi(scales[i / 32] as i32 - 127);
            if code & 8 != 0 {
                -v
            } else {
                v
            }
        })
        .map(|v| v + 0.0)
        .collect();
    let w1 = match &model.layers[1].ffn {
        kimi_burn::model::Ffn::Moe(m) => m.experts.expert(0).w1.weight.val(),
        _ => unreachable!("layer 1 is a MoE layer"),
    };
    let want = bits_of(mx_fake_quant(
        w1.transpose(),
        MxFormat::Fp4E2M1,
        MxScaleRule::Floor,
        1,
    ));
    assert_eq!(
        decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want
    );

    let back = KimiForCausalLM::<Cpu>::from_safetensors(&config, &packed, &d).unwrap();
    let mut r = rng(77);
    let ids: Vec<i64> = (0..2 * 9).map(|_| r.random_range(0..64)).collect();
    let ids = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(ids, [2, 9]), &d);
    assert_eq!(
        bits_of(model.forward(ids.clone())),
        bits_of(back.forward(ids)),
        "logits after the packed round trip"
    );

    // A width that is not a whole number of blocks cannot be packed: the error names the weight.
    let mut odd = crate::model::small();
    odd.moe.qat = Some(QatConfig::mxfp4());
    odd.moe.layout = kimi_burn::nn::MoeLayout::StableLatent { dim: 40 };
    let err = odd
        .init::<Cpu>(&d)
        .save_safetensors_packed(dir.join("odd.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("experts.0.w1.weight") && err.contains("40"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The host loop on inputs large enough to be split over threads, along every axis of a rank-3
/// tensor (blocks strided in memory for the first two), against the tensor-op reference, bit for bit.
#[test]
fn the_threaded_host_loop_matches_the_reference_along_every_axis() {
    let d = Default::default();
    let dims = [3, 300, 80];
    let v = wide_random(78, dims.iter().product());
    for format in FORMATS {
        for axis in 0..3 {
            let run = |kernels: bool| {
                with_kernels(kernels, || {
                    bits_of(mx_fake_quant(
                        tensor::<Cpu, 3>(&v, dims, &d),
                        format,
                        MxScaleRule::Floor,
                        axis,
                    ))
                })
            };
            assert_eq!(run(true), run(false), "{format:?} axis {axis}");
        }
    }
}
