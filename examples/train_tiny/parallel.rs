//! `--devices N`: N replicas on threads of this process, one per device (all on the one CPU
//! device with `--backend ndarray`), registered as local peers of a burn-collective collective.
//! Each step's gradients, balance counts and metrics are summed by one all-reduce
//! (`kimi_burn::parallel::Peer::sync`).

use std::rc::Rc;

use burn::tensor::backend::AutodiffBackend;
use kimi_burn::model::KimiForCausalLM;
use kimi_burn::parallel::Peer;

use crate::{train_loop, Args, Replication, Trained};

/// Trains one replica of `model` per device and returns replica 0's result.
pub(crate) fn train_replicas<B: AutodiffBackend>(
    args: &Args,
    model: &KimiForCausalLM<B>,
    devices: &[B::Device],
) -> Result<Trained<B>, String> {
    let n = devices.len();
    let results: Vec<Result<Option<Trained<B>>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                let replica = model.replica(device);
                scope.spawn(move || replica_thread(args, replica, rank, n, device))
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
            Ok(Some(trained)) => first = Some(trained),
            Ok(None) => {}
        }
    }
    first.ok_or_else(|| "replica 0 returned nothing".into())
}

fn replica_thread<B: AutodiffBackend>(
    args: &Args,
    model: KimiForCausalLM<B>,
    rank: usize,
    replicas: usize,
    device: &B::Device,
) -> Result<Option<Trained<B>>, String> {
    let peer = Rc::new(Peer::<B>::local(rank, replicas, device).map_err(|e| e.to_string())?);
    let sync_peer = peer.clone();
    let check_peer = peer.clone();
    let dp = Replication {
        rank,
        replicas,
        sync: Box::new(move |model, grads, extra| {
            let synced = sync_peer
                .sync(model, grads, extra)
                .map_err(|e| e.to_string())?;
            Ok((synced.grads, synced.extra))
        }),
        check: args.check_replicas.then(|| -> crate::CheckFn<B> {
            Box::new(move |model| check_peer.check_replicas(model).map_err(|e| e.to_string()))
        }),
    };
    let trained = train_loop(args, model, device, Some(dp))?;
    if let Ok(peer) = Rc::try_unwrap(peer) {
        peer.finish().map_err(|e| e.to_string())?;
    }
    Ok(trained)
}
