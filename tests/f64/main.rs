//! f64 gradient checks, one binary: only f64 CPU backends may run here, because Burn 0.21 fixes the
//! shared `NdArrayDevice::Cpu` default dtype on first use for `NdArray<f32>` and `NdArray<f64>` alike.
// Reading tensors back is this program's business: the crate's read counter covers the library.
#![allow(clippy::disallowed_methods)]

#[path = "../common/mod.rs"]
mod common;

mod gradcheck;
mod mla_f64;
