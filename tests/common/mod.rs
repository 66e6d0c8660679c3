//! Shared test helpers: backends, seeded random inputs and the design §0 error metric.
#![allow(dead_code, unused_macros, unused_imports)]

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{backend::Backend, Element, Shape, Tensor, TensorData};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// CPU reference backend in f32.
pub type Cpu = NdArray<f32>;
/// CPU reference backend in f32 with autodiff.
pub type CpuAd = Autodiff<Cpu>;
/// CPU backend in f64, for finite differences.
///
/// Only use it in test binaries without `Cpu`: Burn 0.21 fixes a device's default dtype on first
/// use, keyed by the device type, and both NdArray backends share `NdArrayDevice::Cpu`.
pub type Cpu64 = NdArray<f64>;
/// CPU backend in f64 with autodiff.
pub type Cpu64Ad = Autodiff<Cpu64>;
/// The GPU backend under test: wgpu (software Vulkan in CI), or CUDA in a build with `cuda` and
/// without `wgpu` (`scripts/cuda-check.sh`), so the same kernel checks run on both.
#[cfg(feature = "wgpu")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;
/// See the wgpu variant.
#[cfg(all(feature = "cuda", not(feature = "wgpu")))]
pub type Gpu = burn::backend::Cuda<f32, i32>;
/// The GPU backend under test with autodiff.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub type GpuAd = Autodiff<Gpu>;

/// Runs a generic check `fn f<B: AutodiffBackend>(device: &B::Device)` on ndarray and, with the
/// `wgpu` feature, on the wgpu device (on CUDA in a `cuda` build without `wgpu`: the test keeps its
/// name). The GPU test fails (never skips) when no adapter exists.
macro_rules! on_backends {
    ($name:ident, $check:ident) => {
        mod $name {
            #[test]
            fn ndarray() {
                super::$check::<crate::common::CpuAd>(&Default::default());
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            #[test]
            fn wgpu() {
                super::$check::<crate::common::GpuAd>(&Default::default());
            }
        }
    };
}
pub(crate) use on_backends;

/// The tests `$f16` and `$bf16`, each calling `$check(name, DType, FloatDType)` for its storage
/// type. The bf16 one is ignored, with the reason, where CI's device (lavapipe) has no bf16; it
/// runs on CUDA (`scripts/cuda-check.sh`). Either fails when its device lacks the dtype.
macro_rules! half_storage_tests {
    ($f16:ident, $bf16:ident, $check:ident) => {
        #[test]
        fn $f16() {
            $check(
                "f16",
                burn::tensor::DType::F16,
                burn::tensor::FloatDType::F16,
            );
        }

        #[test]
        #[cfg_attr(
            not(feature = "cuda"),
            ignore = "bf16 storage: lavapipe (wgpu in CI) has none; scripts/cuda-check.sh runs it on CUDA"
        )]
        fn $bf16() {
            $check(
                "bf16",
                burn::tensor::DType::BF16,
                burn::tensor::FloatDType::BF16,
            );
        }
    };
}
pub(crate) use half_storage_tests;

/// A seeded generator; every test uses its own seed.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `len` standard-normal samples (Box–Muller).
pub fn normal_vec(rng: &mut StdRng, len: usize) -> Vec<f64> {
    (0..len)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
        .collect()
}

/// A tensor of standard-normal values times `scale`.
pub fn randn<B: Backend, const D: usize>(
    rng: &mut StdRng,
    shape: [usize; D],
    scale: f64,
    device: &B::Device,
) -> Tensor<B, D> {
    let len = shape.iter().product();
    let v: Vec<f64> = normal_vec(rng, len)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    from_f64(&v, shape, device)
}

/// A tensor of uniform values in `[lo, hi)`.
pub fn uniform<B: Backend, const D: usize>(
    rng: &mut StdRng,
    shape: [usize; D],
    lo: f64,
    hi: f64,
    device: &B::Device,
) -> Tensor<B, D> {
    let len = shape.iter().product();
    let v: Vec<f64> = (0..len).map(|_| rng.random_range(lo..hi)).collect();
    from_f64(&v, shape, device)
}

/// Uploads host values in the backend's float dtype.
///
/// `from_data` with the backend's own float dtype, not `from_floats`: Burn's `from_floats` converts
/// to f32 first, and a bare device picks the dtype registered for that device by whichever backend
/// used it first in the process (`NdArray<f32>` and `NdArray<f64>` share one device), which would
/// round f64 finite-difference inputs to f32.
pub fn from_f64<B: Backend, const D: usize>(
    v: &[f64],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let dtype = <B::FloatElem as Element>::dtype();
    Tensor::<B, 1>::from_data(
        TensorData::new(v.to_vec(), Shape::new([v.len()])),
        (device, dtype),
    )
    .reshape(shape)
}

/// Reads any float tensor back as f64.
pub fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
    t.into_data().iter::<f64>().collect()
}

/// The design §0 error `rms(ref − out) / (rms(ref) + 1e-8)`.
pub fn rel_err(reference: &[f64], out: &[f64]) -> f64 {
    assert_eq!(reference.len(), out.len(), "length mismatch");
    let n = reference.len().max(1) as f64;
    let diff = (reference
        .iter()
        .zip(out)
        .map(|(r, o)| (r - o).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let base = (reference.iter().map(|r| r * r).sum::<f64>() / n).sqrt();
    diff / (base + 1e-8)
}

/// Whether `B` runs on CUDA (through autodiff or fusion too).
pub fn is_cuda<B: Backend>(device: &B::Device) -> bool {
    B::name(device).contains("cuda")
}

/// Burn 0.21 runs f32 matmuls on CUDA on the tensor cores in TF32 (its autotune picks those
/// kernels, and there is no switch for full f32): a 10-bit significand, f16's. Comparisons on CUDA
/// in which Burn's own matmul ran on either side (an op's reference path, a layer's projections)
/// are held to design §0's f16-storage output tolerance instead; on an H200 they came out at a
/// relative RMS error of 6e-5 to 6e-4.
pub const TF32_TOL: f64 = 5e-3;

/// `tol` for a comparison in which Burn's own f32 matmul ran on `B`: `tol` where that matmul is
/// f32 (CPU, wgpu), at least [`TF32_TOL`] on CUDA. The crate's kernels compute in f32 on every
/// device: their checks against host references keep `tol` everywhere.
pub fn matmul_tol<B: Backend>(device: &B::Device, tol: f64) -> f64 {
    if is_cuda::<B>(device) {
        tol.max(TF32_TOL)
    } else {
        tol
    }
}

/// design §0 check: passes when `max|ref − out| ≤ 1e-6` or the relative RMS error is below `tol`;
/// always fails on NaN or infinity.
pub fn assert_close(what: &str, reference: &[f64], out: &[f64], tol: f64) {
    assert_eq!(
        reference.len(),
        out.len(),
        "{what}: length {} vs {}",
        reference.len(),
        out.len()
    );
    assert!(
        reference.iter().all(|v| v.is_finite()),
        "{what}: reference has NaN/Inf"
    );
    assert!(
        out.iter().all(|v| v.is_finite()),
        "{what}: output has NaN/Inf"
    );
    let max = reference
        .iter()
        .zip(out)
        .map(|(r, o)| (r - o).abs())
        .fold(0.0, f64::max);
    let err = rel_err(reference, out);
    assert!(
        max <= 1e-6 || err < tol,
        "{what}: relative RMS error {err:.3e} (max abs diff {max:.3e}) exceeds {tol:e}"
    );
}

/// Central finite differences of a scalar function at `x` along every coordinate.
pub fn finite_diff(x: &[f64], eps: f64, mut f: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = x[i];
            x[i] = orig + eps;
            let plus = f(&x);
            x[i] = orig - eps;
            let minus = f(&x);
            x[i] = orig;
            (plus - minus) / (2.0 * eps)
        })
        .collect()
}

/// Runs `f` on the kernel path and asserts that `op` really ran its kernel (at least `min` times).
pub fn on_kernel<T>(op: kimi_burn::ops::FusedOp, min: u64, f: impl FnOnce() -> T) -> T {
    use kimi_burn::ops::{kernel_calls, last_path, with_kernels, KernelPath};
    let before = kernel_calls(op);
    let out = with_kernels(true, f);
    let ran = kernel_calls(op) - before;
    assert!(
        ran >= min,
        "{op:?}: expected the kernel path ({min}+ launches), it ran {ran}"
    );
    assert_eq!(last_path(op), Some(KernelPath::Kernel), "{op:?}");
    out
}

/// Runs `f` on the reference path (same backend) and checks that it did.
pub fn on_reference<T>(op: kimi_burn::ops::FusedOp, f: impl FnOnce() -> T) -> T {
    use kimi_burn::ops::{kernel_calls, with_kernels};
    let before = kernel_calls(op);
    let out = with_kernels(false, f);
    assert_eq!(
        kernel_calls(op),
        before,
        "{op:?}: the reference run used the kernel"
    );
    out
}

/// The exact bit patterns of a float tensor (read as f32), for bit-for-bit repeatability checks.
pub fn bits<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<u32> {
    t.into_data().iter::<f32>().map(f32::to_bits).collect()
}

/// The SiTU-GLU test points (design §1): zero of both signs, tiny values, both sides of `±β1 = ±4`
/// and `±β2 = ±25`, the minimum of `A` near −1.219, the sigmoid's tails and `|x|` up to 1e4.
/// Every value is exactly representable in f32, so f32 inputs and the f64 formula see one point.
pub const SITU_POINTS: [f64; 28] = [
    -1e4,
    -100.0,
    -30.0,
    -25.5,
    -25.0,
    -24.5,
    -20.0,
    -5.0,
    -4.125,
    -4.0,
    -3.875,
    -1.21875,
    -0.0009765625,
    -0.0,
    0.0,
    0.0009765625,
    0.5,
    2.0,
    3.875,
    4.0,
    4.125,
    6.0,
    24.5,
    25.0,
    25.5,
    30.0,
    100.0,
    1e4,
];

/// Every pair of [`SITU_POINTS`] as `(gate, up)`.
pub fn situ_grid() -> (Vec<f64>, Vec<f64>) {
    let mut g = Vec::new();
    let mut v = Vec::new();
    for &a in &SITU_POINTS {
        for &b in &SITU_POINTS {
            g.push(a);
            v.push(b);
        }
    }
    (g, v)
}

/// `(σ(x), 1 − σ(x))` in f64, each from `e^{−|x|}` (no subtraction).
pub fn sigmoid_pair64(x: f64) -> (f64, f64) {
    let e = (-x.abs()).exp();
    let (big, small) = (1.0 / (1.0 + e), e / (1.0 + e));
    if x >= 0.0 {
        (big, small)
    } else {
        (small, big)
    }
}

/// The logistic sigmoid in f64.
pub fn sigmoid64(x: f64) -> f64 {
    sigmoid_pair64(x).0
}

/// `(tanh(x), 1 − tanh²(x))` in f64, the second as `1/cosh²` (no subtraction).
pub fn tanh_sech2_64(x: f64) -> (f64, f64) {
    let c = x.cosh();
    (x.tanh(), if c.is_finite() { 1.0 / (c * c) } else { 0.0 })
}

/// SiTU-GLU in f64, written from design §1 independently of the crate: `(y, ∂y/∂gate, ∂y/∂up)` of
/// `y = A(gate)·B(up)`, `A(g) = β1·tanh(g/β1)·σ(g)`, `B(v) = β2·tanh(v/β2)` (or `v`).
pub fn situ64(g: f64, v: f64, b1: f64, b2: Option<f64>) -> (f64, f64, f64) {
    let ((tg, sech_g), (s, c)) = (tanh_sech2_64(g / b1), sigmoid_pair64(g));
    let a = b1 * tg * s;
    let da = sech_g * s + b1 * tg * s * c;
    let (b, db) = match b2 {
        Some(b2) => {
            let (tv, sech_v) = tanh_sech2_64(v / b2);
            (b2 * tv, sech_v)
        }
        None => (v, 1.0),
    };
    (a * b, b * da, a * db)
}

/// SwiGLU in f64: `(y, ∂y/∂gate, ∂y/∂up)` of `y = g·σ(g)·v`.
pub fn swiglu64(g: f64, v: f64) -> (f64, f64, f64) {
    let (s, c) = sigmoid_pair64(g);
    (g * s * v, s * (1.0 + g * c) * v, g * s)
}

/// Fails unless the device can store `dtype`: a storage test must check the dtype it names, never
/// pass without checking anything. Tests of a dtype that CI's device lacks are `#[ignore]`d with a
/// reason that names it.
pub fn require_dtype<B: Backend>(device: &B::Device, dtype: burn::tensor::DType) {
    assert!(
        B::supports_dtype(device, dtype),
        "{dtype:?} storage is not supported by this device: run this test where it is"
    );
}
