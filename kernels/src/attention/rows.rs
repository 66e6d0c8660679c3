//! The per-row kernels: one unit owns one query row (the forward,
//! [`attention_backward_query`](fn@attention_backward_query)) or one key row
//! ([`attention_backward_key`](fn@attention_backward_key)) with its vectors in registers: no
//! shared memory, no barrier, no atomics, so reruns are bit-identical. Units of a plane hold
//! neighbouring rows, which read the same key (query) row at the same step. The forward takes the
//! maximum online and rescales its accumulators only when it grows. For small heads (see
//! [`uses_row_kernels`](super::uses_row_kernels)): on lavapipe they run about twice as fast as
//! the tiled kernels at the tiny model's heads, and a unit's row vectors stay in registers on
//! CUDA up to [`ROW_KERNEL_MAX_WIDTH`](super::ROW_KERNEL_MAX_WIDTH).

use cubecl::prelude::*;

use super::{key_visible, EMPTY_ROW_LSE};

/// Units per cube of the per-row kernels (one unit per row).
pub const ATTENTION_CUBE: u32 = 64;

/// Forward: `o: [BH, T, dv]` in `F` and `lse: [BH · T]` f32. One unit per query row (`rows` =
/// `BH · T`), cubes of [`ATTENTION_CUBE`] units; extra units exit. `pad` is read only when
/// `has_pad` (pass any one-element buffer otherwise).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_forward<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    o: &mut Array<F>,
    lse: &mut Array<f32>,
    rows: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let i = row % t;
    let first = row - i;
    let b = row / t / heads;
    let mut qr = Array::<f32>::new(dqk);
    for c in 0..dqk {
        qr[c] = f32::cast_from(q[row * dqk + c]) * scale;
    }
    let mut acc = Array::<f32>::new(dv);
    for c in 0..dv {
        acc[c] = 0.0f32;
    }
    let mut top = f32::new(-1.0e30);
    let mut total = 0.0f32;
    for j in 0..i + 1 {
        if key_visible(pad, b, j, t, has_pad) {
            let kb = (first + j) * dqk;
            let mut s = 0.0f32;
            for c in 0..dqk {
                s += qr[c] * f32::cast_from(k[kb + c]);
            }
            let vb = (first + j) * dv;
            if s > top {
                // A new maximum: rescale what was summed so far.
                let alpha = f32::exp(top - s);
                top = s;
                total = total * alpha + 1.0f32;
                for c in 0..dv {
                    acc[c] = acc[c] * alpha + f32::cast_from(v[vb + c]);
                }
            } else {
                let p = f32::exp(s - top);
                total += p;
                for c in 0..dv {
                    acc[c] += p * f32::cast_from(v[vb + c]);
                }
            }
        }
    }
    let ob = row * dv;
    if total > 0.0f32 {
        let inv = 1.0f32 / total;
        for c in 0..dv {
            o[ob + c] = F::cast_from(acc[c] * inv);
        }
        lse[row] = top + f32::ln(total);
    } else {
        for c in 0..dv {
            o[ob + c] = F::cast_from(0.0f32);
        }
        lse[row] = EMPTY_ROW_LSE;
    }
}

/// Backward, per query row: `dq: [BH, T, dqk]` in `F` and `delta: [BH · T]` f32 (`D_i`, which
/// [`attention_backward_key`](fn@attention_backward_key) reads), from the forward's `o` and `lse`
/// and `d_o: [BH, T, dv]`. Launch as [`attention_forward`](fn@attention_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_backward_query<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    o: &Array<F>,
    lse: &Array<f32>,
    d_o: &Array<F>,
    dq: &mut Array<F>,
    delta: &mut Array<f32>,
    rows: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let i = row % t;
    let first = row - i;
    let b = row / t / heads;
    let mut qr = Array::<f32>::new(dqk);
    let mut acc = Array::<f32>::new(dqk);
    for c in 0..dqk {
        qr[c] = f32::cast_from(q[row * dqk + c]) * scale;
        acc[c] = 0.0f32;
    }
    let mut gr = Array::<f32>::new(dv);
    let mut d = 0.0f32;
    for c in 0..dv {
        let g = f32::cast_from(d_o[row * dv + c]);
        gr[c] = g;
        d += g * f32::cast_from(o[row * dv + c]);
    }
    delta[row] = d;
    let l = lse[row];
    for j in 0..i + 1 {
        if key_visible(pad, b, j, t, has_pad) {
            let kb = (first + j) * dqk;
            let vb = (first + j) * dv;
            let mut s = 0.0f32;
            for c in 0..dqk {
                s += qr[c] * f32::cast_from(k[kb + c]);
            }
            let mut dp = 0.0f32;
            for c in 0..dv {
                dp += gr[c] * f32::cast_from(v[vb + c]);
            }
            let ds = f32::exp(s - l) * (dp - d);
            for c in 0..dqk {
                acc[c] += ds * f32::cast_from(k[kb + c]);
            }
        }
    }
    for c in 0..dqk {
        dq[row * dqk + c] = F::cast_from(acc[c] * scale);
    }
}

/// Backward, per key row: `dk: [BH, T, dqk]` and `dv: [BH, T, dv]` in `F`, from the forward's
/// `lse` and the `delta` of [`attention_backward_query`](fn@attention_backward_query) (launch it
/// first). One unit per key row, launched as [`attention_forward`](fn@attention_forward).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn attention_backward_key<F: Float, I: Int>(
    q: &Array<F>,
    k: &Array<F>,
    v: &Array<F>,
    pad: &Array<I>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    d_o: &Array<F>,
    dk: &mut Array<F>,
    d_v: &mut Array<F>,
    rows: usize,
    t: usize,
    heads: usize,
    scale: f32,
    #[comptime] dqk: usize,
    #[comptime] dv: usize,
    #[comptime] has_pad: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let j = row % t;
    let first = row - j;
    let b = row / t / heads;
    let mut kr = Array::<f32>::new(dqk);
    let mut acc_k = Array::<f32>::new(dqk);
    for c in 0..dqk {
        kr[c] = f32::cast_from(k[row * dqk + c]) * scale;
        acc_k[c] = 0.0f32;
    }
    let mut vr = Array::<f32>::new(dv);
    let mut acc_v = Array::<f32>::new(dv);
    for c in 0..dv {
        vr[c] = f32::cast_from(v[row * dv + c]);
        acc_v[c] = 0.0f32;
    }
    // A padding key is seen by no query: its gradients stay zero.
    let mut end = t;
    if !key_visible(pad, b, j, t, has_pad) {
        end = j;
    }
    for i in j..end {
        let qb = (first + i) * dqk;
        let gb = (first + i) * dv;
        let mut s = 0.0f32;
        for c in 0..dqk {
            s += kr[c] * f32::cast_from(q[qb + c]);
        }
        let p = f32::exp(s - lse[first + i]);
        let mut dp = 0.0f32;
        for c in 0..dv {
            let g = f32::cast_from(d_o[gb + c]);
            dp += g * vr[c];
            acc_v[c] += p * g;
        }
        let ds = p * (dp - delta[first + i]);
        for c in 0..dqk {
            acc_k[c] += ds * f32::cast_from(q[qb + c]);
        }
    }
    for c in 0..dqk {
        dk[row * dqk + c] = F::cast_from(acc_k[c] * scale);
    }
    for c in 0..dv {
        d_v[row * dv + c] = F::cast_from(acc_v[c]);
    }
}
