//! Live engine measurements, shared between the engine thread (which writes them) and the
//! server (which renders them as Prometheus text). Plain atomics; no locks on the hot path.

use std::sync::atomic::{AtomicU64, Ordering};

/// A cumulative histogram over fixed bucket bounds, in seconds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

/// Draft positions whose acceptance is counted apart (longer drafts count in the last).
pub const DRAFT_POSITIONS: usize = 8;

/// Latency buckets (seconds) for TTFT and inter-token latency.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, seconds: f64) {
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            if seconds <= *bound {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// `(upper bound, cumulative count)` per bucket, then the sum in seconds and the count.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let buckets = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(b, c)| (*b, c.load(Ordering::Relaxed)))
            .collect();
        (
            buckets,
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// Counters and gauges of the engine.
#[derive(Debug)]
pub struct EngineMetrics {
    /// Requests submitted and not yet admitted (counted as they are submitted).
    pub queue_depth: AtomicU64,
    /// Sequences being generated.
    pub running: AtomicU64,
    /// KV cache blocks held by sequences.
    pub kv_blocks_used: AtomicU64,
    /// KV cache blocks the prefix cache indexes (some may be held by sequences too).
    pub kv_blocks_cached: AtomicU64,
    /// KV cache blocks in the pool.
    pub kv_blocks_total: AtomicU64,
    /// State slots held by running sequences (one each; the hybrids keep their recurrent
    /// state there).
    pub state_slots_used: AtomicU64,
    /// Prompt tokens prefilled (recomputation after preemption included).
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens of finished requests taken from the prefix cache instead of computed.
    pub cached_prompt_tokens: AtomicU64,
    /// Finished requests that took any prompt tokens from the prefix cache.
    pub prefix_cache_hits: AtomicU64,
    /// Recurrent-state checkpoints taken (hybrid models).
    pub state_checkpoints_taken: AtomicU64,
    /// Checkpoints the prefix cache holds.
    pub state_checkpoints_cached: AtomicU64,
    /// Clients' session ids whose prefix eviction passes by.
    pub session_pins: AtomicU64,
    /// Cached KV blocks copied into a sequence's own block (a partly matching block).
    pub kv_block_copies: AtomicU64,
    /// Sequences that resumed from a checkpoint.
    pub state_restores: AtomicU64,
    /// Tokens those sequences did not recompute.
    pub state_restored_tokens: AtomicU64,
    /// Prefixes written to the session folder.
    pub session_spills: AtomicU64,
    /// Bytes of those files.
    pub session_spill_bytes: AtomicU64,
    /// Those files whose background write has finished (on disk, renamed into place).
    pub session_spill_writes: std::sync::Arc<AtomicU64>,
    /// Sequences that started from a session file.
    pub session_restores: AtomicU64,
    /// Tokens those sequences read from disk instead of computing.
    pub session_restored_tokens: AtomicU64,
    /// KV and state bytes those sequences copied from session files.
    pub session_restored_bytes: AtomicU64,
    /// Session files that could not be restored (deleted; the request recomputed).
    pub session_restore_failures: AtomicU64,
    /// Bytes in the session folder now.
    pub session_dir_bytes: AtomicU64,
    /// Bytes of free activation buffers the backend's pool keeps for reuse, after the last
    /// step.
    pub buffer_pool_free_bytes: AtomicU64,
    /// KV blocks the session folder's index knows now.
    pub session_index_blocks: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Draft tokens verified (speculative decoding).
    pub draft_tokens: AtomicU64,
    /// Draft tokens accepted.
    pub accepted_draft_tokens: AtomicU64,
    /// Drafts verified (a sequence's step with one or more draft tokens).
    pub drafts: AtomicU64,
    /// Draft tokens accepted by their position in the draft (the first, the second, ...).
    pub accepted_by_position: [AtomicU64; DRAFT_POSITIONS],
    /// Tokens run through forward passes.
    pub forward_tokens: AtomicU64,
    /// Steps that only decoded (every run its next token, with any draft tokens it
    /// verifies): the steps [`Metrics::decode_step_micros`] times.
    pub decode_steps: AtomicU64,
    /// Where those steps' time went, in microseconds: planning (drafting included), the
    /// forward pass (its read-back included), and taking the outputs.
    pub decode_step_micros: [AtomicU64; 3],
    /// Dispatches of those forward passes.
    pub dispatches: AtomicU64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: AtomicU64,
    /// Whether the engine thread is running.
    pub engine_alive: std::sync::atomic::AtomicBool,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens of a sequence.
    pub inter_token: Histogram,
    /// Time from arrival to the last token, of finished requests.
    pub e2e: Histogram,
    /// Requests that ended on a stop token.
    pub finished_stop: AtomicU64,
    /// Requests that ended on `max_tokens`.
    pub finished_length: AtomicU64,
    /// Requests that ended by the client going away, or a cancel.
    pub finished_abort: AtomicU64,
    /// Prompt tokens of finished requests, cached or computed (the prefix cache's queries).
    pub finished_prompt_tokens: AtomicU64,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            queue_depth: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_blocks_used: AtomicU64::new(0),
            kv_blocks_cached: AtomicU64::new(0),
            kv_blocks_total: AtomicU64::new(0),
            state_slots_used: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            state_checkpoints_taken: AtomicU64::new(0),
            state_checkpoints_cached: AtomicU64::new(0),
            session_pins: AtomicU64::new(0),
            kv_block_copies: AtomicU64::new(0),
            state_restores: AtomicU64::new(0),
            state_restored_tokens: AtomicU64::new(0),
            session_spills: AtomicU64::new(0),
            session_spill_bytes: AtomicU64::new(0),
            session_spill_writes: std::sync::Arc::default(),
            session_restores: AtomicU64::new(0),
            session_restored_tokens: AtomicU64::new(0),
            session_restored_bytes: AtomicU64::new(0),
            session_restore_failures: AtomicU64::new(0),
            session_dir_bytes: AtomicU64::new(0),
            buffer_pool_free_bytes: AtomicU64::new(0),
            session_index_blocks: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            draft_tokens: AtomicU64::new(0),
            accepted_draft_tokens: AtomicU64::new(0),
            drafts: AtomicU64::new(0),
            accepted_by_position: Default::default(),
            forward_tokens: AtomicU64::new(0),
            decode_steps: AtomicU64::new(0),
            decode_step_micros: std::array::from_fn(|_| AtomicU64::new(0)),
            dispatches: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            engine_alive: std::sync::atomic::AtomicBool::new(false),
            ttft: Histogram::new(LATENCY_BUCKETS),
            inter_token: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            finished_abort: AtomicU64::new(0),
            finished_prompt_tokens: AtomicU64::new(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let (buckets, sum, count) = h.snapshot();
        assert_eq!(buckets, vec![(0.1, 1), (1.0, 2)]);
        assert_eq!(count, 3);
        assert!((sum - 5.55).abs() < 1e-6);
    }
}
