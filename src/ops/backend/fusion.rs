//! The kernel traits on Burn's `Fusion` backends.
//!
//! With Burn's default features, `burn::backend::Wgpu` and `burn::backend::Cuda` are
//! `Fusion<CubeBackend<…>>`: Burn records tensor operations in a stream and fuses them before it
//! runs them. A kernel of this crate joins that stream as one custom operation (Burn's own pattern
//! for extension kernels, `CustomOpIr` with `OperationIr::Custom`): its inputs and outputs are
//! declared with their shapes and dtypes when the op is called, and when the stream reaches it the
//! inner backend's implementation of the same trait method runs on the inner tensors. So
//! `Fusion<B>` implements every kernel trait of the crate wherever `B` does, each in its op
//! family's folder beside the CubeCL glue (`ops/<op>/fusion.rs`: [`MoeKernels`],
//! [`KdaKernels`], [`AttnResKernels`], [`RmsNormKernels`], [`CrossEntropyKernels`],
//! [`AttentionKernels`], [`OptimKernels`], [`ActivationKernels`]), and `Autodiff<Fusion<B>>` gets
//! the custom backward passes through the generic autodiff implementations.
//!
//! One generic recorder ([`call`]), here, serves every method: a method lists its inputs, declares
//! its outputs and hands over a closure that calls the inner backend.
//!
//! [`MoeKernels`]: crate::ops::moe::MoeKernels
//! [`KdaKernels`]: crate::ops::kda::KdaKernels
//! [`AttnResKernels`]: crate::ops::attn_res::AttnResKernels
//! [`RmsNormKernels`]: crate::ops::norm::RmsNormKernels
//! [`CrossEntropyKernels`]: crate::ops::loss::CrossEntropyKernels
//! [`AttentionKernels`]: crate::ops::mla::AttentionKernels
//! [`OptimKernels`]: crate::ops::optim::OptimKernels
//! [`ActivationKernels`]: crate::ops::precision::ActivationKernels

use std::fmt;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};

/// A fusion tensor of the backend `B` wraps.
pub(crate) type Ft<B> = FusionTensor<<B as FusionBackend>::FusionRuntime>;

/// An inner-backend tensor handed to or returned by a recorded kernel call.
pub(crate) enum Prim<B: Backend> {
    Float(FloatTensor<B>),
    Int(IntTensor<B>),
}

/// The inputs of a recorded call, taken in the order they were listed.
pub(crate) struct Args<B: Backend>(std::vec::IntoIter<Prim<B>>);

impl<B: Backend> Args<B> {
    pub(crate) fn float(&mut self) -> FloatTensor<B> {
        match self.0.next() {
            Some(Prim::Float(t)) => t,
            _ => unreachable!("recorded kernel call: a float input was listed here"),
        }
    }

    pub(crate) fn int(&mut self) -> IntTensor<B> {
        match self.0.next() {
            Some(Prim::Int(t)) => t,
            _ => unreachable!("recorded kernel call: an int input was listed here"),
        }
    }

    pub(crate) fn float_if(&mut self, present: bool) -> Option<FloatTensor<B>> {
        present.then(|| self.float())
    }

    pub(crate) fn int_if(&mut self, present: bool) -> Option<IntTensor<B>> {
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
pub(crate) struct Inputs<R: FusionRuntime>(Vec<Input<R>>);

impl<R: FusionRuntime> Inputs<R> {
    pub(crate) fn new() -> Self {
        Self(Vec::new())
    }

    pub(crate) fn float(mut self, t: FusionTensor<R>) -> Self {
        self.0.push(Input::Float(t));
        self
    }

    pub(crate) fn int(mut self, t: FusionTensor<R>) -> Self {
        self.0.push(Input::Int(t));
        self
    }

    pub(crate) fn float_opt(self, t: Option<FusionTensor<R>>) -> Self {
        match t {
            Some(t) => self.float(t),
            None => self,
        }
    }

    pub(crate) fn int_opt(self, t: Option<FusionTensor<R>>) -> Self {
        match t {
            Some(t) => self.int(t),
            None => self,
        }
    }
}

/// A declared output: shape and dtype (float or int by the dtype).
pub(crate) struct Out {
    shape: Shape,
    dtype: DType,
}

impl Out {
    pub(crate) fn new(shape: impl Into<Shape>, dtype: DType) -> Self {
        Self {
            shape: shape.into(),
            dtype,
        }
    }

    /// The shape and dtype of `t`.
    pub(crate) fn like<R: FusionRuntime>(t: &FusionTensor<R>) -> Self {
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
pub(crate) fn call<B: FusionBackend>(
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
pub(crate) fn outs<R: FusionRuntime, const N: usize>(
    v: Vec<FusionTensor<R>>,
) -> [FusionTensor<R>; N] {
    v.try_into()
        .unwrap_or_else(|v: Vec<_>| panic!("expected {N} outputs, got {}", v.len()))
}

/// `[B, T, H, K]`-style dims of a fusion tensor.
pub(crate) fn dims<R: FusionRuntime, const D: usize>(t: &FusionTensor<R>) -> [usize; D] {
    t.shape.dims::<D>()
}
