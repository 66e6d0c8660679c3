//! The global balance step of data-parallel training (design §3; `docs/scaling.md` §1): every
//! replica's accumulated balancer counts, summed over the replicas by one float all-reduce, so
//! that [`update_balance`](KimiForCausalLM::update_balance) gives the same bias everywhere.
//!
//! A replica packs its counts with [`KimiForCausalLM::balance_packet`] into one f32 tensor, the
//! tensors of all replicas are summed (Burn's collective all-reduce with `Sum`, or any sum), and
//! each replica hands the sum to [`KimiForCausalLM::apply_balance_packet`], which reads it once,
//! checks it and adds the other replicas' counts to its own.
//!
//! **Exact counts in f32.** f32 holds integers exactly up to 2^24, and a sum of floats stays exact
//! while every partial sum does. So each count `c < 2^40` is sent as two digits, `c mod 2^16` and
//! `c div 2^16`, and the packet supports up to [`MAX_REPLICAS`] replicas: a low digit is below
//! 2^16 and 255 of them sum below 2^24; a high digit is below 2^24 / 255 when each replica's
//! count is below 2^40 / 255 ≈ 4.3e9, checked when packing. (One step of K3 pools about
//! `tokens · k` counts per layer, far below.)
//!
//! **Same bias on every replica.** Counts only pool when every replica routed with the same bias.
//! The packet carries, per MoE layer, a small hash `h` of the bias bits and `h²`; after the sum,
//! `Σh² · P = (Σh)²` holds exactly when every replica had the same `h` (Cauchy–Schwarz), and a
//! replica whose bias differs is reported, with the layer.

use burn::tensor::{backend::Backend, Tensor, TensorData};

use crate::error::{Error, Result};
use crate::model::{Ffn, KimiForCausalLM};

/// Most replicas whose packets may be summed exactly.
pub const MAX_REPLICAS: u64 = 255;

const DIGIT: u64 = 1 << 16;
/// Largest count one replica may send per bin (see the module docs).
const MAX_COUNT: u64 = (1 << 40) / MAX_REPLICAS;
/// Bias hashes lie in `1..=HASH`, so `P · HASH²` stays below 2^24 for `P ≤ 255`.
const HASH: u64 = 255;

/// A hash of the bias bits in `1..=HASH`.
fn bias_hash(bias: &[f32]) -> u64 {
    // FNV-1a over the bits, folded to 1..=255.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in bias {
        for byte in v.to_bits().to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    1 + h % HASH
}

impl<B: Backend> KimiForCausalLM<B> {
    /// This replica's balancer counts of every MoE layer, with the replica count and a hash of
    /// each layer's bias, as one f32 tensor `[1 + Σ_layers (2 + 2·counts)]` to be summed over the
    /// replicas (see the module docs). Errors when a count is too large to be summed exactly.
    pub fn balance_packet(&self) -> Result<Tensor<B, 1>> {
        let mut packet: Vec<f32> = vec![1.0];
        for (i, layer) in self.layers.iter().enumerate() {
            let Ffn::Moe(moe) = &layer.ffn else { continue };
            let h = bias_hash(&moe.balance.bias_host());
            packet.push(h as f32);
            packet.push((h * h) as f32);
            for c in moe.balance.counts() {
                if c >= MAX_COUNT {
                    return Err(Error::argument(
                        "balance counts",
                        format!(
                            "layer {i} holds a count of {c}; a packet sums exactly only counts \
                             below {MAX_COUNT} (see kimi_burn::balance_sync)"
                        ),
                    ));
                }
                packet.push((c % DIGIT) as f32);
                packet.push((c / DIGIT) as f32);
            }
        }
        let device = self.embed_tokens.weight.val().device();
        let n = packet.len();
        Ok(Tensor::from_data(TensorData::new(packet, [n]), &device))
    }

    /// Takes the sum of every replica's [`balance_packet`](Self::balance_packet) (this one's
    /// included) and adds the other replicas' counts to this replica's, so that
    /// [`update_balance`](Self::update_balance) then applies the global batch's statistics. One
    /// read of `summed` to the host. Returns the number of replicas.
    ///
    /// Errors when `summed` does not have this model's packet layout, when the replica count is
    /// out of range or not an integer, or when the replicas routed a layer with different biases.
    pub fn apply_balance_packet(&self, summed: Tensor<B, 1>) -> Result<u64> {
        let got: Vec<f32> = summed.into_data().iter::<f32>().collect();
        let layers: Vec<_> = self
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.ffn {
                Ffn::Moe(moe) => Some((i, moe)),
                Ffn::Dense(_) => None,
            })
            .collect();
        let expected = 1 + layers
            .iter()
            .map(|(_, m)| 2 + 2 * m.balance.counts().len())
            .sum::<usize>();
        if got.len() != expected {
            return Err(Error::shape(
                "summed balance packet",
                format!("[{expected}]"),
                [got.len()],
            ));
        }
        let whole = |v: f32, what: &str| -> Result<u64> {
            if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < 16_777_216.0 {
                Ok(v as u64)
            } else {
                Err(Error::argument(
                    "summed balance packet",
                    format!("{what} is {v}, not an exact sum of packets"),
                ))
            }
        };
        let replicas = whole(got[0], "the replica count")?;
        if !(1..=MAX_REPLICAS).contains(&replicas) {
            return Err(Error::argument(
                "summed balance packet",
                format!("{replicas} replicas: a packet sums exactly over 1..={MAX_REPLICAS}"),
            ));
        }
        let mut at = 1;
        for (i, moe) in layers {
            let (s1, s2) = (
                whole(got[at], "a bias hash sum")?,
                whole(got[at + 1], "a bias hash sum")?,
            );
            if s2 * replicas != s1 * s1 {
                return Err(Error::argument(
                    "balance bias",
                    format!(
                        "the {replicas} replicas routed MoE layer {i} with different biases; \
                         they must apply the same balance update every step"
                    ),
                ));
            }
            at += 2;
            let own = moe.balance.counts();
            let mut others = Vec::with_capacity(own.len());
            for (j, &mine) in own.iter().enumerate() {
                let lo = whole(got[at + 2 * j], "a count digit")?;
                let hi = whole(got[at + 2 * j + 1], "a count digit")?;
                let total = hi * DIGIT + lo;
                others.push(total.checked_sub(mine).ok_or_else(|| {
                    Error::argument(
                        "summed balance packet",
                        format!(
                            "layer {i}: the sum {total} is below this replica's own count {mine} \
                             (its counts changed after packing?)"
                        ),
                    )
                })?);
            }
            at += 2 * own.len();
            moe.balance.merge(&others)?;
        }
        Ok(replicas)
    }
}
