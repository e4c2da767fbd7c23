//! Generating one sequence to completion: chunked prefill through the paged KV cache, then
//! one decode step per token, with timings and dispatch counts for each phase. The server's
//! scheduler batches many sequences; this is the single-request path behind `corral run`.

use std::time::{Duration, Instant};

use corral_backend::DispatchStats;
use corral_model::{
    BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache, SeqId, SlotId,
    TokenId,
};

use crate::request::FinishReason;
use crate::{EngineError, KvBlockPool, Sampler, SamplingParams};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// How to sample.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Ids that end generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Most prompt tokens per prefill forward.
    pub prefill_chunk: usize,
}

/// Tokens and measurements of one generation.
#[derive(Clone, Debug)]
pub struct GenerationReport {
    /// Generated ids, without the stop token.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Time from start to the first sampled token.
    pub ttft: Duration,
    /// Counts over the prefill forwards.
    pub prefill_stats: DispatchStats,
    /// Decode forwards run.
    pub decode_steps: usize,
    /// Time of the decode forwards and their sampling.
    pub decode_time: Duration,
    /// Counts over the decode forwards.
    pub decode_stats: DispatchStats,
}

/// Runs `request` on `model`, calling `on_token` with each generated id as it is sampled;
/// `on_token` returning `false` stops generation.
pub fn generate(
    model: &Model,
    request: &GenerationRequest,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenerationReport, EngineError> {
    request.params.validate()?;
    if request.prompt.is_empty() {
        return Err(EngineError::InvalidParameter {
            param: "prompt",
            problem: "is empty".to_string(),
        });
    }
    let config = model.config();
    if request.max_tokens == 0 {
        return Err(EngineError::InvalidParameter {
            param: "max_tokens",
            problem: "must be at least 1".to_string(),
        });
    }
    let context = config.max_position_embeddings;
    let total = request.prompt.len().saturating_add(request.max_tokens);
    if total > context {
        return Err(EngineError::InvalidParameter {
            param: "max_tokens",
            problem: format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context of {context}",
                request.prompt.len(),
                request.max_tokens
            ),
        });
    }
    let blocks = total.div_ceil(BLOCK_SIZE);
    let mut pool = KvBlockPool::new(blocks, BLOCK_SIZE);
    let mut cache = PagedKvCache::new(model.backend().as_ref(), config, blocks, BLOCK_SIZE)?;
    let mut state = RecurrentStateCache::new(model.backend().as_ref(), config, 1)?;
    let mut table = BlockTable::default();
    pool.grow(&mut table, total)?;

    let seq = SeqId(0);
    let start = Instant::now();
    let backend = model.backend();
    let stats_start = backend.stats();
    let mut logits = Vec::new();
    let mut seen = request.prompt.clone();
    let mut position = 0;
    let chunk = request.prefill_chunk.max(1);
    for piece in request.prompt.chunks(chunk) {
        let last = position + piece.len() == request.prompt.len();
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        let ids: Vec<TokenId> = piece.iter().map(|&t| TokenId(t)).collect();
        let wanted = if last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        batch.push_run(seq, &ids, position, &table, wanted)?;
        batch.set_state_slot(seq, SlotId(0))?;
        let _ = model.forward_with_state(&batch, &mut cache, &mut state, &mut logits)?;
        position += piece.len();
    }
    let mut sampler = Sampler::new(request.params.clone());
    let mut tokens = Vec::new();
    let mut next = sampler.sample(&mut logits, &seen);
    let ttft = start.elapsed();
    let prefill_stats = backend.stats() - stats_start;

    let decode_start = Instant::now();
    let decode_stats_start = backend.stats();
    let mut decode_steps = 0;
    let finish = loop {
        if request.stop_token_ids.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        seen.push(next);
        if !on_token(next) {
            break FinishReason::Cancelled;
        }
        if tokens.len() >= request.max_tokens {
            break FinishReason::Length;
        }
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        batch.push_run(seq, &[TokenId(next)], position, &table, LogitsWanted::Last)?;
        batch.set_state_slot(seq, SlotId(0))?;
        let _ = model.forward_with_state(&batch, &mut cache, &mut state, &mut logits)?;
        position += 1;
        decode_steps += 1;
        next = sampler.sample(&mut logits, &seen);
    };
    pool.release(&mut table);
    Ok(GenerationReport {
        tokens,
        finish,
        prompt_tokens: request.prompt.len(),
        ttft,
        prefill_stats,
        decode_steps,
        decode_time: decode_start.elapsed(),
        decode_stats: backend.stats() - decode_stats_start,
    })
}
