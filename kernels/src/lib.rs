//! CubeCL kernels for kimi-burn: the fused ops behind `kimi_burn::ops` on the CubeCL backends
//! (wgpu, CUDA). Kernels only: no Burn types, no modules; `kimi-burn` launches them.
//!
//! * [`activation`]: the logistic sigmoid and its derivative without cancellation, one unit per
//!   element.
//! * [`attention`]: causal softmax attention (MLA's expanded form, design §5), forward and
//!   backward, one unit per query or key row, the scores never stored.
//! * [`attn_res`]: Attention Residuals' softmax mix over depth, forward and backward (design §6),
//!   one unit per token.
//! * [`rms_norm`]: RMSNorm forward and backward, one unit per row (design §0).
//! * [`cross_entropy`]: cross-entropy over the rows of a logit matrix, forward and backward, one
//!   unit per row, with an ignore index.
//! * [`situ`]: fused SiTU-GLU forward and backward (design §1), with an optional per-row routing
//!   weight folded in.
//! * [`qb_histogram`]: top-k routing and the Quantile Balancing histogram in one pass (design §2, §3).
//! * [`kda`]: Kimi Delta Attention (design §4): the recurrent decode kernel, the chunked forward and
//!   backward, and the gated output norm forward and backward.
//! * [`mx`]: MX fake quantisation, one unit per block of 32 (design §9).
//! * [`optim`]: the optimiser's elementwise updates (AdamW, momentum, the Muon update), one launch
//!   per parameter.
//! * [`moe`]: dropless dispatch: a stable device-side sort of the routed pairs by expert, a grouped
//!   matmul over the expert segments (one launch for all experts) and the un-permute (design §2).
//!
//! Every kernel computes in f32 whatever the storage dtype (f32, f16, bf16) and avoids float
//! atomics, so repeated runs on the same input are bit-identical.
//!
//! The kernels are generated with `launch_unchecked` only (an `unsafe fn`): each bounds its own
//! indices, provided the caller passes the buffer sizes and tables its docs name, so CubeCL's
//! per-access bounds checks would only cost time. CubeCL's `check_mode = "enforce"` (a
//! `cubecl.toml`) turns those checks back on for every launch.

// Kernel bodies are written in the forms the `#[cube]` expansion handles: a `comptime!` branch
// stays separate from the run-time condition inside it, and integer ceil-division and clamping
// are spelled out with the operators the DSL maps to device instructions.
#![allow(clippy::collapsible_if, clippy::manual_div_ceil, clippy::manual_clamp)]

pub mod activation;
pub mod attention;
pub mod attn_res;
pub mod cross_entropy;
pub mod kda;
pub mod moe;
pub mod mx;
pub mod optim;
pub mod qb_histogram;
pub mod rms_norm;
pub mod situ;

/// Four f32 lanes: the register-blocked kernels keep shared tiles and accumulators in these, so
/// one memory read feeds four multiply-adds (the grouped matmuls' micro-tiles, the KDA state
/// passes' columns, the within-chunk backward's key channels).
pub type V4 = cubecl::prelude::Vector<f32, cubecl::prelude::Const<4>>;
