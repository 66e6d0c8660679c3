//! [`MoeKernels`] for every CubeCL backend: allocates outputs and launches the kernels of
//! `kimi-burn-kernels`.

use burn::tensor::{DType, Shape};
use burn_cubecl::element::BoolElement;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{tensor_vector_size_parallel, CubeCount, CubeDim};
use kimi_burn_kernels::{moe as kmoe, qb_histogram as kqb, situ as ksitu};

use super::kernels::{MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
use super::situ::GluActivation;
use crate::nn::balance::HistogramSpec;
use crate::ops::backend::cube::{contiguous_as, elementwise, empty, f32_scalar, per_row};
use crate::ops::quant::cube::fake_quant_rows;
use crate::ops::quant::MxSpec;
use burn::tensor::ops::FloatTensorOps;

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

use crate::ops::backend::cube::zeros_u32 as zeros_u32_shaped;

type T<R> = CubeTensor<R>;

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

/// Cube size of the row-wise backward (a power of two).
const ROW_CUBE: u32 = 64;

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
                        CubeDim::new_1d(ROW_CUBE),
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
                        ROW_CUBE,
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

/// The device-side dispatch plan (see `kimi_burn_kernels::moe`).
struct Plan<R: CubeRuntime> {
    sorted_token: T<R>,
    sorted_weight: T<R>,
    inv: T<R>,
    offsets: T<R>,
    tile_offsets: T<R>,
    /// All `m·k` pairs (the buffers' row count; masked pairs leave a tail that is never read).
    pairs: usize,
    tokens: usize,
    k: usize,
    n: usize,
}

fn plan<R: CubeRuntime>(indices: T<R>, valid: Option<T<R>>, weights: T<R>, n: usize) -> Plan<R> {
    let indices = into_contiguous(indices);
    let [tokens, k] = dims2(&indices);
    let pairs = tokens * k;
    let weights = contiguous_as(weights, DType::F32);
    let masked = valid.is_some();
    let valid = match valid {
        Some(v) => contiguous_as(v, DType::U32),
        None => zeros_u32(&indices, 1),
    };
    let block = kmoe::PLAN_BLOCK as usize;
    let blocks = pairs.div_ceil(block);
    let local_rank = empty(&indices, [pairs.max(1)], DType::U32);
    let block_counts = zeros_u32(&indices, blocks * n);
    let block_base = empty(&indices, [(blocks * n).max(1)], DType::U32);
    let totals = empty(&indices, [n], DType::U32);
    let offsets = empty(&indices, [n + 1], DType::U32);
    let tile_offsets = empty(&indices, [n + 1], DType::U32);
    // Zeros, so the rows past the last segment (masked pairs) gather token 0: harmless reads.
    let sorted_token = zeros_u32(&indices, pairs);
    let sorted_weight = empty(&indices, [pairs.max(1)], DType::F32);
    let inv = empty(&indices, [pairs.max(1)], DType::U32);
    let client = indices.client.clone();
    let idx_dtype = indices.dtype;
    if pairs > 0 {
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::moe_block_ranks::launch_unchecked::<R>(
                &client,
                per_row(&indices, blocks),
                CubeDim::new_1d(kmoe::PLAN_BLOCK),
                indices.clone().into_array_arg(),
                valid.clone().into_array_arg(),
                local_rank.clone().into_array_arg(),
                block_counts.clone().into_array_arg(),
                pairs,
                k,
                n,
                masked,
                idx_dtype.into(),
            )
        };
    }
    let (count, dim) = elementwise(&indices, n);
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kmoe::moe_block_scan::launch_unchecked::<R>(
            &client,
            count,
            dim,
            block_counts.into_array_arg(),
            block_base.clone().into_array_arg(),
            totals.clone().into_array_arg(),
            blocks,
            n,
        )
    };
    // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
    unsafe {
        kmoe::moe_offsets::launch_unchecked::<R>(
            &client,
            CubeCount::new_single(),
            CubeDim::new_1d(1),
            totals.into_array_arg(),
            offsets.clone().into_array_arg(),
            tile_offsets.clone().into_array_arg(),
            n,
        )
    };
    if pairs > 0 {
        let (count, dim) = elementwise(&indices, pairs);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::moe_place::launch_unchecked::<R>(
                &client,
                count,
                dim,
                indices.into_array_arg(),
                valid.into_array_arg(),
                weights.into_array_arg(),
                local_rank.into_array_arg(),
                block_base.into_array_arg(),
                offsets.clone().into_array_arg(),
                sorted_token.clone().into_array_arg(),
                sorted_weight.clone().into_array_arg(),
                inv.clone().into_array_arg(),
                pairs,
                k,
                n,
                masked,
                idx_dtype.into(),
            )
        };
    }
    Plan {
        sorted_token,
        sorted_weight,
        inv,
        offsets,
        tile_offsets,
        pairs,
        tokens,
        k,
        n,
    }
}

/// `out[pos] (+)= a[row(pos)] · w[e]` over the plan's segments (see `kmoe::grouped_matmul`).
/// `w: [n, kdim, cols]`, or `[n, cols, kdim]` when `transposed`.
#[allow(clippy::too_many_arguments)]
fn grouped_matmul<R: CubeRuntime>(
    a: &T<R>,
    w: &T<R>,
    plan: &Plan<R>,
    gather: bool,
    transposed: bool,
    accumulate: Option<T<R>>,
    kdim: usize,
    cols: usize,
) -> T<R> {
    let out = match &accumulate {
        Some(o) => o.clone(),
        None => empty(a, [plan.pairs.max(1), cols], a.dtype),
    };
    let mode = Gmm {
        gather,
        transposed,
        accumulate: accumulate.is_some(),
        glu: None,
    };
    launch_grouped(a, w, plan, &out, mode, kdim, cols);
    out
}

/// The gate and up projections of the sorted pairs, `[pairs, m_e]` each.
type Projections<R> = (T<R>, T<R>);

/// The experts' first layer fused (see `kmoe::grouped_matmul` with `glu`): the activated hidden
/// rows `p·act(h[row]·W1[e], h[row]·W3[e])`, `[pairs, m_e]`, rows gathered from `h` by the plan,
/// and with `save` also the gate and up projections (else `None`).
fn grouped_glu<R: CubeRuntime>(
    ex: &Experts<R>,
    plan: &Plan<R>,
    activation: GluActivation,
    save: bool,
) -> (T<R>, Option<Projections<R>>) {
    let a = &ex.h;
    let rows = plan.pairs.max(1);
    let out = empty(a, [rows, ex.hidden], a.dtype);
    let saved = save.then(|| {
        (
            empty(a, [rows, ex.hidden], a.dtype),
            empty(a, [rows, ex.hidden], a.dtype),
        )
    });
    let (gate, up) = match &saved {
        Some((g, u)) => (g.clone(), u.clone()),
        None => (out.clone(), out.clone()),
    };
    let mode = Gmm {
        gather: true,
        transposed: false,
        accumulate: false,
        glu: Some(GluLaunch {
            w3: ex.w3.clone(),
            activation,
            gate,
            up,
            save,
            backward: None,
        }),
    };
    launch_grouped(a, &ex.w1, plan, &out, mode, ex.width, ex.hidden);
    (out, saved)
}

/// The fused first layer's backward from `grad: [tokens, ℓ]` (see `kmoe::grouped_matmul` with
/// `EPILOGUE_GLU_BACKWARD`): `dAct = grad[row]·W2[e]ᵀ` stays in registers, and the epilogue turns
/// it into `(act, dg, du, dp)` with the gate and up projections `g`, `u`: the forward's
/// activation (for `dW2`), `[pairs, m_e]` three times, and `[pairs]` f32.
fn grouped_glu_backward<R: CubeRuntime>(
    grad: &T<R>,
    ex: &Experts<R>,
    plan: &Plan<R>,
    (g, u): &Projections<R>,
    activation: GluActivation,
) -> [T<R>; 4] {
    let rows = plan.pairs.max(1);
    let col_tiles = ex.hidden.div_ceil(kmoe::TILE as usize).max(1);
    let [act, dg, du] = [(); 3].map(|_| empty(g, [rows, ex.hidden], g.dtype));
    // Rows past the last segment (masked pairs) are not written; their dp is never gathered.
    let partial = empty(g, [rows * col_tiles], DType::F32);
    let mode = Gmm {
        gather: true,
        transposed: true,
        accumulate: false,
        glu: Some(GluLaunch {
            w3: ex.w2.clone(),
            activation,
            gate: g.clone(),
            up: u.clone(),
            save: false,
            backward: Some(GluBackward {
                du: du.clone(),
                act: act.clone(),
                dp: partial.clone(),
            }),
        }),
    };
    launch_grouped(grad, &ex.w2, plan, &dg, mode, ex.width, ex.hidden);
    let partial = CubeBackendOf::<R>::float_reshape(partial, Shape::new([rows, col_tiles]));
    let dp = CubeBackendOf::<R>::float_sum_dim(partial, 1);
    let dp = CubeBackendOf::<R>::float_reshape(dp, Shape::new([rows]));
    [act, dg, du, dp]
}

/// The fused backward's outputs besides `dg` (the launch's `out`).
struct GluBackward<R: CubeRuntime> {
    du: T<R>,
    act: T<R>,
    /// Per-row partials of `dp`, `[pairs · col_tiles]` f32.
    dp: T<R>,
}

/// The fused first layer's extra inputs and outputs: forward (`backward: None`) or backward
/// (`gate`, `up` read; `dg` to the launch's `out`, the rest in [`GluBackward`]).
struct GluLaunch<R: CubeRuntime> {
    w3: T<R>,
    activation: GluActivation,
    gate: T<R>,
    up: T<R>,
    save: bool,
    backward: Option<GluBackward<R>>,
}

/// How `kmoe::grouped_matmul` runs.
struct Gmm<R: CubeRuntime> {
    gather: bool,
    transposed: bool,
    accumulate: bool,
    glu: Option<GluLaunch<R>>,
}

/// Launches `kmoe::grouped_matmul` over all of the plan's tiles, in as many launches as the
/// device's grid limit needs.
fn launch_grouped<R: CubeRuntime>(
    a: &T<R>,
    w: &T<R>,
    plan: &Plan<R>,
    out: &T<R>,
    mode: Gmm<R>,
    kdim: usize,
    cols: usize,
) {
    if plan.pairs == 0 || cols == 0 {
        return;
    }
    let tile = kmoe::TILE as usize;
    // Σ_e ceil(len_e / TILE) ≤ pairs / TILE + n; spare cubes exit after one read.
    let tiles = (plan.pairs.div_ceil(tile) + plan.n) as u32;
    let col_tiles = cols.div_ceil(tile) as u32;
    let max_x = a.client.properties().hardware.max_cube_count.0.max(1);
    let (w3, weight, gate, up, (act_mode, b1, b2), save) = match &mode.glu {
        Some(g) => (
            g.w3.clone(),
            plan.sorted_weight.clone(),
            g.gate.clone(),
            g.up.clone(),
            activation_params(g.activation),
            g.save,
        ),
        // Not read without `glu`.
        None => (
            w.clone(),
            dummy_f32(a),
            out.clone(),
            out.clone(),
            (ksitu::MODE_SWIGLU, 1.0, 1.0),
            false,
        ),
    };
    // Arrays an epilogue does not use are stand-ins (`out`, a one-element f32).
    let (epilogue, hidden, act, dp) = match mode.glu.as_ref().and_then(|g| g.backward.as_ref()) {
        Some(b) => (
            kmoe::EPILOGUE_GLU_BACKWARD,
            b.du.clone(),
            b.act.clone(),
            b.dp.clone(),
        ),
        None if mode.glu.is_some() => (kmoe::EPILOGUE_GLU, out.clone(), out.clone(), dummy_f32(a)),
        None => (kmoe::EPILOGUE_PLAIN, out.clone(), out.clone(), dummy_f32(a)),
    };
    let mma = matrix_units(a);
    let cube = kmoe::grouped_matmul_cube(mma);
    let mut base = 0u32;
    while base < tiles {
        let x = (tiles - base).min(max_x);
        if mma {
            crate::ops::backend::record_tensor_core_launch();
        }
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::grouped_matmul::launch_unchecked::<R>(
                &a.client,
                CubeCount::Static(x, col_tiles, 1),
                CubeDim::new_2d(cube.0, cube.1),
                a.clone().into_array_arg(),
                w.clone().into_array_arg(),
                w3.clone().into_array_arg(),
                plan.sorted_token.clone().into_array_arg(),
                plan.offsets.clone().into_array_arg(),
                plan.tile_offsets.clone().into_array_arg(),
                weight.clone().into_array_arg(),
                out.clone().into_array_arg(),
                gate.clone().into_array_arg(),
                up.clone().into_array_arg(),
                hidden.clone().into_array_arg(),
                act.clone().into_array_arg(),
                dp.clone().into_array_arg(),
                base,
                plan.n,
                kdim,
                cols,
                b1,
                b2,
                mode.gather,
                mode.transposed,
                mode.accumulate,
                epilogue,
                act_mode,
                save,
                mma,
                a.dtype.into(),
            )
        };
        base += x;
    }
}

/// Whether `kmoe::grouped_matmul` runs its products on the matrix units for `a`'s storage
/// type: f16 or bf16, tensor cores switched on ([`crate::ops::with_tensor_cores`]), a device
/// with `16×16×16` cooperative matrices for that type with f32 accumulation, and planes of
/// exactly [`kmoe::MMA_PLANE`] units (the kernel's layout).
fn matrix_units<R: CubeRuntime>(a: &T<R>) -> bool {
    use cubecl::ir::features::MmaConfig;
    use cubecl::ir::{ElemType, FloatKind, StorageType};
    let kind = match a.dtype {
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        _ => return false,
    };
    if !crate::ops::tensor_cores_enabled() {
        return false;
    }
    let hardware = &a.client.properties().hardware;
    if hardware.plane_size_min != kmoe::MMA_PLANE || hardware.plane_size_max != kmoe::MMA_PLANE {
        return false;
    }
    let half: StorageType = ElemType::Float(kind).into();
    a.client.features().matmul.cmma.contains(&MmaConfig {
        a_type: half,
        b_type: half,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: 16,
        k: 16,
        n: 16,
    })
}

/// `out[e] = Σ_{pos ∈ segment e} a[arow(pos)]ᵀ · b[brow(pos)]`: `[n, adim, bdim]`.
fn grouped_wgrad<R: CubeRuntime>(
    a: &T<R>,
    b: &T<R>,
    plan: &Plan<R>,
    gather: (bool, bool),
    adim: usize,
    bdim: usize,
    dtype: DType,
) -> T<R> {
    let b = cast(b.clone(), a.dtype);
    let out = empty(a, [plan.n, adim, bdim], a.dtype);
    if plan.n * adim * bdim > 0 {
        let tile = kmoe::TILE as usize;
        let mma = matrix_units(a);
        if mma {
            crate::ops::backend::record_tensor_core_launch();
        }
        let cube = kmoe::grouped_matmul_cube(mma);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::grouped_matmul_wgrad::launch_unchecked::<R>(
                &a.client,
                CubeCount::Static(
                    adim.div_ceil(tile) as u32,
                    bdim.div_ceil(tile) as u32,
                    plan.n as u32,
                ),
                CubeDim::new_2d(cube.0, cube.1),
                a.clone().into_array_arg(),
                b.into_array_arg(),
                plan.sorted_token.clone().into_array_arg(),
                plan.offsets.clone().into_array_arg(),
                out.clone().into_array_arg(),
                adim,
                bdim,
                gather.0,
                gather.1,
                mma,
                a.dtype.into(),
            )
        };
    }
    cast(out, dtype)
}

/// The un-permute `out[t] = Σ_slot y[inv[t, slot]]`: `[tokens, width]`.
fn combine<R: CubeRuntime>(y: &T<R>, plan: &Plan<R>, width: usize) -> T<R> {
    let out = empty(y, [plan.tokens, width], y.dtype);
    let units = plan.tokens * width;
    if units > 0 {
        let (count, dim) = elementwise(y, units);
        // SAFETY: the kernel bounds every index itself ("Unchecked launches", ops/backend/cube.rs).
        unsafe {
            kmoe::moe_combine::launch_unchecked::<R>(
                &y.client,
                count,
                dim,
                y.clone().into_array_arg(),
                plan.inv.clone().into_array_arg(),
                out.clone().into_array_arg(),
                plan.tokens,
                width,
                plan.k,
                y.dtype.into(),
            )
        };
    }
    out
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
    let w_dtype = input.w1.dtype;
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
    let dw2 = grouped_wgrad(&act, &grad, &plan, (false, true), me, l, w_dtype);
    let dw1 = grouped_wgrad(&ex.h, &dg, &plan, (true, false), l, me, w_dtype);
    let dw3 = grouped_wgrad(&ex.h, &du, &plan, (true, false), l, me, w_dtype);
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
