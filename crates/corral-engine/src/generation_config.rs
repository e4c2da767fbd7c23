//! What `generation_config.json` says about generating: end-of-generation ids
//! (`eos_token_id` of `config.json` plus its own, which often lists more, e.g. both
//! `<|im_end|>` and `<|endoftext|>`), and the sampling defaults the model ships with.

use std::path::Path;

use serde_json::Value;

use crate::EngineError;

/// The ids that stop generation for a checkpoint directory, given config.json's own; for a
/// GGUF file, those its vocabulary names (it has no generation config).
pub fn stop_token_ids(dir: &Path, config_eos: &[u32]) -> Result<Vec<u32>, EngineError> {
    if dir.is_file() {
        let gguf = crate::gguf_vocab::open_gguf(dir)?;
        return Ok(gguf_stop_token_ids(&gguf, config_eos));
    }
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

/// config.json's end-of-generation ids plus those the vocabulary of an opened GGUF file names.
pub fn gguf_stop_token_ids(
    gguf: &corral_model::checkpoint::GgufCheckpoint,
    config_eos: &[u32],
) -> Vec<u32> {
    let mut ids = config_eos.to_vec();
    for id in crate::gguf_vocab::end_of_generation_ids(gguf.header()) {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Sampling values a request gets for the fields it leaves out: the model's shipped
/// defaults (`generation_config.json`), overridden by the command line. `None`: the API's
/// own default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    /// Softmax temperature.
    pub temperature: Option<f32>,
    /// Nucleus probability mass.
    pub top_p: Option<f32>,
    /// Most likely tokens kept (0: all).
    pub top_k: Option<usize>,
    /// Least probability kept, relative to the most likely token.
    pub min_p: Option<f32>,
    /// Penalty on tokens already seen.
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    /// The names `set` and the files know.
    pub const FIELDS: [&'static str; 5] = [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    ];

    /// Sets field `name` to `value`, checked as a request's field would be.
    pub fn set(&mut self, name: &str, value: f64) -> Result<(), String> {
        let in_range = |lo: f64, hi: f64, open_low: bool| {
            let ok = value.is_finite() && value <= hi && (value > lo || (!open_low && value == lo));
            if ok {
                Ok(value as f32)
            } else {
                Err(format!("{name} = {value} is outside its range"))
            }
        };
        match name {
            "temperature" => self.temperature = Some(in_range(0.0, 2.0, false)?),
            "top_p" => self.top_p = Some(in_range(0.0, 1.0, true)?),
            "min_p" => self.min_p = Some(in_range(0.0, 1.0, false)?),
            "repetition_penalty" => self.repetition_penalty = Some(in_range(0.0, 10.0, true)?),
            "top_k" => {
                if value.fract() != 0.0 || !(-1.0..=1e9).contains(&value) {
                    return Err(format!(
                        "top_k = {value} is not -1, 0 or a positive integer"
                    ));
                }
                self.top_k = Some(value.max(0.0) as usize);
            }
            _ => {
                return Err(format!(
                    "unknown sampling field `{name}` (expected one of {})",
                    Self::FIELDS.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// `temperature=0.7,top_p=0.8,...` (the `--sampling-defaults` form) over `self`.
    pub fn parse_over(mut self, text: &str) -> Result<Self, String> {
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not NAME=VALUE"))?;
            let value: f64 = value
                .trim()
                .parse()
                .map_err(|_| format!("`{item}`: `{}` is not a number", value.trim()))?;
            self.set(name.trim(), value)?;
        }
        Ok(self)
    }

    /// The set fields as `name=value`, for the start-up log.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let mut add = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                parts.push(format!("{name}={v}"));
            }
        };
        add("temperature", self.temperature.map(|v| v.to_string()));
        add("top_p", self.top_p.map(|v| v.to_string()));
        add("top_k", self.top_k.map(|v| v.to_string()));
        add("min_p", self.min_p.map(|v| v.to_string()));
        add(
            "repetition_penalty",
            self.repetition_penalty.map(|v| v.to_string()),
        );
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(" ")
        }
    }
}

/// The sampling defaults of a checkpoint directory's `generation_config.json` (none when it
/// has no such file); a field of the wrong type or out of range is an error naming it.
pub fn sampling_defaults(dir: &Path) -> Result<SamplingDefaults, EngineError> {
    let path = dir.join("generation_config.json");
    let mut defaults = SamplingDefaults::default();
    if !path.exists() {
        return Ok(defaults);
    }
    let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
        path: path.clone(),
        source,
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|e| EngineError::ConfigField {
        path: path.clone(),
        field: "(file)".to_string(),
        problem: format!("not valid JSON: {e}"),
    })?;
    for name in SamplingDefaults::FIELDS {
        let field_err = |problem: String| EngineError::ConfigField {
            path: path.clone(),
            field: name.to_string(),
            problem,
        };
        match value.get(name) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) => {
                let v = n
                    .as_f64()
                    .ok_or_else(|| field_err(format!("{n} is not a number")))?;
                defaults.set(name, v).map_err(field_err)?;
            }
            Some(other) => return Err(field_err(format!("expected a number, got {other}"))),
        }
    }
    Ok(defaults)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder holding `json` as its generation_config.json, removed when dropped.
    fn dir_with(json: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("generation_config.json"), json).unwrap();
        dir
    }

    #[test]
    fn sampling_defaults_are_read_and_checked() {
        // Qwen3's shipped values.
        let dir = dir_with(
            r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}"#,
        );
        let d = sampling_defaults(dir.path()).unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: None,
                repetition_penalty: None,
            }
        );
        let over = d.parse_over("temperature=0, min_p=0.05").unwrap();
        assert_eq!(
            (over.temperature, over.min_p, over.top_k),
            (Some(0.0), Some(0.05), Some(20))
        );
        for bad in [
            r#"{"temperature": "hot"}"#,
            r#"{"top_p": 0}"#,
            r#"{"top_k": 2.5}"#,
        ] {
            let err = sampling_defaults(dir_with(bad).path())
                .unwrap_err()
                .to_string();
            assert!(err.contains("generation_config.json"), "{err}");
        }
        assert!(d.parse_over("temp=1").unwrap_err().contains("unknown"));
        assert!(d.parse_over("top_p").unwrap_err().contains("NAME=VALUE"));
        let none = tempfile::tempdir().unwrap();
        assert_eq!(
            sampling_defaults(none.path()).unwrap(),
            SamplingDefaults::default()
        );
    }
}
