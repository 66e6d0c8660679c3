//! Incremental generation: prefill the prompt through a [`KimiCache`], then decode one token at a
//! time, greedily or by temperature / top-k / nucleus (top-p) sampling, optionally streaming each
//! step's tokens to a callback and stopping at end-of-sequence tokens.
//!
//! Where the token is picked ([`Sampling::pick_rows`]): greedily, on the device on the GPU
//! backends, so that a step reads back only its `[batch]` token ids, not the `[batch, vocab]`
//! logits (the decode step itself reads nothing); sampling on the host from the logits, or on
//! the device with [`GenerateOptions::sample_on_device`]; on the CPU backends always on the host
//! (ndarray's logits read in place). Both follow one rule ([`Sampling::pick`]) and pick the same
//! token from the same logits and seed, up to f32 rounding at a boundary.
//!
//! A QAT model fake-quantises its experts' weights on every forward; call
//! [`with_quantized_weights`](KimiForCausalLM::with_quantized_weights) once before generating
//! so that a decode step does not pass over every expert's weights.

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::data::SeededRng;
use crate::error::Result;
use crate::model::{KimiCache, KimiForCausalLM};

mod sampling;

pub use sampling::Sampling;

/// The most new tokens a generation allocates its MLA caches for up front; beyond them the caches
/// grow by doubling, so a generation bounded only by its stop tokens (`max_new_tokens =
/// usize::MAX`) allocates what it uses.
const PREALLOCATED_NEW_TOKENS: usize = 4096;

/// What [`KimiForCausalLM::generate_stream`] generates.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// At most this many new tokens per sequence (`usize::MAX`: until every sequence has met a
    /// stop token).
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Tokens that end a sequence (its end-of-sequence ids); empty: none.
    pub stop_tokens: Vec<i64>,
    /// Sample on the device on the GPU backends, reading back only the ids (greedy always
    /// does); off by default, see [`Sampling::pick_rows`] for why.
    pub sample_on_device: bool,
}

impl GenerateOptions {
    /// `max_new_tokens` greedy tokens, no stop token.
    pub fn new(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::Greedy,
            stop_tokens: Vec::new(),
            sample_on_device: false,
        }
    }

    /// With `sampling`.
    pub fn with_sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// Ending a sequence at any of `stop_tokens`.
    pub fn with_stop_tokens(mut self, stop_tokens: Vec<i64>) -> Self {
        self.stop_tokens = stop_tokens;
        self
    }

    /// Sampling on the device or not ([`sample_on_device`](Self::sample_on_device)).
    pub fn with_sampling_on_device(mut self, on: bool) -> Self {
        self.sample_on_device = on;
        self
    }
}

impl<B: Backend> KimiForCausalLM<B> {
    /// Continues `prompt: [B, T]` by `max_new_tokens` tokens: one prefill pass over the prompt,
    /// then one cached decode step per new token. Returns `[B, T + max_new_tokens]`.
    pub fn generate(
        &self,
        prompt: Tensor<B, 2, Int>,
        max_new_tokens: usize,
        sampling: Sampling,
    ) -> Result<Tensor<B, 2, Int>> {
        let options = GenerateOptions::new(max_new_tokens).with_sampling(sampling);
        // On the CPU backends the whole generation runs on rayon's pool as one piece; a stream's
        // callback may not be `Send`, so `generate_stream` moves each step there instead.
        crate::ops::backend::on_cpu_pool::<B, _>(|| {
            self.generate_stream(prompt, &options, |_| true)
        })
    }

    /// [`generate`](Self::generate), streaming: after each step (the first is the prefill),
    /// `on_step` gets that step's new token of every sequence and returns whether to go on. A
    /// sequence that produced one of `stop_tokens` has ended: it is padded with that token from
    /// then on, and generation stops once every sequence has ended (or after `max_new_tokens`,
    /// or when `on_step` says so). Returns the prompt and every generated token,
    /// `[B, T + steps]`.
    ///
    /// On the CPU backends each step runs on rayon's pool
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)) and `on_step` on the calling thread;
    /// call this inside `on_cpu_pool` (with a `Send` callback) to run the whole generation there,
    /// as [`generate`](Self::generate) does.
    pub fn generate_stream(
        &self,
        prompt: Tensor<B, 2, Int>,
        options: &GenerateOptions,
        mut on_step: impl FnMut(&[i64]) -> bool,
    ) -> Result<Tensor<B, 2, Int>> {
        let sampling = options.sampling;
        sampling.validate()?;
        let [batch, prompt_len] = prompt.dims();
        let device = prompt.device();
        // The crate's own generator: a seed names the same samples whatever the dependencies.
        let mut rng = SeededRng::new(sampling.parts().map_or(0, |p| p.3));
        // The MLA caches are allocated for the prompt and up to PREALLOCATED_NEW_TOKENS new
        // tokens; a longer generation (or `usize::MAX`: until every sequence stops) grows them.
        let capacity =
            prompt_len.saturating_add(options.max_new_tokens.min(PREALLOCATED_NEW_TOKENS));
        let mut cache = KimiCache::with_capacity(self.config(), capacity);
        let mut ended: Vec<Option<i64>> = vec![None; batch];
        let mut out = vec![prompt.clone()];
        let mut input = prompt;
        for _ in 0..options.max_new_tokens {
            let logits = self.try_forward(input, None, Some(&mut cache))?.logits;
            let [_, t, vocab] = logits.dims();
            let last = logits.narrow(1, t - 1, 1).reshape([batch, vocab]);
            // One uniform number per sequence still going, drawn in order whichever path picks.
            let u: Vec<f64> = ended
                .iter()
                .map(|end| match (end, sampling) {
                    (None, Sampling::Greedy) | (Some(_), _) => 0.0,
                    (None, _) => rng.unit_f64(),
                })
                .collect();
            let picked = sampling.pick_rows(last, &u, options.sample_on_device)?;
            let next: Vec<i64> = picked
                .into_iter()
                .zip(&mut ended)
                .map(|(id, end)| {
                    // An ended sequence is padded with its stop token.
                    if let Some(stop) = *end {
                        return stop;
                    }
                    if options.stop_tokens.contains(&id) {
                        *end = Some(id);
                    }
                    id
                })
                .collect();
            let go_on = on_step(&next);
            input = Tensor::from_data(TensorData::new(next, [batch, 1]), &device);
            out.push(input.clone());
            if !go_on || ended.iter().all(Option::is_some) {
                break;
            }
        }
        Ok(Tensor::cat(out, 1))
    }
}
