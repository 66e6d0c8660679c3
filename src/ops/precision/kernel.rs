//! The precise sigmoid as a CubeCL kernel: [`ActivationKernels`], forward and a fused backward.
//!
//! In tensor ops [`sigmoid`](super::sigmoid) is about ten launches forward and as many again in
//! its autodiff backward; the model calls it for every KDA layer's `β` and safe gate, every
//! router and MLA's output gate. On the CubeCL backends it is one launch each way, with the same
//! cancellation-free formulas.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, Tensor, TensorPrimitive};

use crate::ops::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};

/// Backend extension with the activation kernels. Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`), for `Fusion` over one and for
/// `Autodiff<B>` over those (fused backward).
pub trait ActivationKernels: Backend {
    /// `σ(x)` elementwise for a flat `[len]` tensor (f32, f16 or bf16), in f32 arithmetic,
    /// returned in `x`'s dtype. Differentiable on autodiff backends (fused backward).
    fn precise_sigmoid(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `grad · σ'(x)` for flat `[len]` tensors, in `x`'s dtype. Not differentiable itself.
    fn precise_sigmoid_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>)
        -> FloatTensor<Self>;
}

/// [`sigmoid`](super::sigmoid) on the kernels when `B` takes them: `Ok(σ(x))`, or `x` back.
pub(super) fn try_sigmoid<B: Backend, const D: usize>(
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, Tensor<B, D>> {
    let shape = x.shape();
    let len = shape.num_elements();
    if !(backend::kernel_dtype(x.dtype()) && len > 0 && backend::kernels_available::<B>()) {
        return Err(x);
    }
    match backend::on_kernels::<B, _>(SigmoidOp(x.reshape([len]))) {
        Ok(y) => {
            backend::record(FusedOp::Sigmoid, KernelPath::Kernel);
            Ok(y.reshape(shape))
        }
        Err(SigmoidOp(x)) => Err(x.reshape(shape)),
    }
}

/// [`ActivationKernels::precise_sigmoid`] on a `Tensor`.
struct SigmoidOp<B: Backend>(Tensor<B, 1>);

impl<B: Backend> KernelOp<B> for SigmoidOp<B> {
    type Output = Tensor<B, 1>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let x = same::<Tensor<B, 1>, Tensor<K, 1>>(self.0)
            .into_primitive()
            .tensor();
        let y = K::precise_sigmoid(x);
        same(Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(y)))
    }
}

#[cfg(feature = "autodiff")]
mod autodiff {
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::autodiff::NodeId;
    use burn::backend::Autodiff;
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::ops::FloatTensor;

    use super::ActivationKernels;
    use crate::ops::backend::{record, register_grads, FusedOp, KernelPath};

    /// Parent `[x]`, state `x`.
    #[derive(Debug)]
    struct SigmoidBackward;

    impl<B: ActivationKernels> Backward<B, 1> for SigmoidBackward {
        type State = NodeId;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            checkpointer: &mut Checkpointer,
        ) {
            let [node] = ops.parents.map(|n| n.map(|n| n.id));
            let grad = grads.consume::<B>(&ops.node);
            let x: FloatTensor<B> = checkpointer.retrieve_node_output(ops.state);
            let dx = B::precise_sigmoid_backward(x, grad);
            record(FusedOp::SigmoidBackward, KernelPath::Kernel);
            register_grads::<B>(grads, [(node, Some(dx))]);
        }
    }

    impl<B: ActivationKernels, C: CheckpointStrategy> ActivationKernels for Autodiff<B, C> {
        fn precise_sigmoid(x: FloatTensor<Self>) -> FloatTensor<Self> {
            match SigmoidBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = prep.checkpoint(&x);
                    let y = B::precise_sigmoid(x.primitive);
                    prep.finish(state, y)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::precise_sigmoid(x.primitive)),
            }
        }

        fn precise_sigmoid_backward(
            x: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            Self::from_inner(B::precise_sigmoid_backward(
                Self::inner(x),
                Self::inner(grad),
            ))
        }
    }
}

#[cfg(feature = "cubecl-kernels")]
mod cube {
    use burn_cubecl::element::BoolElement;
    use burn_cubecl::kernel::{cast, into_contiguous};
    use burn_cubecl::tensor::CubeTensor;
    use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
    use cubecl::{calculate_cube_count_elemwise, CubeDim};
    use kimi_burn_kernels::activation as kact;

    use super::ActivationKernels;
    use crate::ops::backend::cube::{dims, empty};

    type T<R> = CubeTensor<R>;

    fn launch_dims<R: CubeRuntime>(x: &T<R>, len: usize) -> (cubecl::CubeCount, CubeDim) {
        let dim = CubeDim::new_1d(kact::ACTIVATION_CUBE);
        (calculate_cube_count_elemwise(&x.client, len, dim), dim)
    }

    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ActivationKernels
        for CubeBackend<R, F, I, BT>
    {
        fn precise_sigmoid(x: T<R>) -> T<R> {
            let x = into_contiguous(x);
            let dtype = x.dtype;
            let [len] = dims(&x, "precise_sigmoid takes a flat tensor [len]");
            let out = empty(&x, [len], dtype);
            if len > 0 {
                let (count, dim) = launch_dims(&x, len);
                // SAFETY: the kernel bounds every index itself ("Unchecked launches",
                // ops/backend/cube.rs); both buffers hold `len` elements.
                unsafe {
                    kact::sigmoid_forward::launch_unchecked::<R>(
                        &x.client.clone(),
                        count,
                        dim,
                        x.into_array_arg(),
                        out.clone().into_array_arg(),
                        len,
                        dtype.into(),
                    )
                };
            }
            out
        }

        fn precise_sigmoid_backward(x: T<R>, grad: T<R>) -> T<R> {
            let x = into_contiguous(x);
            let dtype = x.dtype;
            let grad = into_contiguous(cast(grad, dtype));
            let [len] = dims(&x, "precise_sigmoid_backward takes flat tensors [len]");
            let dx = empty(&x, [len], dtype);
            if len > 0 {
                let (count, dim) = launch_dims(&x, len);
                // SAFETY: as above; the three buffers hold `len` elements.
                unsafe {
                    kact::sigmoid_backward::launch_unchecked::<R>(
                        &x.client.clone(),
                        count,
                        dim,
                        x.into_array_arg(),
                        grad.into_array_arg(),
                        dx.clone().into_array_arg(),
                        len,
                        dtype.into(),
                    )
                };
            }
            dx
        }
    }
}
