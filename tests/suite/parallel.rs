//! Data parallelism on burn-collective (`kimi_burn::parallel`): peers are threads of this process
//! on the CPU backend, registered as local peers of one collective.

use std::sync::Mutex;

use crate::common::*;
use crate::train::{identical_models, moe_biases, small_mqar};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use kimi_burn::data::{masked_cross_entropy, SeededRng, Task};
use kimi_burn::model::{Ffn, KimiForCausalLM};
use kimi_burn::optim::KimiOptimizerConfig;
use kimi_burn::parallel::Peer;
use kimi_burn::train::accumulate_gradients;

type B = CpuAd;

/// burn-collective's local server is one per process and backend: one collective at a time.
static COLLECTIVE: Mutex<()> = Mutex::new(());

/// Runs `peer(index, model)` on one thread per model, as the peers of one local collective, and
/// returns what each returned, in peer order. Leaves the collective reset.
fn run_peers<T: Send + 'static>(
    models: Vec<KimiForCausalLM<B>>,
    peer: impl Fn(Peer<B>, KimiForCausalLM<B>) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let _one = COLLECTIVE.lock().unwrap_or_else(|e| e.into_inner());
    let n = models.len();
    let handles: Vec<_> = models
        .into_iter()
        .enumerate()
        .map(|(i, model)| {
            std::thread::spawn(move || {
                let device = Default::default();
                let me = Peer::<B>::local(i, n, &device).expect("register");
                peer(me, model)
            })
        })
        .collect();
    let out = handles
        .into_iter()
        .map(|h| h.join().expect("a peer panicked"))
        .collect();
    burn::collective::reset_collective::<Cpu>();
    out
}

/// The equivalence check: two peers on batches of 8 (gradients and QB histograms summed
/// by one all-reduce per step) and one device on the same 16 sequences give the same losses,
/// parameters (through held-out logits) and balance biases after 5 steps. The two differ only in
/// the order of f32 sums, as gradient accumulation does (`train::micro_batches_...`), so the same
/// 1e-4 relative tolerance applies. The two peers agree bit for bit with each other (checked every
/// step by `Peer::check_replicas`, and on the logits at the end).
#[test]
fn two_peers_train_like_one_device_on_their_whole_batch() {
    let device = Default::default();
    let (task, config) = small_mqar();
    let mut single = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");
    let replicas = vec![single.replica(&device), single.replica(&device)];
    let steps = 5;
    let lr = 1e-2;
    let optim = |model: &KimiForCausalLM<B>| {
        KimiOptimizerConfig::new()
            .init(model, model.param_roles())
            .expect("per-head Muon roles")
    };

    let peers = run_peers(replicas, move |peer, mut model| {
        let device = Default::default();
        let (task, _) = small_mqar();
        let mut optim = optim(&model);
        let mut rng = SeededRng::new(11);
        let mut losses = Vec::new();
        for _ in 0..steps {
            let global = task.sample_batch(16, &mut rng);
            let mine = &global.split(peer.replicas()).expect("16 = 2 x 8")[peer.rank()];
            let step =
                accumulate_gradients(&model, mine, 1, global.scored(), &device).expect("a step");
            let synced = peer
                .sync(&model, step.grads, &[step.loss as f32])
                .expect("all-reduce");
            assert_eq!(synced.replicas, 2);
            losses.push(f64::from(synced.extra[0]));
            model = optim.step(lr, model, synced.grads);
            model.update_balance();
            peer.check_replicas(&model).expect("replicas agree");
        }
        peer.finish().expect("finish");
        (losses, model)
    });

    let mut optim_single = optim(&single);
    let mut rng = SeededRng::new(11);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let batch = task.sample_batch(16, &mut rng);
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let loss = masked_cross_entropy(single.forward(inputs), targets);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &single);
        single = optim_single.step(lr, single, grads);
        single.update_balance();
    }

    let held_out = task.sample_batch(8, &mut SeededRng::new(12));
    let (inputs, _) = held_out.to_tensors::<B>(&device);
    let logits = |m: &KimiForCausalLM<B>| host(m.valid().forward(inputs.clone().inner()));
    let want = logits(&single);
    let biases = |m: &KimiForCausalLM<B>| -> Vec<f64> {
        moe_biases(m).into_iter().flatten().map(f64::from).collect()
    };
    assert!(
        biases(&single).iter().any(|&b| b != 0.0),
        "QB moved the biases"
    );
    for (p, (peer_losses, model)) in peers.iter().enumerate() {
        for (step, (a, b)) in losses.iter().zip(peer_losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * a,
                "peer {p}, step {step}: loss {b} vs one device's {a}"
            );
        }
        assert_close(
            &format!("peer {p}'s held-out logits"),
            &want,
            &logits(model),
            1e-4,
        );
        assert_close(
            &format!("peer {p}'s biases"),
            &biases(&single),
            &biases(model),
            1e-4,
        );
    }
    assert_eq!(
        logits(&peers[0].1),
        logits(&peers[1].1),
        "the peers agree bit for bit"
    );
    assert_eq!(biases(&peers[0].1), biases(&peers[1].1));
}

/// A peer that routed with another bias, or that trained a parameter the other did not, makes
/// `sync` fail on every peer with a message that names the layer or the parameter.
#[test]
fn peers_that_disagree_are_an_error() {
    let device = Default::default();
    let (_, config) = small_mqar();
    let first = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");

    // Peer 1 shifts layer 2's bias before routing.
    let replicas = vec![first.replica(&device), first.replica(&device)];
    let errors = run_peers(replicas, |peer, model| {
        let device = Default::default();
        let (task, _) = small_mqar();
        if peer.rank() == 1 {
            let Ffn::Moe(moe) = &model.layers[2].ffn else {
                panic!("layer 2 is a MoE layer")
            };
            let mut shifted = moe.balance.bias_host();
            shifted[0] += 0.25;
            moe.balance.set_bias(&shifted);
        }
        let batch = task.sample_batch(8, &mut SeededRng::new(3));
        let step = accumulate_gradients(&model, &batch, 1, 16, &device).expect("a step");
        let err = peer.sync(&model, step.grads, &[]).unwrap_err().to_string();
        peer.finish().expect("finish");
        err
    });
    for err in errors {
        assert!(
            err.contains("MoE layer 2") && err.contains("different biases"),
            "{err}"
        );
    }

    // Peer 1 has no gradient for the embedding.
    let replicas = vec![first.replica(&device), first.replica(&device)];
    let errors = run_peers(replicas, |peer, model| {
        let device = Default::default();
        let (task, _) = small_mqar();
        let batch = task.sample_batch(8, &mut SeededRng::new(3));
        let mut step = accumulate_gradients(&model, &batch, 1, 16, &device).expect("a step");
        if peer.rank() == 1 {
            let id = model.embed_tokens.weight.id;
            step.grads
                .remove::<Cpu, 2>(id)
                .expect("the embedding has a gradient");
        }
        let err = peer.sync(&model, step.grads, &[]).unwrap_err().to_string();
        peer.finish().expect("finish");
        (err, model.embed_tokens.weight.id.to_string())
    });
    for (err, id) in errors {
        assert!(err.contains(&id) && err.contains("1 of 2"), "{err}");
    }
}
