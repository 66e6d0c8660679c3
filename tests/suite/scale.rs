//! The scaling presets (`KimiConfig::k3_scaled`, `KimiConfig::scaling_presets`) keep K3's
//! ratios and sizes, and the sweep of `examples/scale` (its `sweep.rs`, included here) measures
//! and writes what it promises on the CPU.

#[allow(dead_code)]
#[path = "../../examples/scale/sweep.rs"]
mod sweep;

use crate::common::*;
use burn::module::Module;
use kimi_burn::config::hybrid_pattern;
use kimi_burn::model::KimiConfig;
use kimi_burn::nn::{BalancerKind, GluActivation, MoeLayout};

/// The balance biases Burn counts as parameters: `n` per MoE layer.
fn balance_buffers(c: &KimiConfig) -> u64 {
    ((c.num_hidden_layers - c.first_k_dense_replace) * c.moe.num_experts) as u64
}

#[test]
fn scaling_presets_keep_k3s_ratios_and_grow_to_about_1b() {
    let presets = KimiConfig::scaling_presets();
    let names: Vec<&str> = presets.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4", "s5"]);
    let mut last = 0;
    for (name, c) in &presets {
        c.validate()
            .unwrap_or_else(|e| panic!("{name} must validate: {e}"));
        let (total, active) = (c.num_params(), c.active_params());
        // The table of `KimiConfig::scaling_presets`' docs.
        println!(
            "| `{name}` | {} | {} | {} × {} | {} | {} | {} | {total} | {active} |",
            c.hidden_size,
            c.num_hidden_layers,
            c.kda.num_heads,
            c.kda.head_dim,
            c.moe.moe_intermediate_size,
            c.intermediate_size,
            c.vocab_size
        );
        assert!(total > last, "{name}: {total} parameters after {last}");
        assert!(active < total, "{name}");
        last = total;
        // The 3:1 KDA:MLA pattern with the last layer MLA.
        assert_eq!(
            c.full_attn_layers,
            hybrid_pattern(c.num_hidden_layers),
            "{name}"
        );
        assert_eq!(c.full_attn_layers.last(), Some(&(c.num_hidden_layers - 1)));
        // Stable LatentMoE at ℓ = d/2, K3's 2 shared experts and k/n = 16/896.
        assert_eq!(
            c.moe.layout,
            MoeLayout::StableLatent {
                dim: c.hidden_size / 2
            },
            "{name}"
        );
        assert_eq!(c.moe.num_shared_experts, 2, "{name}");
        assert_eq!(
            c.moe.num_experts * 16,
            c.moe.num_experts_per_token * 896,
            "{name}"
        );
        assert_eq!(c.first_k_dense_replace, 1, "{name}");
        assert_eq!(c.activation, GluActivation::situ(), "{name}");
        assert!(c.attn_res_block_size.is_some(), "{name}");
        assert_eq!(c.moe.balancer, BalancerKind::quantile(), "{name}");
        assert!(c.mla.use_nope && c.mla.use_output_gate, "{name}");
        assert!(c.kda.use_full_rank_gate, "{name}");
        assert_eq!(c.kda.gate_lower_bound, Some(-5.0), "{name}");
    }
    let largest = presets.last().expect("presets").1.num_params() as f64;
    assert!(
        (0.7e9..=1.5e9).contains(&largest),
        "the largest preset has {largest:e} parameters"
    );
}

#[test]
fn k3_scaled_at_k3s_shape_is_k3_but_for_the_expert_count() {
    let mut c = KimiConfig::k3_scaled(7168, 93);
    c.moe.num_experts = 896;
    c.moe.num_experts_per_token = 16;
    assert_eq!(c, KimiConfig::k3());
}

#[test]
fn the_smallest_preset_counts_the_parameters_of_its_built_model() {
    let (name, config) = KimiConfig::scaling_presets().remove(0);
    let model = config.init::<Cpu>(&Default::default());
    assert_eq!(
        model.num_params() as u64,
        config.num_params() + balance_buffers(&config),
        "{name}"
    );
}

#[test]
fn a_short_cpu_sweep_writes_every_row_and_column() {
    let presets = vec![
        ("t0".to_string(), KimiConfig::k3_scaled(16, 2)),
        ("t1".to_string(), KimiConfig::k3_scaled(32, 2)),
    ];
    let seq_lens = [8, 16];
    let settings = sweep::Settings {
        batch: 2,
        steps: 1,
        warmup: 1,
        seed: 3,
        peak_tflops: Some(0.5),
    };
    let mut reported = 0;
    let rows = sweep::sweep::<CpuAd>(
        "ndarray",
        &presets,
        &seq_lens,
        &settings,
        &mut sweep::ProcessPeak,
        &Default::default(),
        &mut |_| {
            reported += 1;
            Ok(())
        },
    )
    .expect("the sweep runs");
    assert_eq!(reported, 4);

    let dir = std::env::temp_dir().join(format!("kimi-burn-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("scale.csv");
    sweep::write_csv(&path, &rows).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();

    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    assert_eq!(header, sweep::CSV_COLUMNS);
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let table: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(table.len(), presets.len() * seq_lens.len());
    for (i, cells) in table.iter().enumerate() {
        assert_eq!(cells.len(), header.len(), "row {i}: {cells:?}");
        let (name, config) = &presets[i / seq_lens.len()];
        let seq_len = seq_lens[i % seq_lens.len()];
        let num = |c: &str| -> f64 {
            cells[col(c)]
                .parse()
                .unwrap_or_else(|e| panic!("row {i}, {c} = {:?}: {e}", cells[col(c)]))
        };
        assert_eq!(cells[col("preset")], name);
        assert_eq!(cells[col("backend")], "ndarray");
        assert_eq!(num("seq_len"), seq_len as f64);
        assert_eq!(num("batch"), 2.0);
        assert_eq!(num("tokens_per_step"), (2 * seq_len) as f64);
        assert_eq!(num("total_params"), config.num_params() as f64, "row {i}");
        assert_eq!(num("active_params"), config.active_params() as f64);
        let tps = num("tokens_per_s");
        assert!(tps.is_finite() && tps > 0.0, "row {i}: tokens/s {tps}");
        assert!(num("step_time_s") > 0.0);
        let flops = sweep::flops_per_token(config, seq_len);
        assert!(
            flops
                > 6.0
                    * (config.active_params() - (config.vocab_size * config.hidden_size) as u64)
                        as f64
        );
        assert!((num("flops_per_token") - flops).abs() <= 0.5);
        // MFU is filled when a peak is given: achieved over 0.5 TFLOP/s.
        let mfu = num("mfu");
        assert!(mfu > 0.0 && mfu.is_finite(), "row {i}: MFU {mfu}");
        assert!((mfu - rows[i].achieved_tflops / 0.5).abs() <= 1e-5 + 1e-3 * mfu);
        assert!(num("loss").is_finite());
        if cfg!(target_os = "linux") {
            assert!(num("peak_mem_mib") > 0.0);
            assert_eq!(cells[col("mem_source")], "process_vmhwm");
        }
    }
    // The first preset is the baseline of the relative column.
    assert_eq!(table[0][col("rel_tokens_per_s")], "1.000");
    assert_eq!(table[1][col("rel_tokens_per_s")], "1.000");

    // Without a peak the MFU column stays empty.
    let row = sweep::Row {
        mfu: None,
        ..rows[0].clone()
    };
    let line = row.csv_line();
    assert_eq!(line.split(',').nth(col("mfu")), Some(""));
}

#[test]
fn the_sweep_rejects_unknown_presets_and_bad_numbers_with_a_message() {
    let err = sweep::presets(&["s1".into(), "s9".into()]).unwrap_err();
    assert!(err.contains("s9") && err.contains("s0, s1"), "{err}");
    assert!(sweep::check_seq_lens(&[64, 0])
        .unwrap_err()
        .contains("--seq-lens"));
    let bad = sweep::Settings {
        batch: 1,
        steps: 1,
        warmup: 0,
        seed: 0,
        peak_tflops: Some(-1.0),
    };
    assert!(bad.check().unwrap_err().contains("--peak-tflops"));
    let no_steps = sweep::Settings { steps: 0, ..bad };
    assert!(no_steps.check().unwrap_err().contains("--steps"));
}
