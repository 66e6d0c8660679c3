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

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

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
#[derive(Debug, Clone)]
pub(crate) struct HostArray {
    /// Row-major values.
    pub data: HostData,
    /// The shape.
    pub shape: Vec<usize>,
}

impl HostArray {
    /// Zeros of the given shape. A large buffer asks for transparent huge pages first
    /// ([`zeroed`]).
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            data: HostData::Owned(zeroed(shape.iter().product())),
            shape: shape.to_vec(),
        }
    }
}

/// Buffers from this many bytes on are worth huge pages.
const HUGE_PAGE_BYTES: usize = 4 << 20;

/// `len` zeros. From [`HUGE_PAGE_BYTES`] on, the 2 MiB-aligned part of the buffer is advised to be
/// backed by transparent huge pages (Linux, `madvise(MADV_HUGEPAGE)`) before anything touches
/// it: an output the allocator maps afresh on every call (glibc does, for large buffers) then
/// faults in 2 MiB at a time instead of 4 KiB, which at T = 8192 were most of the KDA backward's
/// thousands of faults per call. Only a hint: where the kernel declines, nothing changes.
pub(crate) fn zeroed(len: usize) -> Vec<f32> {
    let v = vec![0.0f32; len];
    advise_huge_pages(v.as_ptr(), len);
    v
}

/// The huge-page advice of [`zeroed`] for the `len` floats at `ptr` (nothing below
/// [`HUGE_PAGE_BYTES`], nor off Linux).
fn advise_huge_pages(ptr: *const f32, len: usize) {
    #[cfg(target_os = "linux")]
    if len * 4 >= HUGE_PAGE_BYTES {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + len * 4) / HUGE * HUGE;
        if end > start {
            // SAFETY: `[start, end)` lies inside the caller's allocation, which is alive; the
            // advice changes how its pages are backed, never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// An output of `len` floats that a kernel's threads fill row by row through
/// [`DisjointWrites::fresh`], each row zeroed by the thread that takes it, just before it writes
/// it. Zeroing the whole output first ([`zeroed`]) is a pass over memory on the calling thread
/// while the pool waits (glibc's `calloc` clears a reused heap block with `memset`): about a
/// tenth of the KDA forward + backward at T = 2048, whose five gradients are 8.5 MiB together.
pub(crate) struct Fresh {
    /// Capacity `len`; its length stays 0 until [`Fresh::into_vec`].
    buf: Vec<f32>,
    len: usize,
    /// Every element zeroed already ([`Fresh::zero_all`]).
    zeroed: bool,
}

impl Fresh {
    /// `len` floats, none written yet (with the huge-page advice of [`zeroed`]).
    pub fn new(len: usize) -> Self {
        #[allow(unused_mut)]
        let mut buf = Vec::with_capacity(len);
        advise_huge_pages(buf.as_ptr(), len);
        // In the crate's own tests every element starts as NaN, so that an element that no row
        // covers shows, whatever memory the allocator hands out.
        #[cfg(test)]
        {
            buf.resize(len, f32::NAN);
            buf.clear();
        }
        Self {
            buf,
            len,
            zeroed: false,
        }
    }

    /// Zeroes every element now: for an output some of whose rows no thread takes.
    pub fn zero_all(&mut self) {
        self.buf.clear();
        self.buf.resize(self.len, 0.0);
        self.zeroed = true;
    }

    /// The values, once written.
    ///
    /// # Safety
    /// Unless [`Fresh::zero_all`] was called, every element must lie in a row handed out by the
    /// [`DisjointWrites::fresh`] of this buffer (which zeroes the row before handing it out).
    pub unsafe fn into_vec(mut self) -> Vec<f32> {
        if !self.zeroed {
            // SAFETY: every element was written (the caller's contract); the capacity is `len`.
            unsafe { self.buf.set_len(self.len) };
        }
        self.buf
    }
}

/// The values of a [`HostArray`]: its own buffer, or (for an ndarray `f32` tensor in standard
/// layout) the tensor's buffer itself, shared and read in place. Reading an input costs no copy
/// and, more to the point on a CPU, no fresh pages: large new buffers are mapped afresh by the
/// allocator and every page is faulted in on first touch, which cost more than the KDA kernel.
#[derive(Clone)]
pub(crate) enum HostData {
    /// A buffer of our own.
    Owned(Vec<f32>),
    /// An ndarray tensor's buffer, read in place (never written: `DerefMut` copies it first).
    #[cfg(feature = "ndarray")]
    NdArray(burn::backend::ndarray::NdArrayTensor),
}

impl HostData {
    /// The values to write in place, when nothing else holds them: the buffer itself when owned,
    /// an ndarray tensor's buffer when the tensor's last handle was handed over (a decode loop's
    /// state, say); `None` when another handle still reads it. Unlike `DerefMut`, never copies.
    pub fn unique_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Self::Owned(v) => Some(v),
            #[cfg(feature = "ndarray")]
            Self::NdArray(burn::backend::ndarray::NdArrayTensor::F32(storage))
                if storage.is_unique() =>
            {
                storage.ensure_owned().as_slice_mut()
            }
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => None,
        }
    }

    /// The values as a `Vec`, moved out when owned, copied otherwise.
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => self.to_vec(),
        }
    }
}

impl std::ops::Deref for HostData {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(nd) => ndarray_slice(nd)
                .unwrap_or_else(|| unreachable!("only contiguous f32 tensors are shared")),
        }
    }
}

impl std::ops::DerefMut for HostData {
    fn deref_mut(&mut self) -> &mut [f32] {
        #[cfg(feature = "ndarray")]
        if let Self::NdArray(_) = self {
            *self = Self::Owned(self.to_vec());
        }
        match self {
            Self::Owned(v) => v,
            #[cfg(feature = "ndarray")]
            Self::NdArray(_) => unreachable!("made owned above"),
        }
    }
}

impl Debug for HostData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostData({} values)", self.len())
    }
}

impl PartialEq for HostData {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl FromIterator<f32> for HostData {
    fn from_iter<I: IntoIterator<Item = f32>>(iter: I) -> Self {
        Self::Owned(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a HostData {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl From<Vec<f32>> for HostData {
    fn from(v: Vec<f32>) -> Self {
        Self::Owned(v)
    }
}

/// The values of an ndarray `f32` tensor in standard layout, in place.
#[cfg(feature = "ndarray")]
fn ndarray_slice(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<&[f32]> {
    match nd {
        burn::backend::ndarray::NdArrayTensor::F32(storage) => {
            let view = storage.view();
            let slice = view.as_slice()?;
            // SAFETY: the slice points into `storage`'s buffer, which `nd` keeps alive and
            // unchanged for the lifetime of the borrow of `nd` (the view itself is a temporary).
            Some(unsafe { std::slice::from_raw_parts(slice.as_ptr(), slice.len()) })
        }
        _ => None,
    }
}

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

/// `x` as a value of type `T` when it is one.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn cast<S: 'static, T: 'static>(x: S) -> Option<T> {
    (Box::new(x) as Box<dyn Any>)
        .downcast::<T>()
        .ok()
        .map(|b| *b)
}

/// `x` as a value of type `T` when it is one, else `x` back.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn try_cast<S: 'static, T: 'static>(x: S) -> std::result::Result<T, S> {
    if TypeId::of::<S>() != TypeId::of::<T>() {
        return Err(x);
    }
    Ok(cast(x).unwrap_or_else(|| unreachable!("S is T")))
}

/// The shape of an ndarray `f32` tensor whose values [`ndarray_slice`] reads in place.
#[cfg(feature = "ndarray")]
fn ndarray_shape(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<Vec<usize>> {
    match nd {
        burn::backend::ndarray::NdArrayTensor::F32(storage) if ndarray_slice(nd).is_some() => {
            Some(storage.shape().to_vec())
        }
        _ => None,
    }
}

/// An ndarray `f32` tensor not in standard layout (a transposed or permuted view: MLA's heads
/// moved ahead of the tokens, say) copied into a new row-major buffer, a row of the last axis at
/// a time (`None` for other element types). Burn's `into_data` does the same copy one element at
/// a time through a dynamic-rank iterator: 4% of a tiny MLA layer's training step.
#[cfg(feature = "ndarray")]
fn ndarray_copy(nd: &burn::backend::ndarray::NdArrayTensor) -> Option<HostArray> {
    let burn::backend::ndarray::NdArrayTensor::F32(storage) = nd else {
        return None;
    };
    let view = storage.view();
    let shape = view.shape().to_vec();
    let strides = view.strides().to_vec();
    let len = shape.iter().product();
    let mut out = Vec::with_capacity(len);
    if len > 0 {
        // SAFETY: `view.as_ptr()` with the view's own shape and strides addresses exactly the
        // view's elements (ndarray's invariant), all alive while `nd` is borrowed.
        unsafe { copy_strided(&mut out, view.as_ptr(), &shape, &strides) };
    }
    debug_assert_eq!(out.len(), len);
    Some(HostArray {
        data: HostData::Owned(out),
        shape,
    })
}

/// Appends the elements of the strided array at `ptr` (`shape`, `strides` in elements) to `out`
/// in row-major order: whole rows when the last axis is contiguous.
///
/// # Safety
/// `ptr` offset by `Σ i_a · strides[a]` must be a readable `f32` for every index `i` in `shape`.
#[cfg(feature = "ndarray")]
unsafe fn copy_strided(out: &mut Vec<f32>, ptr: *const f32, shape: &[usize], strides: &[isize]) {
    // SAFETY (throughout): every offset taken addresses an element of the array (the caller's
    // contract).
    unsafe {
        match (shape, strides) {
            ([], _) => out.push(*ptr),
            ([n], [1]) => out.extend_from_slice(std::slice::from_raw_parts(ptr, *n)),
            ([n], [s]) => out.extend((0..*n).map(|i| *ptr.offset(i as isize * s))),
            ([n, rest @ ..], [s, srest @ ..]) => {
                for i in 0..*n {
                    copy_strided(out, ptr.offset(i as isize * s), rest, srest);
                }
            }
            _ => unreachable!("as many strides as axes"),
        }
    }
}

/// Copies a primitive of backend `X` to the host in `f32`.
///
/// An ndarray `f32` tensor in standard layout is shared, not copied ([`HostData::NdArray`]):
/// Burn's `into_data` walks a shared array (autodiff keeps a clone of every input) element by
/// element through a dynamic-rank iterator, which cost more than the kernels themselves.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn to_host<X: Backend>(x: FloatTensor<X>) -> HostArray {
    #[cfg(feature = "ndarray")]
    let x = match try_cast::<FloatTensor<X>, burn::backend::ndarray::NdArrayTensor>(x) {
        Ok(nd) => {
            if let Some(shape) = ndarray_shape(&nd) {
                return HostArray {
                    data: HostData::NdArray(nd),
                    shape,
                };
            }
            if let Some(copy) = ndarray_copy(&nd) {
                return copy;
            }
            try_cast(nd).unwrap_or_else(|_| unreachable!("cast back to the type it came from"))
        }
        Err(x) => x,
    };
    let data = crate::sync::read(Tensor::<X, 1>::from_primitive(TensorPrimitive::Float(x)))
        .convert_dtype(DType::F32);
    let shape = data.shape.to_vec();
    HostArray {
        data: HostData::Owned(
            data.into_vec::<f32>()
                .unwrap_or_else(|e| unreachable!("convert_dtype(F32) gives f32 data: {e:?}")),
        ),
        shape,
    }
}

/// A primitive of backend `X` holding `x`.
///
/// An ndarray tensor's buffer ([`HostData::NdArray`]) of the same shape is handed back as that
/// tensor, without a copy: an output written in place into an input's buffer.
#[cfg(any(feature = "ndarray", feature = "flex"))]
fn from_host<X: Backend>(x: HostArray, device: &X::Device) -> FloatTensor<X> {
    let HostArray { data, shape } = x;
    #[cfg(feature = "ndarray")]
    let data = match data {
        HostData::NdArray(nd) => match ndarray_with_shape(nd, &shape) {
            Ok(nd) => match try_cast::<_, FloatTensor<X>>(nd) {
                Ok(tensor) => return tensor,
                Err(nd) => HostData::NdArray(nd),
            },
            Err(nd) => HostData::NdArray(nd),
        },
        data => data,
    };
    X::float_from_data(TensorData::new(data.into_vec(), shape), device)
}

/// An ndarray `f32` tensor read in place ([`HostData::NdArray`]) as a tensor of `shape`: itself
/// when the shape is its own, the same buffer with the new shape when the element counts agree
/// (its buffer is in standard layout, so the row-major order is kept), `Err` otherwise (the
/// caller copies). Burn 0.21's ndarray `reshape` copies even a contiguous tensor.
#[cfg(feature = "ndarray")]
fn ndarray_with_shape(
    nd: burn::backend::ndarray::NdArrayTensor,
    shape: &[usize],
) -> std::result::Result<burn::backend::ndarray::NdArrayTensor, burn::backend::ndarray::NdArrayTensor>
{
    use burn::backend::ndarray::NdArrayTensor;
    let Some(own) = ndarray_shape(&nd) else {
        return Err(nd);
    };
    if own == shape {
        return Ok(nd);
    }
    if own.iter().product::<usize>() != shape.iter().product::<usize>() {
        return Err(nd);
    }
    match nd {
        NdArrayTensor::F32(storage) if storage.is_owned() => {
            let array = storage.into_shared();
            debug_assert!(
                array.is_standard_layout(),
                "ndarray_shape checked the layout"
            );
            let array = array
                .into_shape_with_order(shape.to_vec())
                .unwrap_or_else(|e| {
                    unreachable!("a standard-layout array of as many elements: {e}")
                });
            Ok(NdArrayTensor::from(array))
        }
        nd => Err(nd),
    }
}

/// `x` with another shape of as many elements, row-major order kept: on ndarray the input's
/// own buffer, without a copy (see [`ndarray_with_shape`]); the gradient is reshaped back.
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

/// A buffer that several threads write at once, each thread to its own elements (the rows of one
/// head of a `[B, T, H, X]` tensor, say), so that a host kernel writes its results in place instead
/// of gathering them from per-thread copies.
pub(crate) struct DisjointWrites<'a> {
    ptr: *mut f32,
    len: usize,
    /// Zero each slice before handing it out ([`DisjointWrites::fresh`]).
    fresh: bool,
    _buffer: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the buffer is borrowed mutably for 'a, and `slice`'s contract rules out overlapping
// writes, so sharing the pointer between threads is as safe as splitting the slice.
unsafe impl Send for DisjointWrites<'_> {}
// SAFETY: as above.
unsafe impl Sync for DisjointWrites<'_> {}

impl<'a> DisjointWrites<'a> {
    /// Wraps `buffer` for the duration of its borrow.
    pub fn new(buffer: &'a mut [f32]) -> Self {
        Self {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
            fresh: false,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Wraps an output not written yet: every [`slice`](Self::slice) is zeroed before it is
    /// handed out, so a slice must be taken once only (a second one would zero the first one's
    /// writes).
    pub fn fresh(buffer: &'a mut Fresh) -> Self {
        Self {
            ptr: buffer.buf.as_mut_ptr(),
            len: buffer.len,
            fresh: !buffer.zeroed,
            _buffer: std::marker::PhantomData,
        }
    }

    /// The buffer's first element: for reading elements that no slice of this buffer alive at
    /// the same time covers (an op that writes its results over the input it reads, say).
    pub fn as_ptr(&self) -> *const f32 {
        self.ptr
    }

    /// Requests elements `start..start + len` for writing ahead of [`slice`](Self::slice) (see
    /// [`super::simd::prefetch_write`]); makes no slice and writes nothing.
    #[inline(always)]
    pub fn prefetch_write(&self, start: usize, len: usize) {
        if start <= self.len && len <= self.len - start {
            super::simd::prefetch_write(self.ptr.wrapping_add(start), len);
        }
    }

    /// Elements `start..start + len` (zeros first, from [`DisjointWrites::fresh`]).
    ///
    /// # Safety
    /// No two slices alive at the same time, from any thread, may overlap.
    ///
    /// # Panics
    /// When the range is out of bounds.
    #[allow(clippy::mut_from_ref)] // disjointness is the caller's contract, as for `split_at_mut`
    #[inline(always)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(
            start <= self.len && len <= self.len - start,
            "range {start}..{} of a buffer of {}",
            start + len,
            self.len
        );
        // SAFETY: in bounds (checked above), and the caller guarantees no overlap. A fresh
        // buffer's range is written (zeros) before the slice is made.
        unsafe {
            let at = self.ptr.add(start);
            if self.fresh {
                std::ptr::write_bytes(at, 0, len);
            }
            std::slice::from_raw_parts_mut(at, len)
        }
    }
}

/// Buffers of at least this many floats go back to the [`scratch`] pool; smaller ones come from
/// the allocator's heap cheaply enough.
const POOL_MIN: usize = 1 << 16;

/// The most floats the [`scratch`] pool keeps (1 GiB).
const POOL_MAX: usize = 1 << 28;

/// Large scratch buffers of the host kernels, kept between calls. Every buffer here has every
/// element up to its capacity initialised (`len == capacity`).
///
/// A fresh large allocation is mapped afresh by the allocator, and every page is faulted in (and
/// zeroed by the kernel) on first touch: on the benchmark machine that cost as much as the
/// arithmetic of the MoE layer's activations. Buffers that the kernels fill and drop every call
/// (the experts' hidden rows, the KDA checkpoints) come from here instead.
static POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// A buffer of the [`scratch`] pool: `len` floats whose contents are unspecified (the caller
/// overwrites them), handed back to the pool when dropped. Its allocation may be longer than
/// `len`; the rest is never cleared (an earlier version refilled it on every return, a `memset`
/// that cost a tenth of the MoE layer's backward).
pub(crate) struct Scratch {
    /// The whole allocation, every element initialised (`len == capacity`).
    buf: Vec<f32>,
    /// The length handed out.
    len: usize,
}

impl std::ops::Deref for Scratch {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({} values)", self.len)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.len() < POOL_MIN {
            return;
        }
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        pool.push(buf);
        let mut total: usize = pool.iter().map(Vec::len).sum();
        while total > POOL_MAX && !pool.is_empty() {
            total -= pool.remove(0).len();
        }
    }
}

/// A [`Scratch`] buffer of `len` floats: a pooled one when one is large enough (the smallest such),
/// else a new one.
pub(crate) fn scratch(len: usize) -> Scratch {
    if len >= POOL_MIN {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, v)| v.len() >= len)
            .min_by_key(|(_, v)| v.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return Scratch {
                buf: pool.swap_remove(i),
                len,
            };
        }
    }
    let buf = vec![0.0; len];
    debug_assert_eq!(buf.len(), buf.capacity());
    Scratch { buf, len }
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

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Tensor, TensorData};

    use super::{ndarray_copy, ndarray_slice, to_host, HostData};

    type B = NdArray<f32>;

    /// Views in other layouts than the standard one (axes swapped, the last axis strided, an
    /// axis reversed) come to the host as the row-major values that `into_data` gives.
    #[test]
    fn strided_ndarray_views_come_to_the_host_in_row_major_order() {
        let device = Default::default();
        let base = Tensor::<B, 1>::from_data(
            TensorData::new((0..120).map(|i| i as f32 * 0.5 - 7.0).collect(), [120]),
            &device,
        )
        .reshape([2, 3, 5, 4]);
        let views = [
            base.clone().swap_dims(1, 2),
            base.clone().swap_dims(2, 3),
            base.clone().permute([3, 1, 0, 2]),
            base.clone().flip([2]),
        ];
        for (i, view) in views.into_iter().enumerate() {
            let want = view.clone().into_data();
            let primitive = view.into_primitive().tensor();
            assert!(
                ndarray_slice(&primitive).is_none(),
                "view {i}: standard layout"
            );
            let copy = ndarray_copy(&primitive).expect("an f32 tensor");
            let host = to_host::<B>(primitive);
            for got in [copy, host] {
                assert!(
                    matches!(got.data, HostData::Owned(_)),
                    "view {i}: not a copy"
                );
                assert_eq!(got.shape, want.shape.to_vec(), "view {i}: shape");
                assert_eq!(
                    &got.data[..],
                    want.as_slice::<f32>().expect("f32"),
                    "view {i}: values"
                );
            }
        }
    }
}
