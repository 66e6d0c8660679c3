//! The design §8 optimiser grouping of the Kimi model.

use burn::tensor::backend::AutodiffBackend;

use super::{HeadSplit, ParamRole, ParamRoles};
use crate::model::{KimiForCausalLM, Mixer};

impl<B: AutodiffBackend> KimiForCausalLM<B> {
    /// The design §8 grouping: Muon for every ≥2-D hidden matrix; **per head** for the Q, K and V
    /// projections (KDA `q/k/v_proj` split into `H` column blocks; MLA `q_proj`/`q_b_proj` into `H`
    /// blocks of `dn + dr`, `kv_b_proj` into `H` blocks of `dn + dv`); AdamW for the embedding,
    /// `lm_head`, the depthwise conv kernels and every 1-D tensor (norms, AttnRes vectors, `A_log`,
    /// `dt_bias`). The balance biases are buffers and belong to no optimiser.
    pub fn param_roles(&self) -> ParamRoles {
        let mut roles = ParamRoles::from_module(self);
        roles.set(self.embed_tokens.weight.id, ParamRole::AdamW);
        if let Some(head) = &self.lm_head {
            roles.set(head.weight.id, ParamRole::AdamW);
        }
        for layer in &self.layers {
            match &layer.mixer {
                Mixer::Kda(kda) => {
                    let split = ParamRole::muon_per_head(HeadSplit::columns(kda.num_heads));
                    for proj in [&kda.q_proj, &kda.k_proj, &kda.v_proj] {
                        roles.set(proj.weight.id, split);
                    }
                    for conv in [&kda.q_conv1d, &kda.k_conv1d, &kda.v_conv1d] {
                        roles.set(conv.weight.id, ParamRole::AdamW);
                    }
                }
                Mixer::Mla(mla) => {
                    let split = ParamRole::muon_per_head(HeadSplit::columns(mla.num_heads));
                    for proj in [&mla.q_proj, &mla.q_b_proj].into_iter().flatten() {
                        roles.set(proj.weight.id, split);
                    }
                    roles.set(mla.kv_b_proj.weight.id, split);
                }
            }
        }
        // The routed experts are stacked `[n, in, out]`: Muon takes the leading axis as a batch
        // and orthogonalises each expert's matrix on its own, so the FFNs need no override.
        roles
    }
}
