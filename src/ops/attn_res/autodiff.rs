//! [`AttnResKernels`] for `Autodiff<B>`: the forward runs `B`'s kernel and registers a backward
//! that calls `B`'s fused backward kernel.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::AttnResKernels;
use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};

/// The mix: parents `[v, query]`, state the two inputs; carries `eps`.
#[derive(Debug)]
struct AttnResBackward(f64);

impl<B: AttnResKernels> Backward<B, 2> for AttnResBackward {
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_v, node_q] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let v: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let q: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let (dv, dq) = B::attn_res_backward(v, q, grad, self.0);
        record(FusedOp::AttnResBackward, KernelPath::Kernel);
        register_grads::<B>(grads, [(node_v, Some(dv)), (node_q, Some(dq))]);
    }
}

impl<B: AttnResKernels, C: CheckpointStrategy> AttnResKernels for Autodiff<B, C> {
    fn attn_res_forward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let prep = AttnResBackward(eps)
            .prepare::<C>([v.node.clone(), query.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&v), prep.checkpoint(&query));
                let out = B::attn_res_forward(v.primitive, query.primitive, eps);
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::attn_res_forward(v.primitive, query.primitive, eps))
            }
        }
    }

    fn attn_res_backward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dv, dq) =
            B::attn_res_backward(Self::inner(v), Self::inner(query), Self::inner(grad), eps);
        (Self::from_inner(dv), Self::from_inner(dq))
    }
}
