//! [`RmsNormKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, outs, Ft, Inputs, Out, Prim};
use crate::ops::norm::RmsNormKernels;

impl<B: FusionBackend + RmsNormKernels> RmsNormKernels for Fusion<B> {
    fn rms_norm_forward(x: Ft<B>, weight: Ft<B>, eps: f64) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let inputs = Inputs::new().float(x).float(weight);
        let [out] = outs(call::<B>(
            "kimi_burn::rms_norm_forward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                vec![Prim::Float(B::rms_norm_forward(x, w, eps))]
            },
        ));
        out
    }

    fn rms_norm_backward(x: Ft<B>, weight: Ft<B>, grad: Ft<B>, eps: f64) -> (Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&x), Out::like(&weight)];
        let inputs = Inputs::new().float(x).float(weight).float(grad);
        let [dx, dw] = outs(call::<B>(
            "kimi_burn::rms_norm_backward",
            inputs,
            declared,
            move |mut a| {
                let (x, w, g) = (a.float(), a.float(), a.float());
                let (dx, dw) = B::rms_norm_backward(x, w, g, eps);
                vec![Prim::Float(dx), Prim::Float(dw)]
            },
        ));
        (dx, dw)
    }
}
