//! Elementwise CPU kernels: the sigmoid, SiLU, `tanh` (and the soft cap `β·tanh(x/β)`), softplus,
//! SiTU and SiTU-GLU islands of the model in one pass each, forward and backward, with `f32`
//! arithmetic.
//!
//! In tensor ops each of these is a chain of four to twelve ops, and on ndarray `tanh` rounds
//! through f64 (tens of nanoseconds per element): the activations alone cost more than the matrix
//! products of the tiny model. The kernels compute the same functions in `f32` from `exp` and
//! `exp_m1` in forms that neither cancel nor overflow anywhere (docs/design.md, "Numerics of the
//! activations"):
//!
//! ```text
//! e = e^{−|x|}:      σ(x) = 1/(1+e), 1 − σ(x) = e/(1+e)  (x ≥ 0; swapped for x < 0)
//! m = expm1(−2|x|), e₂ = e^{−2|x|}:  tanh(x) = −sign(x)·m/(1+e₂),  1 − tanh²(x) = 4e₂/(1+e₂)²
//! ```
//!
//! `1 − σ` and `1 − tanh²` are never formed by a subtraction: near saturation that subtraction
//! returns rounding noise (σ(−20) ≈ 2e−9 is below f32's spacing at ½).

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use crate::ops::backend::host::{DisjointWrites, HostArray, HostOp};
use crate::ops::backend::simd::{
    exp_expm1_nonpositive_lane, exp_expm1_nonpositive_lean_lane, exp_lane, ln_1p_unit_lane, map,
    map_into, map_many, map_many_into, Elementwise, ElementwiseMany,
};
use crate::ops::norm::host::for_row_blocks;

/// `(σ(x), 1 − σ(x))` in `f32`, each accurate to a few ulp for every `x`.
#[inline(always)]
pub(crate) fn sigmoid_pair(x: f32) -> (f32, f32) {
    let e = exp_lane(-x.abs());
    let r = 1.0 / (1.0 + e);
    let (big, small) = (r, e * r);
    if x >= 0.0 {
        (big, small)
    } else {
        (small, big)
    }
}

/// The logistic sigmoid in `f32`, accurate to a few ulp for every `x`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    sigmoid_pair(x).0
}

/// `(tanh(c·x), 1 − tanh²(c·x))` in `f32` through `expm1` for a scale `c > 0`: accurate near
/// zero, and the derivative keeps its relative precision where `tanh` has saturated to ±1.
#[inline(always)]
fn scaled_tanh_sech2(x: f32, c: f32) -> (f32, f32) {
    let (n, d, e2) = tanh_parts::<false>(x, c);
    // One division (they are the slow instruction of these loops) for both.
    let r = 1.0 / d;
    (n * r, 4.0 * e2 * r * r)
}

/// `tanh(c·x) = n / d` for a scale `c > 0` as `(n, d, e₂)`: `n = −sign(x)·expm1(−2|c·x|)`,
/// `d = 1 + e₂ ∈ [1, 2]`, `e₂ = e^{−2|c·x|}`; the division left to the caller, who may fold
/// several into one. The argument `−2|c·x|` is formed as `|x|·(−2c)`, one multiplication: the
/// same value (doubling is exact, so it commutes with the rounding of the product) wherever `c·x`
/// is a normal number.
///
/// `LEAN` takes [`exp_expm1_nonpositive_lean_lane`]: the same `n` and `d` for every input, and
/// `e₂` is about 1.3e−38 instead of 0 where `|c·x| > 43.65`. For callers that use `e₂` only
/// through `d` (a value), not as `1 − tanh²` (a gradient, which would no longer be exactly 0
/// there).
#[inline(always)]
fn tanh_parts<const LEAN: bool>(x: f32, c: f32) -> (f32, f32, f32) {
    let a = x.abs() * (-2.0 * c);
    let (e2, m) = if LEAN {
        exp_expm1_nonpositive_lean_lane(a)
    } else {
        exp_expm1_nonpositive_lane(a)
    };
    ((-m).copysign(x), 1.0 + e2, e2)
}

/// `(tanh(x), 1 − tanh²(x))`: [`scaled_tanh_sech2`] at scale 1.
#[cfg(test)]
#[inline(always)]
pub(crate) fn tanh_sech2(x: f32) -> (f32, f32) {
    scaled_tanh_sech2(x, 1.0)
}

/// `tanh` in `f32` through `expm1`, accurate near zero and saturating cleanly for large `|x|`.
#[cfg(test)]
#[inline]
pub(crate) fn tanh(x: f32) -> f32 {
    tanh_sech2(x).0
}

/// Above this, softplus is the identity (design §4.2), as in the tensor ops.
pub(crate) const SOFTPLUS_LINEAR: f32 = 20.0;

/// `(softplus(x), e^{−|x|})`: `max(x, 0) + log1p(e^{−|x|})` as in the tensor ops (the `log1p` by
/// [`ln_1p_unit_lane`], branch-free), and `x` itself above [`SOFTPLUS_LINEAR`].
#[inline(always)]
pub(crate) fn softplus(x: f32) -> (f32, f32) {
    let e = exp_lane(-x.abs());
    let y = x.max(0.0) + ln_1p_unit_lane(e);
    (if x > SOFTPLUS_LINEAR { x } else { y }, e)
}

/// A differentiable scalar function of one input for the elementwise loops ([`Value`],
/// [`Derivative`]). Both methods must be `#[inline(always)]` and branch-free (selects only), so
/// that the loops around them vectorise.
pub(crate) trait Scalar: Copy + Send + Sync {
    /// `f(x)`.
    fn value(self, x: f32) -> f32;
    /// `f'(x)`.
    fn derivative(self, x: f32) -> f32;
}

/// `σ(x)` ([`sigmoid_pair`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sigmoid;

impl Scalar for Sigmoid {
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        sigmoid(x)
    }

    #[inline(always)]
    fn derivative(self, x: f32) -> f32 {
        let (s, c) = sigmoid_pair(x);
        s * c
    }
}

/// `x·σ(x)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Silu;

impl Scalar for Silu {
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        x * sigmoid(x)
    }

    #[inline(always)]
    fn derivative(self, x: f32) -> f32 {
        let (s, c) = sigmoid_pair(x);
        s * (1.0 + x * c)
    }
}

/// The soft cap `β·tanh(x/β)` for `β > 0` (`tanh` itself at `β = 1`), with the derivative
/// `1 − tanh²(x/β)` from the same exponential ([`tanh_parts`]: the argument is formed as
/// `|x|·(−2/β)`, as in SiTU-GLU's capped branch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SoftCap(pub f32);

impl Scalar for SoftCap {
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        let (n, d, _) = tanh_parts::<true>(x, 1.0 / self.0);
        self.0 * n / d
    }

    #[inline(always)]
    fn derivative(self, x: f32) -> f32 {
        scaled_tanh_sech2(x, 1.0 / self.0).1
    }
}

/// `softplus(x) = log(1 + e^x)` ([`softplus`]), whose derivative is `σ(x)` (1 above
/// [`SOFTPLUS_LINEAR`], where the value is `x`), from the same exponential.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Softplus;

impl Scalar for Softplus {
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        softplus(x).0
    }

    #[inline(always)]
    fn derivative(self, x: f32) -> f32 {
        let e = exp_lane(-x.abs());
        // σ(x): 1/(1 + e) for x ≥ 0, e/(1 + e) below.
        let sigma = if x >= 0.0 { 1.0 } else { e } / (1.0 + e);
        if x > SOFTPLUS_LINEAR {
            1.0
        } else {
            sigma
        }
    }
}

/// SiTU's gate branch `A(x) = β1·tanh(x/β1)·σ(x)` alone: SiTU-GLU's [`SituGlu::parts`] without
/// the up branch, with `SHARED` as in [`Situ`] (`β1 = 4`, one exponential).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SituGate<const SHARED: bool>(pub f32);

impl<const SHARED: bool> SituGate<SHARED> {
    #[inline(always)]
    fn glu(self) -> SituGlu {
        SituGlu {
            beta1: self.0,
            beta2: None,
        }
    }
}

impl<const SHARED: bool> Scalar for SituGate<SHARED> {
    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        let p = self.glu().parts::<SHARED, true>(x, 1.0);
        p.a_num / (p.t_den * p.s_den)
    }

    #[inline(always)]
    fn derivative(self, x: f32) -> f32 {
        let p = self.glu().parts::<SHARED, false>(x, 1.0);
        // One division for the reciprocals of both denominators, as in `value_and_gradient`.
        let r = 1.0 / (p.t_den * p.s_den);
        let (inv_t, inv_s) = (p.s_den * r, p.t_den * r);
        let t = p.t_num * inv_t;
        let sech2 = 4.0 * p.e_t * inv_t * inv_t;
        let (s, c) = (p.s_num * inv_s, p.c_num * inv_s);
        sech2 * s + self.0 * t * s * c
    }
}

/// `y = f(x)` elementwise for one of the [`Scalar`] functions, as a host op.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Unary {
    /// [`Sigmoid`].
    Sigmoid,
    /// [`Silu`].
    Silu,
    /// [`SoftCap`] with its `β`.
    SoftCap(f32),
    /// [`Softplus`].
    Softplus,
    /// [`SituGate`] with its `β1`.
    SituGate(f32),
}

/// `$body` with `$f` bound to the [`Scalar`] function of the [`Unary`] `$op`: one match per call,
/// outside the loops, so that each function's loop is compiled on its own.
macro_rules! with_scalar {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            Unary::Sigmoid => {
                let $f = Sigmoid;
                $body
            }
            Unary::Silu => {
                let $f = Silu;
                $body
            }
            Unary::SoftCap(beta) => {
                let $f = SoftCap(beta);
                $body
            }
            Unary::Softplus => {
                let $f = Softplus;
                $body
            }
            Unary::SituGate(beta1) if SituGlu { beta1, beta2: None }.shares_exp() => {
                let $f = SituGate::<true>(beta1);
                $body
            }
            Unary::SituGate(beta1) => {
                let $f = SituGate::<false>(beta1);
                $body
            }
        }
    };
}

impl HostOp<1> for Unary {
    type Saved = ();

    fn forward(&self, [x]: &[HostArray; 1], save: bool) -> (HostArray, Option<()>) {
        let data = with_scalar!(*self, f => map([&x.data], Value(f)));
        let out = HostArray {
            data: data.into(),
            shape: x.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x]: &[HostArray; 1], _: &(), grad: &HostArray) -> [HostArray; 1] {
        let data = with_scalar!(*self, f => map([&x.data, &grad.data], Derivative(f)));
        [HostArray {
            data: data.into(),
            shape: x.shape.clone(),
        }]
    }
}

/// SiTU-GLU `A(gate) · B(up)` (design §1): `A(g) = β1·tanh(g/β1)·σ(g)`, `B(v) = β2·tanh(v/β2)` or
/// `v` without `β2`.
///
/// Each of `tanh(g/β1)`, `σ(g)` and `tanh(v/β2)` is a quotient whose denominator lies in `[1, 2]`,
/// so the value and both derivatives come from one division (of their product, in `[1, 8]`: it
/// can neither overflow nor underflow); divisions are the slow instruction of these loops. With
/// `β1 = 4` (the default) `σ(g)`'s `e^{−|g|}` is the square of the `e^{−|g|/2}` that
/// `tanh(g/4)` needs, so the gate takes one exponential instead of two ([`SituGlu::shares_exp`]:
/// the loops are compiled once for each case, so neither pays for the other's branch).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SituGlu {
    /// `β1`.
    pub beta1: f32,
    /// `β2`, or none for an uncapped linear branch.
    pub beta2: Option<f32>,
}

/// [`SituGlu`] with `SHARED` telling whether `β1 = 4` ([`SituGlu::shares_exp`]), for the loops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Situ<const SHARED: bool>(pub SituGlu);

/// The pieces of `A(g)·B(v)` before their one division.
struct SituParts {
    /// `A(g) = β1·tanh(g/β1)·σ(g) = a_num / (t_den · s_den)`.
    a_num: f32,
    /// `tanh(g/β1) = t_num / t_den`, `t_den ∈ [1, 2]`.
    t_num: f32,
    t_den: f32,
    /// `e^{−2|g|/β1}`, for `1 − tanh²(g/β1) = 4·e_t/t_den²`.
    e_t: f32,
    /// `σ(|g|) = 1/s_den`, `s_den = 1 + e^{−|g|} ∈ [1, 2]`; `σ(g) = s_num/s_den`,
    /// `1 − σ(g) = c_num/s_den`.
    s_den: f32,
    s_num: f32,
    c_num: f32,
    /// `B(v) = b_num / b_den`, `b_den ∈ [1, 2]`, and `B'(v) = db_num / b_den²`.
    b_num: f32,
    b_den: f32,
    db_num: f32,
}

impl SituGlu {
    /// Whether `σ(g)`'s exponential is the square of `tanh(g/β1)`'s: `β1 = 4`.
    pub(crate) fn shares_exp(&self) -> bool {
        self.beta1 == 4.0
    }

    /// The parts at `(g, v)`; with `LEAN` (values only) `e_t` may be 1.3e−38 where it is 0
    /// otherwise ([`tanh_parts`]), which changes neither `σ(g)` (that `e_t` is below the clamp
    /// below) nor any denominator.
    #[inline(always)]
    fn parts<const SHARED: bool, const LEAN: bool>(&self, g: f32, v: f32) -> SituParts {
        let (t_num, t_den, e_t) = tanh_parts::<LEAN>(g, 1.0 / self.beta1);
        let e = if SHARED {
            // e^{−|g|} = (e^{−|g|/2})². Squares under f32's smallest normal number are 0 (as
            // `exp_lane` gives there), and no product is formed from a smaller factor: a result
            // below the normal range costs some CPUs a microcode assist per instruction.
            const LOW: f32 = 1.0 / (1u64 << 63) as f32;
            let f = e_t.max(LOW);
            if e_t < LOW {
                0.0
            } else {
                f * f
            }
        } else {
            exp_lane(-g.abs())
        };
        let (s_num, c_num) = if g >= 0.0 { (1.0, e) } else { (e, 1.0) };
        let (b_num, b_den, db_num) = match self.beta2 {
            Some(b2) => {
                let (n, d, e2) = tanh_parts::<LEAN>(v, 1.0 / b2);
                (b2 * n, d, 4.0 * e2)
            }
            None => (v, 1.0, 1.0),
        };
        SituParts {
            a_num: self.beta1 * t_num * s_num,
            t_num,
            t_den,
            e_t,
            s_den: 1.0 + e,
            s_num,
            c_num,
            b_num,
            b_den,
            db_num,
        }
    }

    /// `A(g) · B(v)`.
    #[inline(always)]
    pub(crate) fn value<const SHARED: bool>(&self, g: f32, v: f32) -> f32 {
        let p = self.parts::<SHARED, true>(g, v);
        let r = 1.0 / (p.t_den * p.s_den * p.b_den);
        p.a_num * p.b_num * r
    }

    /// `(A(g)·B(v), d·A'(g)·B(v), d·A(g)·B'(v))`, from the same one division as
    /// [`value`](Self::value) (the value is the same bits as there).
    #[inline(always)]
    pub(crate) fn value_and_gradient<const SHARED: bool>(
        &self,
        g: f32,
        v: f32,
        d: f32,
    ) -> [f32; 3] {
        let p = self.parts::<SHARED, false>(g, v);
        let r = 1.0 / (p.t_den * p.s_den * p.b_den);
        let value = p.a_num * p.b_num * r;
        // The reciprocal of each factor from `r`.
        let (inv_t, inv_s, inv_b) = (
            p.s_den * p.b_den * r,
            p.t_den * p.b_den * r,
            p.t_den * p.s_den * r,
        );
        let t = p.t_num * inv_t;
        let sech2 = 4.0 * p.e_t * inv_t * inv_t;
        let (s, c) = (p.s_num * inv_s, p.c_num * inv_s);
        let a = self.beta1 * t * s;
        let da = sech2 * s + a * c;
        let b = p.b_num * inv_b;
        let db = p.db_num * inv_b * inv_b;
        [value, d * b * da, d * a * db]
    }

    /// [`value`](Self::value) of every element into `out`.
    pub(crate) fn value_into(&self, out: &mut [f32], inputs: [&[f32]; 2]) {
        if self.shares_exp() {
            map_into(out, inputs, Value(Situ::<true>(*self)))
        } else {
            map_into(out, inputs, Value(Situ::<false>(*self)))
        }
    }

    /// [`value`](Self::value) of every element, into a new buffer.
    pub(crate) fn values(&self, inputs: [&[f32]; 2]) -> Vec<f32> {
        if self.shares_exp() {
            map(inputs, Value(Situ::<true>(*self)))
        } else {
            map(inputs, Value(Situ::<false>(*self)))
        }
    }

    /// The two gradients of [`value_and_gradient`](Self::value_and_gradient) of every element
    /// `[g, v, d]`, into new buffers.
    pub(crate) fn gradients(&self, inputs: [&[f32]; 3]) -> [Vec<f32>; 2] {
        if self.shares_exp() {
            map_many(inputs, Gradient(Situ::<true>(*self)))
        } else {
            map_many(inputs, Gradient(Situ::<false>(*self)))
        }
    }

    /// [`value_and_gradient`](Self::value_and_gradient) of every element `[g, v, d]` into
    /// `outs`.
    pub(crate) fn value_and_gradient_into(&self, outs: [&mut [f32]; 3], inputs: [&[f32]; 3]) {
        if self.shares_exp() {
            map_many_into(outs, inputs, ValueAndGradient(Situ::<true>(*self)))
        } else {
            map_many_into(outs, inputs, ValueAndGradient(Situ::<false>(*self)))
        }
    }
}

impl HostOp<2> for SituGlu {
    type Saved = ();

    fn forward(&self, [g, v]: &[HostArray; 2], save: bool) -> (HostArray, Option<()>) {
        let data = self.values([&g.data, &v.data]);
        let out = HostArray {
            data: data.into(),
            shape: g.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [g, v]: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        let [dg, dv] = self.gradients([&g.data, &v.data, &grad.data]);
        let shape = g.shape.clone();
        [
            HostArray {
                data: dg.into(),
                shape: shape.clone(),
            },
            HostArray {
                data: dv.into(),
                shape,
            },
        ]
    }
}

/// SiTU-GLU times one weight per row, `y[r, j] = A(g[r, j])·B(v[r, j])·w[r]`, for `g, v: [R, C]`
/// and `w: [R, 1]` (a routing weight per token), in one pass each way over blocks of rows (on
/// rayon's pool for large inputs): the value and the weight in the same loop over a row, and
/// backward the weight's gradient `Σ_j dy[r, j]·A·B` from the value that the gradients' pass
/// recomputes anyway.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WeightedSituGlu(pub SituGlu);

impl HostOp<3> for WeightedSituGlu {
    type Saved = ();

    fn forward(&self, [g, v, w]: &[HostArray; 3], save: bool) -> (HostArray, Option<()>) {
        let cols = g.shape.last().copied().unwrap_or(0);
        let mut out = vec![0.0f32; g.data.len()];
        for_row_blocks(&mut out, cols, |first, block| {
            for (i, y) in block.chunks_mut(cols).enumerate() {
                let r = first + i;
                let at = r * cols..(r + 1) * cols;
                self.0.value_into(y, [&g.data[at.clone()], &v.data[at]]);
                let p = w.data[r];
                for y in y.iter_mut() {
                    *y *= p;
                }
            }
        });
        let out = HostArray {
            data: out.into(),
            shape: g.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [g, v, w]: &[HostArray; 3], _: &(), grad: &HostArray) -> [HostArray; 3] {
        let cols = g.shape.last().copied().unwrap_or(0);
        let (mut dg, mut dv) = (vec![0.0f32; g.data.len()], vec![0.0f32; g.data.len()]);
        let mut dw = vec![0.0f32; w.data.len()];
        let (dv_rows, dw_rows) = (DisjointWrites::new(&mut dv), DisjointWrites::new(&mut dw));
        for_row_blocks(&mut dg, cols, |first, block| {
            // The weighted output gradient and the value of one row.
            let mut buf = vec![0.0f32; 2 * cols];
            let (d, a) = buf.split_at_mut(cols);
            for (i, dg) in block.chunks_mut(cols).enumerate() {
                let r = first + i;
                let at = r * cols..(r + 1) * cols;
                let p = w.data[r];
                for (d, &dy) in d.iter_mut().zip(&grad.data[at.clone()]) {
                    *d = dy * p;
                }
                // SAFETY: row `r` of `dv` and of `dw` is written by this row's iteration alone.
                let (dv, dw) = unsafe { (dv_rows.slice(r * cols, cols), dw_rows.slice(r, 1)) };
                let (gr, vr) = (&g.data[at.clone()], &v.data[at.clone()]);
                // The value (unweighted) and both gradients from one evaluation; the value's row
                // is then the terms of the weight's gradient.
                self.0
                    .value_and_gradient_into([&mut *a, dg, dv], [gr, vr, &*d]);
                dw[0] = a.iter().zip(&grad.data[at]).map(|(a, d)| a * d).sum();
            }
        });
        [
            HostArray {
                data: dg.into(),
                shape: g.shape.clone(),
            },
            HostArray {
                data: dv.into(),
                shape: v.shape.clone(),
            },
            HostArray {
                data: dw.into(),
                shape: w.shape.clone(),
            },
        ]
    }
}

/// An elementwise function's value, for [`map`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Value<F>(pub F);

/// `d · f'(x)` for `[x, d]`, for [`map`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Derivative<F>(pub F);

/// `(d · ∂/∂g, d · ∂/∂v)` of `A(g) B(v)` for `[g, v, d]`, for [`map_many_into`]: both halves
/// from one evaluation of `A` and `B` and their derivatives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gradient<F>(pub F);

impl<F: Scalar> Elementwise<1> for Value<F> {
    #[inline(always)]
    fn apply(&self, [x]: [f32; 1]) -> f32 {
        self.0.value(x)
    }
}

impl<F: Scalar> Elementwise<2> for Derivative<F> {
    #[inline(always)]
    fn apply(&self, [x, d]: [f32; 2]) -> f32 {
        d * self.0.derivative(x)
    }
}

impl<const SHARED: bool> Elementwise<2> for Value<Situ<SHARED>> {
    #[inline(always)]
    fn apply(&self, [g, v]: [f32; 2]) -> f32 {
        self.0 .0.value::<SHARED>(g, v)
    }
}

impl<const SHARED: bool> ElementwiseMany<3, 2> for Gradient<Situ<SHARED>> {
    #[inline(always)]
    fn apply(&self, [g, v, d]: [f32; 3]) -> [f32; 2] {
        let [_, dg, dv] = self.0 .0.value_and_gradient::<SHARED>(g, v, d);
        [dg, dv]
    }
}

/// `(A(g) B(v), d · ∂/∂g, d · ∂/∂v)` for `[g, v, d]`, for [`map_many_into`]: the value the
/// backward pass recomputes and both gradient halves from one evaluation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ValueAndGradient<F>(pub F);

impl<F: Copy + Send + Sync> ElementwiseMany<3, 3> for ValueAndGradient<F>
where
    Value<F>: Elementwise<2>,
    Gradient<F>: ElementwiseMany<3, 2>,
{
    #[inline(always)]
    fn apply(&self, [g, v, d]: [f32; 3]) -> [f32; 3] {
        // The value exactly as the forward pass computes it (the compiler shares the
        // transcendentals of the two calls).
        let [dg, du] = Gradient(self.0).apply([g, v, d]);
        [Value(self.0).apply([g, v]), dg, du]
    }
}

/// SwiGLU `SiLU(g) · v`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SwiGlu;

impl Elementwise<2> for Value<SwiGlu> {
    #[inline(always)]
    fn apply(&self, [g, v]: [f32; 2]) -> f32 {
        Silu.value(g) * v
    }
}

impl ElementwiseMany<3, 2> for Gradient<SwiGlu> {
    #[inline(always)]
    fn apply(&self, [g, v, d]: [f32; 3]) -> [f32; 2] {
        let (s, c) = sigmoid_pair(g);
        [d * v * s * (1.0 + g * c), d * g * s]
    }
}

#[cfg(test)]
mod tests;
