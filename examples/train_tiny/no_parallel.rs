//! `--devices N` / `--nodes N` without the crate feature `collective`: an error that says how to
//! build it.

use burn::tensor::backend::AutodiffBackend;
use kimi_burn::model::KimiForCausalLM;

use crate::{Args, Trained};

/// Always an error: data parallelism needs burn-collective.
pub(crate) fn train_replicas<B: AutodiffBackend>(
    args: &Args,
    _: &KimiForCausalLM<B>,
    devices: &[B::Device],
) -> Result<Trained<B>, String> {
    Err(format!(
        "--devices {} / --nodes {} need the crate feature `collective`: \
         cargo run --release --features collective --example train_tiny -- …",
        devices.len(),
        args.nodes
    ))
}
