//! [`KdaKernels`] for `Autodiff<B>`: the gated norm and the chunked KDA forward run `B`'s forward
//! kernels and register backwards that call `B`'s fused backward kernels; the recurrent kernel
//! runs untracked only.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Shape, Slice, TensorMetadata};

use super::kernels::{KdaChunkGrads, KdaChunkSaved, KdaKernelInput, KdaKernels};
use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};

/// The short convolution with SiLU: parents `[x, weight, tail]` (the last a stand-in for `x`
/// when there is no tail).
#[derive(Debug)]
struct ShortConvBackward;

#[derive(Debug, Clone)]
struct ShortConvState {
    x: NodeId,
    weight: NodeId,
    tail: Option<NodeId>,
    seq_starts: Vec<usize>,
}

impl<B: KdaKernels> Backward<B, 3> for ShortConvBackward {
    type State = ShortConvState;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let dy = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let x: FloatTensor<B> = checkpointer.retrieve_node_output(s.x);
        let weight: FloatTensor<B> = checkpointer.retrieve_node_output(s.weight);
        let tail = s
            .tail
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let has_tail = tail.is_some();
        let (dx, dw, dt) = B::short_conv_backward(x, weight, tail, s.seq_starts, dy);
        record(FusedOp::ShortConvBackward, KernelPath::Kernel);
        let [n_x, n_w, n_t] = ops.parents.map(|n| n.map(|n| n.id));
        let n_t = if has_tail { n_t } else { None };
        register_grads::<B>(grads, [(n_x, Some(dx)), (n_w, Some(dw)), (n_t, dt)]);
    }
}

/// The chunked KDA forward: parents `[q, k, v, g, β, S_0]` (the last a stand-in for `q` when
/// there is no initial state); its one output is `o` and `S_T` flattened and concatenated.
#[derive(Debug)]
struct ChunkBackward {
    chunk: usize,
}

#[derive(Debug, Clone)]
struct ChunkState<B: KdaKernels> {
    nodes: [NodeId; 5],
    /// Whether `S_0` is a real parent (its value is not needed: the saved states hold it).
    has_h0: bool,
    seq_starts: Vec<usize>,
    saved: KdaChunkSaved<B>,
    o_shape: Shape,
    s_shape: Shape,
}

/// `[start, end)` of a flat tensor.
fn range<B: KdaKernels>(t: FloatTensor<B>, start: usize, end: usize) -> FloatTensor<B> {
    B::float_slice(t, &[Slice::from(start..end)])
}

impl<B: KdaKernels> Backward<B, 6> for ChunkBackward {
    type State = ChunkState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 6>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let [q, k, v, g, beta] = state
            .nodes
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let o_len = state.o_shape.num_elements();
        let s_len = state.s_shape.num_elements();
        let grad_o = B::float_reshape(range::<B>(grad.clone(), 0, o_len), state.o_shape);
        let grad_s = B::float_reshape(range::<B>(grad, o_len, o_len + s_len), state.s_shape);
        let input = KdaKernelInput::<B> {
            q,
            k,
            v,
            g,
            beta,
            initial_state: None,
            seq_starts: state.seq_starts,
        };
        let d = B::kda_chunk_backward(input, self.chunk, state.saved, grad_o, Some(grad_s));
        record(FusedOp::KdaChunkBackward, KernelPath::Kernel);
        let [n_q, n_k, n_v, n_g, n_beta, n_h0] = ops.parents.map(|n| n.map(|n| n.id));
        let n_h0 = if state.has_h0 { n_h0 } else { None };
        let pairs = [
            (n_q, Some(d.q)),
            (n_k, Some(d.k)),
            (n_v, Some(d.v)),
            (n_g, Some(d.g)),
            (n_beta, Some(d.beta)),
            (n_h0, Some(d.initial_state)),
        ];
        register_grads::<B>(grads, pairs);
    }
}

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
        let [node_o, node_z, node_w] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let o: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let z: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let w: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.2);
        let (d_o, d_z, d_w) = B::rms_norm_gated_backward(o, z, w, grad, self.0);
        record(FusedOp::RmsNormGatedBackward, KernelPath::Kernel);
        register_grads::<B>(
            grads,
            [
                (node_o, Some(d_o)),
                (node_z, Some(d_z)),
                (node_w, Some(d_w)),
            ],
        );
    }
}

/// The inner backend's primitives of `input` (the autodiff graph is not recorded).
fn inner_input<B: KdaKernels, C: CheckpointStrategy>(
    input: KdaKernelInput<Autodiff<B, C>>,
) -> KdaKernelInput<B> {
    type A<B, C> = Autodiff<B, C>;
    KdaKernelInput::<B> {
        q: A::<B, C>::inner(input.q),
        k: A::<B, C>::inner(input.k),
        v: A::<B, C>::inner(input.v),
        g: A::<B, C>::inner(input.g),
        beta: A::<B, C>::inner(input.beta),
        initial_state: input.initial_state.map(A::<B, C>::inner),
        seq_starts: input.seq_starts,
    }
}

impl<B: KdaKernels, C: CheckpointStrategy> KdaKernels for Autodiff<B, C> {
    fn kda_recurrent_forward(
        input: KdaKernelInput<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Callers check `kda_tracked` first: no graph to record.
        let (o, s) = B::kda_recurrent_forward(inner_input(input));
        (Self::from_inner(o), Self::from_inner(s))
    }

    fn kda_chunk_forward(
        input: KdaKernelInput<Self>,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let h0_node = input
            .initial_state
            .as_ref()
            .unwrap_or(&input.q)
            .node
            .clone();
        let prep = ChunkBackward { chunk }
            .prepare::<C>([
                input.q.node.clone(),
                input.k.node.clone(),
                input.v.node.clone(),
                input.g.node.clone(),
                input.beta.node.clone(),
                h0_node,
            ])
            .compute_bound()
            .stateful();
        let mut prep = match prep {
            OpsKind::Tracked(prep) => prep,
            OpsKind::UnTracked(_) => {
                let (o, s) = B::kda_chunk_forward(inner_input(input), chunk);
                return (Self::from_inner(o), Self::from_inner(s));
            }
        };
        let nodes = [
            prep.checkpoint(&input.q),
            prep.checkpoint(&input.k),
            prep.checkpoint(&input.v),
            prep.checkpoint(&input.g),
            prep.checkpoint(&input.beta),
        ];
        let has_h0 = input.initial_state.is_some();
        let seq_starts = input.seq_starts.clone();
        // Memory over compute under Burn's balanced checkpointing: the backward then recomputes
        // the within-chunk work.
        let keep = std::any::TypeId::of::<C>() != std::any::TypeId::of::<BalancedCheckpointing>();
        let (o, s, saved) = B::kda_chunk_forward_saving(inner_input(input), chunk, keep);
        let (o_shape, s_shape) = (o.shape(), s.shape());
        let (o_len, s_len) = (o_shape.num_elements(), s_shape.num_elements());
        let packed = B::float_cat(
            vec![
                B::float_reshape(o, Shape::new([o_len])),
                B::float_reshape(s, Shape::new([s_len])),
            ],
            0,
        );
        let state = ChunkState {
            nodes,
            has_h0,
            seq_starts,
            saved,
            o_shape: o_shape.clone(),
            s_shape: s_shape.clone(),
        };
        let packed = prep.finish(state, packed);
        let o = Self::float_reshape(
            Self::float_slice(packed.clone(), &[Slice::from(0..o_len)]),
            o_shape,
        );
        let s = Self::float_reshape(
            Self::float_slice(packed, &[Slice::from(o_len..o_len + s_len)]),
            s_shape,
        );
        (o, s)
    }

    fn kda_chunk_forward_saving(
        input: KdaKernelInput<Self>,
        chunk: usize,
        keep_within: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, KdaChunkSaved<Self>) {
        let (o, s, saved) = B::kda_chunk_forward_saving(inner_input(input), chunk, keep_within);
        let saved = KdaChunkSaved {
            states: Self::from_inner(saved.states),
            vn: Self::from_inner(saved.vn),
            within: saved.within.map(|w| w.map(Self::from_inner)),
        };
        (Self::from_inner(o), Self::from_inner(s), saved)
    }

    fn kda_chunk_backward(
        input: KdaKernelInput<Self>,
        chunk: usize,
        saved: KdaChunkSaved<Self>,
        grad_o: FloatTensor<Self>,
        grad_state: Option<FloatTensor<Self>>,
    ) -> KdaChunkGrads<Self> {
        let saved = KdaChunkSaved {
            states: Self::inner(saved.states),
            vn: Self::inner(saved.vn),
            within: saved.within.map(|w| w.map(Self::inner)),
        };
        let d = B::kda_chunk_backward(
            inner_input(input),
            chunk,
            saved,
            Self::inner(grad_o),
            grad_state.map(Self::inner),
        );
        KdaChunkGrads {
            q: Self::from_inner(d.q),
            k: Self::from_inner(d.k),
            v: Self::from_inner(d.v),
            g: Self::from_inner(d.g),
            beta: Self::from_inner(d.beta),
            initial_state: Self::from_inner(d.initial_state),
        }
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

    fn short_conv_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        tail: Option<FloatTensor<Self>>,
        seq_starts: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let tail_node = tail.as_ref().unwrap_or(&x).node.clone();
        let prep = ShortConvBackward
            .prepare::<C>([x.node.clone(), weight.node.clone(), tail_node])
            .compute_bound()
            .stateful();
        match prep {
            OpsKind::Tracked(mut prep) => {
                let state = ShortConvState {
                    x: prep.checkpoint(&x),
                    weight: prep.checkpoint(&weight),
                    tail: tail.as_ref().map(|t| prep.checkpoint(t)),
                    seq_starts: seq_starts.clone(),
                };
                let (y, t) = B::short_conv_forward(
                    x.primitive,
                    weight.primitive,
                    tail.map(|t| t.primitive),
                    seq_starts,
                );
                (prep.finish(state, y), Self::from_inner(t))
            }
            OpsKind::UnTracked(prep) => {
                let (y, t) = B::short_conv_forward(
                    x.primitive,
                    weight.primitive,
                    tail.map(|t| t.primitive),
                    seq_starts,
                );
                (prep.finish(y), Self::from_inner(t))
            }
        }
    }

    fn short_conv_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        tail: Option<FloatTensor<Self>>,
        seq_starts: Vec<usize>,
        dy: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    ) {
        let (dx, dw, dt) = B::short_conv_backward(
            Self::inner(x),
            Self::inner(weight),
            tail.map(Self::inner),
            seq_starts,
            Self::inner(dy),
        );
        (
            Self::from_inner(dx),
            Self::from_inner(dw),
            dt.map(Self::from_inner),
        )
    }

    fn kda_tracked(tensors: &[&FloatTensor<Self>]) -> bool {
        tensors.iter().any(|t| !t.node.requirement.is_none())
    }
}
