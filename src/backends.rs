//! The GPU backend types the kernels dispatch on, named by what they are.
//!
//! `burn::backend::Wgpu` and `burn::backend::Cuda` change meaning with Burn's features: with its
//! default `fusion` feature (what almost every GPU project has, as cargo unifies features) they are
//! `Fusion<CubeBackend<…>>`, without it the plain `CubeBackend<…>`. The crate's kernels run on both
//! (on `Fusion` they join the fusion stream as custom operations), with and without `Autodiff`.
//! These aliases name each type explicitly, for code and tests that must know which one they get.

#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::backend::wgpu::WgpuRuntime;

    /// The plain wgpu CubeCL backend with float type `F` (what `burn::backend::Wgpu<F>` is without
    /// Burn's `fusion` feature).
    pub type WgpuCube<F = f32> = burn_cubecl::CubeBackend<WgpuRuntime, F, i32, u32>;

    /// The wgpu backend behind Burn's operation fusion (what `burn::backend::Wgpu<F>` is with
    /// Burn's default features).
    pub type WgpuFusion<F = f32> = burn_fusion::Fusion<WgpuCube<F>>;
}
#[cfg(feature = "wgpu")]
pub use wgpu::{WgpuCube, WgpuFusion};

#[cfg(feature = "cuda")]
mod cuda {
    use cubecl::cuda::CudaRuntime;

    /// The plain CUDA CubeCL backend with float type `F` (what `burn::backend::Cuda<F>` is
    /// without Burn's `fusion` feature).
    pub type CudaCube<F = f32> = burn_cubecl::CubeBackend<CudaRuntime, F, i32, u8>;

    /// The CUDA backend behind Burn's operation fusion (what `burn::backend::Cuda<F>` is with
    /// Burn's default features).
    pub type CudaFusion<F = f32> = burn_fusion::Fusion<CudaCube<F>>;
}
#[cfg(feature = "cuda")]
pub use cuda::{CudaCube, CudaFusion};
