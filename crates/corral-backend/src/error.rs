//! The backend's error type.

use crate::DType;

/// Errors raised by buffers and ops. Each variant names the op or buffer at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// An op received a buffer of the wrong element type.
    #[error("{op}: expected a {expected} buffer, got {got}")]
    WrongDType {
        /// The op that was called.
        op: &'static str,
        /// The type it needs.
        expected: DType,
        /// The type it was given.
        got: DType,
    },
    /// An op received a buffer too small for the shape it was asked to compute.
    #[error("{op}: buffer `{what}` holds {len} elements, the shape needs {needed}")]
    TooSmall {
        /// The op that was called.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// Elements it holds.
        len: usize,
        /// Elements the shape needs.
        needed: usize,
    },
    /// Arguments that contradict each other (shapes, counts, indices out of range).
    #[error("{op}: {detail}")]
    BadArgument {
        /// The op that was called.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A GPU library or device is missing or refused a call.
    #[error("{what}: {detail}")]
    Device {
        /// What was being done (the library, the call or the op).
        what: String,
        /// What went wrong.
        detail: String,
    },
    /// A kernel found an index out of range (or a value it cannot represent) and raised the
    /// device's error flag.
    #[error("{what} (found on the device; the step's results are invalid)")]
    DeviceIndex {
        /// Which kind of index.
        what: &'static str,
    },
    /// A buffer of another backend was passed in.
    #[error("{op}: buffer belongs to another backend")]
    ForeignBuffer {
        /// The op that was called.
        op: &'static str,
    },
}

/// Result alias for backend operations.
pub type Result<T, E = BackendError> = std::result::Result<T, E>;
