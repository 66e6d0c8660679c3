//! Functional ops: pure functions on tensors, the reference implementation of every block.
//!
//! Each op here runs on any Burn backend (with autodiff); modules in [`crate::nn`] call them.

pub mod attn_res;
pub(crate) mod cpu;
pub mod dispatch;
pub mod fused;
pub mod kda;
pub mod layout;
pub mod mla;
pub mod norm;
pub mod precision;
pub mod route;
pub mod situ;

pub use fused::{kernel_calls, last_path, set_kernels, with_kernels, FusedOp, KernelPath};
pub use situ::{situ_glu, situ_glu_weighted};
