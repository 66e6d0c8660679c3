//! Shared test helpers: backends, seeded random inputs and the SPEC §0 error metric.
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
/// The wgpu backend (software Vulkan in CI).
#[cfg(feature = "wgpu")]
pub type Gpu = burn::backend::Wgpu<f32, i32>;
/// The wgpu backend with autodiff.
#[cfg(feature = "wgpu")]
pub type GpuAd = Autodiff<Gpu>;

/// Runs a generic check `fn f<B: AutodiffBackend>(device: &B::Device)` on ndarray and, with the
/// `wgpu` feature, on the wgpu device. The wgpu test fails (never skips) when no adapter exists.
macro_rules! on_backends {
    ($name:ident, $check:ident) => {
        mod $name {
            #[test]
            fn ndarray() {
                super::$check::<crate::common::CpuAd>(&Default::default());
            }
            #[cfg(feature = "wgpu")]
            #[test]
            fn wgpu() {
                super::$check::<crate::common::GpuAd>(&Default::default());
            }
        }
    };
}
pub(crate) use on_backends;

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

/// The SPEC §0 error `rms(ref − out) / (rms(ref) + 1e-8)`.
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

/// SPEC §0 check: passes when `max|ref − out| ≤ 1e-6` or the relative RMS error is below `tol`;
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
