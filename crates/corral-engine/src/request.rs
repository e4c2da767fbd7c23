//! What a request is and what it hears back: the types the engine thread, the scheduler and
//! the handlers share, so that none of them imports another for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use corral_backend::DispatchStats;
use tokio::sync::mpsc::UnboundedSender;

use crate::SamplingParams;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled, the grammar completed, or the client found a stop string
    /// ([`RequestHandle::finish_as_stop`]).
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The client went away.
    Cancelled,
}

/// The submitter's hold on a request in the engine ([`crate::EngineHandle::submit`]).
#[derive(Clone, Debug, Default)]
pub struct RequestHandle {
    stopped: Arc<AtomicBool>,
}

impl RequestHandle {
    /// Marks the request as ended by a stop (its client found a stop string in the text),
    /// before its receiver is dropped: the engine then ends it as [`FinishReason::Stop`],
    /// counted so and its turn kept in the prefix cache, not as a cancellation.
    pub fn finish_as_stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// Why a request whose receiver is gone ended.
    pub(crate) fn departed_reason(&self) -> FinishReason {
        if self.stopped.load(Ordering::SeqCst) {
            FinishReason::Stop
        } else {
            FinishReason::Cancelled
        }
    }
}

/// A validated generation request.
#[derive(Debug)]
pub struct EngineRequest {
    /// Prompt token ids (non-empty, within the vocabulary).
    pub prompt: Vec<u32>,
    /// Sampling parameters (validated).
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Longest the sequence may grow.
    pub max_context: usize,
    /// Ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Alternatives to report with each token's log-probability; `None` for no log-probs.
    pub top_logprobs: Option<usize>,
    /// Where the request's events go.
    pub events: UnboundedSender<Event>,
    /// The client's session id (`X-Session-Id`, or the `user` field): the prefix its turn
    /// leaves in the cache is kept from eviction for a while. Nothing depends on it.
    pub session: Option<String>,
    /// The grammar the output must match (`response_format`, a required tool call).
    pub constraint: Option<crate::Constraint>,
}

/// A generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// The token.
    pub id: u32,
    /// Prompt tokens the request took from the prefix cache instead of computing (the same
    /// on every token of a request).
    pub cached_prompt_tokens: usize,
    /// Its log-probability, when asked for.
    pub logprob: Option<f32>,
    /// The most likely alternatives and their log-probabilities, when asked for.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The end of a request.
#[derive(Clone, Debug)]
pub struct Finished {
    /// Why it ended.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from cache.
    pub cached_tokens: usize,
    /// Milliseconds from arrival to the first token.
    pub prompt_ms: f64,
    /// Milliseconds from the first token to the last.
    pub decode_ms: f64,
    /// Counts of the steps that prefilled the prompt (shared with the other sequences in
    /// those steps).
    pub prefill_stats: DispatchStats,
    /// Decode steps run after the first token.
    pub decode_steps: usize,
    /// Counts of those decode steps (shared likewise).
    pub decode_stats: DispatchStats,
    /// Time its constraint took, if it had one.
    pub constraint: Option<crate::ConstraintStats>,
    /// Draft tokens its steps verified, and how many of them were accepted.
    pub drafted: (usize, usize),
}

/// What the engine sends a request's handler.
#[derive(Clone, Debug)]
pub enum Event {
    /// Tokens were generated: one, or several where a step accepted a draft.
    Tokens(Vec<TokenEvent>),
    /// Generation ended.
    Finished(Finished),
    /// The engine failed while running the request.
    Failed(String),
}
