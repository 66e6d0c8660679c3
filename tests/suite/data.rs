//! Synthetic tasks (design §10): structure, determinism, errors, accuracy and the masked loss.

use std::collections::{HashMap, HashSet};

use crate::common::*;
use burn::tensor::Tensor;
use kimi_burn::data::{
    accuracy, accuracy_from_logits, masked_cross_entropy, Batch, ByteLm, Mqar, MqarFiller,
    Palindrome, SeededRng, Task, BUILTIN_CORPUS, IGNORE_INDEX, MQAR_GRID, MQAR_VOCAB,
};
use kimi_burn::Error;
use rand::Rng;

fn rows(batch: &Batch) -> impl Iterator<Item = (&[i64], &[i64])> {
    batch
        .inputs
        .chunks(batch.seq_len)
        .zip(batch.targets.chunks(batch.seq_len))
}

/// Checks one MQAR sequence from first principles; returns the positions that are scored.
fn check_mqar_sequence(task: &Mqar, x: &[i64], y: &[i64]) -> Vec<usize> {
    let pairs = task.num_pairs();
    let half = (task.vocab_size() / 2) as i64;
    let mut value_of = HashMap::new();
    for i in 0..pairs {
        let (k, v) = (x[2 * i], x[2 * i + 1]);
        // Keys never take a filler-only token: [n, V/2) with n reserved tokens, else [1, V/2).
        let first = match task.filler() {
            MqarFiller::Reserved(n) => n as i64,
            _ => 1,
        };
        assert!(
            (first..half).contains(&k),
            "key {k} outside [{first}, {half})"
        );
        assert_eq!(task.key_range(), first..half);
        assert!((half..task.vocab_size() as i64).contains(&v), "value {v}");
        assert!(value_of.insert(k, v).is_none(), "key {k} repeated");
        assert_eq!(y[2 * i], IGNORE_INDEX);
        assert_eq!(y[2 * i + 1], IGNORE_INDEX);
    }
    let mut queried = HashSet::new();
    let mut scored = Vec::new();
    for t in 2 * pairs..x.len() {
        if y[t] == IGNORE_INDEX {
            match task.filler() {
                MqarFiller::Pad => assert_eq!(x[t], 0, "filler at {t}"),
                MqarFiller::Values => assert!(
                    (half..task.vocab_size() as i64).contains(&x[t]),
                    "filler {} at {t} outside the value range",
                    x[t]
                ),
                MqarFiller::Reserved(n) => assert!(
                    (0..n as i64).contains(&x[t]),
                    "filler {} at {t} outside the {n} reserved tokens",
                    x[t]
                ),
                MqarFiller::Random => {}
                other => panic!("a filler this test does not know: {other:?}"),
            }
            continue;
        }
        assert_eq!((t - 2 * pairs) % 2, 0, "query at odd offset {t}");
        let value = value_of.get(&x[t]).copied();
        assert_eq!(
            value,
            Some(y[t]),
            "target at {t} is not the value of key {}",
            x[t]
        );
        assert!(queried.insert(x[t]), "key {} queried twice", x[t]);
        scored.push(t);
    }
    assert_eq!(queried.len(), pairs, "every key is queried once");
    scored
}

#[test]
fn mqar_sequences_have_the_zoology_structure() {
    let mut rng = SeededRng::new(1);
    let cases = [
        Mqar::new(64, 32, 8).unwrap().with_random_filler(false),
        Mqar::new(64, 37, 9).unwrap(),
        Mqar::new(64, 48, 6)
            .unwrap()
            .with_filler(MqarFiller::Values)
            .unwrap(),
        Mqar::new(64, 60, 8)
            .unwrap()
            .with_filler(MqarFiller::Reserved(6))
            .unwrap(),
        Mqar::new(MQAR_VOCAB, 64, 4).unwrap(),
        Mqar::new(300, 100, 12).unwrap().with_power_a(1.0).unwrap(),
    ];
    for task in &cases {
        let batch = task.sample_batch(6, &mut rng);
        assert_eq!((batch.batch, batch.seq_len), (6, task.seq_len()));
        assert_eq!(batch.inputs.len(), 6 * task.seq_len());
        for (x, y) in rows(&batch) {
            assert!(x
                .iter()
                .all(|&t| (0..task.vocab_size() as i64).contains(&t)));
            check_mqar_sequence(task, x, y);
        }
        assert_eq!(batch.scored(), 6 * task.num_pairs());
    }
}

#[test]
fn reserved_filler_uses_every_reserved_token_and_no_key() {
    let task = Mqar::new(256, 256, 16)
        .unwrap()
        .with_filler(MqarFiller::Reserved(8))
        .unwrap();
    assert_eq!(task.key_range(), 8..128);
    let batch = task.sample_batch(4, &mut SeededRng::new(3));
    let mut counts = [0usize; 8];
    for (x, y) in rows(&batch) {
        check_mqar_sequence(&task, x, y);
        for (t, &tok) in x.iter().enumerate().skip(32) {
            if y[t] == IGNORE_INDEX {
                counts[tok as usize] += 1;
            }
        }
    }
    // 4 × (224 − 16) filler positions over 8 tokens: about 104 each.
    assert!(
        counts.iter().all(|&c| c > 60 && c < 150),
        "filler counts {counts:?}"
    );
}

#[test]
fn mqar_queries_cluster_early_under_the_power_law() {
    // p(g) ∝ (g+1)^(a−1): with a = 0.01 most queries sit near the start of the query region,
    // with a = 1 they spread evenly.
    let mean_offset = |task: &Mqar| {
        let batch = task.sample_batch(50, &mut SeededRng::new(2));
        let mut sum = 0.0;
        for (x, y) in rows(&batch) {
            for t in check_mqar_sequence(task, x, y) {
                sum += (t - 2 * task.num_pairs()) as f64;
            }
        }
        sum / (50 * task.num_pairs()) as f64
    };
    let skewed = mean_offset(&Mqar::new(512, 256, 16).unwrap());
    let uniform = mean_offset(&Mqar::new(512, 256, 16).unwrap().with_power_a(1.0).unwrap());
    // Uniform: 16 distinct gaps out of 112, mean offset ≈ 111; the power law roughly halves it.
    assert!(
        uniform > 90.0 && uniform < 130.0,
        "uniform mean offset {uniform}"
    );
    assert!(
        skewed < 0.7 * uniform,
        "skewed {skewed} vs uniform {uniform}"
    );
}

#[test]
fn mqar_standard_grid_and_determinism() {
    let grid = Mqar::standard_grid(MQAR_VOCAB).unwrap();
    let shapes: Vec<(usize, usize)> = grid.iter().map(|t| (t.seq_len(), t.num_pairs())).collect();
    assert_eq!(shapes, MQAR_GRID.to_vec());
    assert_eq!(shapes, vec![(64, 4), (128, 8), (256, 16), (512, 64)]);

    let task = &grid[1];
    let a = task.sample_batch(4, &mut SeededRng::new(9));
    let b = task.sample_batch(4, &mut SeededRng::new(9));
    let c = task.sample_batch(4, &mut SeededRng::new(10));
    assert_eq!(a, b);
    assert_ne!(a.inputs, c.inputs);
    // Consecutive batches from one generator differ too.
    let mut rng = SeededRng::new(9);
    let first = task.sample_batch(4, &mut rng);
    assert_ne!(first, task.sample_batch(4, &mut rng));
}

fn config_error(result: Result<impl std::fmt::Debug, Error>, needles: &[&str]) {
    match result {
        Err(e @ Error::Config { .. }) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "`{msg}` lacks `{n}`");
            }
        }
        other => panic!("expected a config error mentioning {needles:?}, got {other:?}"),
    }
}

#[test]
fn impossible_settings_are_errors_naming_the_values() {
    config_error(Mqar::new(0, 64, 4), &["vocab_size", "got 0"]);
    config_error(Mqar::new(64, 0, 4), &["seq_len", "got 0"]);
    config_error(Mqar::new(64, 64, 0), &["num_pairs", "got 0"]);
    config_error(
        Mqar::new(64, 64, 20),
        &["num_pairs 20", "seq_len ≥", "80", "got 64"],
    );
    config_error(
        Mqar::new(16, 64, 8),
        &["vocab_size 16", "7 distinct keys", "18"],
    );
    assert!(
        Mqar::new(18, 32, 8).is_ok(),
        "the smallest vocabulary that fits"
    );
    config_error(
        Mqar::new(64, 64, 4).unwrap().with_power_a(0.0),
        &["power_a", "got 0"],
    );
    config_error(
        Mqar::new(64, 64, 4)
            .unwrap()
            .with_filler(MqarFiller::Reserved(0)),
        &["filler", "n = 0"],
    );
    config_error(
        Mqar::new(64, 64, 8)
            .unwrap()
            .with_filler(MqarFiller::Reserved(25)),
        &["7 distinct keys in [25, 32)", "num_pairs 8", "66"],
    );
    assert!(Mqar::new(64, 64, 8)
        .unwrap()
        .with_filler(MqarFiller::Reserved(24))
        .is_ok());
    config_error(Palindrome::new(2, 8), &["vocab_size", "got 2"]);
    config_error(Palindrome::new(10, 0), &["length", "got 0"]);
    config_error(ByteLm::new(&b"abc"[..], 3), &["at least 4 bytes", "got 3"]);
    config_error(ByteLm::new(&b"abcdef"[..], 0), &["seq_len", "got 0"]);
}

#[test]
fn palindrome_targets_spell_the_sequence_reversed() {
    let task = Palindrome::new(11, 9).unwrap();
    assert_eq!(task.seq_len(), 18);
    let batch = task.sample_batch(8, &mut SeededRng::new(4));
    let mut distinct = HashSet::new();
    for (x, y) in rows(&batch) {
        let (first, second) = x.split_at(9);
        assert!(
            first.iter().all(|&t| (0..10).contains(&t)),
            "content avoids the separator"
        );
        assert_eq!(second[0], task.separator());
        assert!(y[..9].iter().all(|&t| t == IGNORE_INDEX));
        let reversed: Vec<i64> = first.iter().rev().copied().collect();
        assert_eq!(&y[9..], &reversed[..]);
        // Teacher forcing: after the separator the inputs are the targets shifted by one.
        assert_eq!(&second[1..], &y[9..17]);
        distinct.insert(first.to_vec());
    }
    assert!(distinct.len() > 1, "sequences should differ");
    assert_eq!(batch.scored(), 8 * 9);
}

#[test]
fn byte_lm_windows_come_from_the_builtin_corpus() {
    assert!(
        BUILTIN_CORPUS.len() > 50_000 && BUILTIN_CORPUS.len() <= 200_000,
        "corpus is {} bytes",
        BUILTIN_CORPUS.len()
    );
    assert!(BUILTIN_CORPUS.is_ascii());
    let task = ByteLm::builtin(48).unwrap();
    assert_eq!(task.vocab_size(), 256);
    let batch = task.sample_batch(5, &mut SeededRng::new(5));
    for (x, y) in rows(&batch) {
        assert_eq!(&x[1..], &y[..47], "targets are the inputs shifted by one");
        let window: Vec<u8> = x.iter().chain(&y[47..]).map(|&b| b as u8).collect();
        assert!(
            BUILTIN_CORPUS.windows(49).any(|w| w == window.as_slice()),
            "window not found in the corpus"
        );
    }
    assert_eq!(batch.scored(), 5 * 48);

    let (train, held_out) = task.split(0.1).unwrap();
    assert_eq!(
        train.corpus().len() + held_out.corpus().len(),
        BUILTIN_CORPUS.len()
    );
    assert!(held_out.corpus().len() * 9 < train.corpus().len() + 100);
    assert!(task.split(1.0).is_err());
}

#[test]
fn accuracy_counts_only_scored_targets() {
    let mut rng = rng(6);
    let n = 500;
    let targets: Vec<i64> = (0..n)
        .map(|_| {
            if rng.random_bool(0.4) {
                IGNORE_INDEX
            } else {
                rng.random_range(0..5)
            }
        })
        .collect();
    let predictions: Vec<i64> = (0..n).map(|_| rng.random_range(0..5)).collect();
    let (mut correct, mut total) = (0, 0);
    for i in 0..n {
        if targets[i] >= 0 {
            total += 1;
            correct += usize::from(predictions[i] == targets[i]);
        }
    }
    let acc = accuracy(&predictions, &targets).unwrap();
    assert_eq!((acc.correct, acc.total), (correct, total));
    assert!(total < n && correct > 0);

    // From logits: the arg-max along the vocabulary, on the device.
    let device = Default::default();
    let (b, t, v) = (4, 7, 6);
    let logits_host = normal_vec(&mut rng, b * t * v);
    let targets: Vec<i64> = (0..b * t)
        .map(|i| {
            if i % 3 == 0 {
                IGNORE_INDEX
            } else {
                (i % v) as i64
            }
        })
        .collect();
    let argmax: Vec<i64> = logits_host
        .chunks(v)
        .map(|row| {
            let best = (0..v).max_by(|&i, &j| row[i].total_cmp(&row[j])).unwrap();
            best as i64
        })
        .collect();
    let expected = accuracy(&argmax, &targets).unwrap();
    let logits = from_f64::<Cpu, 3>(&logits_host, [b, t, v], &device);
    assert_eq!(
        accuracy_from_logits(logits.clone(), &targets).unwrap(),
        expected
    );
    assert!(accuracy_from_logits(logits, &targets[1..]).is_err());
}

#[test]
fn batches_become_int_tensors() {
    let device = Default::default();
    let batch = Mqar::new(64, 16, 2)
        .unwrap()
        .sample_batch(3, &mut SeededRng::new(7));
    let (inputs, targets) = batch.to_tensors::<Cpu>(&device);
    assert_eq!(inputs.dims(), [3, 16]);
    assert_eq!(targets.dims(), [3, 16]);
    let back: Vec<i64> = targets.into_data().iter::<i64>().collect();
    assert_eq!(back, batch.targets);
    let back: Vec<i64> = inputs.into_data().iter::<i64>().collect();
    assert_eq!(back, batch.inputs);
}

#[test]
fn masked_cross_entropy_matches_a_host_reference() {
    let device = Default::default();
    let mut rng = rng(8);
    let (b, t, v) = (3, 5, 7);
    let logits_host = normal_vec(&mut rng, b * t * v);
    let targets: Vec<i64> = (0..b * t)
        .map(|_| {
            if rng.random_bool(0.3) {
                IGNORE_INDEX
            } else {
                rng.random_range(0..v as i64)
            }
        })
        .collect();
    let (mut sum, mut count) = (0.0, 0);
    for (row, &y) in logits_host.chunks(v).zip(&targets) {
        if y == IGNORE_INDEX {
            continue;
        }
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let lse = max + row.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        sum += lse - row[y as usize];
        count += 1;
    }
    let batch = Batch {
        batch: b,
        seq_len: t,
        inputs: vec![0; b * t],
        targets,
    };
    let (_, target_tensor) = batch.to_tensors::<Cpu>(&device);
    let loss = masked_cross_entropy(
        from_f64::<Cpu, 3>(&logits_host, [b, t, v], &device),
        target_tensor,
    );
    assert_close(
        "masked cross-entropy",
        &[sum / count as f64],
        &host(loss),
        1e-5,
    );

    // Nothing scored: zero, not NaN.
    let none: Tensor<Cpu, 2, burn::tensor::Int> = Tensor::full([b, t], IGNORE_INDEX, &device);
    let zero = masked_cross_entropy(from_f64::<Cpu, 3>(&logits_host, [b, t, v], &device), none);
    assert_eq!(host(zero), vec![0.0]);
}
