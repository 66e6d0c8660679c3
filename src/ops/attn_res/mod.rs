//! Attention Residuals (design §6): a softmax mix over depth replacing the residual sum.
//!
//! [`attn_res`] runs a fused kernel (forward and backward, one unit per token) on the CubeCL
//! backends, [`AttnResKernels`], a host kernel on the CPU backends (f32), and the tensor-op
//! reference elsewhere.

use burn::tensor::activation::softmax;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use super::backend::{self, same, FusedKernels, FusedOp, KernelOp, KernelPath};
use super::precision::{restore, widen};

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "cubecl-kernels")]
mod cube;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod host;

/// The block-form AttnRes mix of design §6, in f32 (f64 stays f64):
///
/// ```text
/// V = [blocks…, partial];   K_n = V_n / sqrt(mean_d(V_n²) + eps)
/// score_n = Σ_d K_n[d]·w_norm[d]·w_proj[d];   P = softmax_n(score);   out = Σ_n P_n·V_n
/// ```
///
/// Each source is `[B, T, d]`; the scores and the softmax are per token, over the `N =
/// blocks.len() + 1` sources. `w_norm` is the gain of the RMSNorm that makes the keys, `w_proj`
/// the pseudo-query (`[d]` each). With `w_proj = 0` the result is the mean of the sources. The
/// result has `partial`'s dtype.
///
/// On the CubeCL backends (f32, f16, bf16 sources of one dtype) one kernel computes the mix and
/// one its gradient, with f32 statistics ([`AttnResKernels`]); on the CPU backends (f32) a host
/// kernel makes one pass over the sources per token each way; other backends run the tensor ops.
///
/// # Panics
/// When a block's shape differs from `partial`'s or a vector's length is not `d`.
pub fn attn_res<B: Backend>(
    partial: Tensor<B, 3>,
    blocks: &[Tensor<B, 3>],
    w_proj: Tensor<B, 1>,
    w_norm: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, 3> {
    let dims = partial.dims();
    let d = dims[2];
    for (i, b) in blocks.iter().enumerate() {
        assert!(
            b.dims() == dims,
            "attn_res: block {i} has shape {:?}, the partial sum {dims:?}",
            b.dims()
        );
    }
    for (what, w) in [("w_proj", &w_proj), ("w_norm", &w_norm)] {
        assert!(
            w.dims() == [d],
            "attn_res: {what} has shape {:?}, expected [{d}]",
            w.dims()
        );
    }
    let dtype = partial.dtype();
    let usable = backend::kernel_dtype(dtype)
        && blocks.iter().all(|b| b.dtype() == dtype)
        && dims.iter().product::<usize>() > 0
        && backend::kernels_available::<B>();
    let n = blocks.len() + 1;
    let sources: Vec<Tensor<B, 3>> = blocks.iter().cloned().chain([partial]).collect();
    let query = widen(w_norm).0.mul(widen(w_proj).0);
    if dims.iter().product::<usize>() > 0
        && backend::host::is_cpu_backend::<B>()
        && sources.iter().all(|s| s.dtype() == DType::F32)
        && query.dtype() == DType::F32
    {
        backend::record(FusedOp::AttnRes, KernelPath::Reference);
        return host_mix(sources, query, eps as f32);
    }
    if usable {
        let op = AttnResOp {
            v: Tensor::stack::<4>(sources, 0).reshape([n, dims[0] * dims[1], d]),
            query,
            eps,
        };
        return match backend::on_kernels::<B, _>(op) {
            Ok(out) => {
                backend::record(FusedOp::AttnRes, KernelPath::Kernel);
                out.reshape(dims)
            }
            Err(op) => {
                backend::record(FusedOp::AttnRes, KernelPath::Reference);
                let v = widen(op.v).0.reshape([n, dims[0], dims[1], d]);
                restore(attn_res_reference(v, op.query, eps), dtype)
            }
        };
    }
    backend::record(FusedOp::AttnRes, KernelPath::Reference);
    // Sources of several dtypes are fine here: each is widened on its own.
    let sources: Vec<Tensor<B, 3>> = sources.into_iter().map(|x| widen(x).0).collect();
    restore(
        attn_res_reference(Tensor::stack::<4>(sources, 0), query, eps),
        dtype,
    )
}

/// The most sources the host kernel takes as separate inputs; more are stacked first.
const HOST_SOURCES: usize = 16;

/// [`attn_res`] on the CPU host kernel (f32 sources and query): each source its own input up to
/// [`HOST_SOURCES`], so that neither the forward stacks them (a copy of every source) nor the
/// backward cuts the stacked gradient apart (another); stacked beyond that.
fn host_mix<B: Backend>(sources: Vec<Tensor<B, 3>>, query: Tensor<B, 1>, eps: f32) -> Tensor<B, 3> {
    let op = host::AttnResHost { eps };
    let n = sources.len();
    if n > HOST_SOURCES {
        let v = Tensor::stack::<4>(sources, 0);
        let inputs = [v.into_primitive().tensor(), query.into_primitive().tensor()];
        return backend::host::run(&host::Stacked(op), inputs);
    }
    let inputs: Vec<FloatTensor<B>> = sources
        .into_iter()
        .map(|x| x.into_primitive().tensor())
        .chain([query.into_primitive().tensor()])
        .collect();
    fn run<B: Backend, const M: usize>(
        op: &host::AttnResHost,
        inputs: Vec<FloatTensor<B>>,
    ) -> Tensor<B, 3> {
        let inputs: [FloatTensor<B>; M] = inputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("M = sources + 1 inputs"));
        backend::host::run(op, inputs)
    }
    macro_rules! by_count {
        ($($m:literal)*) => {
            match n + 1 {
                $($m => run::<B, $m>(&op, inputs),)*
                _ => unreachable!("1 ≤ sources ≤ HOST_SOURCES"),
            }
        };
    }
    by_count!(2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17)
}

/// [`attn_res`] in tensor ops (any backend, Burn's autodiff) over the stacked f32 (or f64)
/// sources `v: [N, B, T, d]`, with the query `w_norm ⊙ w_proj: [d]` given.
fn attn_res_reference<B: Backend>(v: Tensor<B, 4>, query: Tensor<B, 1>, eps: f64) -> Tensor<B, 3> {
    let d = v.dims()[3];
    // Σ_d K·(w_norm⊙w_proj) = (Σ_d V·w_norm⊙w_proj) / rms(V): K itself is never materialised.
    let query = query.reshape([1, 1, 1, d]);
    let inv_rms = v
        .clone()
        .square()
        .mean_dim(3)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let scores = v.clone().mul(query).sum_dim(3).mul(inv_rms); // [N, B, T, 1]
    let p = softmax(scores, 0);
    v.mul(p).sum_dim(0).squeeze_dim(0)
}

/// Backend extension with the Attention Residuals kernels (design §6). Implemented for every
/// CubeCL backend (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`), for `Fusion` over one
/// and for `Autodiff<B>` over those (fused backward).
pub trait AttnResKernels: Backend {
    /// The mix of [`attn_res`] over stacked sources `v: [N, rows, d]` (f32, f16 or bf16) with the
    /// query `w_norm ⊙ w_proj: [d]`: returns `[rows, d]` in `v`'s dtype. Differentiable on
    /// autodiff backends with respect to `v` and the query (fused backward).
    fn attn_res_forward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;

    /// The fused backward of [`attn_res_forward`](Self::attn_res_forward) for `grad: [rows, d]`:
    /// returns `(dv, dquery)` in the dtypes of `v` and `query`. Not differentiable itself.
    fn attn_res_backward(
        v: FloatTensor<Self>,
        query: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// [`AttnResKernels::attn_res_forward`] on `Tensor`s.
struct AttnResOp<B: Backend> {
    v: Tensor<B, 3>,
    query: Tensor<B, 1>,
    eps: f64,
}

impl<B: Backend> KernelOp<B> for AttnResOp<B> {
    type Output = Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let prim = |t: Tensor<K, 3>| t.into_primitive().tensor();
        let v = prim(same::<Tensor<B, 3>, Tensor<K, 3>>(self.v));
        let query = same::<Tensor<B, 1>, Tensor<K, 1>>(self.query)
            .into_primitive()
            .tensor();
        let out = K::attn_res_forward(v, query, self.eps);
        same(Tensor::<K, 2>::from_primitive(TensorPrimitive::Float(out)))
    }
}
