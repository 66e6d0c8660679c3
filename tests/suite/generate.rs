//! The generation CLI (`examples/generate`) end to end on a tiny model folder, and its errors on
//! broken folders.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use kimi_burn::generate::Sampling;
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::store::StoreDtype;
use kimi_burn::tokenizer::Tokenizer;

use crate::common::Cpu;

#[path = "../../examples/generate/cli.rs"]
#[allow(dead_code)]
mod cli;

/// A tiny model folder: a sharded f32 checkpoint, `config.json` and the fixture tokenizer.
fn model_folder(tag: &str) -> (PathBuf, KimiConfig) {
    let dir = std::env::temp_dir().join(format!("kimi-burn-gen-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tok_dir = crate::tokenizer::fixture();
    let tokenizer = Tokenizer::from_dir(&tok_dir).unwrap();
    let mut config = KimiConfig::tiny();
    config.vocab_size = tokenizer.vocab_size();
    let device = Default::default();
    // Seeded: the greedy continuation the tests check must not depend on what earlier tests in
    // the process drew from the backend's generator (an early end-of-sequence token cuts it).
    <Cpu as burn::tensor::backend::Backend>::seed(&device, 5);
    let model = config.init::<Cpu>(&device);
    let files = model
        .save_pretrained(&dir, StoreDtype::F32, 200_000, false)
        .unwrap();
    assert!(files.len() > 3, "sharded: {files:?}");
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(tok_dir.join(f), dir.join(f)).unwrap();
    }
    (dir, config)
}

/// Sets `key` of the folder's `config.json` to `value`.
fn set_config(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json[key] = value;
    std::fs::write(&path, json.to_string()).unwrap();
}

fn args(dir: &Path, prompt: &str) -> cli::Args {
    cli::Args {
        model: dir.to_path_buf(),
        prompt: prompt.into(),
        bos: true,
        max_new_tokens: 12,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        backend: cli::BackendKind::Ndarray,
    }
}

/// The new ids `generate` gives for `prompt_ids`, cut after the first of `stop`.
fn reference(
    dir: &Path,
    config: &KimiConfig,
    prompt_ids: &[i64],
    n: usize,
    s: Sampling,
    stop: &[i64],
) -> Vec<i64> {
    let device = Default::default();
    let model = KimiForCausalLM::<Cpu>::from_safetensors(config, dir, &device).unwrap();
    let prompt = Tensor::<Cpu, 2, Int>::from_data(
        TensorData::new(prompt_ids.to_vec(), [1, prompt_ids.len()]),
        &device,
    );
    let all: Vec<i64> = model
        .generate(prompt, n, s)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let mut new = all[prompt_ids.len()..].to_vec();
    if let Some(at) = new.iter().position(|id| stop.contains(id)) {
        new.truncate(at + 1);
    }
    new
}

/// The text the CLI streams equals decoding the ids `generate` returns for the same prompt and
/// sampling, greedy and sampled; with an end-of-sequence id in `config.json` the CLI stops there
/// and prints nothing of it.
#[test]
fn the_cli_streams_the_decoded_ids_of_generate() {
    let (dir, config) = model_folder("ok");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let eos = i64::from(tokenizer.eos_id().unwrap());
    let device = Default::default();
    for sampled in [false, true] {
        let mut a = args(&dir, "The quick brown fox 线性");
        if sampled {
            a.temperature = 1.3;
            a.top_k = 40;
            a.top_p = 0.9;
            a.seed = 5;
        }
        let mut out = Vec::new();
        let report = cli::run::<Cpu>(&a, &device, &mut out).unwrap();
        let streamed = String::from_utf8(out).unwrap();
        let mut want_prompt = vec![i64::from(tokenizer.bos_id().unwrap())];
        want_prompt.extend(tokenizer.encode(&a.prompt, true).into_iter().map(i64::from));
        assert_eq!(report.prompt_ids, want_prompt);
        let want = reference(&dir, &config, &want_prompt, 12, a.sampling(), &[eos]);
        assert_eq!(report.generated, want, "sampled {sampled}");
        let shown: Vec<u32> = want
            .iter()
            .filter(|&&id| id != eos)
            .map(|&id| id as u32)
            .collect();
        assert_eq!(
            streamed,
            tokenizer.decode(&shown).unwrap(),
            "sampled {sampled}"
        );
        assert_eq!(report.text, streamed);
        assert!(report.prefill_tokens_per_s > 0.0 && report.decode_tokens_per_s > 0.0);
    }

    // The fourth greedy token becomes the end of sequence: the CLI stops after three.
    let a = args(&dir, "The quick brown fox 线性");
    let mut out = Vec::new();
    let greedy = cli::run::<Cpu>(&a, &device, &mut out).unwrap().generated;
    assert!(
        greedy.len() >= 4,
        "the seeded model's greedy continuation ended early: {greedy:?}"
    );
    let stop = greedy[3];
    if !greedy[..3].contains(&stop) {
        set_config(&dir, "eos_token_id", serde_json::json!([stop]));
        let mut out = Vec::new();
        let report = cli::run::<Cpu>(&a, &device, &mut out).unwrap();
        assert_eq!(report.generated, greedy[..4].to_vec());
        let shown: Vec<u32> = greedy[..3].iter().map(|&id| id as u32).collect();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            tokenizer.decode(&shown).unwrap()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A broken model folder is one error naming the file and, where one is at fault, the tensor:
/// a missing config, a missing shard, a shape mismatch, a tensor of an unsupported dtype, and a
/// tokenizer larger than the model's vocabulary.
#[test]
fn broken_model_folders_are_clear_errors() {
    let device = Default::default();
    let fails = |dir: &Path| -> String {
        let mut out = Vec::new();
        cli::run::<Cpu>(&args(dir, "hi"), &device, &mut out)
            .unwrap_err()
            .to_string()
    };

    let (dir, _) = model_folder("noconfig");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = fails(&dir);
    assert!(
        err.contains(&dir.join("config.json").display().to_string()),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    let (dir, _) = model_folder("noshard");
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("model-00002-of-"))
        .expect("a sharded checkpoint");
    std::fs::remove_file(&shard).unwrap();
    let err = fails(&dir);
    assert!(
        err.contains(&shard.display().to_string())
            && err.contains("missing shard")
            && err.contains("model."),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    let (dir, _) = model_folder("shape");
    set_config(&dir, "intermediate_size", serde_json::json!(96));
    let err = fails(&dir);
    assert!(
        err.contains("wrong shape for model.layers.0.mlp.gate_proj.weight in")
            && err.contains(".safetensors: expected [96, 64], found [128, 64]"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    // One tensor stored as I32 (same size): the reader names the file, the tensor and the dtype.
    let (dir, config) = model_folder("dtype");
    let model = KimiForCausalLM::<Cpu>::from_safetensors(&config, &dir, &device).unwrap();
    for f in std::fs::read_dir(&dir).unwrap() {
        let p = f.unwrap().path();
        if p.to_string_lossy().contains("model-0") || p.ends_with("model.safetensors.index.json") {
            std::fs::remove_file(p).unwrap();
        }
    }
    model
        .save_safetensors(dir.join("model.safetensors"))
        .unwrap();
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let at = header.find("\"model.norm.weight\"").unwrap();
    let patched = format!(
        "{}{}",
        &header[..at],
        header[at..].replacen("\"F32\"", "\"I32\"", 1)
    );
    assert_eq!(patched.len(), header.len());
    let mut bytes = bytes;
    bytes[8..8 + n].copy_from_slice(patched.as_bytes());
    std::fs::write(&file, bytes).unwrap();
    let err = fails(&dir);
    assert!(
        err.contains(&file.display().to_string())
            && err.contains("model.norm.weight")
            && err.contains("I32"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();

    let (dir, _) = model_folder("vocab");
    set_config(&dir, "vocab_size", serde_json::json!(500));
    let err = fails(&dir);
    assert!(
        err.contains("500") && err.contains("tiktoken.model"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
