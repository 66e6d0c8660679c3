//! [`AttnResKernels`] for every CubeCL backend: allocates outputs and launches the Attention
//! Residuals kernels of `kimi-burn-kernels`.

use burn::tensor::DType;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::attn_res as kar;

use super::AttnResKernels;
use crate::ops::backend::cube::{column_sum, contiguous_as, dims, empty};

type T<R> = CubeTensor<R>;

/// Cubes of `ATTN_RES_CUBE` units covering one unit per row.
fn per_unit<R: CubeRuntime>(v: &T<R>, rows: usize) -> cubecl::CubeCount {
    calculate_cube_count_elemwise(&v.client, rows, CubeDim::new_1d(kar::ATTN_RES_CUBE))
}

/// `[N, rows, d]` of the stacked sources.
fn dims3<R: CubeRuntime>(v: &T<R>) -> [usize; 3] {
    dims(v, "the AttnRes kernels take stacked sources [N, rows, d]")
}

fn forward<R: CubeRuntime>(v: T<R>, query: T<R>, eps: f64) -> T<R> {
    let v = into_contiguous(v);
    let dtype = v.dtype;
    let query = contiguous_as(query, DType::F32);
    let [n, rows, d] = dims3(&v);
    let out = empty(&v, [rows, d], dtype);
    let scores = empty(&v, [n.max(1), rows.max(1)], DType::F32);
    if n * rows * d > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kar::attn_res_forward::launch_unchecked::<R>(
                &v.client.clone(),
                per_unit(&v, rows),
                CubeDim::new_1d(kar::ATTN_RES_CUBE),
                v.into_array_arg(),
                query.into_array_arg(),
                out.clone().into_array_arg(),
                scores.into_array_arg(),
                n,
                rows,
                d,
                eps as f32,
                dtype.into(),
            )
        };
    }
    out
}

fn backward<R: CubeRuntime>(v: T<R>, query: T<R>, grad: T<R>, eps: f64) -> (T<R>, T<R>) {
    let v = into_contiguous(v);
    let dtype = v.dtype;
    let q_dtype = query.dtype;
    let query = contiguous_as(query, DType::F32);
    let grad = into_contiguous(cast(grad, dtype));
    let [n, rows, d] = dims3(&v);
    let dv = empty(&v, [n, rows, d], dtype);
    let partial = empty(&v, [(n * rows).max(1), d], DType::F32);
    let scores = empty(&v, [n.max(1), rows.max(1)], DType::F32);
    let inv_rms = empty(&v, [n.max(1), rows.max(1)], DType::F32);
    let weights = empty(&v, [n.max(1), rows.max(1)], DType::F32);
    let client = v.client.clone();
    if n * rows * d > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kar::attn_res_backward::launch_unchecked::<R>(
                &client,
                per_unit(&v, rows),
                CubeDim::new_1d(kar::ATTN_RES_CUBE),
                v.into_array_arg(),
                query.into_array_arg(),
                grad.into_array_arg(),
                dv.clone().into_array_arg(),
                partial.clone().into_array_arg(),
                scores.into_array_arg(),
                inv_rms.into_array_arg(),
                weights.into_array_arg(),
                n,
                rows,
                d,
                eps as f32,
                dtype.into(),
            )
        };
    }
    let dq = column_sum(partial, if n * rows * d > 0 { n * rows } else { 0 }, [d]);
    (dv, cast(dq, q_dtype))
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttnResKernels
    for CubeBackend<R, F, I, BT>
{
    fn attn_res_forward(v: T<R>, query: T<R>, eps: f64) -> T<R> {
        forward(v, query, eps)
    }

    fn attn_res_backward(v: T<R>, query: T<R>, grad: T<R>, eps: f64) -> (T<R>, T<R>) {
        backward(v, query, grad, eps)
    }
}
