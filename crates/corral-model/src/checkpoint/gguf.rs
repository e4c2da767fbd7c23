//! A GGUF file as a checkpoint: its metadata turned into the model config the families read,
//! and its tensors found under the Hugging Face names the families ask for (llama.cpp's
//! converter renames them and stacks each layer's experts into one tensor per projection).
//! Plain f32/f16/bf16 tensors are mapped; block-quantized ones are decoded to f32 at load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_backend::{Backend, DType, DeviceBuffer, MappedFile};
use serde_json::{Map, Value, json};

use crate::checkpoint::gguf_file::{GgufHeader, GgufTensor, GgufValue, parse_header};
use crate::checkpoint::gguf_hybrid::{HybridLayout, Mapped, ValueChange};
use crate::checkpoint::quant::{GgmlType, dequantize};
use crate::config::ModelConfig;
use crate::weights::WeightSource;
use crate::weights::{Projection, stacked_values};
use crate::{ModelError, Result};
use corral_backend::QuantFormat;

/// An opened GGUF model: its file (or each file of a split model) mapped, the headers parsed
/// and every tensor indexed by name.
#[derive(Debug)]
pub struct GgufCheckpoint {
    path: PathBuf,
    /// The mapped files, in split order.
    files: Vec<Arc<MappedFile>>,
    /// The first file's header: all the metadata.
    header: GgufHeader,
    /// Every file's tensors, each with the index of its file.
    tensors: Vec<(usize, GgufTensor)>,
    by_name: HashMap<String, usize>,
    arch: String,
    /// How a hybrid architecture's tensors differ from the Hugging Face layout.
    hybrid: Option<HybridLayout>,
}

/// Where a Hugging Face tensor is in a GGUF file: a tensor, or one expert's slab of a
/// stacked one.
struct Located<'a> {
    file: usize,
    tensor: &'a GgufTensor,
    expert: Option<usize>,
    /// A hybrid's tensor read other than as stored (rows, columns or values changed back).
    changed: Option<Mapped>,
}

/// A located tensor's data: the tensor, its file, the byte range (one expert's slab of a
/// stacked tensor) and what to change back when reading it.
type Checked<'a> = (
    &'a GgufTensor,
    &'a Arc<MappedFile>,
    usize,
    usize,
    Option<Mapped>,
);

/// `shape` without its axes of one (`[c, 1, k]` and `[c, k]` are one layout).
fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&d| d != 1).collect()
}

/// Maps `path` and reads its header.
fn open_file(path: &Path) -> Result<(Arc<MappedFile>, GgufHeader)> {
    let file = MappedFile::open(path).map_err(|e| match e {
        corral_backend::BackendError::Io { source, .. } => ModelError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => other.into(),
    })?;
    let header = parse_header(file.bytes()).map_err(|e| ModelError::Gguf {
        path: path.to_path_buf(),
        detail: e.0,
    })?;
    Ok((file, header))
}

/// The path of split `no` (0-based) of `count` beside the first split `first`, named as
/// llama.cpp names them (`NAME-00001-of-00003.gguf`).
fn split_path(first: &Path, no: u64, count: u64) -> Option<PathBuf> {
    let name = first.file_name()?.to_str()?;
    let prefix = name.strip_suffix(&format!("-00001-of-{count:05}.gguf"))?;
    Some(first.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1)))
}

impl GgufCheckpoint {
    /// Maps `path` and reads its header; for the first file of a split model, every split.
    pub fn open(path: &Path) -> Result<Self> {
        let (file, header) = open_file(path)?;
        tracing::debug!(path = %path.display(), "read a GGUF header");
        let invalid = |detail: String| ModelError::Gguf {
            path: path.to_path_buf(),
            detail,
        };
        let split = |h: &GgufHeader, key: &str| h.get(key).and_then(GgufValue::as_u64);
        let count = split(&header, "split.count").unwrap_or(1).max(1);
        if split(&header, "split.no").unwrap_or(0) != 0 {
            return Err(invalid(
                "a later split of a split model: give the first (NAME-00001-of-N.gguf)".to_string(),
            ));
        }
        let arch = header
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| invalid("no `general.architecture` string".to_string()))?
            .to_string();
        let mut files = vec![file];
        let mut tensors: Vec<(usize, GgufTensor)> =
            header.tensors.iter().map(|t| (0, t.clone())).collect();
        for no in 1..count {
            let next = split_path(path, no, count).ok_or_else(|| {
                invalid(format!(
                    "split 1 of {count}, but not named NAME-00001-of-{count:05}.gguf"
                ))
            })?;
            let (file, h) = open_file(&next)?;
            if split(&h, "split.no") != Some(no) || split(&h, "split.count") != Some(count) {
                return Err(ModelError::Gguf {
                    path: next,
                    detail: format!("not split {} of {count}", no + 1),
                });
            }
            tensors.extend(h.tensors.into_iter().map(|t| (files.len(), t)));
            files.push(file);
        }
        let mut by_name = HashMap::with_capacity(tensors.len());
        for (i, (_, t)) in tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(invalid(format!("tensor `{}` is in two splits", t.name)));
            }
        }
        let hybrid = HybridLayout::from_header(&arch, &header)
            .transpose()
            .map_err(invalid)?;
        Ok(Self {
            path: path.to_path_buf(),
            files,
            header,
            tensors,
            by_name,
            arch,
            hybrid,
        })
    }

    /// Every tensor of the model (all splits).
    pub fn tensors(&self) -> impl Iterator<Item = &GgufTensor> {
        self.tensors.iter().map(|(_, t)| t)
    }

    /// The bytes its weights take once loaded: plain tensors as stored, block-quantized ones
    /// as stored where `kept` says the backend reads their format, else decoded to f32. An MTP
    /// head's tensors are not loaded (the model runs the trunk) and not counted.
    pub fn loaded_bytes(&self, kept: &dyn Fn(QuantFormat) -> bool) -> usize {
        let mtp = |name: &str| self.hybrid.as_ref().is_some_and(|h| h.holds_mtp(name));
        self.tensors()
            .filter(|t| !mtp(&t.name))
            .map(|t| match t.ggml_type.quant_format() {
                Some(format) if !kept(format) => t.numel() as usize * 4,
                _ => t.byte_len,
            })
            .sum()
    }

    /// Elements and stored bytes of the MTP head's tensors (0 without a head).
    pub fn mtp_size(&self) -> (usize, usize) {
        let mtp = |name: &str| self.hybrid.as_ref().is_some_and(|h| h.holds_mtp(name));
        self.tensors()
            .filter(|t| mtp(&t.name))
            .fold((0, 0), |(n, b), t| (n + t.numel() as usize, b + t.byte_len))
    }

    /// The MTP head's layers the file carries (`nextn_predict_layers`; 0 without a head).
    /// Its tensors read under the checkpoints' `mtp.*` names; the model runs the trunk.
    pub fn mtp_layers(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |h| h.mtp_layers)
    }

    /// Checkpoint tensor `name` (Hugging Face's name, `mtp.*` for an MTP head's) of `shape`,
    /// as f32: decoded, the converter's permutations and value changes undone.
    pub fn read_tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.read_f32(name, shape)
    }

    /// The (first) file's header: the model's metadata.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    fn invalid(&self, detail: String) -> ModelError {
        ModelError::Gguf {
            path: self.path.clone(),
            detail,
        }
    }

    fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i].1)
    }

    /// The model config the metadata describes, as the families read it.
    pub fn config(&self) -> Result<ModelConfig> {
        let text = self.config_json()?.to_string();
        ModelConfig::from_json(&text, &self.path)
    }

    /// The metadata as the `config.json` transformers would have, for Qwen3 and Qwen3-MoE.
    fn config_json(&self) -> Result<Value> {
        let arch = self.arch.as_str();
        let Some(model_type) = crate::families::by_gguf_architecture(arch).map(|f| f.gguf.1) else {
            return Err(self.invalid(format!(
                "architecture `{arch}` is not read ({} are)",
                crate::families::supported(true)
            )));
        };
        let key = |k: &str| format!("{arch}.{k}");
        let uint = |k: &str| -> Result<Option<u64>> {
            match self.header.get(&key(k)) {
                None => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    self.invalid(format!("`{}` is {v}, not an unsigned integer", key(k)))
                }),
            }
        };
        let float = |k: &str| -> Result<Option<f64>> {
            match self.header.get(&key(k)) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| self.invalid(format!("`{}` is {v}, not a number", key(k)))),
            }
        };
        let required = |k: &str| -> Result<u64> {
            uint(k)?.ok_or_else(|| self.invalid(format!("no `{}`", key(k))))
        };
        let embed = self
            .tensor("token_embd.weight")
            .ok_or_else(|| self.invalid("no tensor `token_embd.weight`".to_string()))?;
        let vocab = embed.dims.get(1).copied().unwrap_or(0);
        let mut c = Map::new();
        c.insert("model_type".into(), json!(model_type));
        c.insert("vocab_size".into(), json!(vocab));
        c.insert("hidden_size".into(), json!(required("embedding_length")?));
        // The hybrids' block count includes the MTP layers, which follow the trunk's.
        let blocks = required("block_count")?;
        let mtp = uint("nextn_predict_layers")?.unwrap_or(0);
        let layers = blocks.checked_sub(mtp).filter(|&n| n > 0).ok_or_else(|| {
            self.invalid(format!(
                "`{}` {blocks} leaves no layer beside {mtp} MTP layers",
                key("block_count")
            ))
        })?;
        c.insert("num_hidden_layers".into(), json!(layers));
        if mtp > 0 {
            c.insert("mtp_num_hidden_layers".into(), json!(mtp));
        }
        c.insert(
            "num_attention_heads".into(),
            json!(required("attention.head_count")?),
        );
        if let Some(kv) = uint("attention.head_count_kv")? {
            c.insert("num_key_value_heads".into(), json!(kv));
        }
        if let Some(d) = uint("attention.key_length")? {
            c.insert("head_dim".into(), json!(d));
        }
        if let Some(f) = uint("feed_forward_length")? {
            c.insert("intermediate_size".into(), json!(f));
        }
        if let Some(n) = uint("context_length")? {
            c.insert("max_position_embeddings".into(), json!(n));
        }
        if let Some(eps) = float("attention.layer_norm_rms_epsilon")? {
            c.insert("rms_norm_eps".into(), json!(eps));
        }
        if let Some(theta) = float("rope.freq_base")? {
            c.insert("rope_theta".into(), json!(theta));
        }
        let scaling = self
            .header
            .get(&key("rope.scaling.type"))
            .filter(|kind| kind.as_str() != Some("none"));
        if let Some(kind) = scaling {
            let kind = kind.as_str().ok_or_else(|| {
                self.invalid(format!("`{}` is not a string", key("rope.scaling.type")))
            })?;
            let mut scaling = Map::new();
            scaling.insert("rope_type".into(), json!(kind));
            if let Some(f) = float("rope.scaling.factor")? {
                scaling.insert("factor".into(), json!(f));
            }
            if let Some(n) = uint("rope.scaling.original_context_length")? {
                scaling.insert("original_max_position_embeddings".into(), json!(n));
            }
            c.insert("rope_scaling".into(), Value::Object(scaling));
        }
        if self.hybrid.is_some() {
            self.hybrid_config(&mut c, layers)?;
        }
        if matches!(model_type, "qwen3_moe" | "qwen3_5_moe_text" | "qwen3_next") {
            c.insert("num_experts".into(), json!(required("expert_count")?));
            c.insert(
                "num_experts_per_tok".into(),
                json!(required("expert_used_count")?),
            );
            c.insert(
                "moe_intermediate_size".into(),
                json!(required("expert_feed_forward_length")?),
            );
            // llama.cpp renormalises the chosen experts' weights for these architectures
            // (the converter writes no key for it), as their checkpoints set norm_topk_prob.
            c.insert("norm_topk_prob".into(), json!(true));
            if let Some(n) = uint("expert_shared_feed_forward_length")? {
                c.insert("shared_expert_intermediate_size".into(), json!(n));
            }
        }
        c.insert(
            "tie_word_embeddings".into(),
            json!(self.tensor("output.weight").is_none()),
        );
        for (field, k) in [
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ] {
            if let Some(id) = self.header.get(k).and_then(GgufValue::as_u64) {
                c.insert(field.into(), json!(id));
            }
        }
        Ok(Value::Object(c))
    }

    /// The hybrids' Gated DeltaNet sizes, partial RoPE and layer pattern, as transformers'
    /// config names them.
    fn hybrid_config(&self, c: &mut Map<String, Value>, layers: u64) -> Result<()> {
        let arch = self.arch.as_str();
        let key = |k: &str| format!("{arch}.{k}");
        let uint = |k: &str| -> Result<u64> {
            self.header
                .get(&key(k))
                .and_then(GgufValue::as_u64)
                .ok_or_else(|| self.invalid(format!("no unsigned integer `{}`", key(k))))
        };
        let value_heads = uint("ssm.time_step_rank")?;
        c.insert(
            "linear_conv_kernel_dim".into(),
            json!(uint("ssm.conv_kernel")?),
        );
        c.insert("linear_key_head_dim".into(), json!(uint("ssm.state_size")?));
        c.insert(
            "linear_num_key_heads".into(),
            json!(uint("ssm.group_count")?),
        );
        c.insert("linear_num_value_heads".into(), json!(value_heads));
        c.insert(
            "linear_value_head_dim".into(),
            json!(uint("ssm.inner_size")? / value_heads.max(1)),
        );
        let head_dim = uint("attention.key_length")?;
        let rotary = uint("rope.dimension_count")?;
        c.insert(
            "partial_rotary_factor".into(),
            json!(rotary as f64 / head_dim.max(1) as f64),
        );
        // Which layers are linear: the converter's list where it wrote one (it is the truth:
        // its `full_attention_interval` may be a default), else the interval.
        match self.header.get(&key("attention.recurrent_layers")) {
            Some(GgufValue::Array(flags)) => {
                let kinds: Option<Vec<&str>> = flags
                    .iter()
                    .take(layers as usize)
                    .map(|f| match f {
                        GgufValue::Bool(true) => Some("linear_attention"),
                        GgufValue::Bool(false) => Some("full_attention"),
                        other => other.as_u64().map(|v| {
                            if v != 0 {
                                "linear_attention"
                            } else {
                                "full_attention"
                            }
                        }),
                    })
                    .collect();
                let kinds = kinds
                    .filter(|k| k.len() == layers as usize)
                    .ok_or_else(|| {
                        self.invalid(format!(
                            "`{}` is not {layers} flags",
                            key("attention.recurrent_layers")
                        ))
                    })?;
                c.insert("layer_types".into(), json!(kinds));
            }
            Some(other) => {
                return Err(self.invalid(format!(
                    "`{}` is {other}, not a list",
                    key("attention.recurrent_layers")
                )));
            }
            None => {
                c.insert(
                    "full_attention_interval".into(),
                    json!(uint("full_attention_interval")?),
                );
            }
        }
        Ok(())
    }

    /// The GGUF tensor (and expert) holding Hugging Face tensor `name`.
    fn locate(&self, name: &str) -> Option<Located<'_>> {
        let trunk = self.hybrid.as_ref().and_then(|h| h.mtp_layer_name(name));
        let name = trunk.as_deref().unwrap_or(name);
        let (gguf, expert, changed) = match self.hybrid.as_ref().and_then(|h| h.map(name)) {
            Some(mapped) => (
                mapped.gguf.clone(),
                None,
                (!mapped.as_stored()).then_some(mapped),
            ),
            None => {
                let (gguf, expert) = gguf_name(name)?;
                (gguf, expert, None)
            }
        };
        let (file, tensor) = &self.tensors[*self.by_name.get(&gguf)?];
        Some(Located {
            file: *file,
            tensor,
            expert,
            changed,
        })
    }

    /// The GGUF name of Hugging Face tensor `name`, for messages.
    fn file_name_of(&self, name: &str) -> String {
        let trunk = self.hybrid.as_ref().and_then(|h| h.mtp_layer_name(name));
        let name = trunk.as_deref().unwrap_or(name);
        match self.hybrid.as_ref().and_then(|h| h.map(name)) {
            Some(mapped) => mapped.gguf,
            None => gguf_name(name).map_or("none".into(), |n| n.0),
        }
    }

    /// `name`'s tensor, checked against `shape`, its file and the byte range of its data (one
    /// expert's slab of a stacked tensor).
    fn checked(&self, name: &str, shape: &[usize]) -> Result<Checked<'_>> {
        let Located {
            file,
            tensor,
            expert,
            changed,
        } = self.locate(name).ok_or_else(|| ModelError::MissingTensor {
            name: format!("{name} (GGUF: {})", self.file_name_of(name)),
            dir: self.path.clone(),
        })?;
        let full = tensor.shape();
        let (got, start, len) = match expert {
            None => (full, tensor.byte_offset, tensor.byte_len),
            Some(e) => {
                let experts = full.first().copied().unwrap_or(0);
                if full.len() != 3 || e >= experts {
                    return Err(self.invalid(format!(
                        "`{}` of shape {full:?} has no expert {e}",
                        tensor.name
                    )));
                }
                let slab = tensor.byte_len / experts;
                (full[1..].to_vec(), tensor.byte_offset + e * slab, slab)
            }
        };
        // Rows taken from a hybrid's tensor: as many as asked for, of its own columns.
        let got = match changed.as_ref().and_then(|c| c.rows.as_ref()) {
            Some(rows) if rows.iter().all(|&r| r < got.first().copied().unwrap_or(0)) => {
                let mut picked = got.clone();
                picked[0] = rows.len();
                picked
            }
            Some(_) => {
                return Err(self.invalid(format!(
                    "`{}` of shape {got:?} is too small for the value heads the metadata names",
                    tensor.name
                )));
            }
            None => got,
        };
        if squeezed(&got) != squeezed(shape) {
            return Err(ModelError::WrongShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                got,
            });
        }
        if !tensor.ggml_type.is_decodable() {
            return Err(ModelError::UnsupportedDType {
                name: name.to_string(),
                dtype: tensor.ggml_type.name().to_string(),
            });
        }
        Ok((tensor, &self.files[file], start, len, changed))
    }
}

/// The GGUF name (and expert index) llama.cpp's converter gives Hugging Face tensor `name`.
fn gguf_name(name: &str) -> Option<(String, Option<usize>)> {
    let plain = |s: &str| Some((s.to_string(), None));
    match name {
        "model.embed_tokens.weight" => return plain("token_embd.weight"),
        "model.norm.weight" => return plain("output_norm.weight"),
        "lm_head.weight" => return plain("output.weight"),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let blk = |s: &str| Some((format!("blk.{layer}.{s}.weight"), None));
    if let Some(expert) = rest
        .strip_prefix("mlp.experts.")
        .filter(|e| e.starts_with(|c: char| c.is_ascii_digit()))
    {
        let (e, proj) = expert.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let stacked = match proj {
            "gate_proj.weight" => "ffn_gate_exps",
            "up_proj.weight" => "ffn_up_exps",
            "down_proj.weight" => "ffn_down_exps",
            _ => return None,
        };
        return Some((format!("blk.{layer}.{stacked}.weight"), Some(e)));
    }
    match rest {
        // transformers' fused layout ([E, 2I, H], gate rows first; down [E, H, I]): what
        // the converter writes with --fuse-gate-up-exps. Files with separate gate and up
        // tensors have no such name, and their experts bind one by one.
        "mlp.experts.gate_up_proj" => Some((format!("blk.{layer}.ffn_gate_up_exps.weight"), None)),
        "mlp.experts.down_proj" => Some((format!("blk.{layer}.ffn_down_exps.weight"), None)),
        "input_layernorm.weight" => blk("attn_norm"),
        "post_attention_layernorm.weight" => blk("ffn_norm"),
        "self_attn.q_proj.weight" => blk("attn_q"),
        "self_attn.k_proj.weight" => blk("attn_k"),
        "self_attn.v_proj.weight" => blk("attn_v"),
        "self_attn.o_proj.weight" => blk("attn_output"),
        "self_attn.q_norm.weight" => blk("attn_q_norm"),
        "self_attn.k_norm.weight" => blk("attn_k_norm"),
        "mlp.gate_proj.weight" => blk("ffn_gate"),
        "mlp.up_proj.weight" => blk("ffn_up"),
        "mlp.down_proj.weight" => blk("ffn_down"),
        "mlp.gate.weight" => blk("ffn_gate_inp"),
        _ => None,
    }
}

/// The element type a GGUF tensor loads as: its own for plain types, f32 for decoded blocks.
fn loaded_dtype(ty: GgmlType) -> DType {
    match ty {
        GgmlType::F16 => DType::F16,
        GgmlType::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

impl WeightSource for GgufCheckpoint {
    fn contains(&self, name: &str) -> bool {
        self.locate(name).is_some()
    }

    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer> {
        let (tensor, file, start, len, changed) = self.checked(name, shape)?;
        let ty = tensor.ggml_type;
        let numel = shape.iter().product();
        if let Some(changed) = changed {
            // Rows alone of a block format the backend reads: those rows' blocks.
            let kept = ty
                .quant_format()
                .filter(|&f| backend.capabilities().reads(f));
            if let (Some(format), Some(rows), None, ValueChange::None) =
                (kept, &changed.rows, &changed.columns, changed.values)
            {
                let total = tensor.shape().first().copied().unwrap_or(1).max(1);
                let row_bytes = len / total;
                let bytes = &file.bytes()[start..start + len];
                let blocks = rows
                    .iter()
                    .flat_map(|&r| &bytes[r * row_bytes..(r + 1) * row_bytes])
                    .copied()
                    .collect();
                return Ok(backend.weight_from_blocks(blocks, DType::Quant(format), numel)?);
            }
            let dtype = if kept.is_some() || ty.quant_format().is_some() {
                DType::F32
            } else {
                loaded_dtype(ty)
            };
            return Ok(backend.weight_from_f32(&self.read_f32(name, shape)?, dtype)?);
        }
        if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Ok(backend.weight_from_file(file, start, loaded_dtype(ty), numel)?);
        }
        if let Some(format) = ty.quant_format()
            && backend.capabilities().reads(format)
        {
            let dtype = DType::Quant(format);
            return Ok(backend.weight_from_file(file, start, dtype, numel)?);
        }
        Ok(backend.weight_from_f32(&self.read_f32(name, shape)?, DType::F32)?)
    }

    fn weight_stacked(
        &self,
        backend: &dyn Backend,
        parts: &[(&str, &[usize])],
    ) -> Result<DeviceBuffer> {
        // Parts of one block format the backend reads stay blocks: their rows are whole
        // blocks, so the stack is their bytes one after another.
        let mut blocks = Vec::new();
        let mut format = None;
        for &(name, shape) in parts {
            let (tensor, file, start, len, changed) = self.checked(name, shape)?;
            let part = tensor.ggml_type.quant_format();
            let kept = part.is_some_and(|f| backend.capabilities().reads(f));
            if !kept || changed.is_some() || (format.is_some() && format != part) {
                return stacked_values(self, backend, parts);
            }
            format = part;
            blocks.extend_from_slice(&file.bytes()[start..start + len]);
        }
        match format {
            Some(format) => {
                let values = parts
                    .iter()
                    .map(|(_, shape)| shape.iter().product::<usize>())
                    .sum();
                Ok(backend.weight_from_blocks(blocks, DType::Quant(format), values)?)
            }
            None => stacked_values(self, backend, parts),
        }
    }

    fn projection(&self, backend: &dyn Backend, parts: &[(&str, &[usize])]) -> Result<Projection> {
        // Parts the backend reads as stored but in different formats stay apart rather than
        // being decoded to one type.
        let mut formats = Vec::with_capacity(parts.len());
        for &(name, shape) in parts {
            let (tensor, .., changed) = self.checked(name, shape)?;
            match tensor.ggml_type.quant_format() {
                Some(format) if backend.capabilities().reads(format) && changed.is_none() => {
                    formats.push(format)
                }
                _ => return Ok(Projection::Stacked(self.weight_stacked(backend, parts)?)),
            }
        }
        if formats.windows(2).all(|w| w[0] == w[1]) {
            return Ok(Projection::Stacked(self.weight_stacked(backend, parts)?));
        }
        let mut apart = Vec::with_capacity(parts.len());
        for &(name, shape) in parts {
            let rows = shape.first().copied().unwrap_or(0);
            apart.push((self.weight(backend, name, shape)?, rows));
        }
        Ok(Projection::Parts(apart))
    }

    fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (tensor, file, start, len, changed) = self.checked(name, shape)?;
        let (block_values, block_bytes) = tensor.ggml_type.block();
        let mut values = vec![0f32; len / block_bytes * block_values];
        dequantize(
            tensor.ggml_type,
            &file.bytes()[start..start + len],
            &mut values,
        );
        Ok(match changed {
            None => values,
            Some(changed) => {
                let cols = tensor.shape()[1..].iter().product::<usize>();
                changed.apply(&values, if tensor.dims.len() > 1 { cols } else { 1 })
            }
        })
    }

    fn stored_dtype(&self, name: &str) -> Result<DType> {
        let located = self.locate(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            dir: self.path.clone(),
        })?;
        Ok(loaded_dtype(located.tensor.ggml_type))
    }
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn hugging_face_names_map_to_the_converters() {
        let cases = [
            ("model.embed_tokens.weight", "token_embd.weight", None),
            ("lm_head.weight", "output.weight", None),
            (
                "model.layers.3.self_attn.o_proj.weight",
                "blk.3.attn_output.weight",
                None,
            ),
            (
                "model.layers.0.post_attention_layernorm.weight",
                "blk.0.ffn_norm.weight",
                None,
            ),
            (
                "model.layers.11.mlp.gate.weight",
                "blk.11.ffn_gate_inp.weight",
                None,
            ),
            (
                "model.layers.2.mlp.experts.17.down_proj.weight",
                "blk.2.ffn_down_exps.weight",
                Some(17),
            ),
        ];
        for (hf, gguf, expert) in cases {
            assert_eq!(gguf_name(hf), Some((gguf.to_string(), expert)), "{hf}");
        }
        assert_eq!(gguf_name("model.layers.x.mlp.gate.weight"), None);
        assert_eq!(gguf_name("model.layers.1.mlp.experts.2.bias"), None);
    }
}
