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

use crate::ops::backend::host::{
    scratch, DisjointWrites, Fresh, HostArray, HostData, HostOp, Scratch,
};
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
                    let mut nan = false;
                    for (s, &masked) in seen.iter_mut().zip(pad) {
                        if masked {
                            *s = f32::NEG_INFINITY;
                        } else {
                            *s *= scale;
                            nan |= s.is_nan();
                            max = max.max(*s);
                        }
                    }
                    // A NaN score makes the row NaN, as without padding (`f32::max` skips it,
                    // which would leave a row of NaN scores looking wholly masked).
                    if nan {
                        max = f32::NAN;
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

/// Block `i` of `len` elements of `x`.
fn block(x: &[f32], i: usize, len: usize) -> &[f32] {
    &x[i * len..(i + 1) * len]
}

/// Sizes `(B, H, T, d_qk, d_v)` of a call.
fn sizes(inputs: &[HostArray; 3]) -> (usize, usize, usize, usize, usize) {
    let (q, v) = (&inputs[0].shape, &inputs[2].shape);
    (q[0], q[1], q[2], q[3], v[3])
}

impl CausalAttention {
    /// One (batch row `b`, head): `o = softmax(scale · q kᵀ) v` into `o: [t, dv]`, with the
    /// probabilities left in `p: [t, t]`; `q, k: [t, d]`, `v: [t, dv]`.
    fn head_forward(
        &self,
        o: &mut [f32],
        p: &mut [f32],
        [q, k, v]: [&[f32]; 3],
        b: usize,
        [t, d, dv]: [usize; 3],
    ) {
        self.probabilities(p, q, k, b, t, d);
        matmul_serial(o, p, Layout::Plain, v, Layout::Plain, [t, t, dv], false);
    }

    /// The backward pass of [`head_forward`](Self::head_forward): `dq, dk: [t, d]` and
    /// `dv: [t, dv]` from its probabilities `p` and the output gradient `d_o: [t, dv]`.
    fn head_backward(
        &self,
        [dq, dk, dvs]: [&mut [f32]; 3],
        p: &[f32],
        d_o: &[f32],
        [q, k, v]: [&[f32]; 3],
        [t, d, dv]: [usize; 3],
    ) {
        // dV = Pᵀ dO; dP = dO Vᵀ.
        matmul_serial(
            dvs,
            p,
            Layout::Transposed,
            d_o,
            Layout::Plain,
            [t, t, dv],
            false,
        );
        let mut ds = scratch(t * t);
        matmul_serial(
            &mut ds,
            d_o,
            Layout::Plain,
            v,
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
        matmul_serial(dq, &ds, Layout::Plain, k, Layout::Plain, [t, t, d], false);
        matmul_serial(
            dk,
            &ds,
            Layout::Transposed,
            q,
            Layout::Plain,
            [t, t, d],
            false,
        );
    }
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
                let qkv = [
                    block(&q.data, bh, t * d),
                    block(&k.data, bh, t * d),
                    block(&v.data, bh, t * dv),
                ];
                self.head_forward(o, p, qkv, bh / h, [t, d, dv]);
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
                let qkv = [
                    block(&q.data, bh, t * d),
                    block(&k.data, bh, t * d),
                    block(&v.data, bh, t * dv),
                ];
                let p = block(&saved.p, bh, t * t);
                let d_o = block(&grad.data, bh, t * dv);
                self.head_backward([dq, dk, dvv], p, d_o, qkv, [t, d, dv]);
            });
        [dq, dk, dvs]
    }
}

/// MLA's expanded attention over its projections' own layouts (rotated beforehand, if at all),
/// so that no per-head tensor is assembled around it: `q: [B, T, H, d_qk]`, `kv: [B, T, H, d_n +
/// d_v]` (per head the key's first `d_n` dims, then the value) and `k_pe: [B, T, d_qk − d_n]`
/// (the key's other dims, shared by every head) → `o: [B, T, H, d_v]`. Each (batch row, head)
/// gathers its `q`, `k` and `v` rows and runs [`CausalAttention`]'s own per-head passes; the
/// backward writes `dq`, `dkv` in the inputs' layouts and sums `dk_pe` over the heads in head
/// order.
#[derive(Debug, Clone)]
pub(crate) struct MlaAttention {
    /// The attention proper (scale and key padding).
    pub attention: CausalAttention,
    /// `d_n`: the key dims of `kv`.
    pub dn: usize,
}

/// `(B, T, H, d_qk, d_v)` of [`MlaAttention`]'s inputs.
fn mla_sizes(inputs: &[HostArray; 3], dn: usize) -> (usize, usize, usize, usize, usize) {
    let (q, kv) = (&inputs[0].shape, &inputs[1].shape);
    (q[0], q[1], q[2], q[3], kv[3] - dn)
}

impl MlaAttention {
    /// Head `h` of batch row `b`: its `q` (`[t, d_qk]`), `k` (`[t, d_qk]`) and `v` (`[t, d_v]`)
    /// rows gathered into `buf`.
    fn gather<'b>(
        &self,
        inputs: &[HostArray; 3],
        b: usize,
        h: usize,
        buf: &'b mut [f32],
    ) -> [&'b [f32]; 3] {
        let (_, t, heads, d, dv) = mla_sizes(inputs, self.dn);
        let [q, kv, k_pe] = inputs;
        let (dn, dr, dkv) = (self.dn, d - self.dn, self.dn + dv);
        let (qs, rest) = buf.split_at_mut(t * d);
        let (ks, vs) = rest.split_at_mut(t * d);
        for i in 0..t {
            let row = (b * t + i) * heads + h;
            qs[i * d..(i + 1) * d].copy_from_slice(&q.data[row * d..(row + 1) * d]);
            let kv_row = &kv.data[row * dkv..(row + 1) * dkv];
            ks[i * d..i * d + dn].copy_from_slice(&kv_row[..dn]);
            let pe = (b * t + i) * dr;
            ks[i * d + dn..(i + 1) * d].copy_from_slice(&k_pe.data[pe..pe + dr]);
            vs[i * dv..(i + 1) * dv].copy_from_slice(&kv_row[dn..]);
        }
        [qs, ks, &vs[..t * dv]]
    }
}

impl HostOp<3> for MlaAttention {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; 3], save: bool) -> (HostArray, Option<Saved>) {
        let (b, t, h, d, dv) = mla_sizes(inputs, self.dn);
        let mut out = Fresh::new(b * t * h * dv);
        let mut p = scratch(b * h * t * t);
        let (o_rows, p_blocks) = (DisjointWrites::fresh(&mut out), DisjointWrites::new(&mut p));
        (0..b * h).into_par_iter().for_each(|bh| {
            let (bi, hi) = (bh / h, bh % h);
            let mut buf = scratch(t * (2 * d + dv) + t * dv);
            let (qkv_buf, o) = buf.split_at_mut(t * (2 * d + dv));
            let qkv = self.gather(inputs, bi, hi, qkv_buf);
            // SAFETY: the probabilities of this (batch row, head) are its own block.
            let p = unsafe { p_blocks.slice(bh * t * t, t * t) };
            self.attention.head_forward(o, p, qkv, bi, [t, d, dv]);
            for (i, row) in o.chunks_exact(dv).enumerate() {
                // SAFETY: row `(b, i, h)` of `o` belongs to this (batch row, head) alone.
                unsafe { o_rows.slice(((bi * t + i) * h + hi) * dv, dv) }.copy_from_slice(row);
            }
        });
        let saved = save.then_some(Saved { p });
        let out = HostArray {
            // SAFETY: the (batch row, head) pairs took every row of `o` once.
            data: HostData::Owned(unsafe { out.into_vec() }),
            shape: vec![b, t, h, dv],
        };
        (out, saved)
    }

    fn backward(&self, inputs: &[HostArray; 3], saved: &Saved, grad: &HostArray) -> [HostArray; 3] {
        let (b, t, h, d, dv) = mla_sizes(inputs, self.dn);
        let (dn, dr) = (self.dn, d - self.dn);
        let dkv_w = dn + dv;
        let mut dq = Fresh::new(b * t * h * d);
        let mut dkv = Fresh::new(b * t * h * dkv_w);
        let mut dk_pe = HostArray::zeros(&inputs[2].shape);
        // Every head's share of `dk_pe`, `[B, H, T, d_r]`, summed over the heads afterwards.
        let mut pe_parts = scratch(b * h * t * dr);
        let (dq_rows, dkv_rows, pe_rows) = (
            DisjointWrites::fresh(&mut dq),
            DisjointWrites::fresh(&mut dkv),
            DisjointWrites::new(&mut pe_parts),
        );
        (0..b * h).into_par_iter().for_each(|bh| {
            let (bi, hi) = (bh / h, bh % h);
            let mut buf = scratch(t * (2 * d + dv) + t * (2 * d + 2 * dv));
            let (qkv_buf, rest) = buf.split_at_mut(t * (2 * d + dv));
            let qkv = self.gather(inputs, bi, hi, qkv_buf);
            let (d_o, rest) = rest.split_at_mut(t * dv);
            let (dqs, rest) = rest.split_at_mut(t * d);
            let (dks, dvs) = rest.split_at_mut(t * d);
            for (i, row) in d_o.chunks_exact_mut(dv).enumerate() {
                let at = ((bi * t + i) * h + hi) * dv;
                row.copy_from_slice(&grad.data[at..at + dv]);
            }
            let p = block(&saved.p, bh, t * t);
            self.attention
                .head_backward([dqs, dks, dvs], p, d_o, qkv, [t, d, dv]);
            // SAFETY: this (batch row, head)'s share of `dk_pe` is its own block.
            let pe_part = unsafe { pe_rows.slice(bh * t * dr, t * dr) };
            for i in 0..t {
                let row = (bi * t + i) * h + hi;
                // SAFETY: row `(b, i, h)` of `dq` and of `dkv` belongs to this (batch row, head)
                // alone.
                let (dq_row, dkv_row) = unsafe {
                    (
                        dq_rows.slice(row * d, d),
                        dkv_rows.slice(row * dkv_w, dkv_w),
                    )
                };
                let dk = &dks[i * d..(i + 1) * d];
                dq_row.copy_from_slice(&dqs[i * d..(i + 1) * d]);
                dkv_row[..dn].copy_from_slice(&dk[..dn]);
                dkv_row[dn..].copy_from_slice(&dvs[i * dv..(i + 1) * dv]);
                pe_part[i * dr..(i + 1) * dr].copy_from_slice(&dk[dn..]);
            }
        });
        if dr > 0 {
            dk_pe
                .data
                .par_chunks_mut(t * dr)
                .enumerate()
                .for_each(|(bi, dk_pe)| {
                    for hi in 0..h {
                        let part = block(&pe_parts, bi * h + hi, t * dr);
                        dk_pe.iter_mut().zip(part).for_each(|(s, x)| *s += x);
                    }
                });
        }
        let [dq, dkv] = [(dq, &inputs[0]), (dkv, &inputs[1])].map(|(d, x)| HostArray {
            // SAFETY: the (batch row, head) pairs took every row once.
            data: HostData::Owned(unsafe { d.into_vec() }),
            shape: x.shape.clone(),
        });
        [dq, dkv, dk_pe]
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Bool, Distribution, Tensor, TensorData, Tolerance};

    use crate::ops::mla::{causal_attention, mla_attention, AttentionKind};
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

    /// MLA's attention over the projections' layouts: the host kernel against the per-head
    /// tensors assembled by tensor ops and the tensor-op attention, output and the gradients of
    /// `q`, `kv` and `k_pe`, with right padding on one row, `d_v ≠ d_n` and three heads (the
    /// shared key's gradient sums them). Also with no shared key dims (`d_qk = d_n`).
    #[test]
    fn mla_layout_attention_matches_the_assembled_heads_and_their_gradients() {
        fn normal<const D: usize>(s: [usize; D]) -> Tensor<B, D> {
            Tensor::random(s, Distribution::Normal(0.0, 1.0), &Default::default())
        }
        let device = Default::default();
        let (b, h, t) = (2, 3, 17);
        let pad: Vec<bool> = (0..b * t).map(|i| i / t == 1 && i % t >= 12).collect();
        let pad = Tensor::<B, 2, Bool>::from_data(TensorData::new(pad, [b, t]), &device);
        for (dn, dr, dv) in [(6, 4, 5), (7, 0, 3)] {
            let q: Tensor<B, 4> = normal([b, t, h, dn + dr]);
            let kv: Tensor<B, 4> = normal([b, t, h, dn + dv]);
            let k_pe: Tensor<B, 3> = normal([b, t, dr]);
            let d_o: Tensor<B, 4> = normal([b, t, h, dv]);
            for padding in [None, Some(pad.clone())] {
                let run = |host: bool| {
                    with_kernels(host, || {
                        let (q, kv, k_pe) = (
                            q.clone().require_grad(),
                            kv.clone().require_grad(),
                            k_pe.clone().require_grad(),
                        );
                        let o = mla_attention(
                            q.clone(),
                            kv.clone(),
                            k_pe.clone(),
                            dn,
                            padding.clone(),
                            AttentionKind::Plain,
                        );
                        let grads = o.clone().mul(d_o.clone()).sum().backward();
                        let mut out = vec![
                            o.inner().into_data(),
                            q.grad(&grads).expect("dq").into_data(),
                            kv.grad(&grads).expect("dkv").into_data(),
                        ];
                        if dr > 0 {
                            out.push(k_pe.grad(&grads).expect("dk_pe").into_data());
                        }
                        out
                    })
                };
                let (want, got) = (run(false), run(true));
                assert_eq!(want.len(), got.len());
                for (w, g) in want.iter().zip(&got) {
                    assert_eq!(w.shape, g.shape);
                    g.assert_approx_eq::<f32>(w, Tolerance::rel_abs(1e-4, 1e-5));
                }
            }
        }
    }
}
