//! One request running in the engine: length checks and submission, then the engine's
//! token events turned into parsed deltas, log-probabilities, and at the end why it ended,
//! its usage and timings. Dropping a [`Generation`] drops the event receiver, which cancels
//! the request in the engine.

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
use crate::request::GenerateRequest;
use crate::state::AppState;

/// Why a reply ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// A stop token or stop string.
    Stop,
    /// The token limit.
    Length,
    /// The model called tools and waits for their results.
    ToolCalls,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub(crate) fn openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// A request's token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub(crate) cached_tokens: usize,
    pub(crate) completion_tokens: usize,
    /// Completion tokens inside the reasoning.
    pub(crate) reasoning_tokens: usize,
    /// What max_tokens was clamped to, when it asked for more than the context leaves.
    pub(crate) clamped_to: Option<usize>,
}

impl Usage {
    /// OpenAI's usage object (with the clamp, where there was one).
    pub(crate) fn openai(&self) -> Value {
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
        usage
    }
}

/// How a request ended.
#[derive(Clone, Debug)]
pub(crate) struct End {
    pub(crate) finish: Finish,
    /// The stop string that ended it, if one did.
    pub(crate) stop_sequence: Option<String>,
    pub(crate) usage: Usage,
    /// llama.cpp's `timings` object.
    pub(crate) timings: Value,
}

/// What the next piece of a generation brought.
#[derive(Debug)]
pub(crate) enum Step {
    /// Settled text and tool calls, with the log-probabilities of the tokens behind them.
    Tokens {
        deltas: Vec<Delta>,
        logprobs: Vec<TokenEvent>,
    },
    /// The end: the last deltas, and how it ended.
    Finished { deltas: Vec<Delta>, end: End },
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
    usage: Usage,
    started: Instant,
    first_token: Option<Instant>,
    finished: bool,
    /// Time the request's constraint took, once finished.
    constraint: Option<corral_engine::ConstraintStats>,
    /// Draft tokens verified and accepted, once finished.
    drafted: (usize, usize),
}

impl Drop for Generation {
    /// A request whose client went away before its end is logged too.
    fn drop(&mut self) {
        if !self.finished {
            tracing::info!(
                id = %self.id,
                model = %self.model,
                prompt_tokens = self.usage.prompt_tokens,
                completion_tokens = self.usage.completion_tokens,
                "request cancelled by the client"
            );
        }
    }
}

impl Generation {
    /// Checks the prompt and length against the context and submits the request; errors
    /// in the prompt are reported under `prompt_param`, the API's name for it.
    pub(crate) fn start(
        state: &AppState,
        prompt: Vec<u32>,
        request: &GenerateRequest,
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
        let clamped_to = request.max_tokens.filter(|&n| n > room).map(|_| room);
        let max_tokens = request.max_tokens.map_or(room, |n| n.min(room));
        let constraint = match &request.grammar {
            None => None,
            Some((grammar, param)) => {
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
                params: request.sampling.clone(),
                max_tokens,
                max_context: context,
                stop_token_ids: state.config.stop_token_ids.clone(),
                top_logprobs: request.top_logprobs,
                events: tx,
                session: request.session.clone(),
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
            decoder: IncrementalDecoder::new(request.skip_special_tokens),
            parser,
            usage: Usage {
                prompt_tokens,
                clamped_to,
                ..Usage::default()
            },
            started: Instant::now(),
            first_token: None,
            finished: false,
            constraint: None,
            drafted: (0, 0),
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
                    self.usage.completion_tokens += 1;
                    if self.parser.in_reasoning() {
                        self.usage.reasoning_tokens += 1;
                    }
                    self.usage.cached_tokens = token.cached_prompt_tokens;
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
                        let finish = if self.parser.num_tool_calls() > 0 {
                            Finish::ToolCalls
                        } else {
                            Finish::Stop
                        };
                        return Ok(Some(self.finish(deltas, finish)));
                    }
                    if token.logprob.is_some() {
                        logprobs.push(token);
                    }
                }
                Ok(Some(Step::Tokens { deltas, logprobs }))
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
                let finish = match done.reason {
                    // A call cut short is no call: the reply ended for its length.
                    _ if self.parser.cut_call() => Finish::Length,
                    _ if self.parser.num_tool_calls() > 0 => Finish::ToolCalls,
                    FinishReason::Length => Finish::Length,
                    FinishReason::Stop | FinishReason::Cancelled => Finish::Stop,
                };
                self.usage.cached_tokens = done.cached_tokens;
                self.constraint = done.constraint;
                self.drafted = done.drafted;
                Ok(Some(self.finish(deltas, finish)))
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

    fn finish(&self, deltas: Vec<Delta>, finish: Finish) -> Step {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let prompt_ms = (first - self.started).as_secs_f64() * 1e3;
        let predicted_ms = (now - first).as_secs_f64() * 1e3;
        let usage = self.usage;
        // The first token comes with the prefill; decode rate counts the ones after it.
        let decoded = usage.completion_tokens.saturating_sub(1);
        let per_second = |n: usize, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
        tracing::info!(
            id = %self.id,
            model = %self.model,
            prompt_tokens = usage.prompt_tokens,
            cached_tokens = usage.cached_tokens,
            completion_tokens = usage.completion_tokens,
            ttft_ms = format_args!("{prompt_ms:.1}"),
            decode_tok_s = format_args!("{:.1}", per_second(decoded, predicted_ms)),
            finish_reason = %finish.openai(),
            drafted = self.drafted.0,
            accepted = self.drafted.1,
            grammar = %self.constraint.map_or(String::new(), |c| format!(
                "{} masks, {:.2} ms computing beside the forward, {:.2} ms waited",
                c.masks,
                c.compute.as_secs_f64() * 1e3,
                c.wait.as_secs_f64() * 1e3
            )),
            "request finished"
        );
        Step::Finished {
            deltas,
            end: End {
                finish,
                stop_sequence: self.parser.stop_string().map(str::to_string),
                usage,
                timings: json!({
                    "prompt_n": usage.prompt_tokens,
                    "prompt_ms": prompt_ms,
                    "prompt_per_second": per_second(usage.prompt_tokens, prompt_ms),
                    "predicted_n": usage.completion_tokens,
                    "predicted_ms": predicted_ms,
                    "predicted_per_second": per_second(decoded, predicted_ms),
                    "prefill_duration_ttft": prompt_ms,
                    "decoding_speed_tps": per_second(decoded, predicted_ms),
                }),
            },
        }
    }

    /// Tokens counted so far (the prompt's cached part known from the first token on).
    pub(crate) fn usage(&self) -> Usage {
        self.usage
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

/// A suffix no other id of this server has: the time and a counter, in hex.
pub(crate) fn unique_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{:x}{n:04x}", unix_now())
}

/// A fresh response id with `prefix`.
pub(crate) fn response_id(prefix: &str) -> String {
    format!("{prefix}-{}", unique_suffix())
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
            drafted: (0, 0),
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
            usage: Usage {
                prompt_tokens: 1,
                ..Usage::default()
            },
            started: Instant::now(),
            first_token: None,
            finished: false,
            constraint: None,
            drafted: (0, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop string's finish reason for a generation fed `text`.
    fn finish_reason_of(text: &str, stop: &str) -> Finish {
        run(Generation::fed(text, stop)).1
    }

    /// Every delta of a generation, and its finish reason.
    fn run(mut g: Generation) -> (Vec<Delta>, Finish) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut all = Vec::new();
            loop {
                match g.next().await.unwrap() {
                    Some(Step::Finished { deltas, end }) => {
                        all.extend(deltas);
                        return (all, end.finish);
                    }
                    Some(Step::Tokens { deltas, .. }) => all.extend(deltas),
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
            Finish::ToolCalls
        );
        assert_eq!(
            finish_reason_of("plain text HALT more", "HALT"),
            Finish::Stop
        );
    }
}
