//! The KDA side of the fused kernels: the backend extension [`KdaKernels`] and the op wrappers
//! that move tensors onto it once [`on_kernels`](crate::ops::backend::on_kernels) matched the
//! backend.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::ops::backend::{same, FusedKernels, KernelOp};

/// The inputs of the KDA kernels, as backend primitives in f32, already validated and prepared
/// by the op (`q` scaled, and L2-normalised when asked).
#[derive(Debug, Clone)]
pub struct KdaKernelInput<B: Backend> {
    /// `q: [B, T, H, K]` (scaled).
    pub q: FloatTensor<B>,
    /// `k: [B, T, H, K]`.
    pub k: FloatTensor<B>,
    /// `v: [B, T, H, V]`.
    pub v: FloatTensor<B>,
    /// Log decays `g: [B, T, H, K]`, ≤ 0.
    pub g: FloatTensor<B>,
    /// `β: [B, T, H]`.
    pub beta: FloatTensor<B>,
    /// `S_0: [N, H, K, V]`; `None`: zeros.
    pub initial_state: Option<FloatTensor<B>>,
    /// Token offsets of the `N` sequences along the flattened `B·T` axis, `[N + 1]`:
    /// `[0, T, 2T, …]` for `B` rows, the `cu_seqlens` for a packed batch.
    pub seq_starts: Vec<usize>,
}

/// What [`KdaKernels::kda_chunk_forward_saving`] keeps for the backward (f32).
#[derive(Debug, Clone)]
pub struct KdaChunkSaved<B: Backend> {
    /// The state entering every chunk, `[chunks, H, K, V]`.
    pub states: FloatTensor<B>,
    /// `Vn = U − W S` of every chunk, `[chunks, H, C, V]`.
    pub vn: FloatTensor<B>,
    /// The within-chunk matrices and the solve of every chunk, when the forward kept them: the
    /// backward then does not recompute them.
    pub within: Option<KdaChunkWithin<B>>,
}

/// The within-chunk work of the chunked forward (design §4.3, f32), which
/// [`KdaKernels::kda_chunk_backward`] otherwise recomputes: per token and head `2·C + K + V`
/// floats.
#[derive(Debug, Clone)]
pub struct KdaChunkWithin<B: Backend> {
    /// `A_qk`, `[chunks, H, C, C]`.
    pub a_qk: FloatTensor<B>,
    /// `A_kk`, `[chunks, H, C, C]`.
    pub a_kk: FloatTensor<B>,
    /// `W`, `[chunks, H, C, K]`.
    pub w: FloatTensor<B>,
    /// `U`, `[chunks, H, C, V]`.
    pub u: FloatTensor<B>,
}

impl<B: Backend> KdaChunkWithin<B> {
    /// `[a_qk, a_kk, w, u]`.
    pub fn into_array(self) -> [FloatTensor<B>; 4] {
        [self.a_qk, self.a_kk, self.w, self.u]
    }

    /// From `[a_qk, a_kk, w, u]`.
    pub fn from_array([a_qk, a_kk, w, u]: [FloatTensor<B>; 4]) -> Self {
        Self { a_qk, a_kk, w, u }
    }

    /// Each tensor mapped by `f` (moving them between backends).
    pub fn map<C: Backend>(
        self,
        f: impl FnMut(FloatTensor<B>) -> FloatTensor<C>,
    ) -> KdaChunkWithin<C> {
        KdaChunkWithin::from_array(self.into_array().map(f))
    }
}

/// The gradients of the chunked KDA forward with respect to its inputs (f32, their shapes).
#[derive(Debug, Clone)]
pub struct KdaChunkGrads<B: Backend> {
    /// `dq: [B, T, H, K]`.
    pub q: FloatTensor<B>,
    /// `dk: [B, T, H, K]`.
    pub k: FloatTensor<B>,
    /// `dv: [B, T, H, V]`.
    pub v: FloatTensor<B>,
    /// `dg: [B, T, H, K]`.
    pub g: FloatTensor<B>,
    /// `dβ: [B, T, H]`.
    pub beta: FloatTensor<B>,
    /// `dS_0: [N, H, K, V]`.
    pub initial_state: FloatTensor<B>,
}

/// Backend extension with the KDA kernels (design §4). Implemented for every CubeCL backend
/// (`CubeBackend<R, F, I, BT>`, features `wgpu` / `cuda`) and for `Autodiff<B>` over one.
///
/// The KDA recurrence kernels (recurrent and chunked) take f32 inputs (the ops widen first) and
/// keep the state in f32; the short-convolution and norm kernels take f32, f16 or bf16 storage
/// with f32 math. A state given as `S_0` is updated in place when nothing else holds its buffer
/// (else copied first).
pub trait KdaKernels: Backend {
    /// KDA by its recurrence (design §4.1), one launch for every sequence, head and value tile per
    /// window of tokens, with the state on chip. Returns `o: [B, T, H, V]` f32 and
    /// `S_T: [N, H, K, V]` f32.
    ///
    /// On `Autodiff<B>` it is not differentiable: the ops only call it when no input is tracked
    /// (see [`kda_tracked`](Self::kda_tracked)), which is the case in decode.
    fn kda_recurrent_forward(input: KdaKernelInput<Self>)
        -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Chunked KDA (design §4.3) with chunks of `chunk` tokens (16, 32 or 64; 16-row sub-chunks)
    /// that never cross a sequence: gate sums, within-chunk matrices, the triangular solve for `W`
    /// and `U`, the sequential state pass tiled over `V` (in windows of chunks), and the output of
    /// all chunks in parallel. Returns `o: [B, T, H, V]` f32 and `S_T: [N, H, K, V]` f32.
    ///
    /// On `Autodiff<B>` it is differentiable: tracked inputs record the fused backward
    /// ([`kda_chunk_backward`](Self::kda_chunk_backward)).
    fn kda_chunk_forward(
        input: KdaKernelInput<Self>,
        chunk: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// [`kda_chunk_forward`](Self::kda_chunk_forward), also returning what the backward needs:
    /// the state entering every chunk and `Vn` (`[chunks, H, K, V]` and `[chunks, H, C, V]`, f32),
    /// and with `keep_within` the within-chunk matrices and the solve ([`KdaChunkWithin`]).
    /// `Autodiff` keeps them unless its checkpointing strategy is `BalancedCheckpointing` (which
    /// asks for memory over compute).
    fn kda_chunk_forward_saving(
        input: KdaKernelInput<Self>,
        chunk: usize,
        keep_within: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, KdaChunkSaved<Self>);

    /// The fused backward of the chunked forward for the gradients of `o: [B, T, H, V]` and
    /// (optionally) `S_T: [N, H, K, V]`: recomputes the within-chunk work the forward did not keep, runs the state pass in
    /// reverse from the saved states, and returns `dq, dk, dv, dg, dβ, dS_0` in f32. `S_0` itself
    /// is not read (`input.initial_state` may be `None`; the saved states hold it). Not
    /// differentiable itself.
    fn kda_chunk_backward(
        input: KdaKernelInput<Self>,
        chunk: usize,
        saved: KdaChunkSaved<Self>,
        grad_o: FloatTensor<Self>,
        grad_state: Option<FloatTensor<Self>>,
    ) -> KdaChunkGrads<Self>;

    /// The gated output norm `y = o / sqrt(mean(o²) + eps) · weight ⊙ σ(z)` (design §4.2) over the
    /// last dim: `o, z: [rows, V]` (same dtype), `weight: [V]`. Returns `[rows, V]` in `o`'s
    /// dtype. Differentiable on autodiff backends (fused backward).
    fn rms_norm_gated_forward(
        o: FloatTensor<Self>,
        z: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;

    /// The fused backward of [`rms_norm_gated_forward`](Self::rms_norm_gated_forward) for
    /// `grad: [rows, V]`: returns `(do, dz, dweight)` in the dtypes of `o`, `z` and `weight`.
    /// Not differentiable itself.
    fn rms_norm_gated_backward(
        o: FloatTensor<Self>,
        z: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The causal depthwise short convolution with its SiLU (design §4.2) over packed sequences:
    /// `x: [tokens, P]` (f32, f16 or bf16), `weight: [P, W]`, `tail: [N, P, W − 1]` in `x`'s dtype
    /// (the last `W − 1` raw inputs before each sequence; `None`: zeros), `seq_starts: [N + 1]`
    /// token offsets. Returns `y: [tokens, P]` and the new tail `[N, P, W − 1]`, both in `x`'s
    /// dtype; two launches, so a decode step is two launches per layer for q, k and v together.
    ///
    /// On `Autodiff<B>`, `y` is differentiable (fused backward,
    /// [`short_conv_backward`](Self::short_conv_backward)); the new tail is not tracked.
    fn short_conv_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        tail: Option<FloatTensor<Self>>,
        seq_starts: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The backward of [`short_conv_forward`](Self::short_conv_forward)'s `y` for `dy: [tokens,
    /// P]`: `(dx, dweight, dtail)` in the dtypes of `x`, `weight` and `tail` (`dtail` when a tail
    /// was given), the pre-activation recomputed. Not differentiable itself.
    fn short_conv_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        tail: Option<FloatTensor<Self>>,
        seq_starts: Vec<usize>,
        dy: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
    );

    /// Whether any of `tensors` is tracked by autodiff: kernels without a backward pass step aside
    /// for the reference path then. `false` on backends without autodiff.
    fn kda_tracked(tensors: &[&FloatTensor<Self>]) -> bool {
        let _ = tensors;
        false
    }
}

fn float<B: Backend, K: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<K> {
    same::<Tensor<B, D>, Tensor<K, D>>(t)
        .into_primitive()
        .tensor()
}

fn tensor<K: Backend, B: Backend, const D: usize>(t: FloatTensor<K>) -> Tensor<B, D> {
    same(Tensor::<K, D>::from_primitive(TensorPrimitive::Float(t)))
}

/// [`KdaKernels::kda_recurrent_forward`] or [`KdaKernels::kda_chunk_forward`] on `Tensor`s;
/// the recurrent form hands itself back when an input is tracked by autodiff.
pub(crate) struct KdaForwardOp<B: Backend> {
    pub q: Tensor<B, 4>,
    pub k: Tensor<B, 4>,
    pub v: Tensor<B, 4>,
    pub g: Tensor<B, 4>,
    pub beta: Tensor<B, 3>,
    pub h0: Option<Tensor<B, 4>>,
    pub seq_starts: Vec<usize>,
    pub form: KdaForm,
}

impl<B: Backend> KernelOp<B> for KdaForwardOp<B> {
    type Output = Result<(Tensor<B, 4>, Tensor<B, 4>), Self>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let input = KdaKernelInput::<K> {
            q: float::<B, K, 4>(self.q.clone()),
            k: float::<B, K, 4>(self.k.clone()),
            v: float::<B, K, 4>(self.v.clone()),
            g: float::<B, K, 4>(self.g.clone()),
            beta: float::<B, K, 3>(self.beta.clone()),
            initial_state: self.h0.clone().map(float::<B, K, 4>),
            seq_starts: self.seq_starts.clone(),
        };
        let mut all = vec![&input.q, &input.k, &input.v, &input.g, &input.beta];
        all.extend(input.initial_state.as_ref());
        // Only the chunked kernels have a backward.
        if self.form == KdaForm::Recurrent && K::kda_tracked(&all) {
            return Err(self);
        }
        let (o, s) = match self.form {
            KdaForm::Recurrent => K::kda_recurrent_forward(input),
            KdaForm::Chunk(c) => K::kda_chunk_forward(input, c),
        };
        Ok((tensor::<K, B, 4>(o), tensor::<K, B, 4>(s)))
    }
}

/// Which KDA kernel a [`KdaForwardOp`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KdaForm {
    /// [`KdaKernels::kda_recurrent_forward`].
    Recurrent,
    /// [`KdaKernels::kda_chunk_forward`] with this chunk size.
    Chunk(usize),
}

/// Whether autodiff tracks any of `tensors` on a backend with the fused kernels; `false` on
/// every other backend.
pub(crate) fn tracked_on_kernels<B: Backend>(tensors: &[Tensor<B, 4>]) -> bool {
    struct Probe<B: Backend>(Vec<Tensor<B, 4>>);
    impl<B: Backend> KernelOp<B> for Probe<B> {
        type Output = bool;
        fn run<K: FusedKernels>(self) -> bool {
            let prims: Vec<FloatTensor<K>> = self.0.into_iter().map(float::<B, K, 4>).collect();
            K::kda_tracked(&prims.iter().collect::<Vec<_>>())
        }
    }
    crate::ops::backend::on_kernels::<B, _>(Probe(tensors.to_vec())).unwrap_or(false)
}

/// [`KdaKernels::short_conv_forward`] on `Tensor`s.
pub(crate) struct ShortConvOp<B: Backend> {
    /// `[tokens, P]`.
    pub x: Tensor<B, 2>,
    /// `[P, W]`.
    pub weight: Tensor<B, 2>,
    /// `[N, P, W − 1]`.
    pub tail: Option<Tensor<B, 3>>,
    /// Token offsets of the `N` sequences, `[N + 1]`.
    pub seq_starts: Vec<usize>,
}

impl<B: Backend> KernelOp<B> for ShortConvOp<B> {
    /// `y` and, when no input is tracked, the new tail.
    type Output = (Tensor<B, 2>, Option<Tensor<B, 3>>);

    fn run<K: FusedKernels>(self) -> Self::Output {
        let x = float::<B, K, 2>(self.x);
        let weight = float::<B, K, 2>(self.weight);
        let tail = self.tail.map(float::<B, K, 3>);
        let mut all = vec![&x, &weight];
        all.extend(tail.as_ref());
        let tracked = K::kda_tracked(&all);
        let (y, t) = K::short_conv_forward(x, weight, tail, self.seq_starts);
        (
            tensor::<K, B, 2>(y),
            (!tracked).then(|| tensor::<K, B, 3>(t)),
        )
    }
}

/// [`KdaKernels::rms_norm_gated_forward`] on `Tensor`s (`[rows, V]`).
pub(crate) struct NormGatedOp<B: Backend> {
    pub o: Tensor<B, 2>,
    pub z: Tensor<B, 2>,
    pub weight: Tensor<B, 1>,
    pub eps: f64,
}

impl<B: Backend> KernelOp<B> for NormGatedOp<B> {
    type Output = Tensor<B, 2>;

    fn run<K: FusedKernels>(self) -> Self::Output {
        let y = K::rms_norm_gated_forward(
            float::<B, K, 2>(self.o),
            float::<B, K, 2>(self.z),
            float::<B, K, 1>(self.weight),
            self.eps,
        );
        tensor::<K, B, 2>(y)
    }
}
