//! Elementwise CPU kernels: the sigmoid, SiLU and SiTU-GLU islands of the model in one pass each,
//! forward and backward, with `f32` arithmetic.
//!
//! In tensor ops each of these is a chain of four to twelve ops, and on ndarray `tanh` rounds
//! through f64 (tens of nanoseconds per element): the activations alone cost more than the matrix
//! products of the tiny model. The kernels compute the same functions in `f32` from `exp` and
//! `exp_m1`, so no cancellation appears near zero and nothing overflows:
//!
//! ```text
//! σ(x) = 1 / (1 + e^{−x})  (x ≥ 0),   e^{x} / (1 + e^{x})  (x < 0)
//! tanh(x) = −sign(x) · m / (2 + m),   m = expm1(−2|x|)
//! ```

use super::{HostOp, HostTensor};

/// The logistic sigmoid in `f32`, accurate to a few ulp for every `x`.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `tanh` in `f32` through `expm1`, accurate near zero and saturating cleanly for large `|x|`.
#[inline]
pub(crate) fn tanh(x: f32) -> f32 {
    let m = (-2.0 * x.abs()).exp_m1();
    let t = -m / (2.0 + m);
    if x < 0.0 {
        -t
    } else {
        t
    }
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
    fn value(self, x: f32) -> f32 {
        match self {
            Self::Sigmoid => sigmoid(x),
            Self::Silu => x * sigmoid(x),
        }
    }

    fn derivative(self, x: f32) -> f32 {
        let s = sigmoid(x);
        match self {
            Self::Sigmoid => s * (1.0 - s),
            Self::Silu => s * (1.0 + x * (1.0 - s)),
        }
    }
}

impl HostOp<1> for Unary {
    type Saved = ();

    fn forward(&self, [x]: &[HostTensor; 1], save: bool) -> (HostTensor, Option<()>) {
        let data = x.data.iter().map(|&a| self.value(a)).collect();
        let out = HostTensor {
            data,
            shape: x.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [x]: &[HostTensor; 1], _: &(), grad: &HostTensor) -> [HostTensor; 1] {
        let data = x
            .data
            .iter()
            .zip(&grad.data)
            .map(|(&a, &d)| d * self.derivative(a))
            .collect();
        [HostTensor {
            data,
            shape: x.shape.clone(),
        }]
    }
}

/// SiTU-GLU `A(gate) · B(up)` (SPEC §1): `A(g) = β1·tanh(g/β1)·σ(g)`, `B(v) = β2·tanh(v/β2)` or
/// `v` without `β2`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SituGlu {
    /// `β1`.
    pub beta1: f32,
    /// `β2`, or none for an uncapped linear branch.
    pub beta2: Option<f32>,
}

impl SituGlu {
    /// `(A(g), A'(g))`.
    fn gate(&self, g: f32) -> (f32, f32) {
        let (t, s) = (tanh(g / self.beta1), sigmoid(g));
        (
            self.beta1 * t * s,
            (1.0 - t * t) * s + self.beta1 * t * s * (1.0 - s),
        )
    }

    /// `(B(v), B'(v))`.
    fn up(&self, v: f32) -> (f32, f32) {
        match self.beta2 {
            Some(b2) => {
                let t = tanh(v / b2);
                (b2 * t, 1.0 - t * t)
            }
            None => (v, 1.0),
        }
    }
}

impl HostOp<2> for SituGlu {
    type Saved = ();

    fn forward(&self, [g, v]: &[HostTensor; 2], save: bool) -> (HostTensor, Option<()>) {
        let data = g
            .data
            .iter()
            .zip(&v.data)
            .map(|(&a, &b)| self.gate(a).0 * self.up(b).0)
            .collect();
        let out = HostTensor {
            data,
            shape: g.shape.clone(),
        };
        (out, save.then_some(()))
    }

    fn backward(&self, [g, v]: &[HostTensor; 2], _: &(), grad: &HostTensor) -> [HostTensor; 2] {
        let n = g.data.len();
        let (mut dg, mut dv) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for ((&a, &b), &d) in g.data.iter().zip(&v.data).zip(&grad.data) {
            let ((ga, gd), (ua, ud)) = (self.gate(a), self.up(b));
            dg.push(d * ua * gd);
            dv.push(d * ga * ud);
        }
        let shape = g.shape.clone();
        [
            HostTensor {
                data: dg,
                shape: shape.clone(),
            },
            HostTensor { data: dv, shape },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
        assert_eq!(tanh(1e-20), 1e-20);
        assert_eq!(tanh(-50.0), -1.0);
    }
}
