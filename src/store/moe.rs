//! Checkpoint names of the FFN side (design §7): dense `mlp.*`, and `block_sparse_moe.*` with the
//! router, the balance bias, routed and shared experts and the K3 latent projections.

use burn::tensor::backend::Backend;

use super::{HfCheckpoint, Loader, Saver};
use crate::nn::{LatentMoe, RmsNorm, SituGlu};

/// The three projection names of a GLU FFN: gate, up, down.
pub(crate) type GluNames = [&'static str; 3];
/// Dense and shared FFNs: `gate_proj`, `up_proj`, `down_proj`.
pub(crate) const PROJ_NAMES: GluNames = ["gate_proj", "up_proj", "down_proj"];
/// Routed experts: `w1` (gate), `w3` (up), `w2` (down).
pub(crate) const EXPERT_NAMES: GluNames = ["w1", "w3", "w2"];

pub(crate) fn load_glu<B: Backend>(
    mut glu: SituGlu<B>,
    prefix: &str,
    names: GluNames,
    l: &mut Loader<'_, B>,
) -> SituGlu<B> {
    glu.w1 = l.linear(&format!("{prefix}{}.weight", names[0]), glu.w1);
    glu.w3 = l.linear(&format!("{prefix}{}.weight", names[1]), glu.w3);
    glu.w2 = l.linear(&format!("{prefix}{}.weight", names[2]), glu.w2);
    glu
}

/// Saves the three projections; packed as MX when the saver packs and the FFN trains its weights
/// with MX QAT.
pub(crate) fn save_glu<B: Backend>(glu: &SituGlu<B>, prefix: &str, names: GluNames, s: &mut Saver) {
    let pack = glu.qat.and_then(|q| q.weights).filter(|_| s.packs_mx());
    for (name, layer) in names.iter().zip([&glu.w1, &glu.w3, &glu.w2]) {
        let name = format!("{prefix}{name}.weight");
        match pack {
            Some(spec) => s.mx_linear(&name, layer, spec),
            None => s.linear(&name, layer),
        }
    }
}

/// `{prefix}experts.{e}.{w1,w3,w2}.weight` for every expert, grouped by projection.
fn expert_names(prefix: &str, n: usize) -> [Vec<String>; 3] {
    EXPERT_NAMES.map(|w| {
        (0..n)
            .map(|e| format!("{prefix}experts.{e}.{w}.weight"))
            .collect()
    })
}

impl<B: Backend> HfCheckpoint<B> for RmsNorm<B> {
    /// `{prefix}weight`.
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        self.weight = l.same(&format!("{prefix}weight"), self.weight);
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        s.same(&format!("{prefix}weight"), &self.weight);
    }
}

impl<B: Backend> HfCheckpoint<B> for LatentMoe<B> {
    /// Names under `prefix` (normally `model.layers.{i}.block_sparse_moe.`): `gate.weight [n, d]`,
    /// `gate.e_score_correction_bias [n]`, `experts.{e}.{w1,w3,w2}.weight`,
    /// `shared_experts.{gate,up,down}_proj.weight`, and for latent layouts
    /// `routed_expert_down_proj.weight`, `routed_expert_norm.weight`, `routed_expert_up_proj.weight`.
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        self.router.gate = l.linear(&format!("{prefix}gate.weight"), self.router.gate);
        let n = self.experts.len();
        if let Some(bias) = l.vector(&format!("{prefix}gate.e_score_correction_bias"), n) {
            self.balance.set_bias(&bias);
        }
        let names = expert_names(prefix, n);
        self.experts.w1 = l.stacked_linear(&names[0], self.experts.w1);
        self.experts.w3 = l.stacked_linear(&names[1], self.experts.w3);
        self.experts.w2 = l.stacked_linear(&names[2], self.experts.w2);
        self.shared = self
            .shared
            .map(|g| load_glu(g, &format!("{prefix}shared_experts."), PROJ_NAMES, l));
        self.down = self
            .down
            .map(|d| l.linear(&format!("{prefix}routed_expert_down_proj.weight"), d));
        self.norm = self
            .norm
            .map(|n| n.load_hf(&format!("{prefix}routed_expert_norm."), l));
        self.up = self
            .up
            .map(|u| l.linear(&format!("{prefix}routed_expert_up_proj.weight"), u));
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        s.linear(&format!("{prefix}gate.weight"), &self.router.gate);
        s.vector(
            &format!("{prefix}gate.e_score_correction_bias"),
            self.balance.bias_host(),
        );
        let ex = &self.experts;
        let pack = ex.qat.and_then(|q| q.weights).filter(|_| s.packs_mx());
        let names = expert_names(prefix, ex.len());
        for (names, w) in names.iter().zip([&ex.w1, &ex.w3, &ex.w2]) {
            s.stacked_linear(names, w.val(), pack);
        }
        if let Some(g) = &self.shared {
            save_glu(g, &format!("{prefix}shared_experts."), PROJ_NAMES, s);
        }
        if let Some(d) = &self.down {
            s.linear(&format!("{prefix}routed_expert_down_proj.weight"), d);
        }
        if let Some(n) = &self.norm {
            n.save_hf(&format!("{prefix}routed_expert_norm."), s);
        }
        if let Some(u) = &self.up {
            s.linear(&format!("{prefix}routed_expert_up_proj.weight"), u);
        }
    }
}
