//! [`MoeKernels`] for every CubeCL backend: allocates outputs and launches the kernels of
//! `kimi-burn-kernels`. The SiTU-GLU and routing launches and the layer's forward and backward are
//! here; the dropless dispatch they use (plan, grouped matmuls, un-permute) is in [`dispatch`].

mod dispatch;

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{tensor_vector_size_parallel, CubeDim};
use kimi_burn_kernels::{moe as kmoe, qb_histogram as kqb, situ as ksitu};

use super::kernels::{MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
use super::situ::GluActivation;
use crate::nn::balance::HistogramSpec;
use crate::ops::backend::cube::zeros_u32 as zeros_u32_shaped;
use crate::ops::backend::cube::{contiguous_as, elementwise, empty, f32_scalar, per_row};
use crate::ops::quant::cube::fake_quant_rows;
use crate::ops::quant::MxSpec;
use dispatch::{
    combine, grouped_glu, grouped_glu_backward, grouped_matmul, grouped_wgrad, plan, Plan,
    Projections,
};

type T<R> = CubeTensor<R>;

fn dims2<R: CubeRuntime>(t: &T<R>) -> [usize; 2] {
    crate::ops::backend::cube::dims(t, "fused kernels take [rows, cols] tensors")
}

fn dims3<R: CubeRuntime>(t: &T<R>) -> [usize; 3] {
    crate::ops::backend::cube::dims(t, "stacked expert weights are [n, rows, cols]")
}

/// A zero-filled u32 buffer of `len` elements (at least one, so it can stand in as a dummy).
fn zeros_u32<R: CubeRuntime>(like: &T<R>, len: usize) -> T<R> {
    zeros_u32_shaped(like, Shape::new([len.max(1)]))
}

/// `(mode, β1, β2)` of the SiTU kernels.
fn activation_params(act: GluActivation) -> (u32, f32, f32) {
    match act {
        GluActivation::Situ {
            beta1,
            beta2: Some(b2),
        } => (ksitu::MODE_SITU_CAPPED, beta1, b2),
        GluActivation::Situ { beta1, beta2: None } => (ksitu::MODE_SITU, beta1, 1.0),
        GluActivation::SwiGlu => (ksitu::MODE_SWIGLU, 1.0, 1.0),
    }
}

/// A one-element f32 buffer for an unused optional input.
fn dummy_f32<R: CubeRuntime>(like: &T<R>) -> T<R> {
    f32_scalar(like, 0.0)
}

/// The widest vector the device loads efficiently that divides the row length.
fn vector_size<R: CubeRuntime>(t: &T<R>) -> usize {
    tensor_vector_size_parallel(
        t.client.io_optimized_vector_sizes(t.dtype.size()),
        t.meta.shape(),
        t.meta.strides(),
        t.meta.num_dims() - 1,
    )
    .max(1)
}

fn situ_forward<R: CubeRuntime>(
    gate: T<R>,
    up: T<R>,
    weight: Option<T<R>>,
    act: GluActivation,
) -> T<R> {
    let gate = into_contiguous(gate);
    let up = into_contiguous(cast(up, gate.dtype));
    let [rows, h] = dims2(&gate);
    let out = empty(&gate, [rows, h], gate.dtype);
    if rows * h == 0 {
        return out;
    }
    let vs = vector_size(&gate);
    let len = rows * h / vs;
    let weighted = weight.is_some();
    let weight = match weight {
        Some(w) => contiguous_as(w, DType::F32),
        None => dummy_f32(&gate),
    };
    let (mode, b1, b2) = activation_params(act);
    let (count, dim) = elementwise(&gate, len);
    let dtype = gate.dtype;
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        ksitu::situ_glu_forward::launch_unchecked::<R>(
            &gate.client.clone(),
            count,
            dim,
            vs,
            gate.into_array_arg(),
            up.into_array_arg(),
            weight.into_array_arg(),
            out.clone().into_array_arg(),
            len,
            h / vs,
            b1,
            b2,
            mode,
            weighted,
            dtype.into(),
        )
    };
    out
}

fn situ_backward<R: CubeRuntime>(
    gate: T<R>,
    up: T<R>,
    weight: Option<T<R>>,
    grad: T<R>,
    act: GluActivation,
) -> (T<R>, T<R>, Option<T<R>>) {
    let gate = into_contiguous(gate);
    let dtype = gate.dtype;
    let up = into_contiguous(cast(up, dtype));
    let grad = into_contiguous(cast(grad, dtype));
    let [rows, h] = dims2(&gate);
    let dgate = empty(&gate, [rows, h], dtype);
    let dup = empty(&gate, [rows, h], dtype);
    let (mode, b1, b2) = activation_params(act);
    let vs = vector_size(&gate);
    let client = gate.client.clone();
    match weight {
        None => {
            let len = rows * h / vs;
            if len > 0 {
                let (count, dim) = elementwise(&gate, len);
                // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
                unsafe {
                    ksitu::situ_glu_backward::launch_unchecked::<R>(
                        &client,
                        count,
                        dim,
                        vs,
                        gate.into_array_arg(),
                        up.into_array_arg(),
                        grad.into_array_arg(),
                        dgate.clone().into_array_arg(),
                        dup.clone().into_array_arg(),
                        len,
                        b1,
                        b2,
                        mode,
                        dtype.into(),
                    )
                };
            }
            (dgate, dup, None)
        }
        Some(w) => {
            let w = contiguous_as(w, DType::F32);
            let dw = empty(&gate, [rows], DType::F32);
            if rows > 0 {
                let count = per_row(&gate, rows);
                // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
                unsafe {
                    ksitu::situ_glu_backward_weighted::launch_unchecked::<R>(
                        &client,
                        count,
                        CubeDim::new_1d(ksitu::WEIGHTED_BACKWARD_CUBE),
                        vs,
                        gate.into_array_arg(),
                        up.into_array_arg(),
                        grad.into_array_arg(),
                        w.into_array_arg(),
                        dgate.clone().into_array_arg(),
                        dup.clone().into_array_arg(),
                        dw.clone().into_array_arg(),
                        rows,
                        h / vs,
                        b1,
                        b2,
                        mode,
                        ksitu::WEIGHTED_BACKWARD_CUBE,
                        dtype.into(),
                    )
                };
            }
            (dgate, dup, Some(dw))
        }
    }
}

fn route<R: CubeRuntime>(
    scores: T<R>,
    bias: T<R>,
    valid: Option<T<R>>,
    k: usize,
    histogram: Option<HistogramSpec>,
    index_dtype: DType,
) -> (T<R>, Option<T<R>>) {
    let scores = contiguous_as(scores, DType::F32);
    let bias = contiguous_as(bias, DType::F32);
    let [m, n] = dims2(&scores);
    let indices = empty(&scores, [m, k], index_dtype);
    let masked = valid.is_some();
    let valid = match valid {
        Some(v) => contiguous_as(v, DType::U32),
        None => zeros_u32(&scores, 1),
    };
    let (counts, lo, scale, bins) = match histogram {
        Some(spec) => (
            // The host balancer rejects this too (`quantile_bias_from_histogram`); checked
            // here because the kernel's last-bin clamp needs one bin.
            {
                assert!(
                    spec.bins > 0,
                    "route: a QB histogram needs at least one bin"
                );
                zeros_u32_shaped(&scores, Shape::new([n, spec.bins]))
            },
            spec.lo,
            spec.scale(),
            spec.bins,
        ),
        None => (zeros_u32(&scores, 1), 0.0, 1.0, 1),
    };
    if m > 0 {
        let (count, dim) = elementwise(&scores, m);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kqb::route_top_k::launch_unchecked::<R>(
                &scores.client.clone(),
                count,
                dim,
                scores.into_array_arg(),
                bias.into_array_arg(),
                valid.into_array_arg(),
                indices.clone().into_array_arg(),
                counts.clone().into_array_arg(),
                m,
                n,
                lo,
                scale,
                bins as u32,
                k,
                true,
                histogram.is_some(),
                masked,
                index_dtype.into(),
            )
        };
    }
    (indices, histogram.map(|_| counts))
}

/// The stacked weights in `h`'s dtype and contiguous, with their dims checked.
struct Experts<R: CubeRuntime> {
    h: T<R>,
    w1: T<R>,
    w3: T<R>,
    w2: T<R>,
    n: usize,
    width: usize,
    hidden: usize,
}

fn experts<R: CubeRuntime>(input: &MoeExpertsInput<CubeBackendOf<R>>) -> Experts<R> {
    let h = into_contiguous(input.input.clone());
    let dtype = h.dtype;
    let w1 = contiguous_as(input.w1.clone(), dtype);
    let w3 = contiguous_as(input.w3.clone(), dtype);
    let w2 = contiguous_as(input.w2.clone(), dtype);
    let [_, width] = dims2(&h);
    let [n, l1, hidden] = dims3(&w1);
    assert_eq!(l1, width, "moe_experts: W1 is [n, ℓ, m_e] with ℓ = {width}");
    assert_eq!(dims3(&w3), [n, width, hidden], "moe_experts: W3 shape");
    assert_eq!(dims3(&w2), [n, hidden, width], "moe_experts: W2 shape");
    Experts {
        h,
        w1,
        w3,
        w2,
        n,
        width,
        hidden,
    }
}

/// Only used to name `MoeExpertsInput`'s backend in [`experts`]; every element type shares it.
type CubeBackendOf<R> = CubeBackend<R, f32, i32, u32>;

fn moe_input_cast<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    input: &MoeExpertsInput<CubeBackend<R, F, I, BT>>,
) -> MoeExpertsInput<CubeBackendOf<R>> {
    // The primitives are the same `CubeTensor<R>` whatever the element parameters.
    MoeExpertsInput {
        input: input.input.clone(),
        indices: input.indices.clone(),
        weights: input.weights.clone(),
        valid: input.valid.clone(),
        w1: input.w1.clone(),
        w3: input.w3.clone(),
        w2: input.w2.clone(),
        activation: input.activation,
        hidden_quant: input.hidden_quant,
    }
}

/// `x · p` per row: `x: [pairs, h]` f32, `p: [pairs]` f32.
fn mul_rows<R: CubeRuntime>(x: T<R>, p: T<R>) -> T<R> {
    let pairs = p.meta.shape()[0];
    let p = CubeBackendOf::<R>::float_reshape(p, Shape::new([pairs, 1]));
    CubeBackendOf::<R>::float_mul(x, p)
}

/// The activated hidden rows entering `W2` with quantisation-aware training: `p · Q(act(g, u))`
/// in `dtype`, and `Q(act(g, u))` in f32.
fn quantised_hidden<R: CubeRuntime>(
    g: &T<R>,
    u: &T<R>,
    plan: &Plan<R>,
    activation: GluActivation,
    spec: MxSpec,
    dtype: DType,
) -> (T<R>, T<R>) {
    let a = situ_forward(g.clone(), u.clone(), None, activation);
    let q = fake_quant_rows(a, spec);
    let act = cast(mul_rows(q.clone(), plan.sorted_weight.clone()), dtype);
    (act, q)
}

/// The routed experts' forward; with `save` also returns the gate and up projections (sorted
/// pairs) for the backward.
///
/// Without QAT the first layer is one fused launch (gate, up and the weighted activation in its
/// epilogue); QAT's hidden quantisation needs whole rows of the activation, so there the gate
/// and up projections are written and activated by separate launches.
fn moe_forward<R: CubeRuntime>(
    input: MoeExpertsInput<CubeBackendOf<R>>,
    save: bool,
) -> (T<R>, Option<Projections<R>>) {
    let ex = experts(&input);
    let plan = plan(input.indices, input.valid, input.weights, ex.n);
    let (act, saved) = match input.hidden_quant {
        None => grouped_glu(&ex, &plan, input.activation, save),
        Some(spec) => {
            let g = grouped_matmul(&ex.h, &ex.w1, &plan, true, false, None, ex.width, ex.hidden);
            let u = grouped_matmul(&ex.h, &ex.w3, &plan, true, false, None, ex.width, ex.hidden);
            let act = quantised_hidden(&g, &u, &plan, input.activation, spec, ex.h.dtype).0;
            (act, save.then_some((g, u)))
        }
    };
    let y = grouped_matmul(&act, &ex.w2, &plan, false, false, None, ex.hidden, ex.width);
    (combine(&y, &plan, ex.width), saved)
}

fn moe_backward<R: CubeRuntime>(
    input: MoeExpertsInput<CubeBackendOf<R>>,
    grad: T<R>,
    saved: Option<(T<R>, T<R>)>,
) -> MoeExpertsGrads<CubeBackendOf<R>> {
    let ex = experts(&input);
    let weights_dtype = input.weights.dtype;
    let (w1_dtype, w3_dtype, w2_dtype) = (input.w1.dtype, input.w3.dtype, input.w2.dtype);
    let grad = contiguous_as(grad, ex.h.dtype);
    // The plan is recomputed (a few small launches); the gate/up projections come from the
    // forward when it kept them (autodiff does), and are recomputed otherwise.
    let plan = plan(input.indices, input.valid, input.weights, ex.n);
    let (n, l, me) = (ex.n, ex.width, ex.hidden);
    let (g, u) = match saved {
        Some((g, u)) => (contiguous_as(g, ex.h.dtype), contiguous_as(u, ex.h.dtype)),
        None => (
            grouped_matmul(&ex.h, &ex.w1, &plan, true, false, None, l, me),
            grouped_matmul(&ex.h, &ex.w3, &plan, true, false, None, l, me),
        ),
    };
    let (act, dg, du, dp) = match input.hidden_quant {
        None => {
            // dAct = dY·W2[e]ᵀ (rows of dY gathered from the token gradients), the activation
            // and its backward in one launch.
            let [act, dg, du, dp] =
                grouped_glu_backward(&grad, &ex, &plan, &(g, u), input.activation);
            (act, dg, du, dp)
        }
        Some(spec) => {
            // dAct = dY·W2[e]ᵀ, with the rows of dY gathered from the token gradients.
            let d_act = grouped_matmul(&grad, &ex.w2, &plan, true, true, None, l, me);
            // Straight through Q: dp = Σ Q(a)·dAct, da = p·dAct.
            let (act, q) = quantised_hidden(&g, &u, &plan, input.activation, spec, ex.h.dtype);
            let d_act = cast(d_act, DType::F32);
            let dp = CubeBackendOf::<R>::float_sum_dim(
                CubeBackendOf::<R>::float_mul(q, d_act.clone()),
                1,
            );
            let dp = CubeBackendOf::<R>::float_reshape(dp, Shape::new([plan.pairs]));
            let da = cast(mul_rows(d_act, plan.sorted_weight.clone()), ex.h.dtype);
            let (dg, du, _) = situ_backward(g, u, None, da, input.activation);
            (act, dg, du, dp)
        }
    };
    let dw2 = grouped_wgrad(&act, &grad, &plan, (false, true), me, l, w2_dtype);
    let dw1 = grouped_wgrad(&ex.h, &dg, &plan, (true, false), l, me, w1_dtype);
    let dw3 = grouped_wgrad(&ex.h, &du, &plan, (true, false), l, me, w3_dtype);
    let dx = grouped_matmul(&dg, &ex.w1, &plan, false, true, None, me, l);
    let dx = grouped_matmul(&du, &ex.w3, &plan, false, true, Some(dx), me, l);
    let dh = combine(&dx, &plan, l);
    let dweights = empty(&dh, [plan.tokens, plan.k], DType::F32);
    if plan.pairs > 0 {
        let (count, dim) = elementwise(&dh, plan.pairs);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::moe_pair_gather::launch_unchecked::<R>(
                &dh.client,
                count,
                dim,
                dp.into_array_arg(),
                plan.inv.clone().into_array_arg(),
                dweights.clone().into_array_arg(),
                plan.pairs,
            )
        };
    }
    let _ = n;
    MoeExpertsGrads {
        input: dh,
        weights: cast(dweights, weights_dtype),
        w1: dw1,
        w3: dw3,
        w2: dw2,
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> MoeKernels
    for CubeBackend<R, F, I, BT>
{
    fn situ_glu_forward(
        gate: T<R>,
        up: T<R>,
        weight: Option<T<R>>,
        activation: GluActivation,
    ) -> T<R> {
        situ_forward(gate, up, weight, activation)
    }

    fn situ_glu_backward(
        gate: T<R>,
        up: T<R>,
        weight: Option<T<R>>,
        grad: T<R>,
        activation: GluActivation,
    ) -> (T<R>, T<R>, Option<T<R>>) {
        situ_backward(gate, up, weight, grad, activation)
    }

    fn route_top_k(
        scores: T<R>,
        bias: T<R>,
        valid: Option<T<R>>,
        k: usize,
        histogram: Option<HistogramSpec>,
    ) -> (T<R>, Option<T<R>>) {
        route(scores, bias, valid, k, histogram, I::dtype())
    }

    fn moe_experts(input: MoeExpertsInput<Self>) -> T<R> {
        moe_forward(moe_input_cast(&input), false).0
    }

    fn moe_experts_saving(input: MoeExpertsInput<Self>) -> (T<R>, Option<MoeSaved<Self>>) {
        let (out, saved) = moe_forward(moe_input_cast(&input), true);
        (out, saved.map(|(gate, up)| MoeSaved { gate, up }))
    }

    fn moe_experts_backward(
        input: MoeExpertsInput<Self>,
        grad: T<R>,
        saved: Option<MoeSaved<Self>>,
    ) -> MoeExpertsGrads<Self> {
        let saved = saved.map(|s| (s.gate, s.up));
        let g = moe_backward(moe_input_cast(&input), grad, saved);
        MoeExpertsGrads {
            input: g.input,
            weights: g.weights,
            w1: g.w1,
            w3: g.w3,
            w2: g.w2,
        }
    }

    fn mx_fake_quant(x: T<R>, spec: MxSpec) -> T<R> {
        fake_quant_rows(x, spec)
    }
}
