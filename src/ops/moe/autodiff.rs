//! [`MoeKernels`] for `Autodiff<B>`: the forward runs `B`'s kernel, the backward calls `B`'s
//! fused backward kernel (the pattern of Burn's `custom-cubecl-kernel` example).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::kernels::{MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
use super::situ::GluActivation;
use crate::nn::balance::HistogramSpec;
use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};
use crate::ops::quant::MxSpec;

/// SiTU-GLU without a routing weight: parents `[gate, up]`.
#[derive(Debug)]
struct SituBackward(GluActivation);

impl<B: MoeKernels> Backward<B, 2> for SituBackward {
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_gate, node_up] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let gate: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let up: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let (dgate, dup, _) = B::situ_glu_backward(gate, up, None, grad, self.0);
        record(FusedOp::SituGluBackward, KernelPath::Kernel);
        register_grads::<B>(grads, [(node_gate, Some(dgate)), (node_up, Some(dup))]);
    }
}

/// SiTU-GLU with a per-row routing weight: parents `[gate, up, weight]`.
#[derive(Debug)]
struct WeightedSituBackward(GluActivation);

impl<B: MoeKernels> Backward<B, 3> for WeightedSituBackward {
    type State = (NodeId, NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_gate, node_up, node_weight] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let gate: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let up: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let weight: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.2);
        let (dgate, dup, dweight) = B::situ_glu_backward(gate, up, Some(weight), grad, self.0);
        record(FusedOp::SituGluBackward, KernelPath::Kernel);
        let pairs = [
            (node_gate, Some(dgate)),
            (node_up, Some(dup)),
            (node_weight, dweight),
        ];
        register_grads::<B>(grads, pairs);
    }
}

/// The routed experts: parents `[input, weights, w1, w3, w2]`; the integer routing rides in the
/// state.
#[derive(Debug)]
struct MoeBackward(GluActivation, Option<MxSpec>);

#[derive(Debug, Clone)]
struct MoeState<B: MoeKernels> {
    nodes: [NodeId; 5],
    indices: IntTensor<B>,
    valid: Option<IntTensor<B>>,
    saved: Option<MoeSaved<B>>,
}

impl<B: MoeKernels> Backward<B, 5> for MoeBackward {
    type State = MoeState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 5>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let [input, weights, w1, w3, w2] = ops
            .state
            .nodes
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let input = MoeExpertsInput::<B> {
            input,
            indices: ops.state.indices,
            weights,
            valid: ops.state.valid,
            w1,
            w3,
            w2,
            activation: self.0,
            hidden_quant: self.1,
        };
        let g = B::moe_experts_backward(input, grad, ops.state.saved);
        record(FusedOp::MoeExpertsBackward, KernelPath::Kernel);
        let [n_input, n_weights, n_w1, n_w3, n_w2] = ops.parents.map(|n| n.map(|n| n.id));
        let pairs = [
            (n_input, Some(g.input)),
            (n_weights, Some(g.weights)),
            (n_w1, Some(g.w1)),
            (n_w3, Some(g.w3)),
            (n_w2, Some(g.w2)),
        ];
        register_grads::<B>(grads, pairs);
    }
}

impl<B: MoeKernels, C: CheckpointStrategy> MoeKernels for Autodiff<B, C> {
    fn situ_glu_forward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        activation: GluActivation,
    ) -> FloatTensor<Self> {
        match weight {
            None => {
                let prep = SituBackward(activation)
                    .prepare::<C>([gate.node.clone(), up.node.clone()])
                    .compute_bound()
                    .stateful();
                match prep {
                    OpsKind::Tracked(mut prep) => {
                        let state = (prep.checkpoint(&gate), prep.checkpoint(&up));
                        let out =
                            B::situ_glu_forward(gate.primitive, up.primitive, None, activation);
                        prep.finish(state, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::situ_glu_forward(
                        gate.primitive,
                        up.primitive,
                        None,
                        activation,
                    )),
                }
            }
            Some(weight) => {
                let prep = WeightedSituBackward(activation)
                    .prepare::<C>([gate.node.clone(), up.node.clone(), weight.node.clone()])
                    .compute_bound()
                    .stateful();
                match prep {
                    OpsKind::Tracked(mut prep) => {
                        let state = (
                            prep.checkpoint(&gate),
                            prep.checkpoint(&up),
                            prep.checkpoint(&weight),
                        );
                        let out = B::situ_glu_forward(
                            gate.primitive,
                            up.primitive,
                            Some(weight.primitive),
                            activation,
                        );
                        prep.finish(state, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::situ_glu_forward(
                        gate.primitive,
                        up.primitive,
                        Some(weight.primitive),
                        activation,
                    )),
                }
            }
        }
    }

    fn situ_glu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        weight: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        activation: GluActivation,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (dg, du, dw) = B::situ_glu_backward(
            Self::inner(gate),
            Self::inner(up),
            weight.map(Self::inner),
            Self::inner(grad),
            activation,
        );
        (
            Self::from_inner(dg),
            Self::from_inner(du),
            dw.map(Self::from_inner),
        )
    }

    fn route_top_k(
        scores: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        valid: Option<IntTensor<Self>>,
        k: usize,
        histogram: Option<HistogramSpec>,
    ) -> (IntTensor<Self>, Option<IntTensor<Self>>) {
        B::route_top_k(Self::inner(scores), Self::inner(bias), valid, k, histogram)
    }

    fn moe_experts(input: MoeExpertsInput<Self>) -> FloatTensor<Self> {
        let activation = input.activation;
        let hidden_quant = input.hidden_quant;
        let floats = [
            &input.input,
            &input.weights,
            &input.w1,
            &input.w3,
            &input.w2,
        ];
        let prep = MoeBackward(activation, hidden_quant)
            .prepare::<C>(floats.map(|t| t.node.clone()))
            .compute_bound()
            .stateful();
        let inner = MoeExpertsInput::<B> {
            input: input.input.primitive.clone(),
            indices: input.indices.clone(),
            weights: input.weights.primitive.clone(),
            valid: input.valid.clone(),
            w1: input.w1.primitive.clone(),
            w3: input.w3.primitive.clone(),
            w2: input.w2.primitive.clone(),
            activation,
            hidden_quant,
        };
        match prep {
            OpsKind::Tracked(mut prep) => {
                let nodes = floats.map(|t| prep.checkpoint(t));
                let (out, saved) = B::moe_experts_saving(inner);
                let state = MoeState {
                    nodes,
                    indices: input.indices,
                    valid: input.valid,
                    saved,
                };
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_experts(inner)),
        }
    }

    fn moe_experts_backward(
        input: MoeExpertsInput<Self>,
        grad: FloatTensor<Self>,
        saved: Option<MoeSaved<Self>>,
    ) -> MoeExpertsGrads<Self> {
        let saved = saved.map(|s| MoeSaved::<B> {
            gate: Self::inner(s.gate),
            up: Self::inner(s.up),
        });
        let inner = MoeExpertsInput::<B> {
            input: Self::inner(input.input),
            indices: input.indices,
            weights: Self::inner(input.weights),
            valid: input.valid,
            w1: Self::inner(input.w1),
            w3: Self::inner(input.w3),
            w2: Self::inner(input.w2),
            activation: input.activation,
            hidden_quant: input.hidden_quant,
        };
        let g = B::moe_experts_backward(inner, Self::inner(grad), saved);
        MoeExpertsGrads {
            input: Self::from_inner(g.input),
            weights: Self::from_inner(g.weights),
            w1: Self::from_inner(g.w1),
            w3: Self::from_inner(g.w3),
            w2: Self::from_inner(g.w2),
        }
    }

    fn mx_fake_quant(x: FloatTensor<Self>, spec: MxSpec) -> FloatTensor<Self> {
        Self::from_inner(B::mx_fake_quant(Self::inner(x), spec))
    }
}
