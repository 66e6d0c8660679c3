//! How a token is picked from a row of logits ([`Sampling`]): greedily or by temperature /
//! top-k / nucleus sampling, on the host ([`Sampling::pick`]) or on the device
//! ([`Sampling::pick_on_device`]) by one rule; [`Sampling::pick_rows`] chooses where.

use burn::tensor::{backend::Backend, Bool, DType, FloatDType, Int, Tensor, TensorData};

use crate::error::{Error, Result};

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Sampling {
    /// The most likely token (ties: the lower id).
    Greedy,
    /// Sample from `softmax(logits / temperature)` restricted to the smallest set of most likely
    /// tokens whose probability reaches `top_p` (with every token tied with the least likely of
    /// them).
    TopP {
        /// Softmax temperature, > 0.
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
        /// Seed of the sampler.
        seed: u64,
    },
    /// Sample from `softmax(logits / temperature)` restricted to the `top_k` most likely tokens
    /// (all when 0; with every token tied with the `k`-th), then to the smallest set of those
    /// whose probability reaches `top_p` (again with ties).
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
    pub(super) fn parts(self) -> Option<(f32, usize, f32, u64)> {
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

    pub(super) fn validate(&self) -> Result<()> {
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

/// Scaled logits `(l − max) / temperature` are clamped from below at this value before
/// sampling: `exp` of it is 0 in f32, so such tokens are never drawn, and the threshold searches
/// of [`Sampling::pick_on_device`] have a finite range.
const FLOOR: f32 = -110.0;

/// Halvings of the threshold searches on the device. Each brackets a threshold of the scaled
/// logits, which lie in `[FLOOR, 0]`, starting from `[FLOOR − 1, 2⁻¹⁰]`: after 36 halvings to
/// `111 · 2⁻³⁶ ≈ 1.6·10⁻⁹`, or to adjacent floats where those lie further apart. A token that
/// close below a threshold counts as tied with it.
const BISECTIONS: usize = 36;

/// A logit as the sampler sees it: NaN and `−∞` count as the lowest finite f32, so that a row's
/// maximum is finite or `+∞` and a row of nothing else is a tie (on the device too, where Burn's
/// reductions start from that value).
fn sane(l: f32) -> f32 {
    if l.is_nan() {
        f32::MIN
    } else {
        l.max(f32::MIN)
    }
}

/// The index of the largest value (ties: the lower index), after [`sane`].
fn argmax(values: &[f32]) -> usize {
    values
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
            if sane(v) > best.1 {
                (i, sane(v))
            } else {
                best
            }
        })
        .0
}

impl Sampling {
    /// Picks the next token from one row of `logits`, on the host; `u` is a uniform number in
    /// `[0, 1)` (ignored by [`Greedy`](Self::Greedy)).
    ///
    /// The rule, which [`pick_on_device`](Self::pick_on_device) follows too: NaN and `−∞`
    /// logits count as the lowest finite f32; with scaled logits `s = (l − max) / temperature`
    /// (0 for the tokens at the maximum, also when it is `+∞`) and probabilities `p ∝ exp(s)`,
    /// the candidates are the `top_k` most likely tokens and every token tied with the `k`-th
    /// (all tokens when `top_k` is 0 or at least the vocabulary); of those, the nucleus is the
    /// most likely tokens whose probability reaches `top_p` of the candidates' mass, again with
    /// every token tied with the least likely of them. The token is drawn from the nucleus by
    /// inverting its cumulative distribution **in id order** at `u` (the same token as the
    /// device draws for the same `u`, up to f32 rounding at the boundaries). Greedy takes the
    /// first maximum.
    ///
    /// Errors on an invalid sampling rule (a temperature that is not finite and positive, a
    /// `top_p` outside `(0, 1]`) or an empty row.
    pub fn pick(&self, logits: &[f32], u: f64) -> Result<usize> {
        self.validate()?;
        if logits.is_empty() {
            return Err(Error::argument(
                "logits",
                "an empty row has no token to pick",
            ));
        }
        let Some((temperature, top_k, top_p, _)) = self.parts() else {
            return Ok(argmax(logits));
        };
        let max = logits.iter().map(|&l| sane(l)).fold(f32::MIN, f32::max);
        let s: Vec<f32> = logits
            .iter()
            .map(|&l| match sane(l) {
                l if l == max => 0.0,
                l => ((l - max) / temperature).max(FLOOR),
            })
            .collect();
        let p = |v: f32| f64::from(v.exp());
        let mut sorted = s.clone();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let kth = match top_k {
            k if k > 0 && k < sorted.len() => sorted[k - 1],
            _ => FLOOR,
        };
        let candidates = sorted.iter().copied().take_while(|&v| v >= kth);
        let target = top_p as f64 * candidates.clone().map(p).sum::<f64>();
        let mut kept = 0.0;
        let mut threshold = kth;
        for v in candidates {
            kept += p(v);
            if kept >= target {
                threshold = v;
                break;
            }
        }
        let mass: f64 = s.iter().filter(|&&v| v >= threshold).map(|&v| p(v)).sum();
        let mut x = u * mass;
        let mut last = argmax(logits);
        for (i, &v) in s.iter().enumerate() {
            if v >= threshold && p(v) > 0.0 {
                if x < p(v) {
                    return Ok(i);
                }
                x -= p(v);
                last = i;
            }
        }
        Ok(last)
    }

    /// [`pick`](Self::pick) for every row of `logits: [rows, vocab]` at once, on the logits'
    /// device: `u` holds one uniform number in `[0, 1)` per row (ignored by
    /// [`Greedy`](Self::Greedy)). Returns the `[rows]` token ids, so that a generation loop
    /// reads back only those.
    ///
    /// Plain tensor ops, any backend: greedy is one `argmax`; sampling finds the top-k and the
    /// nucleus thresholds of the scaled logits by bisection (36 halvings each: a token within
    /// about `1.6·10⁻⁹` below a threshold counts as tied with it), about six `[rows, vocab]` ops
    /// per halving, and draws in id order through the cumulative sums of `√vocab`-sized blocks.
    /// Computed in f32 whatever the logits' dtype.
    ///
    /// Errors as [`pick`](Self::pick) does, and when `u` does not hold one number per row.
    pub fn pick_on_device<B: Backend>(
        &self,
        logits: Tensor<B, 2>,
        u: &[f64],
    ) -> Result<Tensor<B, 1, Int>> {
        self.validate()?;
        let [rows, vocab] = logits.dims();
        if vocab == 0 && rows > 0 {
            return Err(Error::argument(
                "logits",
                "an empty row has no token to pick",
            ));
        }
        if rows == 0 {
            return Ok(Tensor::empty([0], &logits.device()));
        }
        let device = logits.device();
        let f32_on = (&device, DType::F32);
        let logits = logits.cast(FloatDType::F32);
        let logits = logits
            .clone()
            .mask_fill(logits.is_nan(), f32::MIN)
            .clamp_min(f32::MIN);
        let Some((temperature, top_k, top_p, _)) = self.parts() else {
            return Ok(logits.argmax(1).reshape([rows]));
        };
        check_uniforms(u, rows)?;
        let column = |v: f32| Tensor::<B, 2>::full([rows, 1], v, f32_on);
        let max = logits.clone().max_dim(1).expand([rows, vocab]);
        let at_max = logits.clone().equal(max.clone());
        let s = ((logits - max) / temperature)
            .clamp_min(FLOOR)
            .mask_fill(at_max, 0.0);
        let p = s.clone().exp();
        // The largest threshold `t` for which `holds(s ≥ t)` is true, per row; `holds` must be
        // true at `lo` and turn false as `t` grows (it is false above the maximum, 0).
        let bisect =
            |lo: Tensor<B, 2>, holds: &dyn Fn(Tensor<B, 2, Bool>) -> Tensor<B, 2, Bool>| {
                let mut lo = lo;
                let mut hi = column(2f32.powi(-10));
                for _ in 0..BISECTIONS {
                    let mid = (lo.clone() + hi.clone()) * 0.5;
                    let above = s.clone().greater_equal(mid.clone().expand([rows, vocab]));
                    let ok = holds(above);
                    lo = lo.mask_where(ok.clone(), mid.clone());
                    hi = mid.mask_where(ok, hi);
                }
                lo
            };
        let kth = if top_k > 0 && top_k < vocab {
            // Counted in integers: a float count would take the device's default float dtype.
            bisect(column(FLOOR - 1.0), &|above| {
                above.int().sum_dim(1).greater_equal_elem(top_k as i64)
            })
        } else {
            column(FLOOR - 1.0)
        };
        let threshold = if top_p < 1.0 {
            let inside = s.clone().greater_equal(kth.clone().expand([rows, vocab]));
            let target = p.clone().mask_fill(inside.bool_not(), 0.0).sum_dim(1) * top_p;
            bisect(kth, &|above| {
                p.clone()
                    .mask_fill(above.bool_not(), 0.0)
                    .sum_dim(1)
                    .greater_equal(target.clone())
            })
        } else {
            kth
        };
        let outside = s.lower(threshold.expand([rows, vocab]));
        let q = p.mask_fill(outside, 0.0);
        let u: Vec<f32> = u
            .iter()
            .map(|&u| (u as f32).min(1.0 - f32::EPSILON / 2.0))
            .collect();
        let u = Tensor::<B, 2>::from_data(TensorData::new(u, [rows, 1]), f32_on);
        Ok(draw_in_id_order(q, u))
    }

    /// The ids [`pick`](Self::pick) chooses for every row of `logits: [rows, vocab]`, on the
    /// host, with one read: on the device ([`pick_on_device`](Self::pick_on_device)), reading
    /// back only the `[rows]` ids, for greedy and, when `sample_on_device`, for sampling too, on
    /// the backends whose tensors are not in host memory; otherwise on the host from the logits
    /// (read in place on ndarray). `u` as for `pick_on_device`.
    ///
    /// Sampling stays on the host by default: its device form is some 430 small launches (two
    /// threshold searches of 36 halvings), which on lavapipe took 80 ms against 0.2 ms on the
    /// host at 8 × 512 logits and 1.4 s against 9 ms at 1 × 163 840 (`benches/sampling.rs`,
    /// BENCHMARKS.md); whether a GPU's launches make it pay off at Kimi's vocabulary is not
    /// measured yet.
    pub fn pick_rows<B: Backend>(
        &self,
        logits: Tensor<B, 2>,
        u: &[f64],
        sample_on_device: bool,
    ) -> Result<Vec<i64>> {
        let [rows, vocab] = logits.dims();
        check_uniforms(u, rows)?;
        let on_host = |logits: &[f32]| -> Result<Vec<i64>> {
            logits
                .chunks_exact(vocab.max(1))
                .zip(u)
                .map(|(row, &u)| self.pick(row, u).map(|id| id as i64))
                .collect()
        };
        use crate::ops::backend::host;
        if let Some(ids) = host::read_in_place(&logits, on_host) {
            return ids;
        }
        let device = self.parts().is_none() || sample_on_device;
        if !device || host::is_host_device::<B>() {
            return on_host(&crate::sync::read(logits).iter::<f32>().collect::<Vec<_>>());
        }
        let ids = self.pick_on_device(logits, u)?;
        Ok(crate::sync::read(ids).iter::<i64>().collect())
    }
}

/// Errors unless `u` holds one uniform number per row of `rows`.
fn check_uniforms(u: &[f64], rows: usize) -> Result<()> {
    if u.len() == rows {
        return Ok(());
    }
    Err(Error::argument(
        "u",
        format!(
            "one uniform number per row of logits: {} for {rows} rows",
            u.len()
        ),
    ))
}

/// The id drawn from each row of the non-negative weights `q: [rows, vocab]` (every row with a
/// positive weight) by inverting their cumulative sum, in id order, at `u · Σq` (`u: [rows, 1]`
/// in `[0, 1)`). Two levels of `√vocab`-sized blocks, as Burn's cumulative sum on the CubeCL
/// backends costs the square of its length. The id returned has a positive weight, whatever
/// the rounding: the sums are taken in order, so they never decrease.
fn draw_in_id_order<B: Backend>(q: Tensor<B, 2>, u: Tensor<B, 2>) -> Tensor<B, 1, Int> {
    let [rows, vocab] = q.dims();
    let device = q.device();
    let f32_on = (&device, DType::F32);
    let width = (vocab as f64).sqrt().ceil() as usize;
    let blocks = vocab.div_ceil(width);
    let q = match blocks * width - vocab {
        0 => q,
        pad => Tensor::cat(vec![q, Tensor::zeros([rows, pad], f32_on)], 1),
    }
    .reshape([rows, blocks, width]);
    let through = q.clone().sum_dim(2).reshape([rows, blocks]).cumsum(1);
    let total = through.clone().narrow(1, blocks - 1, 1);
    let x = u * total.clone();
    let block = count_below(through.clone(), x.clone(), total);
    let before = match blocks {
        1 => Tensor::zeros([rows, 1], f32_on),
        _ => Tensor::cat(
            vec![
                Tensor::zeros([rows, 1], f32_on),
                through.narrow(1, 0, blocks - 1),
            ],
            1,
        )
        .gather(1, block.clone()),
    };
    let within = q
        .gather(
            1,
            block.clone().reshape([rows, 1, 1]).expand([rows, 1, width]),
        )
        .reshape([rows, width])
        .cumsum(1);
    let end = within.clone().narrow(1, width - 1, 1);
    let offset = count_below(within, (x - before).clamp_min(0.0), end);
    (block * width as i64 + offset).reshape([rows])
}

/// Per row, how many of the non-decreasing `cumulative: [rows, n]` are at most `x: [rows, 1]`,
/// not counting those that reach `end: [rows, 1]` (the row's last sum): the index of the entry
/// in which `x` falls, and at most that of the first entry reaching `end`.
fn count_below<B: Backend>(
    cumulative: Tensor<B, 2>,
    x: Tensor<B, 2>,
    end: Tensor<B, 2>,
) -> Tensor<B, 2, Int> {
    let shape = cumulative.dims();
    let at_or_below = cumulative.clone().lower_equal(x.expand(shape));
    at_or_below
        .bool_and(cumulative.lower(end.expand(shape)))
        .int()
        .sum_dim(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::SeededRng;

    /// How often `s` picks each of five tokens from `logits` in `draws` draws.
    fn tally(s: Sampling, logits: &[f32; 5], draws: usize, rng: &mut SeededRng) -> [usize; 5] {
        let mut seen = [0usize; 5];
        for _ in 0..draws {
            seen[s.pick(logits, rng.unit_f64()).unwrap()] += 1;
        }
        seen
    }

    #[test]
    fn top_p_keeps_only_the_nucleus_and_greedy_takes_the_first_maximum() {
        let mut rng = SeededRng::new(1);
        let logits = [0.0f32, 3.0, 3.0, 1.0, -2.0];
        assert_eq!(Sampling::Greedy.pick(&logits, rng.unit_f64()).unwrap(), 1);
        // Tokens 1 and 2 hold ~0.92 of the mass: with top_p = 0.9 nothing else may appear.
        let s = Sampling::TopP {
            temperature: 1.0,
            top_p: 0.9,
            seed: 1,
        };
        let seen = tally(s, &logits, 2000, &mut rng);
        assert_eq!(seen[0] + seen[3] + seen[4], 0, "{seen:?}");
        assert!(seen[1] > 800 && seen[2] > 800, "{seen:?}");
        // With top_p = 1 the tail shows up, in proportion.
        let s = Sampling::TopP {
            temperature: 1.0,
            top_p: 1.0,
            seed: 1,
        };
        let seen = tally(s, &logits, 20000, &mut rng);
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
            tally(s, &logits, 20000, rng)
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

    /// The device sampler draws the host sampler's token for the same uniform number, row by
    /// row: rows with many ties (at the k-th token and at the nucleus boundary), `−∞` logits,
    /// vocabularies that are not a square (padded blocks) and of one token, every top-k regime.
    #[test]
    fn the_device_sampler_picks_the_host_samplers_token() {
        use burn::backend::NdArray;
        type B = NdArray<f32>;
        let device = Default::default();
        let mut rng = SeededRng::new(11);
        let mut compared = 0;
        for vocab in [1usize, 2, 7, 50, 301] {
            for tied in [true, false] {
                let rows = 6;
                // Row 4 is all −∞; NaN anywhere; +∞ in the untied rows now and then.
                let logits: Vec<f32> = (0..rows * vocab)
                    .map(|i| {
                        if i % 13 == 5 || i / vocab == 4 {
                            f32::NEG_INFINITY
                        } else if i % 17 == 3 {
                            f32::NAN
                        } else if !tied && i % 37 == 11 {
                            f32::INFINITY
                        } else if tied {
                            (rng.unit_f64() * 12.0).floor() as f32 * 0.5 - 3.0
                        } else {
                            (rng.unit_f64() * 8.0 - 4.0) as f32
                        }
                    })
                    .collect();
                let tensor = Tensor::<B, 2>::from_data(
                    TensorData::new(logits.clone(), [rows, vocab]),
                    &device,
                );
                for top_k in [0, 1, 3, vocab.saturating_sub(1), vocab, vocab + 4] {
                    for (temperature, top_p) in [(1.0, 1.0), (0.7, 0.9), (1.6, 0.5), (1.0, 0.02)] {
                        let s = Sampling::TopKTopP {
                            temperature,
                            top_k,
                            top_p,
                            seed: 0,
                        };
                        for _ in 0..3 {
                            let u: Vec<f64> = (0..rows).map(|_| rng.unit_f64()).collect();
                            let device_ids: Vec<i64> = s
                                .pick_on_device(tensor.clone(), &u)
                                .unwrap()
                                .into_data()
                                .iter::<i64>()
                                .collect();
                            for (r, row) in logits.chunks(vocab).enumerate() {
                                let want = s.pick(row, u[r]).unwrap();
                                assert_eq!(
                                    device_ids[r], want as i64,
                                    "vocab {vocab}, tied {tied}, {s:?}, row {r}, u {}: {row:?}",
                                    u[r]
                                );
                                // NaN and −∞ only where the row has nothing else.
                                assert!(
                                    sane(row[want]) > f32::MIN
                                        || row.iter().all(|&l| sane(l) == f32::MIN)
                                );
                                compared += 1;
                            }
                        }
                    }
                }
                let greedy: Vec<i64> = Sampling::Greedy
                    .pick_on_device(tensor, &[0.0; 6])
                    .unwrap()
                    .into_data()
                    .iter::<i64>()
                    .collect();
                for (r, row) in logits.chunks(vocab).enumerate() {
                    assert_eq!(greedy[r], Sampling::Greedy.pick(row, 0.0).unwrap() as i64);
                }
            }
        }
        assert_eq!(compared, 5 * 2 * 6 * 4 * 3 * 6);
    }

    /// Invalid rules, empty rows and a wrong number of uniform numbers are errors naming what
    /// is wrong, on both paths.
    #[test]
    fn bad_sampling_arguments_are_errors() {
        use burn::backend::NdArray;
        let device = Default::default();
        let logits = Tensor::<NdArray<f32>, 2>::zeros([2, 3], &device);
        let hot = Sampling::TopP {
            temperature: 0.0,
            top_p: 0.5,
            seed: 0,
        };
        let empty_nucleus = Sampling::TopP {
            temperature: 1.0,
            top_p: 0.0,
            seed: 0,
        };
        for (s, what) in [(hot, "temperature"), (empty_nucleus, "top_p")] {
            let host = s.pick(&[1.0, 2.0], 0.5).unwrap_err().to_string();
            let device = s
                .pick_on_device(logits.clone(), &[0.5, 0.5])
                .unwrap_err()
                .to_string();
            assert!(
                host.contains(what) && device.contains(what),
                "{host} / {device}"
            );
        }
        let ok = Sampling::TopP {
            temperature: 1.0,
            top_p: 0.5,
            seed: 0,
        };
        assert!(ok.pick(&[], 0.5).unwrap_err().to_string().contains("empty"));
        let err = ok.pick_on_device(logits, &[0.5]).unwrap_err().to_string();
        assert!(err.contains("1 for 2 rows"), "{err}");
    }

    /// Ties are kept whole: at the k-th most likely token and at the nucleus boundary.
    #[test]
    fn tied_tokens_are_all_kept_or_all_dropped() {
        let mut rng = SeededRng::new(3);
        let logits = [1.0f32, 3.0, 0.0, 3.0, 3.0];
        let draw = |s: Sampling, rng: &mut SeededRng| tally(s, &logits, 6000, rng);
        // k = 1 keeps the three tied maxima, in equal shares.
        let one = Sampling::TopKTopP {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 0,
        };
        let seen = draw(one, &mut rng);
        assert_eq!(seen[0] + seen[2], 0, "{seen:?}");
        assert!([1, 3, 4].iter().all(|&i| seen[i] > 1800), "{seen:?}");
        // A nucleus reached inside the tie (a third of the mass) keeps the whole tie.
        let seen = draw(
            Sampling::TopP {
                temperature: 1.0,
                top_p: 0.1,
                seed: 0,
            },
            &mut rng,
        );
        assert_eq!(seen[0] + seen[2], 0, "{seen:?}");
        assert!([1, 3, 4].iter().all(|&i| seen[i] > 1800), "{seen:?}");
    }
}
