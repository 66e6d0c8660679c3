//! The chunked KDA algorithm (design §4.3): dense intra-chunk work batched over every chunk, then a
//! short sequential pass over chunks that carries the state.

use burn::tensor::{backend::Backend, Tensor};

use super::intra::{intra_chunk, Intra};
use super::kernels::KdaForm;
use super::{
    gather_tokens, host_forward, kernel_forward, prepare, unbind, KdaOptions, Prepared, CHUNK_SIZES,
};
use crate::error::{Error, Result};
use crate::ops::backend::{self, FusedOp, KernelPath};
use crate::ops::precision::restore;

/// Chunked KDA (design §4.3) for training and prefill; equal to
/// [`naive_recurrent_kda`](super::naive_recurrent_kda) up to rounding.
///
/// Per chunk of `C` tokens (`opts.chunk_size`, 64 by default; the last chunk of each sequence is
/// zero-padded, which leaves the state unchanged), with `G` the inclusive cumulative sum of `g`
/// inside the chunk:
///
/// ```text
/// A_kk[i,j] = β_i Σ_d k_i[d] k_j[d] exp(G_i[d] − G_j[d])   (j < i)
/// T̃ = (I + A_kk)^{-1} Diag(β);   W = T̃ (exp(G) ⊙ K);   U = T̃ V
/// A_qk[i,j] = Σ_d q_i[d] k_j[d] exp(G_i[d] − G_j[d])        (j ≤ i)
/// Vn = U − W S;   O = (q ⊙ exp(G)) S + A_qk Vn
/// S ← Diag(exp(G_last)) S + (K ⊙ exp(G_last − G))ᵀ Vn
/// ```
///
/// Numerics: every exponent is a sum of gates and so ≤ 0; `exp(−G)` and `1/Γ` are never formed.
/// Each `G_i − G_j` is summed directly from the gates between the two positions rather than taken
/// as a difference of two cumulative sums, which would lose the small gates once a sum reaches
/// −10⁴ in f32. The `C × C` matrices are built by recursive halving: a pair `j < i` is handled in
/// the block of `2b` rows where the two fall into different halves, anchored on the first row
/// `i0` of the upper half, `exp(G_i − G_j) = exp(Σ_{i0≤u≤i} g_u) · exp(Σ_{j<u<i0} g_u)`, so each
/// block is one matrix product of factors ≤ 1; `(I + A_kk)^{-1}` is assembled by the same
/// recursion. Works in f32 (f64 for f64 inputs); the output comes back in the dtype of `q`, the
/// final state `[N, H, K, V]` in f32. Differentiable with Burn's autodiff.
///
/// On the CubeCL backends (see [`backend`]) it runs the chunked kernels instead:
/// gate sums, within-chunk matrices, the triangular solve, the sequential state pass over value
/// tiles (one launch per ~1000 tokens of the longest sequence) and the output, with a fused
/// backward under autodiff.
///
/// # Panics
/// On invalid input; see [`try_chunk_kda`].
pub fn chunk_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    try_chunk_kda(q, k, v, g, beta, opts).unwrap_or_else(|e| panic!("{e}"))
}

/// [`chunk_kda`], reporting bad input as an error: the checks of
/// [`try_naive_recurrent_kda`](super::try_naive_recurrent_kda) plus a chunk size outside
/// {16, 32, 64}.
pub fn try_chunk_kda<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    chunk_kda_inner(q, k, v, g, beta, opts, true)
}

/// [`try_chunk_kda`] with the host read-back of the gate check optional.
pub(crate) fn chunk_kda_inner<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    g: Tensor<B, 4>,
    beta: Tensor<B, 3>,
    opts: KdaOptions<B>,
    check_gates: bool,
) -> Result<(Tensor<B, 4>, Option<Tensor<B, 4>>)> {
    let c = opts.chunk_size;
    if !CHUNK_SIZES.contains(&c) {
        return Err(Error::argument(
            "chunk_size",
            format!("must be one of {CHUNK_SIZES:?}, got {c}"),
        ));
    }
    let opts = match host_forward(&q, &k, &v, &g, &beta, opts, check_gates)? {
        Ok(out) => {
            backend::record(FusedOp::KdaChunk, KernelPath::Reference);
            return Ok(out);
        }
        Err(opts) => opts,
    };
    let p = prepare(q, k, v, g, beta, opts, check_gates)?;
    Ok(match kernel_forward(p, KdaForm::Chunk(c)) {
        Ok(out) => {
            backend::record(FusedOp::KdaChunk, KernelPath::Kernel);
            out
        }
        Err(p) => {
            backend::record(FusedOp::KdaChunk, KernelPath::Reference);
            run(p, c)
        }
    })
}

/// Where the chunks of each sequence lie in the chunk axis.
struct Layout {
    c: usize,
    /// Chunks per row of the chunk axis.
    nc: usize,
    /// `(first chunk, chunk count)` per packed sequence; `None`: every row is one sequence.
    seqs: Option<Vec<(usize, usize)>>,
    /// `(start, len)` in tokens per packed sequence.
    tokens: Option<Vec<(usize, usize)>>,
    t: usize,
}

impl Layout {
    /// `[B, T, H, X]` → `[B·H, NC, C, X]`, each sequence zero-padded to whole chunks.
    fn to_chunks<B: Backend>(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, t, h, d] = x.dims();
        let c = self.c;
        let padded = match &self.tokens {
            None if t % c == 0 => x,
            None => {
                let zeros = Tensor::zeros([b, self.nc * c - t, h, d], (&x.device(), x.dtype()));
                Tensor::cat(vec![x, zeros], 1)
            }
            Some(tokens) => {
                let slots: Vec<Option<usize>> = tokens
                    .iter()
                    .flat_map(|&(start, len)| {
                        (0..len.div_ceil(c) * c).map(move |i| (i < len).then_some(start + i))
                    })
                    .collect();
                gather_tokens(x, &slots)
            }
        };
        padded
            .reshape([b, self.nc, c, h, d])
            .permute([0, 3, 1, 2, 4])
            .reshape([b * h, self.nc, c, d])
    }

    /// The inverse of [`to_chunks`](Self::to_chunks): `[B·H, NC, C, X]` → `[B, T, H, X]`.
    fn unchunk<B: Backend>(&self, x: Tensor<B, 4>, b: usize, h: usize) -> Tensor<B, 4> {
        let d = x.dims()[3];
        let x = x.reshape([b, h, self.nc * self.c, d]).swap_dims(1, 2);
        match &self.tokens {
            None => x.narrow(1, 0, self.t),
            Some(tokens) => {
                let mut offset = 0;
                let mut slots = Vec::with_capacity(self.t);
                for &(_, len) in tokens {
                    slots.extend((offset..offset + len).map(Some));
                    offset += len.div_ceil(self.c) * self.c;
                }
                gather_tokens(x, &slots)
            }
        }
    }
}

/// The chunked form in tensor ops (design §4.3): within-chunk matrices for all chunks at once, then
/// the state pass over the chunks. Long on purpose: the steps share the chunk layout and a dozen
/// intermediate tensors, in the order the design lists them.
fn run<B: Backend>(p: Prepared<B>, c: usize) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    let (b, h, kd, vd) = (p.dims.b, p.dims.h, p.dims.k, p.dims.v);
    let layout = match &p.seqs {
        None => Layout {
            c,
            nc: p.dims.t.div_ceil(c),
            seqs: None,
            tokens: None,
            t: p.dims.t,
        },
        Some(tokens) => {
            let mut first = 0;
            let seqs = tokens
                .iter()
                .map(|&(_, len)| {
                    let span = (first, len.div_ceil(c));
                    first += span.1;
                    span
                })
                .collect();
            Layout {
                c,
                nc: first,
                seqs: Some(seqs),
                tokens: Some(tokens.clone()),
                t: p.dims.t,
            }
        }
    };
    let (z, nc) = (b * h, layout.nc);
    let m = z * nc;
    let flat = |x: Tensor<B, 4>| {
        let d = x.dims()[3];
        layout.to_chunks(x).reshape([m, c, d])
    };
    let intra = intra_chunk(
        flat(p.q),
        flat(p.k),
        flat(p.v),
        flat(p.g),
        flat(crate::ops::layout::unsqueeze_dim(p.beta, 3)).reshape([m, c]),
    );
    let Intra {
        a_qk,
        w,
        u,
        q_decayed,
        k_to_end,
        decay,
    } = intra;

    // The sequential pass: only the products with the state S are left for it.
    let starts: Vec<(usize, usize)> = layout.seqs.clone().unwrap_or_else(|| vec![(0, nc)]);
    let (device, dtype) = (w.device(), w.dtype());
    let initial = |n: usize| match (&p.h0, &layout.seqs) {
        (Some(h0), None) => h0.clone().reshape([z, kd, vd]),
        (Some(h0), Some(_)) => h0.clone().narrow(0, n, 1).reshape([z, kd, vd]),
        (None, _) => Tensor::zeros([z, kd, vd], (&device, dtype)),
    };
    let per_chunk = |x: Tensor<B, 3>| {
        let [_, rows, d] = x.dims();
        unbind(x.reshape([z, nc, rows, d]), 1)
            .into_iter()
            .map(move |t| t.reshape([z, rows, d]))
    };
    let mut ws = per_chunk(w);
    let mut us = per_chunk(u);
    let mut ks = per_chunk(k_to_end);
    let mut ds = per_chunk(decay);
    let mut states = Vec::with_capacity(nc);
    let mut deltas = Vec::with_capacity(nc);
    let mut finals = Vec::with_capacity(starts.len());
    for (n, &(_, count)) in starts.iter().enumerate() {
        let mut s = initial(n);
        for _ in 0..count {
            let (Some(wc), Some(uc), Some(kc), Some(dc)) =
                (ws.next(), us.next(), ks.next(), ds.next())
            else {
                unreachable!("the layout has exactly nc chunks");
            };
            let vn = uc.sub(wc.matmul(s.clone()));
            states.push(s.clone());
            s = s
                .mul(dc.swap_dims(1, 2))
                .add(kc.swap_dims(1, 2).matmul(vn.clone()));
            deltas.push(vn);
        }
        finals.push(s);
    }
    // S before each chunk and Vn of each chunk, back in the [B·H·NC, …] layout.
    let states = Tensor::stack::<4>(states, 1).reshape([m, kd, vd]);
    let deltas = Tensor::stack::<4>(deltas, 1).reshape([m, c, vd]);
    let o = q_decayed.matmul(states).add(a_qk.matmul(deltas));
    let o = layout.unchunk(o.reshape([z, nc, c, vd]), b, h);

    let state = p.output_final_state.then(|| match layout.seqs {
        None => finals.remove(0).reshape([b, h, kd, vd]),
        Some(_) => Tensor::stack(finals, 0),
    });
    (restore(o, p.out_dtype), state)
}
