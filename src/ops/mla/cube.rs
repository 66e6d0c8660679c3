//! [`AttentionKernels`] for every CubeCL backend: allocates outputs and launches the attention
//! kernels of `kimi-burn-kernels`.

use burn::tensor::DType;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use kimi_burn_kernels::attention as katt;

use super::AttentionKernels;
use crate::ops::backend::cube::{contiguous_as, dims, empty, zeros_u32};

type T<R> = CubeTensor<R>;

/// The sizes of a call: `[B, H, T, dqk]` of `q` and `dv`, checked against `k`, `v` and the
/// padding.
struct Sizes {
    batch: usize,
    heads: usize,
    t: usize,
    dqk: usize,
    dv: usize,
}

impl Sizes {
    fn of<R: CubeRuntime>(q: &T<R>, k: &T<R>, v: &T<R>, pad: Option<&T<R>>) -> Self {
        let what = "the attention kernels take q, k: [B, H, T, dqk], v: [B, H, T, dv]";
        let [batch, heads, t, dqk] = dims(q, what);
        let [vb, vh, vt, dv] = dims(v, what);
        let kd = dims::<R, 4>(k, what);
        assert!(
            kd == [batch, heads, t, dqk] && [vb, vh, vt] == [batch, heads, t],
            "{what}: got q {:?}, k {kd:?}, v {:?}",
            [batch, heads, t, dqk],
            [vb, vh, vt, dv]
        );
        if let Some(pad) = pad {
            let pd = dims::<R, 2>(pad, "the key padding is [B, T]");
            assert!(
                pd == [batch, t],
                "the key padding is [B, T] = [{batch}, {t}], got {pd:?}"
            );
        }
        Self {
            batch,
            heads,
            t,
            dqk,
            dv,
        }
    }

    fn rows(&self) -> usize {
        self.batch * self.heads * self.t
    }
}

/// One unit per row, cubes of `ATTENTION_CUBE` units.
fn per_unit<R: CubeRuntime>(x: &T<R>, rows: usize) -> (cubecl::CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(katt::ATTENTION_CUBE);
    (calculate_cube_count_elemwise(&x.client, rows, dim), dim)
}

/// The padding as given (contiguous) and its dtype, or a one-element u32 stand-in.
fn padding<R: CubeRuntime>(like: &T<R>, pad: Option<T<R>>) -> (T<R>, DType, bool) {
    match pad {
        Some(p) => {
            let p = into_contiguous(p);
            let dtype = p.dtype;
            (p, dtype, true)
        }
        None => (zeros_u32(like, [1].into()), DType::U32, false),
    }
}

fn forward<R: CubeRuntime>(
    q: T<R>,
    k: T<R>,
    v: T<R>,
    pad: Option<T<R>>,
    scale: f64,
) -> (T<R>, T<R>) {
    let s = Sizes::of(&q, &k, &v, pad.as_ref());
    let q = into_contiguous(q);
    let dtype = q.dtype;
    let k = contiguous_as(k, dtype);
    let v = contiguous_as(v, dtype);
    let (pad, pad_dtype, has_pad) = padding(&q, pad);
    let o = empty(&q, [s.batch, s.heads, s.t, s.dv], dtype);
    let lse = empty(&q, [s.batch, s.heads, s.t], DType::F32);
    let rows = s.rows();
    if rows > 0 {
        let (count, dim) = per_unit(&q, rows);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs);
        // the shapes were checked above.
        unsafe {
            katt::attention_forward::launch_unchecked::<R>(
                &q.client.clone(),
                count,
                dim,
                q.into_array_arg(),
                k.into_array_arg(),
                v.into_array_arg(),
                pad.into_array_arg(),
                o.clone().into_array_arg(),
                lse.clone().into_array_arg(),
                rows,
                s.t,
                s.heads,
                scale as f32,
                s.dqk,
                s.dv,
                has_pad,
                [dtype.into(), pad_dtype.into()],
            )
        };
    }
    (o, lse)
}

#[allow(clippy::too_many_arguments)]
fn backward<R: CubeRuntime>(
    q: T<R>,
    k: T<R>,
    v: T<R>,
    pad: Option<T<R>>,
    o: T<R>,
    lse: T<R>,
    grad: T<R>,
    scale: f64,
) -> (T<R>, T<R>, T<R>) {
    let s = Sizes::of(&q, &k, &v, pad.as_ref());
    let q = into_contiguous(q);
    let dtype = q.dtype;
    let k = contiguous_as(k, dtype);
    let v = contiguous_as(v, dtype);
    let o = contiguous_as(o, dtype);
    let grad = into_contiguous(cast(grad, dtype));
    let lse = contiguous_as(lse, DType::F32);
    let (pad, pad_dtype, has_pad) = padding(&q, pad);
    let dq = empty(&q, [s.batch, s.heads, s.t, s.dqk], dtype);
    let dk = empty(&q, [s.batch, s.heads, s.t, s.dqk], dtype);
    let dv = empty(&q, [s.batch, s.heads, s.t, s.dv], dtype);
    let rows = s.rows();
    if rows > 0 {
        let delta = empty(&q, [rows], DType::F32);
        let client = q.client.clone();
        let (count, dim) = per_unit(&q, rows);
        // SAFETY: as in the forward; `delta` is written by the first launch before the second
        // reads it (one stream).
        unsafe {
            katt::attention_backward_query::launch_unchecked::<R>(
                &client,
                count.clone(),
                dim,
                q.clone().into_array_arg(),
                k.clone().into_array_arg(),
                v.clone().into_array_arg(),
                pad.clone().into_array_arg(),
                o.into_array_arg(),
                lse.clone().into_array_arg(),
                grad.clone().into_array_arg(),
                dq.clone().into_array_arg(),
                delta.clone().into_array_arg(),
                rows,
                s.t,
                s.heads,
                scale as f32,
                s.dqk,
                s.dv,
                has_pad,
                [dtype.into(), pad_dtype.into()],
            );
            katt::attention_backward_key::launch_unchecked::<R>(
                &client,
                count,
                dim,
                q.into_array_arg(),
                k.into_array_arg(),
                v.into_array_arg(),
                pad.into_array_arg(),
                lse.into_array_arg(),
                delta.into_array_arg(),
                grad.into_array_arg(),
                dk.clone().into_array_arg(),
                dv.clone().into_array_arg(),
                rows,
                s.t,
                s.heads,
                scale as f32,
                s.dqk,
                s.dv,
                has_pad,
                [dtype.into(), pad_dtype.into()],
            );
        }
    }
    (dq, dk, dv)
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> AttentionKernels
    for CubeBackend<R, F, I, BT>
{
    fn attention_forward(
        q: T<R>,
        k: T<R>,
        v: T<R>,
        key_padding: Option<T<R>>,
        scale: f64,
    ) -> (T<R>, T<R>) {
        forward(q, k, v, key_padding, scale)
    }

    fn attention_backward(
        q: T<R>,
        k: T<R>,
        v: T<R>,
        key_padding: Option<T<R>>,
        o: T<R>,
        lse: T<R>,
        grad: T<R>,
        scale: f64,
    ) -> (T<R>, T<R>, T<R>) {
        backward(q, k, v, key_padding, o, lse, grad, scale)
    }
}
