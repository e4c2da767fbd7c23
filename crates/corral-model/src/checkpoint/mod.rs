//! Hugging Face checkpoint directories: safetensors as one file or sharded through
//! `model.safetensors.index.json`, memory-mapped, with every tensor's dtype and shape indexed
//! by name. Binding names to layers is the families' job; this module only finds bytes.

mod gguf;
pub mod gguf_file;
mod gguf_hybrid;
pub(crate) mod hybrid_layout;
pub mod quant;
mod safetensors_file;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_backend::{Backend, DType, DeviceBuffer, MappedFile, QuantFormat};
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

    /// The names of its tensors, in no order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
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

    /// Elements and bytes of the MTP head's own tensors (`mtp.*`).
    pub fn mtp_size(&self) -> (usize, usize) {
        self.tensors
            .values()
            .filter(|t| t.name.starts_with("mtp."))
            .fold((0, 0), |(n, b), t| (n + t.numel(), b + t.byte_len))
    }

    fn language_tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        const SKIPPED: [&str; 3] = ["model.visual.", "visual.", "mtp."];
        self.tensors
            .values()
            .filter(|t| !SKIPPED.iter().any(|p| t.name.starts_with(p)))
    }

    /// Loads `name`, checking that its shape is `shape`, as a weight buffer in its stored type
    /// (mapped, not copied, where the backend can). An FP8 weight becomes row blocks
    /// ([`Checkpoint::fp8_blocks`]) where the backend reads them, else bf16 values.
    pub fn weight(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer> {
        let (entry, dtype) = self.checked(name, shape)?;
        if dtype == DType::F8E4M3 {
            return fp8_weight(backend, self.fp8_blocks(name, shape)?, entry.numel());
        }
        let file = &self.shards[entry.shard];
        Ok(backend.weight_from_file(file, entry.byte_offset, dtype, entry.numel())?)
    }

    /// Whether `name` is an FP8 weight (e4m3 with a `_scale_inv` beside it).
    pub fn is_fp8(&self, name: &str) -> bool {
        self.tensors
            .get(name)
            .is_some_and(|e| e.dtype == Some(DType::F8E4M3))
    }

    /// The FP8 weight `name` (`[N, K]` e4m3, K a multiple of 128) as F8_E4M3x128 row blocks:
    /// each row's 128 values at a time behind their block's scale from `{name}_scale_inv`
    /// (`[ceil(N / 128), K / 128]`, as Qwen's FP8 checkpoints and transformers' fine-grained
    /// FP8 store them: a value is its e4m3 value times the scale).
    pub fn fp8_blocks(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
        let (entry, dtype) = self.checked(name, shape)?;
        let unsupported = |problem: String| ModelError::Unsupported(format!("{name}: {problem}"));
        if dtype != DType::F8E4M3 {
            return Err(unsupported(format!("stored as {dtype}, not FP8")));
        }
        let &[n, k] = shape else {
            return Err(unsupported(format!(
                "an FP8 tensor of shape {shape:?}, not a matrix"
            )));
        };
        const BLOCK: usize = 128;
        if !k.is_multiple_of(BLOCK) {
            return Err(unsupported(format!(
                "FP8 rows of {k} values, not whole blocks of {BLOCK}"
            )));
        }
        let scales = self.read_f32(
            &format!("{name}_scale_inv"),
            &[n.div_ceil(BLOCK), k / BLOCK],
        )?;
        let bytes = &self.shards[entry.shard].bytes()
            [entry.byte_offset..entry.byte_offset + entry.byte_len];
        let mut blocks = Vec::with_capacity(n * k / BLOCK * (BLOCK + 4));
        for (r, row) in bytes.chunks_exact(k).enumerate() {
            for (b, values) in row.chunks_exact(BLOCK).enumerate() {
                blocks.extend_from_slice(&scales[r / BLOCK * (k / BLOCK) + b].to_le_bytes());
                blocks.extend_from_slice(values);
            }
        }
        Ok(blocks)
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
            DType::F32 | DType::BF16 | DType::F16 => {
                let mut values = Vec::with_capacity(entry.numel());
                dtype.extend_f32(bytes, &mut values);
                values
            }
            DType::F8E4M3 => {
                let blocks = self.fp8_blocks(name, shape)?;
                let mut values = vec![0.0; entry.numel()];
                corral_backend::quant::dequantize(QuantFormat::F8E4M3x128, &blocks, &mut values);
                values
            }
            DType::U32 | DType::Quant(_) => {
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

/// An FP8 weight's row blocks as a weight buffer: as they are where the backend reads them,
/// else their values in bf16.
pub(crate) fn fp8_weight(
    backend: &dyn Backend,
    blocks: Vec<u8>,
    len: usize,
) -> Result<DeviceBuffer> {
    let format = QuantFormat::F8E4M3x128;
    if backend.capabilities().reads(format) {
        return Ok(backend.weight_from_blocks(blocks, DType::Quant(format), len)?);
    }
    let mut values = vec![0.0; len];
    corral_backend::quant::dequantize(format, &blocks, &mut values);
    Ok(backend.weight_from_f32(&values, DType::BF16)?)
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
