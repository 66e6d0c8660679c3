//! Steps 0–3 of SPEC §4.3 and the decayed products the sequential pass needs, batched over every
//! chunk.
//!
//! # Accurate gate sums
//! The decay between two positions is `exp(G_i − G_j)` with `G_i − G_j = Σ_{j<u≤i} g_u ≤ 0`. Taking
//! it as the difference of two inclusive cumulative sums is exact in real arithmetic but not in
//! f32: with a few −1000 gates in a chunk the sums reach −10⁴, where the f32 spacing is ~1e-3, and
//! the small gates between `j` and `i` are lost. Here every exponent is a direct sum of the gates
//! in its range (a cumulative sum of masked or shifted gates). Any such sum is accurate when its
//! range holds only small gates, and when it holds a −1000 gate its exponential is 0 anyway.
//!
//! The `C × C` decay matrices are built by sub-blocks of [`SUB`] rows:
//! - below the diagonal blocks, anchored products: for a row `i` in the sub-block starting at
//!   `i0` and a column `j < i0`, `exp(G_i − G_j) = exp(Σ_{i0≤u≤i} g_u) · exp(Σ_{j<u<i0} g_u)`, two
//!   factors ≤ 1, so that a plain matrix product does the work;
//! - inside the diagonal blocks, the elementwise form `Σ_d q_i[d] k_j[d] exp(Σ_{j<u≤i} g_u[d])`
//!   on a `[SUB, SUB, K]` tensor of masked cumulative sums.

use burn::tensor::{backend::Backend, DType, Tensor, TensorData};

use super::unbind;

/// Rows of a sub-block of a chunk: the diagonal blocks of the decay matrices are computed
/// elementwise at `SUB × SUB × K` per block, the rest by matrix products.
pub(crate) const SUB: usize = 16;

/// What the sequential pass needs from one batch of chunks (`M` chunks of `C` tokens).
pub(crate) struct Intra<B: Backend> {
    /// `A_qk [M, C, C]`, lower triangular including the diagonal.
    pub a_qk: Tensor<B, 3>,
    /// `W = T̃ (exp(G) ⊙ K)`: `[M, C, K]`.
    pub w: Tensor<B, 3>,
    /// `U = T̃ V`: `[M, C, V]`.
    pub u: Tensor<B, 3>,
    /// `q ⊙ exp(G)`: `[M, C, K]`.
    pub q_decayed: Tensor<B, 3>,
    /// `k ⊙ exp(G_last − G)`: `[M, C, K]`.
    pub k_to_end: Tensor<B, 3>,
    /// `exp(G_last)`: `[M, 1, K]`.
    pub decay: Tensor<B, 3>,
}

/// Intra-chunk part of SPEC §4.3 (steps 0–3, plus `A_qk`) for `M` independent chunks.
///
/// `q` (already scaled), `k`, `g`: `[M, C, K]`; `v: [M, C, V]`; `beta: [M, C]`. Padded positions
/// must carry `g = 0`, `k = 0`, `β = 0`.
pub(crate) fn intra_chunk<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    g: Tensor<B, 3>,
    beta: Tensor<B, 2>,
) -> Intra<B> {
    let [m, c, kd] = q.dims();
    let s = SUB.min(c);
    let nb = c / s;
    let device = q.device();
    let dtype = q.dtype();
    let mask = |f: &dyn Fn(usize, usize) -> bool, rows: usize, cols: usize| {
        constant_mask::<B>(rows, cols, f, &device, dtype)
    };

    // G from the chunk start and G_last − G to its end: direct sums, accurate as they stand.
    let g_cum = g.clone().cumsum(1);
    let decay = g_cum.clone().narrow(1, c - 1, 1).exp();
    // g_next[t] = g[t + 1] (0 past the end), so that a suffix sum of g_next excludes position t.
    let g_next = Tensor::cat(
        vec![
            g.clone().narrow(1, 1, c - 1),
            g.zeros_like().narrow(1, 0, 1),
        ],
        1,
    );
    let to_end = reverse_cumsum(g_next.clone(), 1);

    // Row factors: Σ_{i0≤u≤i} g_u inside each sub-block.
    let g_blocks = g.reshape([m, nb, s, kd]);
    let row_decay = g_blocks.clone().cumsum(2).exp();
    // Column factors per sub-block I: Σ_{j<u<i0(I)} g_u (zero for j ≥ i0 − 1, masked below).
    let before_anchor = mask(&|bi, t| t + 1 < bi * s, nb, c).reshape([1, nb, c, 1]);
    let col_sums = reverse_cumsum(g_next.unsqueeze_dim::<4>(1).mul(before_anchor), 2);
    let k_cols = k
        .clone()
        .unsqueeze_dim::<4>(1)
        .mul(col_sums.exp())
        .swap_dims(2, 3); // [M, nb, K, C]
    let q_blocks = q.clone().reshape([m, nb, s, kd]);
    let k_blocks = k.clone().reshape([m, nb, s, kd]);
    let below_blocks = mask(&|i, j| j < (i / s) * s, c, c).reshape([1, c, c]);
    let off = |rows: Tensor<B, 4>| {
        rows.mul(row_decay.clone())
            .matmul(k_cols.clone())
            .reshape([m, c, c])
            .mul(below_blocks.clone())
    };
    let qk_off = off(q_blocks.clone());
    let kk_off = off(k_blocks.clone());

    // Diagonal blocks: D[i, j] = Σ_{j<u≤i} g_u as a cumulative sum over u of gates masked to u > j.
    let after_col = mask(&|u, j| u > j, s, s).reshape([1, 1, s, s, 1]);
    let lower = mask(&|i, j| j <= i, s, s).reshape([1, 1, s, s, 1]);
    let pair_decay = g_blocks
        .unsqueeze_dim::<5>(3)
        .mul(after_col)
        .cumsum(2)
        .exp()
        .mul(lower);
    let k_decayed = k_blocks.clone().unsqueeze_dim::<5>(2).mul(pair_decay); // [M, nb, i, j, K]
    let diag = |rows: Tensor<B, 4>| {
        rows.unsqueeze_dim::<5>(3)
            .mul(k_decayed.clone())
            .sum_dim(4)
            .reshape([m, nb, s, s])
    };
    let strict = mask(&|i, j| j < i, s, s).reshape([1, 1, s, s]);
    let eye_blocks = mask(&|a, b| a == b, nb, nb).reshape([1, nb, 1, nb, 1]);
    let block_diag = |x: Tensor<B, 4>| {
        x.unsqueeze_dim::<5>(3)
            .mul(eye_blocks.clone())
            .reshape([m, c, c])
    };
    let a_qk = qk_off.add(block_diag(diag(q_blocks)));
    let beta_rows = beta.clone().reshape([m, c, 1]);
    let a_kk = kk_off
        .add(block_diag(diag(k_blocks).mul(strict)))
        .mul(beta_rows);

    // T̃ = (I + A_kk)^{-1} Diag(β).
    let t_mat = unit_lower_inverse(a_kk).mul(beta.reshape([m, 1, c]));
    let g_exp = g_cum.exp();
    let w = t_mat.clone().matmul(k.clone().mul(g_exp.clone()));
    let u = t_mat.matmul(v);
    Intra {
        a_qk,
        w,
        u,
        q_decayed: q.mul(g_exp),
        k_to_end: k.mul(to_end.exp()),
        decay,
    }
}

/// `(I + L)^{-1}` for strictly lower-triangular `L: [M, C, C]`.
///
/// Forward substitution row by row inside the diagonal blocks of [`SUB`] rows (batched over all
/// blocks), then the blocks are merged one block row at a time:
/// `X_{I,<I} = −X_{II} · L_{I,<I} · X_{<I,<I}`.
pub(crate) fn unit_lower_inverse<B: Backend>(l: Tensor<B, 3>) -> Tensor<B, 3> {
    let [m, c, _] = l.dims();
    let s = SUB.min(c);
    let nb = c / s;
    let device = l.device();
    let dtype = l.dtype();
    let eye_blocks =
        constant_mask::<B>(nb, nb, &|a, b| a == b, &device, dtype).reshape([1, nb, 1, nb, 1]);
    let blocks = l
        .clone()
        .reshape([m, nb, s, nb, s])
        .mul(eye_blocks)
        .sum_dim(3)
        .reshape([m, nb, s, s]);
    let eye = constant_mask::<B>(s, s, &|a, b| a == b, &device, dtype);
    let unit_row = |i: usize| eye.clone().narrow(0, i, 1).reshape([1, 1, 1, s]);
    // X_0 = e_0; X_i = e_i − L_{i,<i} X_{<i}.
    let mut x = Tensor::zeros([m, nb, 1, s], (&device, dtype)).add(unit_row(0));
    for (i, row) in unbind(blocks, 2).into_iter().enumerate().skip(1) {
        let next = unit_row(i).sub(row.narrow(3, 0, i).matmul(x.clone()));
        x = Tensor::cat(vec![x, next], 2);
    }
    let mut diag = unbind(x, 1).into_iter().map(|b| b.reshape([m, s, s]));
    let Some(mut inv) = diag.next() else {
        unreachable!("a chunk has at least one sub-block");
    };
    for (bi, x_ii) in diag.enumerate().map(|(i, x)| (i + 1, x)) {
        let r = bi * s;
        let l_row = l.clone().narrow(1, r, s).narrow(2, 0, r);
        let off = x_ii.clone().matmul(l_row.matmul(inv.clone())).neg();
        let top = Tensor::cat(vec![inv, Tensor::zeros([m, r, s], (&device, dtype))], 2);
        inv = Tensor::cat(vec![top, Tensor::cat(vec![off, x_ii], 2)], 1);
    }
    inv
}

/// `Σ_{u ≥ t} x_u` along `dim`.
fn reverse_cumsum<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    x.flip([dim as isize]).cumsum(dim).flip([dim as isize])
}

/// A `[rows, cols]` 0/1 tensor in `dtype` with ones where `f(row, col)` holds.
fn constant_mask<B: Backend>(
    rows: usize,
    cols: usize,
    f: &dyn Fn(usize, usize) -> bool,
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, 2> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|idx| f32::from(u8::from(f(idx / cols, idx % cols))))
        .collect();
    Tensor::from_data(TensorData::new(values, [rows, cols]), (device, dtype))
}
