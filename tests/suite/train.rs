//! The tiny hybrid learns: a short MQAR run (few pairs, short sequences) on the CPU backend must cut
//! the loss by a large factor and recall held-out pairs, with the same loop as `examples/train_tiny`
//! (per-head Muon for hidden matrices, AdamW for the rest, QB balancing between steps).

use crate::common::*;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::ElementConversion;
use kimi_burn::data::{accuracy_from_logits, masked_cross_entropy, Mqar, SeededRng, Task};
use kimi_burn::model::{Ffn, KimiConfig, KimiForCausalLM};
use kimi_burn::nn::BalancerKind;
use kimi_burn::optim::KimiOptimizerConfig;

/// The MQAR task of these tests (2 pairs in 16 tokens) and the tiny preset sized for it.
pub(crate) fn small_mqar() -> (Mqar, KimiConfig) {
    let task = Mqar::new(16, 16, 2).expect("a valid MQAR setting");
    let mut config = KimiConfig::tiny();
    config.vocab_size = task.vocab_size();
    (task, config)
}

/// The optimiser of these tests: per-head Muon for hidden matrices, AdamW for the rest.
pub(crate) fn kimi_optim<B: burn::tensor::backend::AutodiffBackend>(
    model: &KimiForCausalLM<B>,
) -> kimi_burn::optim::KimiOptimizer<KimiForCausalLM<B>, B> {
    KimiOptimizerConfig::new()
        .init(model, model.param_roles())
        .expect("per-head Muon roles")
}

/// `n` models with the same parameters and biases, each with a balance accumulator of its own
/// (a clone would share it). The copies are loaded from the first one's record rather than
/// initialised from the same seed: the backend's generator is shared by the tests running in
/// parallel, so two seeded inits need not draw the same values.
pub(crate) fn identical_models<B: Backend>(
    config: &KimiConfig,
    device: &B::Device,
    n: usize,
) -> Vec<KimiForCausalLM<B>> {
    use burn::module::Module;
    let first: KimiForCausalLM<B> = config.try_init(device).expect("tiny preset");
    let mut models: Vec<KimiForCausalLM<B>> = (1..n)
        .map(|_| {
            config
                .init::<B>(device)
                .load_record(first.clone().into_record())
        })
        .collect();
    models.insert(0, first);
    models
}

/// Every MoE layer's balance bias, layer by layer.
pub(crate) fn moe_biases<B: Backend>(m: &KimiForCausalLM<B>) -> Vec<Vec<f32>> {
    m.layers
        .iter()
        .filter_map(|l| match &l.ffn {
            Ffn::Moe(moe) => Some(moe.balance.bias_host()),
            Ffn::Dense(_) => None,
        })
        .collect()
}

#[test]
fn two_hundred_steps_of_mqar_cut_the_loss() {
    type B = CpuAd;
    let device = Default::default();
    B::seed(&device, 7);
    // 2 pairs in 16 tokens, 7 possible keys and 8 values: chance loss is ln 8 ≈ 2.08.
    let (task, config) = small_mqar();
    let mut model: KimiForCausalLM<B> = config.try_init(&device).expect("tiny preset");
    let mut optim = KimiOptimizerConfig::new()
        .init(&model, model.param_roles())
        .expect("per-head Muon roles");
    let mut rng = SeededRng::new(7);
    let mut losses = Vec::new();
    for step in 0..200 {
        let batch = task.sample_batch(32, &mut rng);
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let logits = model
            .try_forward(inputs, None, None)
            .expect("forward")
            .logits;
        let loss = masked_cross_entropy(logits, targets);
        losses.push(loss.clone().into_scalar().elem::<f64>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        // Linear warm-up over 10 steps, then a constant rate.
        let lr = 1e-2 * ((step + 1) as f64 / 10.0).min(1.0);
        model = optim.step(lr, model, grads);
        model.update_balance();
    }
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[190..]));
    assert!(
        last < first / 5.0,
        "loss went from {first:.3} (first 10 steps) to {last:.3} (last 10): expected a 5x cut"
    );
    // Held-out sequences from another seed, without autodiff.
    let eval = model.valid();
    let batch = task.sample_batch(64, &mut SeededRng::new(99));
    let (inputs, _) = batch.to_tensors(&device);
    let acc = accuracy_from_logits(eval.forward(inputs), &batch.targets).expect("targets");
    let frac = acc.fraction().expect("scored tokens");
    assert!(
        frac > 0.8,
        "held-out recall accuracy {frac:.3}, expected > 0.8"
    );
}

/// Gradient accumulation: two micro-batches of 8 sequences, each loss weighted by its share of
/// the scored targets, gradients summed and the QB histograms of both pooled into one balance
/// update, give the same training as one batch of all 16: losses, every parameter (through the
/// logits on held-out data) and every MoE layer's bias after 5 steps. The two differ only in the
/// order of f32 sums (the weight gradients sum 16 sequences in one matmul or in two), so the
/// comparison allows 1e-5 (losses) and 1e-4 (parameters, biases) relative, as long as every
/// token is routed alike: from the first step whose expert loads differ (a token within rounding
/// of a routing tie, which some initialisations reach at step 2) the runs are compared no further
/// (`parallel::two_peers_...` explains).
#[test]
fn micro_batches_train_like_their_whole_batch() {
    use burn::optim::GradientsAccumulator;
    type B = CpuAd;
    let device = Default::default();
    let (task, config) = small_mqar();
    let optim = kimi_optim::<B>;
    let mut models = identical_models::<B>(&config, &device, 2);
    let mut micro = models.pop().expect("two models");
    let mut whole = models.pop().expect("two models");
    let (mut whole_optim, mut micro_optim) = (optim(&whole), optim(&micro));
    let mut rng = SeededRng::new(11);
    let loads_of = |stats: &[kimi_burn::nn::MoeStats]| -> Vec<Vec<u64>> {
        stats.iter().map(|s| s.tokens_per_expert.clone()).collect()
    };
    let mut flip = None;
    for step in 0..5 {
        let batch = task.sample_batch(16, &mut rng);
        let lr = 1e-2;
        let (inputs, targets) = batch.to_tensors::<B>(&device);
        let out = whole.try_forward(inputs, None, None).expect("forward");
        let whole_loads = loads_of(&out.moe_stats());
        let loss = masked_cross_entropy(out.logits, targets);
        let whole_loss = loss.clone().into_scalar().elem::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), &whole);
        whole = whole_optim.step(lr, whole, grads);
        whole.update_balance();

        let mut acc = GradientsAccumulator::new();
        let mut micro_loss = 0.0;
        let mut micro_loads = vec![vec![0; 8]; 3];
        let parts = batch.split(2).expect("16 = 2 x 8");
        for part in &parts {
            let w = part.scored() as f64 / batch.scored() as f64;
            let (inputs, targets) = part.to_tensors::<B>(&device);
            let out = micro.try_forward(inputs, None, None).expect("forward");
            for (pooled, layer) in micro_loads.iter_mut().zip(loads_of(&out.moe_stats())) {
                pooled.iter_mut().zip(layer).for_each(|(p, l)| *p += l);
            }
            let loss = masked_cross_entropy(out.logits, targets).mul_scalar(w);
            micro_loss += loss.clone().into_scalar().elem::<f64>();
            acc.accumulate(&micro, GradientsParams::from_grads(loss.backward(), &micro));
        }
        micro = micro_optim.step(lr, micro, acc.grads());
        micro.update_balance();
        if flip.is_none() && micro_loads != whole_loads {
            flip = Some(step);
        }
        if flip.is_none() {
            assert!(
                (whole_loss - micro_loss).abs() <= 1e-5 * whole_loss,
                "step {step}: loss {whole_loss} vs {micro_loss}"
            );
        }
    }
    assert!(
        flip.is_none_or(|s| s >= 2),
        "the routing differs from the whole batch's at step {flip:?}"
    );
    if flip.is_some() {
        eprintln!("a token's routing flipped at step {flip:?}; parameters not compared");
        return;
    }
    let held_out = task.sample_batch(8, &mut SeededRng::new(12));
    let (inputs, _) = held_out.to_tensors::<B>(&device);
    let logits = |m: &KimiForCausalLM<B>| host(m.valid().forward(inputs.clone().inner()));
    assert_close("held-out logits", &logits(&whole), &logits(&micro), 1e-4);
    let biases = |m: &KimiForCausalLM<B>| -> Vec<f64> {
        moe_biases(m).into_iter().flatten().map(f64::from).collect()
    };
    let (bw, bm) = (biases(&whole), biases(&micro));
    assert_eq!(bw.len(), 3 * 8, "three MoE layers of eight experts");
    assert!(bw.iter().any(|&b| b != 0.0), "QB moved the biases: {bw:?}");
    assert_close("balance biases", &bw, &bm, 1e-4);
}

/// The global balance step of data parallelism (`kimi_burn::balance_sync`): three replicas, each
/// routing its own batch, sum their balance packets (as a collective all-reduce with `Sum` would)
/// and each end with exactly the bias of one model that routed all three batches. A replica that
/// routed with another bias is an error naming the layer, and counts near the exactness bound
/// survive a sum over the most replicas a packet allows.
#[test]
fn summed_balance_packets_give_every_replica_the_global_bias() {
    use burn::tensor::Tensor;
    use kimi_burn::balance_sync::MAX_REPLICAS;
    type B = CpuAd;
    let device = Default::default();
    let (task, config) = small_mqar();
    let mut replicas = identical_models::<B>(&config, &device, 4);
    let single = replicas.pop().expect("four models");
    let mut rng = SeededRng::new(21);
    balance_steps_give_the_pooled_bias(&replicas, &single, &mut rng, 2, |_| 3);

    // A replica that routed with another bias.
    let moe = |m: &KimiForCausalLM<B>, i: usize| match &m.layers[i].ffn {
        Ffn::Moe(moe) => moe.balance.clone(),
        _ => panic!("layer {i} is a MoE layer"),
    };
    let mut shifted = moe(&replicas[1], 2).bias_host();
    shifted[0] += 0.25;
    moe(&replicas[1], 2).set_bias(&shifted);
    for replica in &replicas {
        let (inputs, _) = task.sample_batch(4, &mut rng).to_tensors::<B>(&device);
        let _ = replica.forward(inputs);
    }
    let summed = replicas
        .iter()
        .map(|m| m.balance_packet().unwrap())
        .reduce(|a, b| a + b)
        .unwrap();
    let err = replicas[0]
        .apply_balance_packet(summed)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("MoE layer 2") && err.contains("different biases"),
        "{err}"
    );

    // Counts just under the bound, summed over the most replicas, come back exact.
    let m: KimiForCausalLM<B> = config.init(&device);
    let layer = moe(&m, 1);
    let n = layer.counts().len();
    let big: Vec<u64> = (0..n as u64)
        .map(|j| (1u64 << 40) / MAX_REPLICAS - 1 - j)
        .collect();
    layer.merge(&big).unwrap();
    let packet = m.balance_packet().unwrap();
    let mut summed: Tensor<B, 1> = packet.clone();
    for _ in 1..MAX_REPLICAS {
        summed = summed + packet.clone();
    }
    assert_eq!(m.apply_balance_packet(summed).unwrap(), MAX_REPLICAS);
    let want: Vec<u64> = big.iter().map(|c| c * MAX_REPLICAS).collect();
    assert_eq!(layer.counts(), want);
    // One more and the packet refuses.
    layer.merge(&vec![(1u64 << 40) / MAX_REPLICAS; n]).unwrap();
    let err = m.balance_packet().unwrap_err().to_string();
    assert!(err.contains("layer 1"), "{err}");
}

/// A replica without a share of a step (a last batch smaller than the replica count) still
/// takes part in the balance step: the others' counts reach it, and its update gives the bias
/// they get, also in its very first step (it knows its routers' top-k without routing).
#[test]
fn a_replica_that_routed_nothing_updates_to_the_others_bias() {
    let device = Default::default();
    let (_, config) = small_mqar();
    let mut models = identical_models::<CpuAd>(&config, &device, 3);
    let single = models.pop().expect("three models");
    // Step 1: both replicas route a batch; steps 0 and 2: only the first.
    let busy = |step| if step == 1 { 2 } else { 1 };
    balance_steps_give_the_pooled_bias(&models, &single, &mut SeededRng::new(22), 3, busy);
}

/// `steps` global balance steps of `replicas`: in step `s` the first `busy(s)` of them route a
/// batch each (and `single` routes them all), then every replica applies the summed balance
/// packets and updates its biases, which must then be `single`'s, and moved by QB.
fn balance_steps_give_the_pooled_bias(
    replicas: &[KimiForCausalLM<CpuAd>],
    single: &KimiForCausalLM<CpuAd>,
    rng: &mut SeededRng,
    steps: usize,
    busy: impl Fn(usize) -> usize,
) {
    let device = Default::default();
    let (task, _) = small_mqar();
    for step in 0..steps {
        for replica in &replicas[..busy(step)] {
            let (inputs, _) = task.sample_batch(4, rng).to_tensors::<CpuAd>(&device);
            let _ = replica.forward(inputs.clone());
            let _ = single.forward(inputs);
        }
        let summed = replicas
            .iter()
            .map(|m| m.balance_packet().unwrap())
            .reduce(|a, b| a + b)
            .unwrap();
        for replica in replicas {
            let count = replica.apply_balance_packet(summed.clone()).unwrap();
            assert_eq!(count, replicas.len() as u64);
            replica.update_balance();
        }
        single.update_balance();
        let want = moe_biases(single);
        assert!(
            want.iter().flatten().any(|&b| b != 0.0),
            "QB moved the biases"
        );
        for (r, replica) in replicas.iter().enumerate() {
            assert_eq!(moe_biases(replica), want, "replica {r}, step {step}");
        }
    }
}

/// Survive a kill (`kimi_burn::checkpoint`): a run that checkpoints every 2 steps and dies after
/// step 5 (everything in memory dropped), resumed from its latest checkpoint (step 4) and run to
/// step 6, ends with the same parameters and balance biases as an uninterrupted 6-step run, bit
/// for bit: the saved models' files are byte-identical. Losing any piece of state (the
/// optimiser's moments, the data generator's position, a bias) changes the bits.
#[test]
fn a_resumed_run_ends_bit_identical_to_an_uninterrupted_one() {
    resume_matches_the_whole_run(BalancerKind::quantile(), "qb");
}

/// The same with QB's drift compensation, whose memory (the last QB set and the drift) the
/// checkpoint keeps in `balance.json`: resumed with it, the run ends bit-identical; resumed with
/// the drift forgotten, its biases differ (so the memory is restored, not rebuilt).
#[test]
fn a_resumed_run_with_qb_drift_compensation_ends_bit_identical() {
    resume_matches_the_whole_run(BalancerKind::quantile_trend(), "qb-trend");
}

/// Saving a step that is already saved (a run that checkpoints on an interval and again at its
/// end) replaces it without a moment in which `latest` names nothing: the earlier copy stays
/// readable until the new one has its name, also when a save stops between the two.
#[test]
fn saving_a_step_again_keeps_a_readable_latest() {
    use kimi_burn::checkpoint::{Checkpoints, LoopState};
    type B = CpuAd;
    let device = Default::default();
    let (_, config) = small_mqar();
    let dir = std::env::temp_dir().join(format!("kimi-burn-resave-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let checkpoints = Checkpoints::new(&dir);
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(&dir)
            .expect("listing")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let biases = |folder: &std::path::Path| {
        let model = Checkpoints::load_model(folder, config.init::<B>(&device), &device);
        moe_biases(&model.expect("a loadable checkpoint"))
    };
    let models = identical_models::<B>(&config, &device, 2);
    let (first, second) = (&models[0], &models[1]);
    let mut bias = moe_biases(second)[0].clone();
    bias[0] += 0.5;
    match &second.layers[1].ffn {
        Ffn::Moe(moe) => moe.balance.set_bias(&bias),
        Ffn::Dense(_) => panic!("layer 1 is a MoE layer"),
    }
    let rng = SeededRng::new(3);
    let save = |model: &KimiForCausalLM<B>| {
        checkpoints
            .save(model, &kimi_optim(model), &LoopState::new(2, &rng))
            .expect("checkpoint")
    };
    save(first);
    let again = save(second);
    assert_eq!(checkpoints.latest().expect("readable"), Some(again.clone()));
    assert_eq!(biases(&again), moe_biases(second));
    assert_eq!(listing(), ["latest", "step-00000002"]);
    // Stopped between the renames: the earlier copy is aside and `latest` finds it there.
    let aside = dir.join("step-00000002.old");
    std::fs::rename(&again, &aside).expect("rename");
    let found = checkpoints
        .latest()
        .expect("readable")
        .expect("a checkpoint");
    assert_eq!(found, aside);
    assert_eq!(biases(&found), moe_biases(second));
    save(first);
    assert_eq!(listing(), ["latest", "step-00000002"]);
    assert_eq!(biases(&again), moe_biases(first));
    let _ = std::fs::remove_dir_all(&dir);
}

fn resume_matches_the_whole_run(balancer: BalancerKind, tag: &str) {
    use kimi_burn::checkpoint::{Checkpoints, LoopState};
    use kimi_burn::optim::KimiOptimizer;
    type B = CpuAd;
    let device = Default::default();
    let (task, mut config) = small_mqar();
    config.moe.balancer = balancer;
    let trend = matches!(balancer, BalancerKind::QuantileTrend { .. });
    let dir = std::env::temp_dir().join(format!("kimi-burn-resume-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let checkpoints = Checkpoints::new(dir.join("checkpoints"));
    let start = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");
    let optim = kimi_optim::<B>;
    type Optim = KimiOptimizer<KimiForCausalLM<B>, B>;
    // Steps `from..to`, checkpointing after every second step when asked.
    let run = |mut model: KimiForCausalLM<B>,
               mut optim: Optim,
               mut rng: SeededRng,
               steps: std::ops::Range<usize>,
               save: bool| {
        for step in steps {
            let batch = task.sample_batch(8, &mut rng);
            let (inputs, targets) = batch.to_tensors::<B>(&device);
            let loss = masked_cross_entropy(model.forward(inputs), targets);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2 * (step + 1) as f64 / 6.0, model, grads);
            model.update_balance();
            if save && (step + 1) % 2 == 0 {
                checkpoints
                    .save(&model, &optim, &LoopState::new(step + 1, &rng))
                    .expect("checkpoint");
            }
        }
        model
    };
    let saved = |model: &KimiForCausalLM<B>, name: &str| {
        let path = dir.join(name);
        model.valid().save_safetensors(&path).expect("save");
        std::fs::read(&path).expect("read back")
    };

    let whole = start.replica(&device);
    let whole = run(whole.clone(), optim(&whole), SeededRng::new(5), 0..6, false);
    let killed = start.replica(&device);
    drop(run(
        killed.clone(),
        optim(&killed),
        SeededRng::new(5),
        0..5,
        true,
    ));

    let folder = checkpoints
        .latest()
        .expect("readable")
        .expect("a checkpoint");
    let state = Checkpoints::state(&folder).expect("state");
    assert_eq!(state.step, 4, "the last checkpoint before the kill");
    let model =
        Checkpoints::load_model(&folder, config.init::<B>(&device), &device).expect("model");
    let resumed_optim =
        Checkpoints::load_optimizer(&folder, optim(&model), &device).expect("optimiser");
    assert_eq!(
        folder.join("balance.json").exists(),
        trend,
        "the drift memory is saved exactly when the balancer keeps one"
    );
    if trend {
        assert!(
            model
                .drift_memory()
                .iter()
                .flatten()
                .any(|m| !m.drift.is_empty()),
            "the checkpoint restored a drift estimate"
        );
        // The same checkpoint with the drift forgotten must end elsewhere.
        let forgetful =
            Checkpoints::load_model(&folder, config.init::<B>(&device), &device).expect("model");
        forgetful
            .set_drift_memory(vec![None; forgetful.drift_memory().len()])
            .expect("forget");
        let forgetful_optim =
            Checkpoints::load_optimizer(&folder, optim(&forgetful), &device).expect("optimiser");
        let forgetful = run(
            forgetful,
            forgetful_optim,
            state.rng(),
            state.step..6,
            false,
        );
        assert_ne!(
            moe_biases(&whole),
            moe_biases(&forgetful),
            "the drift memory changes the biases"
        );
    }
    let resumed = run(model, resumed_optim, state.rng(), state.step..6, false);

    assert!(
        moe_biases(&whole).iter().flatten().any(|&b| b != 0.0),
        "QB moved the biases"
    );
    assert_eq!(moe_biases(&whole), moe_biases(&resumed));
    assert!(
        saved(&whole, "whole.safetensors") == saved(&resumed, "resumed.safetensors"),
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    // Only the latest checkpoint is kept.
    let kept: Vec<_> = std::fs::read_dir(checkpoints.dir())
        .expect("listing")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept.len(), 2, "latest and step-00000004: {kept:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `calibrate_balance` fits the biases to the batches it is given without training: from biases
/// skewed on purpose, the pooled violation it reports must fall below half, routing the same
/// batches again (on the inference backend, which counts nothing) must give exactly the loads it
/// reports for the bias it kept, and the parameters, the balancers' counts and the drift memory
/// must be left as the method's docs say. Other balancers are refused before anything is routed.
#[test]
fn calibration_fits_the_biases_to_the_batches_and_touches_nothing_else() {
    use kimi_burn::nn::MoeStats;
    type B = CpuAd;
    let device = Default::default();
    let (task, mut config) = small_mqar();
    config.moe.balancer = BalancerKind::quantile_trend();
    let model = identical_models::<B>(&config, &device, 1)
        .pop()
        .expect("a model");
    let mut rng = SeededRng::new(41);
    // Some training first, so the drift memory holds something to forget.
    let optim = &mut kimi_optim(&model);
    let mut model = model;
    for _ in 0..3 {
        let (inputs, targets) = task.sample_batch(8, &mut rng).to_tensors::<B>(&device);
        let loss = masked_cross_entropy(model.forward(inputs), targets);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
        model.update_balance();
    }
    assert!(model
        .drift_memory()
        .iter()
        .flatten()
        .any(|m| !m.drift.is_empty()));
    for (i, layer) in model.layers.iter().enumerate() {
        if let Ffn::Moe(moe) = &layer.ffn {
            let mut skewed = vec![0.0f32; moe.balance.bias_host().len()];
            let at = i % skewed.len();
            skewed[at] = 0.6;
            moe.balance.set_bias(&skewed);
        }
    }
    // Every matrix parameter's bits (the 1-D tensors include the biases, which must change).
    struct Matrices(Vec<u32>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Matrices {
        fn visit_float<const D: usize>(
            &mut self,
            param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
        ) {
            if D >= 2 {
                self.0.extend(bits(param.val()));
            }
        }
    }
    let params = |m: &KimiForCausalLM<B>| {
        use burn::module::Module;
        let mut v = Matrices(Vec::new());
        m.valid().visit(&mut v);
        v.0
    };
    let batches: Vec<_> = (0..3)
        .map(|_| task.sample_batch(8, &mut rng).to_tensors::<B>(&device).0)
        .collect();
    let before_params = params(&model);
    assert!(!before_params.is_empty());

    let fit = model.calibrate_balance(&batches, 5).expect("QB layers");
    let worst = |v: &[f32]| v.iter().copied().fold(0.0f32, f32::max);
    assert!(
        worst(&fit.before) > 0.5,
        "the skewed biases must start unbalanced: {:?}",
        fit.before
    );
    assert!(
        worst(&fit.after) < 0.5 * worst(&fit.before),
        "calibration must at least halve the worst pooled violation: {:?} -> {:?}",
        fit.before,
        fit.after
    );
    // The same batches routed again with the kept biases, counting nothing.
    let inference = model.valid();
    let mut loads: Vec<Vec<u64>> = Vec::new();
    for ids in &batches {
        let out = inference
            .forward_with_stats(ids.clone().inner())
            .expect("forward");
        for (l, stats) in out.moe_stats().iter().enumerate() {
            if loads.len() <= l {
                loads.push(vec![0; stats.tokens_per_expert.len()]);
            }
            loads[l]
                .iter_mut()
                .zip(&stats.tokens_per_expert)
                .for_each(|(a, c)| *a += c);
        }
    }
    let again: Vec<f32> = loads
        .into_iter()
        .map(|l| MoeStats::from_loads(l).max_violation)
        .collect();
    assert_eq!(
        again, fit.after,
        "the reported violations are the kept biases'"
    );
    assert!(params(&model) == before_params, "parameters untouched");
    for layer in &model.layers {
        if let Ffn::Moe(moe) = &layer.ffn {
            assert!(
                moe.balance.counts().iter().all(|&c| c == 0),
                "counts left empty"
            );
            assert_eq!(
                moe.balance.drift_memory(),
                Some(Default::default()),
                "drift forgotten"
            );
        }
    }

    // Refusals.
    let err = model
        .calibrate_balance(&batches, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("0 sweeps"), "{err}");
    let err = model.calibrate_balance(&[], 2).unwrap_err().to_string();
    assert!(err.contains("0 batches"), "{err}");
    config.moe.balancer = BalancerKind::Sign { gamma: 1e-3 };
    let sign: KimiForCausalLM<B> = config.init(&device);
    let bias = moe_biases(&sign);
    let err = sign.calibrate_balance(&batches, 2).unwrap_err().to_string();
    assert!(
        err.contains("Quantile Balancing") && err.contains("Sign"),
        "{err}"
    );
    assert_eq!(moe_biases(&sign), bias);
}
