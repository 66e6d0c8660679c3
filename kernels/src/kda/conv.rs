//! The causal depthwise short convolution in front of KDA's q, k and v, with its SiLU (SPEC §4.2),
//! over packed sequences with a carried tail (the last `width − 1` raw inputs of each sequence):
//! prefill and decode in one launch, the tail update in another.
//!
//! `x, y: [tokens, channels]` in `F`; `weight: [channels, width]` f32; `tail, new_tail: [N,
//! channels, width − 1]` in `F`; `tok_seq: [tokens]` gives each token's sequence and
//! `seq_start: [N + 1]` the sequences' token ranges.

use cubecl::prelude::*;

use super::sigmoid;

/// `y[t, c] = SiLU(Σ_i w[c, i] · x[t − width + 1 + i, c])` (tap `width − 1` on the current token),
/// inputs before a sequence's start read from `tail` (or 0 when `has_tail` is false). One unit
/// per (token, channel).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn short_conv_forward<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    tail: &Array<F>,
    tok_seq: &Array<u32>,
    seq_start: &Array<u32>,
    y: &mut Array<F>,
    tokens: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= tokens * channels {
        terminate!();
    }
    let c = pos % channels;
    let t = pos / channels;
    let n = tok_seq[t] as usize;
    let start = seq_start[n] as usize;
    let j = t - start;
    let back = width - 1;
    let mut acc = 0.0f32;
    for i in 0..width {
        let w = weight[c * width + i];
        if j + i >= back {
            acc += w * f32::cast_from(x[(t + i - back) * channels + c]);
        } else {
            if comptime!(has_tail) {
                acc += w * f32::cast_from(tail[(n * channels + c) * back + j + i]);
            }
        }
    }
    y[pos] = F::cast_from(acc * sigmoid(acc));
}

/// The tail after this call: `new_tail[n, c, r]` is the raw input at position
/// `len_n − (width − 1) + r` of sequence `n`, from `x`, or from the old `tail` when the sequence is
/// shorter than the tail (0 without one). One unit per (sequence, channel, slot).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn short_conv_tail<F: Float>(
    x: &Array<F>,
    tail: &Array<F>,
    seq_start: &Array<u32>,
    new_tail: &mut Array<F>,
    seqs: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
    #[define(F)] _dtype: StorageType,
) {
    let back = width - 1;
    let pos = ABSOLUTE_POS;
    if pos >= seqs * channels * back {
        terminate!();
    }
    let r = pos % back;
    let c = (pos / back) % channels;
    let n = pos / (back * channels);
    let start = seq_start[n] as usize;
    let len = seq_start[n + 1] as usize - start;
    let mut v = F::cast_from(0.0f32);
    if len + r >= back {
        v = x[(start + len + r - back) * channels + c];
    } else {
        if comptime!(has_tail) {
            v = tail[(n * channels + c) * back + len + r];
        }
    }
    new_tail[pos] = v;
}
