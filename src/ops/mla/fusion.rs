//! [`AttentionKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn::tensor::DType;
use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, dims, outs, Ft, Inputs, Out, Prim};
use crate::ops::mla::AttentionKernels;

impl<B: FusionBackend + AttentionKernels> AttentionKernels for Fusion<B> {
    fn attention_forward(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        key_padding: Option<Ft<B>>,
        scale: f64,
    ) -> (Ft<B>, Ft<B>) {
        let [batch, heads, t, _] = dims(&q);
        let dv = dims::<_, 4>(&v)[3];
        let declared = vec![
            Out::new([batch, heads, t, dv], q.dtype),
            Out::new([batch, heads, t], DType::F32),
        ];
        let has_pad = key_padding.is_some();
        let inputs = Inputs::new()
            .float(q)
            .float(k)
            .float(v)
            .int_opt(key_padding);
        let [o, lse] = outs(call::<B>(
            "kimi_burn::attention_forward",
            inputs,
            declared,
            move |mut a| {
                let (q, k, v) = (a.float(), a.float(), a.float());
                let pad = a.int_if(has_pad);
                let (o, lse) = B::attention_forward(q, k, v, pad, scale);
                vec![Prim::Float(o), Prim::Float(lse)]
            },
        ));
        (o, lse)
    }

    fn attention_backward(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        key_padding: Option<Ft<B>>,
        o: Ft<B>,
        lse: Ft<B>,
        grad: Ft<B>,
        scale: f64,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&q), Out::like(&k), Out::like(&v)];
        let has_pad = key_padding.is_some();
        let inputs = Inputs::new()
            .float(q)
            .float(k)
            .float(v)
            .float(o)
            .float(lse)
            .float(grad)
            .int_opt(key_padding);
        let [dq, dk, dv] = outs(call::<B>(
            "kimi_burn::attention_backward",
            inputs,
            declared,
            move |mut a| {
                let (q, k, v) = (a.float(), a.float(), a.float());
                let (o, lse, g) = (a.float(), a.float(), a.float());
                let pad = a.int_if(has_pad);
                let (dq, dk, dv) = B::attention_backward(q, k, v, pad, o, lse, g, scale);
                vec![Prim::Float(dq), Prim::Float(dk), Prim::Float(dv)]
            },
        ));
        (dq, dk, dv)
    }

    fn attention_max_len(dqk: usize, dv: usize) -> usize {
        B::attention_max_len(dqk, dv)
    }
}
