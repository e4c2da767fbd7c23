//! Reading one safetensors header with the `safetensors` crate, which validates the header
//! length, JSON and data offsets against the file size.

use std::path::Path;

use corral_backend::DType;
use safetensors::SafeTensors;

use crate::{ModelError, Result};

/// Where one tensor's bytes are, and what they hold.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Index of the shard holding it.
    pub shard: usize,
    /// Element type, when Corral can use it.
    pub dtype: Option<DType>,
    /// Element type as the file names it.
    pub dtype_name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Offset of the data from the start of the file.
    pub byte_offset: usize,
    /// Bytes of data.
    pub byte_len: usize,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Indexes the tensors of a mapped safetensors file.
pub(crate) fn read_header(path: &Path, bytes: &[u8], shard: usize) -> Result<Vec<TensorEntry>> {
    let invalid = |detail: String| ModelError::Safetensors {
        path: path.to_path_buf(),
        detail,
    };
    let file = SafeTensors::deserialize(bytes).map_err(|e| invalid(e.to_string()))?;
    let base = bytes.as_ptr() as usize;
    let mut entries = Vec::new();
    for (name, view) in file.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::F16 => Some(DType::F16),
            // FP8 weights, read with their block scales (Checkpoint::fp8_blocks).
            safetensors::Dtype::F8_E4M3 => Some(DType::F8E4M3),
            _ => None,
        };
        let data = view.data();
        entries.push(TensorEntry {
            name,
            shard,
            dtype,
            dtype_name: format!("{:?}", view.dtype()),
            shape: view.shape().to_vec(),
            byte_offset: data.as_ptr() as usize - base,
            byte_len: data.len(),
        });
    }
    Ok(entries)
}
