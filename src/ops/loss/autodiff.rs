//! [`CrossEntropyKernels`] for `Autodiff<B>`: the forward runs `B`'s kernel and registers a
//! backward that calls `B`'s fused backward kernel with the saved log-sum-exp.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::CrossEntropyKernels;
use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};

/// Parent `[logits]`; state the logits' node, the targets and the per-row log-sum-exp.
#[derive(Debug)]
struct CrossEntropyBackward(i32);

impl<B: CrossEntropyKernels> Backward<B, 1> for CrossEntropyBackward {
    type State = (NodeId, IntTensor<B>, FloatTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (logits_id, targets, lse) = ops.state;
        let logits: FloatTensor<B> = checkpointer.retrieve_node_output(logits_id);
        let d = B::cross_entropy_backward(logits, targets, lse, grad, self.0);
        record(FusedOp::CrossEntropyBackward, KernelPath::Kernel);
        register_grads::<B>(grads, [(node, Some(d))]);
    }
}

impl<B: CrossEntropyKernels, C: CheckpointStrategy> CrossEntropyKernels for Autodiff<B, C> {
    fn cross_entropy_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        ignore: i32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let prep = CrossEntropyBackward(ignore)
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(mut prep) => {
                let id = prep.checkpoint(&logits);
                let (loss, lse) =
                    B::cross_entropy_forward(logits.primitive, targets.clone(), ignore);
                let loss = prep.finish((id, targets, lse.clone()), loss);
                (loss, Self::from_inner(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (loss, lse) = B::cross_entropy_forward(logits.primitive, targets, ignore);
                (prep.finish(loss), Self::from_inner(lse))
            }
        }
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        ignore: i32,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::cross_entropy_backward(
            Self::inner(logits),
            targets,
            Self::inner(lse),
            Self::inner(grad),
            ignore,
        ))
    }
}
