//! The model layer: configs, checkpoints, layers and model families, and the forward pass
//! over a ragged batch.
//!
//! [`ModelConfig`] is a checked `config.json`. [`Checkpoint`] maps safetensors files and
//! indexes their tensors. [`Model::load`] binds a family's weights by their checkpoint names
//! onto a [`corral_backend::Backend`]; [`Model::forward`] runs a [`RaggedBatch`] (runs of
//! several sequences at their own positions) against a [`PagedKvCache`] and returns the logits
//! of the rows asked for. Sparse MoE blocks run with a [`MoeStrategy`]; [`Model::synthetic`]
//! builds a model from a config alone, for benchmarks at full size.

mod batch;
pub mod checkpoint;
mod config;
mod error;
mod families;
mod kv_cache;
mod layers;
mod model;
mod moe;
mod partition;
mod step_runner;
mod weights;

pub use batch::{
    BlockId, BlockTable, LogitsWanted, RaggedBatch, SeqId, SequenceRun, SlotId, TokenId,
};
pub use checkpoint::Checkpoint;
pub use config::{Family, HybridConfig, LayerKind, LinearAttentionConfig, ModelConfig, MoeConfig};
pub use error::{ModelError, Result};
pub use kv_cache::{LayerKv, PagedKvCache, RecurrentStateCache};
pub use model::Model;
pub use moe::{
    CALIBRATION_TOKENS, DEFAULT_GROUPED_MIN_TOKENS, MoeCalibration, MoeStrategy, UnknownStrategy,
    crossover,
};
pub use partition::{Partition, Shard};
pub use step_runner::{ForwardReport, SampledStep};
pub use weights::{SyntheticMix, SyntheticWeights};
