//! The tokenizer and chat template a GGUF file carries (`tokenizer.ggml.*`,
//! `tokenizer.chat_template`), rebuilt as the `tokenizer.json` of the checkpoint it came from:
//! byte-level BPE over the file's tokens and merges, NFC, Qwen's split pattern, the control
//! and user-defined tokens as added tokens.

use std::path::Path;

use corral_model::checkpoint::gguf_file::{GgufHeader, GgufValue};
use serde_json::{Map, Value, json};

use crate::{EngineError, Tokenizer, TokenizerConfig};

/// The GGUF model at `path` (its header read), a failure as the engine reports a vocabulary's.
pub(crate) fn open_gguf(
    path: &Path,
) -> Result<corral_model::checkpoint::GgufCheckpoint, EngineError> {
    corral_model::checkpoint::GgufCheckpoint::open(path).map_err(|e| EngineError::Tokenizer {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// The tokenizer and template config of a model: from a checkpoint directory's
/// `tokenizer.json` and `tokenizer_config.json`, or from what a GGUF file carries.
pub fn load_vocabulary(path: &Path) -> Result<(Tokenizer, TokenizerConfig), EngineError> {
    if path.is_file() {
        return vocabulary_from_gguf(&open_gguf(path)?, path);
    }
    let tokenizer = Tokenizer::from_file(&path.join("tokenizer.json"))?;
    Ok((tokenizer, TokenizerConfig::from_dir(path)?))
}

/// The tokenizer and template config of the GGUF file `path`, already opened as `gguf`.
pub fn vocabulary_from_gguf(
    gguf: &corral_model::checkpoint::GgufCheckpoint,
    path: &Path,
) -> Result<(Tokenizer, TokenizerConfig), EngineError> {
    let tokenizer = Tokenizer::from_gguf(gguf.header(), path)?;
    Ok((tokenizer, TokenizerConfig::from_gguf(gguf.header())))
}

/// Qwen2 / Qwen3's pre-tokenizer pattern (`tokenizer.ggml.pre` = "qwen2").
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5 / 3.6's ("qwen35"): letters include combining marks.
const QWEN35_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// ggml's token types.
const NORMAL: u64 = 1;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

/// The `tokenizer.json` text equivalent to the vocabulary in `header` (of the file `path`).
pub(crate) fn tokenizer_json(header: &GgufHeader, path: &Path) -> Result<String, EngineError> {
    let invalid = |detail: String| EngineError::Tokenizer {
        path: path.to_path_buf(),
        detail,
    };
    let string_key = |key: &str| header.get(key).and_then(GgufValue::as_str);
    match string_key("tokenizer.ggml.model") {
        Some("gpt2") => {}
        Some(other) => {
            return Err(invalid(format!(
                "tokenizer model `{other}` is not read (byte-level BPE, \"gpt2\", is)"
            )));
        }
        None => return Err(invalid("no `tokenizer.ggml.model`".to_string())),
    }
    let pattern = match string_key("tokenizer.ggml.pre") {
        Some("qwen35") => QWEN35_PATTERN,
        Some("qwen2") | None => QWEN2_PATTERN,
        Some(other) => {
            return Err(invalid(format!(
                "pre-tokenizer `{other}` is not read (qwen2 and qwen35 are)"
            )));
        }
    };
    let array = |key: &str| {
        header
            .get(key)
            .and_then(GgufValue::as_array)
            .ok_or_else(|| invalid(format!("no `{key}` array")))
    };
    let tokens = array("tokenizer.ggml.tokens")?;
    let types = match header.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .ok_or_else(|| invalid("`tokenizer.ggml.token_type` is not an array".to_string()))?,
        None => &[],
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(invalid(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let text = token
            .as_str()
            .ok_or_else(|| invalid(format!("token {id} is not a string")))?;
        let kind = types.get(id).map_or(Some(NORMAL), GgufValue::as_u64);
        // Every id is in the vocabulary, so that each keeps its place whatever lies between
        // (added tokens take their vocabulary id; BPE never builds one, being matched first).
        if vocab.insert(text.to_string(), json!(id)).is_some() {
            return Err(invalid(format!("token {id} `{text}` appears twice")));
        }
        if let Some(CONTROL | USER_DEFINED) = kind {
            added.push(json!({
                "id": id,
                "content": text,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": kind == Some(CONTROL),
            }));
        }
    }
    let merges = array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(rank, m)| {
            let text = m
                .as_str()
                .ok_or_else(|| invalid(format!("merge {rank} is not a string")))?;
            // The parts are split at the first space after the first character.
            let at = text
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i)
                .ok_or_else(|| invalid(format!("merge {rank} `{text}` has no space")))?;
            Ok(json!([&text[..at], &text[at + 1..]]))
        })
        .collect::<Result<Vec<Value>, EngineError>>()?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]
        },
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    });
    Ok(tokenizer.to_string())
}

/// The ids that end generation for a GGUF model: the EOS, end-of-turn and end-of-message ids
/// it names, and the control tokens Qwen ends turns and documents with.
pub(crate) fn end_of_generation_ids(header: &GgufHeader) -> Vec<u32> {
    const ENDS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];
    let mut ids: Vec<u32> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| header.get(k)?.as_u64())
    .filter_map(|id| u32::try_from(id).ok())
    .collect();
    let tokens = header
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .unwrap_or(&[]);
    let types = header
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
        .unwrap_or(&[]);
    for (id, (token, kind)) in tokens.iter().zip(types).enumerate() {
        let control = kind.as_u64() == Some(CONTROL);
        if control && token.as_str().is_some_and(|t| ENDS.contains(&t)) {
            ids.extend(u32::try_from(id).ok());
        }
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    ids
}

/// The chat template and the text of the BOS and EOS tokens the file names.
pub(crate) fn template_and_specials(
    header: &GgufHeader,
) -> (Option<String>, Option<String>, Option<String>) {
    let token = |key: &str| {
        let id = header.get(key)?.as_u64()?;
        let tokens = header.get("tokenizer.ggml.tokens")?.as_array()?;
        Some(tokens.get(usize::try_from(id).ok()?)?.as_str()?.to_string())
    };
    let template = header
        .get("tokenizer.chat_template")
        .and_then(GgufValue::as_str)
        .map(str::to_string);
    (
        template,
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    )
}
