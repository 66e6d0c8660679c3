//! Burn modules: parameters plus the ops of [`crate::ops`].
//!
//! Each module follows `burn-nn`: a `#[derive(Config)]` config whose `init(&device)` builds a
//! `#[derive(Module)]` struct with a `forward` method. Configs also offer `try_init`, which reports
//! invalid values as an [`Error`](crate::Error) instead of panicking.

pub mod attn_res;
pub mod balance;
mod experts;
pub mod kda;
pub mod latent_moe;
pub mod mla;
mod mla_cache;
pub mod norm;
pub mod router;
pub mod situ_glu;

pub use attn_res::{AttnResConfig, AttnResMix};
pub use balance::{
    BalanceState, Balancer, BalancerKind, BiasState, DriftMemory, MoeLoads, MoeStats,
    QuantileBalancer, SignBalancer,
};
pub use experts::RoutedExperts;
pub use kda::{KdaCache, KdaConfig, KimiDeltaAttention};
pub use latent_moe::{LatentMoe, LatentMoeConfig, MoeLayout, MoeOutput};
pub use mla::{GatedMla, MlaConfig};
pub use mla_cache::MlaCache;
pub use norm::{RmsNorm, RmsNormConfig};
pub use router::{Router, RouterConfig, RouterOptions, Routing};
pub use situ_glu::{GluActivation, SituGlu, SituGluConfig};

use std::cell::Cell;

use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;

/// A bias-free `Linear` (`[d_in, d_out]`, Burn's layout), the only kind the Kimi blocks use.
///
/// The weight is initialised eagerly: Burn's lazy parameters initialise on first use, so a module
/// cloned before that would draw *different* weights in each clone.
pub(crate) fn linear<B: Backend>(d_in: usize, d_out: usize, device: &B::Device) -> Linear<B> {
    let layer = LinearConfig::new(d_in, d_out).with_bias(false).init(device);
    if !in_skeleton() {
        let _ = layer.weight.val();
    }
    layer
}

thread_local! {
    static SKELETON: Cell<bool> = const { Cell::new(false) };
}

/// Sets what [`in_skeleton`] says on this thread: the pool carries it between a caller and the
/// pool thread that runs its work.
pub(crate) fn set_skeleton(on: bool) {
    SKELETON.with(|s| s.set(on));
}

/// Runs `f` (a model's `init`) so that its large parameters (linear layers, the embedding, the
/// stacked routed experts) are built without drawing their values: they stay lazily initialised,
/// and a checkpoint loader replaces them without ever materialising the random model. Used by
/// [`KimiForCausalLM::from_safetensors`](crate::model::KimiForCausalLM::from_safetensors). A
/// parameter read before it is replaced is initialised then, from the same distribution but not
/// in the seeded order of an eager init (and clones made before that would draw apart, which is
/// why the normal init is eager).
pub(crate) fn skeleton<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            SKELETON.with(|s| s.set(self.0));
        }
    }
    let _reset = Reset(SKELETON.with(|s| s.replace(true)));
    f()
}

/// Whether a [`skeleton`] build is under way on this thread.
pub(crate) fn in_skeleton() -> bool {
    SKELETON.with(Cell::get)
}
