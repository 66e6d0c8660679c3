//! CPU kernels: ops computed on the host, with a hand-written backward, for Burn's CPU backends.
//!
//! On ndarray (and flex) a tensor op costs an allocation and a pass over memory whatever its size,
//! and the autodiff graph doubles that; an op such as the KDA recurrence, hundreds of small tensor
//! ops in the reference form, is far cheaper as one loop nest over host memory. A [`HostOp`] is such
//! an op: a forward and a backward on row-major `f32` buffers. [`run`] executes it on a backend
//! this module knows ([`is_cpu_backend`]), registering the backward with Burn's autodiff when the
//! backend is an `Autodiff` one. Every other backend keeps the tensor-op reference form; callers
//! check [`is_cpu_backend`] first.
//!
//! The backends are recognised by type (`TypeId`) because Burn's autodiff needs the concrete inner
//! backend to register a backward step: `Autodiff<NdArray<f32>>` and `NdArray<f32>` with the
//! `ndarray` feature, `Autodiff<Flex>` and `Flex` with the `flex` feature.

use std::any::TypeId;
use std::fmt::Debug;

use burn::tensor::{backend::Backend, ops::FloatTensor, Tensor, TensorPrimitive};
#[cfg(any(feature = "ndarray", feature = "flex"))]
use {
    burn::tensor::{DType, TensorData},
    std::any::Any,
    std::sync::Arc,
};

/// A tensor on the host for the CPU host kernels: row-major `f32` values and their shape (the
/// checkpoint store has its own [`HostTensor`](crate::store::HostTensor), which keeps the checkpoint
/// shape).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostArray {
    /// Row-major values.
    pub data: Vec<f32>,
    /// The shape.
    pub shape: Vec<usize>,
}

impl HostArray {
    /// Zeros of the given shape.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            data: vec![0.0; shape.iter().product()],
            shape: shape.to_vec(),
        }
    }
}

/// An op with `N` float inputs and one float output, computed on the host.
pub(crate) trait HostOp<const N: usize>: Debug + Clone + Send + Sync + 'static {
    /// What the forward pass keeps for the backward pass.
    type Saved: Debug + Send + Sync + 'static;

    /// The output, and what the backward pass needs when `save` is true.
    fn forward(&self, inputs: &[HostArray; N], save: bool) -> (HostArray, Option<Self::Saved>);

    /// The gradient of every input, given the inputs, the saved values and the output gradient.
    fn backward(
        &self,
        inputs: &[HostArray; N],
        saved: &Self::Saved,
        grad: &HostArray,
    ) -> [HostArray; N];
}

/// Whether [`run`] supports the backend `B` (a CPU backend of an enabled feature).
///
/// The switch of the fused kernels ([`kernels_enabled`](super::kernels_enabled):
/// `KIMI_BURN_REFERENCE=1`, `set_kernels`, `with_kernels`) turns the host kernels off too, so the
/// tensor-op reference can be run and timed on the same backend.
pub(crate) fn is_cpu_backend<B: Backend>() -> bool {
    if !super::kernels_enabled() {
        return false;
    }
    let id = TypeId::of::<B>();
    #[cfg(feature = "ndarray")]
    {
        use burn::backend::{Autodiff, NdArray};
        if id == TypeId::of::<NdArray<f32>>() || id == TypeId::of::<Autodiff<NdArray<f32>>>() {
            return true;
        }
    }
    #[cfg(feature = "flex")]
    {
        use burn::backend::{Autodiff, Flex};
        if id == TypeId::of::<Flex>() || id == TypeId::of::<Autodiff<Flex>>() {
            return true;
        }
    }
    let _ = id;
    false
}

/// Runs `op` on the host when `B` is a CPU backend and every input is `f32`; otherwise gives the
/// inputs back for the tensor-op form.
pub(crate) fn try_run<B: Backend, O: HostOp<N>, const N: usize, const D: usize>(
    op: &O,
    inputs: [Tensor<B, D>; N],
) -> std::result::Result<Tensor<B, D>, [Tensor<B, D>; N]> {
    if !(is_cpu_backend::<B>() && inputs.iter().all(|x| x.dtype() == burn::tensor::DType::F32)) {
        return Err(inputs);
    }
    Ok(run(op, inputs.map(|x| x.into_primitive().tensor())))
}

/// Runs `op` on the host. The inputs must be `f32` tensors of a backend for which
/// [`is_cpu_backend`] holds.
///
/// # Panics
/// When the backend is not a CPU backend: callers check [`is_cpu_backend`] first.
pub(crate) fn run<B: Backend, O: HostOp<N>, const N: usize, const D: usize>(
    op: &O,
    inputs: [FloatTensor<B>; N],
) -> Tensor<B, D> {
    #[cfg(feature = "ndarray")]
    {
        use burn::backend::NdArray;
        if let Some(out) = run_on::<B, NdArray<f32>, O, N>(op, &inputs) {
            return Tensor::from_primitive(TensorPrimitive::Float(out));
        }
        if let Some(out) = run_autodiff_on::<B, NdArray<f32>, O, N>(op, &inputs) {
            return Tensor::from_primitive(TensorPrimitive::Float(out));
        }
    }
    #[cfg(feature = "flex")]
    {
        use burn::backend::Flex;
        if let Some(out) = run_on::<B, Flex, O, N>(op, &inputs) {
            return Tensor::from_primitive(TensorPrimitive::Float(out));
        }
        if let Some(out) = run_autodiff_on::<B, Flex, O, N>(op, &inputs) {
            return Tensor::from_primitive(TensorPrimitive::Float(out));
        }
    }
    let _ = (op, inputs);
    panic!(
        "cpu::run on {}, which is not a CPU backend this build knows; check is_cpu_backend first",
        std::any::type_name::<B>()
    )
}

/// `x` as a value of type `T` when it is one.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn cast<S: 'static, T: 'static>(x: S) -> Option<T> {
    (Box::new(x) as Box<dyn Any>)
        .downcast::<T>()
        .ok()
        .map(|b| *b)
}

/// Copies a primitive of backend `X` to the host in `f32`.
///
/// An ndarray `f32` tensor in standard layout is copied as one slice: Burn's `into_data` walks a
/// shared array (autodiff keeps a clone of every input) element by element through a dynamic-rank
/// iterator, which cost more than the kernels themselves.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn to_host<X: Backend>(x: FloatTensor<X>) -> HostArray {
    #[cfg(feature = "ndarray")]
    let x = match (TypeId::of::<FloatTensor<X>>()
        == TypeId::of::<burn::backend::ndarray::NdArrayTensor>())
    .then(|| cast::<FloatTensor<X>, burn::backend::ndarray::NdArrayTensor>(x.clone()))
    .flatten()
    {
        Some(nd) => {
            if let burn::backend::ndarray::NdArrayTensor::F32(storage) = &nd {
                let view = storage.view();
                if let Some(slice) = view.as_slice() {
                    return HostArray {
                        data: slice.to_vec(),
                        shape: view.shape().to_vec(),
                    };
                }
            }
            cast::<burn::backend::ndarray::NdArrayTensor, FloatTensor<X>>(nd)
                .unwrap_or_else(|| unreachable!("cast back to the type it came from"))
        }
        None => x,
    };
    let data = Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(x))
        .into_data()
        .convert_dtype(DType::F32);
    let shape = data.shape.to_vec();
    HostArray {
        data: data
            .into_vec::<f32>()
            .unwrap_or_else(|e| unreachable!("convert_dtype(F32) gives f32 data: {e:?}")),
        shape,
    }
}

/// A primitive of backend `X` holding `x`.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn from_host<X: Backend>(x: HostArray, device: &X::Device) -> FloatTensor<X> {
    X::float_from_data(TensorData::new(x.data, x.shape), device)
}

/// The forward pass on a plain (non-autodiff) backend `X`, when `B` is `X`.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn run_on<B: Backend, X: Backend, O: HostOp<N>, const N: usize>(
    op: &O,
    inputs: &[FloatTensor<B>; N],
) -> Option<FloatTensor<B>> {
    if TypeId::of::<B>() != TypeId::of::<X>() {
        return None;
    }
    let prims: [FloatTensor<X>; N] = inputs
        .clone()
        .map(|x| cast(x).unwrap_or_else(|| unreachable!("B is X")));
    let device = X::float_device(&prims[0]);
    let host = prims.map(to_host::<X>);
    let (out, _) = op.forward(&host, false);
    cast(from_host::<X>(out, &device))
}

/// The forward pass on `Autodiff<X>` with the op's backward registered, when `B` is `Autodiff<X>`.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn run_autodiff_on<B: Backend, X: Backend, O: HostOp<N>, const N: usize>(
    op: &O,
    inputs: &[FloatTensor<B>; N],
) -> Option<FloatTensor<B>> {
    use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
    use burn::backend::autodiff::ops::{Backward, OpsKind};
    use burn::backend::Autodiff;

    if TypeId::of::<B>() != TypeId::of::<Autodiff<X>>() {
        return None;
    }
    let prims: [FloatTensor<Autodiff<X>>; N] = inputs
        .clone()
        .map(|x| cast(x).unwrap_or_else(|| unreachable!("B is Autodiff<X>")));
    let device = X::float_device(&prims[0].primitive);
    let nodes = prims.clone().map(|p| p.node);
    let host = prims.map(|p| to_host::<X>(p.primitive));
    let out: FloatTensor<Autodiff<X>> =
        match Backward::<X, N>::prepare::<NoCheckpointing>(HostBackward(op.clone()), nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, saved) = op.forward(&host, true);
                let saved = saved.unwrap_or_else(|| unreachable!("forward(save = true) saves"));
                let state = Arc::new((host, saved, device.clone()));
                prep.finish(state, from_host::<X>(out, &device))
            }
            OpsKind::UnTracked(prep) => {
                let (out, _) = op.forward(&host, false);
                prep.finish(from_host::<X>(out, &device))
            }
        };
    cast(out)
}

/// The backward step of a [`HostOp`] in Burn's autodiff graph.
#[cfg(any(feature = "ndarray", feature = "flex"))]
#[derive(Debug)]
struct HostBackward<O>(O);

#[cfg(any(feature = "ndarray", feature = "flex"))]
impl<X: Backend, O: HostOp<N>, const N: usize> burn::backend::autodiff::ops::Backward<X, N>
    for HostBackward<O>
{
    type State = Arc<([HostArray; N], O::Saved, X::Device)>;

    fn backward(
        self,
        ops: burn::backend::autodiff::ops::Ops<Self::State, N>,
        grads: &mut burn::backend::autodiff::grads::Gradients,
        _checkpointer: &mut burn::backend::autodiff::checkpoint::base::Checkpointer,
    ) {
        let grad = to_host::<X>(grads.consume::<X>(&ops.node));
        let (inputs, saved, device) = &*ops.state;
        let dx = self.0.backward(inputs, saved, &grad);
        for (parent, d) in ops.parents.iter().zip(dx) {
            if let Some(node) = parent {
                grads.register::<X>(node.id, from_host::<X>(d, device));
            }
        }
    }
}

/// Runs `f(i)` for `i in 0..n` on up to `available_parallelism` threads, results in order.
pub(crate) fn parallel_map<T: Send, F: Fn(usize) -> T + Sync>(n: usize, f: F) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(n);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..threads)
            .map(|w| s.spawn(move || (w * per..((w + 1) * per).min(n)).map(f).collect::<Vec<T>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}
