//! The model crate's error type. Every variant names the file, field or tensor at fault.

use std::path::PathBuf;

/// Errors from reading configs and checkpoints, and from running a forward pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// A config field is missing, of the wrong type, or out of range.
    #[error("{}: field `{field}`: {problem}", path.display())]
    ConfigField {
        /// The config file.
        path: PathBuf,
        /// The field, dotted for nested ones.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// `model_type` names an architecture Corral does not run.
    #[error("{}: unsupported model_type `{model_type}` (supported: {supported})", path.display())]
    UnsupportedModelType {
        /// The config file.
        path: PathBuf,
        /// The value found.
        model_type: String,
        /// The values Corral accepts.
        supported: String,
    },
    /// A safetensors file is truncated or its header is corrupt.
    #[error("{}: invalid safetensors file: {detail}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A GGUF file is truncated, corrupt or of a kind Corral does not read.
    #[error("{}: invalid GGUF file: {detail}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint in {}", dir.display())]
    MissingTensor {
        /// The tensor name.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has a shape other than the config implies.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    WrongShape {
        /// The tensor name.
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor is stored in a type Corral cannot use for it.
    #[error("tensor `{name}` has dtype {dtype}; expected one of F32, BF16, F16")]
    UnsupportedDType {
        /// The tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// A feature the checkpoint needs that Corral does not have.
    #[error("not supported: {0}")]
    Unsupported(String),
    /// A batch handed to `forward` contradicts itself or the cache.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] corral_backend::BackendError),
}

/// Result alias for the model crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
