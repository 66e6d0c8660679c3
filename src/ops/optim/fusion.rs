//! [`OptimKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, outs, Ft, Inputs, Out, Prim};
use crate::ops::optim::{AdamWScalars, OptimKernels};

impl<B: FusionBackend + OptimKernels> OptimKernels for Fusion<B> {
    fn adamw_step(
        param: Ft<B>,
        grad: Ft<B>,
        m1: Ft<B>,
        m2: Ft<B>,
        scalars: AdamWScalars,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&param), Out::like(&param), Out::like(&param)];
        let inputs = Inputs::new().float(param).float(grad).float(m1).float(m2);
        let [p, a, b] = outs(call::<B>(
            "kimi_burn::adamw_step",
            inputs,
            declared,
            move |mut a| {
                let (p, g, m1, m2) = (a.float(), a.float(), a.float(), a.float());
                let (p, m1, m2) = B::adamw_step(p, g, m1, m2, scalars);
                vec![Prim::Float(p), Prim::Float(m1), Prim::Float(m2)]
            },
        ));
        (p, a, b)
    }

    fn scaled_sum(x: Ft<B>, y: Ft<B>, a: f32, b: f32) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let inputs = Inputs::new().float(x).float(y);
        let [out] = outs(call::<B>(
            "kimi_burn::scaled_sum",
            inputs,
            declared,
            move |mut args| {
                let (x, y) = (args.float(), args.float());
                vec![Prim::Float(B::scaled_sum(x, y, a, b))]
            },
        ));
        out
    }
}
