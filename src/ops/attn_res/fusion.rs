//! [`AttnResKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn_fusion::{Fusion, FusionBackend};

use crate::ops::attn_res::AttnResKernels;
use crate::ops::backend::fusion::{call, outs, Ft, Inputs, Out, Prim};

impl<B: FusionBackend + AttnResKernels> AttnResKernels for Fusion<B> {
    fn attn_res_forward(v: Ft<B>, query: Ft<B>, eps: f64) -> Ft<B> {
        let [_, rows, d] = v.shape.dims();
        let declared = vec![Out::new([rows, d], v.dtype)];
        let inputs = Inputs::new().float(v).float(query);
        let [out] = outs(call::<B>(
            "kimi_burn::attn_res_forward",
            inputs,
            declared,
            move |mut a| {
                let (v, q) = (a.float(), a.float());
                vec![Prim::Float(B::attn_res_forward(v, q, eps))]
            },
        ));
        out
    }

    fn attn_res_backward(v: Ft<B>, query: Ft<B>, grad: Ft<B>, eps: f64) -> (Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&v), Out::like(&query)];
        let inputs = Inputs::new().float(v).float(query).float(grad);
        let [dv, dq] = outs(call::<B>(
            "kimi_burn::attn_res_backward",
            inputs,
            declared,
            move |mut a| {
                let (v, q, g) = (a.float(), a.float(), a.float());
                let (dv, dq) = B::attn_res_backward(v, q, g, eps);
                vec![Prim::Float(dv), Prim::Float(dq)]
            },
        ));
        (dv, dq)
    }
}
