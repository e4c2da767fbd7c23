//! Reading a request body's fields by the names its API gives them: each reader checks one
//! field's type and range and names that field in its error. The decoders of every wire
//! format share these, so a field means the same everywhere it exists.

use corral_engine::{SamplingDefaults, SamplingParams};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// A JSON object's fields.
pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

/// What a value is, for error messages.
pub(super) fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// String field `key` of an object inside the body (a block, an item, a tool), errors named
/// `{param}.{key}`; null counts as absent.
pub(super) fn string_in(v: &Value, key: &str, param: &str) -> Result<Option<String>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong(&format!("{param}.{key}"), "a string", other)),
    }
}

/// A flat tool definition (`{"name", "description", SCHEMA_KEY}`, Anthropic's and the
/// Responses API's), the `i`th of `tools`.
pub(super) fn flat_tool(t: &Value, i: usize, schema_key: &str) -> Result<super::Tool, ApiError> {
    let name = string_in(t, "name", &format!("tools[{i}]"))?.ok_or_else(|| {
        ApiError::invalid(&format!("tools[{i}].name"), "each tool needs a `name`")
    })?;
    Ok(super::Tool::new(
        name,
        t.get("description").cloned(),
        t.get(schema_key).filter(|s| s.is_object()).cloned(),
    ))
}

/// The error for a field of the wrong type.
pub(super) fn wrong(key: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        key,
        format!("`{key}` must be {expected}, got {}", describe(got)),
    )
}

impl<'a> Fields<'a> {
    /// A field's value; null counts as absent.
    pub(super) fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// A number in `range`.
    pub(super) fn number(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<f64>,
    ) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v.as_f64().ok_or_else(|| wrong(key, "a number", v))?;
        if !range.contains(&n) {
            return Err(ApiError::invalid(
                key,
                format!(
                    "`{key}` must be between {} and {}, got {n}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(Some(n))
    }

    /// An integer.
    pub(super) fn integer(&self, key: &str) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_i64()
            .or_else(|| v.as_u64().map(|u| u as i64))
            .map(Some)
            .ok_or_else(|| wrong(key, "an integer", v))
    }

    /// A boolean.
    pub(super) fn boolean(&self, key: &str) -> Result<Option<bool>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| wrong(key, "a boolean", v))
    }

    /// A string.
    pub(super) fn string(&self, key: &str) -> Result<Option<String>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| wrong(key, "a string", v))
    }

    /// An object.
    pub(super) fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_object()
            .map(Some)
            .ok_or_else(|| wrong(key, "an object", v))
    }

    /// An array.
    pub(super) fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_array()
            .map(Some)
            .ok_or_else(|| wrong(key, "an array", v))
    }

    /// A token count of at least 1, from the first of `keys` given (the last wins where
    /// several are).
    pub(super) fn max_tokens(&self, keys: &[&str]) -> Result<Option<usize>, ApiError> {
        let mut max_tokens = None;
        for &key in keys {
            if let Some(n) = self.integer(key)? {
                if n < 1 {
                    return Err(ApiError::invalid(
                        key,
                        format!("`{key}` must be at least 1, got {n}"),
                    ));
                }
                max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
            }
        }
        Ok(max_tokens)
    }

    /// Stop strings: a string or a list of at most `max` strings.
    pub(super) fn stops(&self, key: &str, max: usize) -> Result<Vec<String>, ApiError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => {
                let stops: Vec<String> = items
                    .iter()
                    .map(|i| i.as_str().map(str::to_string))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        ApiError::invalid(key, format!("`{key}` must be a list of strings"))
                    })?;
                if stops.len() > max {
                    return Err(ApiError::invalid(
                        key,
                        format!("`{key}` holds at most {max} strings, got {}", stops.len()),
                    ));
                }
                Ok(stops)
            }
            Some(other) => Err(wrong(key, "a string or a list of strings", other)),
        }
    }

    /// Sampling parameters from the fields of [`SAMPLING_FIELDS`] that this API defines
    /// (`defined`), the model's defaults filling what the request leaves out.
    pub(super) fn sampling(
        &self,
        defined: &[&str],
        defaults: &SamplingDefaults,
    ) -> Result<SamplingParams, ApiError> {
        let has = |key: &str| defined.contains(&key);
        let number = |key: &str, range| {
            if has(key) {
                self.number(key, range)
            } else {
                Ok(None)
            }
        };
        let top_k = match has("top_k")
            .then(|| self.integer("top_k"))
            .transpose()?
            .flatten()
        {
            None => defaults.top_k.unwrap_or(0),
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1, 0 or positive, got {k}"),
                ));
            }
        };
        let seed = has("seed")
            .then(|| self.integer("seed"))
            .transpose()?
            .flatten();
        Ok(SamplingParams {
            temperature: number("temperature", 0.0..=2.0)?
                .map_or(defaults.temperature.unwrap_or(1.0), |t| t as f32),
            top_k,
            top_p: match number("top_p", 0.0..=1.0)? {
                Some(p) if p <= 0.0 => {
                    return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
                }
                Some(p) => p as f32,
                None => defaults.top_p.unwrap_or(1.0),
            },
            min_p: number("min_p", 0.0..=1.0)?.map_or(defaults.min_p.unwrap_or(0.0), |p| p as f32),
            repetition_penalty: match number("repetition_penalty", 0.0..=10.0)? {
                Some(r) if r <= 0.0 => {
                    return Err(ApiError::invalid(
                        "repetition_penalty",
                        "`repetition_penalty` must be greater than 0",
                    ));
                }
                Some(r) => r as f32,
                None => defaults.repetition_penalty.unwrap_or(1.0),
            },
            presence_penalty: number("presence_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
            frequency_penalty: number("frequency_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
            seed: match seed {
                Some(s) => s as u64,
                None => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64),
            },
        })
    }

    /// Logs, once, the fields of the body that are not among `read` (unknown ones, and ones
    /// Corral does not honour yet), so that nothing is dropped silently; returns them sorted.
    pub(super) fn warn_unread(&self, read: &[&[&str]]) -> Vec<String> {
        let mut ignored: Vec<String> = self
            .0
            .keys()
            .filter(|k| !read.iter().any(|set| set.contains(&k.as_str())))
            .cloned()
            .collect();
        ignored.sort();
        warn_ignored(&ignored);
        ignored
    }
}

/// Every sampling field some API defines, with the same meaning in each.
pub(super) const SAMPLING_FIELDS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
];

/// The one log line naming a request's fields that are not acted on, if any.
pub(crate) fn warn_ignored<S: AsRef<str>>(fields: &[S]) {
    if !fields.is_empty() {
        let names: Vec<&str> = fields.iter().map(AsRef::as_ref).collect();
        tracing::warn!(
            fields = %names.join(", "),
            "request fields that are not acted on (ignored)"
        );
    }
}
