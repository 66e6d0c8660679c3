//! Checkpoint names of Kimi Delta Attention (design §7, prefix `model.layers.{i}.self_attn.`).

use burn::tensor::backend::Backend;

use super::{HfCheckpoint, Loader, Saver};
use crate::nn::KimiDeltaAttention;

impl<B: Backend> HfCheckpoint<B> for KimiDeltaAttention<B> {
    /// `{q,k,v}_proj`, `{q,k,v}_conv1d [P, 1, W]`, `f_a_proj`, `f_b_proj`, `A_log [1, 1, H, 1]`,
    /// `dt_bias [H·K]`, `b_proj`, `g_a_proj`/`g_b_proj` (Kimi-Linear) or `g_proj` (K3), `o_norm`,
    /// `o_proj`; linear and norm weights end in `.weight`.
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        let name = |n: &str| format!("{prefix}{n}.weight");
        self.q_proj = l.linear(&name("q_proj"), self.q_proj);
        self.k_proj = l.linear(&name("k_proj"), self.k_proj);
        self.v_proj = l.linear(&name("v_proj"), self.v_proj);
        for (conv, n) in [
            (&mut self.q_conv1d, "q_conv1d"),
            (&mut self.k_conv1d, "k_conv1d"),
            (&mut self.v_conv1d, "v_conv1d"),
        ] {
            let [p, w] = conv.weight.dims();
            conv.weight = l.param(&name(n), conv.weight.clone(), &[p, 1, w]);
        }
        self.f_a_proj = l.linear(&name("f_a_proj"), self.f_a_proj);
        self.f_b_proj = l.linear(&name("f_b_proj"), self.f_b_proj);
        let h = self.num_heads;
        self.a_log = l.param(&format!("{prefix}A_log"), self.a_log, &[1, 1, h, 1]);
        self.dt_bias = l.same(&format!("{prefix}dt_bias"), self.dt_bias);
        self.b_proj = l.linear(&name("b_proj"), self.b_proj);
        self.g_a_proj = self.g_a_proj.map(|g| l.linear(&name("g_a_proj"), g));
        self.g_b_proj = self.g_b_proj.map(|g| l.linear(&name("g_b_proj"), g));
        self.g_proj = self.g_proj.map(|g| l.linear(&name("g_proj"), g));
        self.o_norm = self.o_norm.load_hf(&format!("{prefix}o_norm."), l);
        self.o_proj = l.linear(&name("o_proj"), self.o_proj);
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        let name = |n: &str| format!("{prefix}{n}.weight");
        s.linear(&name("q_proj"), &self.q_proj);
        s.linear(&name("k_proj"), &self.k_proj);
        s.linear(&name("v_proj"), &self.v_proj);
        for (conv, n) in [
            (&self.q_conv1d, "q_conv1d"),
            (&self.k_conv1d, "k_conv1d"),
            (&self.v_conv1d, "v_conv1d"),
        ] {
            let [p, w] = conv.weight.dims();
            s.tensor(&name(n), conv.weight.val(), &[p, 1, w]);
        }
        s.linear(&name("f_a_proj"), &self.f_a_proj);
        s.linear(&name("f_b_proj"), &self.f_b_proj);
        s.tensor(
            &format!("{prefix}A_log"),
            self.a_log.val(),
            &[1, 1, self.num_heads, 1],
        );
        s.same(&format!("{prefix}dt_bias"), &self.dt_bias);
        s.linear(&name("b_proj"), &self.b_proj);
        for (g, n) in [
            (&self.g_a_proj, "g_a_proj"),
            (&self.g_b_proj, "g_b_proj"),
            (&self.g_proj, "g_proj"),
        ] {
            if let Some(g) = g {
                s.linear(&name(n), g);
            }
        }
        self.o_norm.save_hf(&format!("{prefix}o_norm."), s);
        s.linear(&name("o_proj"), &self.o_proj);
    }
}
