//! Elementwise CPU kernels: the sigmoid, SiLU and SiTU-GLU islands of the model in one pass each,
//! forward and backward, with `f32` arithmetic.
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

use crate::ops::backend::host::{HostArray, HostOp};
use crate::ops::backend::simd::{
    exp_expm1_nonpositive_lane, exp_expm1_nonpositive_lean_lane, exp_lane, map, map_into, map_many,
    map_many_into, Elementwise, ElementwiseMany,
};

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

/// `(tanh(x), 1 − tanh²(x))` in `f32` through `expm1`: accurate near zero, and the derivative
/// keeps its relative precision where `tanh` has saturated to ±1.
#[cfg(test)]
#[inline(always)]
pub(crate) fn tanh_sech2(x: f32) -> (f32, f32) {
    let (n, d, e2) = tanh_parts::<false>(x, 1.0);
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

/// `tanh` in `f32` through `expm1`, accurate near zero and saturating cleanly for large `|x|`.
#[cfg(test)]
#[inline]
pub(crate) fn tanh(x: f32) -> f32 {
    tanh_sech2(x).0
}

/// `y = f(x)` elementwise for a differentiable scalar `f`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Unary {
    /// `σ(x)`.
    Sigmoid,
    /// `x·σ(x)`.
    Silu,
}

impl Unary {
    #[inline(always)]
    pub(crate) fn value(self, x: f32) -> f32 {
        match self {
            Self::Sigmoid => sigmoid(x),
            Self::Silu => x * sigmoid(x),
        }
    }

    #[inline(always)]
    pub(crate) fn derivative(self, x: f32) -> f32 {
        let (s, c) = sigmoid_pair(x);
        match self {
            Self::Sigmoid => s * c,
            Self::Silu => s * (1.0 + x * c),
        }
    }
}

impl HostOp<1> for Unary {
    type Saved = ();

    fn forward(&self, [x]: &[HostArray; 1], save: bool) -> (HostArray, Option<()>) {
        let out = HostArray {
            data: map([&x.data], Value(*self)).into(),
            shape: x.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x]: &[HostArray; 1], _: &(), grad: &HostArray) -> [HostArray; 1] {
        let data = map([&x.data, &grad.data], Derivative(*self));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// SiTU-GLU's value and both gradients, from their one division, against the f64 formulas
    /// of design §1 with and without `β2`, through saturation on both sides, for `β1 = 4` in
    /// both compiled forms (the gate's exponential shared, and computed on its own) and for a
    /// `β1` whose exponentials differ.
    #[test]
    fn situ_glu_value_and_gradients_match_f64() {
        fn check<const SHARED: bool>(f: SituGlu) {
            let b1 = f.beta1 as f64;
            // Past the range of `e^{−|g|}` in f32 too (|g| > 87.3).
            let far = [-200.0, -100.0, -90.0, -88.0, 88.0, 90.0, 100.0, 200.0];
            let gates = (-300..=300).map(|i| i as f32 * 0.17 + 0.001).chain(far);
            for g in gates {
                for j in -60..=60 {
                    let v = j as f32 * 1.3 - 0.002;
                    let (gd, vd) = (g as f64, v as f64);
                    let (t, s) = ((gd / b1).tanh(), 1.0 / (1.0 + (-gd).exp()));
                    let a = b1 * t * s;
                    // `1 − tanh²` and `1 − σ` in forms that keep their precision in f64 too.
                    let sech2 = |x: f64| 1.0 / x.cosh().powi(2);
                    let c = 1.0 / (1.0 + gd.exp());
                    let terms = [sech2(gd / b1) * s, b1 * t * s * c];
                    let da = terms[0] + terms[1];
                    let (b, db) = match f.beta2 {
                        Some(b2) => {
                            let x = vd / b2 as f64;
                            (b2 as f64 * x.tanh(), sech2(x))
                        }
                        None => (vd, 1.0),
                    };
                    let d = 0.37f32 as f64;
                    let want = [a * b, d * da * b, d * a * db];
                    // `A'` changes sign near g = −1.2 (the minimum of `A`), where its two terms
                    // cancel: its error is one of their size.
                    let scale = [a * b, d * (terms[0].abs() + terms[1].abs()) * b, d * a * db];
                    let got = f.value_and_gradient::<SHARED>(g, v, 0.37);
                    assert_eq!(got[0].to_bits(), f.value::<SHARED>(g, v).to_bits());
                    // A few ulp of f32 (ε = 1.19e-7) for the value, a few dozen for the
                    // gradients (products of a dozen rounded factors: the reciprocals of the
                    // three denominators from one division, squared for the `sech²`s), and
                    // f32's smallest normal numbers.
                    let tol = [2e-6, 5e-6, 5e-6];
                    for (k, ((&w, &x), m)) in want.iter().zip(&got).zip(scale).enumerate() {
                        assert!(
                            (x as f64 - w).abs() <= tol[k] * m.abs() + 1e-30,
                            "output {k} at g = {g}, v = {v}: {x} vs {w} ({f:?}, shared {SHARED})"
                        );
                    }
                }
            }
        }
        for beta2 in [Some(25.0f32), Some(0.7), None] {
            let f = SituGlu { beta1: 4.0, beta2 };
            assert!(f.shares_exp());
            check::<true>(f);
            check::<false>(f);
            let other = SituGlu { beta1: 2.5, beta2 };
            assert!(!other.shares_exp());
            check::<false>(other);
        }
    }

    /// NaN in gives NaN out, and only there, through the loops as they run (vectorised, through
    /// `dispatch`): the exponentials carry a NaN by their arithmetic, with no select of their own.
    #[test]
    fn nan_propagates_through_the_vectorised_loops() {
        let len = 67;
        let nan_at = [0, 5, 16, 31, 47, 66];
        let with_nans = |fill: f32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    if nan_at.contains(&i) {
                        f32::NAN
                    } else {
                        fill * (i as f32 - 30.0)
                    }
                })
                .collect()
        };
        let check = |what: &str, out: &[f32], nans: &[usize]| {
            for (i, y) in out.iter().enumerate() {
                assert_eq!(y.is_nan(), nans.contains(&i), "{what}[{i}] = {y}");
            }
        };
        let x = with_nans(3.1);
        for f in [Unary::Sigmoid, Unary::Silu] {
            check("value", &map([&x], Value(f)), &nan_at);
            check("derivative", &map([&x, &x], Derivative(f)), &nan_at);
        }
        let plain: Vec<f32> = (0..len).map(|i| 0.7 * (i as f32 - 33.0)).collect();
        for beta2 in [Some(25.0), Some(0.7), None] {
            for beta1 in [4.0, 2.5] {
                let f = SituGlu { beta1, beta2 };
                for (g, v, nan_in_v) in [(&x, &plain, false), (&plain, &x, true)] {
                    let mut out = vec![0.0; len];
                    f.value_into(&mut out, [g, v]);
                    check("situ value", &out, &nan_at);
                    let (mut a, mut dg, mut dv) = (vec![0.0; len], vec![0.0; len], vec![0.0; len]);
                    f.value_and_gradient_into([&mut a, &mut dg, &mut dv], [g, v, &plain]);
                    check("situ value", &a, &nan_at);
                    check("situ d/dg", &dg, &nan_at);
                    // Without `β2` the branch is linear: `∂(A(g)·v)/∂v = A(g)` does not read v.
                    let linear_in_v = nan_in_v && beta2.is_none();
                    check("situ d/dv", &dv, if linear_in_v { &[] } else { &nan_at });
                }
            }
        }
    }

    #[test]
    fn scalar_functions_match_f64() {
        for i in -400..=400 {
            let x = i as f32 * 0.1 + 0.003;
            let xd = x as f64;
            let s = 1.0 / (1.0 + (-xd).exp());
            // A few f32 ulp (ε = 1.19e-7): exp and one division, each correctly rounded or nearly.
            assert!(
                (sigmoid(x) as f64 - s).abs() <= 5e-7 * s.max(1e-30) + 1e-30,
                "σ({x}) = {} vs {s}",
                sigmoid(x)
            );
            let t = xd.tanh();
            assert!(
                (tanh(x) as f64 - t).abs() <= 5e-7 * t.abs().max(1e-6),
                "tanh({x}) = {} vs {t}",
                tanh(x)
            );
        }
        for i in -400..=400 {
            // Near saturation: 1 − σ and 1 − tanh² keep their relative precision.
            let x = i as f32 * 0.25 + 0.003;
            let xd = x as f64;
            let c = 1.0 / (1.0 + xd.exp());
            let sech2 = 1.0 / xd.cosh().powi(2);
            let (_, c32) = sigmoid_pair(x);
            let (_, s32) = tanh_sech2(x);
            // Down to f32's smallest normal number; below it the spacing is absolute.
            if c > 1e-37 {
                assert!(
                    (c32 as f64 - c).abs() <= 5e-7 * c,
                    "1 − σ({x}) = {c32} vs {c}"
                );
            }
            if sech2 > 1e-37 {
                assert!(
                    (s32 as f64 - sech2).abs() <= 1e-6 * sech2,
                    "sech²({x}) = {s32} vs {sech2}"
                );
            }
        }
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
        assert_eq!(tanh(1e-20), 1e-20);
        assert_eq!(tanh(-50.0), -1.0);
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

impl Elementwise<1> for Value<Unary> {
    #[inline(always)]
    fn apply(&self, [x]: [f32; 1]) -> f32 {
        self.0.value(x)
    }
}

impl Elementwise<2> for Derivative<Unary> {
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
        Unary::Silu.value(g) * v
    }
}

impl ElementwiseMany<3, 2> for Gradient<SwiGlu> {
    #[inline(always)]
    fn apply(&self, [g, v, d]: [f32; 3]) -> [f32; 2] {
        let (s, c) = sigmoid_pair(g);
        [d * v * s * (1.0 + g * c), d * g * s]
    }
}
