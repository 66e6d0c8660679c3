//! `--devices N`: N replicas on threads of this process, one per device (all on the one CPU
//! device with `--backend ndarray`), registered as local peers of a burn-collective collective;
//! with `--nodes M`, this process is one node of M in burn-collective's global mode.
//! Each step's gradients, balance counts and metrics are summed by one all-reduce
//! (`kimi_burn::parallel::Peer::sync`).

use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::parallel::{GlobalSetup, Peer};

use crate::{train_loop, Args, Replication, Trained};

/// Trains one replica of `model` per device and returns this process's first replica's result.
pub(crate) fn train_replicas<B: AutodiffBackend>(
    args: &Args,
    model: &KimiForCausalLM<B>,
    devices: &[B::Device],
) -> Result<Trained<B>, String> {
    let n = devices.len();
    let setup = global_setup(args)?;
    let setup = setup.as_ref();
    let results: Vec<Result<Option<Trained<B>>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                let replica = model.replica(device);
                scope.spawn(move || replica_thread(args, replica, rank, n, device, setup))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a replica panicked".into()))
            })
            .collect()
    });
    let mut first = None;
    for result in results {
        match result {
            Err(e) => return Err(e),
            Ok(Some(trained)) => first = first.or(Some(trained)),
            Ok(None) => {}
        }
    }
    first.ok_or_else(|| "replica 0 returned nothing".into())
}

/// `--nodes`: where this node and the orchestrator are.
fn global_setup(args: &Args) -> Result<Option<GlobalSetup>, String> {
    if args.nodes == 1 {
        return Ok(None);
    }
    let node_address = args
        .node_address
        .clone()
        .unwrap_or_else(|| format!("ws://localhost:{}", 3001 + args.node));
    let data_port = node_address
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .ok_or_else(|| {
            format!("--node-address {node_address}: needs a port, as in ws://host:3001")
        })?;
    Ok(Some(GlobalSetup {
        nodes: args.nodes,
        node: args.node,
        orchestrator: args.orchestrator.clone(),
        node_address,
        data_port,
    }))
}

fn replica_thread<B: AutodiffBackend>(
    args: &Args,
    model: KimiForCausalLM<B>,
    index: usize,
    local: usize,
    device: &B::Device,
    setup: Option<&GlobalSetup>,
) -> Result<Option<Trained<B>>, String> {
    let peer = match setup {
        None => Peer::<B>::local(index, local, device),
        Some(setup) => Peer::<B>::global(index, local, device, setup),
    };
    let peer = Rc::new(peer.map_err(|e| e.to_string())?);
    let (rank, replicas) = (peer.rank(), peer.replicas());
    let sync_peer = peer.clone();
    let check_peer = peer.clone();
    let step_peer = peer.clone();
    let dp = Replication {
        rank,
        replicas,
        reports: index == 0,
        sync: Box::new(move |model, grads, extra| {
            let synced = sync_peer
                .sync(model, grads, extra)
                .map_err(|e| e.to_string())?;
            Ok((synced.grads, synced.extra))
        }),
        check: args.check_replicas.then(|| -> crate::CheckFn<B> {
            Box::new(move |model| check_peer.check_replicas(model).map_err(|e| e.to_string()))
        }),
        same_step: Box::new(move |step| {
            step_peer
                .check_same("the checkpoint step they resume from", step as u32)
                .map_err(|e| format!("--resume: {e}; every node must resume from the same step"))
        }),
    };
    let trained = train_loop(args, model, device, Some(dp))?;
    if let Ok(peer) = Rc::try_unwrap(peer) {
        peer.finish().map_err(|e| e.to_string())?;
    }
    Ok(trained)
}
