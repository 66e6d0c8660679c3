//! f64 finite-difference checks of Gated MLA (design §5) and AttnRes (design §6).
//!
//! A separate test binary on purpose: Burn 0.21 keys a device's default float dtype by the
//! device type, and `NdArray<f32>` and `NdArray<f64>` share `NdArrayDevice::Cpu`. Whichever
//! backend creates a tensor first fixes the dtype for the whole process, so an f32 test in the
//! same binary would silently turn every "f64" tensor here into f32. Only `Cpu64Ad` runs here,
//! and [`f64_device`] fails loudly if that ever changes.

use crate::common::*;
use burn::module::Param;
use burn::tensor::{Bool, DType, Tensor, TensorData};
use kimi_burn::nn::mla::AttentionKind;
use kimi_burn::nn::{GatedMla, MlaConfig};
use kimi_burn::ops::attn_res::attn_res;
use rand::rngs::StdRng;
use rand::Rng;

type B = Cpu64Ad;
type Device = burn::backend::ndarray::NdArrayDevice;

fn f64_device() -> Device {
    let device = Default::default();
    let dtype = Tensor::<B, 1>::zeros([1], &device).dtype();
    assert_eq!(
        dtype,
        DType::F64,
        "the ndarray device defaults to {dtype:?}: an f32 test ran first"
    );
    device
}

fn small(q_lora: Option<usize>, gate: bool) -> MlaConfig {
    MlaConfig::new(24, 3)
        .with_q_lora_rank(q_lora)
        .with_kv_lora_rank(10)
        .with_qk_nope_head_dim(6)
        .with_qk_rope_head_dim(4)
        .with_v_head_dim(5)
        .with_use_output_gate(gate)
}

/// A layer with random norm gains (they start at one, which would hide a wrong gain gradient).
fn layer(config: &MlaConfig, rng: &mut StdRng, device: &Device) -> GatedMla<B> {
    let mut mla = config.init::<B>(device);
    mla.kv_a_layernorm.weight =
        Param::from_tensor(uniform(rng, [config.kv_lora_rank], 0.5, 1.5, device));
    if let (Some(norm), Some(rank)) = (mla.q_a_layernorm.as_mut(), config.q_lora_rank) {
        norm.weight = Param::from_tensor(uniform(rng, [rank], 0.5, 1.5, device));
    }
    mla
}

fn mask(pad: &[bool], shape: [usize; 2], device: &Device) -> Tensor<B, 2, Bool> {
    Tensor::from_data(TensorData::new(pad.to_vec(), shape), device)
}

fn exact<const D: usize>(v: &[f64], shape: [usize; D], device: &Device) -> Tensor<B, D> {
    // `common::from_f64` rounds through f32, which would swallow the finite-difference step.
    Tensor::from_data(TensorData::new(v.to_vec(), shape), device)
}

/// The whole layer's input gradient matches central finite differences in f64 (with padding,
/// both attention kinds).
#[test]
fn input_gradient_matches_finite_differences() {
    let device = f64_device();
    let mut rng = rng(17);
    let shape = [2, 4, 24];
    let pad = [false, false, true, false, true, false, false, false];
    for (config, kind) in [
        (small(Some(7), true), AttentionKind::Fused),
        (small(None, false), AttentionKind::Plain),
    ] {
        let mut mla = layer(&config, &mut rng, &device);
        mla.attention = kind;
        let x0 = host(randn::<B, 3>(&mut rng, shape, 1.0, &device));
        let w = host(randn::<B, 3>(&mut rng, shape, 1.0, &device));
        let loss = |x: Tensor<B, 3>| {
            let y = mla.forward(x, Some(mask(&pad, [2, 4], &device)));
            y.mul(exact(&w, shape, &device)).sum()
        };
        let x = exact::<3>(&x0, shape, &device).require_grad();
        let grads = loss(x.clone()).backward();
        let analytic = host(x.grad(&grads).expect("x grad"));
        let numeric = finite_diff(&x0, 1e-6, |v| host(loss(exact(v, shape, &device)))[0]);
        assert_close(&format!("{kind:?} dx"), &numeric, &analytic, 1e-6);
    }
}

/// Gradients of the op (sources, query, gain) against central finite differences in f64.
#[test]
fn attn_res_gradients_match_finite_differences() {
    let device = f64_device();
    let mut rng = rng(23);
    let (n, shape, d) = (3, [1, 2, 5], 5);
    let len = 2 * d;
    let mut x0 = Vec::new();
    for _ in 0..n {
        x0.extend(normal_vec(&mut rng, len));
    }
    x0.extend(normal_vec(&mut rng, d)); // w_proj
    x0.extend((0..d).map(|_| rng.random_range(0.5..1.5))); // w_norm
    let w = normal_vec(&mut rng, len);
    let loss = |v: &[Tensor<B, 1>]| {
        let sources: Vec<Tensor<B, 3>> = v[..n].iter().map(|s| s.clone().reshape(shape)).collect();
        let (partial, blocks) = sources.split_last().expect("sources");
        attn_res(
            partial.clone(),
            blocks,
            v[n].clone(),
            v[n + 1].clone(),
            1e-5,
        )
        .mul(exact(&w, shape, &device))
        .sum()
    };
    let split = |x: &[f64]| -> Vec<Tensor<B, 1>> {
        let mut parts: Vec<Tensor<B, 1>> = (0..n)
            .map(|i| exact(&x[i * len..(i + 1) * len], [len], &device))
            .collect();
        parts.push(exact(&x[n * len..n * len + d], [d], &device));
        parts.push(exact(&x[n * len + d..], [d], &device));
        parts
    };
    let inputs: Vec<Tensor<B, 1>> = split(&x0).into_iter().map(|t| t.require_grad()).collect();
    let grads = loss(&inputs).backward();
    let analytic: Vec<f64> = inputs
        .iter()
        .flat_map(|t| host(t.grad(&grads).expect("grad")))
        .collect();
    let numeric = finite_diff(&x0, 1e-6, |x| host(loss(&split(x)))[0]);
    assert_close("attn_res gradients", &numeric, &analytic, 1e-6);
}
