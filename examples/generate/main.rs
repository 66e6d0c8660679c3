//! Streams text from a Kimi model folder (Hugging Face layout: `config.json`, safetensors shards
//! with their index, `tiktoken.model`, `tokenizer_config.json`), stopping at the model's
//! end-of-sequence token, and reports prefill and decode throughput.
//!
//! ```text
//! cargo run --release --features tokenizer --example generate -- --model DIR --prompt "Hello"
//! cargo run --release --features tokenizer --example generate -- --model DIR --prompt "Hello" \
//!     --temperature 0.8 --top-k 50 --top-p 0.95 --seed 7 --max-new-tokens 200
//! cargo run --release --features tokenizer,wgpu --example generate -- --model DIR --prompt "Hello" \
//!     --backend wgpu
//! ```
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

mod cli;

use clap::Parser;
use cli::{Args, BackendKind};

fn main() {
    let args = Args::parse();
    // Each step's freed buffers serve the next step instead of going back to the operating
    // system and being faulted in again (glibc; see `retain_freed_memory`).
    kimi_burn::ops::backend::retain_freed_memory();
    let mut stdout = std::io::stdout();
    let report = match args.backend {
        BackendKind::Ndarray => {
            cli::run::<burn::backend::NdArray<f32>>(&args, &Default::default(), &mut stdout)
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            cli::run::<burn::backend::Wgpu>(&args, &Default::default(), &mut stdout)
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            cli::run::<burn::backend::Cuda>(&args, &Default::default(), &mut stdout)
        }
        #[allow(unreachable_patterns)]
        other => {
            let name = format!("{other:?}").to_lowercase();
            eprintln!(
                "error: --backend {name} needs the crate feature of the same name: \
                 cargo run --release --features tokenizer,{name} --example generate"
            );
            std::process::exit(2);
        }
    };
    match report {
        Ok(r) => eprintln!(
            "\n[{} prompt tokens, {} new ({} characters); prefill {:.1} tokens/s, decode {:.1} tokens/s]",
            r.prompt_ids.len(),
            r.generated.len(),
            r.text.chars().count(),
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s
        ),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
