//! Gated NoPE MLA (design §5) and Attention Residuals (design §6) against independent references.

use crate::common::*;
use burn::module::{Module, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Tensor, TensorData};
use kimi_burn::nn::mla::AttentionKind;
use kimi_burn::nn::{GatedMla, MlaCache, MlaConfig};
use kimi_burn::KimiConfig;
use rand::rngs::StdRng;

const TOL: f64 = 1e-5;

/// Small, deliberately uneven head geometry (dn ≠ dv, dr ≠ dn).
fn small(q_lora: Option<usize>, gate: bool) -> MlaConfig {
    MlaConfig::new(24, 3)
        .with_q_lora_rank(q_lora)
        .with_kv_lora_rank(10)
        .with_qk_nope_head_dim(6)
        .with_qk_rope_head_dim(4)
        .with_v_head_dim(5)
        .with_use_output_gate(gate)
}

/// The four variants: with and without q LoRA, with and without the gate.
fn variants() -> Vec<MlaConfig> {
    let mut v = Vec::new();
    for q_lora in [None, Some(7)] {
        for gate in [false, true] {
            v.push(small(q_lora, gate));
        }
    }
    v
}

/// A layer with random norm gains too (they start at one, which would hide a missing gain).
fn layer<B: Backend>(config: &MlaConfig, rng: &mut StdRng, device: &B::Device) -> GatedMla<B> {
    let mut mla = config.init::<B>(device);
    let r = config.kv_lora_rank;
    mla.kv_a_layernorm.weight = Param::from_tensor(uniform(rng, [r], 0.5, 1.5, device));
    if let (Some(norm), Some(rank)) = (mla.q_a_layernorm.as_mut(), config.q_lora_rank) {
        norm.weight = Param::from_tensor(uniform(rng, [rank], 0.5, 1.5, device));
    }
    mla
}

fn mask<B: Backend>(pad: &[bool], shape: [usize; 2], device: &B::Device) -> Tensor<B, 2, Bool> {
    Tensor::from_data(TensorData::new(pad.to_vec(), shape), device)
}

fn rows(
    t: &[f64],
    batch: usize,
    seq: usize,
    width: usize,
    range: std::ops::Range<usize>,
) -> Vec<f64> {
    (0..batch)
        .flat_map(|b| {
            range
                .clone()
                .flat_map(move |i| (0..width).map(move |c| t[(b * seq + i) * width + c]))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Host f64 reference of the expanded layer, written from design §5 with plain loops.

fn vecmat(x: &[f64], w: &[f64], d_out: usize) -> Vec<f64> {
    let mut y = vec![0.0; d_out];
    for (i, xi) in x.iter().enumerate() {
        for (o, yo) in y.iter_mut().enumerate() {
            *yo += xi * w[i * d_out + o];
        }
    }
    y
}

fn rms(x: &[f64], gain: &[f64], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(gain).map(|(v, g)| v * inv * g).collect()
}

fn reference<B: Backend>(
    mla: &GatedMla<B>,
    config: &MlaConfig,
    x: &[f64],
    shape: [usize; 3],
    pad: &[bool],
) -> Vec<f64> {
    let [batch, seq, d] = shape;
    let (h, dn, dr, dv, r) = (
        config.num_heads,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    );
    let w = |l: &burn::nn::Linear<B>| host(l.weight.val());
    let qk = dn + dr;
    let scale = 1.0 / (qk as f64).sqrt();
    let kv_a = w(&mla.kv_a_proj_with_mqa);
    let kv_gain = host(mla.kv_a_layernorm.weight.val());
    let kv_b = w(&mla.kv_b_proj);
    let o_proj = w(&mla.o_proj);
    let query = |xi: &[f64]| match &mla.q_proj {
        Some(q) => vecmat(xi, &w(q), h * qk),
        None => {
            let rank = config.q_lora_rank.expect("q LoRA");
            let a = vecmat(xi, &w(mla.q_a_proj.as_ref().expect("q_a_proj")), rank);
            let gain = host(
                mla.q_a_layernorm
                    .as_ref()
                    .expect("q_a_layernorm")
                    .weight
                    .val(),
            );
            vecmat(
                &rms(&a, &gain, config.rms_norm_eps),
                &w(mla.q_b_proj.as_ref().expect("q_b_proj")),
                h * qk,
            )
        }
    };
    let mut out = vec![0.0; batch * seq * d];
    for b in 0..batch {
        let tok = |i: usize| &x[(b * seq + i) * d..(b * seq + i + 1) * d];
        let ckv: Vec<Vec<f64>> = (0..seq).map(|j| vecmat(tok(j), &kv_a, r + dr)).collect();
        let kv: Vec<Vec<f64>> = ckv
            .iter()
            .map(|c| {
                vecmat(
                    &rms(&c[..r], &kv_gain, config.kv_norm_eps),
                    &kv_b,
                    h * (dn + dv),
                )
            })
            .collect();
        for i in 0..seq {
            let q = query(tok(i));
            let mut o = vec![0.0; h * dv];
            for head in 0..h {
                let qh = &q[head * qk..(head + 1) * qk];
                let keys: Vec<usize> = (0..=i).filter(|&j| !pad[b * seq + j]).collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let k_nope = &kv[j][head * (dn + dv)..head * (dn + dv) + dn];
                        let k_pe = &ckv[j][r..];
                        let s: f64 = qh[..dn].iter().zip(k_nope).map(|(a, b)| a * b).sum::<f64>()
                            + qh[dn..].iter().zip(k_pe).map(|(a, b)| a * b).sum::<f64>();
                        s * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&j, ej) in keys.iter().zip(&e) {
                    let v = &kv[j][head * (dn + dv) + dn..(head + 1) * (dn + dv)];
                    for c in 0..dv {
                        o[head * dv + c] += ej / z * v[c];
                    }
                }
            }
            if let Some(g) = &mla.g_proj {
                let gate = vecmat(tok(i), &w(g), h * dv);
                for (oc, gc) in o.iter_mut().zip(gate) {
                    *oc /= 1.0 + (-gc).exp();
                }
            }
            if pad[b * seq + i] {
                o.fill(0.0);
            }
            out[(b * seq + i) * d..(b * seq + i + 1) * d].copy_from_slice(&vecmat(&o, &o_proj, d));
        }
    }
    out
}

/// The expanded forward (both attention kinds) equals the host reference, with padding.
fn expanded_matches_reference<B: AutodiffBackend>(device: &B::Device) {
    // Projections through Burn's matmul: TF32 on CUDA.
    let tol = matmul_tol::<B>(device, TOL);
    let mut rng = rng(11);
    let [batch, seq] = [2, 7];
    // Left padding in row 0, right padding in row 1.
    let pad: Vec<bool> = (0..batch * seq)
        .map(|k| (k < 2) || k >= 2 * seq - 1)
        .collect();
    for config in variants() {
        let mla = layer::<B>(&config, &mut rng, device);
        let x = randn::<B, 3>(&mut rng, [batch, seq, 24], 1.0, device);
        let expected = reference(&mla, &config, &host(x.clone()), [batch, seq, 24], &pad);
        let mut outputs = Vec::new();
        for kind in [AttentionKind::Fused, AttentionKind::Plain] {
            let mut mla = mla.clone();
            mla.attention = kind;
            let y = host(mla.forward(x.clone(), Some(mask(&pad, [batch, seq], device))));
            assert_close(&format!("{config:?} {kind:?}"), &expected, &y, tol);
            outputs.push(y);
        }
        assert_close("fused vs plain", &outputs[1], &outputs[0], tol);
        let no_pad = vec![false; batch * seq];
        let expected = reference(&mla, &config, &host(x.clone()), [batch, seq, 24], &no_pad);
        assert_close("no padding", &expected, &host(mla.forward(x, None)), tol);
    }
}
on_backends!(expanded_vs_host_reference, expanded_matches_reference);

// ---------------------------------------------------------------------------------------------

/// Prefill T1 tokens into an empty cache, then decode T2 tokens one by one: every output equals
/// the expanded forward over T1 + T2 at the same position (absorbed vs expanded form).
fn absorbed_decode_matches_expanded<B: AutodiffBackend>(device: &B::Device) {
    // Projections through Burn's matmul: TF32 on CUDA.
    let tol = matmul_tol::<B>(device, TOL);
    let mut rng = rng(12);
    let [batch, t1, t2] = [2, 5, 3];
    for config in variants() {
        let mla = layer::<B>(&config, &mut rng, device);
        let x = randn::<B, 3>(&mut rng, [batch, t1 + t2, 24], 1.0, device);
        let full = host(mla.forward(x.clone(), None));
        // Prefill in the absorbed form (forward_cached) and in the expanded form (prefill).
        for expanded_prefill in [false, true] {
            let mut cache = MlaCache::new();
            let head = x.clone().narrow(1, 0, t1);
            let prefill = match expanded_prefill {
                false => mla.forward_cached(head, None, &mut cache),
                true => mla.prefill(head, None, &mut cache),
            };
            let what = format!("{config:?}, expanded prefill {expanded_prefill}");
            assert_close(
                &format!("prefill {what}"),
                &rows(&full, batch, t1 + t2, 24, 0..t1),
                &host(prefill),
                tol,
            );
            for i in t1..t1 + t2 {
                let y = mla.forward_cached(x.clone().narrow(1, i, 1), None, &mut cache);
                assert_close(
                    &format!("decode {i} {what}"),
                    &rows(&full, batch, t1 + t2, 24, i..i + 1),
                    &host(y),
                    tol,
                );
            }
            assert_eq!(cache.len(), t1 + t2);
            let (c, k_pe) = cache.tensors().expect("filled");
            assert_eq!(c.dims(), [batch, t1 + t2, config.kv_lora_rank]);
            assert_eq!(k_pe.dims(), [batch, t1 + t2, config.qk_rope_head_dim]);
            let err = mla
                .try_prefill(x.clone(), None, &mut cache)
                .expect_err("non-empty cache")
                .to_string();
            assert!(err.contains(&format!("{}", t1 + t2)), "{err}");
        }
    }
}
on_backends!(
    absorbed_decode_vs_expanded,
    absorbed_decode_matches_expanded
);

/// Chunked prefill (several tokens into a non-empty cache) with padding kept in the cache.
fn chunked_prefill_with_padding<B: AutodiffBackend>(device: &B::Device) {
    // Projections through Burn's matmul: TF32 on CUDA.
    let tol = matmul_tol::<B>(device, TOL);
    let mut rng = rng(13);
    let [batch, seq] = [2, 9];
    let config = small(Some(7), true);
    let mla = layer::<B>(&config, &mut rng, device);
    let x = randn::<B, 3>(&mut rng, [batch, seq, 24], 1.0, device);
    let pad: Vec<bool> = (0..batch * seq).map(|k| k < 3 || k == seq + 4).collect();
    let full = host(mla.forward(x.clone(), Some(mask(&pad, [batch, seq], device))));
    let mut cache = MlaCache::new();
    let mut start = 0;
    for len in [4, 1, 3, 1] {
        let chunk_pad: Vec<bool> = (0..batch)
            .flat_map(|b| pad[b * seq + start..b * seq + start + len].to_vec())
            .collect();
        let y = mla.forward_cached(
            x.clone().narrow(1, start, len),
            Some(mask(&chunk_pad, [batch, len], device)),
            &mut cache,
        );
        assert_close(
            &format!("chunk at {start}"),
            &rows(&full, batch, seq, 24, start..start + len),
            &host(y),
            tol,
        );
        start += len;
    }
}
on_backends!(chunked_prefill_padding, chunked_prefill_with_padding);

/// NoPE: prefixing a sequence with masked padding shifts every token's position but not its
/// output, in the expanded and the cached form. NoPE also ignores the order of the earlier
/// tokens (a shift alone cannot tell it from RoPE, which is relative): reversing them leaves the
/// last token's output unchanged, and with RoPE switched on it must change (the check can fail).
fn nope_is_position_free<B: AutodiffBackend>(device: &B::Device) {
    // Projections through Burn's matmul: TF32 on CUDA.
    let tol = matmul_tol::<B>(device, TOL);
    let mut rng = rng(14);
    let [seq, prefix] = [6, 3];
    for use_nope in [true, false] {
        let config = small(Some(7), true).with_use_nope(use_nope);
        let mla = layer::<B>(&config, &mut rng, device);
        let x = randn::<B, 3>(&mut rng, [1, seq, 24], 1.0, device);
        let plain = host(mla.forward(x.clone(), None));
        let reversed = Tensor::cat(
            vec![
                x.clone().narrow(1, 0, seq - 1).flip([1]),
                x.clone().narrow(1, seq - 1, 1),
            ],
            1,
        );
        let last = rows(&plain, 1, seq, 24, seq - 1..seq);
        let last_reversed = rows(&host(mla.forward(reversed, None)), 1, seq, 24, seq - 1..seq);
        if use_nope {
            assert_close("NoPE order", &last, &last_reversed, tol);
            let junk = randn::<B, 3>(&mut rng, [1, prefix, 24], 3.0, device);
            let shifted = Tensor::cat(vec![junk, x.clone()], 1);
            let pad: Vec<bool> = (0..prefix + seq).map(|i| i < prefix).collect();
            let moved =
                host(mla.forward(shifted.clone(), Some(mask(&pad, [1, prefix + seq], device))));
            assert_close(
                "NoPE shift",
                &plain,
                &rows(&moved, 1, prefix + seq, 24, prefix..prefix + seq),
                tol,
            );
            // The same through the cache, which remembers the padding.
            let mut cache = MlaCache::new();
            let head = prefix + 2;
            mla.forward_cached(
                shifted.clone().narrow(1, 0, head),
                Some(mask(&pad[..head], [1, head], device)),
                &mut cache,
            );
            let rest = mla.forward_cached(shifted.narrow(1, head, seq - 2), None, &mut cache);
            assert_close(
                "NoPE shift, cached",
                &rows(&plain, 1, seq, 24, 2..seq),
                &host(rest),
                tol,
            );
        } else {
            assert!(
                rel_err(&last, &last_reversed) > 1e-3,
                "RoPE should see the order"
            );
            // k_pe is rotated before it is cached: the absorbed decode still equals the expanded form.
            let mut cache = MlaCache::new();
            mla.forward_cached(x.clone().narrow(1, 0, 2), None, &mut cache);
            let rest = mla.forward_cached(x.narrow(1, 2, seq - 2), None, &mut cache);
            assert_close(
                "RoPE cached",
                &rows(&plain, 1, seq, 24, 2..seq),
                &host(rest),
                tol,
            );
        }
    }
}
on_backends!(nope_position_free, nope_is_position_free);

/// Padding keys have no influence: new content at padded positions leaves the valid outputs
/// unchanged, padded outputs are zero, and a fully padded row gives zeros and finite gradients.
fn padding_has_no_influence<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(15);
    let [batch, seq] = [3, 6];
    // Row 0: padding in the middle and at the end; row 1: left padding; row 2: all padding.
    let pad: Vec<bool> = (0..batch * seq)
        .map(|k| {
            let (b, i) = (k / seq, k % seq);
            match b {
                0 => i == 2 || i == 5,
                1 => i < 2,
                _ => true,
            }
        })
        .collect();
    for kind in [AttentionKind::Fused, AttentionKind::Plain] {
        let mut mla = layer::<B>(&small(None, true), &mut rng, device);
        mla.attention = kind;
        let x = randn::<B, 3>(&mut rng, [batch, seq, 24], 1.0, device);
        let other = randn::<B, 3>(&mut rng, [batch, seq, 24], 5.0, device);
        let m3 = mask::<B>(&pad, [batch, seq], device)
            .reshape([batch, seq, 1])
            .expand([batch, seq, 24]);
        let x2 = x.clone().mask_where(m3, other);
        let x = x.require_grad();
        let y = mla.forward(x.clone(), Some(mask(&pad, [batch, seq], device)));
        let y2 = host(mla.forward(x2, Some(mask(&pad, [batch, seq], device))));
        let y_host = host(y.clone());
        assert_close(&format!("{kind:?}: padding content"), &y_host, &y2, TOL);
        let zeros = y_host
            .chunks(24)
            .zip(&pad)
            .all(|(row, &p)| !p || row.iter().all(|v| *v == 0.0));
        assert!(zeros, "{kind:?}: padded positions must output zero");
        let weights = randn::<B, 3>(&mut rng, [batch, seq, 24], 1.0, device);
        let grads = y.mul(weights).sum().backward();
        let gx = host(x.grad(&grads).expect("x grad"));
        assert!(
            gx.iter().all(|v| v.is_finite()),
            "{kind:?}: NaN in the input gradient"
        );
    }
}
on_backends!(padding_mask, padding_has_no_influence);

/// Every parameter gets a finite, non-zero gradient (both q forms, gate on).
fn all_parameters_learn<B: AutodiffBackend>(device: &B::Device) {
    let mut rng = rng(16);
    for config in [small(None, true), small(Some(7), true)] {
        let mla = layer::<B>(&config, &mut rng, device);
        let x = randn::<B, 3>(&mut rng, [2, 5, 24], 1.0, device);
        let weights = randn::<B, 3>(&mut rng, [2, 5, 24], 1.0, device);
        let grads = mla.forward(x, None).mul(weights).sum().backward();
        let mut params: Vec<(&str, Option<Tensor<B::InnerBackend, 1>>)> = vec![
            ("kv_a_layernorm", mla.kv_a_layernorm.weight.grad(&grads)),
            (
                "kv_a_proj_with_mqa",
                mla.kv_a_proj_with_mqa
                    .weight
                    .grad(&grads)
                    .map(|g| g.flatten(0, 1)),
            ),
            (
                "kv_b_proj",
                mla.kv_b_proj.weight.grad(&grads).map(|g| g.flatten(0, 1)),
            ),
            (
                "o_proj",
                mla.o_proj.weight.grad(&grads).map(|g| g.flatten(0, 1)),
            ),
        ];
        let lin = |l: &Option<burn::nn::Linear<B>>| {
            l.as_ref()
                .and_then(|l| l.weight.grad(&grads))
                .map(|g| g.flatten(0, 1))
        };
        params.push(("g_proj", lin(&mla.g_proj)));
        if config.q_lora_rank.is_some() {
            params.push(("q_a_proj", lin(&mla.q_a_proj)));
            params.push(("q_b_proj", lin(&mla.q_b_proj)));
            params.push((
                "q_a_layernorm",
                mla.q_a_layernorm
                    .as_ref()
                    .and_then(|n| n.weight.grad(&grads)),
            ));
        } else {
            params.push(("q_proj", lin(&mla.q_proj)));
        }
        for (name, g) in params {
            let g = host(g.unwrap_or_else(|| panic!("{name}: no gradient")));
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{name}: non-finite gradient"
            );
            assert!(g.iter().any(|v| *v != 0.0), "{name}: zero gradient");
        }
    }
}
on_backends!(parameter_gradients, all_parameters_learn);

#[test]
fn presets_give_the_published_mla_shapes() {
    let linear = KimiConfig::kimi_linear_48b().mla_config();
    assert_eq!(
        (linear.num_heads, linear.q_lora_rank, linear.use_output_gate),
        (32, None, false)
    );
    let k3 = KimiConfig::k3().mla_config();
    assert_eq!(
        (
            k3.num_heads,
            k3.q_lora_rank,
            k3.use_output_gate,
            k3.use_nope
        ),
        (96, Some(1536), true, true)
    );
    assert_eq!(
        (
            k3.kv_lora_rank,
            k3.qk_nope_head_dim,
            k3.qk_rope_head_dim,
            k3.v_head_dim
        ),
        (512, 128, 64, 128)
    );
    // K3 counted by hand: q LoRA, kv_a (+ norm), kv_b, o_proj, g_proj.
    let by_hand: u64 = 7168 * 1536
        + 1536
        + 1536 * 96 * 192
        + 7168 * 576
        + 512
        + 512 * 96 * 256
        + 2 * 96 * 128 * 7168;
    assert_eq!(KimiConfig::k3().mla_layer_params(), by_hand);
    let tiny = KimiConfig::tiny();
    let module = tiny.mla_config().init::<Cpu>(&Default::default());
    assert_eq!(tiny.mla_layer_params(), module.num_params() as u64);
    let mut bad = KimiConfig::tiny();
    bad.mla.qk_rope_head_dim = 0;
    let err = bad.validate().expect_err("rope 0").to_string();
    assert!(err.contains("qk_rope_head_dim"), "{err}");
}

/// The cache's buffers: appends past the capacity grow them, appends within it write in place, and
/// what comes back is exactly what was appended (and the padding given, `false` where none was).
#[test]
fn the_cache_buffers_grow_and_hold_exactly_the_appended_tokens() {
    let d = Default::default();
    let mut r = rng(90);
    let mut cache = MlaCache::<Cpu>::with_capacity(3);
    assert_eq!((cache.len(), cache.capacity()), (0, 0));
    let (mut all_c, mut all_pe, mut all_pad) = (Vec::new(), Vec::new(), Vec::new());
    for (step, t) in [2usize, 2, 1, 4].into_iter().enumerate() {
        let c = randn::<Cpu, 3>(&mut r, [2, t, 5], 1.0, &d);
        let pe = randn::<Cpu, 3>(&mut r, [2, t, 3], 1.0, &d);
        let pad = (step == 1).then(|| {
            Tensor::<Cpu, 2, Bool>::from_data(
                TensorData::new(vec![false, true, true, false], [2, t]),
                &d,
            )
        });
        all_pad.push(
            pad.clone()
                .unwrap_or_else(|| Tensor::full([2, t], false, &d)),
        );
        cache.append(c.clone(), pe.clone(), pad).unwrap();
        all_c.push(c);
        all_pe.push(pe);
        let want_capacity = [3, 6, 6, 12][step];
        assert_eq!(cache.capacity(), want_capacity, "after append {step}");
    }
    assert_eq!(cache.len(), 9);
    let (c, pe) = cache.tensors().unwrap();
    let bits = |t: Tensor<Cpu, 3>| {
        t.into_data()
            .iter::<f32>()
            .map(f32::to_bits)
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(c), bits(Tensor::cat(all_c, 1)));
    assert_eq!(bits(pe), bits(Tensor::cat(all_pe, 1)));
    let pad: Vec<bool> = cache
        .padding()
        .unwrap()
        .into_data()
        .iter::<bool>()
        .collect();
    let want: Vec<bool> = Tensor::cat(all_pad, 1).into_data().iter::<bool>().collect();
    assert_eq!(pad, want);
    // A batch or width that differs from the cached tokens' is an error, and changes nothing.
    let err = cache
        .append(
            randn::<Cpu, 3>(&mut r, [3, 1, 5], 1.0, &d),
            randn::<Cpu, 3>(&mut r, [3, 1, 3], 1.0, &d),
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("batch"), "{err}");
    assert_eq!(cache.len(), 9);
}

/// The fused causal attention kernels (CubeCL backends) against the plain tensor-op form: the
/// output and the gradients of `q`, `k` and `v`, with key padding (a query that sees no key
/// included), widths that are not multiples of a plane, more rows than a cube, f16 storage and
/// bit-identical reruns.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernel {
    use super::*;
    use crate::common::GpuAd;
    use burn::tensor::{DType, FloatDType, Int};
    use kimi_burn::ops::mla::causal_attention;
    use kimi_burn::ops::{kernel_calls, with_kernels, FusedOp};
    use kimi_burn_kernels::attention::uses_row_kernels;

    /// `[o, dq, dk, dv]` of one path (`kernel`: the fused kernels; otherwise the plain form) for
    /// `[batch, heads, t, dqk, dv]`, with a fixed random output gradient.
    fn run(
        [b, h, t, dqk, dv]: [usize; 5],
        pad: Option<&[bool]>,
        seed: u64,
        kernel: bool,
        dtype: FloatDType,
    ) -> Vec<Vec<f64>> {
        let device = Default::default();
        let mut rng = rng(seed);
        // Scores with a standard deviation of about 4: the running maximum moves often.
        let mut input = |d: usize| {
            randn::<GpuAd, 4>(&mut rng, [b, h, t, d], 2.0, &device)
                .cast(dtype)
                .require_grad()
        };
        let (q, k, v) = (input(dqk), input(dqk), input(dv));
        let weights = randn::<GpuAd, 4>(&mut rng, [b, h, t, dv], 1.0, &device);
        let padding = pad.map(|p| mask::<GpuAd>(p, [b, t], &device));
        let kind = if kernel {
            AttentionKind::Fused
        } else {
            AttentionKind::Plain
        };
        let calls = (
            kernel_calls(FusedOp::Attention),
            kernel_calls(FusedOp::AttentionBackward),
        );
        let o = with_kernels(kernel, || {
            causal_attention(q.clone(), k.clone(), v.clone(), padding, kind)
        });
        assert_eq!(o.dtype(), DType::from(dtype), "the output keeps the dtype");
        let grads = with_kernels(kernel, || {
            o.clone()
                .cast(FloatDType::F32)
                .mul(weights)
                .sum()
                .backward()
        });
        let ran = (
            kernel_calls(FusedOp::Attention) - calls.0,
            kernel_calls(FusedOp::AttentionBackward) - calls.1,
        );
        assert_eq!(
            ran,
            if kernel { (1, 1) } else { (0, 0) },
            "kernel path taken"
        );
        let grad = |x: &Tensor<GpuAd, 4>| host(x.grad(&grads).expect("input gradient"));
        vec![host(o), grad(&q), grad(&k), grad(&v)]
    }

    const NAMES: [&str; 4] = ["o", "dq", "dk", "dv"];

    #[test]
    fn matches_the_plain_form_forward_and_backward() {
        // Batch row 0 starts with two padding keys (its first two queries see nothing), row 1
        // ends with padding.
        let t = 37;
        let pad: Vec<bool> = (0..2 * t)
            .map(|i| i < 2 || (t + 30..2 * t).contains(&i))
            .collect();
        // Nine tiles of 64 rows (the tiled kernels: too long for the per-row kernels' loops):
        // padding that crosses a tile boundary in row 0, a padded first tile in row 1.
        let long = 520;
        let long_pad: Vec<bool> = (0..2 * long)
            .map(|i| (60..70).contains(&i) || (long..long + 64).contains(&i))
            .collect();
        for (shape, pad, seed, rows) in [
            ([2, 3, t, 24, 16], None, 70, true),
            ([2, 3, t, 24, 16], Some(&pad[..]), 71, true),
            ([1, 2, 70, 33, 21], None, 72, true),
            ([2, 1, long, 24, 16], Some(&long_pad[..]), 77, false),
            // Heads wider than the per-row kernels take, not multiples of 4, two query tiles.
            ([1, 2, 70, 66, 33], None, 79, false),
            // MLA's head sizes (`d_qk` = 192, `d_v` = 128): several column passes per tile.
            ([1, 1, 130, 192, 128], None, 78, false),
        ] {
            let [_, _, t, dqk, dv] = shape;
            assert_eq!(
                uses_row_kernels(t, dqk, dv),
                rows,
                "{shape:?}: the kernel set"
            );
            let kernel = run(shape, pad, seed, true, FloatDType::F32);
            let reference = run(shape, pad, seed, false, FloatDType::F32);
            for (name, (r, k)) in NAMES.iter().zip(reference.iter().zip(&kernel)) {
                assert_close(
                    &format!("{shape:?}, padding {}: {name}", pad.is_some()),
                    r,
                    k,
                    // The plain form's matmuls: TF32 on CUDA.
                    matmul_tol::<GpuAd>(&Default::default(), 1e-5),
                );
            }
        }
    }

    /// A query whose keys are all padding gets a zero output, and the padding keys get zero
    /// gradients, on the kernel path (the plain form agrees, above; this pins the values).
    #[test]
    fn queries_that_see_nothing_and_padding_keys_are_zero() {
        // Both kernel sets: heads of 8 run the per-row kernels, a key head of 72 the tiled ones.
        for dqk in [8, 72] {
            queries_that_see_nothing_at(dqk);
        }
    }

    fn queries_that_see_nothing_at(dqk: usize) {
        let [b, h, t, dv] = [1, 2, 9, 8];
        let pad: Vec<bool> = (0..t).map(|i| i < 3).collect();
        let out = run([b, h, t, dqk, dv], Some(&pad), 73, true, FloatDType::F32);
        for head in 0..h {
            for i in 0..3 {
                let row = (head * t + i) * dv;
                assert!(
                    out[0][row..row + dv].iter().all(|x| *x == 0.0),
                    "o at query {i}"
                );
                let krow = (head * t + i) * dqk;
                assert!(
                    out[2][krow..krow + dqk].iter().all(|x| *x == 0.0),
                    "dk at key {i}"
                );
                assert!(
                    out[3][row..row + dv].iter().all(|x| *x == 0.0),
                    "dv at key {i}"
                );
            }
        }
        assert!(out[0].iter().any(|x| *x != 0.0));
    }

    #[test]
    fn repeatable_bit_for_bit() {
        // The per-row kernels, then the tiled ones.
        for shape in [[2, 2, 45, 24, 16], [1, 2, 100, 72, 40]] {
            let a = run(shape, None, 74, true, FloatDType::F32);
            let b = run(shape, None, 74, true, FloatDType::F32);
            assert_eq!(a, b, "{shape:?}");
        }
    }

    /// f16 storage: f32 arithmetic inside, the output and gradients rounded to f16.
    #[test]
    fn half_storage() {
        // The per-row kernels, then the tiled ones.
        for shape in [[2, 2, 33, 24, 16], [1, 2, 70, 80, 72]] {
            let kernel = run(shape, None, 75, true, FloatDType::F16);
            let reference = run(shape, None, 75, false, FloatDType::F16);
            for (name, (r, k)) in NAMES.iter().zip(reference.iter().zip(&kernel)) {
                assert_close(&format!("f16 {shape:?}: {name}"), r, k, 5e-3);
            }
        }
    }

    /// At the longest sequence the wgpu runtime gives the kernels at MLA's heads (lavapipe stops
    /// a unit's loops silently after 65 535 iterations; the bound keeps them within half of
    /// that), the tiled kernels still match the plain form: the loop count they are sized by is
    /// no underestimate. One token more takes the other fused path on wgpu; CUDA has no limit.
    #[test]
    fn the_longest_sequence_of_the_kernels() {
        use kimi_burn::ops::mla::AttentionKernels;
        use kimi_burn_kernels::attention::{max_len_within, tiled_loops};
        use kimi_burn_kernels::kda::LOOP_BUDGET;
        type Inner = <GpuAd as burn::tensor::backend::AutodiffBackend>::InnerBackend;
        let (dqk, dv) = (192, 128);
        let longest = max_len_within(LOOP_BUDGET, dqk, dv);
        assert!(tiled_loops(longest, dqk, dv) <= LOOP_BUDGET);
        assert!(tiled_loops(longest + 1, dqk, dv) > LOOP_BUDGET);
        let device = Default::default();
        let cuda = crate::common::is_cuda::<GpuAd>(&device);
        let limit = <Inner as AttentionKernels>::attention_max_len(dqk, dv);
        assert_eq!(limit, if cuda { usize::MAX } else { longest });
        let shape = [1, 1, longest, dqk, dv];
        let kernel = run(shape, None, 80, true, FloatDType::F32);
        let reference = run(shape, None, 80, false, FloatDType::F32);
        for (name, (r, k)) in NAMES.iter().zip(reference.iter().zip(&kernel)) {
            assert_close(
                &format!("{shape:?}: {name}"),
                r,
                k,
                matmul_tol::<GpuAd>(&device, 1e-5),
            );
        }
        let mut rng = rng(81);
        let x = randn::<GpuAd, 4>(&mut rng, [1, 1, longest + 1, dqk], 1.0, &device);
        let v = randn::<GpuAd, 4>(&mut rng, [1, 1, longest + 1, dv], 1.0, &device);
        let before = kernel_calls(FusedOp::Attention);
        let o = with_kernels(true, || {
            causal_attention(x.clone(), x, v, None, AttentionKind::Fused)
        });
        assert_eq!(o.dims(), [1, 1, longest + 1, dv]);
        assert_eq!(
            kernel_calls(FusedOp::Attention) - before,
            u64::from(cuda),
            "one token past the wgpu limit: the kernels on CUDA only"
        );
    }

    /// The padding may come as any Bool tensor of the batch; a wrong shape is refused before a
    /// kernel runs.
    #[test]
    #[should_panic(expected = "key padding")]
    fn padding_of_the_wrong_shape_is_refused() {
        let device = Default::default();
        let mut rng = rng(76);
        let x = randn::<GpuAd, 4>(&mut rng, [2, 1, 5, 8], 1.0, &device);
        let pad = Tensor::<GpuAd, 2, Int>::zeros([2, 4], &device).bool();
        let _ = causal_attention(x.clone(), x.clone(), x, Some(pad), AttentionKind::Fused);
    }
}

/// The CPU host kernels of `masked_softmax` and `rotary` against their tensor-op forms (kernels
/// switched off) on `Autodiff<NdArray>`: values and input gradients, with rows partly and wholly
/// masked.
#[test]
fn mla_helpers_on_the_host_are_their_tensor_ops() {
    use kimi_burn::ops::mla::{masked_softmax, rotary};
    use kimi_burn::ops::with_kernels;
    let device = Default::default();
    let mut rng = rng(71);
    let scores = randn::<CpuAd, 4>(&mut rng, [2, 3, 5, 9], 3.0, &device).require_grad();
    let x = randn::<CpuAd, 4>(&mut rng, [2, 3, 5, 8], 1.0, &device).require_grad();
    let dout = randn::<CpuAd, 4>(&mut rng, [2, 3, 5, 9], 1.0, &device);
    let draw = randn::<CpuAd, 4>(&mut rng, [2, 3, 5, 9], 1.0, &device);
    // About a third masked; query row 1 of every head wholly masked.
    let mask = draw.lower_elem(-0.45).bool_or(
        Tensor::<CpuAd, 1, burn::tensor::Int>::arange(0..5, &device)
            .equal_elem(1)
            .reshape([1, 1, 5, 1])
            .expand([2, 3, 5, 9]),
    );
    let run = |kernels: bool| {
        with_kernels(kernels, || {
            let p = masked_softmax(scores.clone(), mask.clone());
            let y = rotary(x.clone(), 4, 10_000.0);
            let loss = p.clone().mul(dout.clone()).sum()
                + y.clone().mul(dout.clone().narrow(3, 0, 8)).sum();
            let grads = loss.backward();
            let ds = scores.grad(&grads).expect("a score gradient");
            let dx = x.grad(&grads).expect("an x gradient");
            [host(p), host(y), host(ds), host(dx)]
        })
    };
    let (ours, reference) = (run(true), run(false));
    for (i, what) in ["softmax", "rotary", "d scores", "d x"].iter().enumerate() {
        assert_close(what, &reference[i], &ours[i], 1e-6);
    }
    assert!(ours[0].iter().take(9 * 2).skip(9).all(|p| *p == 0.0));
}

/// The CPU host kernel of `causal_attention` keeps a NaN in its output where the tensor ops do,
/// also in rows with padded keys (a query whose visible scores are all NaN is not a query that
/// sees nothing), and an empty sequence gives an empty output on both paths.
#[test]
fn host_attention_keeps_nan_and_takes_empty_sequences() {
    use kimi_burn::ops::mla::causal_attention;
    use kimi_burn::ops::with_kernels;
    let device = Default::default();
    let mut rng = rng(82);
    let [b, h, t, d] = [1, 2, 8, 4];
    let mut q = host(randn::<Cpu, 4>(&mut rng, [b, h, t, d], 1.0, &device));
    // Query 5 of head 0 is NaN: every score of its row is NaN.
    q[(5 * d)..(6 * d)].fill(f64::NAN);
    let q = Tensor::<Cpu, 4>::from_data(
        TensorData::new(q.iter().map(|x| *x as f32).collect(), [b, h, t, d]),
        &device,
    );
    let k = randn::<Cpu, 4>(&mut rng, [b, h, t, d], 1.0, &device);
    let v = randn::<Cpu, 4>(&mut rng, [b, h, t, d], 1.0, &device);
    let pad: Vec<bool> = (0..t).map(|i| i == t - 1).collect();
    let run = |kernels: bool| {
        with_kernels(kernels, || {
            host(causal_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                Some(mask::<Cpu>(&pad, [b, t], &device)),
                AttentionKind::Plain,
            ))
        })
    };
    let (ours, reference) = (run(true), run(false));
    let row = &ours[5 * d..6 * d];
    assert!(row.iter().all(|x| x.is_nan()), "host kernel: {row:?}");
    assert!(reference[5 * d..6 * d].iter().all(|x| x.is_nan()));
    let finite = |o: &[f64]| o.iter().filter(|x| x.is_finite()).count();
    assert_eq!(finite(&ours), b * h * t * d - d);
    assert_eq!(finite(&reference), finite(&ours));

    let empty = Tensor::<Cpu, 4>::zeros([b, h, 0, d], &device);
    for kernels in [true, false] {
        let o = with_kernels(kernels, || {
            causal_attention(
                empty.clone(),
                empty.clone(),
                empty.clone(),
                None,
                AttentionKind::Plain,
            )
        });
        assert_eq!(o.dims(), [b, h, 0, d], "kernels {kernels}");
        // MLA's layouts: q [B, T, H, dqk], kv [B, T, H, dn + dv], k_pe [B, T, dqk − dn].
        let o = with_kernels(kernels, || {
            kimi_burn::ops::mla::mla_attention(
                Tensor::<Cpu, 4>::zeros([b, 0, h, 6], &device),
                Tensor::<Cpu, 4>::zeros([b, 0, h, 4 + 5], &device),
                Tensor::<Cpu, 3>::zeros([b, 0, 2], &device),
                4,
                None,
                AttentionKind::Plain,
            )
        });
        assert_eq!(o.dims(), [b, 0, h, 5], "MLA, kernels {kernels}");
    }
}
