//! An upstream defect and the crate's way around it (`kimi_burn::ops::layout`).
//!
//! Burn 0.21's CubeCL backends compute wrong strides when a reshape raises the rank of a strided
//! view whose last dimension has size 1: `[[1, 2]]` → `swap_dims(0, 1)` → `unsqueeze_dim(2)` reads
//! back `[1, 0]` on wgpu. The KDA recurrence met it as `β[:, t]` → heads first → broadcast over the
//! state, and returned wrong outputs on wgpu for B > 1 and H > 1 (crate versions 0.1.0 and earlier).

use crate::common::*;
use burn::tensor::backend::AutodiffBackend;
use kimi_burn::ops::layout;

/// The crate's helpers give the right values on every backend, in the smallest reproduction and in
/// the shape the KDA recurrence uses, against values computed on the host.
fn broadcast_over_swapped_unit_dims<B: AutodiffBackend>(device: &B::Device) {
    let x = from_f64::<B, 2>(&[1.0, 2.0], [1, 2], device).swap_dims(0, 1);
    let y = layout::unsqueeze_dim::<B, 2, 3>(x, 2);
    assert_eq!(y.dims(), [2, 1, 1]);
    assert_eq!(host(y), vec![1.0, 2.0], "unsqueeze of a swapped view");

    // β [B, T, H] at one step t, heads first, broadcast over a state [B, H, K, V].
    let (b, t, h, k, v) = (2, 3, 3, 4, 5);
    let mut r = rng(7);
    let f32_values = |v: Vec<f64>| v.into_iter().map(|x| x as f32 as f64).collect::<Vec<_>>();
    let beta_h = f32_values(normal_vec(&mut r, b * t * h));
    let state_h = f32_values(normal_vec(&mut r, b * h * k * v));
    let beta = from_f64::<B, 3>(&beta_h, [b, t, h], device);
    let state = from_f64::<B, 4>(&state_h, [b, h, k, v], device);
    let step = 1;
    let bt = beta.narrow(1, step, 1).swap_dims(1, 2);
    let got = host(state.mul(layout::unsqueeze_dim::<B, 3, 4>(bt.clone(), 3)));
    let expected: Vec<f64> = (0..b * h * k * v)
        .map(|i| {
            let (bi, hi) = (i / (h * k * v), (i / (k * v)) % h);
            state_h[i] * beta_h[(bi * t + step) * h + hi]
        })
        .collect();
    assert_close("β_t broadcast over the state", &expected, &got, 1e-7);
    let flat = host(layout::reshape::<B, 3, 4>(bt, [b, 1, h, 1]));
    let column: Vec<f64> = (0..b * h)
        .map(|i| beta_h[((i / h) * t + step) * h + i % h])
        .collect();
    assert_eq!(flat, column, "reshape of a swapped view");
}
on_backends!(swapped_unit_dims, broadcast_over_swapped_unit_dims);

/// Pins the upstream behaviour the helpers work around: Burn's own `unsqueeze_dim` of the same view
/// is still wrong on wgpu. When this fails after a Burn update, the defect is fixed upstream and
/// `kimi_burn::ops::layout` can go.
#[cfg(feature = "wgpu")]
#[test]
fn burn_0_21_unsqueeze_of_a_swapped_unit_dim_is_wrong_on_wgpu() {
    let device = Default::default();
    let x = from_f64::<Gpu, 2>(&[1.0, 2.0], [1, 2], &device).swap_dims(0, 1);
    let raw = host(x.clone().unsqueeze_dim::<3>(2));
    assert_ne!(raw, vec![1.0, 2.0], "Burn's unsqueeze_dim is right again");
    let cpu = from_f64::<Cpu, 2>(&[1.0, 2.0], [1, 2], &Default::default()).swap_dims(0, 1);
    assert_eq!(
        host(cpu.unsqueeze_dim::<3>(2)),
        vec![1.0, 2.0],
        "NdArray is right"
    );
}
