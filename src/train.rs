//! One training step's gradients for the causal LM: a batch cut into micro-batches (gradient
//! accumulation), each micro-batch's loss weighted so that the summed gradients are those of the
//! mean loss over a larger batch (the whole step's, or every data-parallel replica's together).
//!
//! The balancers of the MoE layers keep counting over all micro-batches until
//! [`KimiForCausalLM::update_balance`] (once per optimiser step), so one step's routing statistics
//! pool the whole batch (design §3).

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use crate::data::{masked_cross_entropy, Accuracy, Batch};
use crate::error::{Error, Result};
use crate::model::KimiForCausalLM;
#[cfg(doc)]
use crate::nn::MoeStats;

/// What [`accumulate_gradients`] returns for one step.
#[derive(Debug)]
pub struct StepGradients {
    /// The summed gradients of the micro-batches' weighted losses.
    pub grads: GradientsParams,
    /// The sum of the weighted losses: the batch's share of the mean loss over `scored_total`
    /// targets (the mean loss itself when the batch is the whole step).
    pub loss: f64,
    /// Arg-max accuracy on the batch's scored targets.
    pub accuracy: Accuracy,
    /// Per MoE layer, the tokens routed to each expert, summed over the micro-batches.
    pub loads: Vec<Vec<u64>>,
    /// Per MoE layer, the median selection margin ([`MoeStats::median_margin`]) when the step
    /// was one micro-batch routed on the host; `None` otherwise (margins do not pool).
    pub median_margins: Vec<Option<f32>>,
}

/// The gradients of one optimiser step over `batch`, in `parts` micro-batches of consecutive
/// sequences: one forward and one backward per micro-batch, micro-batch `i`'s mean loss weighted
/// by `scored_i / scored_total`.
///
/// `scored_total` is the number of scored targets the step averages over: `batch.scored()` on
/// one device; with data parallelism, that of the global batch (every replica's), so that the
/// replicas' gradients summed by an all-reduce are those of the global batch's mean loss.
///
/// Errors when `parts` does not divide the batch, when `scored_total` is smaller than the batch's
/// own scored targets, or when a forward fails (a token outside the vocabulary).
///
/// On the CPU backends the step runs on rayon's pool as one piece
/// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
pub fn accumulate_gradients<B: AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    batch: &Batch,
    parts: usize,
    scored_total: usize,
    device: &B::Device,
) -> Result<StepGradients> {
    if scored_total < batch.scored() {
        return Err(Error::argument(
            "scored_total",
            format!(
                "{scored_total} targets for the step, but this batch alone scores {}",
                batch.scored()
            ),
        ));
    }
    // On the CPU backends the whole step runs on rayon's pool as one piece.
    crate::ops::backend::on_cpu_pool::<B, _>(|| step(model, batch, parts, scored_total, device))
}

/// [`accumulate_gradients`] on this thread.
fn step<B: AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    batch: &Batch,
    parts: usize,
    scored_total: usize,
    device: &B::Device,
) -> Result<StepGradients> {
    let denominator = scored_total.max(1) as f64;
    let mut grads = GradientsAccumulator::new();
    // What the step reports is read after every micro-batch's backward is queued, so the
    // device never waits on the host between micro-batches.
    let mut reports = Vec::with_capacity(parts);
    for part in batch.split(parts)? {
        let (inputs, targets) = part.to_tensors::<B>(device);
        let out = model.try_forward(inputs, None, None)?;
        let predictions = out.logits.clone().detach().inner().argmax(2);
        let loss = masked_cross_entropy(out.logits, targets)
            .mul_scalar(part.scored() as f64 / denominator);
        reports.push((
            part,
            predictions,
            loss.clone().detach().inner(),
            out.moe_loads,
        ));
        grads.accumulate(model, GradientsParams::from_grads(loss.backward(), model));
    }
    let mut accuracy = Accuracy::default();
    let mut loss_value = 0.0;
    let mut loads: Vec<Vec<u64>> = Vec::new();
    let mut median_margins = Vec::new();
    for (part, predictions, loss, moe_loads) in reports {
        let predicted: Vec<i64> = crate::sync::read(predictions).iter::<i64>().collect();
        let a = crate::data::accuracy(&predicted, &part.targets)?;
        accuracy.correct += a.correct;
        accuracy.total += a.total;
        loss_value += crate::sync::read_scalar(loss);
        median_margins = moe_loads
            .iter()
            .map(|s| s.median_margin().filter(|_| parts == 1))
            .collect();
        loads.resize(moe_loads.len(), Vec::new());
        for (pooled, s) in loads.iter_mut().zip(&moe_loads) {
            let counted = s.tokens_per_expert();
            pooled.resize(counted.len(), 0);
            for (p, t) in pooled.iter_mut().zip(&counted) {
                *p += t;
            }
        }
    }
    Ok(StepGradients {
        grads: grads.grads(),
        loss: loss_value,
        accuracy,
        loads,
        median_margins,
    })
}

/// Releases what Burn's autodiff backend keeps of forwards that no backward consumed.
///
/// Burn 0.21 frees its per-operation bookkeeping only in a backward: a forward on an autodiff
/// backend that is never differentiated (evaluation through the training model, counting routed
/// tokens) leaves a few KB per operation behind, and about 0.6 MiB per forward of the tiny
/// model, even when no tensor requires a gradient. This runs the backward of a one-element
/// graph on `device`, which clears it. (A forward that *does* track parameters keeps its whole
/// graph, saved activations included, until its own output is differentiated: run such forwards
/// on a `no_grad()` copy of the module, or on `valid()`.)
pub fn release_autodiff_bookkeeping<B: AutodiffBackend>(device: &B::Device) {
    let one = Tensor::<B, 1>::zeros([1], device).require_grad();
    let _ = one.sum().backward();
}
