//! End-of-generation ids: `eos_token_id` of `config.json` plus those of
//! `generation_config.json` (which often lists more, e.g. both `<|im_end|>` and
//! `<|endoftext|>`).

use std::path::Path;

use serde_json::Value;

use crate::EngineError;

/// The ids that stop generation for a checkpoint directory, given config.json's own.
pub fn stop_token_ids(dir: &Path, config_eos: &[u32]) -> Result<Vec<u32>, EngineError> {
    let mut ids = config_eos.to_vec();
    let path = dir.join("generation_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
            path: path.clone(),
            source,
        })?;
        let field_err = |problem: String| EngineError::ConfigField {
            path: path.clone(),
            field: "eos_token_id".to_string(),
            problem,
        };
        let value: Value =
            serde_json::from_str(&text).map_err(|e| field_err(format!("not valid JSON: {e}")))?;
        let extra: Vec<u32> = match value.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Number(n)) => vec![
                n.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| field_err(format!("{n} is not a token id")))?,
            ],
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| field_err("expected a list of token ids".to_string()))?,
            Some(other) => {
                return Err(field_err(format!(
                    "expected a token id or a list, got {other}"
                )));
            }
        };
        for id in extra {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}
