#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
// Unit tests read tensors freely; the library code reads only through `sync::read`.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod backends;
pub mod balance_sync;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod generate;
#[cfg(all(
    feature = "shared-instances",
    any(feature = "ndarray", feature = "wgpu", feature = "cuda"),
    not(test)
))]
#[doc(hidden)]
pub mod instances;
#[cfg(feature = "learner")]
pub mod learner;
pub mod model;
pub mod nn;
pub mod ops;
pub mod optim;
#[cfg(feature = "collective")]
pub mod parallel;
pub mod store;
pub mod sync;
#[cfg(feature = "tokenizer")]
pub mod tokenizer;
pub mod train;

pub use config::KimiConfig;
pub use error::{Error, Result};
