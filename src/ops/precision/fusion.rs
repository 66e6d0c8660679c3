//! [`ActivationKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, outs, Ft, Inputs, Out, Prim};
use crate::ops::precision::ActivationKernels;

impl<B: FusionBackend + ActivationKernels> ActivationKernels for Fusion<B> {
    fn precise_sigmoid(x: Ft<B>) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let [y] = outs(call::<B>(
            "kimi_burn::sigmoid_forward",
            Inputs::new().float(x),
            declared,
            |mut a| vec![Prim::Float(B::precise_sigmoid(a.float()))],
        ));
        y
    }

    fn precise_sigmoid_backward(x: Ft<B>, grad: Ft<B>) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let [dx] = outs(call::<B>(
            "kimi_burn::sigmoid_backward",
            Inputs::new().float(x).float(grad),
            declared,
            |mut a| {
                let (x, g) = (a.float(), a.float());
                vec![Prim::Float(B::precise_sigmoid_backward(x, g))]
            },
        ));
        dx
    }
}
