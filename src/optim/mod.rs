//! Muon per head with AdamW for the rest (design §8), on Burn's optimiser API.
//!
//! - [`newton_schulz`](fn@newton_schulz): the orthogonalisation itself.
//! - [`ParamRoles`]: which parameters get Muon (whole matrix or per head, [`HeadSplit`]) and which
//!   AdamW; [`ParamRoles::from_module`] is the default grouping of any module.
//! - [`KimiOptimizer`]: a Burn [`Optimizer`](burn::optim::Optimizer) that routes each gradient by
//!   role to Muon (whole matrices, head blocks ([`HeadMuon`]'s update, reconstruction) and stacks,
//!   batched across parameters by block shape) or AdamW ([`KimiAdamW`]: Burn's `AdamW`, one
//!   fused kernel per parameter on the CubeCL backends).
//!
//! ```rust
//! use burn::backend::{Autodiff, NdArray};
//! use burn::nn::LinearConfig;
//! use burn::optim::{GradientsParams, Optimizer};
//! use burn::tensor::{Distribution, Tensor};
//! use kimi_burn::optim::{HeadSplit, KimiOptimizerConfig, ParamRole, ParamRoles};
//!
//! type B = Autodiff<NdArray<f32>>;
//! let device = Default::default();
//! // A Q projection with 4 heads of width 8 (Burn layout [d_in, d_out]).
//! let q_proj = LinearConfig::new(16, 32).init::<B>(&device);
//! let roles = ParamRoles::from_module(&q_proj)
//!     .with(q_proj.weight.id, ParamRole::muon_per_head(HeadSplit::columns(4)));
//! let mut optim = KimiOptimizerConfig::new().init(&q_proj, roles)?;
//!
//! let x = Tensor::<B, 2>::random([5, 16], Distribution::Normal(0.0, 1.0), &device);
//! let loss = q_proj.forward(x).powi_scalar(2).mean();
//! let grads = GradientsParams::from_grads(loss.backward(), &q_proj);
//! let q_proj = optim.step(1e-3, q_proj, grads);
//! # let _ = q_proj;
//! # Ok::<(), kimi_burn::Error>(())
//! ```

mod adamw;
mod head_muon;
mod kimi;
mod model_roles;
mod newton_schulz;
mod roles;

pub use adamw::KimiAdamW;
pub use head_muon::{moonlight_scale, orthogonalised_update, HeadMuon};
pub use kimi::{KimiOptimizer, KimiOptimizerConfig};
pub use newton_schulz::{
    newton_schulz, newton_schulz_batched, NS_COEFFICIENTS, NS_EPSILON, NS_STEPS,
};
pub use roles::{HeadSplit, ParamRole, ParamRoles};
