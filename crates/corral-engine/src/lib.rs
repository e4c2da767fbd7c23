//! The engine layer: KV block ownership, sampling, tokenizer and chat template, and
//! generation loops over a [`corral_model::Model`].
//!
//! [`KvBlockPool`] decides which cache blocks a sequence holds; [`Sampler`] turns logits into
//! tokens; [`Tokenizer`] and [`ChatTemplate`] turn conversations into prompt ids; [`generate`]
//! runs one request from prompt to stop.

mod chat_template;
mod error;
mod generate;
mod generation_config;
pub mod kv;
mod sampler;
mod tokenizer;

pub use chat_template::{ChatTemplate, TokenizerConfig};
pub use error::EngineError;
pub use generate::{BLOCK_SIZE, FinishReason, GenerationReport, GenerationRequest, generate};
pub use generation_config::stop_token_ids;
pub use kv::{KvBlockPool, OutOfBlocks};
pub use sampler::{Sampler, SamplingParams, argmax};
pub use tokenizer::{IncrementalDecoder, Tokenizer};
