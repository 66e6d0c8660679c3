//! Instances of the crate's generic training and inference entry points for the backends its
//! features enable, compiled once here so that crates built without optimisation reuse them
//! (feature `shared-instances`).
//!
//! rustc shares generic instances between crates when they are compiled at `opt-level` 0 or 1
//! (its `share-generics` default): a crate that needs `KimiForCausalLM::<B>::forward` for a `B`
//! this library already instantiated links the library's copy instead of generating its own. A
//! training step reaches most of Burn's backend and autodiff code, and every example and test
//! binary of a project would otherwise generate all of it again. Listing the entry points here
//! makes the library generate them once, for `Autodiff<NdArray<f32>>` and `NdArray<f32>` (and, with
//! `wgpu` or `cuda`, the plain CubeCL backends' f32 types, with and without `Autodiff`; with
//! `wgpu`, also `Autodiff<WgpuFusion<f32>>`, which the suite's fusion tests and `train_tiny`
//! train on: about 120 compile-seconds less for those two, while the library's own compile time
//! stayed within its run-to-run spread).
//!
//! In the crate's own test build (about 25 minutes on two cores before, with eight binaries that
//! each generated the whole training stack for two backends) this took the binaries from about
//! 1700 to 330 compile-seconds and added about 230 to the library. Release builds do not share
//! generics, so the feature only costs them time.
//!
//! Compiled only with a backend feature (`ndarray`, `wgpu` or `cuda`): without one there is
//! nothing to instantiate.

use std::path::Path;

use burn::backend::Autodiff;
use burn::optim::Optimizer;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::model::KimiForCausalLM;
use crate::optim::KimiOptimizer;
use crate::{KimiConfig, Result};

/// Takes the address of every listed entry point for the training backend `B`, which makes the
/// library generate them.
fn training<B: AutodiffBackend>() -> Vec<usize> {
    type Model<B> = KimiForCausalLM<B>;
    let mut v = vec![
        crate::train::accumulate_gradients::<B> as *const () as usize,
        <KimiOptimizer<Model<B>, B> as Optimizer<Model<B>, B>>::step as *const () as usize,
        Model::<B>::update_balance as *const () as usize,
        Model::<B>::forward as *const () as usize,
        Model::<B>::try_forward as *const () as usize,
        save::<B> as *const () as usize,
    ];
    v.extend(inference::<B::InnerBackend>());
    v
}

/// The same for the inference backend `B`.
fn inference<B: Backend>() -> Vec<usize> {
    type Model<B> = KimiForCausalLM<B>;
    vec![
        Model::<B>::forward as *const () as usize,
        Model::<B>::try_forward as *const () as usize,
        Model::<B>::generate as *const () as usize,
        save::<B> as *const () as usize,
        load::<B> as *const () as usize,
    ]
}

fn save<B: Backend>(model: &KimiForCausalLM<B>, path: &Path) -> Result<()> {
    model.save_safetensors(path)
}

fn load<B: Backend>(
    config: &KimiConfig,
    path: &Path,
    device: &B::Device,
) -> Result<KimiForCausalLM<B>> {
    KimiForCausalLM::from_safetensors(config, path, device)
}

/// The entry points' addresses (never called: listing them is the point).
#[doc(hidden)]
pub fn entry_points() -> Vec<usize> {
    let mut v = Vec::new();
    #[cfg(feature = "ndarray")]
    v.extend(training::<Autodiff<burn::backend::NdArray<f32>>>());
    #[cfg(feature = "wgpu")]
    {
        v.extend(training::<Autodiff<crate::backends::WgpuCube<f32>>>());
        v.extend(training::<Autodiff<crate::backends::WgpuFusion<f32>>>());
    }
    #[cfg(feature = "cuda")]
    v.extend(training::<Autodiff<crate::backends::CudaCube<f32>>>());
    v
}
