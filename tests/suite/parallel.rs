//! Data parallelism on burn-collective (`kimi_burn::parallel`): peers are threads of this process
//! on the CPU backend, registered as local peers of one collective.

use std::sync::Mutex;

use crate::common::*;
use crate::train::{identical_models, kimi_optim, moe_biases, small_mqar};
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::{ElementConversion, Tensor};
use kimi_burn::data::{masked_cross_entropy, SeededRng, Task};
use kimi_burn::model::{Ffn, KimiForCausalLM};
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

/// Three CPU peers sum in rank order, every call: burn-collective alone adds peers of one device
/// in a hash map's order, so `1 + (−1) + 2⁻²⁴` came out as `2⁻²⁴` or `0` from call to call.
#[test]
fn three_cpu_peers_sum_in_rank_order_every_time() {
    let _one = COLLECTIVE.lock().unwrap_or_else(|e| e.into_inner());
    let tiny = 2f32.powi(-24);
    let handles: Vec<_> = [1.0f32, -1.0, tiny]
        .into_iter()
        .enumerate()
        .map(|(i, value)| {
            std::thread::spawn(move || {
                let device = Default::default();
                let me = Peer::<B>::local(i, 3, &device).expect("register");
                (0..32)
                    .map(|_| {
                        let t = Tensor::<Cpu, 1>::from_floats([value, 2.0 * value], &device);
                        me.all_reduce_sum(t)
                            .expect("all-reduce")
                            .into_data()
                            .to_vec::<f32>()
                            .unwrap()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (peer, h) in handles.into_iter().enumerate() {
        for (call, sum) in h.join().expect("a peer panicked").into_iter().enumerate() {
            assert_eq!(sum, [tiny, 2.0 * tiny], "peer {peer}, call {call}");
        }
    }
    burn::collective::reset_collective::<Cpu>();
}

/// `Peer::check_same` passes when every replica has the value and otherwise names each one's
/// (as `train_tiny --resume` uses it for the step every node resumes from).
#[test]
fn replicas_that_resume_from_different_steps_are_named() {
    let _one = COLLECTIVE.lock().unwrap_or_else(|e| e.into_inner());
    let handles: Vec<_> = (0..3usize)
        .map(|i| {
            std::thread::spawn(move || {
                let device = Default::default();
                let me = Peer::<B>::local(i, 3, &device).expect("register");
                let same = me.check_same("the step", 40);
                let differ = me.check_same("the step", if i == 1 { 20 } else { 40 });
                (same, differ.map_err(|e| e.to_string()))
            })
        })
        .collect();
    for h in handles {
        let (same, differ) = h.join().expect("a peer panicked");
        assert!(same.is_ok(), "{same:?}");
        let err = differ.unwrap_err();
        assert!(
            err.contains("the step") && err.contains("replica 0: 40, replica 1: 20, replica 2: 40"),
            "{err}"
        );
    }
    burn::collective::reset_collective::<Cpu>();
}

/// Data parallelism changes nothing but where the micro-batches run. From one start, 5 steps of
/// MQAR with 16 sequences per step:
///
/// - **2 peers × 8** (gradients, QB histograms and metrics summed by one all-reduce per step) and
///   **1 device × 2 micro-batches of 8** (`accumulate_gradients`) run the same forwards and add the
///   same two gradients: losses, parameters (through held-out logits) and balance biases are
///   equal bit for bit, and the two peers agree bit for bit (`Peer::check_replicas` every step).
/// - Against **1 device × 16** they differ only in the order of f32 sums (the weight gradients
///   sum 16 rows in one matmul or in two), so losses agree within 1e-5 relative and parameters
///   and biases within 1e-4 — as long as every token is routed alike. A token whose top-k or QB
///   bin sits within rounding of a tie can flip after the first optimiser step; from the first
///   step whose expert loads differ the runs are no longer comparable at these tolerances (with
///   some initialisations this happens at step 2). The comparison therefore covers the steps
///   before any flip, at least the first two, and the final parameters only without a flip.
#[test]
fn two_peers_train_like_one_device_on_their_whole_batch() {
    let device = Default::default();
    let (task, config) = small_mqar();
    let mut whole = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");
    let mut micro = whole.replica(&device);
    let replicas = vec![whole.replica(&device), whole.replica(&device)];
    let steps = 5;
    let lr = 1e-2;
    let optim = kimi_optim::<B>;

    // Per step: the loss and every MoE layer's expert loads, then the trained model.
    type Run = (Vec<(f64, Vec<Vec<u64>>)>, KimiForCausalLM<B>);
    let peers: Vec<Run> = run_peers(replicas, move |peer, mut model| {
        let device = Default::default();
        let (task, _) = small_mqar();
        let mut optim = optim(&model);
        let mut rng = SeededRng::new(11);
        let mut log = Vec::new();
        for _ in 0..steps {
            let global = task.sample_batch(16, &mut rng);
            let mine = &global.split(peer.replicas()).expect("16 = 2 x 8")[peer.rank()];
            let step =
                accumulate_gradients(&model, mine, 1, global.scored(), &device).expect("a step");
            let mut extra = vec![step.loss as f32];
            extra.extend(step.loads.iter().flatten().map(|&l| l as f32));
            let synced = peer.sync(&model, step.grads, &extra).expect("all-reduce");
            assert_eq!(synced.replicas, 2);
            let loads = step
                .loads
                .iter()
                .scan(1, |at, layer| {
                    let pooled = synced.extra[*at..*at + layer.len()]
                        .iter()
                        .map(|&c| c as u64)
                        .collect::<Vec<_>>();
                    *at += layer.len();
                    Some(pooled)
                })
                .collect();
            log.push((f64::from(synced.extra[0]), loads));
            model = optim.step(lr, model, synced.grads);
            model.update_balance();
            peer.check_replicas(&model).expect("replicas agree");
        }
        peer.finish().expect("finish");
        (log, model)
    });

    let (mut whole_optim, mut micro_optim) = (optim(&whole), optim(&micro));
    let mut rng = SeededRng::new(11);
    let (mut whole_log, mut micro_log) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let batch = task.sample_batch(16, &mut rng);
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let out = whole.try_forward(inputs, None, None).expect("forward");
        let loads: Vec<Vec<u64>> = out
            .moe_loads
            .iter()
            .map(|s| s.tokens_per_expert())
            .collect();
        let loss = masked_cross_entropy(out.logits, targets);
        whole_log.push((loss.clone().into_scalar().elem::<f64>(), loads));
        let grads = GradientsParams::from_grads(loss.backward(), &whole);
        whole = whole_optim.step(lr, whole, grads);
        whole.update_balance();

        let step =
            accumulate_gradients(&micro, &batch, 2, batch.scored(), &device).expect("a step");
        micro_log.push((step.loss as f32, step.loads));
        micro = micro_optim.step(lr, micro, step.grads);
        micro.update_balance();
    }

    let held_out = task.sample_batch(8, &mut SeededRng::new(12));
    let (inputs, _) = held_out.to_tensors::<B>(&device);
    let logits = |m: &KimiForCausalLM<B>| host(m.valid().forward(inputs.clone().inner()));
    let biases = |m: &KimiForCausalLM<B>| -> Vec<f64> {
        moe_biases(m).into_iter().flatten().map(f64::from).collect()
    };
    assert!(
        biases(&micro).iter().any(|&b| b != 0.0),
        "QB moved the biases"
    );
    for (p, (log, model)) in peers.iter().enumerate() {
        // Bit for bit against the micro-batches on one device.
        for (step, ((loss, loads), (micro_loss, micro_loads))) in
            log.iter().zip(&micro_log).enumerate()
        {
            assert_eq!(*loss as f32, *micro_loss, "peer {p}, step {step}: loss");
            assert_eq!(loads, micro_loads, "peer {p}, step {step}: expert loads");
        }
        assert_eq!(logits(model), logits(&micro), "peer {p}: parameters");
        assert_eq!(biases(model), biases(&micro), "peer {p}: balance biases");
    }
    // Within reduction-order tolerance of the whole batch, up to the first routing flip.
    let (log, model) = &peers[0];
    let flip = log
        .iter()
        .zip(&whole_log)
        .position(|((_, a), (_, b))| a != b)
        .unwrap_or(steps);
    assert!(
        flip >= 2,
        "the routing differs from the whole batch's at step {flip}"
    );
    for (step, ((loss, _), (whole_loss, _))) in log.iter().zip(&whole_log).take(flip).enumerate() {
        assert!(
            (loss - whole_loss).abs() <= 1e-5 * whole_loss,
            "step {step}: loss {loss} vs one device's {whole_loss}"
        );
    }
    if flip == steps {
        assert_close("held-out logits", &logits(&whole), &logits(model), 1e-4);
        assert_close("balance biases", &biases(&whole), &biases(model), 1e-4);
    } else {
        eprintln!("a token's routing flipped at step {flip}; compared steps 0..{flip}");
    }
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

/// The global balance step alone, on one `LatentMoe` layer (`Peer::balance_step`, for a caller
/// that reduces its gradients elsewhere): two peers route batches of their own, sum their
/// packets with one all-reduce and apply the balance update; both end with exactly the bias of one
/// layer that routed both batches.
#[test]
fn a_latent_moe_balance_step_gives_both_peers_the_bias_of_the_whole_batch() {
    use burn::tensor::{Distribution, Tensor};
    use kimi_burn::nn::latent_moe::LatentMoeConfig;
    use kimi_burn::nn::{BalancerKind, LatentMoe};
    let device = Default::default();
    let config = LatentMoeConfig::new(12, 6, 2, 10)
        .with_n_shared(1)
        .with_shared_hidden(Some(8))
        .with_balancer(BalancerKind::quantile());
    let single: LatentMoe<B> = config.init(&device);
    let replicas = vec![single.replica(&device), single.replica(&device)];
    let batches: Vec<Tensor<B, 3>> = (0..2)
        .map(|_| Tensor::random([2, 7, 12], Distribution::Normal(0.0, 1.0), &device))
        .collect();
    for x in &batches {
        let _ = single.forward(x.clone());
    }
    let want = single.update_balance();
    assert!(want.iter().any(|&b| b != 0.0), "QB moved the bias");

    let _one = COLLECTIVE.lock().unwrap_or_else(|e| e.into_inner());
    let got: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = replicas
            .into_iter()
            .zip(batches.clone())
            .enumerate()
            .map(|(i, (moe, x))| {
                scope.spawn(move || {
                    let peer = Peer::<B>::local(i, 2, &Default::default()).expect("register");
                    let _ = moe.forward(x);
                    assert_eq!(peer.balance_step(&moe).expect("all-reduce"), 2);
                    peer.finish().expect("finish");
                    moe.update_balance()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a peer"))
            .collect()
    });
    burn::collective::reset_collective::<Cpu>();
    assert_eq!(got[0], want);
    assert_eq!(got[1], want);
}
