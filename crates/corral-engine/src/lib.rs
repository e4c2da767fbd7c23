//! The engine layer: KV block ownership, sampling, tokenizer and chat template, and the
//! generation loop over a [`corral_model::Model`].
//!
//! [`KvBlockPool`] decides which cache blocks a sequence holds; [`Sampler`] turns logits into
//! tokens; [`Tokenizer`] and [`ChatTemplate`] turn conversations into prompt ids;
//! [`spawn_engine`] starts the thread that batches requests continuously with the
//! [`Scheduler`] (`serve` many, `run` one).

mod chat_template;
mod constraint;
mod disk_sessions;
mod drafter;
mod engine;
mod error;
mod generation_config;
mod gguf_vocab;
pub mod kv;
pub mod metrics;
mod plan;
mod pyjson;
mod request;
mod sampler;
mod scheduler;
mod segment_cache;
mod tokenizer;

pub use chat_template::{ChatTemplate, TokenizerConfig};
pub use constraint::{Constraint, ConstraintStats, Grammar, GrammarCompiler, json_style};
pub use drafter::{CombinedDrafter, LookupDrafter, ModelDrafter, MtpDrafter};
pub use engine::{EngineConfig, EngineHandle, SubmitError, spawn_engine, spawn_engine_drafting};
pub use error::EngineError;
pub use generation_config::{
    SamplingDefaults, gguf_stop_token_ids, sampling_defaults, stop_token_ids,
};
pub use gguf_vocab::{load_vocabulary, vocabulary_from_gguf};
pub use kv::{
    ChainHash, EvictedPrefix, EvictionCost, KvBlockPool, OutOfBlocks, PrefixCache, PrefixHit,
    RestoreId, RestorePlan, SessionStore, SpillDir, SpillFile, SpilledRun, StateSlotPool,
};
pub use metrics::EngineMetrics;
pub use plan::{MemoryNeeds, MemoryPlan, PlanRequest, mem_available, plan};
pub use request::{EngineRequest, Event, FinishReason, Finished, RequestHandle, TokenEvent};
pub use sampler::{Sampler, SamplingParams, argmax};
pub use scheduler::{
    Drafter, Scheduler, SchedulerConfig, Speculation, StepPlan, kept_state_groups,
};
pub use tokenizer::{IncrementalDecoder, Tokenizer};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;
