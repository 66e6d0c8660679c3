//! Steps 0–3 of design §4.3 and the decayed products the sequential pass needs, batched over every
//! chunk.
//!
//! # Accurate gate sums
//! The decay between two positions is `exp(G_i − G_j)` with `G_i − G_j = Σ_{j<u≤i} g_u ≤ 0`. Taking
//! it as the difference of two inclusive cumulative sums is exact in real arithmetic but not in
//! f32: with a few −1000 gates in a chunk the sums reach −10⁴, where the f32 spacing is ~1e-3, and
//! the small gates between `j` and `i` are lost. Here every exponent is a direct sum of the gates
//! in its range (a cumulative sum of a slice or of shifted gates). Any such sum is accurate when
//! its range holds only small gates, and when it holds a −1000 gate its exponential is 0 anyway.
//!
//! # Recursive halving
//! Every pair `j < i` of a chunk meets at exactly one level: the block of `2b` rows in which `i`
//! and `j` fall into different halves (`b = 1, 2, 4, …, C/2`). Anchored on the first row `i0` of the
//! upper half, `exp(G_i − G_j) = exp(Σ_{i0≤u≤i} g_u) · exp(Σ_{j<u<i0} g_u)`: two factors ≤ 1
//! (nothing overflows, design §4.3), so the `b × b` block of `A_qk` or `A_kk` is one matrix
//! product. The same recursion builds `(I + A_kk)^{-1}` bottom-up, from 1×1 blocks:
//!
//! ```text
//! [[I + A, 0], [Q, I + B]]^{-1} = [[X_A, 0], [−X_B Q X_A, X_B]]
//! ```

use burn::tensor::{backend::Backend, Tensor};

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

/// Intra-chunk part of design §4.3 (steps 0–3, plus `A_qk`) for `M` independent chunks.
///
/// `q` (already scaled), `k`, `g`: `[M, C, K]`; `v: [M, C, V]`; `beta: [M, C]`; `C` a power of
/// two. Padded positions must carry `g = 0`, `k = 0`, `β = 0`.
pub(crate) fn intra_chunk<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    g: Tensor<B, 3>,
    beta: Tensor<B, 2>,
) -> Intra<B> {
    let [m, c, _] = q.dims();
    let beta = beta.reshape([m, c, 1]);

    // G from the chunk start and G_last − G to its end: direct sums, accurate as they stand.
    let g_cum = g.clone().cumsum(1);
    let decay = g_cum.clone().narrow(1, c - 1, 1).exp();
    let to_end = reverse_cumsum(shift_up(g.clone(), 1), 1);

    // 1×1 blocks: A_qk[i, i] = q_i · k_i (no decay), and (I + A_kk)^{-1} is 1 on the diagonal.
    let mut a_qk = q.clone().mul(k.clone()).sum_dim(2).reshape([m, c, 1, 1]);
    let mut inv = a_qk.ones_like();
    let mut b = 1;
    while b < c {
        let (g_cols, g_rows) = halves(g.clone(), b);
        let (k_cols, k_rows) = halves(k.clone(), b);
        // Rows: the upper half of each 2b-block, decayed from its first row i0.
        let row_decay = g_rows.cumsum(2).exp();
        // Columns: the lower half, decayed to its last row (nothing to decay over when b = 1).
        let cols = if b == 1 {
            k_cols
        } else {
            k_cols.mul(reverse_cumsum(shift_up(g_cols, 2), 2).exp())
        }
        .swap_dims(2, 3);
        let qk = halves(q.clone(), b)
            .1
            .mul(row_decay.clone())
            .matmul(cols.clone());
        let kk = k_rows
            .mul(row_decay.mul(halves(beta.clone(), b).1))
            .matmul(cols);
        let (upper, lower) = pairs(a_qk);
        a_qk = join(upper, qk, lower);
        let (x_upper, x_lower) = pairs(inv);
        let off = x_lower.clone().matmul(kk).matmul(x_upper.clone()).neg();
        inv = join(x_upper, off, x_lower);
        b *= 2;
    }
    let a_qk = a_qk.reshape([m, c, c]);
    // T̃ = (I + A_kk)^{-1} Diag(β): scale column j by β_j.
    let t_mat = inv.reshape([m, c, c]).mul(beta.swap_dims(1, 2));
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

/// `[M, C, D]` → the lower and upper halves of every `2b`-row block, each `[M, C/2b, b, D]`.
fn halves<B: Backend>(x: Tensor<B, 3>, b: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [m, c, d] = x.dims();
    let p = c / (2 * b);
    let x = x.reshape([m, p, 2, b, d]);
    let half = |i| x.clone().narrow(2, i, 1).reshape([m, p, b, d]);
    (half(0), half(1))
}

/// `[M, 2P, b, b]` diagonal blocks → the even and odd ones, each `[M, P, b, b]`.
fn pairs<B: Backend>(x: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [m, n, b, _] = x.dims();
    let x = x.reshape([m, n / 2, 2, b, b]);
    let half = |i| x.clone().narrow(2, i, 1).reshape([m, n / 2, b, b]);
    (half(0), half(1))
}

/// `[[upper, 0], [off, lower]]`: three `[M, P, b, b]` blocks → `[M, P, 2b, 2b]`.
fn join<B: Backend>(upper: Tensor<B, 4>, off: Tensor<B, 4>, lower: Tensor<B, 4>) -> Tensor<B, 4> {
    let zeros = upper.zeros_like();
    Tensor::cat(
        vec![
            Tensor::cat(vec![upper, zeros], 3),
            Tensor::cat(vec![off, lower], 3),
        ],
        2,
    )
}

/// `x[t] ← x[t + 1]` along `dim`, 0 past the end: a suffix sum of the result excludes position t.
fn shift_up<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    let n = x.dims()[dim];
    let last = x.clone().narrow(dim, 0, 1).zeros_like();
    Tensor::cat(vec![x.narrow(dim, 1, n - 1), last], dim)
}

/// `Σ_{u ≥ t} x_u` along `dim`.
fn reverse_cumsum<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    x.flip([dim as isize]).cumsum(dim).flip([dim as isize])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, TensorData};

    type B = NdArray<f32>;

    /// `A_qk` against its definition `Σ_d q_i[d] k_j[d] exp(Σ_{j<u≤i} g_u[d])` for `j ≤ i`, and
    /// `U` against forward substitution of `(I + A_kk) U = Diag(β) V`.
    #[test]
    fn recursion_matches_the_definitions() {
        let device = Default::default();
        let (c, d) = (16, 3);
        let q = Tensor::<B, 3>::random([1, c, d], Distribution::Normal(0.0, 1.0), &device);
        let k = Tensor::<B, 3>::random([1, c, d], Distribution::Normal(0.0, 0.5), &device);
        let v = Tensor::<B, 3>::random([1, c, 1], Distribution::Normal(0.0, 1.0), &device);
        let g = Tensor::<B, 3>::random([1, c, d], Distribution::Uniform(-1.0, 0.0), &device);
        let beta = Tensor::<B, 2>::random([1, c], Distribution::Uniform(0.0, 1.0), &device);
        let host = |t: Tensor<B, 3>| t.into_data().iter::<f64>().collect::<Vec<_>>();
        let (qh, kh, vh, gh) = (
            host(q.clone()),
            host(k.clone()),
            host(v.clone()),
            host(g.clone()),
        );
        let bh: Vec<f64> = beta.clone().into_data().iter::<f64>().collect();
        let pair = |x: &[f64], i: usize, j: usize| -> f64 {
            (0..d)
                .map(|e| {
                    let sum: f64 = (j + 1..=i).map(|u| gh[u * d + e]).sum();
                    x[i * d + e] * kh[j * d + e] * sum.exp()
                })
                .sum()
        };
        let out = intra_chunk(q, k, v, g, beta);
        let a_qk = out.a_qk.into_data().iter::<f64>().collect::<Vec<_>>();
        let mut u_ref = vec![0.0; c];
        for i in 0..c {
            for j in 0..c {
                let want = if j <= i { pair(&qh, i, j) } else { 0.0 };
                assert!(
                    (a_qk[i * c + j] - want).abs() < 1e-4,
                    "A_qk[{i},{j}] = {} vs {want}",
                    a_qk[i * c + j]
                );
            }
            let acc: f64 = (0..i).map(|j| bh[i] * pair(&kh, i, j) * u_ref[j]).sum();
            u_ref[i] = bh[i] * vh[i] - acc;
        }
        for (i, (got, want)) in host(out.u).iter().zip(&u_ref).enumerate() {
            assert!((got - want).abs() < 1e-4, "U[{i}] = {got} vs {want}");
        }
    }

    #[test]
    fn reverse_cumsum_sums_the_suffix() {
        let device = Default::default();
        let x = Tensor::<B, 2>::from_floats([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], &device);
        reverse_cumsum(x, 1).into_data().assert_eq(
            &TensorData::from([[6.0f32, 5.0, 3.0], [15.0, 11.0, 6.0]]),
            false,
        );
    }
}
