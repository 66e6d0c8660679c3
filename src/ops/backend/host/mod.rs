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
//!
//! The buffers the kernels read and write are in [`memory`]; the moves of Burn's tensors to and
//! from them, without a copy where ndarray allows it, in [`transfer`].

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

mod memory;
mod transfer;

use std::any::TypeId;
use std::fmt::Debug;

use burn::tensor::{backend::Backend, ops::FloatTensor, Tensor, TensorPrimitive};
#[cfg(any(feature = "ndarray", feature = "flex"))]
use std::sync::Arc;

#[cfg(feature = "ndarray")]
use memory::ndarray_slice;
pub(crate) use memory::{scratch, DisjointWrites, Fresh, HostArray, HostData, Scratch};
#[cfg(feature = "ndarray")]
use transfer::try_cast;
#[cfg(any(feature = "ndarray", feature = "flex"))]
use transfer::{cast, from_host, to_host};

/// An op with `N` float inputs and one float output, computed on the host.
pub(crate) trait HostOp<const N: usize>: Debug + Clone + Send + Sync + 'static {
    /// What the forward pass keeps for the backward pass.
    type Saved: Debug + Send + Sync + 'static;

    /// The output, and what the backward pass needs when `save` is true.
    fn forward(&self, inputs: &[HostArray; N], save: bool) -> (HostArray, Option<Self::Saved>);

    /// The outputs of an untracked call as separate arrays, when the op has several (the output
    /// of [`forward`](Self::forward) is then their concatenation, flattened, which is what a
    /// tracked call needs: Burn's autodiff registers one output per op). Splitting a tensor
    /// afterwards would copy every part but the first.
    ///
    /// The inputs are the op's own: it may write an output into an input's buffer when
    /// [`HostData::unique_mut`] gives it (the output is then that input's tensor, without a new
    /// allocation).
    fn forward_parts(&self, inputs: [HostArray; N]) -> Vec<HostArray> {
        vec![self.forward(&inputs, false).0]
    }

    /// The gradient of every input, given the inputs, the saved values and the output gradient.
    fn backward(
        &self,
        inputs: &[HostArray; N],
        saved: &Self::Saved,
        grad: &HostArray,
    ) -> [HostArray; N];

    /// [`backward`](Self::backward) with the output gradient the op's own: what Burn's autodiff
    /// hands a backward step. An op may write an input gradient into the output gradient's
    /// buffer when [`HostData::unique_mut`] gives it (that gradient is then the output
    /// gradient's tensor, without a new allocation).
    fn backward_owned(
        &self,
        inputs: &[HostArray; N],
        saved: &Self::Saved,
        grad: HostArray,
    ) -> [HostArray; N] {
        self.backward(inputs, saved, &grad)
    }
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
    if is_ndarray_backend::<B>() {
        return true;
    }
    let id = TypeId::of::<B>();
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

/// Whether `B`'s tensors live in host memory (its device is the CPU: ndarray, and Flex with
/// `flex` or `learner`), whatever its element types and whether the host kernels are on. Every
/// tensor of such a backend is on the one device.
pub(crate) fn is_host_device<B: Backend>() -> bool {
    let device = TypeId::of::<B::Device>();
    #[cfg(feature = "ndarray")]
    if device == TypeId::of::<burn::backend::ndarray::NdArrayDevice>() {
        return true;
    }
    #[cfg(any(feature = "flex", feature = "learner"))]
    if device == TypeId::of::<burn::backend::flex::FlexDevice>() {
        return true;
    }
    let _ = device;
    false
}

/// Whether `B` is `NdArray<f32>` or `Autodiff<NdArray<f32>>` with the host kernels on: the
/// backends whose tensors the host ops read and hand back in place ([`HostData::NdArray`]).
pub(crate) fn is_ndarray_backend<B: Backend>() -> bool {
    #[cfg(feature = "ndarray")]
    {
        use burn::backend::{Autodiff, NdArray};
        let id = TypeId::of::<B>();
        if super::kernels_enabled()
            && (id == TypeId::of::<NdArray<f32>>() || id == TypeId::of::<Autodiff<NdArray<f32>>>())
        {
            return true;
        }
    }
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

/// The separate outputs of `op` ([`HostOp::forward_parts`]) as tensors when `B` is a plain
/// (non-autodiff) CPU backend; the inputs back on an autodiff backend, where [`run`] gives the
/// concatenated output. The inputs are moved in so that an op may write into one nothing else
/// holds.
pub(crate) fn run_parts<B: Backend, O: HostOp<N>, const N: usize>(
    op: &O,
    inputs: [FloatTensor<B>; N],
) -> std::result::Result<Vec<FloatTensor<B>>, [FloatTensor<B>; N]> {
    let out = Err(inputs);
    #[cfg(feature = "ndarray")]
    let out =
        out.or_else(|inputs| run_parts_on::<B, burn::backend::NdArray<f32>, O, N>(op, inputs));
    #[cfg(feature = "flex")]
    let out = out.or_else(|inputs| run_parts_on::<B, burn::backend::Flex, O, N>(op, inputs));
    let _ = op;
    out
}

/// `f` of the inputs on the host, its outputs as tensors, when `B` is a CPU backend, plain or
/// `Autodiff` (whose outputs are then untracked: for updates that are never differentiated, such
/// as an optimiser step); the inputs back otherwise. The inputs are moved in so that `f` may write
/// into one nothing else holds ([`HostData::unique_mut`]).
pub(crate) fn run_untracked<B: Backend, const N: usize, const M: usize>(
    inputs: [FloatTensor<B>; N],
    f: impl FnOnce([HostArray; N]) -> [HostArray; M],
) -> std::result::Result<[FloatTensor<B>; M], [FloatTensor<B>; N]> {
    let mut f = Some(f);
    let out = Err(inputs);
    #[cfg(feature = "ndarray")]
    let out =
        out.or_else(|inputs| untracked_on::<B, burn::backend::NdArray<f32>, N, M>(inputs, &mut f));
    #[cfg(feature = "flex")]
    let out = out.or_else(|inputs| untracked_on::<B, burn::backend::Flex, N, M>(inputs, &mut f));
    let _ = &mut f;
    out
}

/// [`run_untracked`] when `B` is `X` or `Autodiff<X>` (`f` is taken then).
#[cfg(any(feature = "ndarray", feature = "flex"))]
#[allow(clippy::type_complexity)]
fn untracked_on<B: Backend, X: Backend, const N: usize, const M: usize>(
    inputs: [FloatTensor<B>; N],
    f: &mut Option<impl FnOnce([HostArray; N]) -> [HostArray; M]>,
) -> std::result::Result<[FloatTensor<B>; M], [FloatTensor<B>; N]> {
    use burn::backend::Autodiff;
    use burn::tensor::backend::AutodiffBackend;
    let mut apply = |host: [HostArray; N], device: &X::Device| {
        let f = f
            .take()
            .unwrap_or_else(|| unreachable!("one backend matches"));
        f(host).map(|out| from_host::<X>(out, device))
    };
    if TypeId::of::<B>() == TypeId::of::<Autodiff<X>>() {
        let prims: [FloatTensor<X>; N] = inputs.map(|x| {
            let x: FloatTensor<Autodiff<X>> =
                cast(x).unwrap_or_else(|| unreachable!("B is Autodiff<X>"));
            Autodiff::<X>::inner(x)
        });
        let device = X::float_device(&prims[0]);
        let out = apply(prims.map(to_host::<X>), &device);
        return Ok(out.map(|o| {
            cast(Autodiff::<X>::from_inner(o)).unwrap_or_else(|| unreachable!("B is Autodiff<X>"))
        }));
    }
    let (host, device) = plain_inputs::<B, X, N>(inputs)?;
    Ok(apply(host, &device).map(|o| cast(o).unwrap_or_else(|| unreachable!("B is X"))))
}

/// [`run_parts`] when `B` is the plain backend `X`.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn run_parts_on<B: Backend, X: Backend, O: HostOp<N>, const N: usize>(
    op: &O,
    inputs: [FloatTensor<B>; N],
) -> std::result::Result<Vec<FloatTensor<B>>, [FloatTensor<B>; N]> {
    let (host, device) = plain_inputs::<B, X, N>(inputs)?;
    Ok(op
        .forward_parts(host)
        .into_iter()
        .map(|part| cast(from_host::<X>(part, &device)).unwrap_or_else(|| unreachable!("B is X")))
        .collect())
}

/// The inputs on the host and their device when `B` is the plain backend `X`; the inputs back
/// otherwise.
#[cfg(any(feature = "ndarray", feature = "flex"))]
#[allow(clippy::type_complexity)]
fn plain_inputs<B: Backend, X: Backend, const N: usize>(
    inputs: [FloatTensor<B>; N],
) -> std::result::Result<([HostArray; N], X::Device), [FloatTensor<B>; N]> {
    if TypeId::of::<B>() != TypeId::of::<X>() {
        return Err(inputs);
    }
    let prims: [FloatTensor<X>; N] =
        inputs.map(|x| cast(x).unwrap_or_else(|| unreachable!("B is X")));
    let device = X::float_device(&prims[0]);
    Ok((prims.map(to_host::<X>), device))
}

/// `x` with another shape of as many elements, row-major order kept: on ndarray the input's
/// own buffer, without a copy (see [`ndarray_with_shape`]); the gradient is reshaped back.
///
/// [`ndarray_with_shape`]: transfer::ndarray_with_shape
#[derive(Debug, Clone)]
pub(crate) struct Reshape {
    /// The output shape.
    pub shape: Vec<usize>,
}

impl HostOp<1> for Reshape {
    type Saved = ();

    /// The input's values moved, not copied, when they are a buffer of the op's own (a strided
    /// input read back in order).
    fn forward_parts(&self, [x]: [HostArray; 1]) -> Vec<HostArray> {
        vec![HostArray {
            data: x.data,
            shape: self.shape.clone(),
        }]
    }

    fn forward(&self, [x]: &[HostArray; 1], save: bool) -> (HostArray, Option<()>) {
        let out = HostArray {
            data: x.data.clone(),
            shape: self.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x]: &[HostArray; 1], _: &(), grad: &HostArray) -> [HostArray; 1] {
        [HostArray {
            data: grad.data.clone(),
            shape: x.shape.clone(),
        }]
    }
}

/// The forward pass on a plain (non-autodiff) backend `X`, when `B` is `X`.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn run_on<B: Backend, X: Backend, O: HostOp<N>, const N: usize>(
    op: &O,
    inputs: &[FloatTensor<B>; N],
) -> Option<FloatTensor<B>> {
    let (host, device) = plain_inputs::<B, X, N>(inputs.clone()).ok()?;
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
        let dx = self.0.backward_owned(inputs, saved, grad);
        for (parent, d) in ops.parents.iter().zip(dx) {
            if let Some(node) = parent {
                grads.register::<X>(node.id, from_host::<X>(d, device));
            }
        }
    }
}

/// `f` of the values of `x`, read in place on the host, when `x` is an ndarray `f32` tensor in
/// standard layout (plain or under autodiff); `None` otherwise, and the caller takes the general
/// road. Burn's ndarray `into_data` and reductions walk a tensor one element at a time through a
/// dynamic-rank iterator: reading back the router's scores that way took 6 ms of the MoE layer's
/// 110, the KDA gate check a sixth of the CPU kernel.
pub(crate) fn read_in_place<B: Backend, const D: usize, R>(
    x: &Tensor<B, D>,
    f: impl FnOnce(&[f32]) -> R,
) -> Option<R> {
    #[cfg(feature = "ndarray")]
    if x.dtype() == burn::tensor::DType::F32 {
        use burn::backend::{ndarray::NdArrayTensor, Autodiff, NdArray};
        let prim = x.clone().into_primitive().tensor();
        let nd = match try_cast::<FloatTensor<B>, NdArrayTensor>(prim) {
            Ok(nd) => Some(nd),
            Err(prim) => try_cast::<_, FloatTensor<Autodiff<NdArray<f32>>>>(prim)
                .ok()
                .map(|ad| ad.primitive),
        };
        if let Some(values) = nd.as_ref().and_then(ndarray_slice) {
            return Some(f(values));
        }
    }
    let _ = (x, f);
    None
}

/// The largest element of `x` (NaN when any is NaN), through [`read_in_place`].
pub(crate) fn max<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<f32> {
    read_in_place(x, super::simd::max)
}

/// Work (in element operations, roughly) below which [`parallel_map_sized`] stays on the calling
/// thread: handing work to the thread pool and waking the caller again costs tens of microseconds
/// on a busy or virtualised machine, the time of about this much work.
pub(crate) const MIN_PARALLEL_WORK: usize = 1 << 20;

/// `f(i)` for `i in 0..n`, results in order: on rayon's thread pool when the whole call does at
/// least [`MIN_PARALLEL_WORK`] element operations (`work`), a plain loop on the calling thread
/// otherwise (a decode step, say). Threads are started once per process (the pool), not per call:
/// starting a thread took hundreds of microseconds on the benchmark machine.
pub(crate) fn parallel_map_sized<T: Send, F: Fn(usize) -> T + Sync + Send>(
    n: usize,
    work: usize,
    f: F,
) -> Vec<T> {
    use rayon::prelude::*;
    if work < MIN_PARALLEL_WORK || n < 2 {
        return (0..n).map(f).collect();
    }
    (0..n).into_par_iter().map(f).collect()
}

/// Helpers of the host kernels' unit tests: central differences and a comparison scaled to the
/// largest expected value.
#[cfg(test)]
pub(crate) mod testing {
    /// Central differences of `f` at `x`, coordinate by coordinate (step 1e-6).
    pub(crate) fn numeric(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
        let h = 1e-6;
        (0..x.len())
            .map(|i| {
                let (mut a, mut b) = (x.to_vec(), x.to_vec());
                a[i] += h;
                b[i] -= h;
                (f(&a) - f(&b)) / (2.0 * h)
            })
            .collect()
    }

    /// Every element of `got` within `tol` times the largest `|want|` (at least 1e-3) of `want`.
    pub(crate) fn close(what: &str, want: &[f64], got: &[f32], tol: f64) {
        assert_eq!(want.len(), got.len(), "{what}: lengths");
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3);
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            assert!(
                (w - *g as f64).abs() <= tol * scale,
                "{what}[{i}]: {g} vs {w} (scale {scale})"
            );
        }
    }
}
