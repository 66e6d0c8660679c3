//! Integration tests, one binary: Burn and the crate's generic code are compiled once for all of
//! them (separate binaries each monomorphise the whole model again, which dominated CI time).
//! f32 only; the f64 checks live in `tests/f64` (see `common::Cpu64`).
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

#[path = "../common/mod.rs"]
mod common;

mod attn_res;
mod data;
#[cfg(feature = "wgpu")]
mod fusion;
#[cfg(feature = "tokenizer")]
mod generate;
mod kda;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels_kda;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels_moe;
mod layout;
#[cfg(feature = "learner")]
mod learner;
mod mla;
mod model;
mod moe;
mod norm_loss;
mod optim;
#[cfg(feature = "collective")]
mod parallel;
mod pool;
mod quant;
#[cfg(feature = "wgpu")]
mod reads;
mod scale;
#[cfg(feature = "tokenizer")]
mod tokenizer;
mod train;
mod train_tiny;
