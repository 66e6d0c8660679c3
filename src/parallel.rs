//! Data-parallel training on Burn's collective operations (feature `collective`; design §3,
//! `docs/scaling.md`).
//!
//! Every replica holds a full copy of the model ([`KimiForCausalLM::replica`](crate::model::KimiForCausalLM::replica)) and its own
//! optimiser, trains on its shard of the global batch, and once per step hands its gradients to
//! [`Peer::sync`]. That is **one** `burn-collective` all-reduce (`Sum`) of a single f32 tensor on
//! the device: every gradient flattened, a presence flag per parameter, the summed
//! [balance packet](crate::balance_sync) of every MoE layer, and a few caller values (the loss,
//! accuracy counts, expert loads). Afterwards every replica holds the global gradients and the
//! global QB histograms, so the optimiser step and
//! [`update_balance`](crate::model::KimiForCausalLM::update_balance) give the same parameters and the same bias
//! everywhere, with no broadcast.
//!
//! **Loss scale.** The all-reduce sums, so each replica must weight its loss by its share of the
//! global batch's scored targets: [`accumulate_gradients`](crate::train::accumulate_gradients)
//! with `scored_total` = the global batch's count. The summed gradients are then exactly those of
//! the global batch's mean loss, whatever the shards' sizes.
//!
//! **Peers.** [`Peer::local`] registers one peer per thread of this process (one per device, or
//! several on one CPU); [`Peer::global`] adds this process as one node of several, coordinated by
//! burn-collective's orchestrator ([`run_orchestrator`]) over WebSockets. Peers must call every
//! collective operation in the same order.
//!
//! **Checks.** A parameter with a gradient on some replicas and not on others, a replica that
//! routed with another bias, and (with [`Peer::check_replicas`], a debug mode) replicas whose
//! parameters or biases differ after a step are errors that name what differs.
//!
//! Burn 0.21's autodiff keeps one process-wide table of graphs; when peers are threads of one
//! process their graphs must not share a node, which [`KimiForCausalLM::replica`](crate::model::KimiForCausalLM::replica) ensures (it
//! forks the parameters). Even disjoint graphs are not fully independent there: the end of every
//! backward sweeps all graphs of the process and can free a step of a graph another thread is
//! still building (reported upstream as tracel-ai/burn#5573), losing that thread's gradient or part
//! of it. A gradient lost entirely is caught by the presence check above; a partial loss is not.
//! The 2-peer test has not shown it (60 runs on ndarray); twelve test threads in one process did
//! (on lavapipe). One peer per process ([`Peer::global`] with one local peer) is not exposed.

use std::str::FromStr;

use burn::collective::{self, CollectiveConfig, PeerId, ReduceOperation};
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};

use crate::balance_sync::{self, BalancedModule};
use crate::error::{Error, Result};

/// Where the other nodes are, for [`Peer::global`]: burn-collective's global mode, in which each
/// process is a node and an orchestrator ([`run_orchestrator`]) matches them up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalSetup {
    /// Number of nodes (processes) in the collective.
    pub nodes: usize,
    /// This node's index in `0..nodes` (it numbers the peers: node `n`'s local peer `i` is peer
    /// `n · peers_per_node + i`).
    pub node: usize,
    /// The orchestrator's WebSocket address, e.g. `ws://localhost:3000`.
    pub orchestrator: String,
    /// The address other nodes reach this one at, e.g. `ws://localhost:3001`.
    pub node_address: String,
    /// The port this node serves its tensors on (the port of `node_address`).
    pub data_port: u16,
}

/// One replica's membership in a data-parallel collective (see the module docs).
///
/// Create one per thread with [`local`](Self::local) or [`global`](Self::global); all peers of a
/// process must register before any of them can all-reduce, so start their threads together.
/// [`finish`](Self::finish) leaves the collective.
#[derive(Debug)]
pub struct Peer<B: AutodiffBackend> {
    id: PeerId,
    replicas: usize,
    device: B::Device,
    /// Global mode: the configuration each operation registers with (see [`Peer::global`]).
    global: Option<CollectiveConfig>,
}

/// What [`Peer::sync`] returns.
#[derive(Debug)]
pub struct Synced {
    /// The gradients summed over the replicas (only the parameters some replica had a gradient
    /// for).
    pub grads: GradientsParams,
    /// The caller's `extra` values, summed over the replicas.
    pub extra: Vec<f32>,
    /// The number of replicas that took part.
    pub replicas: usize,
}

fn collective_error(op: &str, e: impl std::fmt::Debug) -> Error {
    Error::Collective {
        op: op.into(),
        reason: format!("{e:?}"),
    }
}

impl<B: AutodiffBackend> Peer<B> {
    /// Registers peer `index` of `peers` in this process, on `device`. Blocks until all `peers`
    /// have registered.
    pub fn local(index: usize, peers: usize, device: &B::Device) -> Result<Self> {
        check_index(index, peers)?;
        let config = CollectiveConfig::default().with_num_devices(peers);
        Self::register(index, peers, device, config)
    }

    /// Local peer `index` of `peers` in this process as part of node `setup.node` of
    /// `setup.nodes` (every node must run the same number of peers). Each operation registers
    /// with the orchestrator and blocks until every peer of every node has (see
    /// [`all_reduce_sum`](Self::all_reduce_sum)).
    pub fn global(
        index: usize,
        peers: usize,
        device: &B::Device,
        setup: &GlobalSetup,
    ) -> Result<Self> {
        check_index(index, peers)?;
        check_index(setup.node, setup.nodes).map_err(|_| {
            Error::argument(
                "node",
                format!("node {} of {} nodes", setup.node, setup.nodes),
            )
        })?;
        let address = |what: &str, s: &str| {
            burn_communication::Address::from_str(s)
                .map_err(|e| Error::argument(what.to_string(), format!("`{s}`: {e}")))
        };
        let config = CollectiveConfig::default()
            .with_num_devices(peers)
            .with_num_nodes(setup.nodes as u32)
            .with_global_address(address("orchestrator", &setup.orchestrator)?)
            .with_node_address(address("node_address", &setup.node_address)?)
            .with_data_service_port(setup.data_port);
        // Registered per operation (see `all_reduce_sum`).
        Ok(Self {
            id: PeerId::from(setup.node * peers + index),
            replicas: peers * setup.nodes,
            device: device.clone(),
            global: Some(config),
        })
    }

    fn register(
        id: usize,
        replicas: usize,
        device: &B::Device,
        config: CollectiveConfig,
    ) -> Result<Self> {
        let id = PeerId::from(id);
        collective::register::<B::InnerBackend>(id, device.clone(), config)
            .map_err(|e| collective_error("register", e))?;
        Ok(Self {
            id,
            replicas,
            device: device.clone(),
            global: None,
        })
    }

    /// The number of replicas in the collective (all nodes).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// This peer's index among all replicas (`0` for the one that reports).
    pub fn rank(&self) -> usize {
        self.id.0 as usize
    }

    /// The element-wise sum of `tensor: [n]` over all replicas (one all-reduce); every replica
    /// must pass the same `n`. The same bits on every replica and in every run: on the CPU
    /// backends with three or more replicas the tensors are added in rank order (burn-collective
    /// alone adds peers of one device in an order that changes from call to call), which costs
    /// `replicas` times the traffic there.
    ///
    /// In global mode each call is a session of its own (register, all-reduce, leave):
    /// burn-collective 0.21's nodes complete only one global all-reduce per session (after the
    /// first, `SyncService::sync` keeps the peers of the previous sync and never sees the next
    /// one complete), so a fresh session per operation is what works.
    pub fn all_reduce_sum(
        &self,
        tensor: Tensor<B::InnerBackend, 1>,
    ) -> Result<Tensor<B::InnerBackend, 1>> {
        if self.replicas > 2 && crate::ops::backend::host::is_host_device::<B::InnerBackend>() {
            self.all_reduce_in_rank_order(tensor)
        } else {
            self.collective_sum(tensor)
        }
    }

    /// burn-collective's all-reduce (`Sum`) of `tensor`.
    fn collective_sum(
        &self,
        tensor: Tensor<B::InnerBackend, 1>,
    ) -> Result<Tensor<B::InnerBackend, 1>> {
        if let Some(config) = &self.global {
            collective::register::<B::InnerBackend>(self.id, self.device.clone(), config.clone())
                .map_err(|e| collective_error("register", e))?;
        }
        let summed = collective::all_reduce::<B::InnerBackend>(
            self.id,
            tensor.into_primitive().tensor(),
            ReduceOperation::Sum,
        )
        .map_err(|e| collective_error("all-reduce", e));
        if self.global.is_some() {
            collective::finish_collective::<B::InnerBackend>(self.id)
                .map_err(|e| collective_error("finish", e))?;
        }
        Ok(Tensor::from_primitive(TensorPrimitive::Float(summed?)))
    }

    /// [`all_reduce_sum`](Self::all_reduce_sum) with the replicas' tensors added in rank order.
    ///
    /// burn-collective adds the peers' tensors in the order of their devices' ids and, among
    /// peers of one id, in a hash map's order, which changes from call to call: with three or
    /// more such peers (every peer of a CPU backend shares its one device), f32 rounding then
    /// made two runs (or a run and its resume) differ. Here each replica all-reduces
    /// `[replicas, n]` with its tensor in its own row and zeros elsewhere (a sum of one value and
    /// zeros is exact in any order) and adds the rows in rank order itself: the same sum on every
    /// replica and in every run, for `replicas` times the traffic (the CPU backends only).
    fn all_reduce_in_rank_order(
        &self,
        tensor: Tensor<B::InnerBackend, 1>,
    ) -> Result<Tensor<B::InnerBackend, 1>> {
        let [n] = tensor.dims();
        if n == 0 {
            return Ok(tensor);
        }
        let (rank, replicas) = (self.rank(), self.replicas);
        let options = (&self.device, tensor.dtype());
        let mut rows = Vec::with_capacity(3);
        if rank > 0 {
            rows.push(Tensor::zeros([rank * n], options));
        }
        rows.push(tensor);
        if rank + 1 < replicas {
            rows.push(Tensor::zeros([(replicas - rank - 1) * n], options));
        }
        let rows = self.collective_sum(Tensor::cat(rows, 0))?;
        Ok((1..replicas).fold(rows.clone().narrow(0, 0, n), |sum, r| {
            sum + rows.clone().narrow(0, r * n, n)
        }))
    }

    /// Errors unless every replica passes the same `value` (one small all-reduce; every replica
    /// must call it): e.g. the step a resumed run continues from, which a node resumed from an
    /// older checkpoint than the others would not share. The error lists each replica's value,
    /// named `what`. Values up to 2²⁴ (they travel as f32).
    pub fn check_same(&self, what: &str, value: u32) -> Result<()> {
        let mut slots = vec![0.0f32; self.replicas];
        slots[self.rank()] = value as f32;
        let summed = self.all_reduce_sum(Tensor::from_data(
            TensorData::new(slots, [self.replicas]),
            (&self.device, DType::F32),
        ))?;
        let values: Vec<f32> = crate::sync::read(summed)
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| collective_error("agreement check", e))?;
        if values.iter().all(|&v| v == value as f32) {
            return Ok(());
        }
        let each: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(r, v)| format!("replica {r}: {v}"))
            .collect();
        Err(Error::Collective {
            op: "agreement check".into(),
            reason: format!("the replicas differ in {what} ({})", each.join(", ")),
        })
    }

    /// The global step of data parallelism, in one all-reduce: sums `grads` (this replica's, of
    /// `model`) over the replicas, merges every replica's balancer counts into `model`'s MoE
    /// layers (call [`update_balance`](crate::model::KimiForCausalLM::update_balance) after the
    /// optimiser step, as on one device) and sums `extra` (the same length on every replica).
    /// The all-reduced tensor is `[Σ numel(param) + params + packet + extra]` f32, one host read
    /// of its tail.
    ///
    /// Errors when the collective fails, when a parameter has a gradient on some replicas only,
    /// or when the replicas routed with different biases (see [`balance_sync`]).
    pub fn sync<M>(&self, model: &M, grads: GradientsParams, extra: &[f32]) -> Result<Synced>
    where
        M: AutodiffModule<B> + BalancedModule<B>,
    {
        let layers = model.balance_states();
        let packet = balance_sync::pack(&layers)?;
        let mut flatten = Flatten::<B> {
            grads,
            parts: Vec::new(),
            params: Vec::new(),
            device: self.device.clone(),
        };
        model.visit(&mut flatten);
        let Flatten {
            mut grads,
            mut parts,
            params,
            ..
        } = flatten;
        let numel: usize = params.iter().map(|p| p.numel).sum();
        let mut tail: Vec<f32> = params
            .iter()
            .map(|p| f32::from(u8::from(p.present)))
            .collect();
        let packet_at = tail.len();
        tail.extend(&packet);
        let extra_at = tail.len();
        tail.extend_from_slice(extra);
        let n = tail.len();
        parts.push(Tensor::from_data(
            TensorData::new(tail, [n]),
            (&self.device, DType::F32),
        ));
        let summed = self.all_reduce_sum(Tensor::cat(parts, 0))?;

        let tail: Vec<f32> = crate::sync::read(summed.clone().slice(numel..numel + n))
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| collective_error("all-reduce", e))?;
        let replicas = balance_sync::unpack(&layers, &tail[packet_at..extra_at])? as usize;
        if replicas != self.replicas {
            return Err(Error::Collective {
                op: "all-reduce".into(),
                reason: format!("{replicas} replicas answered, {} registered", self.replicas),
            });
        }
        let mut keep = Vec::with_capacity(params.len());
        for (p, &count) in params.iter().zip(&tail[..packet_at]) {
            let count = count as usize;
            if count != 0 && count != replicas {
                return Err(Error::Collective {
                    op: "gradient all-reduce".into(),
                    reason: format!(
                        "parameter {} (shape {:?}) has a gradient on {count} of {replicas} \
                         replicas; every replica must train the same parameters",
                        p.id, p.dims
                    ),
                });
            }
            keep.push((count != 0).then_some(p.dtype));
        }
        let mut unflatten = Unflatten::<B> {
            grads: &mut grads,
            summed,
            at: 0,
            keep: keep.into_iter(),
        };
        model.visit(&mut unflatten);
        Ok(Synced {
            grads,
            extra: tail[extra_at..].to_vec(),
            replicas,
        })
    }

    /// The global balance step alone (for a caller that reduces its gradients elsewhere, e.g.
    /// burn-train's DDP): sums every replica's balance packet of `model` with one all-reduce and
    /// merges the counts, so that `update_balance()` then gives the same bias on every replica.
    /// Returns the number of replicas.
    pub fn balance_step<M: BalancedModule<B>>(&self, model: &M) -> Result<u64> {
        let layers = model.balance_states();
        let packet = balance_sync::pack(&layers)?;
        let n = packet.len();
        let summed = self.all_reduce_sum(Tensor::from_data(
            TensorData::new(packet, [n]),
            (&self.device, DType::F32),
        ))?;
        let got = crate::sync::read(summed)
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| collective_error("all-reduce", e))?;
        balance_sync::unpack(&layers, &got)
    }

    /// Debug mode: checks with one small all-reduce that every replica holds the same parameters
    /// and balance biases, bit for bit (through a 32-bit digest of each; a difference goes
    /// unnoticed with probability about 255⁻⁴). Reads every parameter to the host.
    pub fn check_replicas<M>(&self, model: &M) -> Result<()>
    where
        M: AutodiffModule<B> + BalancedModule<B>,
    {
        let mut digest = Digest {
            state: balance_sync::FNV_OFFSET,
            _backend: std::marker::PhantomData,
        };
        model.visit(&mut digest);
        let mut state = digest.state;
        for (_, layer) in model.balance_states() {
            for v in layer.bias_host() {
                state = balance_sync::fnv(state, &v.to_bits().to_le_bytes());
            }
        }
        let mut packet = vec![1.0f32];
        for byte in state.to_le_bytes().iter().take(4) {
            // 1..=255, so that P·h² stays exact in f32 for P ≤ 255.
            let h = 1 + u64::from(*byte) % 255;
            packet.push(h as f32);
            packet.push((h * h) as f32);
        }
        let summed = self.all_reduce_sum(Tensor::from_data(
            TensorData::new(packet, [9]),
            (&self.device, DType::F32),
        ))?;
        let got: Vec<f32> = crate::sync::read(summed)
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| collective_error("replica check", e))?;
        let p = got[0] as u64;
        for pair in got[1..].chunks_exact(2) {
            let (s1, s2) = (pair[0] as u64, pair[1] as u64);
            if s2 * p != s1 * s1 {
                return Err(Error::Collective {
                    op: "replica check".into(),
                    reason: format!(
                        "the {p} replicas hold different parameters or balance biases \
                         (replica {} included)",
                        self.rank()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Leaves the collective (every peer of the collective should, once it is done).
    pub fn finish(self) -> Result<()> {
        if self.global.is_some() {
            return Ok(()); // each operation left already
        }
        collective::finish_collective::<B::InnerBackend>(self.id)
            .map_err(|e| collective_error("finish", e))
    }
}

fn check_index(index: usize, of: usize) -> Result<()> {
    if of == 0 || index >= of {
        return Err(Error::argument(
            "peer",
            format!("peer {index} of {of} peers: needs 0 <= index < peers"),
        ));
    }
    Ok(())
}

/// Runs burn-collective's global orchestrator on `port` until the process receives Ctrl-C (or
/// SIGTERM). The nodes of [`Peer::global`] connect to it.
pub fn run_orchestrator(port: u16) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| collective_error("orchestrator", e))?;
    runtime.block_on(burn_collective::start_global_orchestrator(port));
    Ok(())
}

/// One parameter of the flattened gradient.
struct Slot {
    id: ParamId,
    dims: Vec<usize>,
    numel: usize,
    present: bool,
    /// The gradient's dtype (it travels as f32, so that the counts beside it stay exact).
    dtype: DType,
}

/// Takes every float parameter's gradient out of `grads` (zeros where it has none), flattened,
/// in the module's visiting order.
struct Flatten<B: AutodiffBackend> {
    grads: GradientsParams,
    parts: Vec<Tensor<B::InnerBackend, 1>>,
    params: Vec<Slot>,
    device: B::Device,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let dims = param.lazy_shape().to_vec();
        let numel: usize = dims.iter().product();
        let grad = self.grads.remove::<B::InnerBackend, D>(param.id);
        let present = grad.is_some();
        let dtype = grad.as_ref().map_or(DType::F32, Tensor::dtype);
        self.parts.push(match grad {
            Some(g) => g.reshape([numel]).cast(FloatDType::F32),
            None => Tensor::zeros([numel], (&self.device, DType::F32)),
        });
        self.params.push(Slot {
            id: param.id,
            dims,
            numel,
            present,
            dtype,
        });
    }
}

/// Registers the summed gradients back, in the same order as [`Flatten`].
struct Unflatten<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    summed: Tensor<B::InnerBackend, 1>,
    at: usize,
    /// Per parameter, the dtype to register its gradient in, or `None` when it has none.
    keep: std::vec::IntoIter<Option<DType>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let dims: [usize; D] = param.lazy_shape().dims();
        let numel: usize = dims.iter().product();
        let range = self.at..self.at + numel;
        self.at += numel;
        if let Some(dtype) = self.keep.next().flatten() {
            let grad = self.summed.clone().slice(range).reshape(dims).cast(dtype);
            self.grads.register::<B::InnerBackend, D>(param.id, grad);
        }
    }
}

/// A running FNV-1a digest of every float parameter's bits.
struct Digest<B> {
    state: u64,
    _backend: std::marker::PhantomData<B>,
}

impl<B: Backend> ModuleVisitor<B> for Digest<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let data = crate::sync::read(param.val()).convert::<f32>();
        self.state = balance_sync::fnv(self.state, data.as_bytes());
    }
}
