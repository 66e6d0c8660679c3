//! The optimiser's elementwise updates as fused ops.
//!
//! [`adamw_update`] is one AdamW step of one parameter: on the CubeCL backends a single kernel
//! ([`OptimKernels`]) instead of Burn's fourteen or so tensor ops, each a launch over the whole
//! parameter; on the CPU backends one host pass (`host`), in place where the parameter and its
//! moments are not held elsewhere; elsewhere the same arithmetic in tensor ops.
//! [`KimiAdamW`](crate::optim::KimiAdamW) steps its parameters through it. [`scaled_sum`]
//! (`a·x + b·y`, one kernel for three tensor ops) is Muon's update of the weights and the two
//! combinations of each Newton–Schulz iteration (on the CPU backends, whose Newton–Schulz runs on
//! the host as a whole, only the weights' update) in
//! [`KimiOptimizer`](crate::optim::KimiOptimizer) (its momentum stays Burn's `Momentum`, whose
//! state keeps the velocity private).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use super::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};

#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod host;

/// The scalars of one AdamW step, each in f32 as the tensor-op form rounds them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `β₁`.
    pub beta1: f32,
    /// `1 − β₁`.
    pub f1: f32,
    /// `β₂`.
    pub beta2: f32,
    /// `1 − β₂`.
    pub f2: f32,
    /// The first moment's bias correction `1 − β₁ᵗ`.
    pub c1: f32,
    /// The second moment's bias correction `1 − β₂ᵗ`.
    pub c2: f32,
    /// `ε`, added to the square root of the corrected second moment.
    pub eps: f32,
    /// `1 − lr·λ`: the decoupled weight decay's factor on the parameter.
    pub keep: f32,
    /// The learning rate.
    pub lr: f32,
}

impl AdamWScalars {
    /// The scalars of step `time` (1 for the first step) with moments `β₁`, `β₂`, `ε`, weight
    /// decay `λ` and learning rate `lr`, rounded to f32 where Burn's `AdamW` rounds them.
    pub fn new(beta1: f32, beta2: f32, eps: f32, weight_decay: f32, lr: f64, time: i32) -> Self {
        Self {
            beta1,
            f1: 1.0 - beta1,
            beta2,
            f2: 1.0 - beta2,
            c1: 1.0 - beta1.powi(time),
            c2: 1.0 - beta2.powi(time),
            eps,
            keep: (1.0 - lr * weight_decay as f64) as f32,
            lr: lr as f32,
        }
    }
}

/// One AdamW step of a parameter: `(param, m1, m2)` after it, from the parameter, its gradient and
/// the moments before it (zeros before the first step), all of one shape; the gradient and the
/// moments are taken in the parameter's dtype (on every path, as the kernel stores them):
///
/// ```text
/// m1 ← β₁·m1 + (1 − β₁)·g,   m2 ← β₂·m2 + (1 − β₂)·g²
/// param ← param·keep − lr · (m1 / c₁) / (sqrt(m2 / c₂) + ε)
/// ```
///
/// On the CubeCL backends (f32, f16, bf16) one kernel computes all three in f32 and stores them in
/// the parameter's dtype. On the CPU backends (f32) one host pass computes the operations of
/// Burn's `AdamW` in its order, each rounded as there, so it matches it bit for bit; it writes
/// into the buffers of `param`, `m1` and `m2` when nothing else holds them (untracked under
/// `Autodiff`: an optimiser step is not differentiated). Elsewhere the same operations run as
/// tensor ops.
///
/// # Panics
/// When the four tensors' shapes differ.
pub fn adamw_update<B: Backend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    m1: Tensor<B, D>,
    m2: Tensor<B, D>,
    scalars: AdamWScalars,
) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
    let shape = param.shape();
    for (what, other) in [
        ("grad", grad.shape()),
        ("m1", m1.shape()),
        ("m2", m2.shape()),
    ] {
        assert!(
            other == shape,
            "adamw_update: {what} has shape {other:?}, the parameter {shape:?}"
        );
    }
    let dtype = param.dtype();
    let like = |t: Tensor<B, D>| if t.dtype() == dtype { t } else { t.cast(dtype) };
    let (grad, m1, m2) = (like(grad), like(m1), like(m2));
    let len = shape.num_elements();
    let f32s = dtype == DType::F32;
    if f32s && len > 0 && backend::host::is_cpu_backend::<B>() {
        let inputs = [param, grad, m1, m2].map(|t| t.into_primitive().tensor());
        match backend::host::run_untracked::<B, 4, 3>(inputs, |x| host::adamw(scalars, x)) {
            Ok([p, a, b]) => {
                backend::record(FusedOp::AdamW, KernelPath::Reference);
                return (float(p), float(a), float(b));
            }
            Err(_) => unreachable!("a CPU backend runs host ops untracked"),
        }
    }
    if backend::kernel_dtype(param.dtype()) && len > 0 && backend::kernels_available::<B>() {
        let flat = |t: Tensor<B, D>| t.reshape([len]);
        let op = AdamWOp {
            param: flat(param),
            grad: flat(grad),
            m1: flat(m1),
            m2: flat(m2),
            scalars,
        };
        match backend::on_kernels::<B, _>(op) {
            Ok((p, a, b)) => {
                backend::record(FusedOp::AdamW, KernelPath::Kernel);
                let dims = shape.dims::<D>();
                return (p.reshape(dims), a.reshape(dims), b.reshape(dims));
            }
            Err(op) => {
                let dims = shape.dims::<D>();
                backend::record(FusedOp::AdamW, KernelPath::Reference);
                let (p, a, b) = adamw_reference(op.param, op.grad, op.m1, op.m2, op.scalars);
                return (p.reshape(dims), a.reshape(dims), b.reshape(dims));
            }
        }
    }
    backend::record(FusedOp::AdamW, KernelPath::Reference);
    adamw_reference(param, grad, m1, m2, scalars)
}

/// A float primitive as a tensor.
fn float<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// [`adamw_update`] in tensor ops, in the order of Burn's `AdamW` (any backend).
fn adamw_reference<B: Backend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    m1: Tensor<B, D>,
    m2: Tensor<B, D>,
    s: AdamWScalars,
) -> (Tensor<B, D>, Tensor<B, D>, Tensor<B, D>) {
    let m1 = m1.mul_scalar(s.beta1).add(grad.clone().mul_scalar(s.f1));
    let m2 = m2.mul_scalar(s.beta2).add(grad.square().mul_scalar(s.f2));
    let delta = m1
        .clone()
        .div_scalar(s.c1)
        .div(m2.clone().div_scalar(s.c2).sqrt().add_scalar(s.eps));
    let kept = if s.keep == 1.0 {
        param
    } else {
        param.mul_scalar(s.keep)
    };
    (kept - delta.mul_scalar(s.lr), m1, m2)
}

/// `a·x + b·y` for two tensors of one shape (`y` taken in `x`'s dtype): on the CubeCL backends
/// one kernel (f32 arithmetic with `a` and `b` rounded to f32, each product rounded, then the
/// sum); on the CPU backends (f32) the same arithmetic in one host pass, into `x`'s buffer when
/// nothing else holds it (untracked under `Autodiff`), the bits of the tensor-op form; elsewhere
/// `x·a + y·b` in tensor ops (the factors converted to the tensors' element type; a factor of
/// exactly 1 skips its product), which is what the tensor-op forms of Muon's update and
/// Newton–Schulz steps compute.
///
/// # Panics
/// When the shapes differ.
pub fn scaled_sum<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    a: f64,
    y: Tensor<B, D>,
    b: f64,
) -> Tensor<B, D> {
    let shape = x.shape();
    assert!(
        y.shape() == shape,
        "scaled_sum: y has shape {:?}, x {shape:?}",
        y.shape()
    );
    let y = if y.dtype() == x.dtype() {
        y
    } else {
        y.cast(x.dtype())
    };
    let len = shape.num_elements();
    if x.dtype() == DType::F32 && len > 0 && backend::host::is_cpu_backend::<B>() {
        let inputs = [x, y].map(|t| t.into_primitive().tensor());
        match backend::host::run_untracked::<B, 2, 1>(inputs, |v| {
            host::scaled_sum(a as f32, b as f32, v)
        }) {
            Ok([out]) => {
                backend::record(FusedOp::ScaledSum, KernelPath::Reference);
                return float(out);
            }
            Err(_) => unreachable!("a CPU backend runs host ops untracked"),
        }
    }
    if backend::kernel_dtype(x.dtype()) && len > 0 && backend::kernels_available::<B>() {
        let op = ScaledSumOp {
            x: x.reshape([len]),
            y: y.reshape([len]),
            a: a as f32,
            b: b as f32,
        };
        match backend::on_kernels::<B, _>(op) {
            Ok(out) => {
                backend::record(FusedOp::ScaledSum, KernelPath::Kernel);
                return out.reshape(shape.dims::<D>());
            }
            Err(op) => {
                backend::record(FusedOp::ScaledSum, KernelPath::Reference);
                let dims = shape.dims::<D>();
                return scaled_sum_reference(op.x, a, op.y, b).reshape(dims);
            }
        }
    }
    backend::record(FusedOp::ScaledSum, KernelPath::Reference);
    scaled_sum_reference(x, a, y, b)
}

/// [`scaled_sum`] in tensor ops (any backend).
fn scaled_sum_reference<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    a: f64,
    y: Tensor<B, D>,
    b: f64,
) -> Tensor<B, D> {
    let scale = |t: Tensor<B, D>, s: f64| if s == 1.0 { t } else { t.mul_scalar(s) };
    scale(x, a).add(scale(y, b))
}

/// Backend extension with the optimiser's fused updates. Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`), for `Fusion` over one and for
/// `Autodiff<B>` over those (untracked: an optimiser step is not differentiated).
pub trait OptimKernels: Backend {
    /// [`adamw_update`] of flat `[len]` tensors of one float dtype: `(param, m1, m2)` after the
    /// step, in that dtype.
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m1: FloatTensor<Self>,
        m2: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// [`scaled_sum`] of flat `[len]` tensors: `a·x + b·y` in `x`'s dtype.
    fn scaled_sum(x: FloatTensor<Self>, y: FloatTensor<Self>, a: f32, b: f32) -> FloatTensor<Self>;
}

#[cfg(feature = "autodiff")]
impl<B: OptimKernels, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    OptimKernels for burn::backend::Autodiff<B, C>
{
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m1: FloatTensor<Self>,
        m2: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (p, a, b) = B::adamw_step(
            Self::inner(param),
            Self::inner(grad),
            Self::inner(m1),
            Self::inner(m2),
            scalars,
        );
        (
            Self::from_inner(p),
            Self::from_inner(a),
            Self::from_inner(b),
        )
    }

    fn scaled_sum(x: FloatTensor<Self>, y: FloatTensor<Self>, a: f32, b: f32) -> FloatTensor<Self> {
        use burn::tensor::backend::AutodiffBackend;
        Self::from_inner(B::scaled_sum(Self::inner(x), Self::inner(y), a, b))
    }
}

/// [`OptimKernels::adamw_step`] on `Tensor`s.
struct AdamWOp<B: Backend> {
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    m1: Tensor<B, 1>,
    m2: Tensor<B, 1>,
    scalars: AdamWScalars,
}

impl<B: Backend> KernelOp<B> for AdamWOp<B> {
    type Output = (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>);

    fn run<K: FusedKernels>(self) -> Self::Output {
        let prim = |t: Tensor<B, 1>| {
            same::<Tensor<B, 1>, Tensor<K, 1>>(t)
                .into_primitive()
                .tensor()
        };
        let back = |t: FloatTensor<K>| {
            same::<Tensor<K, 1>, Tensor<B, 1>>(Tensor::from_primitive(TensorPrimitive::Float(t)))
        };
        let (p, a, b) = K::adamw_step(
            prim(self.param),
            prim(self.grad),
            prim(self.m1),
            prim(self.m2),
            self.scalars,
        );
        (back(p), back(a), back(b))
    }
}

/// [`OptimKernels::scaled_sum`] on `Tensor`s.
struct ScaledSumOp<B: Backend> {
    x: Tensor<B, 1>,
    y: Tensor<B, 1>,
    a: f32,
    b: f32,
}

impl<B: Backend> KernelOp<B> for ScaledSumOp<B> {
    type Output = Tensor<B, 1>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let prim = |t: Tensor<B, 1>| {
            same::<Tensor<B, 1>, Tensor<K, 1>>(t)
                .into_primitive()
                .tensor()
        };
        let out = K::scaled_sum(prim(self.x), prim(self.y), self.a, self.b);
        same(Tensor::<K, 1>::from_primitive(TensorPrimitive::Float(out)))
    }
}
