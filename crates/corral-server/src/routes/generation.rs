//! Driving one request through the engine: length checks and submission, then turning the
//! engine's token events into parsed deltas, log-probabilities, usage and timings. Shared by
//! the chat and text completion endpoints, streaming or not. Dropping a [`Generation`] drops
//! the event receiver, which cancels the request in the engine.

use std::sync::Arc;
use std::time::Instant;

use corral_engine::{
    EngineRequest, Event, FinishReason, IncrementalDecoder, RequestHandle, SubmitError, TokenEvent,
    Tokenizer,
};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::error::ApiError;
use crate::output::{Delta, OutputParser};
use crate::request::Settings;
use crate::state::AppState;

/// What the next piece of a generation brought.
#[derive(Debug)]
pub(crate) enum Step {
    /// Settled text and tool calls, with the log-probabilities of the tokens behind them.
    Deltas {
        deltas: Vec<Delta>,
        logprobs: Vec<TokenEvent>,
    },
    /// The end: the last deltas, why it ended, usage and timings.
    Finished {
        deltas: Vec<Delta>,
        finish_reason: &'static str,
        usage: Value,
        timings: Value,
    },
}

/// A request running in the engine.
pub(crate) struct Generation {
    /// The response id (logged with the request's end).
    id: String,
    model: String,
    rx: UnboundedReceiver<Event>,
    /// Ends the request in the engine as a stop, when a stop string ends it here.
    handle: RequestHandle,
    tokenizer: Arc<Tokenizer>,
    decoder: IncrementalDecoder,
    parser: OutputParser,
    prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache, as the engine reports them.
    cached_tokens: usize,
    completion_tokens: usize,
    /// Completion tokens generated inside the reasoning (`<think>` to `</think>`).
    reasoning_tokens: usize,
    started: Instant,
    first_token: Option<Instant>,
    finished: bool,
    /// What max_tokens was clamped to, when it asked for more than the context leaves.
    clamped_to: Option<usize>,
    /// Time the request's constraint took, once finished.
    constraint: Option<corral_engine::ConstraintStats>,
}

impl Drop for Generation {
    /// A request whose client went away before its end is logged too.
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!(
                id = %self.id,
                model = %self.model,
                prompt_tokens = self.prompt_tokens,
                completion_tokens = self.completion_tokens,
                "request cancelled by the client"
            );
        }
    }
}

impl Generation {
    /// Checks the prompt and length against the context and submits the request.
    pub(crate) fn start(
        state: &AppState,
        prompt: Vec<u32>,
        settings: &Settings,
        parser: OutputParser,
        prompt_param: &str,
        id_prefix: &str,
    ) -> Result<Self, ApiError> {
        let context = state.config.max_context;
        if prompt.is_empty() {
            return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
        }
        if let Some(bad) = prompt
            .iter()
            .find(|&&t| t as usize >= state.config.vocab_size)
        {
            return Err(ApiError::invalid(
                prompt_param,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    state.config.vocab_size
                ),
            ));
        }
        if prompt.len() >= context {
            return Err(ApiError::invalid(
                prompt_param,
                format!(
                    "the prompt has {} tokens; this model's context is {context} tokens, leaving no room to generate",
                    prompt.len()
                ),
            ));
        }
        // As llama.cpp's server: a max_tokens beyond the context is clamped to what is left
        // (agents ask for the whole context), and the usage says so.
        let room = context - prompt.len();
        let clamped_to = settings.max_tokens.filter(|&n| n > room).map(|_| room);
        let max_tokens = settings.max_tokens.map_or(room, |n| n.min(room));
        let constraint = match &settings.grammar {
            None => None,
            Some(grammar) => {
                let param = settings.grammar_param;
                let compiler = state.grammars.as_ref().map_err(|e| {
                    ApiError::invalid(
                        param,
                        format!("constrained decoding is unavailable for this tokenizer: {e}"),
                    )
                })?;
                let constraint = compiler
                    .compile(grammar)
                    .map_err(|e| ApiError::invalid(param, e.to_string()))?;
                Some(constraint)
            }
        };
        let (tx, rx) = unbounded_channel();
        let prompt_tokens = prompt.len();
        let handle = state
            .engine
            .submit(EngineRequest {
                prompt,
                params: settings.params.clone(),
                max_tokens,
                max_context: context,
                stop_token_ids: state.config.stop_token_ids.clone(),
                top_logprobs: settings.top_logprobs,
                events: tx,
                session: settings.session.clone(),
                constraint,
            })
            .map_err(|e| match e {
                SubmitError::QueueFull(_) => ApiError::busy(e.to_string()),
                SubmitError::Stopped => ApiError::unavailable(e.to_string()),
            })?;
        Ok(Self {
            id: response_id(id_prefix),
            model: state.config.served_model_name.clone(),
            rx,
            handle,
            tokenizer: Arc::clone(&state.tokenizer),
            decoder: IncrementalDecoder::new(settings.skip_special_tokens),
            parser,
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            reasoning_tokens: 0,
            started: Instant::now(),
            first_token: None,
            finished: false,
            clamped_to,
            constraint: None,
        })
    }

    /// The next step; `None` after the end.
    pub(crate) async fn next(&mut self) -> Result<Option<Step>, ApiError> {
        if self.finished {
            return Ok(None);
        }
        let event = self.rx.recv().await;
        match event {
            Some(Event::Tokens(tokens)) => {
                self.first_token.get_or_insert_with(Instant::now);
                let (mut deltas, mut logprobs) = (Vec::new(), Vec::new());
                for token in tokens {
                    self.completion_tokens += 1;
                    if self.parser.in_reasoning() {
                        self.reasoning_tokens += 1;
                    }
                    self.cached_tokens = token.cached_prompt_tokens;
                    let text = self
                        .decoder
                        .push(&self.tokenizer, token.id)
                        .map_err(|e| ApiError::internal(e.to_string()))?;
                    deltas.extend(text.map(|t| self.parser.push(&t)).unwrap_or_default());
                    if self.parser.stopped() {
                        // A stop string: the engine ends the request as a stop (counted so,
                        // its turn cached), not as a client gone; tokens after it are not
                        // the reply's.
                        self.finished = true;
                        self.handle.finish_as_stop();
                        self.rx.close();
                        let reason = if self.parser.num_tool_calls() > 0 {
                            "tool_calls"
                        } else {
                            "stop"
                        };
                        return Ok(Some(self.finish(deltas, reason)));
                    }
                    if token.logprob.is_some() {
                        logprobs.push(token);
                    }
                }
                Ok(Some(Step::Deltas { deltas, logprobs }))
            }
            Some(Event::Finished(done)) => {
                self.finished = true;
                let mut deltas = Vec::new();
                if let Some(rest) = self
                    .decoder
                    .finish(&self.tokenizer)
                    .map_err(|e| ApiError::internal(e.to_string()))?
                {
                    deltas.extend(self.parser.push(&rest));
                }
                deltas.extend(self.parser.finish(done.reason == FinishReason::Length));
                let reason = match done.reason {
                    // A call cut short is no call: the reply ended for its length.
                    _ if self.parser.cut_call() => "length",
                    _ if self.parser.num_tool_calls() > 0 => "tool_calls",
                    FinishReason::Length => "length",
                    FinishReason::Stop | FinishReason::Cancelled => "stop",
                };
                self.cached_tokens = done.cached_tokens;
                self.constraint = done.constraint;
                Ok(Some(self.finish(deltas, reason)))
            }
            Some(Event::Failed(message)) => {
                self.finished = true;
                tracing::warn!(id = %self.id, model = %self.model, error = %message, "request failed");
                Err(ApiError::internal(format!("generation failed: {message}")))
            }
            None => {
                self.finished = true;
                Err(ApiError::unavailable(
                    "the engine stopped before the request finished",
                ))
            }
        }
    }

    fn finish(&self, deltas: Vec<Delta>, finish_reason: &'static str) -> Step {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let prompt_ms = (first - self.started).as_secs_f64() * 1e3;
        let predicted_ms = (now - first).as_secs_f64() * 1e3;
        // The first token comes with the prefill; decode rate counts the ones after it.
        let decoded = self.completion_tokens.saturating_sub(1);
        let per_second = |n: usize, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
        tracing::info!(
            id = %self.id,
            model = %self.model,
            prompt_tokens = self.prompt_tokens,
            cached_tokens = self.cached_tokens,
            completion_tokens = self.completion_tokens,
            ttft_ms = format_args!("{prompt_ms:.1}"),
            decode_tok_s = format_args!("{:.1}", per_second(decoded, predicted_ms)),
            finish_reason = %finish_reason,
            grammar = %self.constraint.map_or(String::new(), |c| format!(
                "{} masks, {:.2} ms computing beside the forward, {:.2} ms waited",
                c.masks,
                c.compute.as_secs_f64() * 1e3,
                c.wait.as_secs_f64() * 1e3
            )),
            "request finished"
        );
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        });
        if let Some(n) = self.clamped_to {
            usage["max_tokens_clamped_to"] = json!(n);
        }
        Step::Finished {
            deltas,
            finish_reason,
            usage,
            timings: json!({
                "prompt_n": self.prompt_tokens,
                "prompt_ms": prompt_ms,
                "prompt_per_second": per_second(self.prompt_tokens, prompt_ms),
                "predicted_n": self.completion_tokens,
                "predicted_ms": predicted_ms,
                "predicted_per_second": per_second(decoded, predicted_ms),
                "prefill_duration_ttft": prompt_ms,
                "decoding_speed_tps": per_second(decoded, predicted_ms),
            }),
        }
    }

    /// Tokens in the prompt.
    pub(crate) fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Prompt tokens taken from the prefix cache, as known so far (from the first token on).
    pub(crate) fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// The response id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// The text of a token, for log-probability entries.
    pub(crate) fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id]).unwrap_or_default()
    }

    /// The exact bytes of a token (part of a character, perhaps), for log-probability
    /// entries.
    pub(crate) fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.tokenizer.token_bytes(id).unwrap_or_default()
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh response id with `prefix`.
pub(crate) fn response_id(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{:x}{n:04x}", unix_now())
}

#[cfg(test)]
impl Generation {
    /// A generation fed `text` token by token by the demo model's tokenizer, then finished on
    /// a stop token; it parses tool calls and cuts at `stop`.
    pub(crate) fn fed(text: &str, stop: &str) -> Self {
        Self::fed_in(text, stop, 1)
    }

    /// [`Generation::fed`] with `per_event` tokens an event (as steps that accept drafts
    /// send them).
    pub(crate) fn fed_in(text: &str, stop: &str, per_event: usize) -> Self {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/tiny-qwen3-moe/tokenizer.json");
        let tokenizer = Arc::new(Tokenizer::from_file(&path).unwrap());
        let (tx, rx) = unbounded_channel();
        let ids = tokenizer.encode(text).unwrap();
        for ids in ids.chunks(per_event) {
            let tokens = ids
                .iter()
                .map(|&id| TokenEvent {
                    id,
                    cached_prompt_tokens: 0,
                    logprob: None,
                    top_logprobs: Vec::new(),
                })
                .collect();
            tx.send(Event::Tokens(tokens)).unwrap();
        }
        tx.send(Event::Finished(corral_engine::Finished {
            reason: FinishReason::Stop,
            prompt_tokens: 1,
            completion_tokens: ids.len(),
            cached_tokens: 0,
            prompt_ms: 0.0,
            decode_ms: 0.0,
            prefill_stats: Default::default(),
            decode_steps: 0,
            decode_stats: Default::default(),
            constraint: None,
        }))
        .unwrap();
        let stops = if stop.is_empty() {
            Vec::new()
        } else {
            vec![stop.to_string()]
        };
        Generation {
            id: "test".to_string(),
            model: "tiny".to_string(),
            rx,
            handle: RequestHandle::default(),
            tokenizer,
            decoder: IncrementalDecoder::default(),
            parser: OutputParser::new(&crate::syntax::QWEN3, false, stops, true),
            prompt_tokens: 1,
            cached_tokens: 0,
            completion_tokens: 0,
            reasoning_tokens: 0,
            started: Instant::now(),
            first_token: None,
            finished: false,
            clamped_to: None,
            constraint: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop string's finish reason for a generation fed `text`.
    fn finish_reason_of(text: &str, stop: &str) -> &'static str {
        run(Generation::fed(text, stop)).1
    }

    /// Every delta of a generation, and its finish reason.
    fn run(mut g: Generation) -> (Vec<Delta>, &'static str) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut all = Vec::new();
            loop {
                match g.next().await.unwrap() {
                    Some(Step::Finished {
                        deltas,
                        finish_reason,
                        ..
                    }) => {
                        all.extend(deltas);
                        return (all, finish_reason);
                    }
                    Some(Step::Deltas { deltas, .. }) => all.extend(deltas),
                    None => panic!("no end"),
                }
            }
        })
    }

    /// Tokens that come several to an event (a step that accepted a draft) give the text,
    /// calls and finish that they give one by one, a stop string inside an event included.
    #[test]
    fn several_tokens_an_event_read_as_one_by_one() {
        let call =
            "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        for (text, stop) in [
            (
                format!("The answer is 42. {call} HALT and more after it"),
                "HALT",
            ),
            ("plain text without a stop".to_string(), ""),
        ] {
            let one = run(Generation::fed(&text, stop));
            for per_event in [2, 3, 7] {
                let several = run(Generation::fed_in(&text, stop, per_event));
                assert_eq!(
                    format!("{several:?}"),
                    format!("{one:?}"),
                    "{per_event} an event"
                );
            }
        }
    }

    /// A stop string reached after a tool call ends the turn with "tool_calls" (the client
    /// must run the call), one reached before any with "stop".
    #[test]
    fn a_stop_string_after_a_tool_call_finishes_with_tool_calls() {
        let call =
            "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert_eq!(
            finish_reason_of(&format!("{call} HALT more"), "HALT"),
            "tool_calls"
        );
        assert_eq!(finish_reason_of("plain text HALT more", "HALT"), "stop");
    }
}
