//! Causal softmax attention (design §5, the expanded form of MLA's training and prefill), forward
//! and backward, one unit per row: the scores are never stored.
//!
//! Per (batch row, head), query `i` attends keys `j ≤ i` that are not padding:
//!
//! ```text
//! s_ij = scale · q_i · k_j,   L_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij − L_i),   o_i = Σ_j p_ij v_j
//! D_i  = dO_i · o_i,          ds_ij = p_ij (dO_i · v_j − D_i)
//! dq_i = scale · Σ_j ds_ij k_j,   dk_j = scale · Σ_i ds_ij q_i,   dv_j = Σ_i p_ij dO_i
//! ```
//!
//! The forward keeps `L` (one f32 per query row) and takes the maximum online, rescaling its
//! accumulators when it grows. A query with no visible key gets a zero output, `L` =
//! [`EMPTY_ROW_LSE`] (so every `p_ij` of the backward is 0) and zero gradients. One unit owns one
//! query row (forward, [`attention_backward_query`](fn@attention_backward_query)) or one key row
//! ([`attention_backward_key`](fn@attention_backward_key)) with its vectors in registers: no
//! shared memory, no barrier, no atomics, so reruns are bit-identical. Units of a plane hold
//! neighbouring rows, which read the same key (query) row at the same step. This is the layout
//! that runs fastest on lavapipe, where the tensor-op form launches about ten kernels over the
//! `[B, H, T, T]` scores; it is not a tiled flash kernel, and a GPU at long `T` wants one.
//!
//! Layouts: `q, k: [BH, T, dqk]`, `v, o, dO: [BH, T, dv]` (row-major, `BH` = batch · heads, batch
//! outer), `pad: [B, T]` (non-zero: the key is padding), `L, D: [BH · T]` f32.

use cubecl::prelude::*;

/// Units per cube (one unit per row).
pub const ATTENTION_CUBE: u32 = 64;

/// The log-sum-exp stored for a query with no visible key: `exp(s − L)` is 0 for every score.
pub const EMPTY_ROW_LSE: f32 = 1.0e30;

/// Whether key `j` of batch row `b` is visible (not padding); always when `has_pad` is off.
#[cube]
fn key_visible<I: Int>(
    pad: &Array<I>,
    b: usize,
    j: usize,
    t: usize,
    #[comptime] has_pad: bool,
) -> bool {
    let mut visible = true;
    if comptime!(has_pad) {
        visible = u32::cast_from(pad[b * t + j]) == 0u32;
    }
    visible
}

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
