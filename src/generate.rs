//! Incremental generation: prefill the prompt through a [`KimiCache`], then decode one token at a
//! time, greedily or by temperature / nucleus (top-p) sampling on the host.

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
}

impl Sampling {
    fn validate(&self) -> Result<()> {
        if let Self::TopP {
            temperature, top_p, ..
        } = *self
        {
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
    match sampling {
        Sampling::Greedy => argmax(),
        Sampling::TopP {
            temperature, top_p, ..
        } => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut probs: Vec<(f64, usize)> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| ((((l - max) / temperature) as f64).exp(), i))
                .collect();
            let total: f64 = probs.iter().map(|p| p.0).sum();
            probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
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

impl<B: Backend> KimiForCausalLM<B> {
    /// Continues `prompt: [B, T]` by `max_new_tokens` tokens: one prefill pass over the prompt,
    /// then one cached decode step per new token. Returns `[B, T + max_new_tokens]`.
    pub fn generate(
        &self,
        prompt: Tensor<B, 2, Int>,
        max_new_tokens: usize,
        sampling: Sampling,
    ) -> Result<Tensor<B, 2, Int>> {
        sampling.validate()?;
        let [batch, prompt_len] = prompt.dims();
        let device = prompt.device();
        // The crate's own generator: a seed names the same samples whatever the dependencies.
        let mut rng = SeededRng::new(match sampling {
            Sampling::TopP { seed, .. } => seed,
            Sampling::Greedy => 0,
        });
        let mut cache = KimiCache::with_capacity(self.config(), prompt_len + max_new_tokens);
        let mut out = vec![prompt.clone()];
        let mut input = prompt;
        for _ in 0..max_new_tokens {
            let logits = self.try_forward(input, None, Some(&mut cache))?.logits;
            let [_, t, vocab] = logits.dims();
            let last: Vec<f32> = logits
                .narrow(1, t - 1, 1)
                .into_data()
                .iter::<f32>()
                .collect();
            let next: Vec<i64> = last
                .chunks_exact(vocab)
                .map(|row| pick(row, sampling, &mut rng))
                .collect();
            input = Tensor::from_data(TensorData::new(next, [batch, 1]), &device);
            out.push(input.clone());
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
}
