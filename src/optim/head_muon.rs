//! Muon with per-head (block) orthogonalisation (design §8, per head), as a Burn `SimpleOptimizer`.
//!
//! Burn's own `Muon` handles whole 2-D matrices; this one adds what it lacks: orthogonalising each
//! head block of a projection on its own, and stacked (≥3-D) weights as a batch of matrices.
//! Momentum and its saved state are Burn's (`Momentum`, `MuonState`), so records look alike.

use burn::optim::momentum::{Momentum, MomentumConfig};
use burn::optim::{LearningRate, MuonState, SimpleOptimizer};
use burn::tensor::{backend::Backend, Tensor};

use super::newton_schulz::newton_schulz_batched;
use super::roles::HeadSplit;
use crate::ops::optim::scaled_sum;

/// The Moonlight scale `0.2·sqrt(max(A, B))` of an `[A, B]` matrix (or block), which matches the
/// update RMS of AdamW so both groups can share a learning rate (design §8).
pub fn moonlight_scale(rows: usize, cols: usize) -> f64 {
    0.2 * (rows.max(cols) as f64).sqrt()
}

/// The Muon update direction of `m` (any rank ≥ 1; the last two dims are the matrix, leading dims
/// a batch, a 1-D tensor is one row): `0.2·sqrt(max(A, B))·NS(block)` for every block.
///
/// With `split = None` the blocks are the whole matrices; with a [`HeadSplit`] each matrix is cut
/// into its head blocks, each block is orthogonalised on its own and they are put back in place.
/// Reconstruction (design §8): the scale uses the block's own `[A, B]`. A split that does not
/// divide the matrix falls back to the whole matrix ([`super::ParamRoles::validate`] rejects it
/// up front).
///
/// `m: [..., rows, cols]` → `[..., rows, cols]`.
pub fn orthogonalised_update<B: Backend, const D: usize>(
    m: Tensor<B, D>,
    split: Option<HeadSplit>,
    ns_steps: usize,
) -> Tensor<B, D> {
    if D == 0 {
        return m;
    }
    let dims = m.dims();
    let blocking = Blocking::new(&dims, split);
    let [rows, cols] = blocking.block;
    let blocks = newton_schulz_batched(blocking.cut(m.reshape(blocking.stack)), ns_steps)
        .mul_scalar(moonlight_scale(rows, cols));
    blocking.join(blocks).reshape(dims)
}

/// How a parameter of shape `[..., rows, cols]` is cut into the matrices Muon orthogonalises one
/// by one (its head blocks, or its whole matrices), and put back together.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Blocking {
    /// The parameter as a stack of matrices: `[batch, rows, cols]` (a 1-D tensor is one row).
    pub stack: [usize; 3],
    /// The split that applies (`None` when there is none, or when it does not divide the matrix).
    split: Option<HeadSplit>,
    /// The shape of one block.
    pub block: [usize; 2],
}

impl Blocking {
    /// The blocking of a parameter of shape `dims` (rank ≥ 1) under `split`.
    pub fn new(dims: &[usize], split: Option<HeadSplit>) -> Self {
        let (rows, cols) = match dims {
            [] => (1, 1),
            [n] => (1, *n),
            [.., r, c] => (*r, *c),
        };
        let batch = dims.iter().product::<usize>() / (rows * cols).max(1);
        let resolved = split.and_then(|s| s.block_shape(rows, cols).map(|b| (s, b)));
        Self {
            stack: [batch, rows, cols],
            split: resolved.map(|(s, _)| s),
            block: resolved.map_or([rows, cols], |(_, b)| b),
        }
    }

    /// The number of blocks.
    pub fn count(&self) -> usize {
        self.stack[0] * self.split.map_or(1, |s| s.heads())
    }

    /// `[batch, rows, cols]` → the blocks `[count, block_rows, block_cols]`.
    pub fn cut<B: Backend>(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, rows, _] = self.stack;
        let [br, bc] = self.block;
        match self.split {
            None => x,
            // Row blocks are contiguous in row-major order: a reshape is the split.
            Some(HeadSplit::Rows { .. }) => x.reshape([self.count(), br, bc]),
            Some(HeadSplit::Columns { heads }) => x
                .reshape([batch, rows, heads, bc])
                .swap_dims(1, 2)
                .reshape([self.count(), br, bc]),
        }
    }

    /// The inverse of [`Self::cut`]: blocks `[count, block_rows, block_cols]` → `[batch, rows, cols]`.
    pub fn join<B: Backend>(&self, blocks: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, rows, _] = self.stack;
        let [_, bc] = self.block;
        match self.split {
            None => blocks,
            Some(HeadSplit::Rows { .. }) => blocks.reshape(self.stack),
            Some(HeadSplit::Columns { heads }) => blocks
                .reshape([batch, heads, rows, bc])
                .swap_dims(1, 2)
                .reshape(self.stack),
        }
    }
}

/// `W ← W(1 − ηλ) − η·U`: Muon's step with its orthogonalised, scaled update `U`; the decoupled
/// decay uses the unscaled rate, as in Burn's `Muon` and Moonlight.
pub(crate) fn apply_update<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    update: Tensor<B, D>,
    lr: LearningRate,
    weight_decay: f32,
) -> Tensor<B, D> {
    // `W·(1 − ηλ) − U·η` as one fused op on the CubeCL backends; the tensor ops elsewhere, which
    // skip the decay's product when it is exactly 1.
    scaled_sum(tensor, 1.0 - lr * f64::from(weight_decay), update, -lr)
}

/// Muon over head blocks (or stacked matrices): `M ← μM + G` (Nesterov optional),
/// `W ← W(1 − ηλ) − η·U` with `U` = [`orthogonalised_update`]`(M)` (design §8).
#[derive(Clone)]
pub struct HeadMuon<B: Backend> {
    momentum: Momentum<B>,
    split: Option<HeadSplit>,
    ns_steps: usize,
    weight_decay: f32,
}

impl<B: Backend> HeadMuon<B> {
    /// Muon with momentum `μ` (no dampening), `ns_steps` Newton–Schulz steps, decoupled weight
    /// decay `λ`, orthogonalising the blocks of `split` (whole matrices for `None`).
    ///
    /// `λ` is an `f32` like Burn's `WeightDecayConfig`, so that both Muon paths decay alike.
    pub fn new(
        momentum: f64,
        nesterov: bool,
        ns_steps: usize,
        weight_decay: f32,
        split: Option<HeadSplit>,
    ) -> Self {
        Self {
            momentum: Momentum::new(&MomentumConfig {
                momentum,
                dampening: 0.0,
                nesterov,
            }),
            split,
            ns_steps,
            weight_decay,
        }
    }

    /// The head split this optimiser applies.
    pub fn split(&self) -> Option<HeadSplit> {
        self.split
    }
}

impl<B: Backend> SimpleOptimizer<B> for HeadMuon<B> {
    type State<const D: usize> = MuonState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let (m, momentum) = self.momentum.transform(grad, state.map(|s| s.momentum));
        let update = orthogonalised_update(m, self.split, self.ns_steps);
        (
            apply_update(tensor, update, lr, self.weight_decay),
            Some(MuonState::new(momentum)),
        )
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn moonlight_scale_uses_the_larger_side() {
        assert!((moonlight_scale(1024, 512) - 6.4).abs() < 1e-12);
        assert!((moonlight_scale(16, 64) - 1.6).abs() < 1e-12);
    }

    #[test]
    fn a_vector_is_one_normalised_row() {
        // A rank-1 row: NS keeps its direction, the scale is 0.2·sqrt(n).
        let device = Default::default();
        let v = vec![3.0f32, -4.0, 0.0, 12.0];
        let x = Tensor::<NdArray<f32>, 1>::from_data(TensorData::new(v.clone(), [4]), &device);
        let out: Vec<f32> = orthogonalised_update(x, None, 5)
            .into_data()
            .iter::<f32>()
            .collect();
        let ratio: Vec<f32> = out.iter().zip(&v).map(|(o, v)| o / v).collect();
        assert!(out[2] == 0.0 && (ratio[0] - ratio[1]).abs() < 1e-6 && ratio[0] > 0.0);
        assert!((ratio[0] - ratio[3]).abs() < 1e-6);
    }
}
