//! Which optimiser each parameter gets (design §8): Muon (whole matrix or per head) or AdamW.

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a projection weight splits into per-head blocks for Muon (design §8, per head).
///
/// The matrix is the last two dims of the weight, in Burn's `[d_in, d_out]` layout; leading dims
/// (stacked experts) are a batch of such matrices. Blocks are equal and contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum HeadSplit {
    /// `heads` blocks of `d_out / heads` consecutive columns: the Q, K and V projections, whose
    /// outputs are laid out head after head.
    Columns {
        /// Number of heads.
        heads: usize,
    },
    /// `heads` blocks of `d_in / heads` consecutive rows: a projection that reads heads, such as
    /// the attention output projection.
    Rows {
        /// Number of heads.
        heads: usize,
    },
}

impl HeadSplit {
    /// `heads` blocks of columns (Q, K, V projections).
    pub fn columns(heads: usize) -> Self {
        Self::Columns { heads }
    }

    /// `heads` blocks of rows.
    pub fn rows(heads: usize) -> Self {
        Self::Rows { heads }
    }

    /// Number of heads (blocks).
    pub fn heads(&self) -> usize {
        match *self {
            Self::Columns { heads } | Self::Rows { heads } => heads,
        }
    }

    /// The `[rows, cols]` of one block of a `[rows, cols]` matrix, or `None` when the split
    /// dimension is not a positive multiple of `heads`.
    pub fn block_shape(&self, rows: usize, cols: usize) -> Option<[usize; 2]> {
        let heads = self.heads();
        let (split, block) = match self {
            Self::Columns { .. } => (cols, [rows, cols / heads.max(1)]),
            Self::Rows { .. } => (rows, [rows / heads.max(1), cols]),
        };
        (heads > 0 && split > 0 && split.is_multiple_of(heads)).then_some(block)
    }
}

/// The optimiser of one parameter (design §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ParamRole {
    /// Muon: momentum, Newton–Schulz orthogonalisation, the Moonlight `0.2·sqrt(max(A, B))`
    /// scale; for ≥2-D hidden matrices (attention, FFN, experts, latent projections).
    Muon {
        /// `None`: the whole matrix (each matrix of a stacked ≥3-D weight on its own).
        /// `Some`: each head's block on its own (K3's Q, K, V projections).
        heads: Option<HeadSplit>,
    },
    /// AdamW: embeddings, lm_head, every 1-D tensor, depthwise conv kernels, biases.
    AdamW,
}

impl ParamRole {
    /// Muon on the whole matrix.
    pub const MUON: Self = Self::Muon { heads: None };

    /// Muon on each head block of `split` separately.
    pub fn muon_per_head(split: HeadSplit) -> Self {
        Self::Muon { heads: Some(split) }
    }
}

/// A map `ParamId → ParamRole`; parameters not in the map get [`ParamRole::AdamW`].
///
/// The model's own visitor will provide the design §8 grouping; [`ParamRoles::from_module`] is the
/// generic default and [`ParamRoles::with`] overrides single parameters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamRoles {
    roles: HashMap<ParamId, ParamRole>,
}

impl ParamRoles {
    /// An empty map: AdamW for everything (`--optimiser adamw`).
    pub fn adamw_only() -> Self {
        Self::default()
    }

    /// The default grouping of any module: every trainable float parameter with ≥ 2 dims gets
    /// whole-matrix Muon, every 1-D one AdamW. Tensors that do not require a gradient (buffers
    /// such as the MoE balance bias, a `RunningState`) are left out: they never have a gradient,
    /// so no optimiser ever touches them.
    ///
    /// Embeddings and the lm_head are matrices too; design §8 gives them to AdamW, so override them
    /// with [`ParamRoles::with`] (the model's visitor does).
    pub fn from_module<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Self {
        let mut roles = Self::default();
        for p in collect_params(module) {
            if p.trainable {
                let role = if p.shape.len() >= 2 {
                    ParamRole::MUON
                } else {
                    ParamRole::AdamW
                };
                roles.roles.insert(p.id, role);
            }
        }
        roles
    }

    /// Sets the role of parameter `id` (builder style).
    pub fn with(mut self, id: ParamId, role: ParamRole) -> Self {
        self.set(id, role);
        self
    }

    /// Sets the role of parameter `id`.
    pub fn set(&mut self, id: ParamId, role: ParamRole) {
        self.roles.insert(id, role);
    }

    /// The role of parameter `id` ([`ParamRole::AdamW`] when it is not in the map).
    pub fn get(&self, id: ParamId) -> ParamRole {
        self.roles.get(&id).copied().unwrap_or(ParamRole::AdamW)
    }

    /// The explicitly assigned roles.
    pub fn iter(&self) -> impl Iterator<Item = (ParamId, ParamRole)> + '_ {
        self.roles.iter().map(|(&id, &role)| (id, role))
    }

    /// Number of explicitly assigned roles.
    pub fn len(&self) -> usize {
        self.roles.len()
    }

    /// Whether no role is assigned (everything AdamW).
    pub fn is_empty(&self) -> bool {
        self.roles.is_empty()
    }

    /// Checks the map against `module`: every id names a float parameter of the module, Muon
    /// roles sit on ≥2-D parameters, and each head split divides its dimension.
    pub fn validate<B: Backend, M: Module<B>>(&self, module: &M) -> Result<()> {
        let shapes: HashMap<ParamId, Vec<usize>> = collect_params(module)
            .into_iter()
            .map(|p| (p.id, p.shape))
            .collect();
        let mut problems = Vec::new();
        for (&id, role) in &self.roles {
            let Some(shape) = shapes.get(&id) else {
                problems.push(format!(
                    "{id}: no float parameter with this id in the module"
                ));
                continue;
            };
            let ParamRole::Muon { heads } = role else {
                continue;
            };
            if shape.len() < 2 {
                problems.push(format!(
                    "{id}: Muon needs a matrix, the parameter has shape {shape:?}"
                ));
                continue;
            }
            let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            if let Some(split) = heads {
                if split.block_shape(rows, cols).is_none() {
                    problems.push(format!(
                        "{id}: {split:?} does not divide the [{rows}, {cols}] matrix of shape \
                         {shape:?} into equal blocks"
                    ));
                }
            }
        }
        if problems.is_empty() {
            return Ok(());
        }
        problems.sort();
        Err(Error::argument("param_roles", problems.join("; ")))
    }
}

/// What the role map needs to know about one float parameter.
struct ParamInfo {
    id: ParamId,
    shape: Vec<usize>,
    trainable: bool,
}

struct ParamCollector {
    params: Vec<ParamInfo>,
}

impl<B: Backend> ModuleVisitor<B> for ParamCollector {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.params.push(ParamInfo {
            id: param.id,
            shape: param.lazy_shape().to_vec(),
            // Only meaningful on an autodiff backend; `from_module` requires one.
            trainable: param.val().is_require_grad(),
        });
    }
}

fn collect_params<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamInfo> {
    let mut collector = ParamCollector { params: Vec::new() };
    module.visit(&mut collector);
    collector.params
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_shapes_split_the_right_dimension() {
        assert_eq!(HeadSplit::columns(4).block_shape(16, 32), Some([16, 8]));
        assert_eq!(HeadSplit::rows(4).block_shape(16, 32), Some([4, 32]));
        assert_eq!(HeadSplit::columns(3).block_shape(16, 32), None);
        assert_eq!(HeadSplit::rows(0).block_shape(16, 32), None);
        assert_eq!(HeadSplit::columns(5).heads(), 5);
    }
}
