//! The hybrid model: presets, incremental decoding, generation and Hugging Face checkpoints
//! (design §6, §7).

use crate::common::*;
use burn::module::Module;
use burn::tensor::{backend::AutodiffBackend, Int, Tensor, TensorData};
use kimi_burn::generate::Sampling;
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use rand::Rng;

/// The tiny preset, shrunk further so that the wgpu (lavapipe) runs stay quick.
pub(crate) fn small() -> KimiConfig {
    let mut c = KimiConfig::tiny();
    c.vocab_size = 64;
    c
}

fn ids<B: burn::tensor::backend::Backend>(
    r: &mut rand::rngs::StdRng,
    batch: usize,
    t: usize,
    vocab: usize,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = (0..batch * t)
        .map(|_| r.random_range(0..vocab as i64))
        .collect();
    Tensor::from_data(TensorData::new(v, [batch, t]), device)
}

#[test]
fn preset_parameter_counts_match_the_published_totals() {
    // Published: K3 about 2.8T total / 104B active; Kimi-Linear-48B-A3B 48B / 3B.
    let k3 = KimiConfig::k3();
    let (total, active) = (k3.num_params() as f64, k3.active_params() as f64);
    println!("K3: {total:.4e} total, {active:.4e} active");
    assert!((2.7e12..2.9e12).contains(&total), "K3 total {total:e}");
    assert!((0.95e11..1.15e11).contains(&active), "K3 active {active:e}");
    let kl = KimiConfig::kimi_linear_48b();
    let (total, active) = (kl.num_params() as f64, kl.active_params() as f64);
    println!("Kimi-Linear-48B: {total:.4e} total, {active:.4e} active");
    assert!(
        (4.6e10..5.0e10).contains(&total),
        "Kimi-Linear total {total:e}"
    );
    assert!(
        (2.5e9..3.5e9).contains(&active),
        "Kimi-Linear active {active:e}"
    );
}

#[test]
fn config_parameter_count_equals_the_built_model() {
    let device = Default::default();
    // Burn's `num_params` also counts the balance bias, a `RunningState` buffer `[n]` per MoE layer.
    let buffers = |c: &KimiConfig| {
        ((c.num_hidden_layers - c.first_k_dense_replace) * c.moe.num_experts) as u64
    };
    for mut config in [KimiConfig::tiny(), small()] {
        let model = config.init::<Cpu>(&device);
        assert_eq!(
            model.num_params() as u64,
            config.num_params() + buffers(&config)
        );
        config.attn_res_block_size = None;
        config.tie_word_embeddings = true;
        let model = config.init::<Cpu>(&device);
        assert_eq!(
            model.num_params() as u64,
            config.num_params() + buffers(&config)
        );
    }
}

pub(crate) fn check_prefill_then_decode_equals_one_pass<B: AutodiffBackend>(device: &B::Device) {
    let mut r = rng(51);
    let config = small();
    let model = config.init::<B::InnerBackend>(device);
    let (t1, t2) = (5, 4);
    let all = ids::<B::InnerBackend>(&mut r, 2, t1 + t2, config.vocab_size, device);
    let full = host(model.forward(all.clone()));
    let mut cache = model.new_cache();
    let mut parts = vec![
        model
            .try_forward(all.clone().narrow(1, 0, t1), None, Some(&mut cache))
            .unwrap()
            .logits,
    ];
    for i in t1..t1 + t2 {
        parts.push(
            model
                .try_forward(all.clone().narrow(1, i, 1), None, Some(&mut cache))
                .unwrap()
                .logits,
        );
    }
    assert_eq!(cache.len(), t1 + t2);
    let stepped = host(Tensor::cat(parts, 1));
    // Prefill and decode multiply different shapes with Burn's matmul (TF32 on CUDA).
    let tol = matmul_tol::<B>(device, 1e-4);
    assert_close("prefill + decode vs one pass", &full, &stepped, tol);
}
on_backends!(
    prefill_then_decode_equals_one_pass,
    check_prefill_then_decode_equals_one_pass
);

/// Prompts of different lengths prefilled as one padded batch into a cache, then decoded token by
/// token: every row's logits equal those of its own tokens run alone, with the padding on the
/// right, on the left, in between, or absent (the KDA layers skip it, MLA never attends to it, the
/// MoE does not route it). A decode step in which a row is padding leaves that row's sequence as
/// it was.
pub(crate) fn check_padded_prefill_then_decode_equals_each_row_alone<B: AutodiffBackend>(
    device: &B::Device,
) {
    type Inner<B> = <B as AutodiffBackend>::InnerBackend;
    let mut r = rng(57);
    let config = small();
    let vocab = config.vocab_size;
    let model = config.init::<Inner<B>>(device);
    let (batch, t) = (4, 7);
    let prompt_pad: Vec<bool> = [
        [false, false, false, false, true, true, true],
        [true, true, false, false, false, false, false],
        [false, true, false, false, true, false, false],
        [false; 7],
    ]
    .concat();
    // Row 0 is padding in the second decode step, row 2 in the third.
    let step_pad = [
        [false; 4],
        [true, false, false, false],
        [false, false, true, false],
    ];
    let prompt: Vec<i64> = (0..batch * t)
        .map(|_| r.random_range(0..vocab as i64))
        .collect();
    let steps: Vec<Vec<i64>> = step_pad
        .iter()
        .map(|_| {
            (0..batch)
                .map(|_| r.random_range(0..vocab as i64))
                .collect()
        })
        .collect();
    let ids = |v: Vec<i64>, shape: [usize; 2]| {
        Tensor::<Inner<B>, 2, Int>::from_data(TensorData::new(v, shape), device)
    };
    let mask = |v: &[bool], shape: [usize; 2]| {
        Tensor::<Inner<B>, 2, burn::tensor::Bool>::from_data(
            TensorData::new(v.to_vec(), shape),
            device,
        )
    };

    // The batch: a padded prefill, then the decode steps, each with its padding.
    let mut cache = model.new_cache();
    let mut batched = vec![host(
        model
            .try_forward(
                ids(prompt.clone(), [batch, t]),
                Some(mask(&prompt_pad, [batch, t])),
                Some(&mut cache),
            )
            .unwrap()
            .logits,
    )];
    for (tokens, pad) in steps.iter().zip(&step_pad) {
        batched.push(host(
            model
                .try_forward(
                    ids(tokens.clone(), [batch, 1]),
                    Some(mask(pad, [batch, 1])),
                    Some(&mut cache),
                )
                .unwrap()
                .logits,
        ));
    }
    let tol = matmul_tol::<B>(device, 1e-4);
    for row in 0..batch {
        // The row alone: its prompt tokens, then its decode tokens, with no padding anywhere.
        let keep: Vec<usize> = (0..t).filter(|&i| !prompt_pad[row * t + i]).collect();
        let own: Vec<i64> = keep.iter().map(|&i| prompt[row * t + i]).collect();
        let mut alone_cache = model.new_cache();
        let alone = host(
            model
                .try_forward(ids(own, [1, keep.len()]), None, Some(&mut alone_cache))
                .unwrap()
                .logits,
        );
        let at = |logits: &[f64], rows: usize, pos: usize, width: usize| {
            logits[(rows * width + pos) * vocab..][..vocab].to_vec()
        };
        for (j, &i) in keep.iter().enumerate() {
            assert_close(
                &format!("row {row}, prompt token {i}"),
                &at(&alone, 0, j, keep.len()),
                &at(&batched[0], row, i, t),
                tol,
            );
        }
        for (s, (tokens, pad)) in steps.iter().zip(&step_pad).enumerate() {
            if pad[row] {
                continue;
            }
            let alone = host(
                model
                    .try_forward(ids(vec![tokens[row]], [1, 1]), None, Some(&mut alone_cache))
                    .unwrap()
                    .logits,
            );
            assert_close(
                &format!("row {row}, decode step {s}"),
                &alone,
                &at(&batched[s + 1], row, 0, 1),
                tol,
            );
        }
    }
}
on_backends!(
    padded_prefill_then_decode_equals_each_row_alone,
    check_padded_prefill_then_decode_equals_each_row_alone
);

/// A padding mask of the wrong shape is refused before any layer writes to the cache: the same
/// call with the right mask then gives what a fresh cache gives.
#[test]
fn a_refused_padding_leaves_the_cache_untouched() {
    let device = Default::default();
    let mut r = rng(58);
    let config = small();
    let model = config.init::<Cpu>(&device);
    let prompt = ids::<Cpu>(&mut r, 2, 5, config.vocab_size, &device);
    let pad = |t: usize| {
        Tensor::<Cpu, 2, burn::tensor::Bool>::from_data(
            TensorData::new(vec![false; 2 * t], [2, t]),
            &device,
        )
    };
    let mut cache = model.new_cache();
    let err = model
        .try_forward(prompt.clone(), Some(pad(4)), Some(&mut cache))
        .map(|_| ())
        .expect_err("a [2, 4] mask for [2, 5] ids");
    assert!(err.to_string().contains("padding"), "{err}");
    let retried = model
        .try_forward(prompt.clone(), Some(pad(5)), Some(&mut cache))
        .unwrap()
        .logits;
    let mut fresh = model.new_cache();
    let expected = model
        .try_forward(prompt, Some(pad(5)), Some(&mut fresh))
        .unwrap()
        .logits;
    assert_eq!(cache.len(), 5);
    assert_eq!(host(retried), host(expected));
}

/// Streaming generation hands each step's tokens to the callback as they are produced, stops a
/// sequence at its first stop token (padding it with that token) and ends when every sequence
/// has stopped; before a stop it equals plain generation.
#[test]
fn streaming_generation_stops_each_sequence_at_its_stop_token() {
    use kimi_burn::generate::GenerateOptions;
    let device = Default::default();
    let mut r = rng(53);
    let config = small();
    let model = config.init::<Cpu>(&device);
    let prompt = ids::<Cpu>(&mut r, 2, 5, config.vocab_size, &device);
    let plain: Vec<i64> = model
        .generate(prompt.clone(), 8, Sampling::Greedy)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let rows: Vec<&[i64]> = plain.chunks(13).map(|row| &row[5..]).collect();
    // Row 0 stops at its third new token (the first time that token appears in it).
    let stop = rows[0][2];
    let first = |row: &[i64]| row.iter().position(|&id| id == stop);
    let at0 = first(rows[0]).unwrap();
    let at1 = first(rows[1]);
    let mut steps: Vec<Vec<i64>> = Vec::new();
    let options = GenerateOptions::new(8).with_stop_tokens(vec![stop]);
    let out: Vec<i64> = model
        .generate_stream(prompt.clone(), &options, |ids| {
            steps.push(ids.to_vec());
            true
        })
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let n = steps.len();
    // Every sequence has stopped by the last step, or all 8 were made.
    assert_eq!(n, at1.map_or(8, |a1| at0.max(a1) + 1));
    for (b, row) in rows.iter().enumerate() {
        let end = first(row);
        for (s, step) in steps.iter().enumerate() {
            let want = match end {
                Some(e) if s > e => stop,
                _ => row[s],
            };
            assert_eq!(step[b], want, "row {b} step {s}");
            assert_eq!(out[b * (5 + n) + 5 + s], want);
        }
    }
    // The callback can stop generation, also one with no bound of its own (`usize::MAX`).
    for max in [8, usize::MAX] {
        let mut calls = 0;
        let out = model
            .generate_stream(prompt.clone(), &GenerateOptions::new(max), |_| {
                calls += 1;
                calls < 3
            })
            .unwrap();
        assert_eq!((calls, out.dims()), (3, [2, 8]));
        let out: Vec<i64> = out.into_data().to_vec().unwrap();
        for (b, row) in rows.iter().enumerate() {
            assert_eq!(out[b * 8 + 5..b * 8 + 8], row[..3], "row {b}");
        }
    }
}

#[test]
fn greedy_generation_equals_repeated_full_forwards() {
    let device = Default::default();
    let mut r = rng(52);
    let config = small();
    let model = config.init::<Cpu>(&device);
    let prompt = ids::<Cpu>(&mut r, 2, 6, config.vocab_size, &device);
    let generated = model.generate(prompt.clone(), 5, Sampling::Greedy).unwrap();
    let mut seq = prompt;
    for _ in 0..5 {
        let logits = model.forward(seq.clone());
        let [b, t, _] = logits.dims();
        let next = logits.narrow(1, t - 1, 1).argmax(2).reshape([b, 1]);
        seq = Tensor::cat(vec![seq, next], 1);
    }
    assert_eq!(
        generated.into_data().iter::<i64>().collect::<Vec<_>>(),
        seq.into_data().iter::<i64>().collect::<Vec<_>>()
    );
    let sampled = model
        .generate(
            ids::<Cpu>(&mut r, 1, 3, config.vocab_size, &device),
            4,
            Sampling::TopP {
                temperature: 0.8,
                top_p: 0.9,
                seed: 3,
            },
        )
        .unwrap();
    assert_eq!(sampled.dims(), [1, 7]);
    assert!(model
        .generate(
            ids::<Cpu>(&mut r, 1, 3, 64, &device),
            1,
            Sampling::TopP {
                temperature: 0.0,
                top_p: 0.9,
                seed: 3
            }
        )
        .is_err());
}

#[test]
fn stats_cover_every_moe_layer_and_bad_ids_are_rejected() {
    let device = Default::default();
    let mut r = rng(53);
    let config = small();
    let model = config.init::<Cpu>(&device);
    let out = model
        .forward_with_stats(ids::<Cpu>(&mut r, 2, 7, config.vocab_size, &device))
        .unwrap();
    assert_eq!(
        out.moe_stats().len(),
        config.num_hidden_layers - config.first_k_dense_replace
    );
    for s in &out.moe_stats() {
        assert_eq!(
            s.tokens_per_expert.iter().sum::<u64>(),
            2 * 7 * config.moe.num_experts_per_token as u64
        );
    }
    let bad = Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![1i64, 64], [1, 2]), &device);
    let err = model.forward_with_stats(bad).unwrap_err().to_string();
    assert!(err.contains("0..64") && err.contains("64"), "{err}");
}

#[test]
fn checkpoint_round_trip_and_mismatches_name_the_tensors() {
    let device = Default::default();
    let mut r = rng(54);
    let config = small();
    let model = config.init::<Cpu>(&device);
    if let kimi_burn::model::Ffn::Moe(moe) = &model.layers[2].ffn {
        moe.balance
            .set_bias(&[0.1, -0.1, 0.2, 0.0, 0.0, -0.2, 0.05, -0.05]);
    }
    let dir = std::env::temp_dir().join(format!("kimi-burn-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    model.save_safetensors(&file).unwrap();
    let loaded = KimiForCausalLM::<Cpu>::from_safetensors(&config, &file, &device).unwrap();
    let x = ids::<Cpu>(&mut r, 2, 6, config.vocab_size, &device);
    assert_eq!(
        host(model.forward(x.clone())),
        host(loaded.forward(x.clone()))
    );
    // The folder form with a sharded index.
    let index = serde_json::json!({ "weight_map": { "model.norm.weight": "model.safetensors" } });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let from_dir = KimiForCausalLM::<Cpu>::from_safetensors(&config, &dir, &device).unwrap();
    assert_eq!(host(model.forward(x.clone())), host(from_dir.forward(x)));

    // More KDA heads than the checkpoint has: every affected tensor is named with both shapes.
    let mut wider = config.clone();
    wider.kda.num_heads = 4;
    let err = KimiForCausalLM::<Cpu>::from_safetensors(&wider, &file, &device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "wrong shape for model.layers.0.self_attn.q_proj.weight in {}: expected [128, 64], found [64, 64]",
            file.display()
        )),
        "{err}"
    );
    assert!(err.contains("model.layers.0.self_attn.A_log"), "{err}");
    // One more layer: its tensors are missing.
    let mut deeper = config.clone();
    deeper.num_hidden_layers = 5;
    deeper.full_attn_layers = vec![3, 4];
    let err = KimiForCausalLM::<Cpu>::from_safetensors(&deeper, &file, &device)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing tensor model.layers.4.self_attn.kv_b_proj.weight"),
        "{err}"
    );
    // One layer fewer: the checkpoint holds tensors the model does not expect.
    let mut shallower = config.clone();
    shallower.num_hidden_layers = 3;
    shallower.full_attn_layers = vec![2];
    let err = KimiForCausalLM::<Cpu>::from_safetensors(&shallower, &file, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unexpected tensor model.layers.3."), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A parameter's path, value and gradient (`None`: not in the graph, or no gradients given).
pub(crate) type ParamState = (String, Vec<f64>, Option<Vec<f64>>);

/// Every float parameter of a module, by path: its value and, when gradients are given, its
/// gradient (`None` when the parameter is not in the graph at all).
pub(crate) struct ParamSnapshot<'a, B: AutodiffBackend> {
    path: Vec<String>,
    grads: Option<&'a B::Gradients>,
    params: Vec<ParamState>,
}

impl<'a, B: AutodiffBackend> ParamSnapshot<'a, B> {
    pub(crate) fn take<M: Module<B>>(
        model: &M,
        grads: Option<&'a B::Gradients>,
    ) -> Vec<ParamState> {
        let mut s = Self {
            path: Vec::new(),
            grads,
            params: Vec::new(),
        };
        model.visit(&mut s);
        s.params
    }
}

impl<B: AutodiffBackend> burn::module::ModuleVisitor<B> for ParamSnapshot<'_, B> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
        let value = param.val();
        let grad = self.grads.and_then(|g| value.grad(g)).map(host);
        self.params.push((self.path.join("."), host(value), grad));
    }
}

/// Five AdamW steps on the small model: every trained parameter receives a non-zero gradient in at
/// least one step, every float tensor of the model ends the run at a different value, and the loss
/// falls. Two kinds of tensor get no gradient by design, and the test asserts that too: the balance
/// biases (moved by `update_balance`, never by an optimiser) and the first layer's pre-mixer
/// AttnRes mix (design §6 applies it only once a block exists; it is kept so that checkpoints have
/// the same names in every layer).
#[test]
fn a_few_training_steps_reach_every_parameter() {
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    let device = Default::default();
    let mut r = rng(55);
    let config = small();
    let mut model = config.init::<CpuAd>(&device);
    let mut optim = AdamWConfig::new().init();
    let x = ids::<CpuAd>(&mut r, 4, 9, config.vocab_size, &device);
    let target = x.clone().slice([0..4, 1..9]).reshape([32]);
    let loss_of = |m: &KimiForCausalLM<CpuAd>| {
        let logits = m
            .forward(x.clone())
            .slice([0..4, 0..8])
            .reshape([32, config.vocab_size]);
        burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, target.clone())
    };
    let initial = ParamSnapshot::<CpuAd>::take(&model, None);
    let mut reached = vec![false; initial.len()];
    let first: f32 = loss_of(&model).into_scalar();
    for _ in 0..5 {
        let loss = loss_of(&model);
        let grads = loss.backward();
        let seen = ParamSnapshot::<CpuAd>::take(&model, Some(&grads));
        assert_eq!(seen.len(), initial.len());
        for (hit, (_, _, grad)) in reached.iter_mut().zip(&seen) {
            *hit |= grad.as_ref().is_some_and(|g| g.iter().any(|&v| v != 0.0));
        }
        let params = GradientsParams::from_grads(grads, &model);
        model = optim.step(1e-2, model, params);
        model.update_balance();
    }
    let last: f32 = loss_of(&model).into_scalar();
    let fin = ParamSnapshot::<CpuAd>::take(&model, None);
    let by_design =
        |name: &str| name.ends_with(".balance.bias") || name.starts_with("layers.0.attn_res.");
    let wrong: Vec<(&str, bool)> = initial
        .iter()
        .zip(&reached)
        .filter(|((name, _, _), &hit)| hit == by_design(name))
        .map(|((name, _, _), &hit)| (name.as_str(), hit))
        .collect();
    assert!(
        wrong.is_empty(),
        "(parameter, reached by a gradient) against expectation: {wrong:?}"
    );
    assert_eq!(initial.iter().filter(|(n, _, _)| by_design(n)).count(), 5);
    let unmoved: Vec<&str> = initial
        .iter()
        .zip(&fin)
        .filter(|((name, _, _), _)| !name.starts_with("layers.0.attn_res."))
        .filter(|((_, before, _), (_, after, _))| before == after)
        .map(|((name, _, _), _)| name.as_str())
        .collect();
    assert!(
        unmoved.is_empty(),
        "parameters that never moved: {unmoved:?}"
    );
    assert!(
        initial.len() > 20,
        "only {} parameters visited",
        initial.len()
    );
    assert!(last < first, "loss must decrease: {first} -> {last}");
}

#[test]
fn optimiser_roles_follow_spec_8_and_leave_the_balance_bias_alone() {
    use burn::optim::{GradientsParams, Optimizer};
    use kimi_burn::model::{Ffn, Mixer};
    use kimi_burn::optim::{HeadSplit, KimiOptimizerConfig, ParamRole};
    let device = Default::default();
    let mut r = rng(56);
    let config = small();
    let model = config.init::<CpuAd>(&device);
    let roles = model.param_roles();
    roles.validate(&model).unwrap();
    assert_eq!(roles.get(model.embed_tokens.weight.id), ParamRole::AdamW);
    assert_eq!(
        roles.get(model.lm_head.as_ref().unwrap().weight.id),
        ParamRole::AdamW
    );
    let Mixer::Kda(kda) = &model.layers[0].mixer else {
        panic!("layer 0 is KDA")
    };
    assert_eq!(
        roles.get(kda.k_proj.weight.id),
        ParamRole::muon_per_head(HeadSplit::columns(2))
    );
    assert_eq!(roles.get(kda.q_conv1d.weight.id), ParamRole::AdamW);
    assert_eq!(roles.get(kda.a_log.id), ParamRole::AdamW);
    assert_eq!(roles.get(kda.o_proj.weight.id), ParamRole::MUON);
    let Mixer::Mla(mla) = &model.layers[3].mixer else {
        panic!("layer 3 is MLA")
    };
    assert_eq!(
        roles.get(mla.kv_b_proj.weight.id),
        ParamRole::muon_per_head(HeadSplit::columns(2))
    );
    assert_eq!(roles.get(mla.kv_a_proj_with_mqa.weight.id), ParamRole::MUON);
    let Ffn::Moe(moe) = &model.layers[1].ffn else {
        panic!("layer 1 is MoE")
    };
    // Stacked `[n, m_e, ℓ]`: Muon orthogonalises each expert's matrix (batched over `n`).
    assert_eq!(roles.get(moe.experts.w2.id), ParamRole::MUON);
    assert_eq!(
        roles.get(moe.norm.as_ref().unwrap().weight.id),
        ParamRole::AdamW
    );
    moe.balance
        .set_bias(&[0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.3]);

    let mut optim = KimiOptimizerConfig::new().init(&model, roles).unwrap();
    let x = ids::<CpuAd>(&mut r, 2, 6, config.vocab_size, &device);
    let before = host(kda.k_proj.weight.val());
    let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
    let model = optim.step(1e-2, model, grads);
    let Mixer::Kda(kda) = &model.layers[0].mixer else {
        unreachable!()
    };
    assert_ne!(
        host(kda.k_proj.weight.val()),
        before,
        "Muon must move the per-head projection"
    );
    let Ffn::Moe(moe) = &model.layers[1].ffn else {
        unreachable!()
    };
    assert_eq!(
        moe.balance.bias_host(),
        vec![0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.3]
    );
}

/// Logits and every parameter's gradient of one training forward and backward.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn logits_and_grads<B: AutodiffBackend>(
    model: &KimiForCausalLM<B>,
    ids: &[i64],
    [batch, t]: [usize; 2],
    device: &B::Device,
) -> (Vec<f64>, Vec<ParamState>) {
    let x = Tensor::<B, 2, Int>::from_data(TensorData::new(ids.to_vec(), [batch, t]), device);
    let target = x.clone().slice([0..batch, 1..t]);
    let logits = model.forward(x);
    let loss =
        kimi_burn::data::masked_cross_entropy(logits.clone().slice([0..batch, 0..t - 1]), target);
    let grads = loss.backward();
    (host(logits), ParamSnapshot::<B>::take(model, Some(&grads)))
}

/// The whole small model (KDA, MLA, Stable LatentMoE with QB, SiTU-GLU, AttnRes) on wgpu, with the
/// kernels and on the tensor-op reference, against the same weights on ndarray: logits and every
/// parameter's gradient. A defect of any op on one backend shows here even where the op-level
/// tests compare two paths on that same backend. 1e-4: the errors of every block add up.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn the_model_on_wgpu_matches_ndarray_on_both_paths() {
    check_wgpu_matches_ndarray(&small(), "plain", 1e-4);
}

/// [`the_model_on_wgpu_matches_ndarray_on_both_paths`] for `config`, logits and every gradient
/// within `tol`; `tag` keeps its files apart.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn check_wgpu_matches_ndarray(config: &KimiConfig, tag: &str, tol: f64) {
    let cpu_device = Default::default();
    let reference_model = config.init::<CpuAd>(&cpu_device);
    let dir = std::env::temp_dir().join(format!("kimi-burn-cross-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    reference_model.save_safetensors(&file).unwrap();
    let mut r = rng(57);
    let (batch, t) = (2, 11);
    let ids: Vec<i64> = (0..batch * t)
        .map(|_| r.random_range(0..config.vocab_size as i64))
        .collect();
    let (logits_ref, grads_ref) = logits_and_grads(&reference_model, &ids, [batch, t], &cpu_device);
    let device = Default::default();
    // The projections and the reference path use Burn's matmul on the GPU (TF32 on CUDA).
    let tol = matmul_tol::<GpuAd>(&device, tol);
    for kernels in [true, false] {
        let model = KimiForCausalLM::<GpuAd>::from_safetensors(config, &file, &device).unwrap();
        let (logits, grads) = kimi_burn::ops::with_kernels(kernels, || {
            logits_and_grads(&model, &ids, [batch, t], &device)
        });
        assert_close(
            &format!("logits, kernels {kernels}"),
            &logits_ref,
            &logits,
            tol,
        );
        assert_eq!(grads.len(), grads_ref.len());
        for ((name, _, want), (_, _, got)) in grads_ref.iter().zip(&grads) {
            match (want, got) {
                (Some(w), Some(g)) => {
                    assert_close(&format!("d {name}, kernels {kernels}"), w, g, tol)
                }
                (None, None) => {}
                _ => panic!("{name}: a gradient on one backend only (kernels {kernels})"),
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Token ids outside the vocabulary are an error naming the range and the values found (on the
/// CPU backend the check always runs).
#[test]
fn token_ids_outside_the_vocabulary_are_an_error() {
    let device = Default::default();
    let config = small();
    let model = config.init::<Cpu>(&device);
    for bad in [-1i64, 64, 1000] {
        let ids =
            Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![3, bad, 5, 7], [2, 2]), &device);
        let err = model.try_forward(ids, None, None).unwrap_err().to_string();
        assert!(
            err.contains("0..64") && err.contains(&bad.to_string()),
            "{err}"
        );
    }
    let ok =
        Tensor::<Cpu, 2, Int>::from_data(TensorData::new(vec![0i64, 63, 5, 7], [2, 2]), &device);
    assert!(model.try_forward(ok, None, None).is_ok());
}

/// `save_pretrained` writes a Hugging Face folder: `config.json`, f32 shards of at most the size
/// asked (plus the index) that load back to the same logits bit for bit, or one bf16 file holding
/// every value rounded to bf16.
#[test]
fn save_pretrained_shards_and_loads_back() {
    use kimi_burn::store::{SafeTensorsReader, StoreDtype};
    let d = Default::default();
    let config = small();
    let model = config.init::<Cpu>(&d);
    // Biases that bf16 would round (the file keeps them in f32).
    let mut r = rng(59);
    for layer in &model.layers {
        if let kimi_burn::model::Ffn::Moe(moe) = &layer.ffn {
            let n = config.moe.num_experts;
            let bias: Vec<f32> = (0..n).map(|_| r.random_range(-0.3f32..0.3)).collect();
            moe.balance.set_bias(&bias);
        }
    }
    let base = std::env::temp_dir().join(format!("kimi-burn-pretrained-{}", std::process::id()));
    let (f32_dir, bf16_dir) = (base.join("f32"), base.join("bf16"));
    let max = 200_000u64;
    let files = model
        .save_pretrained(&f32_dir, StoreDtype::F32, max, false)
        .unwrap();
    let shards: Vec<_> = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    assert!(shards.len() > 2, "{files:?}");
    assert!(f32_dir.join("model.safetensors.index.json").exists());
    for s in &shards {
        // Data within the limit; the header adds a few kilobytes.
        assert!(std::fs::metadata(s).unwrap().len() < max + 20_000, "{s:?}");
    }
    let read_config = KimiConfig::from_hf_config(f32_dir.join("config.json")).unwrap();
    assert_eq!(read_config, config);
    let back = KimiForCausalLM::<Cpu>::from_safetensors(&read_config, &f32_dir, &d).unwrap();
    let x = ids::<Cpu>(&mut r, 2, 7, config.vocab_size, &d);
    let bits = |t: Tensor<Cpu, 3>| {
        t.into_data()
            .iter::<f32>()
            .map(f32::to_bits)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bits(model.forward(x.clone())),
        bits(back.forward(x.clone()))
    );

    let files = model
        .save_pretrained(&bf16_dir, StoreDtype::Bf16, u64::MAX, false)
        .unwrap();
    assert!(
        files.contains(&bf16_dir.join("model.safetensors")),
        "{files:?}"
    );
    let full = SafeTensorsReader::open(&f32_dir).unwrap();
    let rounded = SafeTensorsReader::open(&bf16_dir).unwrap();
    assert_eq!(full.names().count(), rounded.names().count());
    let mut biases = 0;
    for name in full.names() {
        let exact = name.ends_with("e_score_correction_bias");
        biases += usize::from(exact);
        let want: Vec<f32> = full
            .read(name)
            .unwrap()
            .unwrap()
            .data
            .iter()
            .map(|v| {
                if exact {
                    *v
                } else {
                    half::bf16::from_f32(*v).to_f32()
                }
            })
            .collect();
        assert_eq!(rounded.read(name).unwrap().unwrap().data, want, "{name}");
    }
    assert_eq!(
        biases,
        config.num_hidden_layers - config.first_k_dense_replace
    );

    // Saving into a folder that holds another save replaces its weight files: one file over
    // shards (the index and the shards go), then shards over one file (the file goes).
    let names = |dir: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let bf16 = KimiForCausalLM::<Cpu>::from_safetensors(&config, &bf16_dir, &d).unwrap();
    std::fs::write(f32_dir.join("notes.txt"), "kept").unwrap();
    bf16.save_pretrained(&f32_dir, StoreDtype::F32, u64::MAX, false)
        .unwrap();
    assert_eq!(
        names(&f32_dir),
        ["config.json", "model.safetensors", "notes.txt"]
    );
    let again = KimiForCausalLM::<Cpu>::from_safetensors(&config, &f32_dir, &d).unwrap();
    assert_eq!(
        bits(bf16.forward(x.clone())),
        bits(again.forward(x.clone()))
    );
    assert_ne!(
        bits(model.forward(x.clone())),
        bits(again.forward(x.clone()))
    );
    let files = model
        .save_pretrained(&f32_dir, StoreDtype::F32, max, false)
        .unwrap();
    assert!(!f32_dir.join("model.safetensors").exists(), "{files:?}");
    assert_eq!(names(&f32_dir).len(), files.len() + 1, "{files:?}");
    let again = KimiForCausalLM::<Cpu>::from_safetensors(&config, &f32_dir, &d).unwrap();
    assert_eq!(bits(model.forward(x.clone())), bits(again.forward(x)));
    std::fs::remove_dir_all(&base).ok();
}
