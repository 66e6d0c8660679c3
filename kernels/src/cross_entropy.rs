//! Cross-entropy over the rows of a logit matrix, forward and backward.
//!
//! For a row `z: [vocab]` and its target `t` (a row whose target is the ignore index scores
//! nothing):
//!
//! ```text
//! lse = max(z) + ln Σ_c exp(z_c − max(z)),   loss = lse − z_t
//! dz_c = g·(exp(z_c − lse) − [c = t])        (0 on an ignored row)
//! ```
//!
//! **Layout.** The forward takes two launches. [`cross_entropy_partials`](fn@cross_entropy_partials)
//! gives each row [`split_for`]`(vocab)` units (64 from 4096 logits on) that walk its columns
//! interleaved (unit `j` takes columns `j`, `j + split`, …), so neighbouring units read
//! neighbouring columns: coalesced loads on a GPU. Each unit keeps a running maximum `m` and the sum of
//! its exponentials rescaled to it, `s = Σ exp(z_c − m)`, in one pass.
//! [`cross_entropy_finish`](fn@cross_entropy_finish), one unit per row, merges the row's partials
//! in order (`lse = M + ln Σ_j s_j·exp(m_j − M)`) and scores the target. The backward has the
//! first launch's layout. No unit loops more than [`LOOP_BUDGET`] times at any
//! vocabulary a device buffer holds, so lavapipe's loop limit (see [`LOOP_BUDGET`]) bounds
//! nothing, and the row's work is spread over `split` units instead of one.
//!
//! The forward keeps `lse` per row, so the backward reads each logit once. A target outside
//! `[0, vocab)` other than the ignore index gives a NaN loss (and NaN gradients on its row): the
//! error surfaces at the next read of the loss instead of as an out-of-bounds read. Statistics in
//! f32 whatever the storage dtype; no atomics, and every sum runs in a fixed order, so reruns are
//! bit-identical.

use cubecl::prelude::*;

use crate::kda::LOOP_BUDGET;

/// Units per cube, for all three kernels.
pub const CROSS_ENTROPY_CUBE: u32 = 256;

/// Units per row of [`cross_entropy_partials`](fn@cross_entropy_partials) from 4096 logits up to
/// `CROSS_ENTROPY_SPLIT · LOOP_BUDGET` (about two million).
pub const CROSS_ENTROPY_SPLIT: usize = 64;

/// The fewest logits a unit walks in a row of at least that many: below
/// `CROSS_ENTROPY_SPLIT · CROSS_ENTROPY_COLUMNS` logits a row gets fewer units. On lavapipe a unit's
/// fixed work (its row's target, gradient and log-sum-exp) costs about as much as a few logits,
/// so 8 logits per unit made the tiny model's backward 1.5× slower than 64 (BENCHMARKS).
pub const CROSS_ENTROPY_COLUMNS: usize = 64;

/// Units per row of [`cross_entropy_partials`](fn@cross_entropy_partials) and
/// [`cross_entropy_backward`](fn@cross_entropy_backward) for rows of `vocab` logits: one per
/// [`CROSS_ENTROPY_COLUMNS`] logits up to [`CROSS_ENTROPY_SPLIT`], and more where a unit would
/// otherwise walk more than [`LOOP_BUDGET`] logits (past about two million). The finishing unit's
/// two loops over the partials stay within the budget for every vocabulary below `LOOP_BUDGET²/2`.
pub fn split_for(vocab: usize) -> usize {
    vocab
        .div_ceil(CROSS_ENTROPY_COLUMNS)
        .clamp(1, CROSS_ENTROPY_SPLIT)
        .max(vocab.div_ceil(LOOP_BUDGET))
}

/// Whether `t` is a valid class of `vocab` (as a signed index).
#[cube]
fn in_range(t: i32, vocab: usize) -> bool {
    t >= 0 && (t as usize) < vocab
}

/// Forward, first launch: `top, sum: [rows, split]` f32, unit `j` of row `r` holding the maximum
/// `m` of the logits `z[r, c]` with `c ≡ j (mod split)` and `Σ exp(z[r, c] − m)` over them
/// (`−3·10³⁸` and 0 for a unit without columns). One unit per `(row, j)`, cubes of
/// [`CROSS_ENTROPY_CUBE`] units; extra units exit.
#[cube(launch_unchecked)]
pub fn cross_entropy_partials<F: Float>(
    logits: &Array<F>,
    top: &mut Array<f32>,
    sum: &mut Array<f32>,
    rows: usize,
    vocab: usize,
    split: usize,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= rows * split {
        terminate!();
    }
    let base = (pos / split) * vocab;
    let mut m = f32::new(-3.0e38);
    let mut s = 0.0f32;
    let mut c = pos % split;
    while c < vocab {
        let x = f32::cast_from(logits[base + c]);
        // One exponential per logit: a new maximum rescales the sum so far.
        if x > m {
            s = s * f32::exp(m - x) + 1.0;
            m = x;
        } else {
            s += f32::exp(x - m);
        }
        c += split;
    }
    top[pos] = m;
    sum[pos] = s;
}

/// Forward, second launch: `loss: [rows]` in `F` and `lse: [rows]` f32 from the partials of
/// [`cross_entropy_partials`](fn@cross_entropy_partials), `logits: [rows, vocab]` in `F` and
/// `targets: [rows]` in `I`. `nan` is `f32::NAN` (passed in: a NaN constant is a compile error in
/// some shader languages). One unit per row, cubes of [`CROSS_ENTROPY_CUBE`] units.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn cross_entropy_finish<F: Float, I: Int>(
    logits: &Array<F>,
    targets: &Array<I>,
    top: &Array<f32>,
    sum: &Array<f32>,
    loss: &mut Array<F>,
    lse: &mut Array<f32>,
    rows: usize,
    vocab: usize,
    split: usize,
    ignore: i32,
    nan: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let first = row * split;
    let mut m = f32::new(-3.0e38);
    for j in 0..split {
        m = f32::max(m, top[first + j]);
    }
    let mut total = 0.0f32;
    for j in 0..split {
        total += sum[first + j] * f32::exp(top[first + j] - m);
    }
    let l = m + f32::ln(total);
    lse[row] = l;
    let t = i32::cast_from(targets[row]);
    let mut out = 0.0f32;
    if t != ignore {
        if in_range(t, vocab) {
            out = l - f32::cast_from(logits[row * vocab + t as usize]);
        } else {
            out = nan;
        }
    }
    loss[row] = F::cast_from(out);
}

/// Backward for `grad: [rows]` in `F` (the gradient of each row's loss): `dlogits: [rows,
/// vocab]` in `F`, from the forward's `lse`. Laid out as
/// [`cross_entropy_partials`](fn@cross_entropy_partials): `split` units per row, unit `j` writing
/// the columns `c ≡ j (mod split)`; extra units exit.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn cross_entropy_backward<F: Float, I: Int>(
    logits: &Array<F>,
    targets: &Array<I>,
    lse: &Array<f32>,
    grad: &Array<F>,
    dlogits: &mut Array<F>,
    rows: usize,
    vocab: usize,
    split: usize,
    ignore: i32,
    nan: f32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let pos = ABSOLUTE_POS;
    if pos >= rows * split {
        terminate!();
    }
    let row = pos / split;
    let base = row * vocab;
    let t = i32::cast_from(targets[row]);
    let mut g = f32::cast_from(grad[row]);
    let l = lse[row];
    if t == ignore {
        g = 0.0;
    } else if !in_range(t, vocab) {
        g = nan;
    }
    let mut c = pos % split;
    while c < vocab {
        let mut x = g * f32::exp(f32::cast_from(logits[base + c]) - l);
        if c as i32 == t {
            x -= g;
        }
        dlogits[base + c] = F::cast_from(x);
        c += split;
    }
}
