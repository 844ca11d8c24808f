//! One error type for the whole core. Each variant maps to one Python exception class in the binding.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file the model directory must contain is absent.
    #[error("{path}: no such file ({what})")]
    FileNotFound { path: PathBuf, what: String },

    /// A weights/tokenizer file exists but cannot be used (truncated, wrong tensor, wrong shape...).
    #[error("{0}")]
    ModelLoad(String),

    /// config.json / generation_config.json / tokenizer_config.json content is malformed or inconsistent.
    #[error("{0}")]
    Config(String),

    /// The checkpoint's architecture (or one of its options) is not one we run.
    #[error("{0}")]
    Unsupported(String),

    /// The caller asked for something invalid (bad token ids, out-of-range parameter...).
    #[error("{0}")]
    InvalidRequest(String),

    /// A parameter name that the request does not take (a `TypeError` in Python).
    #[error("{0}")]
    UnknownParameter(String),

    /// prompt + completion does not fit the model's context.
    #[error("{0}")]
    ContextLength(String),

    /// The caller cancelled the work (a `Cancel` token: a stream's cancel, a client gone, an interrupt).
    #[error("{0}")]
    Cancelled(String),

    /// Anything raised by the tensor backend during compute.
    #[error("tensor backend error: {0}")]
    Backend(#[from] candle_core::Error),

    /// A bug: a panic caught at the boundary, or a broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidRequest(msg.into())
    }
    pub fn load(msg: impl Into<String>) -> Self {
        Error::ModelLoad(msg.into())
    }
}

/// Run `f`, turning a Rust panic into [`Error::Internal`] so that it never aborts the host process.
pub fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "unknown panic".to_string()
            };
            Err(Error::Internal(msg))
        }
    }
}
