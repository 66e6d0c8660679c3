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
    exp_expm1_nonpositive_lane, exp_lane, map, map_many_into, Elementwise, ElementwiseMany,
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
#[inline(always)]
pub(crate) fn tanh_sech2(x: f32) -> (f32, f32) {
    let (n, d, e2) = tanh_parts(x);
    // One division (they are the slow instruction of these loops) for both.
    let r = 1.0 / d;
    (n * r, 4.0 * e2 * r * r)
}

/// `tanh(x) = n / d` as `(n, d, e₂)`: `n = −sign(x)·expm1(−2|x|)`, `d = 1 + e₂ ∈ [1, 2]`,
/// `e₂ = e^{−2|x|}`; the division left to the caller, who may fold several into one.
#[inline(always)]
fn tanh_parts(x: f32) -> (f32, f32, f32) {
    let (e2, m) = exp_expm1_nonpositive_lane(-2.0 * x.abs());
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
#[derive(Debug, Clone, Copy)]
pub(crate) struct SituGlu {
    /// `β1`.
    pub beta1: f32,
    /// `β2`, or none for an uncapped linear branch.
    pub beta2: Option<f32>,
}

impl SituGlu {
    /// `A(g) · B(v)` with a single division: each of `tanh(g/β1)`, `σ(g)` and `tanh(v/β2)` is a
    /// quotient whose denominator lies in `[1, 2]`, so their product is one quotient that can
    /// neither overflow nor underflow (five divisions otherwise, the bulk of the loop's time).
    #[inline(always)]
    pub(crate) fn value(&self, g: f32, v: f32) -> f32 {
        let (n1, d1, _) = tanh_parts(g * (1.0 / self.beta1));
        let e = exp_lane(-g.abs());
        let ns = if g >= 0.0 { 1.0 } else { e };
        let a = self.beta1 * n1 * ns;
        let d = d1 * (1.0 + e);
        match self.beta2 {
            Some(b2) => {
                let (n2, d2, _) = tanh_parts(v * (1.0 / b2));
                a * (b2 * n2) / (d * d2)
            }
            None => a * v / d,
        }
    }

    /// `(A(g), A'(g))`.
    #[inline(always)]
    pub(crate) fn gate(&self, g: f32) -> (f32, f32) {
        let ((t, sech2), (s, c)) = (tanh_sech2(g * (1.0 / self.beta1)), sigmoid_pair(g));
        (self.beta1 * t * s, sech2 * s + self.beta1 * t * s * c)
    }

    /// `(B(v), B'(v))`.
    #[inline(always)]
    pub(crate) fn up(&self, v: f32) -> (f32, f32) {
        match self.beta2 {
            Some(b2) => {
                let (t, sech2) = tanh_sech2(v * (1.0 / b2));
                (b2 * t, sech2)
            }
            None => (v, 1.0),
        }
    }
}

impl HostOp<2> for SituGlu {
    type Saved = ();

    fn forward(&self, [g, v]: &[HostArray; 2], save: bool) -> (HostArray, Option<()>) {
        let data = map([&g.data, &v.data], Value(*self));
        let out = HostArray {
            data: data.into(),
            shape: g.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [g, v]: &[HostArray; 2], _: &(), grad: &HostArray) -> [HostArray; 2] {
        let n = g.data.len();
        let (mut dg, mut dv) = (vec![0.0f32; n], vec![0.0f32; n]);
        let inputs = [&g.data[..], &v.data[..], &grad.data[..]];
        map_many_into([&mut dg, &mut dv], inputs, Gradient(*self));
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

    /// The one-division SiTU-GLU value against the f64 formula, with and without `β2`, through
    /// saturation on both sides, and against the two-factor form the gradients use.
    #[test]
    fn situ_glu_value_matches_f64() {
        for beta2 in [Some(25.0f32), Some(0.7), None] {
            let f = SituGlu { beta1: 4.0, beta2 };
            for i in -300..=300 {
                for j in -60..=60 {
                    let (g, v) = (i as f32 * 0.17 + 0.001, j as f32 * 1.3 - 0.002);
                    let (gd, vd) = (g as f64, v as f64);
                    let a = 4.0 * (gd / 4.0).tanh() / (1.0 + (-gd).exp());
                    let b = beta2.map_or(vd, |b2| b2 as f64 * (vd / b2 as f64).tanh());
                    let want = a * b;
                    let got = f.value(g, v) as f64;
                    assert!(
                        (got - want).abs() <= 2e-6 * want.abs() + 1e-30,
                        "A({g})·B({v}) = {got} vs {want} (β2 {beta2:?})"
                    );
                    let two = (f.gate(g).0 * f.up(v).0) as f64;
                    assert!((two - want).abs() <= 2e-6 * want.abs() + 1e-30);
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

impl Elementwise<2> for Value<SituGlu> {
    #[inline(always)]
    fn apply(&self, [g, v]: [f32; 2]) -> f32 {
        self.0.value(g, v)
    }
}

impl ElementwiseMany<3, 2> for Gradient<SituGlu> {
    #[inline(always)]
    fn apply(&self, [g, v, d]: [f32; 3]) -> [f32; 2] {
        let ((ga, gd), (ua, ud)) = (self.0.gate(g), self.0.up(v));
        [d * ua * gd, d * ga * ud]
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
