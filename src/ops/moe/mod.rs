//! The MoE ops (design §1–§3): the router's top-k selection with the QB histogram ([`route`]),
//! dropless token dispatch over the routed experts ([`dispatch`]) and the SiTU-GLU activation
//! ([`situ`]), each with its reference tensor-op form, its CPU host kernel where one pays, and its
//! CubeCL kernels: the backend extension [`MoeKernels`], its launch glue (`cube`) and the custom
//! backward passes for `Autodiff` (`autodiff`).

#[cfg(feature = "autodiff")]
mod autodiff;
#[cfg(feature = "cubecl-kernels")]
mod cube;
pub mod dispatch;
#[cfg(feature = "cubecl-kernels")]
mod fusion;
mod host;
pub(crate) mod kernels;
pub mod route;
pub mod situ;

pub use kernels::{MoeExpertsGrads, MoeExpertsInput, MoeKernels, MoeSaved};
pub use situ::GluActivation;
