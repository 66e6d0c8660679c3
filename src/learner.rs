//! The causal LM in Burn's `Learner` (burn-train; feature `learner`): [`TrainStep`] and
//! [`InferenceStep`] for [`KimiForCausalLM`], a dataset and a batcher for the synthetic tasks,
//! and burn-train metrics for the recall accuracy and the MoE layers' expert load.
//!
//! The balance update sits in the train step: [`TrainStep::optimize`] applies the optimiser and
//! then [`update_balance`](KimiForCausalLM::update_balance), so with burn-train's gradient
//! accumulation the QB histograms pool over every micro-batch of the step, as on one device with
//! [`accumulate_gradients`](crate::train::accumulate_gradients). burn-train's own checkpoints
//! record the model, so they keep the balance biases; the drift memory of QB with drift
//! compensation ([`BalancerKind::QuantileTrend`](crate::nn::BalancerKind::QuantileTrend)) is not
//! a module record and starts afresh on resume there (a few steps of plain QB), while
//! [`crate::checkpoint`] keeps it.
//!
//! burn-train's gradient accumulation sums the gradients of its micro-batches' *mean* losses:
//! `n` micro-batches give `n` times the gradient of the step's mean loss when each scores as
//! many targets, and weigh the micro-batches equally when they do not.
//! [`accumulate_gradients`](crate::train::accumulate_gradients) instead weighs each by its share
//! of the step's scored targets (the exact gradient of the step's mean loss). Muon's update does
//! not depend on the gradient's scale and AdamW's only through its ε, but a gradient-clipping
//! threshold does: scale it with `n` when moving between the two.
//!
//! burn-train's DDP strategy is not offered here: in Burn 0.21 it needs Burn's `distributed`
//! feature, under which `Autodiff<B>` is an autodiff backend only for backends with a
//! `DistributedBackend` (CUDA through NCCL), so a build with it cannot train on the CPU backend at
//! all. Data parallelism on every backend is `kimi_burn::parallel` (feature `collective`);
//! `docs/scaling.md` §5 has the details.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, ItemLazy, LossInput, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn::train::{InferenceStep, TrainOutput, TrainStep};

use crate::data::{accuracy_from_logits, masked_cross_entropy, Accuracy, SeededRng, Task};
use crate::model::KimiForCausalLM;
use crate::nn::MoeStats;

/// One sequence of a synthetic task: inputs and targets (`IGNORE_INDEX` where nothing is scored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// Input tokens.
    pub inputs: Vec<i64>,
    /// Target tokens.
    pub targets: Vec<i64>,
}

/// `len` sequences of a [`Task`], sequence `i` drawn from its own generator (seeded by `seed`
/// and `i`), so any item can be read in any order and a dataset with the same seed is the same
/// data.
#[derive(Debug, Clone)]
pub struct TaskDataset<T> {
    task: Arc<T>,
    len: usize,
    seed: u64,
}

impl<T: Task> TaskDataset<T> {
    /// `len` sequences of `task` for `seed`.
    pub fn new(task: T, len: usize, seed: u64) -> Self {
        Self {
            task: Arc::new(task),
            len,
            seed,
        }
    }
}

impl<T: Task + Send + Sync> Dataset<Sequence> for TaskDataset<T> {
    fn get(&self, index: usize) -> Option<Sequence> {
        if index >= self.len {
            return None;
        }
        // Item `i` draws from the seed's hash plus `i` (SplitMix64 decorrelates nearby seeds, so
        // each item is a stream of its own). Hashing the seed first keeps datasets of nearby
        // seeds apart: with `seed + i` alone, seeds 3 and 4 would share all but one item.
        let base = SeededRng::new(self.seed).next_u64();
        let mut rng = SeededRng::new(base.wrapping_add(index as u64));
        let batch = self.task.sample_batch(1, &mut rng);
        Some(Sequence {
            inputs: batch.inputs,
            targets: batch.targets,
        })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch of sequences on the device, `[batch, seq]` each.
#[derive(Debug, Clone)]
pub struct LmBatch<B: Backend> {
    /// Input tokens.
    pub inputs: Tensor<B, 2, Int>,
    /// Target tokens.
    pub targets: Tensor<B, 2, Int>,
}

/// Stacks [`Sequence`]s of one length into an [`LmBatch`].
///
/// # Panics
/// When the sequences differ in length (burn-train's `Batcher` cannot return an error; the
/// datasets of this module never mix lengths).
#[derive(Debug, Clone, Copy, Default)]
pub struct LmBatcher;

impl<B: Backend> Batcher<B, Sequence, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<Sequence>, device: &B::Device) -> LmBatch<B> {
        let seq = items.first().map_or(0, |s| s.inputs.len());
        assert!(
            items
                .iter()
                .all(|s| s.inputs.len() == seq && s.targets.len() == seq),
            "LmBatcher: sequences of different lengths in one batch"
        );
        let shape = [items.len(), seq];
        let inputs: Vec<i64> = items
            .iter()
            .flat_map(|s| s.inputs.iter().copied())
            .collect();
        let targets: Vec<i64> = items.into_iter().flat_map(|s| s.targets).collect();
        LmBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, shape), device),
            targets: Tensor::from_data(TensorData::new(targets, shape), device),
        }
    }
}

/// What a train or validation step reports to burn-train's metrics.
#[derive(Debug, Clone)]
pub struct LmOutput<B: Backend> {
    /// The batch's mean cross-entropy over scored targets, `[1]`.
    pub loss: Tensor<B, 1>,
    /// Arg-max accuracy on the scored targets.
    pub accuracy: Accuracy,
    /// Per MoE layer, the batch's expert-load statistics.
    pub moe_stats: Vec<MoeStats>,
}

/// The backend the metrics read from (as burn-train's own outputs do): the same metric then
/// serves training (an autodiff backend) and validation (its inner backend).
pub type MetricBackend = burn::backend::Flex;

impl<B: Backend> ItemLazy for LmOutput<B> {
    type ItemSync = LmOutput<MetricBackend>;

    fn sync(self) -> LmOutput<MetricBackend> {
        LmOutput {
            loss: Tensor::from_data(crate::sync::read(self.loss), &Default::default()),
            accuracy: self.accuracy,
            moe_stats: self.moe_stats,
        }
    }
}

impl<B: Backend> Adaptor<LossInput<B>> for LmOutput<B> {
    fn adapt(&self) -> LossInput<B> {
        LossInput::new(self.loss.clone())
    }
}

impl<B: Backend> Adaptor<RecallInput> for LmOutput<B> {
    fn adapt(&self) -> RecallInput {
        RecallInput(self.accuracy)
    }
}

impl<B: Backend> Adaptor<ExpertLoadInput> for LmOutput<B> {
    fn adapt(&self) -> ExpertLoadInput {
        ExpertLoadInput {
            max_violation: self.moe_stats.iter().map(|s| s.max_violation).collect(),
        }
    }
}

/// The forward, loss and accuracy of one batch.
fn forward<B: Backend>(
    model: &KimiForCausalLM<B>,
    batch: LmBatch<B>,
) -> (Tensor<B, 1>, LmOutput<B>) {
    let targets: Vec<i64> = crate::sync::read(batch.targets.clone())
        .iter::<i64>()
        .collect();
    let out = model
        .try_forward(batch.inputs, None, None)
        .unwrap_or_else(|e| panic!("kimi-burn learner step: {e}"));
    let accuracy = accuracy_from_logits(out.logits.clone(), &targets)
        .unwrap_or_else(|e| panic!("kimi-burn learner step: {e}"));
    let moe_stats = out.moe_stats();
    let loss = masked_cross_entropy(out.logits, batch.targets);
    let output = LmOutput {
        loss: loss.clone(),
        accuracy,
        moe_stats,
    };
    (loss, output)
}

/// # Panics
/// On a token outside the vocabulary (burn-train's steps cannot return an error).
impl<B: AutodiffBackend> TrainStep for KimiForCausalLM<B> {
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<LmOutput<B>> {
        // Forward and backward as one piece on rayon's pool on the CPU backends.
        let (grads, output) = crate::ops::backend::on_cpu_pool::<B, _>(|| {
            let (loss, mut output) = forward(self, batch);
            let grads = loss.backward();
            output.loss = output.loss.detach();
            (grads, output)
        });
        TrainOutput::new(self, grads, output)
    }

    /// The optimiser step, then the balance update of every MoE layer (once per optimiser step,
    /// after all accumulated micro-batches).
    fn optimize<B2, O>(self, optim: &mut O, lr: f64, grads: GradientsParams) -> Self
    where
        B2: AutodiffBackend,
        O: Optimizer<Self, B2>,
        Self: AutodiffModule<B2>,
    {
        let model = optim.step(lr, self, grads);
        model.update_balance();
        model
    }
}

/// # Panics
/// On a token outside the vocabulary.
impl<B: Backend> InferenceStep for KimiForCausalLM<B> {
    type Input = LmBatch<B>;
    type Output = LmOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> LmOutput<B> {
        forward(self, batch).1
    }
}

/// A batch statistic that a [`BatchMetric`] reports: its value, its weight in the epoch's
/// running mean, and how burn-train should label it.
pub trait BatchStatistic: Send + Sync + 'static {
    /// The metric's name in burn-train's UI.
    const NAME: &'static str;
    /// Its unit, if any.
    const UNIT: Option<&'static str>;
    /// Whether larger values are better.
    const HIGHER_IS_BETTER: bool;
    /// Decimals shown.
    const PRECISION: usize;
    /// The batch's value and its weight in the running mean.
    fn value(&self) -> (f64, usize);
}

/// A numeric burn-train metric of one [`BatchStatistic`], averaged over the epoch.
pub struct BatchMetric<S> {
    name: MetricName,
    state: NumericMetricState,
    _statistic: std::marker::PhantomData<fn() -> S>,
}

impl<S> Clone for BatchMetric<S> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            state: self.state.clone(),
            _statistic: std::marker::PhantomData,
        }
    }
}

impl<S: BatchStatistic> Default for BatchMetric<S> {
    fn default() -> Self {
        Self {
            name: Arc::new(S::NAME.into()),
            state: NumericMetricState::default(),
            _statistic: std::marker::PhantomData,
        }
    }
}

impl<S: BatchStatistic> Metric for BatchMetric<S> {
    type Input = S;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn update(&mut self, item: &S, _: &MetricMetadata) -> SerializedEntry {
        let (value, weight) = item.value();
        let mut format = FormatOptions::new(self.name()).precision(S::PRECISION);
        if let Some(unit) = S::UNIT {
            format = format.unit(unit);
        }
        self.state.update(value, weight, format)
    }

    fn clear(&mut self) {
        self.state.reset();
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: S::UNIT.map(Into::into),
            higher_is_better: S::HIGHER_IS_BETTER,
        }
        .into()
    }
}

impl<S: BatchStatistic> Numeric for BatchMetric<S> {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}

/// Input of [`RecallMetric`].
#[derive(Debug, Clone, Copy)]
pub struct RecallInput(pub Accuracy);

impl BatchStatistic for RecallInput {
    const NAME: &'static str = "Recall accuracy";
    const UNIT: Option<&'static str> = Some("%");
    const HIGHER_IS_BETTER: bool = true;
    const PRECISION: usize = 2;

    fn value(&self) -> (f64, usize) {
        (
            100.0 * self.0.fraction().unwrap_or(0.0),
            self.0.total.max(1),
        )
    }
}

/// Arg-max accuracy on the scored targets (the recall of MQAR), in percent.
pub type RecallMetric = BatchMetric<RecallInput>;

/// Input of [`ExpertLoadMetric`]: each MoE layer's max violation on the batch.
#[derive(Debug, Clone)]
pub struct ExpertLoadInput {
    /// `max_j load_j / mean_load − 1` per MoE layer.
    pub max_violation: Vec<f32>,
}

impl BatchStatistic for ExpertLoadInput {
    const NAME: &'static str = "Expert load (max violation)";
    const UNIT: Option<&'static str> = None;
    const HIGHER_IS_BETTER: bool = false;
    const PRECISION: usize = 3;

    fn value(&self) -> (f64, usize) {
        let worst = self.max_violation.iter().copied().fold(0.0f32, f32::max);
        (f64::from(worst), 1)
    }
}

/// The expert load of the MoE layers: the largest max violation over the layers
/// (`max_j load_j / mean_load − 1`, 0 for a perfect balance; design §2), per batch.
pub type ExpertLoadMetric = BatchMetric<ExpertLoadInput>;
