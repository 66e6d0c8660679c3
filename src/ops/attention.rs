//! Causal softmax attention on the CPU host kernels: per (batch row, head), `S = scale · Q Kᵀ`
//! (masked: causal and key padding), `P = softmax(S)` row by row, `O = P V`, every product a
//! `gemm` call, the (batch, head) pairs on rayon's pool. Backward: `dV = Pᵀ dO`, `dP = dO Vᵀ`,
//! `dS = P ⊙ (dP − rowsum(dP ⊙ P))`, `dQ = scale · dS K`, `dK = scale · dSᵀ Q`.
//!
//! A query whose keys are all masked (a padding query preceded only by padding) gets a zero
//! output and zero gradients; the callers zero the outputs at padding queries anyway.

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use crate::ops::backend::host::{scratch, HostArray, HostOp, Scratch};
use crate::ops::backend::matmul::{matmul_serial, Layout};
use crate::ops::backend::simd::{dispatch, exp_lane, max_in, update, Elementwise, Simd, WithSimd};

/// `q, k: [B, H, T, d_qk]`, `v: [B, H, T, d_v]` → `[B, H, T, d_v]`.
#[derive(Debug, Clone)]
pub(crate) struct CausalAttention {
    /// Multiplies the scores.
    pub scale: f32,
    /// `[B, T]`, `true`: the key is padding; `None`: no padding.
    pub key_padding: Option<Vec<bool>>,
}

/// The attention probabilities of every (batch row, head), `[B·H, T, T]`, for the backward pass;
/// back to the scratch pool when dropped.
#[derive(Debug)]
pub(crate) struct Saved {
    p: Scratch,
}

/// `e^{x − max}` for the row maximum `max`.
#[derive(Clone, Copy)]
struct ShiftedExp(f32);

impl Elementwise<1> for ShiftedExp {
    #[inline(always)]
    fn apply(&self, [x]: [f32; 1]) -> f32 {
        exp_lane(x - self.0)
    }
}

impl CausalAttention {
    /// `S = scale · Q Kᵀ` of one (batch row, head) turned into `P` in place: masked, then a
    /// softmax per row (all-masked rows become zeros).
    fn probabilities(&self, p: &mut [f32], q: &[f32], k: &[f32], b: usize, t: usize, d: usize) {
        matmul_serial(p, q, Layout::Plain, k, Layout::Transposed, [t, d, t], false);
        dispatch(Softmax {
            p,
            t,
            scale: self.scale,
            padding: self
                .key_padding
                .as_ref()
                .map(|pad| &pad[b * t..(b + 1) * t]),
        });
    }
}

/// `x · s`.
#[derive(Clone, Copy)]
struct Times(f32);

impl Elementwise<1> for Times {
    #[inline(always)]
    fn apply(&self, [x]: [f32; 1]) -> f32 {
        x * self.0
    }
}

/// The rows of one (batch row, head): the scores `scale · q_i · k_j` scaled, masked and turned
/// into probabilities in place. Only a row's causal prefix `j ≤ i` is worked on; the rest is
/// set to zero, which is what the exponential of a masked score gives (and the prefix's sum is
/// the whole row's: the zeros after it add nothing).
struct Softmax<'a> {
    p: &'a mut [f32],
    t: usize,
    scale: f32,
    /// The batch row's key padding (`true`: masked).
    padding: Option<&'a [bool]>,
}

impl WithSimd for Softmax<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            p,
            t,
            scale,
            padding,
        } = self;
        for (i, row) in p.chunks_exact_mut(t).enumerate() {
            let (seen, future) = row.split_at_mut(i + 1);
            future.fill(0.0);
            let mut max = f32::NEG_INFINITY;
            match padding {
                None => {
                    update(seen, [], Times(scale));
                    // NaN-propagating where `f32::max` skips a NaN: the row's sum is NaN either way.
                    max = max_in(seen);
                }
                Some(pad) => {
                    for (s, &masked) in seen.iter_mut().zip(pad) {
                        if masked {
                            *s = f32::NEG_INFINITY;
                        } else {
                            *s *= scale;
                            max = max.max(*s);
                        }
                    }
                }
            }
            if max == f32::NEG_INFINITY {
                seen.fill(0.0);
                continue;
            }
            update(seen, [], ShiftedExp(max));
            let sum: f32 = seen.iter().sum();
            update(seen, [], Times(1.0 / sum));
        }
    }
}

/// `dS = scale · P ⊙ (dP − rowsum(dP ⊙ P))` in place over `dP`, row by row, on each row's causal
/// prefix (`P` is zero after it, so the rest of the row is too).
struct SoftmaxGrad<'a> {
    ds: &'a mut [f32],
    p: &'a [f32],
    t: usize,
    scale: f32,
}

impl WithSimd for SoftmaxGrad<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self { ds, p, t, scale } = self;
        for (i, (dsr, pr)) in ds.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            let (seen, future) = dsr.split_at_mut(i + 1);
            future.fill(0.0);
            let pr = &pr[..i + 1];
            let dot: f32 = seen.iter().zip(pr).map(|(a, b)| a * b).sum();
            update(seen, [pr], ProbabilityGrad { scale, dot });
        }
    }
}

/// `scale · p · (dp − dot)` for `[dp, p]`.
#[derive(Clone, Copy)]
struct ProbabilityGrad {
    scale: f32,
    dot: f32,
}

impl Elementwise<2> for ProbabilityGrad {
    #[inline(always)]
    fn apply(&self, [dp, p]: [f32; 2]) -> f32 {
        self.scale * p * (dp - self.dot)
    }
}

/// Sizes `(B, H, T, d_qk, d_v)` of a call.
fn sizes(inputs: &[HostArray; 3]) -> (usize, usize, usize, usize, usize) {
    let (q, v) = (&inputs[0].shape, &inputs[2].shape);
    (q[0], q[1], q[2], q[3], v[3])
}

impl HostOp<3> for CausalAttention {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; 3], save: bool) -> (HostArray, Option<Saved>) {
        let [q, k, v] = inputs;
        let (b, h, t, d, dv) = sizes(inputs);
        let mut out = HostArray::zeros(&[b, h, t, dv]);
        let mut p = scratch(b * h * t * t);
        out.data
            .par_chunks_mut(t * dv)
            .zip(p.par_chunks_mut(t * t))
            .enumerate()
            .for_each(|(bh, (o, p))| {
                let (qs, vs) = (
                    &q.data[bh * t * d..(bh + 1) * t * d],
                    &v.data[bh * t * dv..],
                );
                self.probabilities(p, qs, &k.data[bh * t * d..], bh / h, t, d);
                matmul_serial(o, p, Layout::Plain, vs, Layout::Plain, [t, t, dv], false);
            });
        let saved = save.then_some(Saved { p });
        (out, saved)
    }

    fn backward(&self, inputs: &[HostArray; 3], saved: &Saved, grad: &HostArray) -> [HostArray; 3] {
        let [q, k, v] = inputs;
        let (_, _, t, d, dv) = sizes(inputs);
        let mut dq = HostArray::zeros(&q.shape);
        let mut dk = HostArray::zeros(&k.shape);
        let mut dvs = HostArray::zeros(&v.shape);
        dq.data
            .par_chunks_mut(t * d)
            .zip(dk.data.par_chunks_mut(t * d))
            .zip(dvs.data.par_chunks_mut(t * dv))
            .enumerate()
            .for_each(|(bh, ((dq, dk), dvv))| {
                let p = &saved.p[bh * t * t..(bh + 1) * t * t];
                let d_o = &grad.data[bh * t * dv..(bh + 1) * t * dv];
                let (qs, ks) = (&q.data[bh * t * d..], &k.data[bh * t * d..]);
                // dV = Pᵀ dO; dP = dO Vᵀ.
                matmul_serial(
                    dvv,
                    p,
                    Layout::Transposed,
                    d_o,
                    Layout::Plain,
                    [t, t, dv],
                    false,
                );
                let mut ds = scratch(t * t);
                let vs = &v.data[bh * t * dv..];
                matmul_serial(
                    &mut ds,
                    d_o,
                    Layout::Plain,
                    vs,
                    Layout::Transposed,
                    [t, dv, t],
                    false,
                );
                // dS = scale · P ⊙ (dP − rowsum(dP ⊙ P)) (the scale of S = scale · Q Kᵀ folded in).
                dispatch(SoftmaxGrad {
                    ds: &mut ds,
                    p,
                    t,
                    scale: self.scale,
                });
                matmul_serial(dq, &ds, Layout::Plain, ks, Layout::Plain, [t, t, d], false);
                matmul_serial(
                    dk,
                    &ds,
                    Layout::Transposed,
                    qs,
                    Layout::Plain,
                    [t, t, d],
                    false,
                );
            });
        [dq, dk, dvs]
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Bool, Distribution, Tensor, TensorData, Tolerance};

    use crate::ops::mla::{causal_attention, AttentionKind};
    use crate::ops::with_kernels;

    type B = Autodiff<NdArray<f32>>;

    /// The host kernel against the tensor-op attention: output and the gradients of q, k, v, with
    /// right padding on one row and `d_v ≠ d_qk`.
    #[test]
    fn matches_the_tensor_op_attention_and_its_gradients() {
        let device = Default::default();
        let (b, h, t, d, dv) = (2, 3, 19, 8, 5);
        let normal =
            |s: [usize; 4]| Tensor::<B, 4>::random(s, Distribution::Normal(0.0, 1.0), &device);
        let (q, k, v) = (
            normal([b, h, t, d]),
            normal([b, h, t, d]),
            normal([b, h, t, dv]),
        );
        let d_o = normal([b, h, t, dv]);
        let pad: Vec<bool> = (0..b * t).map(|i| i / t == 1 && i % t >= 13).collect();
        let pad = Tensor::<B, 2, Bool>::from_data(TensorData::new(pad, [b, t]), &device);
        for padding in [None, Some(pad)] {
            let run = |host: bool| {
                with_kernels(host, || {
                    let (q, k, v) = (
                        q.clone().require_grad(),
                        k.clone().require_grad(),
                        v.clone().require_grad(),
                    );
                    let o = causal_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        padding.clone(),
                        AttentionKind::Plain,
                    );
                    let grads = o.clone().mul(d_o.clone()).sum().backward();
                    [
                        o.inner().into_data(),
                        q.grad(&grads).expect("dq").into_data(),
                        k.grad(&grads).expect("dk").into_data(),
                        v.grad(&grads).expect("dv").into_data(),
                    ]
                })
            };
            let (want, got) = (run(false), run(true));
            for (w, g) in want.iter().zip(&got) {
                g.assert_approx_eq::<f32>(w, Tolerance::rel_abs(1e-4, 1e-5));
            }
        }
    }
}
