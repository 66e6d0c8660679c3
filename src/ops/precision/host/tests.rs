//! The elementwise host kernels against f64: each function's value and derivative, alone and
//! through the vectorised loops, and NaN through every op.

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
    let ops = [
        Unary::Sigmoid,
        Unary::Silu,
        Unary::SoftCap(1.0),
        Unary::SoftCap(0.7),
        Unary::Softplus,
        Unary::SituGate(4.0),
        Unary::SituGate(2.5),
    ];
    for op in ops {
        // Through the host op, so through its choice of loop too.
        let input = || HostArray {
            data: x.clone().into(),
            shape: vec![len],
        };
        let (y, _) = op.forward(&[input()], false);
        check(&format!("{op:?} value"), &y.data, &nan_at);
        let [dx] = op.backward(&[input()], &(), &input());
        check(&format!("{op:?} derivative"), &dx.data, &nan_at);
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

/// The soft cap (and `tanh`), softplus and SiTU's gate, value and derivative, through the
/// loops as the host op runs them ([`map`]: vectorised, in parts on the pool for long inputs),
/// against their f64 formulas from −120 to 120 (both tails saturated, and past the range of
/// `e^{−|x|}` in f32), with SiTU's gate in both compiled forms.
#[test]
fn unary_functions_match_f64_through_the_loops() {
    const EPS: f64 = f32::EPSILON as f64;
    /// `reference(x)` gives `[f, f', error allowed in f, error allowed in f']` in f64.
    fn check<F: Scalar>(name: &str, f: F, reference: impl Fn(f64) -> [f64; 4]) {
        let xs: Vec<f32> = (-1200..=1200).map(|i| i as f32 * 0.1 + 0.0007).collect();
        let ones = vec![1.0f32; xs.len()];
        let values = map([&xs], Value(f));
        let slopes = map([&xs, &ones], Derivative(f));
        for ((&x, &y), &dy) in xs.iter().zip(&values).zip(&slopes) {
            let [want, dwant, err, derr] = reference(x as f64);
            // Below f32's smallest normal numbers the spacing is absolute.
            assert!(
                (y as f64 - want).abs() <= err + 1e-37,
                "{name}({x}) = {y} vs {want}"
            );
            assert!(
                (dy as f64 - dwant).abs() <= derr + 1e-37,
                "{name}'({x}) = {dy} vs {dwant}"
            );
        }
    }
    // `e^{−2|x|/β}` is evaluated at the f32 product `|x|·(−2/β)`, whose rounding (half an ulp
    // of an argument of size `2|x/β|`) moves the exponential by that much relative: the
    // conditioning of `exp`, which no f32 evaluation avoids. Exact where `2/β` is a power of
    // two (`tanh`, SiTU at β1 = 4).
    let exp_rounding = |x: f64, b: f64| {
        if (2.0 / b).log2().fract() == 0.0 {
            0.0
        } else {
            (2.0 * x / b).abs() * EPS
        }
    };
    for beta in [1.0f32, 0.7, 25.0] {
        let b = beta as f64;
        let soft_cap = |x: f64| {
            let (v, d) = (b * (x / b).tanh(), 1.0 / (x / b).cosh().powi(2));
            [
                v,
                d,
                4.0 * EPS * v.abs(),
                (8.0 * EPS + exp_rounding(x, b)) * d,
            ]
        };
        check(&format!("soft_cap {beta}"), SoftCap(beta), soft_cap);
    }
    let softplus = |x: f64| {
        let v = if x > 20.0 {
            x
        } else {
            x.max(0.0) + (-x.abs()).exp().ln_1p()
        };
        let d = if x > 20.0 {
            1.0
        } else {
            1.0 / (1.0 + (-x).exp())
        };
        [v, d, 4.0 * EPS * v, 4.0 * EPS * d]
    };
    check("softplus", Softplus, softplus);
    let situ_gate = |b1: f64| {
        move |x: f64| {
            let (t, s) = ((x / b1).tanh(), 1.0 / (1.0 + (-x).exp()));
            let c = 1.0 / (1.0 + x.exp());
            // A' = sech²(x/β1)·σ + A·(1 − σ): its error is measured against the sum of
            // the magnitudes of its terms (they cancel near the minimum of A, x ≈ −1.2).
            let terms = [s / (x / b1).cosh().powi(2), b1 * t * s * c];
            let a = b1 * t * s;
            let derr = 40.0 * EPS * (terms[0].abs() + terms[1].abs())
                + exp_rounding(x, b1) * terms[0].abs();
            [a, terms[0] + terms[1], 16.0 * EPS * a.abs(), derr]
        }
    };
    check("situ 4, shared", SituGate::<true>(4.0), situ_gate(4.0));
    check("situ 4", SituGate::<false>(4.0), situ_gate(4.0));
    check("situ 2.5", SituGate::<false>(2.5), situ_gate(2.5));
}
