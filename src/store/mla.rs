//! Checkpoint names of Gated MLA (design §7, prefix `model.layers.{i}.self_attn.`) and of the AttnRes
//! pseudo-queries.

use burn::tensor::backend::Backend;

use super::{HfCheckpoint, Loader, Saver};
use crate::nn::{AttnResMix, GatedMla};

impl<B: Backend> HfCheckpoint<B> for GatedMla<B> {
    /// `q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa [r + dr, d]`,
    /// `kv_a_layernorm [r]`, `kv_b_proj [H·(dn + dv), r]` (rows per head: k_nope then v), `o_proj`,
    /// and `g_proj` when the output gate is on; every name ends in `.weight`.
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        let name = |n: &str| format!("{prefix}{n}.weight");
        self.q_proj = self.q_proj.map(|q| l.linear(&name("q_proj"), q));
        self.q_a_proj = self.q_a_proj.map(|q| l.linear(&name("q_a_proj"), q));
        self.q_a_layernorm = self
            .q_a_layernorm
            .map(|n| n.load_hf(&format!("{prefix}q_a_layernorm."), l));
        self.q_b_proj = self.q_b_proj.map(|q| l.linear(&name("q_b_proj"), q));
        self.kv_a_proj_with_mqa = l.linear(&name("kv_a_proj_with_mqa"), self.kv_a_proj_with_mqa);
        self.kv_a_layernorm = self
            .kv_a_layernorm
            .load_hf(&format!("{prefix}kv_a_layernorm."), l);
        self.kv_b_proj = l.linear(&name("kv_b_proj"), self.kv_b_proj);
        self.o_proj = l.linear(&name("o_proj"), self.o_proj);
        self.g_proj = self.g_proj.map(|g| l.linear(&name("g_proj"), g));
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        let name = |n: &str| format!("{prefix}{n}.weight");
        if let Some(q) = &self.q_proj {
            s.linear(&name("q_proj"), q);
        }
        if let Some(q) = &self.q_a_proj {
            s.linear(&name("q_a_proj"), q);
        }
        if let Some(n) = &self.q_a_layernorm {
            n.save_hf(&format!("{prefix}q_a_layernorm."), s);
        }
        if let Some(q) = &self.q_b_proj {
            s.linear(&name("q_b_proj"), q);
        }
        s.linear(&name("kv_a_proj_with_mqa"), &self.kv_a_proj_with_mqa);
        self.kv_a_layernorm
            .save_hf(&format!("{prefix}kv_a_layernorm."), s);
        s.linear(&name("kv_b_proj"), &self.kv_b_proj);
        s.linear(&name("o_proj"), &self.o_proj);
        if let Some(g) = &self.g_proj {
            s.linear(&name("g_proj"), g);
        }
    }
}

/// One AttnRes pseudo-query pair, saved under a stem such as `model.layers.{i}.self_attention_res`:
/// `{stem}_proj.weight [1, d]` (a bias-free `Linear(d, 1)` in the reference, reconstruction) and
/// `{stem}_norm.weight [d]`. The `prefix` passed to [`HfCheckpoint`] is that stem.
impl<B: Backend> HfCheckpoint<B> for AttnResMix<B> {
    fn load_hf(mut self, stem: &str, l: &mut Loader<'_, B>) -> Self {
        let d = self.proj.dims()[0];
        self.proj = l.param(&format!("{stem}_proj.weight"), self.proj, &[1, d]);
        self.norm = l.same(&format!("{stem}_norm.weight"), self.norm);
        self
    }

    fn save_hf(&self, stem: &str, s: &mut Saver) {
        let d = self.proj.dims()[0];
        s.tensor(&format!("{stem}_proj.weight"), self.proj.val(), &[1, d]);
        s.same(&format!("{stem}_norm.weight"), &self.norm);
    }
}
