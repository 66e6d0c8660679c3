//! The SIMD loops against plain scalar loops, the standard library and f64: maps and row updates
//! at every length, `max` (NaN included), `dot`, and the exponential and logarithm lanes.

use super::*;

#[derive(Clone, Copy)]
struct AffinePair;

impl Elementwise<2> for AffinePair {
    #[inline(always)]
    fn apply(&self, [x, y]: [f32; 2]) -> f32 {
        2.0 * x + y
    }
}

impl ElementwiseMany<2, 3> for AffinePair {
    #[inline(always)]
    fn apply(&self, [x, y]: [f32; 2]) -> [f32; 3] {
        [x + y, x - y, x * y]
    }
}

/// Every element of every output written, at lengths around the chunking of the parallel
/// path (one chunk, just over one, several with a partial last), into outputs holding NaN.
#[test]
fn maps_write_every_element_at_every_length() {
    for len in [
        0,
        1,
        17,
        MAP_CHUNK - 1,
        MAP_CHUNK,
        MAP_CHUNK + 5,
        2 * MAP_CHUNK + 3,
    ] {
        let x: Vec<f32> = (0..len).map(|i| (i % 251) as f32).collect();
        let y: Vec<f32> = (0..len).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut one = vec![f32::NAN; len + 2];
        map_into(&mut one, [&x, &y], AffinePair);
        let [mut a, mut b, mut c] = [(); 3].map(|_| vec![f32::NAN; len + 1]);
        map_many_into([&mut a, &mut b, &mut c], [&x, &y], AffinePair);
        for i in 0..len {
            let (xi, yi) = (x[i], y[i]);
            assert_eq!(one[i], 2.0 * xi + yi, "map_into, length {len}, element {i}");
            assert_eq!(
                [a[i], b[i], c[i]],
                [xi + yi, xi - yi, xi * yi],
                "map_many_into, length {len}, element {i}"
            );
        }
        // Nothing past the inputs' length.
        assert!(one[len].is_nan() && a[len].is_nan() && c[len].is_nan());
    }
}

#[test]
fn max_is_the_largest_element_and_sees_nan() {
    let xs: Vec<f32> = (0..1003)
        .map(|i| ((i * 7919) % 1009) as f32 - 2000.0)
        .collect();
    let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert_eq!(max(&xs), want);
    assert_eq!(max(&[]), f32::NEG_INFINITY);
    assert_eq!(max(&[-3.0, -1.0, -2.0]), -1.0);
    // A NaN anywhere (in a full block, first in its lane, or in the tail) wins.
    for at in [0, 5, 16, 500, 1002] {
        let mut ys = xs.clone();
        ys[at] = f32::NAN;
        assert!(max(&ys).is_nan(), "NaN at {at}");
    }
    // Long enough to be split over the pool: the largest in one part, a NaN in the last.
    let n = 2 * MAX_PARALLEL + 3;
    let mut long: Vec<f32> = (0..n).map(|i| -((i % 977) as f32)).collect();
    long[MAX_PARALLEL / 4 * 5 + 11] = 7.5;
    assert_eq!(max(&long), 7.5);
    assert_eq!(max(&long), max_serial(&long));
    long[n - 1] = f32::NAN;
    assert!(max(&long).is_nan());
}

#[test]
fn exp_matches_the_standard_library() {
    let xs: Vec<f32> = (0..200_001)
        .map(|i| -100.0 + i as f32 * 0.000_95)
        .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, -87.0, -87.29])
        .collect();
    let mut ys = xs.clone();
    exp_in_place(&mut ys);
    for (x, y) in xs.iter().zip(&ys) {
        let want = x.exp();
        if *x < -87.3 {
            assert_eq!(*y, 0.0, "exp({x})");
        } else if *x > 88.0 {
            assert_eq!(*y, f32::INFINITY, "exp({x})");
        } else {
            let ulp = want * f32::EPSILON;
            assert!(
                (y - want).abs() <= 2.0 * ulp,
                "exp({x}) = {y}, std gives {want}"
            );
        }
    }
    let mut special = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 100.0];
    exp_in_place(&mut special);
    assert!(special[0].is_nan());
    assert_eq!(special[1..], [0.0, f32::INFINITY, f32::INFINITY]);
}

#[test]
fn exp_and_expm1_match_f64() {
    let xs = (0..200_000)
        .map(|i| -100.0 + i as f32 * 0.0005)
        .filter(|x| *x <= 0.0)
        .chain((0..2000).map(|i| -(i as f32) * 1e-4))
        .chain([0.0, -0.0, -1e-30, -1e-10, -0.346, -0.347, -87.29, -87.31]);
    for x in xs {
        let (e, m) = exp_expm1_nonpositive_lane(x);
        let (want_e, want_m) = ((x as f64).exp(), (x as f64).exp_m1());
        if x < -87.3 {
            assert_eq!((e, m), (0.0, -1.0), "x = {x}");
            continue;
        }
        // Relative to the f64 values, down to f32's smallest normal number.
        let tol = |w: f64| 3.0 * f32::EPSILON as f64 * w.abs().max(1.2e-38);
        assert!(
            (e as f64 - want_e).abs() <= tol(want_e),
            "exp({x}) = {e} vs {want_e}"
        );
        assert!(
            (m as f64 - want_m).abs() <= tol(want_m),
            "expm1({x}) = {m} vs {want_m}"
        );
    }
    assert_eq!(exp_expm1_nonpositive_lane(-1e-30).1, -1e-30);
    let (e, m) = exp_expm1_nonpositive_lane(f32::NAN);
    assert!(e.is_nan() && m.is_nan());
    assert_eq!(exp_expm1_nonpositive_lane(f32::NEG_INFINITY), (0.0, -1.0));
}

/// The lean lane is the full one, bit for bit, wherever the full one is above 0; below it
/// `exp` is the value at the clamp and `expm1` still −1; NaN stays NaN.
#[test]
fn lean_exp_expm1_is_the_full_one_above_the_clamp() {
    let xs = (0..400_000).map(|i| -100.0 + i as f32 * 0.00025).chain([
        0.0,
        -0.0,
        -1e-30,
        -1e-40,
        -87.29,
        -87.3,
        -87.31,
        -1e30,
        f32::NEG_INFINITY,
    ]);
    let floor = exp_expm1_nonpositive_lane(-87.3).0;
    assert!(floor > 0.0 && floor.is_normal());
    for x in xs.filter(|x| *x <= 0.0) {
        let (full, lean) = (
            exp_expm1_nonpositive_lane(x),
            exp_expm1_nonpositive_lean_lane(x),
        );
        if full.0 == 0.0 {
            assert_eq!(lean, (floor, -1.0), "x = {x}");
        } else {
            assert_eq!(full.0.to_bits(), lean.0.to_bits(), "exp({x})");
            assert_eq!(full.1.to_bits(), lean.1.to_bits(), "expm1({x})");
        }
    }
    let (e, m) = exp_expm1_nonpositive_lean_lane(f32::NAN);
    assert!(e.is_nan() && m.is_nan());
}

#[test]
fn ln_1p_on_the_unit_interval_matches_f64() {
    let ys = (0..=100_000)
        .map(|i| i as f32 / 100_000.0)
        .chain((0..40).map(|i| 2.0f32.powi(-i - 17)))
        .chain([0.0, f32::MIN_POSITIVE, 1e-38, 0.999_999_9, 1.0]);
    for y in ys {
        let got = ln_1p_unit_lane(y) as f64;
        let want = (y as f64).ln_1p();
        let tol = 2.0 * f32::EPSILON as f64 * want.abs().max(1.2e-38);
        assert!((got - want).abs() <= tol, "ln_1p({y}) = {got} vs {want}");
    }
    assert!(ln_1p_unit_lane(f32::NAN).is_nan());
}

#[test]
fn dot_matches_a_plain_sum_for_every_length() {
    for n in [0, 1, 15, 16, 17, 64, 100] {
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let got = dot(&a, &b) as f64;
        assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "n {n}");
    }
}

/// `update` and `write` give the scalar loops' bits at every length around the block size
/// (whole blocks, a tail, a tail alone), and write nothing past the first `x.len()` / shortest
/// input's elements.
#[test]
fn row_updates_and_writes_are_the_scalar_loops() {
    for n in [0, 1, 15, 16, 17, 33, 64, 100] {
        let a: Vec<f32> = (0..n + 3).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..n + 3).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let start: Vec<f32> = (0..n + 2).map(|i| (i as f32 * 0.53).sin() * 7.0).collect();
        let mut want = start.clone();
        for j in 0..n {
            want[j] += a[j] * b[j];
        }
        let mut got = start.clone();
        update(&mut got[..n], [&a, &b], AddProduct);
        assert_eq!(
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "update, n {n}"
        );
        let mut outs = [
            vec![f32::NAN; n + 2],
            vec![f32::NAN; n + 2],
            vec![f32::NAN; n + 2],
        ];
        let [o0, o1, o2] = &mut outs;
        write(
            [&mut o0[..], &mut o1[..], &mut o2[..]],
            [&a[..n], &b],
            AffinePair,
        );
        for j in 0..n {
            let w = [a[j] + b[j], a[j] - b[j], a[j] * b[j]];
            for m in 0..3 {
                assert_eq!(
                    outs[m][j].to_bits(),
                    w[m].to_bits(),
                    "write {m}, n {n}, j {j}"
                );
            }
        }
        assert!(
            outs.iter().all(|o| o[n..].iter().all(|v| v.is_nan())),
            "write past n {n}"
        );
    }
}
