//! `config.json` → [`ModelConfig`]: every field read, type-checked and range-checked once, in
//! both spellings real checkpoints use (Hub: `rope_theta`, `num_experts`, `torch_dtype`;
//! transformers 5: `rope_parameters`, `num_local_experts`, `dtype`). Nothing downstream checks
//! again.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use corral_backend::{DType, RopeParams, Yarn};

use crate::{ModelError, Result};

/// The architecture families Corral runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `qwen3_moe`: Qwen3 with sparse MoE feed-forward layers.
    Qwen3Moe,
    /// `qwen3`: the dense sibling, the same code without experts.
    Qwen3,
    /// `qwen3_next`: Gated DeltaNet + gated attention, MoE with a shared expert.
    Qwen3Next,
    /// `qwen3_5_moe` (Qwen3.5/3.6 MoE): as Qwen3-Next, every layer MoE, always renormalised.
    Qwen35Moe,
    /// `qwen3_5` (Qwen3.5/3.6 dense): the hybrid layers with a dense MLP.
    Qwen35,
}

impl Family {
    /// The `model_type` string of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Next => "qwen3_next",
            Family::Qwen35Moe => "qwen3_5_moe",
            Family::Qwen35 => "qwen3_5",
        }
    }
}

/// Upper bounds on config sizes: far above any real checkpoint, low enough that every size
/// derived from them fits in memory arithmetic without overflow.
const MAX_WIDTH: usize = 1 << 20;
const MAX_VOCAB: usize = 1 << 22;
const MAX_LAYERS: usize = 1 << 10;
const MAX_HEADS: usize = 1 << 10;
const MAX_HEAD_DIM: usize = 512;
const MAX_EXPERTS: usize = 1 << 12;
/// Positions a context may reach (max_position_embeddings, YaRN's original context and their
/// product): 16M, far past any of these models.
const MAX_POSITIONS: usize = 1 << 24;
/// transformers' default `shared_expert_intermediate_size` for Qwen3-Next and Qwen3.5-MoE.
const DEFAULT_SHARED_EXPERT_SIZE: usize = 512;

/// Mixture-of-experts settings of a sparse model.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer (`num_experts` / `num_local_experts`).
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Intermediate size of each expert.
    pub moe_intermediate_size: usize,
    /// Whether the top-k weights are renormalised to sum 1.
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse.
    pub decoder_sparse_step: usize,
    /// Layers forced dense.
    pub mlp_only_layers: Vec<usize>,
}

/// The kind of a hybrid model's layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    Linear,
    /// Gated full attention with a KV cache.
    Full,
}

/// Gated DeltaNet dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    /// Short convolution kernel size.
    pub conv_kernel: usize,
    /// Key (and query) heads.
    pub num_key_heads: usize,
    /// Value heads (a multiple of the key heads).
    pub num_value_heads: usize,
    /// Key head dimension.
    pub key_head_dim: usize,
    /// Value head dimension.
    pub value_head_dim: usize,
}

impl LinearAttentionConfig {
    /// Channels of the convolution: `q | k | v`.
    pub fn conv_channels(&self) -> usize {
        2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
    }

    /// `num_value_heads * value_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Floats of one sequence's recurrent state in one layer.
    pub fn recurrent_state_len(&self) -> usize {
        self.num_value_heads * self.key_head_dim * self.value_head_dim
    }

    /// Floats of one sequence's convolution state in one layer (the last `kernel - 1` inputs).
    pub fn conv_state_len(&self) -> usize {
        self.conv_channels() * (self.conv_kernel - 1)
    }
}

/// Settings of the hybrid (Gated DeltaNet + attention) families.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    /// Kind of each layer.
    pub layer_types: Vec<LayerKind>,
    /// Gated DeltaNet dimensions.
    pub linear: LinearAttentionConfig,
    /// Share of each head's dimensions that RoPE rotates.
    pub partial_rotary_factor: f64,
    /// Intermediate size of the shared expert of MoE layers, if any.
    pub shared_expert_intermediate_size: Option<usize>,
}

/// A checked model configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture family.
    pub family: Family,
    /// Embedding rows (≥ the tokenizer's vocabulary).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head dimension (read, never derived).
    pub head_dim: usize,
    /// Dense MLP intermediate size (dense layers only).
    pub intermediate_size: usize,
    /// Expert settings; `None` for dense models.
    pub moe: Option<MoeConfig>,
    /// Hybrid-family settings; `None` for Qwen3 and Qwen3-MoE.
    pub hybrid: Option<HybridConfig>,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// RoPE's base, and YaRN's scaling when the checkpoint asks for it.
    pub rope: RopeParams,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// Ids that end generation (config.json; generation_config.json may add more).
    pub eos_token_ids: Vec<u32>,
    /// Context length the model was trained for (`max_position_embeddings`); see
    /// [`ModelConfig::max_context`] for how far it runs.
    pub max_position_embeddings: usize,
    /// The checkpoint's declared dtype (`dtype` or `torch_dtype`), informational.
    pub dtype: Option<String>,
}

impl ModelConfig {
    /// Reads and checks `path` (a `config.json`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses and checks config JSON; `path` is used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(obj) = value else {
            return Err(field_error(path, "<root>", "expected a JSON object"));
        };
        let top = Fields {
            obj: &obj,
            path,
            prefix: "",
        };
        let model_type = top.string("model_type")?;
        let family = match crate::families::by_model_type(&model_type) {
            Some(entry) => entry.family,
            None => {
                return Err(ModelError::UnsupportedModelType {
                    path: path.to_path_buf(),
                    model_type,
                    supported: crate::families::supported(false),
                });
            }
        };
        // Qwen3.5 multimodal checkpoints nest the language model's settings in text_config.
        let f = match obj.get("text_config") {
            Some(Value::Object(text)) if matches!(family, Family::Qwen35Moe | Family::Qwen35) => {
                Fields {
                    obj: text,
                    path,
                    prefix: "text_config.",
                }
            }
            Some(other)
                if !other.is_null() && matches!(family, Family::Qwen35Moe | Family::Qwen35) =>
            {
                return Err(top.wrong("text_config", "an object", other));
            }
            _ => Fields {
                obj: &obj,
                path,
                prefix: "",
            },
        };
        if f.opt_bool("attention_bias")? == Some(true) {
            return Err(f.err("attention_bias", "attention biases are not supported"));
        }
        if let Some(act) = f.opt_string("hidden_act")?.filter(|a| a != "silu") {
            return Err(f.err(
                "hidden_act",
                &format!("activation `{act}` is not supported (only silu)"),
            ));
        }
        let num_layers = f.bounded("num_hidden_layers", MAX_LAYERS)?;
        let num_heads = f.bounded("num_attention_heads", MAX_HEADS)?;
        let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                &format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let hidden_size = f.bounded("hidden_size", MAX_WIDTH)?;
        // Absent head_dim: transformers' Qwen3Config defaults it to 128, the hybrids to 256,
        // while Qwen3MoeConfig has no such field and falls back to hidden / heads.
        let head_dim = match (f.opt_usize("head_dim")?, family) {
            (Some(d), _) => d,
            (None, Family::Qwen3) => 128,
            (None, Family::Qwen3Moe) => hidden_size / num_heads,
            (None, _) => 256,
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
            return Err(f.err(
                "head_dim",
                &format!("{head_dim} must be even, positive and at most {MAX_HEAD_DIM}"),
            ));
        }
        let moe = match family {
            Family::Qwen3 | Family::Qwen35 => None,
            // transformers' defaults: norm_topk_prob false for Qwen3-MoE, true for Qwen3-Next.
            Family::Qwen3Moe => f.moe(num_layers, false, false)?,
            Family::Qwen3Next => f.moe(num_layers, false, true)?,
            Family::Qwen35Moe => f.moe(num_layers, true, true)?,
        };
        let hybrid = match family {
            Family::Qwen3 | Family::Qwen3Moe => None,
            _ => Some(f.hybrid(num_layers, head_dim, moe.is_some())?),
        };
        let intermediate_size = match (&moe, f.opt_bounded("intermediate_size", MAX_WIDTH)?) {
            (_, Some(size)) => size,
            (Some(_), None) => 0,
            (None, None) => return Err(f.err("intermediate_size", "missing")),
        };
        if let Some(m) = &moe {
            let has_dense = (0..num_layers).any(|i| !is_sparse(m, i));
            if has_dense && intermediate_size == 0 {
                return Err(f.err(
                    "intermediate_size",
                    "dense layers need a positive intermediate_size",
                ));
            }
        }
        let eos_token_ids = match f
            .present("eos_token_id")
            .or_else(|| top.present("eos_token_id"))
        {
            None => Vec::new(),
            Some(v) => token_ids(v)
                .ok_or_else(|| f.err("eos_token_id", "expected a token id or a list of them"))?,
        };
        // transformers reads tie_word_embeddings at the top level of multimodal configs.
        let tie_word_embeddings = match top.opt_bool("tie_word_embeddings")? {
            Some(t) => t,
            None => f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        };
        let max_position_embeddings = f
            .opt_bounded("max_position_embeddings", MAX_POSITIONS)?
            .unwrap_or(32768);
        let config = ModelConfig {
            family,
            vocab_size: f.bounded("vocab_size", MAX_VOCAB)?,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            moe,
            hybrid,
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope: f.rope(max_position_embeddings)?,
            tie_word_embeddings,
            bos_token_id: f.opt_usize("bos_token_id")?.map(|v| v as u32),
            eos_token_ids,
            max_position_embeddings,
            dtype: match f.opt_string("dtype")? {
                Some(d) => Some(d),
                None => match f.opt_string("torch_dtype")? {
                    Some(d) => Some(d),
                    None => top.opt_string("dtype")?.or(top.opt_string("torch_dtype")?),
                },
            },
        };
        Ok(config)
    }

    /// The longest context the model runs: `max_position_embeddings`, or with YaRN its
    /// original context times the factor where that is longer (vLLM takes the product alone;
    /// for Qwen3's documented settings both give 131,072).
    pub fn max_context(&self) -> usize {
        let scaled = self.rope.yarn.map_or(0, |y| {
            (y.original_max_position_embeddings as f64 * y.factor).min(MAX_POSITIONS as f64)
                as usize
        });
        self.max_position_embeddings.max(scaled)
    }

    /// Whether the MoE blocks run their shared expert as one more expert of the routed ops
    /// (a shared expert of the routed experts' intermediate size, as in every Qwen3.5/3.6 and
    /// Qwen3-Next checkpoint); otherwise it runs as a separate MLP.
    pub fn folds_shared_expert(&self) -> bool {
        match (&self.moe, &self.hybrid) {
            (Some(m), Some(h)) => {
                h.shared_expert_intermediate_size == Some(m.moe_intermediate_size)
            }
            _ => false,
        }
    }

    /// The configuration of the checkpoint's MTP head as a model of its own: one
    /// full-attention decoder layer, sparse where the model's layers are (Qwen stores
    /// `mtp_num_hidden_layers` = 1), on the model's embedding, widths and LM head.
    pub fn mtp(&self) -> Result<ModelConfig> {
        let Some(hybrid) = &self.hybrid else {
            return Err(ModelError::Unsupported(format!(
                "{} has no MTP head",
                self.family.model_type()
            )));
        };
        let mut mtp = self.clone();
        mtp.num_layers = 1;
        mtp.hybrid = Some(HybridConfig {
            layer_types: vec![LayerKind::Full],
            ..hybrid.clone()
        });
        if let Some(moe) = &mut mtp.moe {
            moe.mlp_only_layers.clear();
            moe.decoder_sparse_step = 1;
        }
        Ok(mtp)
    }

    /// Whether layer `layer` runs the sparse MoE block (else the dense MLP).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| is_sparse(m, layer))
    }

    /// Parameters the architecture has (embedding, layers, final norm, untied LM head;
    /// not vision towers or MTP heads).
    pub fn num_parameters(&self) -> usize {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let q = self.num_heads * hd;
        let dense = 3 * h * self.intermediate_size;
        let shared = self
            .hybrid
            .as_ref()
            .and_then(|hy| hy.shared_expert_intermediate_size)
            .map_or(0, |si| 3 * h * si + h);
        let sparse = self.moe.as_ref().map_or(0, |m| {
            m.num_experts * 3 * h * m.moe_intermediate_size + m.num_experts * h + shared
        });
        let attention =
            |gated: bool| h * q * if gated { 3 } else { 2 } + h * self.kv_dim() * 2 + 2 * hd;
        let linear = self.hybrid.as_ref().map_or(0, |hy| {
            let l = hy.linear;
            let c = l.conv_channels();
            c * h
                + 2 * l.value_dim() * h
                + 2 * l.num_value_heads * h
                + c * l.conv_kernel
                + 2 * l.num_value_heads
                + l.value_head_dim
        });
        let layers: usize = (0..self.num_layers)
            .map(|i| {
                let mixer = match self.hybrid.as_ref().map(|hy| hy.layer_types[i]) {
                    None => attention(false),
                    Some(LayerKind::Full) => attention(true),
                    Some(LayerKind::Linear) => linear,
                };
                let ffn = if self.is_sparse_layer(i) {
                    sparse
                } else {
                    dense
                };
                mixer + 2 * h + ffn
            })
            .sum();
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + layers + h + head
    }

    /// Elements of K (or V) per token per attention layer.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Layers with a KV cache: all of them, or a hybrid's full-attention layers.
    pub fn num_attention_layers(&self) -> usize {
        match &self.hybrid {
            None => self.num_layers,
            Some(h) => h
                .layer_types
                .iter()
                .filter(|k| **k == LayerKind::Full)
                .count(),
        }
    }

    /// Gated DeltaNet layers (0 for non-hybrids).
    pub fn num_linear_layers(&self) -> usize {
        self.num_layers - self.num_attention_layers()
    }

    /// Dimensions RoPE rotates in each head.
    pub fn rotary_dim(&self) -> usize {
        match &self.hybrid {
            None => self.head_dim,
            Some(h) => ((self.head_dim as f64 * h.partial_rotary_factor) as usize) & !1,
        }
    }

    /// Whether the layer, model and q/k norms are zero-centred `(1 + w)`.
    pub fn zero_centred_norms(&self) -> bool {
        self.hybrid.is_some()
    }

    /// KV cache bytes per token in a cache of `dtype` (an fp8 cache's head scales included).
    pub fn kv_bytes_per_token(&self, dtype: DType) -> usize {
        let row = corral_backend::kv_row_elems(dtype, self.num_kv_heads, self.head_dim);
        self.num_attention_layers() * 2 * row * dtype.size_bytes()
    }
}

fn is_sparse(m: &MoeConfig, layer: usize) -> bool {
    !m.mlp_only_layers.contains(&layer)
        && m.num_experts > 0
        && (layer + 1).is_multiple_of(m.decoder_sparse_step)
}

fn token_ids(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::Number(n) => Some(vec![u32::try_from(n.as_u64()?).ok()?]),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => None,
    }
}

fn field_error(path: &Path, field: &str, problem: &str) -> ModelError {
    ModelError::ConfigField {
        path: PathBuf::from(path),
        field: field.to_string(),
        problem: problem.to_string(),
    }
}

fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    let mut shown = v.to_string();
    if shown.len() > 40 {
        shown.truncate(40);
        shown.push('…');
    }
    format!("{kind} ({shown})")
}

/// Typed access to the fields of one JSON object, with errors naming the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
    /// Prepended to field names in errors (`text_config.`).
    prefix: &'static str,
}

impl Fields<'_> {
    fn err(&self, field: &str, problem: &str) -> ModelError {
        field_error(self.path, &format!("{}{field}", self.prefix), problem)
    }

    fn wrong(&self, field: &str, expected: &str, got: &Value) -> ModelError {
        self.err(
            field,
            &format!("expected {expected}, got {}", describe(got)),
        )
    }

    fn present(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.wrong(field, "a non-negative integer", v)),
        }
    }

    fn opt_bounded(&self, field: &str, max: usize) -> Result<Option<usize>> {
        match self.opt_usize(field)? {
            Some(n) if n > max => Err(self.err(
                field,
                &format!("{n} exceeds the supported maximum of {max}"),
            )),
            other => Ok(other),
        }
    }

    /// A positive integer no larger than `max`.
    fn bounded(&self, field: &str, max: usize) -> Result<usize> {
        let n = self.positive(field)?;
        if n > max {
            return Err(self.err(
                field,
                &format!("{n} exceeds the supported maximum of {max}"),
            ));
        }
        Ok(n)
    }

    fn positive(&self, field: &str) -> Result<usize> {
        match self.opt_usize(field)? {
            None => Err(self.err(field, "missing")),
            Some(0) => Err(self.err(field, "must be positive")),
            Some(n) => Ok(n),
        }
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong(field, "a number", v)),
        }
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong(field, "a boolean", v)),
        }
    }

    fn opt_string(&self, field: &str) -> Result<Option<String>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.wrong(field, "a string", v)),
        }
    }

    fn string(&self, field: &str) -> Result<String> {
        self.opt_string(field)?
            .ok_or_else(|| self.err(field, "missing"))
    }

    /// RoPE's base from `rope_theta`, or the `rope_parameters` / `rope_scaling` objects, and
    /// YaRN's scaling when their `rope_type` is `yarn` (transformers' defaults filled in:
    /// `original_max_position_embeddings` the model's `max_position`, betas 32 and 1, the
    /// attention factor from `factor` and the `mscale`s, `truncate` true). Other scaled
    /// types are refused by name.
    fn rope(&self, max_position: usize) -> Result<RopeParams> {
        let mut theta = self.opt_f64("rope_theta")?;
        let mut yarn = None;
        for key in ["rope_parameters", "rope_scaling"] {
            let Some(v) = self.present(key) else { continue };
            let Value::Object(params) = v else {
                return Err(self.wrong(key, "an object", v));
            };
            let nested = Fields {
                obj: params,
                path: self.path,
                prefix: self.prefix,
            };
            let named = |field: &str| format!("{key}.{field}");
            let number = |field: &str| {
                nested
                    .opt_f64(field)
                    .map_err(|_| self.wrong(&named(field), "a number", &params[field]))
            };
            let text = |field: &str| {
                nested
                    .opt_string(field)
                    .map_err(|_| self.wrong(&named(field), "a string", &params[field]))
            };
            let kind = match text("rope_type")? {
                Some(k) => Some(k),
                None => text("type")?,
            };
            match kind.as_deref() {
                None | Some("default") => {}
                Some("yarn") => {
                    // transformers prefers a top-level original context to the nested one.
                    let (original, original_field) =
                        match self.opt_f64("original_max_position_embeddings")? {
                            Some(o) => (Some(o), "original_max_position_embeddings".to_string()),
                            None => (
                                number("original_max_position_embeddings")?,
                                named("original_max_position_embeddings"),
                            ),
                        };
                    let original = match original {
                        Some(o) if o >= 1.0 && o.fract() == 0.0 && o <= MAX_POSITIONS as f64 => {
                            o as usize
                        }
                        Some(o) => {
                            return Err(self.err(
                                &original_field,
                                &format!("{o} is not a whole number of positions"),
                            ));
                        }
                        None => max_position,
                    };
                    // No factor: the model's context over the original, as transformers does.
                    let factor = number("factor")?.unwrap_or(max_position as f64 / original as f64);
                    if !(factor >= 1.0 && factor.is_finite()) {
                        return Err(
                            self.err(&named("factor"), &format!("{factor} must be at least 1"))
                        );
                    }
                    let positive = |field: &str, value: Option<f64>| match value {
                        Some(v) if !(v > 0.0 && v.is_finite()) => {
                            Err(self.err(&named(field), &format!("{v} must be a positive number")))
                        }
                        other => Ok(other),
                    };
                    let attention_factor =
                        match positive("attention_factor", number("attention_factor")?)? {
                            Some(a) => a,
                            None => Yarn::default_attention_factor(
                                factor,
                                number("mscale")?,
                                number("mscale_all_dim")?,
                            ),
                        };
                    // transformers reads `beta or default`: 0 (or none) is the default.
                    let beta = |field: &str, default: f64| {
                        let value = number(field)?.filter(|b| *b != 0.0);
                        Ok::<_, ModelError>(positive(field, value)?.unwrap_or(default))
                    };
                    let truncate = nested.opt_bool("truncate").map_err(|_| {
                        self.wrong(&named("truncate"), "true or false", &params["truncate"])
                    })?;
                    yarn = Some(Yarn {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast: beta("beta_fast", 32.0)?,
                        beta_slow: beta("beta_slow", 1.0)?,
                        attention_factor,
                        truncate: truncate.unwrap_or(true),
                    });
                }
                Some(other) => {
                    return Err(self.err(
                        &named("rope_type"),
                        &format!(
                            "rope type `{other}` is not supported (only `default` and `yarn`)"
                        ),
                    ));
                }
            }
            if let Some(t) = number("rope_theta")? {
                theta = Some(t);
            }
        }
        let theta = theta.unwrap_or(10_000.0);
        if theta <= 0.0 || !theta.is_finite() {
            return Err(self.err("rope_theta", "must be positive"));
        }
        Ok(RopeParams {
            theta: theta as f32,
            yarn,
        })
    }

    /// Layer pattern, Gated DeltaNet dimensions, partial RoPE and shared expert size.
    /// `moe_family`: the MoE hybrids, whose shared expert defaults to transformers' size.
    fn hybrid(&self, num_layers: usize, head_dim: usize, moe_family: bool) -> Result<HybridConfig> {
        let layer_types = match self.present("layer_types") {
            Some(Value::Array(items)) => {
                let kinds = items
                    .iter()
                    .map(|i| match i.as_str() {
                        Some("linear_attention") => Some(LayerKind::Linear),
                        Some("full_attention") => Some(LayerKind::Full),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        self.err(
                            "layer_types",
                            "entries must be \"linear_attention\" or \"full_attention\"",
                        )
                    })?;
                if kinds.len() != num_layers {
                    return Err(self.err(
                        "layer_types",
                        &format!("{} entries for {num_layers} layers", kinds.len()),
                    ));
                }
                kinds
            }
            Some(other) => return Err(self.wrong("layer_types", "a list", other)),
            None => {
                let interval = self.opt_usize("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(self.err("full_attention_interval", "must be positive"));
                }
                (0..num_layers)
                    .map(|i| {
                        if (i + 1).is_multiple_of(interval) {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };
        let linear = LinearAttentionConfig {
            conv_kernel: self.bounded("linear_conv_kernel_dim", 16)?,
            num_key_heads: self.bounded("linear_num_key_heads", MAX_HEADS)?,
            num_value_heads: self.bounded("linear_num_value_heads", MAX_HEADS)?,
            key_head_dim: self.bounded("linear_key_head_dim", MAX_HEAD_DIM)?,
            value_head_dim: self.bounded("linear_value_head_dim", MAX_HEAD_DIM)?,
        };
        if linear.conv_kernel < 2 {
            return Err(self.err("linear_conv_kernel_dim", "must be at least 2"));
        }
        if !linear.num_value_heads.is_multiple_of(linear.num_key_heads) {
            return Err(self.err(
                "linear_num_value_heads",
                &format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    linear.num_value_heads, linear.num_key_heads
                ),
            ));
        }
        let factor = match self.opt_f64("partial_rotary_factor")? {
            Some(f) => f,
            None => match self.present("rope_parameters") {
                Some(Value::Object(p)) => p
                    .get("partial_rotary_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.25),
                _ => 0.25,
            },
        };
        if !(factor > 0.0 && factor <= 1.0) || (head_dim as f64 * factor) < 2.0 {
            return Err(self.err(
                "partial_rotary_factor",
                &format!("{factor} must be in (0, 1]"),
            ));
        }
        Ok(HybridConfig {
            layer_types,
            linear,
            partial_rotary_factor: factor,
            shared_expert_intermediate_size: self
                .opt_bounded("shared_expert_intermediate_size", MAX_WIDTH)?
                .or(moe_family.then_some(DEFAULT_SHARED_EXPERT_SIZE)),
        })
    }

    /// MoE settings; `always_renormalize` for Qwen3.5, which has no such flags.
    fn moe(
        &self,
        num_layers: usize,
        always_renormalize: bool,
        default_norm_topk_prob: bool,
    ) -> Result<Option<MoeConfig>> {
        let num_experts = match self.opt_bounded("num_experts", MAX_EXPERTS)? {
            Some(n) => n,
            None => self
                .opt_bounded("num_local_experts", MAX_EXPERTS)?
                .unwrap_or(0),
        };
        if num_experts == 0 {
            return Err(self.err(
                "num_experts",
                "missing (neither num_experts nor num_local_experts is set)",
            ));
        }
        let top_k = self.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(self.err(
                "num_experts_per_tok",
                &format!("{top_k} exceeds the {num_experts} experts"),
            ));
        }
        // Qwen3.5-MoE has no such flags (transformers ignores them): every layer is sparse.
        let mlp_only_layers = match self
            .present("mlp_only_layers")
            .filter(|_| !always_renormalize)
        {
            None => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|i| i.as_u64().map(|n| n as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| self.wrong("mlp_only_layers", "a list of layer indices", v))?,
        };
        if let Some(bad) = mlp_only_layers.iter().find(|&&l| l >= num_layers) {
            return Err(self.err(
                "mlp_only_layers",
                &format!("layer {bad} does not exist ({num_layers} layers)"),
            ));
        }
        let step = if always_renormalize {
            1
        } else {
            self.opt_usize("decoder_sparse_step")?.unwrap_or(1)
        };
        if step == 0 {
            return Err(self.err("decoder_sparse_step", "must be positive"));
        }
        Ok(Some(MoeConfig {
            num_experts,
            top_k,
            moe_intermediate_size: self.bounded("moe_intermediate_size", MAX_WIDTH)?,
            norm_topk_prob: always_renormalize
                || self
                    .opt_bool("norm_topk_prob")?
                    .unwrap_or(default_norm_topk_prob),
            decoder_sparse_step: step,
            mlp_only_layers,
        }))
    }
}

#[cfg(test)]
mod tests;
