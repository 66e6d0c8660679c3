//! [`RmsNormKernels`] for every CubeCL backend: allocates outputs and launches the RMSNorm
//! kernels of `kimi-burn-kernels`.

use burn::tensor::DType;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::rms_norm as krn;

use super::RmsNormKernels;
use crate::ops::backend::cube::{column_sum, contiguous_as, dims, empty};

type T<R> = CubeTensor<R>;

/// `[rows, d]` of the input.
fn dims2<R: CubeRuntime>(x: &T<R>) -> [usize; 2] {
    dims(x, "the RMSNorm kernels take x: [rows, d]")
}

/// Cubes of `RMS_NORM_CUBE` units covering one unit per row.
fn per_unit<R: CubeRuntime>(x: &T<R>, rows: usize) -> cubecl::CubeCount {
    calculate_cube_count_elemwise(&x.client, rows, CubeDim::new_1d(krn::RMS_NORM_CUBE))
}

fn forward<R: CubeRuntime>(x: T<R>, weight: T<R>, eps: f64) -> T<R> {
    let x = into_contiguous(x);
    let dtype = x.dtype;
    let weight = contiguous_as(weight, DType::F32);
    let [rows, d] = dims2(&x);
    let out = empty(&x, [rows, d], dtype);
    if rows * d > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            krn::rms_norm_forward::launch_unchecked::<R>(
                &x.client.clone(),
                per_unit(&x, rows),
                CubeDim::new_1d(krn::RMS_NORM_CUBE),
                x.into_array_arg(),
                weight.into_array_arg(),
                out.clone().into_array_arg(),
                rows,
                d,
                eps as f32,
                dtype.into(),
            )
        };
    }
    out
}

fn backward<R: CubeRuntime>(x: T<R>, weight: T<R>, grad: T<R>, eps: f64) -> (T<R>, T<R>) {
    let x = into_contiguous(x);
    let dtype = x.dtype;
    let w_dtype = weight.dtype;
    let weight = contiguous_as(weight, DType::F32);
    let grad = into_contiguous(cast(grad, dtype));
    let [rows, d] = dims2(&x);
    let dx = empty(&x, [rows, d], dtype);
    let partial = empty(&x, [rows.max(1), d], DType::F32);
    let client = x.client.clone();
    if rows * d > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            krn::rms_norm_backward::launch_unchecked::<R>(
                &client,
                per_unit(&x, rows),
                CubeDim::new_1d(krn::RMS_NORM_CUBE),
                x.into_array_arg(),
                weight.into_array_arg(),
                grad.into_array_arg(),
                dx.clone().into_array_arg(),
                partial.clone().into_array_arg(),
                rows,
                d,
                eps as f32,
                dtype.into(),
            )
        };
    }
    let dw = column_sum(partial, if rows * d > 0 { rows } else { 0 }, [d]);
    (dx, cast(dw, w_dtype))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RmsNormKernels
    for CubeBackend<R, F, I, BT>
{
    fn rms_norm_forward(x: T<R>, weight: T<R>, eps: f64) -> T<R> {
        forward(x, weight, eps)
    }

    fn rms_norm_backward(x: T<R>, weight: T<R>, grad: T<R>, eps: f64) -> (T<R>, T<R>) {
        backward(x, weight, grad, eps)
    }
}
