//! Fused SiTU-GLU (design §1): one pass over `gate` and `up`, f32 math whatever the storage dtype.
//!
//! ```text
//! A(g) = β1·tanh(g/β1)·σ(g)          dA/dg = (1 − t_g²)·σ + β1·t_g·σ·(1 − σ)
//! B(v) = β2·tanh(v/β2)  (or v)       dB/dv = 1 − t_v²  (or 1)
//! y    = p·A·B                       dG = p·dY·B·dA/dg,  dV = p·dY·A·dB/dv,  dp = Σ_row dY·A·B
//! ```
//!
//! `p` is an optional per-row routing weight (rows of `row_len` elements, f32). The element loops
//! are vectorised: each unit loads one `Vector<F, N>` of every input and works on its lanes in f32.
//! [`MODE_SWIGLU`] swaps in `A(g) = g·σ(g)`, `B(v) = v` (SwiGLU, the `β → ∞` limit).

use cubecl::prelude::*;

/// `A(g) = β1·tanh(g/β1)·σ(g)`, `B(v) = v`.
pub const MODE_SITU: u32 = 0;
/// `A(g) = β1·tanh(g/β1)·σ(g)`, `B(v) = β2·tanh(v/β2)` (K3).
pub const MODE_SITU_CAPPED: u32 = 1;
/// `A(g) = g·σ(g)`, `B(v) = v` (SwiGLU).
pub const MODE_SWIGLU: u32 = 2;

/// Units per cube of [`situ_glu_backward_weighted`](fn@situ_glu_backward_weighted) as
/// `kimi-burn` launches it (its `cube_size`; a power of two).
pub const WEIGHTED_BACKWARD_CUBE: u32 = 64;

/// Below this `|x|`, `tanh(x)` is the odd Taylor polynomial up to `x⁹` (truncation error below
/// 1e−8 relative): `(1 − e^{−2|x|})/(1 + e^{−2|x|})` would cancel there, and shader `tanh` is
/// often written through `exp(2x)`, which cancels the same way (and overflows for large `|x|`).
const TANH_SERIES_BELOW: f32 = 0.25;

/// `(tanh(x), 1 − tanh²(x))` without cancellation or overflow anywhere: with `e = e^{−2|x|}`,
/// `tanh(x) = sign(x)·(1 − e)/(1 + e)` (a polynomial near 0) and `1 − tanh²(x) = 4e/(1 + e)²`,
/// which keeps its relative precision where `tanh` has saturated to ±1.
#[cube]
pub fn tanh_sech2(x: f32) -> (f32, f32) {
    let a = f32::abs(x);
    let e = f32::exp(-2.0 * a);
    let d = 1.0 + e;
    let mut t = (1.0 - e) / d;
    if a < TANH_SERIES_BELOW {
        let a2 = a * a;
        let p = 62.0 / 2835.0;
        let p = p * a2 - 17.0 / 315.0;
        let p = p * a2 + 2.0 / 15.0;
        let p = p * a2 - 1.0 / 3.0;
        t = a + a * a2 * p;
    }
    if x < 0.0 {
        t = -t;
    }
    (t, 4.0 * e / (d * d))
}

/// `(σ(g), 1 − σ(g))` from `e = e^{−|g|}`: `1/(1 + e)` and `e/(1 + e)`, swapped for `g < 0`.
/// Neither overflows, and neither is formed by a subtraction, so both keep their relative
/// precision in the tails (σ(−20) ≈ 2e−9, where `½ + ½·tanh(g/2)` returns rounding noise).
#[cube]
pub fn sigmoid_pair(g: f32) -> (f32, f32) {
    let e = f32::exp(-f32::abs(g));
    let r = 1.0 / (1.0 + e);
    let mut s = r;
    let mut c = e * r;
    if g < 0.0 {
        s = e * r;
        c = r;
    }
    (s, c)
}

/// The gate branch `A(g)`.
#[cube]
pub fn glu_a(g: f32, beta1: f32, #[comptime] mode: u32) -> f32 {
    let (s, _c) = sigmoid_pair(g);
    let mut a = g * s;
    if comptime!(mode != MODE_SWIGLU) {
        let (t, _d) = tanh_sech2(g / beta1);
        a = beta1 * t * s;
    }
    a
}

/// `dA/dg`: `σ·(1 + g·(1 − σ))` for SwiGLU, `(1 − t²)·σ + β1·t·σ·(1 − σ)` with `t = tanh(g/β1)`
/// for SiTU, with `1 − σ` and `1 − t²` from [`sigmoid_pair()`] and [`tanh_sech2()`].
#[cube]
pub fn glu_da(g: f32, beta1: f32, #[comptime] mode: u32) -> f32 {
    let (s, c) = sigmoid_pair(g);
    let mut d = s * (1.0 + g * c);
    if comptime!(mode != MODE_SWIGLU) {
        let (t, sech2) = tanh_sech2(g / beta1);
        d = sech2 * s + beta1 * t * s * c;
    }
    d
}

/// The linear branch `B(v)`.
#[cube]
pub fn glu_b(v: f32, beta2: f32, #[comptime] mode: u32) -> f32 {
    let mut b = v;
    if comptime!(mode == MODE_SITU_CAPPED) {
        let (t, _d) = tanh_sech2(v / beta2);
        b = beta2 * t;
    }
    b
}

/// The weighted GLU backward of one element: `(dg, dv, A, B)` for gate `g`, up `v`, output
/// gradient `d` and routing weight `p`; `Σ_row d·A·B` is the gradient of `p`, and `p·A·B` the
/// forward's value.
#[cube]
pub fn glu_backward(
    g: f32,
    v: f32,
    d: f32,
    p: f32,
    beta1: f32,
    beta2: f32,
    #[comptime] mode: u32,
) -> (f32, f32, f32, f32) {
    let a = glu_a(g, beta1, mode);
    let b = glu_b(v, beta2, mode);
    (
        p * d * b * glu_da(g, beta1, mode),
        p * d * a * glu_db(v, beta2, mode),
        a,
        b,
    )
}

/// `dB/dv`.
#[cube]
pub fn glu_db(v: f32, beta2: f32, #[comptime] mode: u32) -> f32 {
    let mut d = 1.0f32;
    if comptime!(mode == MODE_SITU_CAPPED) {
        let (_t, sech2) = tanh_sech2(v / beta2);
        d = sech2;
    }
    d
}

/// Forward: `out = p·A(gate)·B(up)` elementwise.
///
/// All arrays are contiguous; `gate`, `up`, `out` hold `len` vectors of `N` elements, rows of
/// `row_vecs` vectors. `weight: [rows]` f32 is read only when `weighted` (pass any non-empty array
/// otherwise). Launch with at least `len` units; extra units exit.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn situ_glu_forward<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    weight: &Array<f32>,
    out: &mut Array<Vector<F, N>>,
    len: usize,
    row_vecs: usize,
    beta1: f32,
    beta2: f32,
    #[comptime] mode: u32,
    #[comptime] weighted: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let gv = gate[i];
    let uv = up[i];
    let mut p = 1.0f32;
    if comptime!(weighted) {
        p = weight[i / row_vecs];
    }
    let mut o = gv;
    #[unroll]
    for j in 0..N::value() {
        let g = f32::cast_from(gv[j]);
        let v = f32::cast_from(uv[j]);
        let y = p * glu_a(g, beta1, mode) * glu_b(v, beta2, mode);
        o[j] = F::cast_from(y);
    }
    out[i] = o;
}

/// Backward without a routing weight: `dgate = dY·B·dA/dg`, `dup = dY·A·dB/dv`, elementwise.
///
/// Same layout contract as [`situ_glu_forward`](fn@situ_glu_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn situ_glu_backward<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    dy: &Array<Vector<F, N>>,
    dgate: &mut Array<Vector<F, N>>,
    dup: &mut Array<Vector<F, N>>,
    len: usize,
    beta1: f32,
    beta2: f32,
    #[comptime] mode: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= len {
        terminate!();
    }
    let gv = gate[i];
    let uv = up[i];
    let dv = dy[i];
    let mut dg_out = gv;
    let mut du_out = uv;
    #[unroll]
    for j in 0..N::value() {
        let g = f32::cast_from(gv[j]);
        let v = f32::cast_from(uv[j]);
        let d = f32::cast_from(dv[j]);
        dg_out[j] = F::cast_from(d * glu_b(v, beta2, mode) * glu_da(g, beta1, mode));
        du_out[j] = F::cast_from(d * glu_a(g, beta1, mode) * glu_db(v, beta2, mode));
    }
    dgate[i] = dg_out;
    dup[i] = du_out;
}

/// Backward with a per-row routing weight `p`: one cube per row computes `dgate`, `dup` for the
/// row and `dweight[row] = Σ dY·A·B` by a tree reduction in shared memory (fixed order, so the
/// result is bit-reproducible; no float atomics).
///
/// `cube_size` must equal the launch's `CUBE_DIM` and be a power of two. Launch at least `rows`
/// cubes; extra cubes exit.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn situ_glu_backward_weighted<F: Float, N: Size>(
    gate: &Array<Vector<F, N>>,
    up: &Array<Vector<F, N>>,
    dy: &Array<Vector<F, N>>,
    weight: &Array<f32>,
    dgate: &mut Array<Vector<F, N>>,
    dup: &mut Array<Vector<F, N>>,
    dweight: &mut Array<f32>,
    rows: usize,
    row_vecs: usize,
    beta1: f32,
    beta2: f32,
    #[comptime] mode: u32,
    #[comptime] cube_size: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let p = weight[row];
    let mut acc = 0.0f32;
    let mut c = UNIT_POS as usize;
    while c < row_vecs {
        let i = row * row_vecs + c;
        let gv = gate[i];
        let uv = up[i];
        let dv = dy[i];
        let mut dg_out = gv;
        let mut du_out = uv;
        #[unroll]
        for j in 0..N::value() {
            let g = f32::cast_from(gv[j]);
            let v = f32::cast_from(uv[j]);
            let d = f32::cast_from(dv[j]);
            let (dg, du, a, b) = glu_backward(g, v, d, p, beta1, beta2, mode);
            acc += d * a * b;
            dg_out[j] = F::cast_from(dg);
            du_out[j] = F::cast_from(du);
        }
        dgate[i] = dg_out;
        dup[i] = du_out;
        c += CUBE_DIM as usize;
    }
    let mut partial = SharedMemory::<f32>::new(cube_size as usize);
    partial[UNIT_POS as usize] = acc;
    sync_cube();
    let mut stride = CUBE_DIM / 2;
    while stride > 0 {
        if UNIT_POS < stride {
            let u = UNIT_POS as usize;
            partial[u] = partial[u] + partial[u + stride as usize];
        }
        sync_cube();
        stride /= 2;
    }
    if UNIT_POS == 0 {
        dweight[row] = partial[0];
    }
}
