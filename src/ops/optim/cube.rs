//! [`OptimKernels`] for every CubeCL backend: allocates the outputs and launches the optimiser
//! kernels of `kimi-burn-kernels`.

use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::optim as kop;

use super::{AdamWScalars, OptimKernels};
use crate::ops::backend::cube::{dims, empty};

type T<R> = CubeTensor<R>;

fn adamw<R: CubeRuntime>(
    param: T<R>,
    grad: T<R>,
    m1: T<R>,
    m2: T<R>,
    s: AdamWScalars,
) -> (T<R>, T<R>, T<R>) {
    let param = into_contiguous(param);
    let dtype = param.dtype;
    let same = |t: T<R>| into_contiguous(cast(t, dtype));
    let (grad, m1, m2) = (same(grad), same(m1), same(m2));
    let [len] = dims(&param, "adamw_step takes flat tensors [len]");
    let outs = [(); 3].map(|()| empty(&param, [len], dtype));
    if len > 0 {
        let dim = CubeDim::new_1d(kop::OPTIM_CUBE);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs);
        // all seven buffers hold `len` elements.
        unsafe {
            kop::adamw_step::launch_unchecked::<R>(
                &param.client.clone(),
                calculate_cube_count_elemwise(&param.client, len, dim),
                dim,
                param.into_array_arg(),
                grad.into_array_arg(),
                m1.into_array_arg(),
                m2.into_array_arg(),
                outs[0].clone().into_array_arg(),
                outs[1].clone().into_array_arg(),
                outs[2].clone().into_array_arg(),
                len,
                s.beta1,
                s.f1,
                s.beta2,
                s.f2,
                s.c1,
                s.c2,
                s.eps,
                s.keep,
                s.lr,
                dtype.into(),
            )
        };
    }
    let [p, a, b] = outs;
    (p, a, b)
}

fn scaled_sum<R: CubeRuntime>(x: T<R>, y: T<R>, a: f32, b: f32) -> T<R> {
    let x = into_contiguous(x);
    let dtype = x.dtype;
    let y = into_contiguous(cast(y, dtype));
    let [len] = dims(&x, "scaled_sum takes flat tensors [len]");
    let out = empty(&x, [len], dtype);
    if len > 0 {
        let dim = CubeDim::new_1d(kop::OPTIM_CUBE);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs);
        // the three buffers hold `len` elements.
        unsafe {
            kop::scaled_sum::launch_unchecked::<R>(
                &x.client.clone(),
                calculate_cube_count_elemwise(&x.client, len, dim),
                dim,
                x.into_array_arg(),
                y.into_array_arg(),
                out.clone().into_array_arg(),
                len,
                a,
                b,
                dtype.into(),
            )
        };
    }
    out
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> OptimKernels
    for CubeBackend<R, F, I, BT>
{
    fn adamw_step(
        param: T<R>,
        grad: T<R>,
        m1: T<R>,
        m2: T<R>,
        scalars: AdamWScalars,
    ) -> (T<R>, T<R>, T<R>) {
        adamw(param, grad, m1, m2, scalars)
    }

    fn scaled_sum(x: T<R>, y: T<R>, a: f32, b: f32) -> T<R> {
        scaled_sum(x, y, a, b)
    }
}
