//! [`CrossEntropyKernels`] on Burn's `Fusion` backends: each method recorded in the fusion stream as one
//! custom operation that runs the inner backend's method (see [`crate::ops::backend::fusion`]).

use burn::tensor::DType;
use burn_fusion::{Fusion, FusionBackend};

use crate::ops::backend::fusion::{call, outs, Ft, Inputs, Out, Prim};
use crate::ops::loss::CrossEntropyKernels;

impl<B: FusionBackend + CrossEntropyKernels> CrossEntropyKernels for Fusion<B> {
    fn cross_entropy_forward(logits: Ft<B>, targets: Ft<B>, ignore: i32) -> (Ft<B>, Ft<B>) {
        let rows = logits.shape[0];
        let declared = vec![Out::new([rows], logits.dtype), Out::new([rows], DType::F32)];
        let inputs = Inputs::new().float(logits).int(targets);
        let [loss, lse] = outs(call::<B>(
            "kimi_burn::cross_entropy_forward",
            inputs,
            declared,
            move |mut a| {
                let (z, t) = (a.float(), a.int());
                let (loss, lse) = B::cross_entropy_forward(z, t, ignore);
                vec![Prim::Float(loss), Prim::Float(lse)]
            },
        ));
        (loss, lse)
    }

    fn cross_entropy_backward(
        logits: Ft<B>,
        targets: Ft<B>,
        lse: Ft<B>,
        grad: Ft<B>,
        ignore: i32,
    ) -> Ft<B> {
        let declared = vec![Out::like(&logits)];
        let inputs = Inputs::new()
            .float(logits)
            .int(targets)
            .float(lse)
            .float(grad);
        let [d] = outs(call::<B>(
            "kimi_burn::cross_entropy_backward",
            inputs,
            declared,
            move |mut a| {
                let (z, t, lse, g) = (a.float(), a.int(), a.float(), a.float());
                vec![Prim::Float(B::cross_entropy_backward(z, t, lse, g, ignore))]
            },
        ));
        d
    }
}
