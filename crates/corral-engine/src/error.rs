//! The engine's error type.

use std::path::PathBuf;

/// Errors from tokenizing, templating, sampling setup and generation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// `tokenizer.json` is missing or cannot be parsed.
    #[error("{}: cannot load tokenizer: {detail}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The cause.
        detail: String,
    },
    /// Text could not be encoded or ids decoded.
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// `tokenizer_config.json` or `generation_config.json` is malformed.
    #[error("{}: field `{field}`: {problem}", path.display())]
    ConfigField {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// What is wrong.
        problem: String,
    },
    /// The checkpoint has no chat template, or it fails to compile or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A generation or sampling parameter is out of range.
    #[error("invalid `{param}`: {problem}")]
    InvalidParameter {
        /// The parameter.
        param: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A response format, JSON schema or grammar cannot be compiled into a constraint.
    #[error("{0}")]
    Grammar(String),
    /// The KV cache cannot hold the sequence.
    #[error(transparent)]
    OutOfBlocks(#[from] crate::OutOfBlocks),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] corral_model::ModelError),
    /// A spilled session file could not be written, or is unusable (short, corrupt, from
    /// another model or layout).
    #[error("session file {}: {detail}", path.display())]
    Spill {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}
