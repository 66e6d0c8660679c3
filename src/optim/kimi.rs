//! The Kimi optimiser: Muon (whole matrix or per head) for hidden matrices, AdamW for the rest,
//! each parameter routed by its [`ParamRole`] (design §8).

use std::marker::PhantomData;

use burn::config::Config;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::{GradAdaptor, OptimizerAdaptor};
use burn::optim::momentum::{Momentum, MomentumConfig};
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    AdamWConfig, GradientsParams, LearningRate, MultiGradientsParams, Muon, MuonState, Optimizer,
    SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Device, Tensor};

use super::adamw::KimiAdamW;
use super::head_muon::{apply_update, moonlight_scale, Blocking, HeadMuon};
use super::newton_schulz::newton_schulz_batched;
use super::roles::{HeadSplit, ParamRole, ParamRoles};
use crate::error::{Error, Result};

/// Configuration of [`KimiOptimizer`]. Defaults follow Moonlight (design §8): μ = 0.95 without
/// Nesterov, 5 Newton–Schulz steps, weight decay 0.1 in both groups, one shared learning rate.
#[derive(Config, Debug)]
pub struct KimiOptimizerConfig {
    /// Muon momentum `μ` in `M ← μM + G`.
    #[config(default = 0.95)]
    pub momentum: f64,
    /// Nesterov momentum for Muon (orthogonalise `μM + G` instead of `M`).
    #[config(default = false)]
    pub nesterov: bool,
    /// Newton–Schulz iterations per Muon step.
    #[config(default = 5)]
    pub ns_steps: usize,
    /// Muon's decoupled weight decay `λ` in `W ← W(1 − ηλ)`.
    #[config(default = 0.1)]
    pub muon_weight_decay: f64,
    /// Muon's learning rate is `muon_lr_scale` times the scheduler's.
    #[config(default = 1.0)]
    pub muon_lr_scale: f64,
    /// AdamW's learning rate is `adamw_lr_scale` times the scheduler's.
    #[config(default = 1.0)]
    pub adamw_lr_scale: f64,
    /// AdamW for the parameters Muon does not take (its weight decay and gradient clipping
    /// apply to that group only).
    #[config(
        default = "AdamWConfig::new().with_beta_2(0.95).with_epsilon(1e-8).with_weight_decay(0.1)"
    )]
    pub adamw: AdamWConfig,
}

impl KimiOptimizerConfig {
    /// The optimiser for `module` with parameter roles `roles`.
    ///
    /// Errors when a hyper-parameter is out of range (`momentum ∉ [0, 1)`, `ns_steps == 0`, a
    /// negative or non-finite decay or learning-rate scale) or when `roles` does not fit the
    /// module ([`ParamRoles::validate`]).
    pub fn init<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
        roles: ParamRoles,
    ) -> Result<KimiOptimizer<M, B>> {
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(Error::config(
                "momentum",
                format!("must lie in [0, 1), got {}", self.momentum),
            ));
        }
        if self.ns_steps == 0 {
            return Err(Error::config("ns_steps", "must be at least 1, got 0"));
        }
        for (field, value) in [
            ("muon_weight_decay", self.muon_weight_decay),
            ("muon_lr_scale", self.muon_lr_scale),
            ("adamw_lr_scale", self.adamw_lr_scale),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::config(
                    field,
                    format!("must be finite and ≥ 0, got {value}"),
                ));
            }
        }
        roles.validate(module)?;
        Ok(KimiOptimizer {
            whole: Default::default(),
            blocks: Default::default(),
            momentum: Momentum::new(&self.momentum_config()),
            apply: OptimizerAdaptor::from(ApplyUpdate {
                weight_decay: self.muon_weight_decay as f32,
            }),
            adamw: KimiAdamW::init(&self.adamw)?,
            roles,
            config: self.clone(),
        })
    }

    fn momentum_config(&self) -> MomentumConfig {
        MomentumConfig {
            momentum: self.momentum,
            dampening: 0.0,
            nesterov: self.nesterov,
        }
    }
}

/// The record of one adaptor: `HashMap<ParamId, AdaptorRecord<O, B>>`.
type AdaptorRecordOf<O, M, B> = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record;

/// The Muon states of whole 2-D matrices, in the record format of Burn's `Muon` adaptor.
type WholeRecord<M, B> = AdaptorRecordOf<Muon<<B as AutodiffBackend>::InnerBackend>, M, B>;

/// The Muon states of per-head and stacked parameters, in the record format of a [`HeadMuon`]
/// adaptor.
type HeadMuonRecord<M, B> = AdaptorRecordOf<HeadMuon<<B as AutodiffBackend>::InnerBackend>, M, B>;

/// Muon for hidden matrices and AdamW for everything else, each parameter routed by its
/// [`ParamRole`] (design §8). Implements Burn's [`Optimizer`], so it drops into any training loop.
///
/// Each step splits the gradients by role:
///
/// - Muon, whole 2-D matrices, per-head splits and stacked (≥3-D) matrices alike:
///   `M ← μM + G` (Nesterov optional), then `W ← W(1 − ηλ) − η·0.2·sqrt(max(A, B))·NS(M)` for
///   every block, where a block is a whole matrix, one head of a split ([`HeadSplit`]) or one
///   matrix of a stack, with its own `[A, B]` (per head: reconstruction, design §8). It is the
///   update of Burn's `Muon` with `AdjustLrFn::MatchRmsAdamW` for a whole matrix and of
///   [`HeadMuon`] for the others;
/// - everything else: AdamW as Burn's `AdamW` computes it ([`KimiAdamW`]: one
///   fused kernel per parameter on the CubeCL backends, Burn's own tensor ops elsewhere).
///
/// Muon orthogonalises **all blocks of the same shape at once**, across parameters: one batched
/// Newton–Schulz per distinct block shape (a block and its transpose count as one) and device,
/// instead of one per parameter. Each block is still normalised and iterated on its own
/// ([`newton_schulz_batched`]), so the result is that of
/// orthogonalising the parameters one by one, in far fewer and larger matrix products: the
/// model's Q, K, V, expert and FFN matrices share a handful of shapes.
///
/// Muon uses momentum `μ`, decoupled decay `λ` and the learning rate `η = muon_lr_scale · lr`;
/// AdamW uses `adamw_lr_scale · lr` and its own config. Like [`HeadMuon`] (and design §8), Muon
/// normalises by `‖X‖_F + 1e-7` and iterates in f32 (half precision is widened and cast back).
///
/// A parameter without a gradient (frozen, or a buffer such as the MoE balance bias) is never
/// touched. With gradients from several devices ([`Optimizer::step_multi`]) each parameter is
/// updated on the device Burn's adaptors would pick, and blocks are batched per device.
///
/// The record is the tuple `(muon, head_muon, adamw)` of per-parameter states, in the formats of
/// Burn's `Muon`, [`HeadMuon`] and `AdamW` adaptors (the AdamW states are Burn's `AdamWState`);
/// [`Optimizer::load_record`] keeps the Muon states of parameters whose role is still Muon, also
/// where a parameter moved between whole-matrix and per-head Muon (the momentum has the
/// parameter's shape either way); states of parameters now under AdamW are dropped.
pub struct KimiOptimizer<M: AutodiffModule<B>, B: AutodiffBackend> {
    /// Momentum states of whole 2-D matrices.
    whole: WholeRecord<M, B>,
    /// Momentum states of per-head and stacked parameters.
    blocks: HeadMuonRecord<M, B>,
    momentum: Momentum<B::InnerBackend>,
    /// Applies the orthogonalised updates (decay included) through Burn's adaptor, which moves
    /// each parameter to its gradient's device and keeps its autodiff flags.
    apply: OptimizerAdaptor<ApplyUpdate, M, B>,
    adamw: OptimizerAdaptor<KimiAdamW, M, B>,
    roles: ParamRoles,
    config: KimiOptimizerConfig,
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Clone for KimiOptimizer<M, B> {
    fn clone(&self) -> Self {
        Self {
            whole: self.whole.clone(),
            blocks: self.blocks.clone(),
            momentum: self.momentum.clone(),
            apply: self.apply.clone(),
            adamw: self.adamw.clone(),
            roles: self.roles.clone(),
            config: self.config.clone(),
        }
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> KimiOptimizer<M, B> {
    /// The parameter roles this optimiser routes by.
    pub fn roles(&self) -> &ParamRoles {
        &self.roles
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &KimiOptimizerConfig {
        &self.config
    }

    /// Moves each gradient of `source` into its group, visiting the module for ids and ranks.
    fn split(&self, module: &M, source: &mut GradientsParams) -> Groups<GradientsParams> {
        let mut splitter = Splitter::<B> {
            roles: &self.roles,
            source,
            groups: Groups::default(),
            backend: PhantomData,
        };
        module.visit(&mut splitter);
        splitter.groups
    }

    fn apply<G: GradSet<M, B>>(&mut self, lr: LearningRate, module: M, groups: Groups<G>) -> M {
        let module = if groups.muon.is_empty() {
            module
        } else {
            let updates = self.muon_updates(&module, groups.muon.into_adaptor());
            let muon_lr = lr * self.config.muon_lr_scale;
            self.apply.step(muon_lr, module, updates)
        };
        groups
            .adamw
            .step(&mut self.adamw, lr * self.config.adamw_lr_scale, module)
    }

    /// Advances the momentum of every Muon parameter that has a gradient and returns its
    /// orthogonalised, scaled update `0.2·sqrt(max(A, B))·NS(M)` (on the gradient's device).
    fn muon_updates(&mut self, module: &M, grads: GradAdaptor) -> GradientsParams {
        let mut collector = Collector::<B, M> {
            roles: &self.roles,
            grads,
            whole: &mut self.whole,
            blocks: &mut self.blocks,
            momentum: &self.momentum,
            buckets: Vec::new(),
            pending: Vec::new(),
        };
        module.visit(&mut collector);
        collector.finish(self.config.ns_steps)
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Optimizer<M, B> for KimiOptimizer<M, B> {
    type Record = (
        WholeRecord<M, B>,
        HeadMuonRecord<M, B>,
        AdaptorRecordOf<KimiAdamW, M, B>,
    );

    /// On the CPU backends the step runs on rayon's pool as one piece
    /// ([`on_cpu_pool`](crate::ops::backend::on_cpu_pool)).
    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        crate::ops::backend::on_cpu_pool::<B, _>(|| {
            let groups = self.split(&module, &mut grads);
            self.apply(lr, module, groups)
        })
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        crate::ops::backend::on_cpu_pool::<B, _>(|| {
            // Every group keeps one entry per device, in the original order: Burn picks the
            // device that accumulates a parameter by its index in this list.
            let mut groups = Groups::<MultiGradientsParams>::default();
            for (mut device_grads, device) in grads.grads {
                let device_groups = self.split(&module, &mut device_grads);
                groups.muon.grads.push((device_groups.muon, device));
                groups.adamw.grads.push((device_groups.adamw, device));
            }
            self.apply(lr, module, groups)
        })
    }

    fn to_record(&self) -> Self::Record {
        (
            self.whole.clone(),
            self.blocks.clone(),
            self.adamw.to_record(),
        )
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        let (whole, blocks, adamw) = record;
        let roles = &self.roles;
        let is_muon = |id: &ParamId| matches!(roles.get(*id), ParamRole::Muon { .. });
        self.whole = whole.into_iter().filter(|(id, _)| is_muon(id)).collect();
        self.blocks = blocks.into_iter().filter(|(id, _)| is_muon(id)).collect();
        self.adamw = self.adamw.load_record(adamw);
        self
    }
}

/// The gradients of one step, split by optimiser group.
#[derive(Default)]
struct Groups<G> {
    muon: G,
    adamw: G,
}

/// Where a Muon gradient of rank `D` with role `role` goes: its momentum state's record and
/// the blocks it is cut into (`None`: AdamW).
fn route(role: ParamRole, rank: usize) -> Option<Route> {
    match role {
        // `validate` keeps Muon off vectors; should one slip through, AdamW is the safe choice.
        ParamRole::Muon { .. } if rank < 2 => None,
        ParamRole::Muon { heads: None } if rank == 2 => Some(Route::Whole),
        ParamRole::Muon { heads } => Some(Route::Blocks(heads)),
        ParamRole::AdamW => None,
    }
}

/// A Muon parameter: a whole 2-D matrix (Burn's `Muon` record), or per-head / stacked blocks
/// ([`HeadMuon`]'s record).
#[derive(Clone, Copy)]
enum Route {
    Whole,
    Blocks(Option<HeadSplit>),
}

impl Route {
    fn split(self) -> Option<HeadSplit> {
        match self {
            Route::Whole => None,
            Route::Blocks(split) => split,
        }
    }
}

/// Moves each gradient of `source` into its group.
struct Splitter<'a, B> {
    roles: &'a ParamRoles,
    source: &'a mut GradientsParams,
    groups: Groups<GradientsParams>,
    backend: PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Splitter<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // Gradients are stored on the inner backend (as Burn's adaptors read them).
        let Some(grad) = self.source.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let group = match route(self.roles.get(param.id), D) {
            Some(_) => &mut self.groups.muon,
            None => &mut self.groups.adamw,
        };
        group.register(param.id, grad);
    }
}

/// Registers one parameter's update, `[blocks, rows, cols]` put back into its own shape.
type Finish<B> = Box<dyn FnOnce(Tensor<B, 3>, &mut GradientsParams)>;

/// The blocks of one shape on one device, to be orthogonalised in one batch.
struct Bucket<B: Backend> {
    device: Device<B>,
    /// `[rows, cols]` with `rows ≤ cols` (taller blocks are transposed into it).
    shape: [usize; 2],
    parts: Vec<Tensor<B, 3>>,
    len: usize,
}

/// A parameter waiting for its bucket's Newton–Schulz.
struct Pending<B: Backend> {
    bucket: usize,
    start: usize,
    count: usize,
    transposed: bool,
    scale: f64,
    finish: Finish<B>,
}

/// Steps the momentum of every Muon parameter and gathers its blocks by shape and device.
struct Collector<'a, B: AutodiffBackend, M: AutodiffModule<B>> {
    roles: &'a ParamRoles,
    grads: GradAdaptor,
    whole: &'a mut WholeRecord<M, B>,
    blocks: &'a mut HeadMuonRecord<M, B>,
    momentum: &'a Momentum<B::InnerBackend>,
    buckets: Vec<Bucket<B::InnerBackend>>,
    pending: Vec<Pending<B::InnerBackend>>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Collector<'_, B, M> {
    /// Orthogonalises every bucket in one batched Newton–Schulz and returns the scaled updates.
    fn finish(self, ns_steps: usize) -> GradientsParams {
        let outputs: Vec<Tensor<B::InnerBackend, 3>> = self
            .buckets
            .into_iter()
            .map(|mut bucket| {
                let stack = if bucket.parts.len() == 1 {
                    bucket.parts.pop().expect("one part")
                } else {
                    Tensor::cat(bucket.parts, 0)
                };
                newton_schulz_batched(stack, ns_steps)
            })
            .collect();
        let mut updates = GradientsParams::new();
        for pending in self.pending {
            let output = &outputs[pending.bucket];
            let blocks = if pending.count == output.dims()[0] {
                output.clone()
            } else {
                output.clone().narrow(0, pending.start, pending.count)
            };
            let blocks = if pending.transposed {
                blocks.swap_dims(1, 2)
            } else {
                blocks
            };
            (pending.finish)(blocks.mul_scalar(pending.scale), &mut updates);
        }
        updates
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> ModuleVisitor<B> for Collector<'_, B, M> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let id = param.id;
        let Some(route) = route(self.roles.get(id), D) else {
            return;
        };
        let Some((grad, device)) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return;
        };
        // The momentum has the parameter's shape under either route, so a state saved under the
        // other one (the role changed between a save and a load) carries over; both are removed,
        // so that no stale state stays in the record.
        let whole = self.whole.remove(&id).map(|r| r.into_state());
        let blocks = self.blocks.remove(&id).map(|r| r.into_state());
        let previous: Option<MuonState<B::InnerBackend, D>> = match route {
            Route::Whole => whole.or(blocks),
            Route::Blocks(_) => blocks.or(whole),
        };
        let previous = previous.map(|state| state.momentum.to_device(&device));
        let (m, velocity) = self.momentum.transform(grad, previous);
        let state = MuonState::new(velocity);
        match route {
            Route::Whole => {
                self.whole.insert(id, AdaptorRecord::from_state(state));
            }
            Route::Blocks(_) => {
                self.blocks.insert(id, AdaptorRecord::from_state(state));
            }
        }

        let dims = m.dims();
        let blocking = Blocking::new(&dims, route.split());
        let [rows, cols] = blocking.block;
        let transposed = rows > cols;
        let blocks = blocking.cut(m.reshape(blocking.stack));
        let blocks = if transposed {
            blocks.swap_dims(1, 2)
        } else {
            blocks
        };
        let shape = [rows.min(cols), rows.max(cols)];
        let index = match self
            .buckets
            .iter()
            .position(|b| b.shape == shape && b.device == device)
        {
            Some(index) => index,
            None => {
                self.buckets.push(Bucket {
                    device,
                    shape,
                    parts: Vec::new(),
                    len: 0,
                });
                self.buckets.len() - 1
            }
        };
        let bucket = &mut self.buckets[index];
        let count = blocking.count();
        self.pending.push(Pending {
            bucket: index,
            start: bucket.len,
            count,
            transposed,
            scale: moonlight_scale(rows, cols),
            finish: Box::new(move |update, updates| {
                updates.register::<B::InnerBackend, D>(id, blocking.join(update).reshape(dims))
            }),
        });
        bucket.parts.push(blocks);
        bucket.len += count;
    }
}

/// Applies a precomputed Muon update (passed as the "gradient") with
/// [`apply_update`]: `W ← W(1 − ηλ) − η·U`. Stateless.
#[derive(Clone)]
struct ApplyUpdate {
    weight_decay: f32,
}

impl<B: Backend> SimpleOptimizer<B> for ApplyUpdate {
    type State<const D: usize> = MuonState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        update: Tensor<B, D>,
        _state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        (apply_update(tensor, update, lr, self.weight_decay), None)
    }

    fn to_device<const D: usize>(state: Self::State<D>, _device: &B::Device) -> Self::State<D> {
        state
    }
}

/// One group's gradients, single- or multi-device, handed to an adaptor.
trait GradSet<M: AutodiffModule<B>, B: AutodiffBackend>: Sized {
    fn is_empty(&self) -> bool;
    fn apply<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M;
    fn into_adaptor(self) -> GradAdaptor;

    /// Steps `optim` unless the group is empty (which would only cost a pass over the module).
    fn step<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M {
        if self.is_empty() {
            module
        } else {
            self.apply(optim, lr, module)
        }
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> GradSet<M, B> for GradientsParams {
    fn is_empty(&self) -> bool {
        GradientsParams::is_empty(self)
    }

    fn apply<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M {
        optim.step(lr, module, self)
    }

    fn into_adaptor(self) -> GradAdaptor {
        self.into()
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> GradSet<M, B> for MultiGradientsParams {
    fn is_empty(&self) -> bool {
        self.grads.iter().all(|(g, _)| g.is_empty())
    }

    fn apply<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M {
        optim.step_multi(lr, module, self)
    }

    fn into_adaptor(self) -> GradAdaptor {
        self.into()
    }
}
