//! The custom backward shared by the row kernels with two differentiable inputs and an `eps`
//! (Attention Residuals, RMSNorm): the forward runs the inner backend's kernel and registers a
//! backward that calls the inner backend's fused backward kernel.

use std::fmt::Debug;
use std::marker::PhantomData;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;

use super::{record, register_grads, FusedOp, KernelPath};

/// A forward kernel `f(a, b, eps)` and its fused backward `(da, db)` on the backend `B`.
pub(crate) trait PairKernel<B: Backend>: Debug + Send + 'static {
    /// What the backward records as its path.
    const BACKWARD: FusedOp;
    /// The forward kernel.
    fn forward(a: FloatTensor<B>, b: FloatTensor<B>, eps: f64) -> FloatTensor<B>;
    /// The backward kernel for the output's gradient `grad`: `(da, db)`.
    fn backward(
        a: FloatTensor<B>,
        b: FloatTensor<B>,
        grad: FloatTensor<B>,
        eps: f64,
    ) -> (FloatTensor<B>, FloatTensor<B>);
}

/// Parents `[a, b]`, state the two inputs; carries `eps`.
#[derive(Debug)]
struct PairBackward<K>(f64, PhantomData<K>);

impl<B: Backend, K: PairKernel<B>> Backward<B, 2> for PairBackward<K> {
    type State = (NodeId, NodeId);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_a, node_b] = ops.parents.map(|n| n.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let a: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.0);
        let b: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state.1);
        let (da, db) = K::backward(a, b, grad, self.0);
        record(K::BACKWARD, KernelPath::Kernel);
        register_grads::<B>(grads, [(node_a, Some(da)), (node_b, Some(db))]);
    }
}

/// `K`'s forward on `Autodiff<B, C>`, tracked with `K`'s backward.
pub(crate) fn pair_forward<B: Backend, C: CheckpointStrategy, K: PairKernel<B>>(
    a: AdTensor<B, C>,
    b: AdTensor<B, C>,
    eps: f64,
) -> AdTensor<B, C> {
    let prep = PairBackward::<K>(eps, PhantomData)
        .prepare::<C>([a.node.clone(), b.node.clone()])
        .compute_bound()
        .stateful();
    match prep {
        OpsKind::Tracked(mut prep) => {
            let state = (prep.checkpoint(&a), prep.checkpoint(&b));
            let out = K::forward(a.primitive, b.primitive, eps);
            prep.finish(state, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(K::forward(a.primitive, b.primitive, eps)),
    }
}

/// A float tensor of `Autodiff<B, C>`.
type AdTensor<B, C> = FloatTensor<Autodiff<B, C>>;

/// `K`'s backward on `Autodiff<B, C>` (not differentiable itself).
pub(crate) fn pair_backward<B: Backend, C: CheckpointStrategy, K: PairKernel<B>>(
    a: AdTensor<B, C>,
    b: AdTensor<B, C>,
    grad: AdTensor<B, C>,
    eps: f64,
) -> (AdTensor<B, C>, AdTensor<B, C>) {
    type A<B, C> = Autodiff<B, C>;
    let (da, db) = K::backward(
        A::<B, C>::inner(a),
        A::<B, C>::inner(b),
        A::<B, C>::inner(grad),
        eps,
    );
    (A::<B, C>::from_inner(da), A::<B, C>::from_inner(db))
}
