//! What every handler shares: the engine handle, tokenizer and chat template, limits, and the
//! server's own counters.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use corral_engine::{ChatTemplate, EngineHandle, GrammarCompiler, Tokenizer};

/// Limits and identity of the server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Name under which the model is listed, accepted in requests and named in responses.
    pub served_model_name: String,
    /// Other names accepted in requests (and listed).
    pub model_aliases: Vec<String>,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Longest sequence (prompt plus generated tokens).
    pub max_context: usize,
    /// Vocabulary rows of the model (valid token ids are below this).
    pub vocab_size: usize,
    /// Ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Browser origins allowed to call the API (CORS), `*` for any; empty for none.
    pub allowed_origins: Vec<String>,
    /// Sampling values for the fields a request leaves out.
    pub sampling_defaults: corral_engine::SamplingDefaults,
    /// Chat template variables for requests that leave them out (`enable_thinking`, ...).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

/// Request counts by endpoint and HTTP status.
#[derive(Debug, Default)]
pub struct RequestCounts {
    counts: Mutex<BTreeMap<(String, u16), u64>>,
}

impl RequestCounts {
    /// Counts one response.
    pub fn record(&self, endpoint: &str, status: u16) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    /// `(endpoint, status, count)` rows.
    pub fn snapshot(&self) -> Vec<(String, u16, u64)> {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|((e, s), c)| (e.clone(), *s, *c))
            .collect()
    }
}

/// Handler state; cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine thread.
    pub engine: EngineHandle,
    /// The checkpoint's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The checkpoint's chat template, if it has one.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// How the model writes reasoning and tool calls.
    pub syntax: &'static crate::syntax::OutputSyntax,
    /// The compiler of constrained-decoding grammars over the tokenizer's vocabulary, or why
    /// there is none.
    pub grammars: Result<GrammarCompiler, String>,
    /// Limits and identity.
    pub config: Arc<ServerConfig>,
    /// Responses by endpoint and status.
    pub requests: Arc<RequestCounts>,
    /// Unix time the server started, for `/v1/models`.
    pub created: u64,
    /// Responses kept for `previous_response_id`.
    pub responses: Arc<crate::ResponseStore>,
}
