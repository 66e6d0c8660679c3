//! Burn modules: parameters plus the ops of [`crate::ops`].
//!
//! Each module follows `burn-nn`: a `#[derive(Config)]` config whose `init(&device)` builds a
//! `#[derive(Module)]` struct with a `forward` method. Configs also offer `try_init`, which reports
//! invalid values as an [`Error`](crate::Error) instead of panicking.

pub mod balance;
pub mod kda;
pub mod latent_moe;
pub mod norm;
pub mod router;
pub mod situ_glu;

pub use balance::{BalanceState, Balancer, BalancerKind, MoeStats, QuantileBalancer, SignBalancer};
pub use kda::{KdaCache, KdaConfig, KimiDeltaAttention};
pub use latent_moe::{LatentMoe, LatentMoeConfig, MoeLayout, MoeOutput};
pub use norm::{RmsNorm, RmsNormConfig};
pub use router::{Router, RouterConfig, RouterOptions, Routing};
pub use situ_glu::{GluActivation, SituGlu, SituGluConfig};

use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;

/// A bias-free `Linear` (`[d_in, d_out]`, Burn's layout), the only kind the Kimi blocks use.
pub(crate) fn linear<B: Backend>(d_in: usize, d_out: usize, device: &B::Device) -> Linear<B> {
    LinearConfig::new(d_in, d_out).with_bias(false).init(device)
}
