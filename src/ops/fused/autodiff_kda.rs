//! [`KdaKernels`] for `Autodiff<B>`: the gated norm runs `B`'s forward kernel and registers a
//! backward that calls `B`'s fused backward kernel; the recurrent kernel runs untracked only.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::{record, FusedOp, KdaKernelInput, KdaKernels, KernelPath};

/// The gated norm: parents `[o, z, weight]`, state the three inputs; carries `eps`.
#[derive(Debug)]
struct NormGatedBackward(f64);

impl<B: KdaKernels> Backward<B, 3> for NormGatedBackward {
    type State = (NodeId, NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_o, node_z, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let o: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let z: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let w: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.2);
        let (d_o, d_z, d_w) = B::rms_norm_gated_backward(o, z, w, grad, self.0);
        record(FusedOp::RmsNormGatedBackward, KernelPath::Kernel);
        for (node, g) in [(node_o, d_o), (node_z, d_z), (node_w, d_w)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

impl<B: KdaKernels, C: CheckpointStrategy> KdaKernels for Autodiff<B, C> {
    fn kda_recurrent_forward(
        input: KdaKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Callers check `kda_tracked` first: no graph to record.
        let inner = KdaKernelInput::<B> {
            q: Self::inner(input.q),
            k: Self::inner(input.k),
            v: Self::inner(input.v),
            g: Self::inner(input.g),
            beta: Self::inner(input.beta),
            initial_state: input.initial_state.map(Self::inner),
            seq_starts: input.seq_starts,
        };
        let (o, s) = B::kda_recurrent_forward(inner);
        (Self::from_inner(o), Self::from_inner(s))
    }

    fn kda_chunk_forward(
        input: KdaKernelInput<Self>,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = KdaKernelInput::<B> {
            q: Self::inner(input.q),
            k: Self::inner(input.k),
            v: Self::inner(input.v),
            g: Self::inner(input.g),
            beta: Self::inner(input.beta),
            initial_state: input.initial_state.map(Self::inner),
            seq_starts: input.seq_starts,
        };
        let (o, s) = B::kda_chunk_forward(inner, chunk);
        (Self::from_inner(o), Self::from_inner(s))
    }

    fn rms_norm_gated_forward(
        o: FloatTensor<Self>,
        z: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let prep = NormGatedBackward(eps)
            .prepare::<C>([o.node.clone(), z.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&o),
                    prep.checkpoint(&z),
                    prep.checkpoint(&weight),
                );
                let y = B::rms_norm_gated_forward(o.primitive, z.primitive, weight.primitive, eps);
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm_gated_forward(
                o.primitive,
                z.primitive,
                weight.primitive,
                eps,
            )),
        }
    }

    fn rms_norm_gated_backward(
        o: FloatTensor<Self>,
        z: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (d_o, d_z, d_w) = B::rms_norm_gated_backward(
            Self::inner(o),
            Self::inner(z),
            Self::inner(weight),
            Self::inner(grad),
            eps,
        );
        (
            Self::from_inner(d_o),
            Self::from_inner(d_z),
            Self::from_inner(d_w),
        )
    }

    fn kda_tracked(tensors: &[&FloatTensor<Self>]) -> bool {
        tensors.iter().any(|t| !t.node.requirement.is_none())
    }
}
