//! [`CrossEntropyKernels`] for every CubeCL backend: allocates outputs and launches the
//! cross-entropy kernels of `kimi-burn-kernels`.

use burn::tensor::DType;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::cross_entropy as kce;

use super::CrossEntropyKernels;
use crate::ops::backend::cube::{contiguous_as, dims, empty};

type T<R> = CubeTensor<R>;

/// `[rows, vocab]` of the logits.
fn dims2<R: CubeRuntime>(logits: &T<R>) -> [usize; 2] {
    dims(
        logits,
        "the cross-entropy kernels take logits: [rows, vocab]",
    )
}

/// Cubes of `CROSS_ENTROPY_CUBE` units covering `units` units.
fn cubes<R: CubeRuntime>(x: &T<R>, units: usize) -> cubecl::CubeCount {
    calculate_cube_count_elemwise(&x.client, units, CubeDim::new_1d(kce::CROSS_ENTROPY_CUBE))
}

fn forward<R: CubeRuntime>(logits: T<R>, targets: T<R>, ignore: i32) -> (T<R>, T<R>) {
    let logits = into_contiguous(logits);
    let targets = into_contiguous(targets);
    let dtype = logits.dtype;
    let [rows, vocab] = dims2(&logits);
    let loss = empty(&logits, [rows], dtype);
    let lse = empty(&logits, [rows], DType::F32);
    if rows * vocab > 0 {
        let split = kce::split_for(vocab);
        let top = empty(&logits, [rows * split], DType::F32);
        let sum = empty(&logits, [rows * split], DType::F32);
        let t_dtype = targets.dtype;
        let client = logits.client.clone();
        let dim = CubeDim::new_1d(kce::CROSS_ENTROPY_CUBE);
        // SAFETY: the kernels bound every index themselves, the targets included ("Unchecked
        // launches", ops/backend/cube.rs).
        unsafe {
            kce::cross_entropy_partials::launch_unchecked::<R>(
                &client,
                cubes(&logits, rows * split),
                dim,
                logits.clone().into_array_arg(),
                top.clone().into_array_arg(),
                sum.clone().into_array_arg(),
                rows,
                vocab,
                split,
                dtype.into(),
            );
            kce::cross_entropy_finish::launch_unchecked::<R>(
                &client,
                cubes(&logits, rows),
                dim,
                logits.into_array_arg(),
                targets.into_array_arg(),
                top.into_array_arg(),
                sum.into_array_arg(),
                loss.clone().into_array_arg(),
                lse.clone().into_array_arg(),
                rows,
                vocab,
                split,
                ignore,
                f32::NAN,
                [dtype.into(), t_dtype.into()],
            )
        };
    }
    (loss, lse)
}

fn backward<R: CubeRuntime>(
    logits: T<R>,
    targets: T<R>,
    lse: T<R>,
    grad: T<R>,
    ignore: i32,
) -> T<R> {
    let logits = into_contiguous(logits);
    let targets = into_contiguous(targets);
    let dtype = logits.dtype;
    let lse = contiguous_as(lse, DType::F32);
    let grad = into_contiguous(cast(grad, dtype));
    let [rows, vocab] = dims2(&logits);
    let dlogits = empty(&logits, [rows, vocab], dtype);
    if rows * vocab > 0 {
        let t_dtype = targets.dtype;
        let split = kce::split_for(vocab);
        // SAFETY: as in the forward.
        unsafe {
            kce::cross_entropy_backward::launch_unchecked::<R>(
                &logits.client.clone(),
                cubes(&logits, rows * split),
                CubeDim::new_1d(kce::CROSS_ENTROPY_CUBE),
                logits.into_array_arg(),
                targets.into_array_arg(),
                lse.into_array_arg(),
                grad.into_array_arg(),
                dlogits.clone().into_array_arg(),
                rows,
                vocab,
                split,
                ignore,
                f32::NAN,
                [dtype.into(), t_dtype.into()],
            )
        };
    }
    dlogits
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> CrossEntropyKernels
    for CubeBackend<R, F, I, BT>
{
    fn cross_entropy_forward(logits: T<R>, targets: T<R>, ignore: i32) -> (T<R>, T<R>) {
        forward(logits, targets, ignore)
    }

    fn cross_entropy_backward(
        logits: T<R>,
        targets: T<R>,
        lse: T<R>,
        grad: T<R>,
        ignore: i32,
    ) -> T<R> {
        backward(logits, targets, lse, grad, ignore)
    }
}
