//! The crate's single error type.
//!
//! Every fallible entry point returns [`Error`]; each variant carries the values that were wrong so
//! that the message alone tells the user what to change.

use std::path::PathBuf;

/// Everything that can go wrong in kimi-burn, with the offending values in the message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of range or inconsistent with another one.
    #[error("invalid config `{field}`: {reason}")]
    Config {
        /// The name of the offending field (`top_k`, `linear_attn_config.head_dim`, ...).
        field: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A tensor argument has the wrong shape.
    #[error("shape mismatch for `{what}`: expected {expected}, got {got}")]
    Shape {
        /// The argument or tensor that was wrong.
        what: String,
        /// The shape the op needs (may contain symbolic dims such as `[B, T, H, K]`).
        expected: String,
        /// The shape it got.
        got: String,
    },
    /// An argument has a valid shape but an invalid value.
    #[error("invalid argument `{what}`: {reason}")]
    Argument {
        /// The argument that was wrong.
        what: String,
        /// What is wrong, with the values involved.
        reason: String,
    },
    /// A tensor that must be finite contains NaN or infinity.
    #[error("non-finite values in `{what}`: {detail}")]
    NonFinite {
        /// The tensor that held the non-finite values.
        what: String,
        /// Where the first offending value is, or how many there are.
        detail: String,
    },
    /// Reading or writing a file failed.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON document (a Hugging Face `config.json` or an index file) could not be parsed.
    #[error("cannot parse JSON in {path}: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file is malformed.
    #[error("cannot read safetensors data in {path}: {reason}")]
    SafeTensors {
        /// The file involved.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A checkpoint does not match the model: missing, unexpected or mis-shaped tensors.
    #[error("checkpoint does not match the model:\n{0}")]
    Checkpoint(String),
    /// A data-parallel step failed: a collective operation (`kimi_burn::parallel`), or replicas
    /// that no longer agree.
    #[error("data-parallel {op} failed: {reason}")]
    Collective {
        /// The operation (`register`, `all-reduce`, `replica check`, ...).
        op: String,
        /// What went wrong, with the values involved.
        reason: String,
    },
    /// A tokenizer file is malformed.
    #[error("cannot read the tokenizer in {path}: {reason}")]
    Tokenizer {
        /// The file involved.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Shorthand for `std::result::Result<T, kimi_burn::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A [`Error::Config`] for `field` with the given reason.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// A [`Error::Argument`] for `what` with the given reason.
    pub fn argument(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Argument {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// A [`Error::Shape`]: `what` should have had shape `expected` but had `got`.
    pub fn shape(
        what: impl Into<String>,
        expected: impl Into<String>,
        got: impl std::fmt::Debug,
    ) -> Self {
        Self::Shape {
            what: what.into(),
            expected: expected.into(),
            got: format!("{got:?}"),
        }
    }
}
