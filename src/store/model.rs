//! Checkpoint names of the whole model (design §7) and the `from_safetensors` / `save_safetensors`
//! entry points.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;

use super::moe::{load_glu, save_glu, PROJ_NAMES};
use super::{HfCheckpoint, Loader, SafeTensorsReader, Saver, StoreDtype};
use crate::config::KimiConfig;
use crate::error::Result;
use crate::model::{DecoderLayer, Ffn, KimiForCausalLM, Mixer};

impl<B: Backend> HfCheckpoint<B> for DecoderLayer<B> {
    /// Under `model.layers.{i}.`: `input_layernorm`, `post_attention_layernorm`, `self_attn.*`,
    /// `mlp.*` (dense) or `block_sparse_moe.*`, and with AttnRes `self_attention_res_{proj,norm}` and
    /// `mlp_res_{proj,norm}`.
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        self.input_layernorm = self
            .input_layernorm
            .load_hf(&format!("{prefix}input_layernorm."), l);
        self.post_attention_layernorm = self
            .post_attention_layernorm
            .load_hf(&format!("{prefix}post_attention_layernorm."), l);
        let attn = format!("{prefix}self_attn.");
        self.mixer = match self.mixer {
            Mixer::Kda(m) => Mixer::Kda(m.load_hf(&attn, l)),
            Mixer::Mla(m) => Mixer::Mla(m.load_hf(&attn, l)),
        };
        self.ffn = match self.ffn {
            Ffn::Dense(g) => Ffn::Dense(load_glu(g, &format!("{prefix}mlp."), PROJ_NAMES, l)),
            Ffn::Moe(m) => Ffn::Moe(m.load_hf(&format!("{prefix}block_sparse_moe."), l)),
        };
        self.attn_res = self
            .attn_res
            .map(|r| r.load_hf(&format!("{prefix}self_attention_res"), l));
        self.mlp_res = self
            .mlp_res
            .map(|r| r.load_hf(&format!("{prefix}mlp_res"), l));
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        self.input_layernorm
            .save_hf(&format!("{prefix}input_layernorm."), s);
        self.post_attention_layernorm
            .save_hf(&format!("{prefix}post_attention_layernorm."), s);
        let attn = format!("{prefix}self_attn.");
        match &self.mixer {
            Mixer::Kda(m) => m.save_hf(&attn, s),
            Mixer::Mla(m) => m.save_hf(&attn, s),
        }
        match &self.ffn {
            Ffn::Dense(g) => save_glu(g, &format!("{prefix}mlp."), PROJ_NAMES, s),
            Ffn::Moe(m) => m.save_hf(&format!("{prefix}block_sparse_moe."), s),
        }
        if let Some(r) = &self.attn_res {
            r.save_hf(&format!("{prefix}self_attention_res"), s);
        }
        if let Some(r) = &self.mlp_res {
            r.save_hf(&format!("{prefix}mlp_res"), s);
        }
    }
}

impl<B: Backend> HfCheckpoint<B> for KimiForCausalLM<B> {
    /// `model.embed_tokens.weight [vocab, d]`, `model.layers.{i}.*`, `model.norm.weight`,
    /// `model.output_attn_res_{proj,norm}` with AttnRes, `lm_head.weight [vocab, d]` unless tied.
    /// The `prefix` is prepended to every name (normally empty).
    fn load_hf(mut self, prefix: &str, l: &mut Loader<'_, B>) -> Self {
        self.embed_tokens.weight = l.same(
            &format!("{prefix}model.embed_tokens.weight"),
            self.embed_tokens.weight,
        );
        self.layers = std::mem::take(&mut self.layers)
            .into_iter()
            .enumerate()
            .map(|(i, layer)| layer.load_hf(&format!("{prefix}model.layers.{i}."), l))
            .collect();
        self.norm = self.norm.load_hf(&format!("{prefix}model.norm."), l);
        self.output_res = self
            .output_res
            .map(|r| r.load_hf(&format!("{prefix}model.output_attn_res"), l));
        self.lm_head = self
            .lm_head
            .map(|h| l.linear(&format!("{prefix}lm_head.weight"), h));
        self
    }

    fn save_hf(&self, prefix: &str, s: &mut Saver) {
        s.same(
            &format!("{prefix}model.embed_tokens.weight"),
            &self.embed_tokens.weight,
        );
        for (i, layer) in self.layers.iter().enumerate() {
            layer.save_hf(&format!("{prefix}model.layers.{i}."), s);
        }
        self.norm.save_hf(&format!("{prefix}model.norm."), s);
        if let Some(r) = &self.output_res {
            r.save_hf(&format!("{prefix}model.output_attn_res"), s);
        }
        if let Some(h) = &self.lm_head {
            s.linear(&format!("{prefix}lm_head.weight"), h);
        }
    }
}

impl<B: Backend> KimiForCausalLM<B> {
    /// Loads a Hugging Face checkpoint of `config`: `path` is a `.safetensors` file or a folder
    /// with `model.safetensors.index.json` (sharded) or `model.safetensors`. Linear weights are
    /// transposed from `[out, in]`, `A_log` and the conv kernels reshaped; bf16, f16 and f32 on
    /// disk are accepted. Every missing, mis-shaped or unexpected tensor is listed, by name and
    /// shape, in one [`Error::Checkpoint`](crate::Error::Checkpoint).
    pub fn from_safetensors(
        config: &KimiConfig,
        path: impl AsRef<Path>,
        device: &B::Device,
    ) -> Result<Self> {
        let reader = SafeTensorsReader::open(path)?;
        // Built without drawing the random values of its large parameters: each is replaced
        // straight from the file.
        let model = crate::nn::skeleton(|| config.try_init::<B>(device))?;
        let mut loader = Loader::new(&reader, device);
        let model = model.load_hf("", &mut loader);
        loader.finish(true)?;
        Ok(model)
    }

    /// Writes the model in the Hugging Face layout as one f32 `.safetensors` file (the balance
    /// biases included, as `e_score_correction_bias`).
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut saver = Saver::new();
        self.save_hf("", &mut saver);
        saver.write(path)
    }

    /// Writes a Hugging Face model folder: `config.json` and the weights, sharded by
    /// `max_shard_bytes` with `model.safetensors.index.json` when they do not fit in one file
    /// (see [`Saver::write_sharded`]), floats in `dtype` (bf16: half the size, rounded; the balance
    /// biases stay f32), the weights trained with MX QAT packed when `packed_mx`. An earlier
    /// save's weight files in `dir` are replaced, not left beside the new ones.
    /// [`from_safetensors`](Self::from_safetensors) on the folder reads it back. Returns the
    /// files written.
    pub fn save_pretrained(
        &self,
        dir: impl AsRef<Path>,
        dtype: StoreDtype,
        max_shard_bytes: u64,
        packed_mx: bool,
    ) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        let mut saver = if packed_mx {
            Saver::packing_mx()
        } else {
            Saver::new()
        };
        self.save_hf("", &mut saver);
        let mut files = saver.write_sharded(dir, dtype, max_shard_bytes)?;
        let config = dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.config().to_hf_json()).map_err(|source| {
            crate::Error::Json {
                path: config.clone(),
                source,
            }
        })?;
        std::fs::write(&config, text).map_err(|source| crate::Error::Io {
            path: config.clone(),
            source,
        })?;
        files.push(config);
        Ok(files)
    }

    /// [`save_safetensors`](Self::save_safetensors) with every weight the model trains with MX
    /// QAT (the routed experts, and the shared experts and dense FFNs when its
    /// [`QatConfig`](crate::ops::quant::QatConfig) says so) packed as MX blocks and E8M0 scales
    /// (layout and names: [`crate::store`]), so a QAT-trained model ships in FP4.
    /// [`from_safetensors`](Self::from_safetensors) reads it back; the dequantised weights are
    /// exactly the fake-quantised ones the model computed with, so its logits are unchanged.
    ///
    /// Errors when a packed weight's input width is not a multiple of 32.
    pub fn save_safetensors_packed(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut saver = Saver::packing_mx();
        self.save_hf("", &mut saver);
        saver.write(path)
    }
}
