//! [`KdaKernels`] for every CubeCL backend: allocates outputs and launches the KDA kernels of
//! `kimi-burn-kernels`.

use burn::tensor::{DType, TensorMetadata};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::kda as kkda;

use super::cube_chunk as chunk;
use super::cube_chunk::{dims4, f32_contiguous, state_buffer};
use super::kernels::{KdaChunkGrads, KdaChunkSaved, KdaChunkWithin, KdaKernelInput, KdaKernels};
use crate::ops::backend::cube::{column_sum, empty, per_row, u32_buffer};

fn dims2<R: CubeRuntime>(t: &T<R>) -> [usize; 2] {
    crate::ops::backend::cube::dims(t, "the gated norm kernels take [rows, V] tensors")
}

type T<R> = CubeTensor<R>;

fn starts_u32(starts: &[usize]) -> Vec<u32> {
    starts
        .iter()
        .map(|&s| u32::try_from(s).expect("KDA kernels: token offsets must fit in u32"))
        .collect()
}

fn recurrent<R: CubeRuntime>(input: KdaKernelInput<CubeBackend<R, f32, i32, u32>>) -> (T<R>, T<R>) {
    let q = f32_contiguous(input.q);
    let k = f32_contiguous(input.k);
    let v = f32_contiguous(input.v);
    let g = f32_contiguous(input.g);
    let beta = f32_contiguous(input.beta);
    let [b, t, h, kd] = dims4(&q);
    let vd = dims4(&v)[3];
    let n = input.seq_starts.len() - 1;
    let state = state_buffer(&q, input.initial_state, [n, h, kd, vd]);
    let out = empty(&q, [b, t, h, vd], DType::F32);
    let vt = kkda::recurrent_columns(kd);
    let starts = u32_buffer(&q, &starts_u32(&input.seq_starts));
    let longest = input
        .seq_starts
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or(0);
    let window = kkda::recurrent_window(kd, vt);
    if n * h * vd > 0 {
        for lo in (0..longest).step_by(window) {
            // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
            unsafe {
                kkda::kda_recurrent::launch_unchecked::<R>(
                    &q.client,
                    per_row(&q, vd.div_ceil(vt) * n * h),
                    CubeDim::new_1d(vt as u32),
                    q.clone().into_array_arg(),
                    k.clone().into_array_arg(),
                    v.clone().into_array_arg(),
                    g.clone().into_array_arg(),
                    beta.clone().into_array_arg(),
                    starts.clone().into_array_arg(),
                    state.clone().into_array_arg(),
                    out.clone().into_array_arg(),
                    h,
                    vd.div_ceil(vt),
                    n * h,
                    vd,
                    lo,
                    window,
                    kd,
                    vt,
                )
            };
        }
    }
    (out, state)
}

fn norm_forward<R: CubeRuntime>(o: T<R>, z: T<R>, weight: T<R>, eps: f64) -> T<R> {
    let o = into_contiguous(o);
    let dtype = o.dtype;
    let z = into_contiguous(cast(z, dtype));
    let weight = f32_contiguous(weight);
    let [rows, cols] = dims2(&o);
    let y = empty(&o, [rows, cols], dtype);
    if rows * cols > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::rms_norm_gated_forward::launch_unchecked::<R>(
                &o.client.clone(),
                per_row(&o, rows),
                CubeDim::new_1d(kkda::NORM_CUBE),
                o.into_array_arg(),
                z.into_array_arg(),
                weight.into_array_arg(),
                y.clone().into_array_arg(),
                rows,
                cols,
                eps as f32,
                dtype.into(),
            )
        };
    }
    y
}

fn norm_backward<R: CubeRuntime>(
    o: T<R>,
    z: T<R>,
    weight: T<R>,
    grad: T<R>,
    eps: f64,
) -> (T<R>, T<R>, T<R>) {
    let o = into_contiguous(o);
    let dtype = o.dtype;
    let (z_dtype, w_dtype) = (z.dtype, weight.dtype);
    let z = into_contiguous(cast(z, dtype));
    let grad = into_contiguous(cast(grad, dtype));
    let weight = f32_contiguous(weight);
    let [rows, cols] = dims2(&o);
    let d_o = empty(&o, [rows, cols], dtype);
    let d_z = empty(&o, [rows, cols], dtype);
    let partial = empty(&o, [rows.max(1), cols], DType::F32);
    let client = o.client.clone();
    if rows * cols > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::rms_norm_gated_backward::launch_unchecked::<R>(
                &client,
                per_row(&o, rows),
                CubeDim::new_1d(kkda::NORM_CUBE),
                o.into_array_arg(),
                z.into_array_arg(),
                weight.into_array_arg(),
                grad.into_array_arg(),
                d_o.clone().into_array_arg(),
                d_z.clone().into_array_arg(),
                partial.clone().into_array_arg(),
                rows,
                cols,
                eps as f32,
                dtype.into(),
            )
        };
    }
    let dw = column_sum(partial, if rows * cols > 0 { rows } else { 0 }, [cols]);
    (d_o, cast(d_z, z_dtype), cast(dw, w_dtype))
}

/// The sequence of every token (`[tokens]`, u32) on the device.
fn token_sequences<R: CubeRuntime>(like: &T<R>, seq_starts: &[usize]) -> T<R> {
    let tok_seq: Vec<u32> = seq_starts
        .windows(2)
        .enumerate()
        .flat_map(|(i, w)| std::iter::repeat_n(i as u32, w[1] - w[0]))
        .collect();
    u32_buffer(like, &tok_seq)
}

/// `tail` in `dtype`, contiguous, or a one-element stand-in the kernels do not read.
fn tail_or_stub<R: CubeRuntime>(like: &T<R>, tail: Option<T<R>>, dtype: DType) -> T<R> {
    match tail {
        Some(t) => into_contiguous(cast(t, dtype)),
        None => empty(like, [1], dtype),
    }
}

fn short_conv_grad<R: CubeRuntime>(
    x: T<R>,
    weight: T<R>,
    tail: Option<T<R>>,
    seq_starts: &[usize],
    dy: T<R>,
) -> (T<R>, T<R>, Option<T<R>>) {
    let x = into_contiguous(x);
    let dtype = x.dtype;
    let w_dtype = weight.dtype;
    let tail_dtype = tail.as_ref().map(|t| t.dtype);
    let weight = f32_contiguous(weight);
    let dy = into_contiguous(cast(dy, dtype));
    let [tokens, channels] = dims2(&x);
    let width = weight.shape()[1];
    let n = seq_starts.len() - 1;
    let has_tail = tail.is_some();
    let tail = tail_or_stub(&x, tail, dtype);
    let client = x.client.clone();
    let starts = u32_buffer(&x, &starts_u32(seq_starts));
    let tok_seq = token_sequences(&x, seq_starts);
    let dx = empty(&x, [tokens, channels], dtype);
    let dtail = empty(&x, [n, channels, width - 1], dtype);
    let units = (tokens + if has_tail { n * (width - 1) } else { 0 }) * channels;
    if units > 0 {
        let dim = CubeDim::new(&client, units);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::short_conv_backward_input::launch_unchecked::<R>(
                &client,
                calculate_cube_count_elemwise(&client, units, dim),
                dim,
                x.clone().into_array_arg(),
                weight.clone().into_array_arg(),
                tail.clone().into_array_arg(),
                dy.clone().into_array_arg(),
                tok_seq.clone().into_array_arg(),
                starts.clone().into_array_arg(),
                dx.clone().into_array_arg(),
                dtail.clone().into_array_arg(),
                tokens,
                channels,
                n,
                width,
                has_tail,
                dtype.into(),
            )
        };
    }
    let blocks = tokens.div_ceil(kkda::CONV_BLOCK);
    let partial = empty(&x, [blocks.max(1), channels * width], DType::F32);
    if blocks * channels > 0 {
        let units = blocks * channels;
        let dim = CubeDim::new(&client, units);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::short_conv_backward_weight::launch_unchecked::<R>(
                &client,
                calculate_cube_count_elemwise(&client, units, dim),
                dim,
                x.into_array_arg(),
                weight.into_array_arg(),
                tail.into_array_arg(),
                dy.into_array_arg(),
                tok_seq.into_array_arg(),
                starts.into_array_arg(),
                partial.clone().into_array_arg(),
                tokens,
                channels,
                width,
                has_tail,
                dtype.into(),
            )
        };
    }
    let rows = if blocks * channels > 0 { blocks } else { 0 };
    let dw = column_sum(partial, rows, [channels, width]);
    (dx, cast(dw, w_dtype), tail_dtype.map(|d| cast(dtail, d)))
}

fn short_conv<R: CubeRuntime>(
    x: T<R>,
    weight: T<R>,
    tail: Option<T<R>>,
    seq_starts: &[usize],
) -> (T<R>, T<R>) {
    let x = into_contiguous(x);
    let dtype = x.dtype;
    let weight = f32_contiguous(weight);
    let [tokens, channels] = dims2(&x);
    let width = weight.shape()[1];
    let n = seq_starts.len() - 1;
    let y = empty(&x, [tokens, channels], dtype);
    let new_tail = empty(&x, [n, channels, width - 1], dtype);
    let has_tail = tail.is_some();
    let tail = tail_or_stub(&x, tail, dtype);
    let client = x.client.clone();
    let starts = u32_buffer(&x, &starts_u32(seq_starts));
    if tokens * channels > 0 {
        let tok_seq = token_sequences(&x, seq_starts);
        let units = tokens * channels;
        let dim = CubeDim::new(&client, units);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::short_conv_forward::launch_unchecked::<R>(
                &client,
                calculate_cube_count_elemwise(&client, units, dim),
                dim,
                x.clone().into_array_arg(),
                weight.into_array_arg(),
                tail.clone().into_array_arg(),
                tok_seq.into_array_arg(),
                starts.clone().into_array_arg(),
                y.clone().into_array_arg(),
                tokens,
                channels,
                width,
                has_tail,
                dtype.into(),
            )
        };
    }
    let units = n * channels * (width - 1);
    if units > 0 {
        let dim = CubeDim::new(&client, units);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kkda::short_conv_tail::launch_unchecked::<R>(
                &client,
                calculate_cube_count_elemwise(&client, units, dim),
                dim,
                x.into_array_arg(),
                tail.into_array_arg(),
                starts.into_array_arg(),
                new_tail.clone().into_array_arg(),
                n,
                channels,
                width,
                has_tail,
                dtype.into(),
            )
        };
    }
    (y, new_tail)
}

/// Only used to name `KdaKernelInput`'s backend; the primitives are the same `CubeTensor<R>`
/// whatever the element parameters.
pub(super) fn input_cast<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    input: KdaKernelInput<CubeBackend<R, F, I, BT>>,
) -> KdaKernelInput<CubeBackend<R, f32, i32, u32>> {
    KdaKernelInput {
        q: input.q,
        k: input.k,
        v: input.v,
        g: input.g,
        beta: input.beta,
        initial_state: input.initial_state,
        seq_starts: input.seq_starts,
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KdaKernels
    for CubeBackend<R, F, I, BT>
{
    fn kda_recurrent_forward(input: KdaKernelInput<Self>) -> (T<R>, T<R>) {
        recurrent(input_cast(input))
    }

    fn kda_chunk_forward(input: KdaKernelInput<Self>, chunk: usize) -> (T<R>, T<R>) {
        let (o, s, _) = chunk::forward(input_cast(input), chunk, false, false);
        (o, s)
    }

    fn kda_chunk_forward_saving(
        input: KdaKernelInput<Self>,
        chunk: usize,
        keep_within: bool,
    ) -> (T<R>, T<R>, KdaChunkSaved<Self>) {
        let (o, s, saved) = chunk::forward(input_cast(input), chunk, true, keep_within);
        let (states, vn, within) = saved.expect("asked to save");
        let within = within.map(KdaChunkWithin::from_array);
        (o, s, KdaChunkSaved { states, vn, within })
    }

    fn kda_chunk_backward(
        input: KdaKernelInput<Self>,
        chunk: usize,
        saved: KdaChunkSaved<Self>,
        grad_o: T<R>,
        grad_state: Option<T<R>>,
    ) -> KdaChunkGrads<Self> {
        let g = chunk::backward(
            input_cast(input),
            chunk,
            (
                saved.states,
                saved.vn,
                saved.within.map(KdaChunkWithin::into_array),
            ),
            grad_o,
            grad_state,
        );
        KdaChunkGrads {
            q: g[0].clone(),
            k: g[1].clone(),
            v: g[2].clone(),
            g: g[3].clone(),
            beta: g[4].clone(),
            initial_state: g[5].clone(),
        }
    }

    fn short_conv_forward(
        x: T<R>,
        weight: T<R>,
        tail: Option<T<R>>,
        seq_starts: Vec<usize>,
    ) -> (T<R>, T<R>) {
        short_conv(x, weight, tail, &seq_starts)
    }

    fn short_conv_backward(
        x: T<R>,
        weight: T<R>,
        tail: Option<T<R>>,
        seq_starts: Vec<usize>,
        dy: T<R>,
    ) -> (T<R>, T<R>, Option<T<R>>) {
        short_conv_grad(x, weight, tail, &seq_starts, dy)
    }

    fn rms_norm_gated_forward(o: T<R>, z: T<R>, weight: T<R>, eps: f64) -> T<R> {
        norm_forward(o, z, weight, eps)
    }

    fn rms_norm_gated_backward(
        o: T<R>,
        z: T<R>,
        weight: T<R>,
        grad: T<R>,
        eps: f64,
    ) -> (T<R>, T<R>, T<R>) {
        norm_backward(o, z, weight, grad, eps)
    }
}
