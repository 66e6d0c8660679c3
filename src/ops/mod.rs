//! Functional ops: pure functions on tensors, the reference implementation of every block, and the
//! faster paths each op chooses for itself.
//!
//! Each op runs on any Burn backend (with autodiff); modules in [`crate::nn`] call them and never
//! choose a path. Every backend of an op lives in the op's folder: [`kda`] (the reference
//! recurrence, chunked and recurrent forms, the CPU host kernels, the CubeCL launch glue and the
//! autodiff of the kernels) and [`moe`] (routing, token dispatch, SiTU-GLU, likewise). What they
//! share (the registry of kernel backends, the kernels switch, the CPU host-kernel runner, the
//! `Fusion` glue) is [`backend`].

pub(crate) mod attention;
pub mod attn_res;
pub mod backend;
pub mod kda;
pub mod layout;
pub(crate) mod linear;
pub mod loss;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod precision;
pub mod quant;

pub use backend::{kernel_calls, last_path, set_kernels, with_kernels, FusedOp, KernelPath};
pub use backend::{
    tensor_core_emulation, tensor_core_launches, tensor_cores_enabled, with_tensor_core_emulation,
    with_tensor_cores,
};
pub use moe::situ::{situ_glu, situ_glu_weighted};
