//! The generation CLI's logic, shared by `main.rs` and the test suite (which runs it end to end on
//! a tiny model folder).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::{Parser, ValueEnum};
use kimi_burn::generate::{GenerateOptions, Sampling};
use kimi_burn::model::{KimiConfig, KimiForCausalLM};
use kimi_burn::tokenizer::Tokenizer;
use kimi_burn::{Error, Result};

/// The backend the model runs on.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq)]
pub enum BackendKind {
    /// Burn's CPU backend.
    Ndarray,
    /// Burn's wgpu backend (build with `--features wgpu`).
    Wgpu,
    /// Burn's CUDA backend (build with `--features cuda`).
    Cuda,
}

/// Stream text from a Kimi model folder.
#[derive(Debug, Clone, Parser)]
#[command(version, about)]
pub struct Args {
    /// A Hugging Face model folder: `config.json`, `model.safetensors` or sharded safetensors
    /// with `model.safetensors.index.json`, `tiktoken.model` and `tokenizer_config.json`.
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt. Special-token names in it (`<|im_user|>`, `[BOS]`) become their ids.
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Put the tokenizer's beginning-of-sequence token before the prompt.
    #[arg(long)]
    pub bos: bool,
    /// At most this many new tokens.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only; 0: all.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus: sample among the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Ndarray)]
    pub backend: BackendKind,
}

impl Args {
    /// The sampling rule the flags describe.
    pub fn sampling(&self) -> Sampling {
        if self.temperature == 0.0 {
            Sampling::Greedy
        } else {
            Sampling::TopKTopP {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            }
        }
    }
}

/// What a run produced and how fast.
#[derive(Debug, Clone)]
pub struct Report {
    /// The prompt's token ids.
    pub prompt_ids: Vec<i64>,
    /// The generated ids, the end-of-sequence token (when one was produced) included.
    pub generated: Vec<i64>,
    /// The text written to the output: the decoded generated ids, without the end-of-sequence
    /// token.
    pub text: String,
    /// Prefill throughput: prompt tokens per second (the first new token included in the time).
    pub prefill_tokens_per_s: f64,
    /// Decode throughput: new tokens after the first, per second.
    pub decode_tokens_per_s: f64,
}

/// The end-of-sequence ids: `eos_token_id` of `config.json` (a number or a list), else the
/// tokenizer's `eos_token`.
fn eos_ids(config: &Path, tokenizer: &Tokenizer) -> Result<Vec<i64>> {
    let text = std::fs::read_to_string(config).map_err(|source| Error::Io {
        path: config.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
        path: config.to_path_buf(),
        source,
    })?;
    let json = json.get("text_config").unwrap_or(&json);
    let ids: Vec<i64> = match json.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    };
    Ok(if ids.is_empty() {
        tokenizer.eos_id().map(i64::from).into_iter().collect()
    } else {
        ids
    })
}

/// Loads the model folder of `args`, generates on `device` and streams the text to `out` as it
/// is produced. Every problem with the folder is an error naming the file (and the tensor).
pub fn run<B: Backend>(
    args: &Args,
    device: &B::Device,
    out: &mut (dyn Write + Send),
) -> Result<Report> {
    let dir = &args.model;
    let config_path = dir.join("config.json");
    let config = KimiConfig::from_hf_config(&config_path)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(Error::config(
            "vocab_size",
            format!(
                "{} in {} is smaller than the {} ids of the tokenizer in {}",
                config.vocab_size,
                config_path.display(),
                tokenizer.vocab_size(),
                dir.join("tiktoken.model").display()
            ),
        ));
    }
    let stop = eos_ids(&config_path, &tokenizer)?;
    // A QAT model (an MX-packed folder, say) would quantise every expert's weights again on each
    // decode step: quantise them once here.
    let model =
        KimiForCausalLM::<B>::from_safetensors(&config, dir, device)?.with_quantized_weights();

    let mut prompt_ids: Vec<i64> = Vec::new();
    if args.bos {
        let bos = tokenizer.bos_id().ok_or_else(|| {
            Error::argument(
                "bos",
                "the tokenizer names no bos_token in tokenizer_config.json",
            )
        })?;
        prompt_ids.push(bos.into());
    }
    prompt_ids.extend(
        tokenizer
            .encode(&args.prompt, true)
            .into_iter()
            .map(i64::from),
    );
    if prompt_ids.is_empty() {
        return Err(Error::argument(
            "prompt",
            "empty: give --prompt text or --bos",
        ));
    }
    let n = prompt_ids.len();
    let prompt =
        Tensor::<B, 2, Int>::from_data(TensorData::new(prompt_ids.clone(), [1, n]), device);
    let options = GenerateOptions::new(args.max_new_tokens)
        .with_sampling(args.sampling())
        .with_stop_tokens(stop.clone());

    let mut stream = tokenizer.stream();
    let mut text = String::new();
    let mut generated = Vec::new();
    let mut failure: Option<Error> = None;
    let start = Instant::now();
    let mut first_token_at = None;
    // The whole generation on rayon's pool on the CPU backends (the callback is `Send`), rather
    // than each step handed there on its own.
    let generation = || {
        model.generate_stream(prompt, &options, |ids| {
            first_token_at.get_or_insert_with(Instant::now);
            let id = ids[0];
            generated.push(id);
            if stop.contains(&id) {
                return false;
            }
            let piece = u32::try_from(id)
                .map_err(|_| Error::argument("ids", format!("negative token {id}")))
                .and_then(|id| stream.push(id))
                .and_then(|piece| {
                    out.write_all(piece.as_bytes())
                        .and_then(|()| out.flush())
                        .map_err(|source| Error::Io {
                            path: PathBuf::from("<output>"),
                            source,
                        })
                        .map(|()| piece)
                });
            match piece {
                Ok(piece) => {
                    text.push_str(&piece);
                    true
                }
                Err(e) => {
                    failure = Some(e);
                    false
                }
            }
        })
    };
    kimi_burn::ops::backend::on_cpu_pool::<B, _>(generation)?;
    let end = Instant::now();
    if let Some(e) = failure {
        return Err(e);
    }
    let rest = stream.finish();
    out.write_all(rest.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| Error::Io {
            path: PathBuf::from("<output>"),
            source,
        })?;
    text.push_str(&rest);
    let first = first_token_at.unwrap_or(end);
    let prefill = (first - start).as_secs_f64();
    let decode = (end - first).as_secs_f64();
    let decoded = generated.len().saturating_sub(1);
    Ok(Report {
        prompt_ids,
        generated,
        text,
        // No token generated (`--max-new-tokens 0`): no prefill ran either.
        prefill_tokens_per_s: if first_token_at.is_none() {
            0.0
        } else {
            n as f64 / prefill.max(1e-9)
        },
        decode_tokens_per_s: if decoded == 0 {
            0.0
        } else {
            decoded as f64 / decode.max(1e-9)
        },
    })
}
