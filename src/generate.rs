//! Incremental generation: prefill the prompt through a [`KimiCache`], then decode one token at a
//! time, greedily or by temperature / top-k / nucleus (top-p) sampling on the host, optionally
//! streaming each step's tokens to a callback and stopping at end-of-sequence tokens.

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};

use crate::data::SeededRng;
use crate::error::{Error, Result};
use crate::model::{KimiCache, KimiForCausalLM};

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Sampling {
    /// The most likely token (ties: the lower id).
    Greedy,
    /// Sample from `softmax(logits / temperature)` restricted to the smallest set of most likely
    /// tokens whose probability reaches `top_p`.
    TopP {
        /// Softmax temperature, > 0.
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Seed of the sampler.
        seed: u64,
    },
    /// Sample from `softmax(logits / temperature)` restricted to the `top_k` most likely tokens
    /// (all when 0), then to the smallest set of those whose probability reaches `top_p`.
    TopKTopP {
        /// Softmax temperature, > 0.
        temperature: f32,
        /// How many of the most likely tokens stay candidates; 0: all.
        top_k: usize,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Seed of the sampler.
        seed: u64,
    },
}

impl Sampling {
    /// `(temperature, top_k, top_p, seed)` of a sampling rule; `None` for greedy.
    fn parts(self) -> Option<(f32, usize, f32, u64)> {
        match self {
            Self::Greedy => None,
            Self::TopP {
                temperature,
                top_p,
                seed,
            } => Some((temperature, 0, top_p, seed)),
            Self::TopKTopP {
                temperature,
                top_k,
                top_p,
                seed,
            } => Some((temperature, top_k, top_p, seed)),
        }
    }

    fn validate(&self) -> Result<()> {
        if let Some((temperature, _, top_p, _)) = self.parts() {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(Error::argument(
                    "temperature",
                    format!("must be finite and positive, got {temperature}"),
                ));
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(Error::argument(
                    "top_p",
                    format!("must lie in (0, 1], got {top_p}"),
                ));
            }
        }
        Ok(())
    }
}

/// Picks one token from a row of logits.
fn pick(logits: &[f32], sampling: Sampling, rng: &mut SeededRng) -> i64 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as i64
    };
    match sampling.parts() {
        None => argmax(),
        Some((temperature, top_k, top_p, _)) => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut probs: Vec<(f64, usize)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| ((((l - max) / temperature) as f64).exp(), i))
                .collect();
            probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            if top_k > 0 {
                probs.truncate(top_k);
            }
            // The nucleus is taken of the top-k tokens' renormalised distribution.
            let total: f64 = probs.iter().map(|p| p.0).sum();
            let mut kept = 0.0;
            let mut cut = probs.len();
            for (n, p) in probs.iter().enumerate() {
                kept += p.0 / total;
                if kept >= top_p as f64 {
                    cut = n + 1;
                    break;
                }
            }
            let nucleus = &probs[..cut];
            let mass: f64 = nucleus.iter().map(|p| p.0).sum();
            let mut u = rng.unit_f64() * mass;
            for &(p, i) in nucleus {
                if u < p {
                    return i as i64;
                }
                u -= p;
            }
            nucleus.last().map_or_else(argmax, |p| p.1 as i64)
        }
    }
}

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
}

impl GenerateOptions {
    /// `max_new_tokens` greedy tokens, no stop token.
    pub fn new(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: Sampling::Greedy,
            stop_tokens: Vec::new(),
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
            let last = logits.narrow(1, t - 1, 1);
            // On ndarray the last position's logits are read where they lie (Burn's own read
            // walks them element by element: about a twentieth of a tiny model's decode step).
            let last: Vec<f32> = crate::ops::backend::host::read_in_place(&last, <[f32]>::to_vec)
                .unwrap_or_else(|| crate::sync::read(last).iter::<f32>().collect());
            let next: Vec<i64> = last
                .chunks_exact(vocab)
                .zip(&mut ended)
                .map(|(row, end)| {
                    // An ended sequence is padded with its stop token and draws nothing.
                    if let Some(stop) = *end {
                        return stop;
                    }
                    let id = pick(row, sampling, &mut rng);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_keeps_only_the_nucleus_and_greedy_takes_the_first_maximum() {
        let mut rng = SeededRng::new(1);
        let logits = [0.0f32, 3.0, 3.0, 1.0, -2.0];
        assert_eq!(pick(&logits, Sampling::Greedy, &mut rng), 1);
        // Tokens 1 and 2 hold ~0.92 of the mass: with top_p = 0.9 nothing else may appear.
        let s = Sampling::TopP {
            temperature: 1.0,
            top_p: 0.9,
            seed: 1,
        };
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            seen[pick(&logits, s, &mut rng) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3] + seen[4], 0, "{seen:?}");
        assert!(seen[1] > 800 && seen[2] > 800, "{seen:?}");
        // With top_p = 1 the tail shows up, in proportion.
        let s = Sampling::TopP {
            temperature: 1.0,
            top_p: 1.0,
            seed: 1,
        };
        let mut seen = [0usize; 5];
        for _ in 0..20000 {
            seen[pick(&logits, s, &mut rng) as usize] += 1;
        }
        let p3 = (1.0f64).exp() / (1.0 + 2.0 * 3.0f64.exp() + 1.0f64.exp() + (-2.0f64).exp());
        assert!((seen[3] as f64 / 20000.0 - p3).abs() < 0.01, "{seen:?}");
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_then_the_nucleus_of_those() {
        let mut rng = SeededRng::new(2);
        let logits = [0.0f32, 3.0, 2.0, 1.0, -2.0];
        let draw = |top_k, top_p, rng: &mut SeededRng| {
            let s = Sampling::TopKTopP {
                temperature: 1.0,
                top_k,
                top_p,
                seed: 0,
            };
            let mut seen = [0usize; 5];
            for _ in 0..20000 {
                seen[pick(&logits, s, rng) as usize] += 1;
            }
            seen
        };
        // k = 1 is greedy.
        assert_eq!(draw(1, 1.0, &mut rng), [0, 20000, 0, 0, 0]);
        // k = 3: tokens 1, 2, 3 in the proportions of their renormalised probabilities.
        let seen = draw(3, 1.0, &mut rng);
        assert_eq!(seen[0] + seen[4], 0, "{seen:?}");
        let z = 3.0f64.exp() + 2.0f64.exp() + 1.0f64.exp();
        for (i, l) in [(1usize, 3.0f64), (2, 2.0), (3, 1.0)] {
            assert!(
                (seen[i] as f64 / 20000.0 - l.exp() / z).abs() < 0.012,
                "{seen:?}"
            );
        }
        // k = 3 then top_p = 0.9 of those three (0.665 + 0.245 ≥ 0.9): token 3 drops out.
        let seen = draw(3, 0.9, &mut rng);
        assert_eq!(seen[0] + seen[3] + seen[4], 0, "{seen:?}");
        // k = 0 means every token.
        let seen = draw(0, 1.0, &mut rng);
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }
}
