//! [`AttentionKernels`] for `Autodiff<B>`: the forward runs `B`'s kernel and registers a backward
//! that calls `B`'s fused backward kernels with the saved output and log-sum-exp.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::AttentionKernels;
use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};

/// Parents `[q, k, v]`; carries the scale.
#[derive(Debug)]
struct AttentionBackward(f64);

/// The inputs' nodes, the padding, the output and the log-sum-exp.
type State<B> = (
    [NodeId; 3],
    Option<IntTensor<B>>,
    FloatTensor<B>,
    FloatTensor<B>,
);

impl<B: AttentionKernels> Backward<B, 3> for AttentionBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let ([q, k, v], pad, o, lse) = ops.state;
        let q: FloatTensor<B> = checkpointer.retrieve_node_output(q);
        let k: FloatTensor<B> = checkpointer.retrieve_node_output(k);
        let v: FloatTensor<B> = checkpointer.retrieve_node_output(v);
        let (dq, dk, dv) = B::attention_backward(q, k, v, pad, o, lse, grad, self.0);
        record(FusedOp::AttentionBackward, KernelPath::Kernel);
        register_grads::<B>(
            grads,
            [(node_q, Some(dq)), (node_k, Some(dk)), (node_v, Some(dv))],
        );
    }
}

impl<B: AttentionKernels, C: CheckpointStrategy> AttentionKernels for Autodiff<B, C> {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: Option<IntTensor<Self>>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let prep = AttentionBackward(scale)
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(mut prep) => {
                let ids = [
                    prep.checkpoint(&q),
                    prep.checkpoint(&k),
                    prep.checkpoint(&v),
                ];
                let (o, lse) = B::attention_forward(
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    key_padding.clone(),
                    scale,
                );
                let out = prep.finish((ids, key_padding, o.clone(), lse.clone()), o);
                (out, Self::from_inner(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (o, lse) =
                    B::attention_forward(q.primitive, k.primitive, v.primitive, key_padding, scale);
                (prep.finish(o), Self::from_inner(lse))
            }
        }
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        key_padding: Option<IntTensor<Self>>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::attention_backward(
            Self::inner(q),
            Self::inner(k),
            Self::inner(v),
            key_padding,
            Self::inner(o),
            Self::inner(lse),
            Self::inner(grad),
            scale,
        );
        (
            Self::from_inner(dq),
            Self::from_inner(dk),
            Self::from_inner(dv),
        )
    }

    fn attention_max_len(dqk: usize, dv: usize) -> usize {
        B::attention_max_len(dqk, dv)
    }
}
