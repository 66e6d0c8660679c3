//! The CubeCL launch of the MX fake-quantisation kernel (`kimi_burn_kernels::mx`).

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use kimi_burn_kernels::mx as kmx;

use super::{scalar, MxSpec, MX_BLOCK};
use crate::ops::backend::cube::{contiguous_as, elementwise, empty};

/// `X · Q(x / X)` in blocks of 32 along the last axis of `x` (any rank, any float dtype); returns
/// f32, contiguous, same shape.
pub(crate) fn fake_quant_rows<R: CubeRuntime>(x: CubeTensor<R>, spec: MxSpec) -> CubeTensor<R> {
    let x = contiguous_as(x, DType::F32);
    let shape = x.shape();
    let len = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / len.max(1);
    let blocks = len.div_ceil(MX_BLOCK);
    let y = empty(&x, shape, DType::F32);
    if rows * blocks == 0 {
        return y;
    }
    let e = spec.format.elem();
    // The largest element is `max_sig · 2^(emax − mbits)`.
    let max_sig = (e.max / scalar::pow2(e.emax - e.mbits)) as u32;
    // "Ceil" raises the scale when `amax`'s significand exceeds `max / 2^emax` (23-bit fraction).
    let ceil_above = match spec.rule {
        super::MxScaleRule::Floor => u32::MAX,
        super::MxScaleRule::Ceil => {
            ((e.max / scalar::pow2(e.emax) - 1.0) * scalar::pow2(23)) as u32
        }
    };
    let (count, dim) = elementwise(&x, rows * blocks);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kmx::mx_fake_quant::launch_unchecked::<R>(
            &x.client.clone(),
            count,
            dim,
            x.into_array_arg(),
            y.clone().into_array_arg(),
            rows,
            len,
            blocks,
            e.mbits,
            e.emin,
            e.emax,
            max_sig,
            ceil_above,
        )
    };
    y
}
