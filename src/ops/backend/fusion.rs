//! The kernel traits on Burn's `Fusion` backends.
//!
//! With Burn's default features, `burn::backend::Wgpu` and `burn::backend::Cuda` are
//! `Fusion<CubeBackend<…>>`: Burn records tensor operations in a stream and fuses them before it
//! runs them. A kernel of this crate joins that stream as one custom operation (Burn's own pattern
//! for extension kernels, `CustomOpIr` with `OperationIr::Custom`): its inputs and outputs are
//! declared with their shapes and dtypes when the op is called, and when the stream reaches it the
//! inner backend's implementation of the same trait method runs on the inner tensors. So
//! `Fusion<B>` implements [`MoeKernels`], [`KdaKernels`], [`AttnResKernels`], [`RmsNormKernels`],
//! [`CrossEntropyKernels`], [`AttentionKernels`], [`OptimKernels`] and [`ActivationKernels`]
//! wherever `B` does, and
//! `Autodiff<Fusion<B>>` gets the custom backward passes through the generic autodiff
//! implementations.
//!
//! One generic recorder ([`call`]) serves every method: a method lists its inputs, declares its
//! outputs and hands over a closure that calls the inner backend.

use std::fmt;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Element, FloatDType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

use crate::nn::balance::HistogramSpec;
use crate::ops::attn_res::AttnResKernels;
use crate::ops::kda::{KdaChunkGrads, KdaChunkSaved, KdaChunkWithin, KdaKernelInput, KdaKernels};
use crate::ops::loss::CrossEntropyKernels;
use crate::ops::mla::AttentionKernels;
use crate::ops::moe::{GluActivation, MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
use crate::ops::norm::RmsNormKernels;
use crate::ops::optim::{AdamWScalars, OptimKernels};
use crate::ops::precision::ActivationKernels;
use crate::ops::quant::MxSpec;

/// A fusion tensor of the backend `B` wraps.
type Ft<B> = FusionTensor<<B as FusionBackend>::FusionRuntime>;

/// An inner-backend tensor handed to or returned by a recorded kernel call.
enum Prim<B: Backend> {
    Float(FloatTensor<B>),
    Int(IntTensor<B>),
}

/// The inputs of a recorded call, taken in the order they were listed.
struct Args<B: Backend>(std::vec::IntoIter<Prim<B>>);

impl<B: Backend> Args<B> {
    fn float(&mut self) -> FloatTensor<B> {
        match self.0.next() {
            Some(Prim::Float(t)) => t,
            _ => unreachable!("recorded kernel call: a float input was listed here"),
        }
    }

    fn int(&mut self) -> IntTensor<B> {
        match self.0.next() {
            Some(Prim::Int(t)) => t,
            _ => unreachable!("recorded kernel call: an int input was listed here"),
        }
    }

    fn float_if(&mut self, present: bool) -> Option<FloatTensor<B>> {
        present.then(|| self.float())
    }

    fn int_if(&mut self, present: bool) -> Option<IntTensor<B>> {
        present.then(|| self.int())
    }
}

/// An input of a recorded call.
enum Input<R: FusionRuntime> {
    Float(FusionTensor<R>),
    Int(FusionTensor<R>),
}

impl<R: FusionRuntime> Input<R> {
    fn tensor(&self) -> &FusionTensor<R> {
        match self {
            Self::Float(t) | Self::Int(t) => t,
        }
    }
}

/// The inputs of one call, in order; optional ones are skipped when absent (the closure is told
/// which were present).
struct Inputs<R: FusionRuntime>(Vec<Input<R>>);

impl<R: FusionRuntime> Inputs<R> {
    fn new() -> Self {
        Self(Vec::new())
    }

    fn float(mut self, t: FusionTensor<R>) -> Self {
        self.0.push(Input::Float(t));
        self
    }

    fn int(mut self, t: FusionTensor<R>) -> Self {
        self.0.push(Input::Int(t));
        self
    }

    fn float_opt(self, t: Option<FusionTensor<R>>) -> Self {
        match t {
            Some(t) => self.float(t),
            None => self,
        }
    }

    fn int_opt(self, t: Option<FusionTensor<R>>) -> Self {
        match t {
            Some(t) => self.int(t),
            None => self,
        }
    }
}

/// A declared output: shape and dtype (float or int by the dtype).
struct Out {
    shape: Shape,
    dtype: DType,
}

impl Out {
    fn new(shape: impl Into<Shape>, dtype: DType) -> Self {
        Self {
            shape: shape.into(),
            dtype,
        }
    }

    /// The shape and dtype of `t`.
    fn like<R: FusionRuntime>(t: &FusionTensor<R>) -> Self {
        Self::new(t.shape.clone(), t.dtype)
    }
}

type Body<B> = Arc<dyn Fn(Args<B>) -> Vec<Prim<B>> + Send + Sync>;

/// One kernel-trait call of the inner backend `B`, recorded in the fusion stream.
struct KernelCall<B: FusionBackend> {
    desc: CustomOpIr,
    int_inputs: Vec<bool>,
    body: Body<B>,
}

impl<B: FusionBackend> fmt::Debug for KernelCall<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelCall")
            .field("op", &self.desc.id)
            .finish()
    }
}

fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        DType::Flex32 => FloatDType::Flex32,
        _ => FloatDType::F32,
    }
}

impl<B: FusionBackend> Operation<B::FusionRuntime> for KernelCall<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let inputs: Vec<Prim<B>> = self
            .desc
            .inputs
            .iter()
            .zip(&self.int_inputs)
            .map(|(ir, &int)| {
                if int {
                    Prim::Int(handles.get_int_tensor::<B>(ir))
                } else {
                    Prim::Float(handles.get_float_tensor::<B>(ir))
                }
            })
            .collect();
        let outputs = (self.body)(Args(inputs.into_iter()));
        let id = &self.desc.id;
        assert_eq!(
            outputs.len(),
            self.desc.outputs.len(),
            "{id}: the kernel returned {} outputs, {} were declared",
            outputs.len(),
            self.desc.outputs.len()
        );
        for (ir, out) in self.desc.outputs.iter().zip(outputs) {
            match out {
                Prim::Float(t) => {
                    assert_eq!(t.shape(), ir.shape, "{id}: output shape");
                    // The declared dtype wins (a kernel may hand back f32 where a caller's
                    // dtype was declared): the stream's later ops were planned with it.
                    let t = if t.dtype() == ir.dtype {
                        t
                    } else {
                        B::float_cast(t, float_dtype(ir.dtype))
                    };
                    handles.register_float_tensor::<B>(&ir.id, t);
                }
                Prim::Int(t) => {
                    assert_eq!(t.shape(), ir.shape, "{id}: output shape");
                    assert_eq!(t.dtype(), ir.dtype, "{id}: output dtype");
                    handles.register_int_tensor::<B>(&ir.id, t);
                }
            }
        }
    }
}

/// Records one call of the inner backend `B` in the fusion stream of the inputs: `outputs`
/// declares what `body` returns (same order), `body` receives the inner tensors of `inputs` in
/// order. Returns the outputs as fusion tensors.
fn call<B: FusionBackend>(
    name: &'static str,
    inputs: Inputs<B::FusionRuntime>,
    outputs: Vec<Out>,
    body: impl Fn(Args<B>) -> Vec<Prim<B>> + Send + Sync + 'static,
) -> Vec<Ft<B>> {
    let inputs = inputs.0;
    let client = inputs
        .first()
        .expect("a recorded kernel call has inputs")
        .tensor()
        .client
        .clone();
    let streams = OperationStreams::with_inputs(inputs.iter().map(Input::tensor));
    let out_ir: Vec<TensorIr> = outputs
        .into_iter()
        .map(|o| TensorIr::uninit(client.create_empty_handle(), o.shape, o.dtype))
        .collect();
    let int_inputs = inputs.iter().map(|i| matches!(i, Input::Int(_))).collect();
    let in_ir: Vec<TensorIr> = inputs
        .into_iter()
        .map(|i| match i {
            Input::Float(t) | Input::Int(t) => t.into_ir(),
        })
        .collect();
    let desc = CustomOpIr::new(name, &in_ir, &out_ir);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        KernelCall::<B> {
            desc,
            int_inputs,
            body: Arc::new(body),
        },
    )
}

/// The outputs of [`call`] as a fixed-size array.
fn outs<R: FusionRuntime, const N: usize>(v: Vec<FusionTensor<R>>) -> [FusionTensor<R>; N] {
    v.try_into()
        .unwrap_or_else(|v: Vec<_>| panic!("expected {N} outputs, got {}", v.len()))
}

/// `[B, T, H, K]`-style dims of a fusion tensor.
fn dims<R: FusionRuntime, const D: usize>(t: &FusionTensor<R>) -> [usize; D] {
    t.shape.dims::<D>()
}

impl<B: FusionBackend + MoeKernels> MoeKernels for Fusion<B> {
    fn situ_glu_forward(
        gate: Ft<B>,
        up: Ft<B>,
        weight: Option<Ft<B>>,
        activation: GluActivation,
    ) -> Ft<B> {
        let weighted = weight.is_some();
        let out = Out::like(&gate);
        let inputs = Inputs::new().float(gate).float(up).float_opt(weight);
        let [y] = outs(call::<B>(
            "kimi_burn::situ_glu_forward",
            inputs,
            vec![out],
            move |mut a| {
                let (gate, up) = (a.float(), a.float());
                let weight = a.float_if(weighted);
                vec![Prim::Float(B::situ_glu_forward(
                    gate, up, weight, activation,
                ))]
            },
        ));
        y
    }

    fn situ_glu_backward(
        gate: Ft<B>,
        up: Ft<B>,
        weight: Option<Ft<B>>,
        grad: Ft<B>,
        activation: GluActivation,
    ) -> (Ft<B>, Ft<B>, Option<Ft<B>>) {
        let weighted = weight.is_some();
        let rows = dims::<_, 2>(&gate)[0];
        let mut declared = vec![Out::like(&gate), Out::like(&up)];
        if weighted {
            declared.push(Out::new([rows], DType::F32));
        }
        let inputs = Inputs::new()
            .float(gate)
            .float(up)
            .float_opt(weight)
            .float(grad);
        let mut out = call::<B>(
            "kimi_burn::situ_glu_backward",
            inputs,
            declared,
            move |mut a| {
                let (gate, up) = (a.float(), a.float());
                let weight = a.float_if(weighted);
                let grad = a.float();
                let (dg, du, dw) = B::situ_glu_backward(gate, up, weight, grad, activation);
                let mut v = vec![Prim::Float(dg), Prim::Float(du)];
                v.extend(dw.map(Prim::Float));
                v
            },
        )
        .into_iter();
        let (dg, du) = (out.next().unwrap(), out.next().unwrap());
        (dg, du, out.next())
    }

    fn route_top_k(
        scores: Ft<B>,
        bias: Ft<B>,
        valid: Option<IntTensor<Self>>,
        k: usize,
        histogram: Option<HistogramSpec>,
    ) -> (IntTensor<Self>, Option<IntTensor<Self>>) {
        let [m, n] = dims::<_, 2>(&scores);
        let int = B::IntElem::dtype();
        let mut declared = vec![Out::new([m, k], int)];
        if let Some(h) = histogram {
            // The CubeCL kernel counts in u32 whatever the backend's int type.
            declared.push(Out::new([n, h.bins], DType::U32));
        }
        let masked = valid.is_some();
        let inputs = Inputs::new().float(scores).float(bias).int_opt(valid);
        let mut out = call::<B>("kimi_burn::route_top_k", inputs, declared, move |mut a| {
            let (scores, bias) = (a.float(), a.float());
            let valid = a.int_if(masked);
            let (idx, counts) = B::route_top_k(scores, bias, valid, k, histogram);
            let mut v = vec![Prim::Int(idx)];
            v.extend(counts.map(Prim::Int));
            v
        })
        .into_iter();
        (out.next().unwrap(), out.next())
    }

    fn moe_experts(input: MoeExpertsInput<Self>) -> Ft<B> {
        let activation = (input.activation, input.hidden_quant);
        let masked = input.valid.is_some();
        let declared = vec![Out::like(&input.input)];
        let inputs = moe_inputs(input);
        let [y] = outs(call::<B>(
            "kimi_burn::moe_experts",
            inputs,
            declared,
            move |mut a| {
                let input = inner_moe_input::<B>(&mut a, masked, activation);
                vec![Prim::Float(B::moe_experts(input))]
            },
        ));
        y
    }

    fn moe_experts_backward(
        input: MoeExpertsInput<Self>,
        grad: Ft<B>,
        saved: Option<MoeSaved<Self>>,
    ) -> MoeExpertsGrads<Self> {
        let activation = (input.activation, input.hidden_quant);
        let masked = input.valid.is_some();
        let has_saved = saved.is_some();
        let declared = vec![
            Out::like(&input.input),
            Out::like(&input.weights),
            Out::like(&input.w1),
            Out::like(&input.w3),
            Out::like(&input.w2),
        ];
        let mut inputs = moe_inputs(input).float(grad);
        if let Some(s) = saved {
            inputs = inputs.float(s.gate).float(s.up);
        }
        let [input, weights, w1, w3, w2] = outs(call::<B>(
            "kimi_burn::moe_experts_backward",
            inputs,
            declared,
            move |mut a| {
                let input = inner_moe_input::<B>(&mut a, masked, activation);
                let grad = a.float();
                let saved = has_saved.then(|| MoeSaved {
                    gate: a.float(),
                    up: a.float(),
                });
                let g = B::moe_experts_backward(input, grad, saved);
                [g.input, g.weights, g.w1, g.w3, g.w2]
                    .into_iter()
                    .map(Prim::Float)
                    .collect()
            },
        ));
        MoeExpertsGrads {
            input,
            weights,
            w1,
            w3,
            w2,
        }
    }
    fn mx_fake_quant(x: Ft<B>, spec: MxSpec) -> Ft<B> {
        let declared = vec![Out::new(x.shape.clone(), DType::F32)];
        let [y] = outs(call::<B>(
            "kimi_burn::mx_fake_quant",
            Inputs::new().float(x),
            declared,
            move |mut a| vec![Prim::Float(B::mx_fake_quant(a.float(), spec))],
        ));
        y
    }
}

/// The tensors of a [`MoeExpertsInput`] in the order [`inner_moe_input`] reads them.
fn moe_inputs<B: FusionBackend>(input: MoeExpertsInput<Fusion<B>>) -> Inputs<B::FusionRuntime> {
    Inputs::new()
        .float(input.input)
        .int(input.indices)
        .float(input.weights)
        .int_opt(input.valid)
        .float(input.w1)
        .float(input.w3)
        .float(input.w2)
}

fn inner_moe_input<B: Backend>(
    a: &mut Args<B>,
    masked: bool,
    (activation, hidden_quant): (GluActivation, Option<MxSpec>),
) -> MoeExpertsInput<B> {
    MoeExpertsInput {
        input: a.float(),
        indices: a.int(),
        weights: a.float(),
        valid: a.int_if(masked),
        w1: a.float(),
        w3: a.float(),
        w2: a.float(),
        activation,
        hidden_quant,
    }
}

/// The tensors of a [`KdaKernelInput`] in the order [`inner_kda_input`] reads them.
fn kda_inputs<B: FusionBackend>(input: KdaKernelInput<Fusion<B>>) -> Inputs<B::FusionRuntime> {
    Inputs::new()
        .float(input.q)
        .float(input.k)
        .float(input.v)
        .float(input.g)
        .float(input.beta)
        .float_opt(input.initial_state)
}

fn inner_kda_input<B: Backend>(
    a: &mut Args<B>,
    has_state: bool,
    seq_starts: Vec<usize>,
) -> KdaKernelInput<B> {
    KdaKernelInput {
        q: a.float(),
        k: a.float(),
        v: a.float(),
        g: a.float(),
        beta: a.float(),
        initial_state: a.float_if(has_state),
        seq_starts,
    }
}

/// `(o, S_T)` of a KDA forward: `[B, T, H, V]` and `[N, H, K, V]`, f32.
fn kda_outputs<B: FusionBackend>(input: &KdaKernelInput<Fusion<B>>) -> Vec<Out> {
    let [b, t, h, kd] = dims::<_, 4>(&input.q);
    let vd = dims::<_, 4>(&input.v)[3];
    let n = input.seq_starts.len() - 1;
    vec![
        Out::new([b, t, h, vd], DType::F32),
        Out::new([n, h, kd, vd], DType::F32),
    ]
}

impl<B: FusionBackend + KdaKernels> KdaKernels for Fusion<B> {
    fn kda_recurrent_forward(input: KdaKernelInput<Self>) -> (Ft<B>, Ft<B>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let declared = kda_outputs(&input);
        let [o, s] = outs(call::<B>(
            "kimi_burn::kda_recurrent_forward",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s) = B::kda_recurrent_forward(input);
                vec![Prim::Float(o), Prim::Float(s)]
            },
        ));
        (o, s)
    }

    fn kda_chunk_forward(input: KdaKernelInput<Self>, chunk: usize) -> (Ft<B>, Ft<B>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let declared = kda_outputs(&input);
        let [o, s] = outs(call::<B>(
            "kimi_burn::kda_chunk_forward",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s) = B::kda_chunk_forward(input, chunk);
                vec![Prim::Float(o), Prim::Float(s)]
            },
        ));
        (o, s)
    }

    fn kda_chunk_forward_saving(
        input: KdaKernelInput<Self>,
        chunk: usize,
        keep_within: bool,
    ) -> (Ft<B>, Ft<B>, KdaChunkSaved<Self>) {
        let has_state = input.initial_state.is_some();
        let starts = input.seq_starts.clone();
        let [_, _, h, kd] = dims::<_, 4>(&input.q);
        let vd = dims::<_, 4>(&input.v)[3];
        // Chunks never cross a sequence: each sequence contributes ⌈len / chunk⌉.
        let chunks: usize = starts
            .windows(2)
            .map(|w| (w[1] - w[0]).div_ceil(chunk))
            .sum();
        let mut declared = kda_outputs(&input);
        declared.push(Out::new([chunks, h, kd, vd], DType::F32));
        declared.push(Out::new([chunks, h, chunk, vd], DType::F32));
        if keep_within {
            for cols in [chunk, chunk, kd, vd] {
                declared.push(Out::new([chunks, h, chunk, cols], DType::F32));
            }
        }
        let mut out = call::<B>(
            "kimi_burn::kda_chunk_forward_saving",
            kda_inputs(input),
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let (o, s, saved) = B::kda_chunk_forward_saving(input, chunk, keep_within);
                let within = saved.within.map(|w| w.into_array()).into_iter().flatten();
                [o, s, saved.states, saved.vn]
                    .into_iter()
                    .chain(within)
                    .map(Prim::Float)
                    .collect()
            },
        )
        .into_iter();
        let mut next = || out.next().expect("declared output");
        let (o, s, states, vn) = (next(), next(), next(), next());
        let within =
            keep_within.then(|| KdaChunkWithin::from_array([next(), next(), next(), next()]));
        (o, s, KdaChunkSaved { states, vn, within })
    }

    fn kda_chunk_backward(
        input: KdaKernelInput<Self>,
        chunk: usize,
        saved: KdaChunkSaved<Self>,
        grad_o: Ft<B>,
        grad_state: Option<Ft<B>>,
    ) -> KdaChunkGrads<Self> {
        let has_state = input.initial_state.is_some();
        let has_grad_state = grad_state.is_some();
        let starts = input.seq_starts.clone();
        let [_, _, h, kd] = dims::<_, 4>(&input.q);
        let vd = dims::<_, 4>(&input.v)[3];
        let n = starts.len() - 1;
        let f32_like = |t: &Ft<B>| Out::new(t.shape.clone(), DType::F32);
        let declared = vec![
            f32_like(&input.q),
            f32_like(&input.k),
            f32_like(&input.v),
            f32_like(&input.g),
            f32_like(&input.beta),
            Out::new([n, h, kd, vd], DType::F32),
        ];
        let has_within = saved.within.is_some();
        let within = saved.within.map(|w| w.into_array()).into_iter().flatten();
        let inputs = within.fold(
            kda_inputs(input).float(saved.states).float(saved.vn),
            Inputs::float,
        );
        let inputs = inputs.float(grad_o).float_opt(grad_state);
        let [q, k, v, g, beta, initial_state] = outs(call::<B>(
            "kimi_burn::kda_chunk_backward",
            inputs,
            declared,
            move |mut a| {
                let input = inner_kda_input::<B>(&mut a, has_state, starts.clone());
                let saved = KdaChunkSaved {
                    states: a.float(),
                    vn: a.float(),
                    within: has_within
                        .then(|| KdaChunkWithin::from_array([(); 4].map(|_| a.float()))),
                };
                let grad_o = a.float();
                let grad_state = a.float_if(has_grad_state);
                let g = B::kda_chunk_backward(input, chunk, saved, grad_o, grad_state);
                [g.q, g.k, g.v, g.g, g.beta, g.initial_state]
                    .into_iter()
                    .map(Prim::Float)
                    .collect()
            },
        ));
        KdaChunkGrads {
            q,
            k,
            v,
            g,
            beta,
            initial_state,
        }
    }

    fn rms_norm_gated_forward(o: Ft<B>, z: Ft<B>, weight: Ft<B>, eps: f64) -> Ft<B> {
        let declared = vec![Out::like(&o)];
        let inputs = Inputs::new().float(o).float(z).float(weight);
        let [y] = outs(call::<B>(
            "kimi_burn::rms_norm_gated_forward",
            inputs,
            declared,
            move |mut a| {
                let (o, z, w) = (a.float(), a.float(), a.float());
                vec![Prim::Float(B::rms_norm_gated_forward(o, z, w, eps))]
            },
        ));
        y
    }

    fn rms_norm_gated_backward(
        o: Ft<B>,
        z: Ft<B>,
        weight: Ft<B>,
        grad: Ft<B>,
        eps: f64,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&o), Out::like(&z), Out::like(&weight)];
        let inputs = Inputs::new().float(o).float(z).float(weight).float(grad);
        let [d_o, dz, dw] = outs(call::<B>(
            "kimi_burn::rms_norm_gated_backward",
            inputs,
            declared,
            move |mut a| {
                let (o, z, w, g) = (a.float(), a.float(), a.float(), a.float());
                let (d_o, dz, dw) = B::rms_norm_gated_backward(o, z, w, g, eps);
                vec![Prim::Float(d_o), Prim::Float(dz), Prim::Float(dw)]
            },
        ));
        (d_o, dz, dw)
    }

    fn short_conv_forward(
        x: Ft<B>,
        weight: Ft<B>,
        tail: Option<Ft<B>>,
        seq_starts: Vec<usize>,
    ) -> (Ft<B>, Ft<B>) {
        let [_, p] = dims::<_, 2>(&x);
        let w = dims::<_, 2>(&weight)[1];
        let n = seq_starts.len() - 1;
        let declared = vec![Out::like(&x), Out::new([n, p, w - 1], x.dtype)];
        let has_tail = tail.is_some();
        let inputs = Inputs::new().float(x).float(weight).float_opt(tail);
        let [y, new_tail] = outs(call::<B>(
            "kimi_burn::short_conv_forward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                let tail = a.float_if(has_tail);
                let (y, t) = B::short_conv_forward(x, w, tail, seq_starts.clone());
                vec![Prim::Float(y), Prim::Float(t)]
            },
        ));
        (y, new_tail)
    }

    fn short_conv_backward(
        x: Ft<B>,
        weight: Ft<B>,
        tail: Option<Ft<B>>,
        seq_starts: Vec<usize>,
        dy: Ft<B>,
    ) -> (Ft<B>, Ft<B>, Option<Ft<B>>) {
        let mut declared = vec![Out::like(&x), Out::like(&weight)];
        declared.extend(tail.as_ref().map(Out::like));
        let has_tail = tail.is_some();
        let inputs = Inputs::new()
            .float(x)
            .float(weight)
            .float_opt(tail)
            .float(dy);
        let mut out = call::<B>(
            "kimi_burn::short_conv_backward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                let tail = a.float_if(has_tail);
                let dy = a.float();
                let (dx, dw, dt) = B::short_conv_backward(x, w, tail, seq_starts.clone(), dy);
                let mut v = vec![Prim::Float(dx), Prim::Float(dw)];
                v.extend(dt.map(Prim::Float));
                v
            },
        )
        .into_iter();
        let (dx, dw) = (out.next().unwrap(), out.next().unwrap());
        (dx, dw, out.next())
    }
}

impl<B: FusionBackend + AttnResKernels> AttnResKernels for Fusion<B> {
    fn attn_res_forward(v: Ft<B>, query: Ft<B>, eps: f64) -> Ft<B> {
        let [_, rows, d] = v.shape.dims();
        let declared = vec![Out::new([rows, d], v.dtype)];
        let inputs = Inputs::new().float(v).float(query);
        let [out] = outs(call::<B>(
            "kimi_burn::attn_res_forward",
            inputs,
            declared,
            move |mut a| {
                let (v, q) = (a.float(), a.float());
                vec![Prim::Float(B::attn_res_forward(v, q, eps))]
            },
        ));
        out
    }

    fn attn_res_backward(v: Ft<B>, query: Ft<B>, grad: Ft<B>, eps: f64) -> (Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&v), Out::like(&query)];
        let inputs = Inputs::new().float(v).float(query).float(grad);
        let [dv, dq] = outs(call::<B>(
            "kimi_burn::attn_res_backward",
            inputs,
            declared,
            move |mut a| {
                let (v, q, g) = (a.float(), a.float(), a.float());
                let (dv, dq) = B::attn_res_backward(v, q, g, eps);
                vec![Prim::Float(dv), Prim::Float(dq)]
            },
        ));
        (dv, dq)
    }
}

impl<B: FusionBackend + RmsNormKernels> RmsNormKernels for Fusion<B> {
    fn rms_norm_forward(x: Ft<B>, weight: Ft<B>, eps: f64) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let inputs = Inputs::new().float(x).float(weight);
        let [out] = outs(call::<B>(
            "kimi_burn::rms_norm_forward",
            inputs,
            declared,
            move |mut a| {
                let (x, w) = (a.float(), a.float());
                vec![Prim::Float(B::rms_norm_forward(x, w, eps))]
            },
        ));
        out
    }

    fn rms_norm_backward(x: Ft<B>, weight: Ft<B>, grad: Ft<B>, eps: f64) -> (Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&x), Out::like(&weight)];
        let inputs = Inputs::new().float(x).float(weight).float(grad);
        let [dx, dw] = outs(call::<B>(
            "kimi_burn::rms_norm_backward",
            inputs,
            declared,
            move |mut a| {
                let (x, w, g) = (a.float(), a.float(), a.float());
                let (dx, dw) = B::rms_norm_backward(x, w, g, eps);
                vec![Prim::Float(dx), Prim::Float(dw)]
            },
        ));
        (dx, dw)
    }
}

impl<B: FusionBackend + CrossEntropyKernels> CrossEntropyKernels for Fusion<B> {
    fn cross_entropy_forward(logits: Ft<B>, targets: Ft<B>, ignore: i32) -> (Ft<B>, Ft<B>) {
        let rows = logits.shape[0];
        let declared = vec![Out::new([rows], logits.dtype), Out::new([rows], DType::F32)];
        let inputs = Inputs::new().float(logits).int(targets);
        let [loss, lse] = outs(call::<B>(
            "kimi_burn::cross_entropy_forward",
            inputs,
            declared,
            move |mut a| {
                let (z, t) = (a.float(), a.int());
                let (loss, lse) = B::cross_entropy_forward(z, t, ignore);
                vec![Prim::Float(loss), Prim::Float(lse)]
            },
        ));
        (loss, lse)
    }

    fn cross_entropy_backward(
        logits: Ft<B>,
        targets: Ft<B>,
        lse: Ft<B>,
        grad: Ft<B>,
        ignore: i32,
    ) -> Ft<B> {
        let declared = vec![Out::like(&logits)];
        let inputs = Inputs::new()
            .float(logits)
            .int(targets)
            .float(lse)
            .float(grad);
        let [d] = outs(call::<B>(
            "kimi_burn::cross_entropy_backward",
            inputs,
            declared,
            move |mut a| {
                let (z, t, lse, g) = (a.float(), a.int(), a.float(), a.float());
                vec![Prim::Float(B::cross_entropy_backward(z, t, lse, g, ignore))]
            },
        ));
        d
    }

    fn cross_entropy_max_vocab() -> usize {
        B::cross_entropy_max_vocab()
    }
}

impl<B: FusionBackend + AttentionKernels> AttentionKernels for Fusion<B> {
    fn attention_forward(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        key_padding: Option<Ft<B>>,
        scale: f64,
    ) -> (Ft<B>, Ft<B>) {
        let [batch, heads, t, _] = dims(&q);
        let dv = dims::<_, 4>(&v)[3];
        let declared = vec![
            Out::new([batch, heads, t, dv], q.dtype),
            Out::new([batch, heads, t], DType::F32),
        ];
        let has_pad = key_padding.is_some();
        let inputs = Inputs::new()
            .float(q)
            .float(k)
            .float(v)
            .int_opt(key_padding);
        let [o, lse] = outs(call::<B>(
            "kimi_burn::attention_forward",
            inputs,
            declared,
            move |mut a| {
                let (q, k, v) = (a.float(), a.float(), a.float());
                let pad = a.int_if(has_pad);
                let (o, lse) = B::attention_forward(q, k, v, pad, scale);
                vec![Prim::Float(o), Prim::Float(lse)]
            },
        ));
        (o, lse)
    }

    fn attention_backward(
        q: Ft<B>,
        k: Ft<B>,
        v: Ft<B>,
        key_padding: Option<Ft<B>>,
        o: Ft<B>,
        lse: Ft<B>,
        grad: Ft<B>,
        scale: f64,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&q), Out::like(&k), Out::like(&v)];
        let has_pad = key_padding.is_some();
        let inputs = Inputs::new()
            .float(q)
            .float(k)
            .float(v)
            .float(o)
            .float(lse)
            .float(grad)
            .int_opt(key_padding);
        let [dq, dk, dv] = outs(call::<B>(
            "kimi_burn::attention_backward",
            inputs,
            declared,
            move |mut a| {
                let (q, k, v) = (a.float(), a.float(), a.float());
                let (o, lse, g) = (a.float(), a.float(), a.float());
                let pad = a.int_if(has_pad);
                let (dq, dk, dv) = B::attention_backward(q, k, v, pad, o, lse, g, scale);
                vec![Prim::Float(dq), Prim::Float(dk), Prim::Float(dv)]
            },
        ));
        (dq, dk, dv)
    }
}

impl<B: FusionBackend + OptimKernels> OptimKernels for Fusion<B> {
    fn adamw_step(
        param: Ft<B>,
        grad: Ft<B>,
        m1: Ft<B>,
        m2: Ft<B>,
        scalars: AdamWScalars,
    ) -> (Ft<B>, Ft<B>, Ft<B>) {
        let declared = vec![Out::like(&param), Out::like(&param), Out::like(&param)];
        let inputs = Inputs::new().float(param).float(grad).float(m1).float(m2);
        let [p, a, b] = outs(call::<B>(
            "kimi_burn::adamw_step",
            inputs,
            declared,
            move |mut a| {
                let (p, g, m1, m2) = (a.float(), a.float(), a.float(), a.float());
                let (p, m1, m2) = B::adamw_step(p, g, m1, m2, scalars);
                vec![Prim::Float(p), Prim::Float(m1), Prim::Float(m2)]
            },
        ));
        (p, a, b)
    }

    fn scaled_sum(x: Ft<B>, y: Ft<B>, a: f32, b: f32) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let inputs = Inputs::new().float(x).float(y);
        let [out] = outs(call::<B>(
            "kimi_burn::scaled_sum",
            inputs,
            declared,
            move |mut args| {
                let (x, y) = (args.float(), args.float());
                vec![Prim::Float(B::scaled_sum(x, y, a, b))]
            },
        ));
        out
    }
}

impl<B: FusionBackend + ActivationKernels> ActivationKernels for Fusion<B> {
    fn precise_sigmoid(x: Ft<B>) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let [y] = outs(call::<B>(
            "kimi_burn::sigmoid_forward",
            Inputs::new().float(x),
            declared,
            |mut a| vec![Prim::Float(B::precise_sigmoid(a.float()))],
        ));
        y
    }

    fn precise_sigmoid_backward(x: Ft<B>, grad: Ft<B>) -> Ft<B> {
        let declared = vec![Out::like(&x)];
        let [dx] = outs(call::<B>(
            "kimi_burn::sigmoid_backward",
            Inputs::new().float(x).float(grad),
            declared,
            |mut a| {
                let (x, g) = (a.float(), a.float());
                vec![Prim::Float(B::precise_sigmoid_backward(x, g))]
            },
        ));
        dx
    }
}
