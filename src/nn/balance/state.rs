//! A layer's balance as a Burn module: the expert bias (a saved buffer with a host copy) and the
//! balancer's counts, pending on the device until an optimiser step reads them.

use std::sync::{Arc, Mutex};

use burn::module::{
    AutodiffModule, Content, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper,
    ModuleVisitor, Param, ParamId,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{backend::Backend, DType, FloatDType, Int, Tensor, TensorData};

use super::{AnyBalancer, Balancer, BalancerKind, DriftMemory, HistogramSpec, RoutedBatch};
use crate::error::{Error, Result};
use crate::ops::moe::route::to_host_f32;

/// The device side of a layer's balance: the expert bias `[n]` (checkpoint name
/// `e_score_correction_bias`) with a host copy that every write keeps in step, and the counts
/// observed on the device since they were last read.
///
/// Routing reads the host copy, so a forward needs no read of the bias. Writes go through
/// [`BalanceState::set_bias`] / [`BalanceState::update`] and loading a record; both copies
/// change together. A [`ModuleMapper`] that rewrites the bias's *values* (rather than its device
/// or dtype) leaves the host copy behind: call [`BiasState::resync`] after it. The record is a
/// `Param<Tensor<B, 1>>`, as Burn's `RunningState` records it, so checkpoints written before
/// this type load unchanged.
///
/// Clones share the state (as `RunningState`'s do).
#[derive(Clone, Debug)]
pub struct BiasState<B: Backend> {
    id: ParamId,
    inner: Arc<Mutex<BiasInner<B>>>,
}

#[derive(Clone, Debug)]
struct BiasInner<B: Backend> {
    device: Tensor<B, 1>,
    host: Vec<f32>,
    /// Counts accumulated on the device since the last read, flattened as the balancer's
    /// [`counts`](super::Balancer::counts).
    pending: Option<Tensor<B, 1, Int>>,
}

impl<B: Backend> BiasState<B> {
    fn new(host: Vec<f32>, device: &B::Device) -> Self {
        let n = host.len();
        Self {
            id: ParamId::new(),
            inner: Arc::new(Mutex::new(BiasInner {
                device: Tensor::from_data(TensorData::new(host.clone(), [n]), (device, DType::F32)),
                host,
                pending: None,
            })),
        }
    }

    fn with_device(id: ParamId, device: Tensor<B, 1>, host: Vec<f32>) -> Self {
        Self {
            id,
            inner: Arc::new(Mutex::new(BiasInner {
                device,
                host,
                pending: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BiasInner<B>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bias on the device.
    pub fn value(&self) -> Tensor<B, 1> {
        self.lock().device.clone()
    }

    /// The bias on the host (no read: the host copy).
    pub fn host(&self) -> Vec<f32> {
        self.lock().host.clone()
    }

    /// Writes both copies.
    fn set(&self, bias: &[f32]) {
        let mut inner = self.lock();
        let device = inner.device.device();
        inner.device = Tensor::from_data(
            TensorData::new(bias.to_vec(), [bias.len()]),
            (&device, DType::F32),
        );
        inner.host = bias.to_vec();
    }

    /// Reads the device bias back into the host copy (one read), after a [`ModuleMapper`] that
    /// changed its values.
    pub fn resync(&self) {
        let mut inner = self.lock();
        inner.host = to_host_f32(inner.device.clone());
    }

    /// Adds counts gathered on the device to the pending ones (no read).
    fn add_pending(&self, counts: Tensor<B, 1, Int>) {
        let mut inner = self.lock();
        inner.pending = Some(match inner.pending.take() {
            Some(acc) => acc.add(counts),
            None => counts,
        });
    }

    /// Takes the pending device counts to the host (one read), if there are any.
    fn take_pending(&self) -> Option<Vec<u64>> {
        let pending = self.lock().pending.take()?;
        Some(
            crate::sync::read(pending)
                .iter::<i64>()
                .map(|c| c.max(0) as u64)
                .collect(),
        )
    }
}

impl<B: Backend> core::fmt::Display for BiasState<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "BiasState")
    }
}

impl<B: Backend> ModuleDisplayDefault for BiasState<B> {
    fn content(&self, content: Content) -> Option<Content> {
        content.add_formatted(&"BiasState".to_string()).optional()
    }
}

impl<B: Backend> ModuleDisplay for BiasState<B> {}

impl<B: Backend> Module<B> for BiasState<B> {
    type Record = Param<Tensor<B, 1>>;

    fn collect_devices(&self, mut devices: Vec<B::Device>) -> Vec<B::Device> {
        let device = self.lock().device.device();
        if !devices.contains(&device) {
            devices.push(device);
        }
        devices
    }

    /// A copy of its own on `device` (the replicas and devices of data parallelism must not
    /// share one bias state), counts pending on the device included.
    fn fork(self, device: &B::Device) -> Self {
        let inner = self.lock().clone();
        Self {
            id: self.id,
            inner: Arc::new(Mutex::new(BiasInner {
                device: inner.device.to_device(device),
                host: inner.host,
                pending: inner.pending.map(|p| p.to_device(device)),
            })),
        }
    }

    fn to_device(self, device: &B::Device) -> Self {
        {
            let mut inner = self.lock();
            inner.device = inner.device.clone().to_device(device);
            inner.pending = inner.pending.take().map(|p| p.to_device(device));
        }
        self
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        visitor.visit_float(&Param::initialized(self.id, self.value()))
    }

    fn map<M: ModuleMapper<B>>(self, mapper: &mut M) -> Self {
        let (_, tensor, _) = mapper
            .map_float(Param::initialized(self.id, self.value()))
            .consume();
        self.lock().device = tensor;
        self
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        let device = self.lock().device.device();
        // A record's float tensor comes back in the backend's float type: on a half backend
        // the bias has been rounded to it (the crate's safetensors files keep it exact).
        let value = record.val().to_device(&device).cast(FloatDType::F32);
        {
            let mut inner = self.lock();
            inner.host = to_host_f32(value.clone());
            inner.device = value;
        }
        self.id = record.id;
        self
    }

    fn into_record(self) -> Self::Record {
        Param::initialized(self.id, self.value())
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for BiasState<B> {
    type InnerModule = BiasState<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        let inner = self.lock();
        BiasState::with_device(self.id, inner.device.clone().inner(), inner.host.clone())
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        let inner = module.lock();
        BiasState::with_device(
            module.id,
            Tensor::from_inner(inner.device.clone()),
            inner.host.clone(),
        )
    }
}

/// The balance state of one MoE layer: the expert bias `[n]` (a saved buffer, checkpoint name
/// `e_score_correction_bias`, with a host copy: [`BiasState`]) and the balancer's accumulated
/// counts (not saved), on the host or, from the kernel path, on the device until the balance
/// update reads them (one read per optimiser step).
///
/// Cloning the module shares the accumulator, so clones made for evaluation keep feeding the
/// same statistics; call [`update`](BalanceState::update) once per optimiser step.
#[derive(Module, Debug)]
pub struct BalanceState<B: Backend> {
    /// The expert bias `b` added to the scores for selection only.
    pub bias: BiasState<B>,
    #[module(skip)]
    acc: Arc<Mutex<Option<AnyBalancer>>>,
}

impl<B: Backend> BalanceState<B> {
    /// A zero bias for `experts` experts and the balancer `kind`.
    pub fn new(experts: usize, kind: BalancerKind, device: &B::Device) -> Result<Self> {
        Ok(Self {
            bias: BiasState::new(vec![0.0; experts], device),
            acc: Arc::new(Mutex::new(kind.build(experts)?)),
        })
    }

    /// The current bias on the host (its host copy: no device read).
    pub fn bias_host(&self) -> Vec<f32> {
        self.bias.host()
    }

    /// Replaces the bias (e.g. after loading a checkpoint or an all-reduce).
    pub fn set_bias(&self, bias: &[f32]) {
        self.bias.set(bias);
    }

    /// Accumulates one routed batch into the balancer (no-op without a balancer).
    pub fn observe(&self, batch: &RoutedBatch<'_>) -> Result<()> {
        match self.lock().as_mut() {
            Some(b) => b.inner().observe(batch),
            None => Ok(()),
        }
    }

    /// The QB histogram a batch routed with `bias` should be counted over, for a fused kernel
    /// (`None` unless the balancer is QB).
    pub fn histogram_spec(&self, bias: &[f32]) -> Option<HistogramSpec> {
        match self.lock().as_ref() {
            Some(AnyBalancer::Quantile(q)) => Some(q.histogram_spec(bias)),
            _ => None,
        }
    }

    /// Accumulates QB counts a fused kernel gathered over [`histogram_spec`](Self::histogram_spec)
    /// for one batch routed with `bias` and `k` experts per token.
    ///
    /// Errors when the balancer is not QB, or as [`QuantileBalancer::observe_counts`].
    ///
    /// [`QuantileBalancer::observe_counts`]: super::QuantileBalancer::observe_counts
    pub fn observe_histogram(&self, counts: &[u64], bias: &[f32], k: usize) -> Result<()> {
        match self.lock().as_mut() {
            Some(AnyBalancer::Quantile(q)) => q.observe_counts(counts, bias, k),
            _ => Err(Error::argument(
                "counts",
                "a QB histogram was given to a balancer that is not QB",
            )),
        }
    }

    /// Accumulates the device counts of one batch routed with `bias` and `k` experts per token,
    /// without reading them: the QB histogram `[n, bins]` of the fused routing kernel, or for the
    /// sign rule the expert loads `[n]` ([`expert_loads`]). They are read, once for all the
    /// batches observed so far, by [`update`](Self::update), [`counts`](Self::counts) or
    /// [`merge`](Self::merge). No-op without a balancer.
    ///
    /// Errors on counts of the wrong size, or when QB's bounds or `k` changed since the last
    /// update.
    ///
    /// [`expert_loads`]: super::expert_loads
    pub fn observe_device<const D: usize>(
        &self,
        counts: Tensor<B, D, Int>,
        bias: &[f32],
        k: usize,
    ) -> Result<()> {
        let mut guard = self.lock();
        let Some(balancer) = guard.as_mut() else {
            return Ok(());
        };
        let expected = balancer.inner().counts().len();
        let dims = counts.dims();
        if counts.shape().num_elements() != expected {
            return Err(Error::shape(
                "device counts",
                format!("{expected} counts"),
                dims,
            ));
        }
        if let AnyBalancer::Quantile(q) = balancer {
            q.begin(bias, k)?;
            q.pending = true;
        }
        self.bias.add_pending(counts.reshape([expected]));
        Ok(())
    }

    /// Moves counts pending on the device into the balancer (one read, if there are any).
    fn flush(&self) -> Result<()> {
        match self.bias.take_pending() {
            Some(counts) => match self.lock().as_mut() {
                Some(b) => b.inner().merge(&counts),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// Applies the balancer's update to the bias and clears its counts. Returns the new bias.
    /// Reads the counts observed on the device, if any (one read).
    pub fn update(&self) -> Vec<f32> {
        let bias = self.bias_host();
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        let next = match self.lock().as_mut() {
            Some(b) => b.inner().update(&bias),
            None => return bias,
        };
        self.set_bias(&next);
        next
    }

    /// The drift memory of QB with drift compensation ([`BalancerKind::QuantileTrend`]); `None`
    /// for every other balancer.
    pub fn drift_memory(&self) -> Option<DriftMemory> {
        match self.lock().as_ref() {
            Some(AnyBalancer::Quantile(q)) => q.drift_memory().cloned(),
            _ => None,
        }
    }

    /// Restores a drift memory (from [`drift_memory`](Self::drift_memory) of the same layer).
    /// `None` forgets the drift. Errors when `Some` is given to a layer whose balancer keeps no
    /// drift memory, or on vectors of the wrong length.
    pub fn set_drift_memory(&self, memory: Option<DriftMemory>) -> Result<()> {
        let mut guard = self.lock();
        match (guard.as_mut(), memory) {
            (Some(AnyBalancer::Quantile(q)), Some(m)) => q.set_drift_memory(m),
            (Some(AnyBalancer::Quantile(q)), None) => {
                q.forget_drift();
                Ok(())
            }
            (_, None) => Ok(()),
            (_, Some(_)) => Err(Error::argument(
                "drift memory",
                "this layer's balancer is not QB with drift compensation",
            )),
        }
    }

    /// Forgets QB's drift estimate ([`BalancerKind::QuantileTrend`]) after a change of data: the
    /// next update routes with QB's set as it is. No-op for other balancers.
    pub fn forget_drift(&self) {
        if let Some(AnyBalancer::Quantile(q)) = self.lock().as_mut() {
            q.forget_drift();
        }
    }

    /// Whether the balancer is QB (plain or with drift compensation).
    pub fn is_quantile(&self) -> bool {
        matches!(self.lock().as_ref(), Some(AnyBalancer::Quantile(_)))
    }

    /// One calibration sweep's QB set from the counts so far (which it clears), without drift
    /// compensation and leaving the drift memory alone. Errors unless the balancer is QB;
    /// `Ok(None)` with no counts.
    pub(crate) fn take_quantile_set(&self) -> Result<Option<Vec<f32>>> {
        self.flush()?;
        match self.lock().as_mut() {
            Some(AnyBalancer::Quantile(q)) => Ok(q.take_set()),
            _ => Err(Error::argument(
                "balancer",
                "calibrating the bias needs Quantile Balancing (plain or with drift compensation)",
            )),
        }
    }

    /// The raw integer counts accumulated since the last update (empty without a balancer),
    /// reading those pending on the device (one read, if there are any).
    pub fn counts(&self) -> Vec<u64> {
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        self.lock()
            .as_mut()
            .map(|b| b.inner().counts().to_vec())
            .unwrap_or_default()
    }

    /// The number of counts [`counts`](Self::counts) returns, without copying them.
    pub fn counts_len(&self) -> usize {
        self.lock().as_mut().map_or(0, |b| b.inner().counts().len())
    }

    /// A copy for another data-parallel replica on `device`: the same bias and balancer state
    /// (counts included), sharing nothing with `self`. A plain `clone` shares the accumulator
    /// and the bias state, which is what an evaluation copy wants and a replica must not have.
    pub fn replica(&self, device: &B::Device) -> Self {
        self.flush()
            .unwrap_or_else(|e| unreachable!("device counts have the balancer's size: {e}"));
        let acc = self.lock().clone();
        let bias = BiasState::with_device(
            self.bias.id,
            self.bias.value().to_device(device),
            self.bias.host(),
        );
        Self {
            bias,
            acc: Arc::new(Mutex::new(acc)),
        }
    }

    /// Gives a QB balancer the router's top-k before its first batch, so that counts merged
    /// from other replicas pool even before this replica has routed anything (see
    /// [`merge`](Self::merge)). No-op for the other balancers.
    pub(crate) fn set_top_k(&self, k: usize) {
        if let Some(AnyBalancer::Quantile(q)) = self.lock().as_mut() {
            q.set_top_k(k);
        }
    }

    /// Adds another replica's counts (one integer all-reduce) before [`update`](Self::update).
    ///
    /// A replica that routed nothing since its last update (no share of this step's batch) then
    /// updates to the same bias as the others. A QB balancer needs its router's top-k for that: a
    /// `LatentMoe`'s knows it from the start, one built alone once it has observed a batch.
    pub fn merge(&self, counts: &[u64]) -> Result<()> {
        self.flush()?;
        let bias = self.bias.host();
        match self.lock().as_mut() {
            Some(AnyBalancer::Quantile(q)) => {
                q.merge(counts)?;
                q.adopt_merged(&bias)
            }
            Some(b) => b.inner().merge(counts),
            None => Ok(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AnyBalancer>> {
        // A poisoned lock only means another thread panicked mid-observe; the counts are plain
        // integers and stay usable.
        self.acc.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Moves the counts pending on the device of every state in `states` to their balancers with
/// **one** read for all of them (their pending tensors joined on the first one's device), so that
/// the [`update`](BalanceState::update)s and [`counts`](BalanceState::counts) that follow read
/// nothing. States without pending counts are skipped; none at all reads nothing.
pub fn flush_all<B: Backend>(states: &[&BalanceState<B>]) -> Result<()> {
    let pending: Vec<(&BalanceState<B>, Tensor<B, 1, Int>)> = states
        .iter()
        .filter_map(|s| Some((*s, s.bias.lock().pending.take()?)))
        .collect();
    let Some((_, first)) = pending.first() else {
        return Ok(());
    };
    let device = first.device();
    let lens: Vec<usize> = pending.iter().map(|(_, t)| t.dims()[0]).collect();
    let joined = Tensor::cat(
        pending
            .iter()
            .map(|(_, t)| t.clone().to_device(&device))
            .collect(),
        0,
    );
    let counts: Vec<u64> = crate::sync::read(joined)
        .iter::<i64>()
        .map(|c| c.max(0) as u64)
        .collect();
    let mut at = 0;
    for ((state, _), len) in pending.iter().zip(lens) {
        if let Some(b) = state.lock().as_mut() {
            b.inner().merge(&counts[at..at + len])?;
        }
        at += len;
    }
    Ok(())
}
