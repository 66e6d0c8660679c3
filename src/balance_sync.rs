//! The global balance step of data-parallel training (design §3; `docs/scaling.md` §1): every
//! replica's accumulated balancer counts, summed over the replicas by one float all-reduce, so
//! that [`update_balance`](KimiForCausalLM::update_balance) gives the same bias everywhere.
//!
//! A replica packs its counts with [`KimiForCausalLM::balance_packet`] (or
//! [`LatentMoe::balance_packet`] for one layer) into one f32 tensor, the tensors of all replicas
//! are summed (Burn's collective all-reduce with `Sum`, or any sum), and each replica hands the sum
//! to [`KimiForCausalLM::apply_balance_packet`], which reads it once, checks it and adds the other
//! replicas' counts to its own. `kimi_burn::parallel` (feature `collective`) does all of it, with
//! the gradients, in one all-reduce per step.
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
use crate::nn::{BalanceState, LatentMoe};

/// Most replicas whose packets may be summed exactly.
pub const MAX_REPLICAS: u64 = 255;

const DIGIT: u64 = 1 << 16;
/// Largest count one replica may send per bin (see the module docs).
const MAX_COUNT: u64 = (1 << 40) / MAX_REPLICAS;
/// Bias hashes lie in `1..=HASH`, so `P · HASH²` stays below 2^24 for `P ≤ 255`.
const HASH: u64 = 255;

pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a: `state` extended by `bytes`.
pub(crate) fn fnv(mut state: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        state ^= u64::from(byte);
        state = state.wrapping_mul(0x0100_0000_01b3);
    }
    state
}

/// A hash of the bias bits in `1..=HASH`.
fn bias_hash(bias: &[f32]) -> u64 {
    let h = bias
        .iter()
        .fold(FNV_OFFSET, |h, v| fnv(h, &v.to_bits().to_le_bytes()));
    1 + h % HASH
}

/// A module whose MoE layers carry balance state: the model and one [`LatentMoe`]. Their
/// balance packets, and `kimi_burn::parallel`'s global step, cover these layers.
pub trait BalancedModule<B: Backend> {
    /// Every MoE layer's balance state with its layer index, in layer order.
    fn balance_states(&self) -> Vec<(usize, &BalanceState<B>)>;
}

impl<B: Backend> BalancedModule<B> for KimiForCausalLM<B> {
    fn balance_states(&self) -> Vec<(usize, &BalanceState<B>)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.ffn {
                Ffn::Moe(moe) => Some((i, &moe.balance)),
                Ffn::Dense(_) => None,
            })
            .collect()
    }
}

impl<B: Backend> BalancedModule<B> for LatentMoe<B> {
    fn balance_states(&self) -> Vec<(usize, &BalanceState<B>)> {
        vec![(0, &self.balance)]
    }
}

/// The packet of `layers` (`(model layer index, state)`) on the host, laid out as the module docs
/// say: `[replicas = 1, then per layer: h, h², then each count as (low, high) digits]`.
pub(crate) fn pack<B: Backend>(layers: &[(usize, &BalanceState<B>)]) -> Result<Vec<f32>> {
    let states: Vec<&BalanceState<B>> = layers.iter().map(|(_, s)| *s).collect();
    crate::nn::balance::flush_all(&states)?;
    let mut packet: Vec<f32> = vec![1.0];
    for (i, state) in layers {
        let h = bias_hash(&state.bias_host());
        packet.push(h as f32);
        packet.push((h * h) as f32);
        for c in state.counts() {
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
    Ok(packet)
}

/// The length of the packet of `layers`.
pub(crate) fn packet_len<B: Backend>(layers: &[(usize, &BalanceState<B>)]) -> usize {
    1 + layers
        .iter()
        .map(|(_, s)| 2 + 2 * s.counts_len())
        .sum::<usize>()
}

/// Checks the summed packet `got` of `layers` and merges the other replicas' counts into each
/// layer's state. Returns the number of replicas.
pub(crate) fn unpack<B: Backend>(layers: &[(usize, &BalanceState<B>)], got: &[f32]) -> Result<u64> {
    let expected = packet_len(layers);
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
    for (i, state) in layers {
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
        let own = state.counts();
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
        state.merge(&others)?;
    }
    Ok(replicas)
}

fn to_tensor<B: Backend>(packet: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = packet.len();
    // f32 whatever the backend's default float: the packet's digits are exact in f32 only.
    Tensor::from_data(
        TensorData::new(packet, [n]),
        (device, burn::tensor::DType::F32),
    )
}

fn read<B: Backend>(summed: Tensor<B, 1>) -> Result<Vec<f32>> {
    crate::sync::read(summed)
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| Error::argument("summed balance packet", format!("{e:?}")))
}

impl<B: Backend> KimiForCausalLM<B> {
    /// This replica's balancer counts of every MoE layer, with the replica count and a hash of
    /// each layer's bias, as one f32 tensor `[1 + Σ_layers (2 + 2·counts)]` to be summed over the
    /// replicas (see the module docs). Errors when a count is too large to be summed exactly.
    pub fn balance_packet(&self) -> Result<Tensor<B, 1>> {
        let packet = pack(&self.balance_states())?;
        Ok(to_tensor(packet, &self.embed_tokens.weight.val().device()))
    }

    /// Takes the sum of every replica's [`balance_packet`](Self::balance_packet) (this one's
    /// included) and adds the other replicas' counts to this replica's, so that
    /// [`update_balance`](Self::update_balance) then applies the global batch's statistics. One
    /// read of `summed` to the host. Returns the number of replicas.
    ///
    /// Errors when `summed` does not have this model's packet layout, when the replica count is
    /// out of range or not an integer, or when the replicas routed a layer with different biases.
    pub fn apply_balance_packet(&self, summed: Tensor<B, 1>) -> Result<u64> {
        unpack(&self.balance_states(), &read(summed)?)
    }
}

impl<B: Backend> LatentMoe<B> {
    /// [`KimiForCausalLM::balance_packet`] for this one layer (reported as layer 0).
    pub fn balance_packet(&self) -> Result<Tensor<B, 1>> {
        let packet = pack(&self.balance_states())?;
        Ok(to_tensor(packet, &self.balance.bias.value().device()))
    }

    /// [`KimiForCausalLM::apply_balance_packet`] for this one layer.
    pub fn apply_balance_packet(&self, summed: Tensor<B, 1>) -> Result<u64> {
        unpack(&self.balance_states(), &read(summed)?)
    }
}
