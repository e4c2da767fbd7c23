//! Hugging Face checkpoint directories: safetensors as one file or sharded through
//! `model.safetensors.index.json`, memory-mapped, with every tensor's dtype and shape indexed
//! by name. Binding names to layers is the families' job; this module only finds bytes.

mod gguf;
pub mod gguf_file;
pub mod quant;
mod safetensors_file;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_backend::{Backend, DType, DeviceBuffer, MappedFile};
use serde_json::Value;

use crate::{ModelError, Result};
pub use gguf::GgufCheckpoint;
pub use safetensors_file::TensorEntry;

/// An opened checkpoint: mapped shards and an index of their tensors.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Arc<MappedFile>>,
    tensors: HashMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Maps the safetensors files of `dir` and indexes their tensors.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files = if index_path.exists() {
            shard_files(&index_path)?
        } else if single.exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(ModelError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json exists",
                ),
            });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for name in files {
            let path = dir.join(&name);
            let file = MappedFile::open(&path).map_err(|e| match e {
                corral_backend::BackendError::Io { source, .. } => ModelError::Io {
                    path: path.clone(),
                    source,
                },
                other => other.into(),
            })?;
            let shard = shards.len();
            for entry in safetensors_file::read_header(&path, file.bytes(), shard)? {
                if tensors.contains_key(&entry.name) {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        detail: format!("tensor `{}` also appears in an earlier shard", entry.name),
                    });
                }
                tensors.insert(entry.name.clone(), entry);
            }
            shards.push(file);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The index entry of `name`, or an error naming it.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })
    }

    /// Total elements of the language model's tensors (vision towers and MTP heads, which
    /// Corral never reads, excluded).
    pub fn total_elements(&self) -> usize {
        self.language_tensors().map(TensorEntry::numel).sum()
    }

    /// Total bytes of the language model's tensor data.
    pub fn total_bytes(&self) -> usize {
        self.language_tensors().map(|t| t.byte_len).sum()
    }

    fn language_tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        const SKIPPED: [&str; 3] = ["model.visual.", "visual.", "mtp."];
        self.tensors
            .values()
            .filter(|t| !SKIPPED.iter().any(|p| t.name.starts_with(p)))
    }

    /// Loads `name`, checking that its shape is `shape`, as a weight buffer in its stored type
    /// (mapped, not copied, where the backend can).
    pub fn weight(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer> {
        let (entry, dtype) = self.checked(name, shape)?;
        let file = &self.shards[entry.shard];
        Ok(backend.weight_from_file(file, entry.byte_offset, dtype, entry.numel())?)
    }

    /// Loads `name` with shape `shape` converted to f32 (norm weights, which ops read as f32).
    pub fn weight_f32(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer> {
        let values = self.read_f32(name, shape)?;
        Ok(backend.weight_from_f32(&values, DType::F32)?)
    }

    /// Reads `name` with shape `shape` to host f32 values.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (entry, dtype) = self.checked(name, shape)?;
        let bytes = &self.shards[entry.shard].bytes()
            [entry.byte_offset..entry.byte_offset + entry.byte_len];
        Ok(match dtype {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => {
                return Err(ModelError::UnsupportedDType {
                    name: name.to_string(),
                    dtype: dtype.to_string(),
                });
            }
        })
    }

    fn checked(&self, name: &str, shape: &[usize]) -> Result<(&TensorEntry, DType)> {
        let entry = self.entry(name)?;
        let dtype = entry.dtype.ok_or_else(|| ModelError::UnsupportedDType {
            name: name.to_string(),
            dtype: entry.dtype_name.clone(),
        })?;
        if entry.shape != shape {
            return Err(ModelError::WrongShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                got: entry.shape.clone(),
            });
        }
        Ok((entry, dtype))
    }
}

/// The shard file names listed in an index's `weight_map`, in first-seen order.
fn shard_files(index_path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index_path).map_err(|source| ModelError::Io {
        path: index_path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: index_path.to_path_buf(),
        source,
    })?;
    let field = |problem: &str| ModelError::ConfigField {
        path: index_path.to_path_buf(),
        field: "weight_map".to_string(),
        problem: problem.to_string(),
    };
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| field("missing or not an object"))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| field(&format!("entry `{tensor}` is not a file name")))?;
        if file.contains('/') || file.contains("..") {
            return Err(field(&format!(
                "entry `{tensor}` names a file outside the directory"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    Ok(files)
}
