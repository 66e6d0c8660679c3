//! The causal depthwise short convolution in front of KDA's q, k and v, with its SiLU (design §4.2),
//! over packed sequences with a carried tail (the last `width − 1` raw inputs of each sequence):
//! prefill and decode in one launch, the tail update in another.
//!
//! `x, y: [tokens, channels]` in `F`; `weight: [channels, width]` f32; `tail, new_tail: [N,
//! channels, width − 1]` in `F`; `tok_seq: [tokens]` gives each token's sequence and
//! `seq_start: [N + 1]` the sequences' token ranges. The backward recomputes the
//! pre-activation from the inputs rather than storing it.

use cubecl::prelude::*;

use super::sigmoid;

/// `y[t, c] = SiLU(Σ_i w[c, i] · x[t − width + 1 + i, c])` (tap `width − 1` on the current token),
/// inputs before a sequence's start read from `tail` (or 0 when `has_tail` is false). One unit
/// per (token, channel).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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
    let a = conv_pre(x, weight, tail, t, j, n, c, channels, width, has_tail);
    y[pos] = F::cast_from(a * sigmoid(a));
}

/// The tail after this call: `new_tail[n, c, r]` is the raw input at position
/// `len_n − (width − 1) + r` of sequence `n`, from `x`, or from the old `tail` when the sequence is
/// shorter than the tail (0 without one). One unit per (sequence, channel, slot).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
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

/// The raw input at position `m − (width − 1)` of the window of token `t` (tap `m`): from `x`
/// inside the sequence, else from `tail` (0 without one). `j` is `t`'s position in sequence `n`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn conv_input<F: Float>(
    x: &Array<F>,
    tail: &Array<F>,
    t: usize,
    j: usize,
    n: usize,
    c: usize,
    m: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
) -> f32 {
    let back = width - 1;
    let mut v = 0.0f32;
    if j + m >= back {
        v = f32::cast_from(x[(t + m - back) * channels + c]);
    } else {
        if comptime!(has_tail) {
            v = f32::cast_from(tail[(n * channels + c) * back + j + m]);
        }
    }
    v
}

/// The pre-activation `a = Σ_m w[c, m] · input(t, m)` of token `t`, channel `c`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn conv_pre<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    tail: &Array<F>,
    t: usize,
    j: usize,
    n: usize,
    c: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
) -> f32 {
    let mut a = 0.0f32;
    for m in 0..width {
        a += weight[c * width + m] * conv_input(x, tail, t, j, n, c, m, channels, width, has_tail);
    }
    a
}

/// `dL/da` at token `t`, channel `c`, for `y = SiLU(a)`: `dy · σ(a)(1 + a(1 − σ(a)))`, with the
/// pre-activation `a` recomputed from the window.
#[allow(clippy::too_many_arguments)]
#[cube]
fn conv_grad_pre<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    tail: &Array<F>,
    dy: &Array<F>,
    t: usize,
    j: usize,
    n: usize,
    c: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
) -> f32 {
    let a = conv_pre(x, weight, tail, t, j, n, c, channels, width, has_tail);
    let s = sigmoid(a);
    f32::cast_from(dy[t * channels + c]) * s * (1.0 + a * (1.0 - s))
}

/// Backward to the inputs, one unit per (token, channel): `dx[t, c] = Σ_m w[c, m] · da[t + width −
/// 1 − m, c]` over the tokens of the same sequence whose window covers `t`. Units past
/// `tokens · channels`, up to `(tokens + N·(width − 1)) · channels`, give the tail's gradient
/// `dtail[n, c, r] = Σ_{j ≤ r} w[c, r − j] · da[start_n + j, c]` (written when `has_tail`).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn short_conv_backward_input<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    tail: &Array<F>,
    dy: &Array<F>,
    tok_seq: &Array<u32>,
    seq_start: &Array<u32>,
    dx: &mut Array<F>,
    dtail: &mut Array<F>,
    tokens: usize,
    channels: usize,
    seqs: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
    #[define(F)] _dtype: StorageType,
) {
    let back = width - 1;
    let pos = ABSOLUTE_POS;
    if pos < tokens * channels {
        let c = pos % channels;
        let t = pos / channels;
        let n = tok_seq[t] as usize;
        let start = seq_start[n] as usize;
        let end = seq_start[n + 1] as usize;
        let mut acc = 0.0f32;
        for m in 0..width {
            // The output token whose tap m reads t.
            let t2 = t + back - m;
            if t2 < end {
                let da = conv_grad_pre(
                    x,
                    weight,
                    tail,
                    dy,
                    t2,
                    t2 - start,
                    n,
                    c,
                    channels,
                    width,
                    has_tail,
                );
                acc += weight[c * width + m] * da;
            }
        }
        dx[pos] = F::cast_from(acc);
    } else {
        if comptime!(has_tail) {
            let e = pos - tokens * channels;
            if e < seqs * channels * back {
                let r = e % back;
                let c = (e / back) % channels;
                let n = e / (back * channels);
                let start = seq_start[n] as usize;
                let len = seq_start[n + 1] as usize - start;
                let mut acc = 0.0f32;
                for j in 0..usize::min(r + 1, len) {
                    let da = conv_grad_pre(
                        x,
                        weight,
                        tail,
                        dy,
                        start + j,
                        j,
                        n,
                        c,
                        channels,
                        width,
                        has_tail,
                    );
                    acc += weight[c * width + r - j] * da;
                }
                dtail[e] = F::cast_from(acc);
            }
        }
    }
}

/// Tokens per block of [`short_conv_backward_weight`](fn@short_conv_backward_weight).
pub const CONV_BLOCK: usize = 256;

/// Backward to the taps, stage 1: one unit per (block of [`CONV_BLOCK`] tokens, channel) sums
/// `da[t, c] · input(t, m)` over its tokens for every tap `m`, into `partial: [blocks, channels ·
/// width]`; [`column_sum`](fn@super::column_sum) over the blocks finishes `dw`.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn short_conv_backward_weight<F: Float>(
    x: &Array<F>,
    weight: &Array<f32>,
    tail: &Array<F>,
    dy: &Array<F>,
    tok_seq: &Array<u32>,
    seq_start: &Array<u32>,
    partial: &mut Array<f32>,
    tokens: usize,
    channels: usize,
    #[comptime] width: usize,
    #[comptime] has_tail: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    let blocks = (tokens + CONV_BLOCK - 1) / CONV_BLOCK;
    if pos >= blocks * channels {
        terminate!();
    }
    let c = pos % channels;
    let block = pos / channels;
    let mut acc = Array::<f32>::new(width);
    for m in 0..width {
        acc[m] = 0.0f32;
    }
    let t0 = block * CONV_BLOCK;
    let t1 = usize::min(t0 + CONV_BLOCK, tokens);
    for t in t0..t1 {
        let n = tok_seq[t] as usize;
        let j = t - seq_start[n] as usize;
        let da = conv_grad_pre(x, weight, tail, dy, t, j, n, c, channels, width, has_tail);
        for m in 0..width {
            acc[m] += da * conv_input(x, tail, t, j, n, c, m, channels, width, has_tail);
        }
    }
    for m in 0..width {
        partial[(block * channels + c) * width + m] = acc[m];
    }
}
