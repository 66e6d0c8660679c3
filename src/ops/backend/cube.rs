//! Tensor-primitive helpers of the CubeCL launch glue, shared by the MoE and KDA kernels.
//!
//! # Unchecked launches
//!
//! Every kernel of `kimi-burn-kernels` is launched with `launch_unchecked`: CubeCL's checked
//! mode wraps each global-array access in a bounds test (a read past the buffer gives 0, a write
//! is dropped) and bounds every loop, which cost a quarter of the training step on lavapipe.
//! Each kernel bounds its indices itself instead, and the launch sites keep to its contract:
//!
//! - units past the logical size exit (`terminate!`) or test every access (`load_f32`-style
//!   guards, `lanes_below` in the grouped matmuls);
//! - indices read from device data are checked where they are made: an expert index outside
//!   `0..n` is a masked pair in `moe_block_ranks` and `moe_place`, `inv`'s `NONE` is tested
//!   before every gather, the QB histogram clamps its bin as an integer (a NaN score included);
//! - the host builds the tables the KDA kernels loop over (`chunk_tok`, `chunk_len`,
//!   `seq_start`, `tok_seq`) from validated sequence offsets, and checks every shape first;
//! - no kernel relies on an out-of-bounds read returning 0.
//!
//! CubeCL's own switch turns the checks back on for every launch, to chase a suspected
//! out-of-bounds access: `check_mode = "enforce"` in the `[compilation]` table of a
//! `cubecl.toml` in the working directory or one of its parents (or under `[cubecl.compilation]`
//! in a `burn.toml`).

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeCount, CubeDim};

type T<R> = CubeTensor<R>;

/// A contiguous (row-major, unpadded) uninitialised tensor on `like`'s device: the kernels index
/// flat arrays, so the pitched layouts `empty_device_dtype` may pick are not allowed here.
pub(crate) fn empty<R: CubeRuntime>(like: &T<R>, shape: impl Into<Shape>, dtype: DType) -> T<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// `t` cast to `dtype` (a no-op when it already is) and made contiguous.
pub(crate) fn contiguous_as<R: CubeRuntime>(t: T<R>, dtype: DType) -> T<R> {
    into_contiguous(cast(t, dtype))
}

/// A u32 buffer holding `values` (at least one element, so it can stand in as a dummy).
pub(crate) fn u32_buffer<R: CubeRuntime>(like: &T<R>, values: &[u32]) -> T<R> {
    let data = if values.is_empty() {
        vec![0]
    } else {
        values.to_vec()
    };
    from_u32(like, &data, Shape::new([data.len()]))
}

/// A zero-filled u32 tensor of `shape`.
pub(crate) fn zeros_u32<R: CubeRuntime>(like: &T<R>, shape: Shape) -> T<R> {
    let data = vec![0u32; shape.num_elements().max(1)];
    from_u32(like, &data, shape)
}

/// A one-element f32 buffer holding `value` (a stand-in for an absent optional input).
pub(crate) fn f32_scalar<R: CubeRuntime>(like: &T<R>, value: f32) -> T<R> {
    let handle = like.client.create_from_slice(f32::as_bytes(&[value]));
    T::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([1]),
        handle,
        DType::F32,
    )
}

fn from_u32<R: CubeRuntime>(like: &T<R>, data: &[u32], shape: Shape) -> T<R> {
    let handle = like.client.create_from_slice(u32::as_bytes(data));
    T::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        DType::U32,
    )
}

/// The launch geometry of `units` independent units.
pub(crate) fn elementwise<R: CubeRuntime>(t: &T<R>, units: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, units.max(1));
    (calculate_cube_count_elemwise(&t.client, units, dim), dim)
}

/// `rows` cubes spread over the grid's dimensions (the kernels read the linear `CUBE_POS` and exit
/// past `rows`).
pub(crate) fn per_row<R: CubeRuntime>(t: &T<R>, rows: usize) -> CubeCount {
    cubecl::server::CubeCountSelection::new(&t.client, rows as u32).cube_count()
}

/// `Σ_row x[row, c]` of the contiguous f32 `x: [rows, cols]` (its first `rows · cols` values) as
/// a new f32 tensor of `shape` (`cols` elements), in row order, so reruns are bit-identical. Each launch of
/// [`column_sum`](fn@kimi_burn_kernels::kda::column_sum) adds blocks of
/// [`COLUMN_SUM_BLOCK`](kimi_burn_kernels::kda::COLUMN_SUM_BLOCK) rows and the next one sums the
/// blocks, so no unit passes lavapipe's loop limit however long the columns are. Zero rows give
/// zeros.
pub(crate) fn column_sum<R: CubeRuntime>(x: T<R>, rows: usize, shape: impl Into<Shape>) -> T<R> {
    use kimi_burn_kernels::kda as kkda;
    let shape: Shape = shape.into();
    let cols = shape.num_elements();
    let block = kkda::COLUMN_SUM_BLOCK;
    let (mut x, mut rows) = (x, rows);
    loop {
        let blocks = rows.div_ceil(block).max(1);
        let out = if blocks == 1 {
            empty(&x, shape.clone(), DType::F32)
        } else {
            empty(&x, [blocks * cols], DType::F32)
        };
        if cols > 0 {
            let (count, dim) = elementwise(&x, blocks * cols);
            // SAFETY: the kernel bounds every index itself ("Unchecked launches" above); `x`
            // holds at least `rows · cols` values.
            unsafe {
                kkda::column_sum::launch_unchecked::<R>(
                    &x.client.clone(),
                    count,
                    dim,
                    x.into_array_arg(),
                    out.clone().into_array_arg(),
                    rows,
                    cols,
                    block,
                )
            };
        }
        if blocks == 1 {
            return out;
        }
        (x, rows) = (out, blocks);
    }
}

/// The dims of a rank-`D` tensor; `what` names the layout a kernel expects, for the panic.
pub(crate) fn dims<R: CubeRuntime, const D: usize>(t: &T<R>, what: &str) -> [usize; D] {
    let s = t.shape();
    assert_eq!(s.num_dims(), D, "{what}: expected rank {D}, got {:?}", s);
    std::array::from_fn(|i| s[i])
}
