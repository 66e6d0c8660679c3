//! [`AttentionKernels`] for every CubeCL backend: allocates outputs and launches the attention
//! kernels of `kimi-burn-kernels`.

use burn::tensor::DType;
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{calculate_cube_count_elemwise, CubeCount, CubeDim};
use kimi_burn_kernels::attention as katt;

use super::AttentionKernels;
use crate::ops::backend::cube::{contiguous_as, dims, empty, per_row, zeros_u32};

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

/// How a call launches: which kernel set ([`katt::uses_row_kernels`]), the cubes, and the first
/// scalar argument (`rows` of the per-row kernels, the (batch row, head) pairs of the tiled ones).
#[derive(Clone)]
struct Launch {
    rows: bool,
    count: CubeCount,
    dim: CubeDim,
    first: usize,
}

impl Launch {
    fn of<R: CubeRuntime>(x: &T<R>, s: &Sizes) -> Self {
        if katt::uses_row_kernels(s.t, s.dqk, s.dv) {
            let dim = CubeDim::new_1d(katt::ATTENTION_CUBE);
            Self {
                rows: true,
                count: calculate_cube_count_elemwise(&x.client, s.rows(), dim),
                dim,
                first: s.rows(),
            }
        } else {
            let pairs = s.batch * s.heads;
            Self {
                rows: false,
                count: per_row(x, pairs * katt::attention_tiles(s.t)),
                dim: CubeDim::new_1d(katt::TILED_CUBE),
                first: pairs,
            }
        }
    }
}

/// Launches the per-row kernel `$rows` or the tiled kernel `$tiled` (same arguments) as `$launch`
/// says, with `$launch.first` before the trailing arguments.
macro_rules! launch {
    ($launch:expr, $client:expr, $rows:ident | $tiled:ident, [$($arg:expr),* $(,)?], [$($tail:expr),* $(,)?]) => {{
        let l = $launch;
        if l.rows {
            katt::$rows::launch_unchecked::<R>($client, l.count, l.dim, $($arg,)* l.first, $($tail,)*)
        } else {
            katt::$tiled::launch_unchecked::<R>($client, l.count, l.dim, $($arg,)* l.first, $($tail,)*)
        }
    }};
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
    if s.rows() > 0 {
        let client = q.client.clone();
        // SAFETY: the kernels bound every index themselves ("Unchecked launches",
        // ops/backend/cube.rs); the shapes were checked above.
        unsafe {
            launch!(
                Launch::of(&q, &s),
                &client,
                attention_forward | attention_tiled_forward,
                [
                    q.into_array_arg(),
                    k.into_array_arg(),
                    v.into_array_arg(),
                    pad.into_array_arg(),
                    o.clone().into_array_arg(),
                    lse.clone().into_array_arg(),
                ],
                [
                    s.t,
                    s.heads,
                    scale as f32,
                    s.dqk,
                    s.dv,
                    has_pad,
                    [dtype.into(), pad_dtype.into()],
                ]
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
        let types: [cubecl::ir::StorageType; 2] = [dtype.into(), pad_dtype.into()];
        let sc = scale as f32;
        let launch = Launch::of(&q, &s);
        // SAFETY: as in the forward; `delta` is written by the first launch before the second
        // reads it (one stream).
        unsafe {
            launch!(
                launch.clone(),
                &client,
                attention_backward_query | attention_tiled_backward_query,
                [
                    q.clone().into_array_arg(),
                    k.clone().into_array_arg(),
                    v.clone().into_array_arg(),
                    pad.clone().into_array_arg(),
                    o.into_array_arg(),
                    lse.clone().into_array_arg(),
                    grad.clone().into_array_arg(),
                    dq.clone().into_array_arg(),
                    delta.clone().into_array_arg(),
                ],
                [s.t, s.heads, sc, s.dqk, s.dv, has_pad, types]
            );
            launch!(
                launch,
                &client,
                attention_backward_key | attention_tiled_backward_key,
                [
                    q.into_array_arg(),
                    k.into_array_arg(),
                    v.into_array_arg(),
                    pad.into_array_arg(),
                    lse.into_array_arg(),
                    delta.into_array_arg(),
                    grad.into_array_arg(),
                    dk.clone().into_array_arg(),
                    dv.clone().into_array_arg(),
                ],
                [s.t, s.heads, sc, s.dqk, s.dv, has_pad, types]
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

    fn attention_max_len(dqk: usize, dv: usize) -> usize {
        #[cfg(feature = "wgpu")]
        if std::any::TypeId::of::<R>() == std::any::TypeId::of::<burn::backend::wgpu::WgpuRuntime>()
        {
            return katt::max_len_within(kimi_burn_kernels::kda::LOOP_BUDGET, dqk, dv);
        }
        let _ = (dqk, dv);
        usize::MAX
    }
}
