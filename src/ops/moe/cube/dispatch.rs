//! The dropless dispatch on the device: the plan (the routed pairs sorted by expert), the grouped
//! matmuls over the expert segments, their fused SiTU-GLU epilogues and weight gradients, and the
//! un-permute.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::CubeRuntime;
use cubecl::{CubeCount, CubeDim};
use kimi_burn_kernels::{moe as kmoe, situ as ksitu};

use super::{activation_params, dims2, dummy_f32, zeros_u32, CubeBackendOf, Experts, T};
use crate::ops::backend::cube::{contiguous_as, elementwise, empty, per_row};
use crate::ops::moe::situ::GluActivation;

/// The device-side dispatch plan (see `kimi_burn_kernels::moe`).
pub(super) struct Plan<R: CubeRuntime> {
    sorted_token: T<R>,
    pub(super) sorted_weight: T<R>,
    pub(super) inv: T<R>,
    offsets: T<R>,
    tile_offsets: T<R>,
    /// All `m·k` pairs (the buffers' row count; masked pairs leave a tail that is never read).
    pub(super) pairs: usize,
    pub(super) tokens: usize,
    pub(super) k: usize,
    n: usize,
}

pub(super) fn plan<R: CubeRuntime>(
    indices: T<R>,
    valid: Option<T<R>>,
    weights: T<R>,
    n: usize,
) -> Plan<R> {
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
pub(super) fn grouped_matmul<R: CubeRuntime>(
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
pub(super) type Projections<R> = (T<R>, T<R>);

/// The experts' first layer fused (see `kmoe::grouped_matmul` with `glu`): the activated hidden
/// rows `p·act(h[row]·W1[e], h[row]·W3[e])`, `[pairs, m_e]`, rows gathered from `h` by the plan,
/// and with `save` also the gate and up projections (else `None`).
pub(super) fn grouped_glu<R: CubeRuntime>(
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
pub(super) fn grouped_glu_backward<R: CubeRuntime>(
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
    let products = products(a);
    let cube = kmoe::grouped_matmul_cube(products);
    let mut base = 0u32;
    while base < tiles {
        let x = (tiles - base).min(max_x);
        record_launch(products);
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
                products,
                a.dtype.into(),
            )
        };
        base += x;
    }
}

/// How the grouped matmuls compute their products for `a`'s storage type
/// ([`kmoe::Products`]):
///
/// - under [`crate::ops::with_tensor_core_emulation`], the tensor-core path with its block
///   products emulated (in its TF32 shape for f32 storage);
/// - with tensor cores switched on ([`crate::ops::with_tensor_cores`]), on a device with planes
///   of exactly [`kmoe::MMA_PLANE`] units (the kernel's layout) and cooperative matrices with
///   f32 accumulation for the type: `16×16×16` of f16 or bf16 for half storage, `16×16×8` of
///   TF32 for f32 storage (tensor cores on CUDA, compute capability 8.0 and later);
/// - else the scalar loop.
fn products<R: CubeRuntime>(a: &T<R>) -> kmoe::Products {
    if crate::ops::tensor_core_emulation() {
        match a.dtype {
            DType::F32 => kmoe::Products::EmulatedTf32,
            _ => kmoe::Products::Emulated,
        }
    } else {
        matrix_units(a).unwrap_or(kmoe::Products::Scalar)
    }
}

/// Counts one launch off the scalar loop ([`crate::ops::tensor_core_launches`]).
fn record_launch(products: kmoe::Products) {
    if products.blocks() {
        crate::ops::backend::record_tensor_core_launch();
    }
}

/// The matrix-unit path for `a`'s storage type, where the device has one and tensor cores are
/// switched on (see [`products`]).
fn matrix_units<R: CubeRuntime>(a: &T<R>) -> Option<kmoe::Products> {
    use cubecl::ir::features::MmaConfig;
    use cubecl::ir::{ElemType, FloatKind, StorageType};
    let (kind, products) = match a.dtype {
        DType::F16 => (FloatKind::F16, kmoe::Products::MatrixUnits),
        DType::BF16 => (FloatKind::BF16, kmoe::Products::MatrixUnits),
        DType::F32 => (FloatKind::TF32, kmoe::Products::MatrixUnitsTf32),
        _ => return None,
    };
    if !crate::ops::tensor_cores_enabled() {
        return None;
    }
    let hardware = &a.client.properties().hardware;
    if hardware.plane_size_min != kmoe::MMA_PLANE || hardware.plane_size_max != kmoe::MMA_PLANE {
        return None;
    }
    let operand: StorageType = ElemType::Float(kind).into();
    a.client
        .features()
        .matmul
        .cmma
        .contains(&MmaConfig {
            a_type: operand,
            b_type: operand,
            cd_type: ElemType::Float(FloatKind::F32).into(),
            m: 16,
            k: products.depth() as u32,
            n: 16,
        })
        .then_some(products)
}

/// `out[e] = Σ_{pos ∈ segment e} a[arow(pos)]ᵀ · b[brow(pos)]`: `[n, adim, bdim]`.
pub(super) fn grouped_wgrad<R: CubeRuntime>(
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
        let products = products(a);
        record_launch(products);
        let cube = kmoe::grouped_matmul_cube(products);
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
                products,
                a.dtype.into(),
            )
        };
    }
    cast(out, dtype)
}

/// The un-permute `out[t] = Σ_slot y[inv[t, slot]]`: `[tokens, width]`.
pub(super) fn combine<R: CubeRuntime>(y: &T<R>, plan: &Plan<R>, width: usize) -> T<R> {
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
