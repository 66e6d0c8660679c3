//! The routed experts on the CPU host kernels: one grouped pass over the expert segments of a
//! [`DispatchPlan`], forward and backward, with every product a `gemm` call.
//!
//! Forward, per expert `e` with the rows `X_e` of its segment (in parallel over experts):
//! `G = X_e W1[e]`, `U = X_e W3[e]`, `A = act(G, U)`, `Y = A W2[e]`; then each token sums
//! `p · Y` over its own pairs in slot order (a gather, no scatter: the result does not depend on
//! the number of threads). Backward, per expert: `dY = p · dOut`, `dA = dY W2[e]ᵀ`,
//! `dW2[e] = Aᵀ dY`, `(dG, dU) = act'(G, U) ⊙ dA`, `dW1[e] = X_eᵀ dG`, `dW3[e] = X_eᵀ dU`,
//! `dX_e = dG W1[e]ᵀ + dU W3[e]ᵀ`; then `dh` and `dp = Y · dOut` per token, again by gathers.
//!
//! Nothing is padded: an expert's products are exactly its load. `G`, `U` and `Y` are kept for
//! the backward pass (`A` is recomputed from them).

// Without a CPU backend (ndarray, flex) no backend reaches the host kernels: compiled, unused.
#![cfg_attr(
    not(any(feature = "ndarray", feature = "flex")),
    allow(dead_code, unused_imports)
)]

use rayon::prelude::*;

use super::dispatch::DispatchPlan;
use super::situ::GluActivation;
use crate::ops::backend::host::{scratch, HostArray, HostOp, Scratch};
use crate::ops::backend::matmul::{matmul_serial, Layout};
use crate::ops::backend::simd::{dispatch, map_into, map_many_into, prefetch, Simd, WithSimd};
use crate::ops::precision::host::{SituGlu, SwiGlu, Value, ValueAndGradient};

/// The routed experts of one dispatch: inputs `h: [m, ℓ]`, `weights: [m, k]`, `W1, W3: [n, ℓ, m_e]`,
/// `W2: [n, m_e, ℓ_out]`; output `[m, ℓ_out]` (zeros for tokens without pairs).
#[derive(Debug, Clone)]
pub(crate) struct RoutedExperts {
    /// The dispatch plan (pairs in expert order).
    pub plan: std::sync::Arc<DispatchPlan>,
    /// Experts per token.
    pub k: usize,
    /// The experts' activation.
    pub activation: GluActivation,
}

/// `G`, `U` (`[P, m_e]`) and the unweighted expert outputs `Y` (`[P, ℓ_out]`), in pair order;
/// back to the scratch pool when dropped.
#[derive(Debug)]
pub(crate) struct Saved {
    g: Scratch,
    u: Scratch,
    y: Scratch,
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    l: usize,
    me: usize,
    lo: usize,
}

impl RoutedExperts {
    fn dims(inputs: &[HostArray; 5]) -> Dims {
        let (w1, w2) = (&inputs[2].shape, &inputs[4].shape);
        Dims {
            l: w1[1],
            me: w1[2],
            lo: w2[2],
        }
    }

    /// `act(g, u)` into `out`, elementwise (vectorised, [`map_into`]).
    fn act_into(&self, out: &mut [f32], g: &[f32], u: &[f32]) {
        match self.activation {
            GluActivation::Situ { beta1, beta2 } => {
                SituGlu { beta1, beta2 }.value_into(out, [g, u])
            }
            GluActivation::SwiGlu => map_into(out, [g, u], Value(SwiGlu)),
        }
    }

    /// `act(g, u)` into `a` and `(∂act/∂g · d, ∂act/∂u · d)` into `(dg, du)`, elementwise, from
    /// one evaluation of the activation per element.
    fn act_and_grad_into(&self, [a, dg, du]: [&mut [f32]; 3], g: &[f32], u: &[f32], d: &[f32]) {
        let outs = [a, dg, du];
        match self.activation {
            GluActivation::Situ { beta1, beta2 } => {
                SituGlu { beta1, beta2 }.value_and_gradient_into(outs, [g, u, d])
            }
            GluActivation::SwiGlu => map_many_into(outs, [g, u, d], ValueAndGradient(SwiGlu)),
        }
    }

    /// The rows of `h` of an expert's segment, gathered: `[len, ℓ]`.
    /// The rows of a segment sit anywhere in `h`, so the row a few ahead is requested before it
    /// is copied (the hardware prefetchers do not follow an index).
    fn gather(&self, h: &[f32], l: usize, range: std::ops::Range<usize>) -> Scratch {
        let mut x = scratch(range.len() * l);
        let tokens = &self.plan.tokens[range];
        for (i, (row, &t)) in x.chunks_exact_mut(l).zip(tokens).enumerate() {
            if let Some(&ahead) = tokens.get(i + GATHER_AHEAD) {
                let ahead = ahead as usize;
                prefetch(&h[ahead * l..(ahead + 1) * l]);
            }
            let t = t as usize;
            row.copy_from_slice(&h[t * l..(t + 1) * l]);
        }
        x
    }

    /// The pair position of each `(token, slot)` (`usize::MAX`: not dispatched).
    fn positions(&self) -> Vec<usize> {
        let mut at = vec![usize::MAX; self.plan.m * self.k];
        for (pos, &pair) in self.plan.pairs.iter().enumerate() {
            at[pair as usize] = pos;
        }
        at
    }
}

/// `buf` cut into one slice of `width` floats per pair of each expert's segment.
fn segments_mut<'a>(plan: &DispatchPlan, buf: &'a mut [f32], width: usize) -> Vec<&'a mut [f32]> {
    let mut rest = buf;
    let mut out = Vec::with_capacity(plan.offsets.len().saturating_sub(1));
    for w in plan.offsets.windows(2) {
        let (seg, tail) = std::mem::take(&mut rest).split_at_mut((w[1] - w[0]) * width);
        out.push(seg);
        rest = tail;
    }
    out
}

/// Rows of `h` requested ahead of their copy in [`RoutedExperts::gather`].
const GATHER_AHEAD: usize = 4;

/// Tokens per task of the forward's weighted sum.
const COMBINE_TOKENS: usize = 64;

/// The forward's weighted sum over a chunk of tokens: `out[t] = Σ_slot p[t, slot] · Y[pos]`, in
/// slot order (a gather, so the result does not depend on the number of threads). The `Y` rows of
/// a token sit anywhere in the pair-ordered buffer, so the next token's rows are requested while
/// this one's are summed.
struct Combine<'a> {
    /// The chunk's output rows, zeros on entry.
    out: &'a mut [f32],
    /// The chunk's first token.
    first: usize,
    /// The pair position of every `(token, slot)` (`usize::MAX`: not dispatched).
    at: &'a [usize],
    /// The routing weights `[m, k]`.
    weights: &'a [f32],
    /// The unweighted expert outputs, in pair order.
    y: &'a [f32],
    /// Experts per token.
    k: usize,
    /// Output width.
    width: usize,
}

impl WithSimd for Combine<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _: S) {
        let Self {
            out,
            first,
            at,
            weights,
            y,
            k,
            width,
        } = self;
        let row_of = |pos: usize| &y[pos * width..(pos + 1) * width];
        for (i, row) in out.chunks_exact_mut(width).enumerate() {
            let t = first + i;
            for &pos in at.get((t + 1) * k..(t + 2) * k).unwrap_or_default() {
                if pos != usize::MAX {
                    prefetch(row_of(pos));
                }
            }
            for slot in 0..k {
                let pos = at[t * k + slot];
                if pos != usize::MAX {
                    let w = weights[t * k + slot];
                    for (o, v) in row.iter_mut().zip(row_of(pos)) {
                        *o += w * v;
                    }
                }
            }
        }
    }
}

impl HostOp<5> for RoutedExperts {
    type Saved = Saved;

    fn forward(&self, inputs: &[HostArray; 5], save: bool) -> (HostArray, Option<Saved>) {
        let [h, weights, w1, w3, w2] = inputs;
        let Dims { l, me, lo } = Self::dims(inputs);
        let (m, p) = (self.plan.m, self.plan.len());
        let experts = self.plan.offsets.len().saturating_sub(1);
        // `G` and `U` of every pair when the backward needs them; otherwise each expert keeps its
        // own in a pooled buffer that stays in its core's cache (two fewer `[P, m_e]` round trips
        // to memory).
        let mut kept = save.then(|| (scratch(p * me), scratch(p * me)));
        let kept_segments: Vec<Option<(&mut [f32], &mut [f32])>> = match kept.as_mut() {
            Some((g, u)) => segments_mut(&self.plan, g, me)
                .into_iter()
                .zip(segments_mut(&self.plan, u, me))
                .map(Some)
                .collect(),
            None => (0..experts).map(|_| None).collect(),
        };
        let mut y = scratch(p * lo);
        let jobs: Vec<_> = kept_segments
            .into_iter()
            .zip(segments_mut(&self.plan, &mut y, lo))
            .enumerate()
            .collect();
        jobs.into_par_iter().for_each(|(e, (kept, y))| {
            let range = self.plan.offsets[e]..self.plan.offsets[e + 1];
            let c = range.len();
            if c == 0 {
                return;
            }
            let x = self.gather(&h.data, l, range);
            let mut own = None;
            let (g, u) = match kept {
                Some(gu) => gu,
                None => {
                    let (g, u) = own.insert((scratch(c * me), scratch(c * me)));
                    (&mut g[..], &mut u[..])
                }
            };
            let (w1, w3) = (&w1.data[e * l * me..], &w3.data[e * l * me..]);
            matmul_serial(g, &x, Layout::Plain, w1, Layout::Plain, [c, l, me], false);
            matmul_serial(u, &x, Layout::Plain, w3, Layout::Plain, [c, l, me], false);
            let mut a = scratch(c * me);
            self.act_into(&mut a, g, u);
            let w2 = &w2.data[e * me * lo..];
            matmul_serial(y, &a, Layout::Plain, w2, Layout::Plain, [c, me, lo], false);
        });
        let at = self.positions();
        // Zeroed chunk by chunk on the pool, each just before its sum, rather than all at once
        // on the calling thread.
        let mut out = Vec::with_capacity(m * lo);
        out.spare_capacity_mut()[..m * lo]
            .par_chunks_mut(lo * COMBINE_TOKENS)
            .enumerate()
            .for_each(|(chunk, rows)| {
                for v in rows.iter_mut() {
                    v.write(0.0);
                }
                // SAFETY: every element of `rows` was just written; `MaybeUninit<f32>` has the
                // layout of `f32`.
                let rows =
                    unsafe { &mut *(rows as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
                dispatch(Combine {
                    out: rows,
                    first: chunk * COMBINE_TOKENS,
                    at: &at,
                    weights: &weights.data,
                    y: &y,
                    k: self.k,
                    width: lo,
                })
            });
        // SAFETY: the chunks above cover all `m · lo` elements, each written.
        unsafe { out.set_len(m * lo) };
        let out = HostArray {
            data: out.into(),
            shape: vec![m, lo],
        };
        let saved = kept.map(|(g, u)| Saved { g, u, y });
        (out, saved)
    }

    fn backward(&self, inputs: &[HostArray; 5], saved: &Saved, grad: &HostArray) -> [HostArray; 5] {
        let [h, weights, w1, w3, w2] = inputs;
        let Dims { l, me, lo } = Self::dims(inputs);
        let (p, k) = (self.plan.len(), self.k);
        let at = self.positions();
        // dp = Y · dOut and dY = p · dOut, per pair.
        let mut dweights = HostArray::zeros(&weights.shape);
        let mut dy = scratch(p * lo);
        for (pos, &pair) in self.plan.pairs.iter().enumerate() {
            let (pair, t) = (pair as usize, self.plan.tokens[pos] as usize);
            let dout = &grad.data[t * lo..(t + 1) * lo];
            let y = &saved.y[pos * lo..(pos + 1) * lo];
            dweights.data[pair] = y.iter().zip(dout).map(|(a, b)| a * b).sum();
            let w = weights.data[pair];
            for (d, o) in dy[pos * lo..(pos + 1) * lo].iter_mut().zip(dout) {
                *d = w * o;
            }
        }
        let mut dw1 = HostArray::zeros(&w1.shape);
        let mut dw3 = HostArray::zeros(&w3.shape);
        let mut dw2 = HostArray::zeros(&w2.shape);
        let mut dx = scratch(p * l);
        let jobs: Vec<_> = dw1
            .data
            .chunks_mut(l * me)
            .zip(dw3.data.chunks_mut(l * me))
            .zip(dw2.data.chunks_mut(me * lo))
            .zip(segments_mut(&self.plan, &mut dx, l))
            .enumerate()
            .collect();
        jobs.into_par_iter()
            .for_each(|(e, (((dw1, dw3), dw2), dx))| {
                let range = self.plan.offsets[e]..self.plan.offsets[e + 1];
                let c = range.len();
                if c == 0 {
                    return;
                }
                let x = self.gather(&h.data, l, range.clone());
                let (g, u) = (
                    &saved.g[range.start * me..range.end * me],
                    &saved.u[range.start * me..range.end * me],
                );
                let dy = &dy[range.start * lo..range.end * lo];
                let w2e = &w2.data[e * me * lo..];
                // dA = dY W2ᵀ; then A (recomputed) and dG, dU in one pass; dW2 = Aᵀ dY.
                let mut da = scratch(c * me);
                matmul_serial(
                    &mut da,
                    dy,
                    Layout::Plain,
                    w2e,
                    Layout::Transposed,
                    [c, lo, me],
                    false,
                );
                let (mut a, mut dg, mut du) = (scratch(c * me), scratch(c * me), scratch(c * me));
                self.act_and_grad_into([&mut a, &mut dg, &mut du], g, u, &da);
                matmul_serial(
                    dw2,
                    &a,
                    Layout::Transposed,
                    dy,
                    Layout::Plain,
                    [me, c, lo],
                    false,
                );
                let (w1e, w3e) = (&w1.data[e * l * me..], &w3.data[e * l * me..]);
                matmul_serial(
                    dw1,
                    &x,
                    Layout::Transposed,
                    &dg,
                    Layout::Plain,
                    [l, c, me],
                    false,
                );
                matmul_serial(
                    dw3,
                    &x,
                    Layout::Transposed,
                    &du,
                    Layout::Plain,
                    [l, c, me],
                    false,
                );
                matmul_serial(
                    dx,
                    &dg,
                    Layout::Plain,
                    w1e,
                    Layout::Transposed,
                    [c, me, l],
                    false,
                );
                matmul_serial(
                    dx,
                    &du,
                    Layout::Plain,
                    w3e,
                    Layout::Transposed,
                    [c, me, l],
                    true,
                );
            });
        let mut dh = HostArray::zeros(&h.shape);
        dh.data.par_chunks_mut(l).enumerate().for_each(|(t, row)| {
            for slot in 0..k {
                let pos = at[t * k + slot];
                if pos != usize::MAX {
                    for (o, v) in row.iter_mut().zip(&dx[pos * l..(pos + 1) * l]) {
                        *o += v;
                    }
                }
            }
        });
        [dh, dweights, dw1, dw3, dw2]
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Int, Tensor, TensorData};

    use crate::ops::moe::dispatch::{routed_experts, StackedExperts};
    use crate::ops::moe::route::Selection;
    use crate::ops::moe::situ::GluActivation;
    use crate::ops::with_kernels;

    type B = Autodiff<NdArray<f32>>;

    /// The design §0 check: `max|ref − out| ≤ 1e-6` or `rms(ref − out) / (rms(ref) + 1e-8)`
    /// below 1e-5 (element by element a relative bound fails where a sum cancels to near zero).
    fn assert_close(what: &str, want: &TensorData, got: &TensorData) {
        let (w, g): (Vec<f64>, Vec<f64>) =
            (want.iter::<f64>().collect(), got.iter::<f64>().collect());
        assert_eq!(w.len(), g.len(), "{what}: lengths");
        assert!(g.iter().all(|v| v.is_finite()), "{what}: not finite");
        let rms = |x: &mut dyn Iterator<Item = f64>| {
            (x.map(|v| v * v).sum::<f64>() / w.len().max(1) as f64).sqrt()
        };
        let max = w
            .iter()
            .zip(&g)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let err =
            rms(&mut w.iter().zip(&g).map(|(a, b)| a - b)) / (rms(&mut w.iter().copied()) + 1e-8);
        assert!(
            max <= 1e-6 || err < 1e-5,
            "{what}: relative RMS error {err:.3e}, max {max:.3e}"
        );
    }

    /// The host kernel against the padded tensor-op form: output and the gradients of `h`, the
    /// routing weights and the three stacked weights, with padding tokens and an idle expert.
    #[test]
    fn matches_the_tensor_op_dispatch_and_its_gradients() {
        let device = Default::default();
        let (m, n, k, l, me, lo) = (37, 6, 2, 12, 10, 9);
        for activation in [GluActivation::situ(), GluActivation::SwiGlu] {
            // Token t goes to experts (t mod 5) and (t·3 + 1) mod 5 (distinct): expert 5 is idle.
            let indices: Vec<u32> = (0..m)
                .flat_map(|t| {
                    let a = (t % 5) as u32;
                    let b = ((t * 3 + 1) % 5) as u32;
                    [a, if b == a { (a + 1) % 5 } else { b }]
                })
                .collect();
            let selection = Selection {
                tokens: m,
                experts: n,
                k,
                indices: indices.clone(),
            };
            let valid =
                crate::ops::moe::route::TokenMask::from_host((0..m).map(|t| t % 7 != 3).collect());
            let ids: Vec<i64> = indices.iter().map(|&e| e as i64).collect();
            let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [m, k]), &device);
            let normal =
                |s: [usize; 3]| Tensor::<B, 3>::random(s, Distribution::Normal(0.0, 1.0), &device);
            let h = Tensor::<B, 2>::random([m, l], Distribution::Normal(0.0, 1.0), &device);
            let weights = Tensor::<B, 2>::random([m, k], Distribution::Uniform(0.1, 1.0), &device);
            let (w1, w3, w2) = (normal([n, l, me]), normal([n, l, me]), normal([n, me, lo]));
            let dout = Tensor::<B, 2>::random([m, lo], Distribution::Normal(0.0, 1.0), &device);
            let run = |host: bool| {
                with_kernels(host, || {
                    let leaves = (
                        h.clone().require_grad(),
                        weights.clone().require_grad(),
                        w1.clone().require_grad(),
                        w3.clone().require_grad(),
                        w2.clone().require_grad(),
                    );
                    let experts = StackedExperts {
                        w1: leaves.2.clone(),
                        w3: leaves.3.clone(),
                        w2: leaves.4.clone(),
                        activation,
                        hidden_quant: None,
                    };
                    let out = routed_experts(
                        leaves.0.clone(),
                        &ids,
                        leaves.1.clone(),
                        || &selection,
                        Some(&valid),
                        &experts,
                    );
                    let grads = out.clone().mul(dout.clone()).sum().backward();
                    vec![
                        out.inner().into_data(),
                        leaves.0.grad(&grads).expect("dh").into_data(),
                        leaves.1.grad(&grads).expect("dp").into_data(),
                        leaves.2.grad(&grads).expect("dW1").into_data(),
                        leaves.3.grad(&grads).expect("dW3").into_data(),
                        leaves.4.grad(&grads).expect("dW2").into_data(),
                    ]
                })
            };
            let (want, got) = (run(false), run(true));
            let names = ["out", "dh", "dp", "dW1", "dW3", "dW2"];
            for ((w, g), name) in want.iter().zip(&got).zip(names) {
                assert_close(name, w, g);
            }
            // Untracked (no autodiff: the forward keeps no `G`, `U`, each expert its own).
            let inner = |t: Tensor<B, 3>| t.inner();
            let experts = StackedExperts {
                w1: inner(w1.clone()),
                w3: inner(w3.clone()),
                w2: inner(w2.clone()),
                activation,
                hidden_quant: None,
            };
            let valid = crate::ops::moe::route::TokenMask::<NdArray<f32>>::from_host(
                (0..m).map(|t| t % 7 != 3).collect(),
            );
            let untracked = with_kernels(true, || {
                routed_experts(
                    h.clone().inner(),
                    &ids.clone().inner(),
                    weights.clone().inner(),
                    || &selection,
                    Some(&valid),
                    &experts,
                )
            });
            assert_close("untracked out", &want[0], &untracked.into_data());
        }
    }
}
