//! MX (OCP Microscaling v1.0) fake quantisation for quantisation-aware training (design §9).
//!
//! Blocks of [`MX_BLOCK`] = 32 consecutive values along one axis share a power-of-two scale `X`
//! (stored as E8M0, `2^-127 … 2^127`); each value is stored as an element `Q(x / X)` of an FP4
//! (E2M1: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) or FP8 (E4M3, max 448; E5M2, max 57344) format, rounded
//! to nearest with ties to even and saturating at the format's largest value. A row whose length
//! is not a multiple of 32 ends with a shorter block of its own.
//!
//! [`mx_fake_quant`] returns `X · Q(x / X)` in the input dtype with a straight-through gradient;
//! [`quantize_mx`] / [`dequantize_mx`] pack to and from real MX storage, and
//! `dequantize_mx(quantize_mx(x)) == mx_fake_quant(x)` bit for bit. Every zero comes out as `+0`.
//!
//! Paths, all exact and so bit-identical: on the CPU backends a host loop; on the CubeCL backends
//! a kernel with one unit per block that works on the f32 bits (`kimi_burn_kernels::mx`); elsewhere,
//! and with the kernels switched off, tensor ops (powers of two by repeated exact scaling, the
//! element grid by comparisons with its binade bounds). The backward is the identity (or a mask),
//! so it needs no kernel.
//!
//! [`QatConfig`] applies these to the matmuls of the experts (and of any `Linear`) for
//! quantisation-aware training.

#[cfg(feature = "cubecl-kernels")]
pub(crate) mod cube;
mod pack;
mod qat;
pub(crate) mod scalar;

use burn::tensor::{backend::Backend, DType, Tensor};

use crate::error::{Error, Result};
use crate::ops::backend::host::HostArray;
use crate::ops::backend::{self, FusedKernels, FusedOp, KernelOp, KernelPath};
use crate::ops::layout;
use crate::ops::precision::{restore, widen};

pub(crate) use pack::{dequantize_host, pack_rows};
pub use pack::{dequantize_mx, quantize_mx, MxTensor};
pub use qat::{MxSpec, QatConfig};

/// Values per MX block.
pub const MX_BLOCK: usize = 32;

/// The element format of an MX block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum MxFormat {
    /// MXFP4: FP4 E2M1, values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
    Fp4E2M1,
    /// MXFP8 with FP8 E4M3 (no infinities, max 448).
    Fp8E4M3,
    /// MXFP8 with FP8 E5M2 (max 57344).
    Fp8E5M2,
}

/// How a block's shared scale is chosen from its largest magnitude `amax`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum MxScaleRule {
    /// The specification's rule `X = 2^(floor(log2 amax) − emax_elem)`: the largest values of a
    /// block may be clipped to the format's maximum, by up to 25% for E2M1.
    Floor,
    /// `X = 2^ceil(log2(amax / max_elem))`: the smallest scale that clips nothing.
    Ceil,
}

/// The gradient of [`mx_fake_quant_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MxGradient {
    /// The upstream gradient unchanged (straight-through estimator).
    #[default]
    StraightThrough,
    /// Straight through, but zero where a value was clipped to the format's maximum.
    ZeroWhereClipped,
}

/// MX fake quantisation `X · Q(x / X)` in blocks of 32 along `axis`, with a straight-through
/// gradient. `x`: any shape and float dtype; returns the same shape and dtype (computed in f32, or
/// f64 for f64 input).
///
/// Inputs must be finite: a block holding NaN or an infinity gives unspecified values (use
/// [`try_mx_fake_quant`], which checks, where that can happen).
///
/// # Panics
/// If `axis ≥ D`.
pub fn mx_fake_quant<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
) -> Tensor<B, D> {
    mx_fake_quant_with(x, format, rule, axis, MxGradient::StraightThrough)
}

/// [`mx_fake_quant`] that rejects a bad axis and non-finite input (one host read of the input's
/// finiteness) with an [`Error`].
pub fn try_mx_fake_quant<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
) -> Result<Tensor<B, D>> {
    check_axis::<D>(axis)?;
    let finite = crate::sync::read(x.clone().is_finite().all())
        .iter::<bool>()
        .all(|b| b);
    if !finite {
        return Err(Error::NonFinite {
            what: "mx_fake_quant input".into(),
            detail: "NaN or an infinity: an MX block scale is undefined".into(),
        });
    }
    Ok(mx_fake_quant(x, format, rule, axis))
}

/// [`mx_fake_quant`] with a choice of gradient.
///
/// # Panics
/// If `axis ≥ D`.
pub fn mx_fake_quant_with<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
    gradient: MxGradient,
) -> Tensor<B, D> {
    check_axis::<D>(axis).unwrap_or_else(|e| panic!("{e}"));
    let (xf, dtype) = widen(x);
    // On the CPU backends one host op with an identity backward (no composite for the gradient).
    let xf = if gradient == MxGradient::StraightThrough {
        let op = HostFakeQuant { format, rule, axis };
        match backend::host::try_run(&op, [xf]) {
            Ok(y) => return restore(y, dtype),
            Err([xf]) => xf,
        }
    } else {
        xf
    };
    let values = fake_values(xf.clone().detach(), format, rule, axis);
    // Forward: `values + (x − x)`, which is `values` exactly; backward: the upstream gradient.
    let through = xf.clone().sub(xf.clone().detach());
    let through = match gradient {
        MxGradient::StraightThrough => through,
        MxGradient::ZeroWhereClipped => {
            let clipped = clipped_mask(xf.detach(), format, rule, axis);
            through.mask_fill(clipped, 0.0)
        }
    };
    restore(values.add(through), dtype)
}

fn check_axis<const D: usize>(axis: usize) -> Result<()> {
    if axis >= D {
        return Err(Error::argument(
            "axis",
            format!("must be below the rank {D}, got {axis}"),
        ));
    }
    Ok(())
}

/// The fake-quantised values (no gradient), f32 or f64 in, same dtype out.
fn fake_values<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
) -> Tensor<B, D> {
    if backend::host::is_cpu_backend::<B>() && x.dtype() == DType::F32 {
        // The host op works along any axis in place: no transpose.
        let op = HostFakeQuant { format, rule, axis };
        return backend::host::run(&op, [x.into_primitive().tensor()]);
    }
    let last = D - 1;
    let x = x.swap_dims(axis, last);
    let y = if x.dtype() == DType::F32 {
        let dims = x.dims();
        let len = dims[D - 1];
        let rows = dims.iter().product::<usize>() / len.max(1);
        let op = MxOp {
            x: layout::reshape::<B, D, 2>(x, [rows, len]),
            spec: MxSpec::new(format, rule),
        };
        match backend::on_kernels::<B, _>(op) {
            Ok(y) => {
                backend::record(FusedOp::MxFakeQuant, KernelPath::Kernel);
                y.reshape(dims)
            }
            Err(op) => {
                backend::record(FusedOp::MxFakeQuant, KernelPath::Reference);
                layout::reshape(reference_values(op.x, format, rule), dims)
            }
        }
    } else {
        reference_values(x, format, rule)
    };
    y.swap_dims(axis, last)
}

/// The CPU host op: the exact loop along `axis` forward, the upstream gradient backward.
#[derive(Debug, Clone, Copy)]
struct HostFakeQuant {
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
}

impl backend::host::HostOp<1> for HostFakeQuant {
    type Saved = ();

    fn forward(&self, [x]: &[HostArray; 1], save: bool) -> (HostArray, Option<()>) {
        let shape = &x.shape;
        let outer = shape[..self.axis].iter().product();
        let inner = shape[self.axis + 1..].iter().product();
        let mut data = x.data.clone();
        scalar::fake_quant_axis(
            &mut data,
            [outer, shape[self.axis], inner],
            self.format,
            self.rule,
        );
        let out = HostArray {
            data,
            shape: shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, _: &[HostArray; 1], _: &(), grad: &HostArray) -> [HostArray; 1] {
        [grad.clone()]
    }
}

/// [`MoeKernels::mx_fake_quant`](crate::ops::moe::MoeKernels::mx_fake_quant) on a `[rows, len]`
/// f32 tensor.
struct MxOp<B: Backend> {
    x: Tensor<B, 2>,
    spec: MxSpec,
}

impl<B: Backend> KernelOp<B> for MxOp<B> {
    type Output = Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Tensor<B, 2> {
        use burn::tensor::TensorPrimitive;
        let x: Tensor<K, 2> = backend::same(self.x);
        let y = K::mx_fake_quant(x.into_primitive().tensor(), self.spec);
        backend::same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(y)))
    }
}

/// Bounds for the binary decomposition of exponents in `[-191, 127]`.
const EXPONENT_BITS: [i32; 7] = [64, 32, 16, 8, 4, 2, 1];

/// `x · 2^s` for an integer-valued `s` in `[-127, 127]` (broadcast), exactly: one multiplication by
/// `2^(±b)` per set bit of `|s|`, so every intermediate is exact when the result is.
fn scale_pow2<B: Backend, const D: usize>(mut x: Tensor<B, D>, s: Tensor<B, D>) -> Tensor<B, D> {
    let neg = s.clone().lower_elem(0.0);
    let mut m = s.abs();
    for b in EXPONENT_BITS {
        let bit = m.clone().greater_equal_elem(b as f64);
        m = m.sub(bit.clone().float().mul_scalar(b as f64));
        let factor = x
            .ones_like()
            .mask_fill(
                bit.clone().bool_and(neg.clone().bool_not()),
                scalar::pow2(b) as f64,
            )
            .mask_fill(bit.bool_and(neg.clone()), scalar::pow2(-b) as f64);
        x = x.mul(factor);
    }
    x
}

/// `(r, e)` with `amax = r · 2^e`, `r ∈ [1, 2)` (`r = 0`, `e = 0` for zero), exactly, for finite
/// `amax ≥ 0` down to the smallest subnormal.
fn normalise<B: Backend, const D: usize>(amax: Tensor<B, D>) -> (Tensor<B, D>, Tensor<B, D>) {
    let mut r = amax;
    let mut e = r.zeros_like();
    for b in EXPONENT_BITS {
        let m = r.clone().greater_equal_elem(scalar::pow2(b) as f64);
        r = r
            .clone()
            .mask_where(m.clone(), r.mul_scalar(scalar::pow2(-b) as f64));
        e = e.add(m.float().mul_scalar(b as f64));
    }
    for b in [64, 64, 32, 16, 8, 4, 2, 1] {
        let m = r
            .clone()
            .lower_elem(scalar::pow2(1 - b) as f64)
            .bool_and(r.clone().greater_elem(0.0));
        r = r
            .clone()
            .mask_where(m.clone(), r.mul_scalar(scalar::pow2(b) as f64));
        e = e.sub(m.float().mul_scalar(b as f64));
    }
    (r, e)
}

/// The last axis as `[rows, blocks, 32]` (zero-padded) and the original dims.
fn blocks<B: Backend, const D: usize>(x: Tensor<B, D>) -> (Tensor<B, 3>, [usize; D]) {
    let dims = x.dims();
    let len = dims[D - 1];
    let rows = dims.iter().product::<usize>() / len.max(1);
    let nb = len.div_ceil(MX_BLOCK);
    let flat: Tensor<B, 2> = layout::reshape(x, [rows, len]);
    let padded = if nb * MX_BLOCK > len {
        let pad = Tensor::zeros([rows, nb * MX_BLOCK - len], (&flat.device(), flat.dtype()));
        Tensor::cat(vec![flat, pad], 1)
    } else {
        flat
    };
    (padded.reshape([rows, nb, MX_BLOCK]), dims)
}

/// Back from [`blocks`].
fn unblocks<B: Backend, const D: usize>(y: Tensor<B, 3>, dims: [usize; D]) -> Tensor<B, D> {
    let [rows, nb, _] = y.dims();
    let len = dims[D - 1];
    let flat = y.reshape([rows, nb * MX_BLOCK]).narrow(1, 0, len);
    layout::reshape(flat, dims)
}

/// The scale exponent of every block `[rows, blocks, 1]` (0 for all-zero blocks).
fn block_exponents<B: Backend>(
    xb: &Tensor<B, 3>,
    format: MxFormat,
    rule: MxScaleRule,
) -> Tensor<B, 3> {
    let e = format.elem();
    let amax = xb.clone().abs().max_dim(2);
    let zero = amax.clone().equal_elem(0.0);
    let (r, top) = normalise(amax);
    let mut s = top.sub_scalar(e.emax as f64);
    if rule == MxScaleRule::Ceil {
        let beyond = r
            .mul_scalar(scalar::pow2(e.emax) as f64)
            .greater_elem(e.max as f64);
        s = s.add(beyond.float());
    }
    s.clamp(-127.0, 127.0).mask_fill(zero, 0.0)
}

/// The element grid: `v` rounded to nearest (ties to even), saturating.
fn quantize_elements<B: Backend>(v: Tensor<B, 3>, format: MxFormat) -> Tensor<B, 3> {
    let e = format.elem();
    let a = v.clone().abs();
    let mut step = a
        .zeros_like()
        .add_scalar(scalar::pow2(e.emin - e.mbits) as f64);
    for k in e.emin + 1..=e.emax {
        let above = a.clone().greater_equal_elem(scalar::pow2(k) as f64);
        step = step.mask_fill(above, scalar::pow2(k - e.mbits) as f64);
    }
    let q = a
        .div(step.clone())
        .round()
        .mul(step)
        .clamp_max(e.max as f64);
    q.clone().mask_where(v.lower_elem(0.0), q.neg())
}

/// The tensor-op form over the last axis (exact: see the module docs).
fn reference_values<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
) -> Tensor<B, D> {
    let (xb, dims) = blocks(x);
    let s = block_exponents(&xb, format, rule);
    let v = scale_pow2(xb, s.clone().neg().expand_like_last());
    let q = quantize_elements(v, format);
    let y = scale_pow2(q, s.expand_like_last()).add_scalar(0.0);
    unblocks(y, dims)
}

/// Where `|x / X|` exceeds the element maximum (the values [`MxGradient::ZeroWhereClipped`] stops).
fn clipped_mask<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    format: MxFormat,
    rule: MxScaleRule,
    axis: usize,
) -> Tensor<B, D, burn::tensor::Bool> {
    let last = D - 1;
    let (xb, dims) = blocks(x.swap_dims(axis, last));
    let s = block_exponents(&xb, format, rule);
    let v = scale_pow2(xb, s.neg().expand_like_last());
    let clipped = v.abs().greater_elem(format.elem().max as f64).float();
    unblocks(clipped, dims)
        .swap_dims(axis, last)
        .equal_elem(1.0)
}

/// Broadcasts `[rows, blocks, 1]` over the block.
trait ExpandLast<B: Backend> {
    fn expand_like_last(self) -> Tensor<B, 3>;
}

impl<B: Backend> ExpandLast<B> for Tensor<B, 3> {
    fn expand_like_last(self) -> Tensor<B, 3> {
        let [rows, nb, _] = self.dims();
        self.expand([rows, nb, MX_BLOCK])
    }
}
