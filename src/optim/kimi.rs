//! The Kimi optimiser: Muon (whole matrix or per head) for hidden matrices, AdamW for the rest,
//! each parameter routed by its [`ParamRole`] (design §8).

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;

use burn::config::Config;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamW, AdamWConfig, AdjustLrFn, GradientsParams, LearningRate, MultiGradientsParams, Muon,
    MuonConfig, Optimizer,
};
use burn::tensor::backend::{AutodiffBackend, DeviceId};
use burn::tensor::Tensor;

use super::head_muon::HeadMuon;
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
        let weight_decay = (self.muon_weight_decay > 0.0)
            .then(|| WeightDecayConfig::new(self.muon_weight_decay as f32));
        let muon = MuonConfig::new()
            .with_momentum(self.momentum_config())
            .with_ns_steps(self.ns_steps)
            .with_weight_decay(weight_decay)
            .with_adjust_lr_fn(AdjustLrFn::MatchRmsAdamW)
            .init();
        Ok(KimiOptimizer {
            muon,
            blocks: BTreeMap::new(),
            adamw: self.adamw.init(),
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

    fn head_muon<B: AutodiffBackend>(&self, split: Option<HeadSplit>) -> HeadMuon<B::InnerBackend> {
        HeadMuon::new(
            self.momentum,
            self.nesterov,
            self.ns_steps,
            self.muon_weight_decay as f32,
            split,
        )
    }
}

/// The record of one adaptor: `HashMap<ParamId, AdaptorRecord<O, B>>`.
type AdaptorRecordOf<O, M, B> = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record;

/// One [`HeadMuon`] adaptor per distinct head split (`None`: stacked whole matrices).
type HeadMuonAdaptor<M, B> = OptimizerAdaptor<HeadMuon<<B as AutodiffBackend>::InnerBackend>, M, B>;

/// The per-head record, to be split by head split on load.
type HeadMuonRecord<M, B> = AdaptorRecordOf<HeadMuon<<B as AutodiffBackend>::InnerBackend>, M, B>;

/// Muon for hidden matrices and AdamW for everything else, each parameter routed by its
/// [`ParamRole`] (design §8). Implements Burn's [`Optimizer`], so it drops into any training loop.
///
/// Each step splits the gradients by role and hands each group to a Burn `OptimizerAdaptor`:
///
/// - whole 2-D matrices: Burn's `Muon` with `AdjustLrFn::MatchRmsAdamW`, i.e.
///   `W ← W(1 − ηλ) − η·0.2·sqrt(max(A, B))·NS(M)`;
/// - per-head splits and stacked (≥3-D) matrices: [`HeadMuon`], one adaptor per distinct split,
///   each head block orthogonalised on its own with its own `0.2·sqrt(max(A, B))`
///   (reconstruction, design §8);
/// - everything else: Burn's `AdamW`.
///
/// Both Muon paths use momentum `μ`, decoupled decay `λ` and the learning rate
/// `η = muon_lr_scale · lr`; AdamW uses `adamw_lr_scale · lr` and its own config.
///
/// A parameter without a gradient (frozen, or a buffer such as the MoE balance bias) is never
/// touched. Two differences between the Muon paths, both negligible in practice: Burn's Muon
/// normalises by `max(‖X‖_F, 1e-7)` where design §8 (and [`HeadMuon`]) use `‖X‖_F + 1e-7`, and it
/// iterates in the parameter's dtype where [`HeadMuon`] widens half precision to f32.
///
/// The record is the tuple `(muon, head_muon, adamw)` of the adaptors' per-parameter states;
/// [`Optimizer::load_record`] sends each per-head state back to the adaptor of its parameter's
/// current role (states of parameters now under AdamW are dropped).
pub struct KimiOptimizer<M: AutodiffModule<B>, B: AutodiffBackend> {
    muon: OptimizerAdaptor<Muon<B::InnerBackend>, M, B>,
    blocks: BTreeMap<Option<HeadSplit>, HeadMuonAdaptor<M, B>>,
    adamw: OptimizerAdaptor<AdamW, M, B>,
    roles: ParamRoles,
    config: KimiOptimizerConfig,
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Clone for KimiOptimizer<M, B> {
    fn clone(&self) -> Self {
        Self {
            muon: self.muon.clone(),
            blocks: self.blocks.clone(),
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
        let muon_lr = lr * self.config.muon_lr_scale;
        let mut module = groups.muon.step(&mut self.muon, muon_lr, module);
        for (split, grads) in groups.blocks {
            let config = &self.config;
            let adaptor = self
                .blocks
                .entry(split)
                .or_insert_with(|| OptimizerAdaptor::from(config.head_muon::<B>(split)));
            module = grads.step(adaptor, muon_lr, module);
        }
        groups
            .adamw
            .step(&mut self.adamw, lr * self.config.adamw_lr_scale, module)
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> Optimizer<M, B> for KimiOptimizer<M, B> {
    type Record = (
        AdaptorRecordOf<Muon<B::InnerBackend>, M, B>,
        HeadMuonRecord<M, B>,
        AdaptorRecordOf<AdamW, M, B>,
    );

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        let groups = self.split(&module, &mut grads);
        self.apply(lr, module, groups)
    }

    fn step_multi(&mut self, lr: LearningRate, module: M, grads: MultiGradientsParams) -> M {
        let per_device: Vec<(Groups<GradientsParams>, DeviceId)> = grads
            .grads
            .into_iter()
            .map(|(mut device_grads, device)| (self.split(&module, &mut device_grads), device))
            .collect();
        let splits: BTreeSet<Option<HeadSplit>> = per_device
            .iter()
            .flat_map(|(groups, _)| groups.blocks.keys().copied())
            .collect();
        // Every group keeps one entry per device, in the original order: Burn picks the device
        // that accumulates a parameter by its index in this list.
        let mut groups = Groups::<MultiGradientsParams>::default();
        for (mut device_groups, device) in per_device {
            groups.muon.grads.push((device_groups.muon, device));
            groups.adamw.grads.push((device_groups.adamw, device));
            for &split in &splits {
                let grads = device_groups.blocks.remove(&split).unwrap_or_default();
                groups
                    .blocks
                    .entry(split)
                    .or_default()
                    .grads
                    .push((grads, device));
            }
        }
        self.apply(lr, module, groups)
    }

    fn to_record(&self) -> Self::Record {
        let mut blocks = HeadMuonRecord::<M, B>::default();
        for adaptor in self.blocks.values() {
            blocks.extend(adaptor.to_record());
        }
        (self.muon.to_record(), blocks, self.adamw.to_record())
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        let (muon, blocks, adamw) = record;
        let mut by_split: BTreeMap<Option<HeadSplit>, HeadMuonRecord<M, B>> = BTreeMap::new();
        for (id, state) in blocks {
            if let ParamRole::Muon { heads } = self.roles.get(id) {
                by_split.entry(heads).or_default().insert(id, state);
            }
        }
        let config = self.config.clone();
        self.blocks = by_split
            .into_iter()
            .map(|(split, record)| {
                let adaptor = OptimizerAdaptor::from(config.head_muon::<B>(split));
                (split, adaptor.load_record(record))
            })
            .collect();
        self.muon = self.muon.load_record(muon);
        self.adamw = self.adamw.load_record(adamw);
        self
    }
}

/// The gradients of one step, split by optimiser group.
#[derive(Default)]
struct Groups<G> {
    muon: G,
    blocks: BTreeMap<Option<HeadSplit>, G>,
    adamw: G,
}

/// Where a gradient of rank `D` with role `role` goes.
enum Route {
    Muon,
    Blocks(Option<HeadSplit>),
    AdamW,
}

fn route(role: ParamRole, rank: usize) -> Route {
    match role {
        // `validate` keeps Muon off vectors; should one slip through, AdamW is the safe choice.
        ParamRole::Muon { .. } if rank < 2 => Route::AdamW,
        ParamRole::Muon { heads: None } if rank == 2 => Route::Muon,
        ParamRole::Muon { heads } => Route::Blocks(heads),
        ParamRole::AdamW => Route::AdamW,
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
            Route::Muon => &mut self.groups.muon,
            Route::Blocks(split) => self.groups.blocks.entry(split).or_default(),
            Route::AdamW => &mut self.groups.adamw,
        };
        group.register(param.id, grad);
    }
}

/// One group's gradients, single- or multi-device, handed to an adaptor.
trait GradSet<M: AutodiffModule<B>, B: AutodiffBackend>: Sized {
    fn is_empty(&self) -> bool;
    fn apply<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M;

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
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> GradSet<M, B> for MultiGradientsParams {
    fn is_empty(&self) -> bool {
        self.grads.iter().all(|(g, _)| g.is_empty())
    }

    fn apply<O: Optimizer<M, B>>(self, optim: &mut O, lr: LearningRate, module: M) -> M {
        optim.step_multi(lr, module, self)
    }
}
