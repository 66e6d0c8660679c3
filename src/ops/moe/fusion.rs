//! [`MoeKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn::tensor::backend::Backend;
use burn::tensor::ops::IntTensor;
use burn::tensor::{DType, Element};
use burn_fusion::{Fusion, FusionBackend};

use crate::nn::balance::HistogramSpec;
use crate::ops::backend::fusion::{call, dims, outs, Args, Ft, Inputs, Out, Prim};
use crate::ops::moe::{GluActivation, MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
use crate::ops::quant::MxSpec;

impl<B: FusionBackend + MoeKernels> MoeKernels for Fusion<B> {
    fn situ_glu_forward(
        gate: Ft<B>,
        up: Ft<B>,
        weight: Option<Ft<B>>,
        activation: GluActivation,
    ) -> Ft<B> {
        let weighted = weight.is_some();
        let out = Out::like(&gate);
        let inputs = Inputs::new().float(gate).float(up).float_opt(weight);
        let [y] = outs(call::<B>(
            "kimi_burn::situ_glu_forward",
            inputs,
            vec![out],
            move |mut a| {
                let (gate, up) = (a.float(), a.float());
                let weight = a.float_if(weighted);
                vec![Prim::Float(B::situ_glu_forward(
                    gate, up, weight, activation,
                ))]
            },
        ));
        y
    }

    fn situ_glu_backward(
        gate: Ft<B>,
        up: Ft<B>,
        weight: Option<Ft<B>>,
        grad: Ft<B>,
        activation: GluActivation,
    ) -> (Ft<B>, Ft<B>, Option<Ft<B>>) {
        let weighted = weight.is_some();
        let rows = dims::<_, 2>(&gate)[0];
        let mut declared = vec![Out::like(&gate), Out::like(&up)];
        if weighted {
            declared.push(Out::new([rows], DType::F32));
        }
        let inputs = Inputs::new()
            .float(gate)
            .float(up)
            .float_opt(weight)
            .float(grad);
        let mut out = call::<B>(
            "kimi_burn::situ_glu_backward",
            inputs,
            declared,
            move |mut a| {
                let (gate, up) = (a.float(), a.float());
                let weight = a.float_if(weighted);
                let grad = a.float();
                let (dg, du, dw) = B::situ_glu_backward(gate, up, weight, grad, activation);
                let mut v = vec![Prim::Float(dg), Prim::Float(du)];
                v.extend(dw.map(Prim::Float));
                v
            },
        )
        .into_iter();
        let (dg, du) = (out.next().unwrap(), out.next().unwrap());
        (dg, du, out.next())
    }

    fn route_top_k(
        scores: Ft<B>,
        bias: Ft<B>,
        valid: Option<IntTensor<Self>>,
        k: usize,
        histogram: Option<HistogramSpec>,
    ) -> (IntTensor<Self>, Option<IntTensor<Self>>) {
        let [m, n] = dims::<_, 2>(&scores);
        let int = B::IntElem::dtype();
        let mut declared = vec![Out::new([m, k], int)];
        if let Some(h) = histogram {
            // The CubeCL kernel counts in u32 whatever the backend's int type.
            declared.push(Out::new([n, h.bins], DType::U32));
        }
        let masked = valid.is_some();
        let inputs = Inputs::new().float(scores).float(bias).int_opt(valid);
        let mut out = call::<B>("kimi_burn::route_top_k", inputs, declared, move |mut a| {
            let (scores, bias) = (a.float(), a.float());
            let valid = a.int_if(masked);
            let (idx, counts) = B::route_top_k(scores, bias, valid, k, histogram);
            let mut v = vec![Prim::Int(idx)];
            v.extend(counts.map(Prim::Int));
            v
        })
        .into_iter();
        (out.next().unwrap(), out.next())
    }

    fn moe_experts(input: MoeExpertsInput<Self>) -> Ft<B> {
        let activation = (input.activation, input.hidden_quant);
        let masked = input.valid.is_some();
        let declared = vec![Out::like(&input.input)];
        let inputs = moe_inputs(input);
        let [y] = outs(call::<B>(
            "kimi_burn::moe_experts",
            inputs,
            declared,
            move |mut a| {
                let input = inner_moe_input::<B>(&mut a, masked, activation);
                vec![Prim::Float(B::moe_experts(input))]
            },
        ));
        y
    }

    fn moe_experts_backward(
        input: MoeExpertsInput<Self>,
        grad: Ft<B>,
        saved: Option<MoeSaved<Self>>,
    ) -> MoeExpertsGrads<Self> {
        let activation = (input.activation, input.hidden_quant);
        let masked = input.valid.is_some();
        let has_saved = saved.is_some();
        let declared = vec![
            Out::like(&input.input),
            Out::like(&input.weights),
            Out::like(&input.w1),
            Out::like(&input.w3),
            Out::like(&input.w2),
        ];
        let mut inputs = moe_inputs(input).float(grad);
        if let Some(s) = saved {
            inputs = inputs.float(s.gate).float(s.up);
        }
        let [input, weights, w1, w3, w2] = outs(call::<B>(
            "kimi_burn::moe_experts_backward",
            inputs,
            declared,
            move |mut a| {
                let input = inner_moe_input::<B>(&mut a, masked, activation);
                let grad = a.float();
                let saved = has_saved.then(|| MoeSaved {
                    gate: a.float(),
                    up: a.float(),
                });
                let g = B::moe_experts_backward(input, grad, saved);
                [g.input, g.weights, g.w1, g.w3, g.w2]
                    .into_iter()
                    .map(Prim::Float)
                    .collect()
            },
        ));
        MoeExpertsGrads {
            input,
            weights,
            w1,
            w3,
            w2,
        }
    }
    fn mx_fake_quant(x: Ft<B>, spec: MxSpec) -> Ft<B> {
        let declared = vec![Out::new(x.shape.clone(), DType::F32)];
        let [y] = outs(call::<B>(
            "kimi_burn::mx_fake_quant",
            Inputs::new().float(x),
            declared,
            move |mut a| vec![Prim::Float(B::mx_fake_quant(a.float(), spec))],
        ));
        y
    }
}

/// The tensors of a [`MoeExpertsInput`] in the order [`inner_moe_input`] reads them.
fn moe_inputs<B: FusionBackend>(input: MoeExpertsInput<Fusion<B>>) -> Inputs<B::FusionRuntime> {
    Inputs::new()
        .float(input.input)
        .int(input.indices)
        .float(input.weights)
        .int_opt(input.valid)
        .float(input.w1)
        .float(input.w3)
        .float(input.w2)
}

fn inner_moe_input<B: Backend>(
    a: &mut Args<B>,
    masked: bool,
    (activation, hidden_quant): (GluActivation, Option<MxSpec>),
) -> MoeExpertsInput<B> {
    MoeExpertsInput {
        input: a.float(),
        indices: a.int(),
        weights: a.float(),
        valid: a.int_if(masked),
        w1: a.float(),
        w3: a.float(),
        w2: a.float(),
        activation,
        hidden_quant,
    }
}
