//! Continuous batching: which sequences run in the next forward pass, and with how many tokens.
//!
//! Each step takes every running sequence: one decode row for those past their prompt, and a
//! prefill chunk for the others, prefill limited to a token budget so that long prompts do not
//! stall decoding. Blocks are granted per step, oldest sequence first; when the pool runs dry
//! the youngest running sequence is preempted by recompute (its blocks freed, its tokens kept,
//! re-queued at the front). There is no prefill or decode phase: a sequence simply has tokens
//! not yet in the cache. [`Scheduler::step`] returns a [`StepPlan`]; the engine runs it and
//! hands the logits back to [`Scheduler::finish_step`]. With a [`PrefixCache`], a sequence
//! starts from the longest cached prefix of its tokens, down to a token: shared whole blocks,
//! then a partly matching block copied into its own ([`StepPlan::block_copies`]); a sequence
//! that ends or is preempted leaves its computed blocks in the cache, which gives them back
//! when the pool runs short.
//!
//! For hybrid models the cache also keeps recurrent-state checkpoints, at exact tokens: at
//! the end of each prompt (the next turn usually re-sends the prompt and diverges where the
//! reply starts), where a prompt leaves the cached tree (a branch point), at each whole
//! block of a turn's output as it decodes, and at its last token when it ends. A prefill
//! chunk ends at such a point so that the state exists there; the copy into a checkpoint slot
//! is queued for the engine after the step ([`StepCounts::checkpoint_copies`]), and a
//! sequence that starts from a checkpoint gets a private copy in its own slot before its
//! first step ([`StepPlan::restores`]).

use std::collections::VecDeque;
use std::time::Instant;

use corral_backend::DispatchStats;
use corral_backend::sampling::{Filter, MAX_REDUCED_VOCAB};
use corral_model::{
    BlockId, BlockTable, LogitsWanted, RaggedBatch, SampledStep, SeqId, SlotId, TokenId,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::request::{EngineRequest, Event, Finished, RequestHandle, TokenEvent};
use crate::{
    Constraint, EvictedPrefix, FinishReason, KvBlockPool, PrefixCache, Sampler, StateSlotPool,
};

mod output;

/// Sessions on disk as the scheduler uses them: the engine implements it over its caches, so
/// that a cold prefix is written out when the cache evicts it and read back into a new
/// sequence's blocks (and state slot) at admission.
pub trait SessionStore {
    /// Writes an evicted prefix to disk if worth it; failures are the store's to log.
    fn spill(&mut self, prefix: &EvictedPrefix<'_>);
    /// Writes a cached prefix that stays cached, while the engine is idle, if worth it and
    /// the folder has room for it without dropping another file.
    fn write_ahead(&mut self, prefix: &EvictedPrefix<'_>);
    /// The longest spilled prefix of `tokens` of at most `max_tokens` tokens, if it holds more
    /// than `beyond` (what the cache gave already): its length and file, kept from the byte
    /// cap until [`SessionStore::load`] reads it.
    fn find(
        &mut self,
        tokens: &[u32],
        beyond: usize,
        max_tokens: usize,
    ) -> Option<(usize, std::path::PathBuf)>;
    /// Reads the spilled prefix at `path` into `blocks`, and its state into `slot` (hybrid
    /// models). On an error the file is deleted and nothing it held may be used.
    fn load(
        &mut self,
        path: &std::path::Path,
        blocks: &[corral_model::BlockId],
        slot: Option<SlotId>,
    ) -> Result<(), String>;
}

/// Limits of the scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_batch: usize,
    /// Most tokens a step computes, decode rows included (which always run).
    pub max_prefill_tokens: usize,
    /// How long a session's prefix is kept from eviction after its turn (with a session id).
    pub session_pin: std::time::Duration,
}

/// A sequence owned by the scheduler.
#[derive(Debug)]
struct Sequence {
    id: SeqId,
    /// Not yet admitted since it was added (a preempted sequence waits again, unqueued).
    queued: bool,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// The client's session id, if it gave one: its prefix is pinned when it ends.
    session: Option<String>,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// Tokens of `computed` in a block whose copy from the prefix cache is planned but not
    /// yet made (before the sequence's first step): not to be cached if it ends first.
    uncopied: usize,
    /// Prompt tokens taken from the prefix cache before its first token.
    cached: usize,
    table: BlockTable,
    /// Recurrent-state slot while running.
    slot: Option<SlotId>,
    /// Tokens computed at which a state checkpoint is to be taken (hybrids, prefill).
    checkpoint_at: Vec<usize>,
    /// State checkpoints taken, `(tokens covered, checkpoint slot)`, for the prefix cache.
    checkpoints: Vec<(usize, SlotId)>,
    /// Which of them is the output checkpoint (tokens covered), replaced as decode goes on.
    output_checkpoint: Option<usize>,
    sampler: Sampler,
    /// The grammar its output must match.
    constraint: Option<Constraint>,
    max_tokens: usize,
    max_context: usize,
    stop_token_ids: Vec<u32>,
    top_logprobs: Option<usize>,
    events: UnboundedSender<Event>,
    /// Whether its client ended it as a stop before going away.
    handle: RequestHandle,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Counts of the steps this sequence took part in, prefilling and decoding.
    prefill_stats: DispatchStats,
    decode_stats: DispatchStats,
    decode_steps: usize,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
struct PlannedRun {
    seq: SeqId,
    tokens: usize,
    /// Rows of logits it asks for (its last tokens'): one where it ends a prompt or decodes.
    logits: usize,
}

/// What the next forward pass runs: the batch, and which sequence each logits row belongs to.
#[derive(Debug)]
#[must_use]
pub struct StepPlan {
    /// The ragged batch for the model.
    pub batch: RaggedBatch,
    runs: Vec<PlannedRun>,
    /// State copies to make before the forward: `(sequence, checkpoint slot, its slot)`.
    pub restores: Vec<(SeqId, SlotId, SlotId)>,
    /// KV block copies to make before the forward: `(sequence, cached block, its block)`,
    /// a cached block's first tokens continuing the sequence's shared ones.
    pub block_copies: Vec<(SeqId, BlockId, BlockId)>,
}

/// A block copy planned for a sequence: `(sequence, cached block, its block)`.
type BlockCopy = (SeqId, BlockId, BlockId);

/// Waiting and running sequences, and the KV blocks they hold.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: KvBlockPool,
    slots: StateSlotPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
    preemptions: u64,
    prefix: Option<PrefixCache>,
    /// Queued requests that left the queue (first admitted, or cancelled while waiting)
    /// since [`Scheduler::take_departures`] last read them.
    departures: usize,
}

/// What a step did, for metrics.
#[derive(Clone, Debug, Default)]
pub struct StepCounts {
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Seconds from arrival to first token, of sequences that got their first token.
    pub ttft: Vec<f64>,
    /// Seconds since the previous token, of sequences that got a later token.
    pub inter_token: Vec<f64>,
    /// Sequences that ended, with their final event: the engine sends these after updating
    /// its metrics, so a client that sees the end also sees it counted.
    pub finished: Vec<(UnboundedSender<Event>, Finished)>,
    /// State copies to make before the next forward: `(running slot, checkpoint slot)`.
    pub checkpoint_copies: Vec<(SlotId, SlotId)>,
    /// Requests whose clients went away while they waited, never run.
    pub aborted: usize,
}

impl Scheduler {
    /// A scheduler over `pool`, with one recurrent-state slot per batch row.
    pub fn new(config: SchedulerConfig, pool: KvBlockPool) -> Self {
        Self {
            slots: StateSlotPool::new(config.max_batch),
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            preemptions: 0,
            prefix: None,
            departures: 0,
        }
    }

    /// Keeps computed blocks in a prefix cache for later sequences (models without recurrent
    /// state).
    pub fn with_prefix_cache(mut self) -> Self {
        self.prefix = Some(PrefixCache::new(self.pool.block_size()));
        self
    }

    /// Keeps computed blocks and recurrent-state checkpoints in a prefix cache (hybrid
    /// models): `checkpoints` state slots from `first_slot` on (after the running ones).
    pub fn with_state_checkpoints(mut self, first_slot: usize, checkpoints: usize) -> Self {
        self.prefix = Some(PrefixCache::with_checkpoints(
            self.pool.block_size(),
            StateSlotPool::range(first_slot, checkpoints),
        ));
        self
    }

    /// Tokens sequence `id` has computed (resumed ones: what it took from the cache).
    pub fn computed_tokens(&self, id: SeqId) -> usize {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map_or(0, |s| s.computed)
    }

    /// The prefix cache evicts by recency and prefill FLOPs saved per byte (`cost`).
    pub fn with_eviction_cost(mut self, cost: crate::EvictionCost) -> Self {
        self.prefix = self.prefix.map(|p| p.with_eviction_cost(cost));
        self
    }

    /// State checkpoints the prefix cache holds.
    pub fn cached_checkpoints(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::num_checkpoints)
    }

    /// Drops the checkpoint in `slot`, wherever it is held (its copy failed, so it must not
    /// be resumed from).
    pub fn forget_checkpoint(&mut self, slot: SlotId) {
        for seq in &mut self.running {
            if let Some(i) = seq.checkpoints.iter().position(|c| c.1 == slot) {
                seq.checkpoints.remove(i);
                if let Some(prefix) = &mut self.prefix {
                    prefix.release_checkpoint(slot);
                }
                return;
            }
        }
        if let Some(prefix) = &mut self.prefix {
            prefix.forget_checkpoint(slot);
        }
    }

    /// Session pins in force (clients' session ids whose prefix eviction passes by).
    pub fn session_pins(&self) -> usize {
        let now = Instant::now();
        self.prefix.as_ref().map_or(0, |p| p.num_pins(now))
    }

    /// KV blocks the prefix cache indexes (none without a cache).
    pub fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::num_blocks)
    }

    /// Recurrent-state slots held by running sequences.
    pub fn slots_in_use(&self) -> usize {
        self.slots.num_used()
    }

    /// KV blocks held by sequences (the cache's idle blocks excluded).
    pub fn blocks_in_use(&self) -> usize {
        let idle = self
            .prefix
            .as_ref()
            .map_or(0, |p| p.num_idle_blocks(&self.pool));
        self.pool.num_used() - idle
    }

    /// Queues a request. The caller has checked that its prompt plus `max_tokens` fits the
    /// cache and the context.
    pub fn add(&mut self, request: EngineRequest) {
        self.add_handled(request, RequestHandle::default());
    }

    /// [`Scheduler::add`], with the submitter's handle (which may end it as a stop).
    pub fn add_handled(&mut self, request: EngineRequest, handle: RequestHandle) {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id,
            queued: true,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            session: request.session,
            computed: 0,
            uncopied: 0,
            cached: 0,
            table: BlockTable::default(),
            slot: None,
            checkpoint_at: Vec::new(),
            checkpoints: Vec::new(),
            output_checkpoint: None,
            sampler: Sampler::new(request.params),
            constraint: request.constraint,
            max_tokens: request.max_tokens,
            max_context: request.max_context,
            stop_token_ids: request.stop_token_ids,
            top_logprobs: request.top_logprobs,
            events: request.events,
            handle,
            arrived: Instant::now(),
            first_token: None,
            last_token: None,
            prefill_stats: DispatchStats::default(),
            decode_stats: DispatchStats::default(),
            decode_steps: 0,
        });
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The block pool.
    pub fn pool(&self) -> &KvBlockPool {
        &self.pool
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Queued requests that have left the queue since the last call: the engine's count of
    /// waiting requests, which submissions add to, goes down by these.
    pub fn take_departures(&mut self) -> usize {
        std::mem::take(&mut self.departures)
    }

    /// Ends the sequences whose client has gone: those waiting are dropped (`aborted`), those
    /// running end as a step's finished ones do (their computed blocks cached, a hybrid's
    /// final state checkpointed), as stops where the client said so
    /// ([`RequestHandle::finish_as_stop`]), else as cancelled.
    pub fn retire_departed(&mut self) -> StepCounts {
        let mut counts = StepCounts::default();
        let before = self.waiting.len();
        let departures = &mut self.departures;
        self.waiting.retain(|s| {
            let gone = s.events.is_closed();
            *departures += usize::from(gone && s.queued);
            !gone
        });
        counts.aborted = before - self.waiting.len();
        let now = Instant::now();
        while let Some(index) = self.running.iter().position(|s| s.events.is_closed()) {
            let reason = self.running[index].handle.departed_reason();
            self.end(index, reason, now, &mut counts);
        }
        counts
    }

    /// Plans the next step; `None` when there is nothing to run.
    pub fn step(&mut self) -> Option<StepPlan> {
        self.step_with(None)
    }

    /// While idle: shows `store` the next cached prefix not yet shown (see
    /// [`PrefixCache::next_unwritten`]), so that the eviction that later needs its blocks
    /// does not copy them out on the admission path. False when there is none.
    pub fn write_ahead(&mut self, store: &mut dyn SessionStore) -> bool {
        let Some(prefix) = &mut self.prefix else {
            return false;
        };
        let Some((tokens, blocks, checkpoint)) = prefix.next_unwritten() else {
            return false;
        };
        store.write_ahead(&EvictedPrefix {
            tokens: &tokens,
            blocks: &blocks,
            checkpoint,
        });
        true
    }

    /// [`Scheduler::step`] with sessions on disk: evicted prefixes are shown to `store`, and
    /// a new sequence whose tokens extend a spilled prefix longer than its cached one starts
    /// from the spilled one (falling back to the cache and recompute if it cannot be read).
    pub fn step_with(&mut self, mut store: Option<&mut dyn SessionStore>) -> Option<StepPlan> {
        let mut restores = Vec::new();
        let mut copies: Vec<BlockCopy> = Vec::new();
        while self.running.len() < self.config.max_batch && !self.waiting.is_empty() {
            let Some(slot) = self.slots.acquire() else {
                break;
            };
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if std::mem::take(&mut seq.queued) {
                self.departures += 1;
            }
            seq.slot = Some(slot);
            if let Some(prefix) = &mut self.prefix
                && seq.table.blocks.is_empty()
            {
                // At least the last token is computed, for its logits.
                let bs = self.pool.block_size();
                let usable = seq.tokens.len() - 1;
                take_cached_prefix(
                    prefix,
                    &mut self.pool,
                    &mut seq,
                    slot,
                    &mut restores,
                    &mut copies,
                    store.as_deref_mut(),
                );
                if let Some(store) = store.as_deref_mut()
                    && let Some((len, path)) = store.find(&seq.tokens, seq.computed, usable)
                {
                    // The file holds the whole prefix: the cached blocks go back first (and
                    // may be evicted to make room), then are looked up again if it fails.
                    self.pool.release(&mut seq.table);
                    restores.retain(|r: &(SeqId, SlotId, SlotId)| r.0 != seq.id);
                    drop_copies(&mut copies, &mut self.pool, |c| c.0 == seq.id);
                    let need = len.div_ceil(bs);
                    if need > self.pool.num_free() {
                        evict(prefix, &mut self.pool, need, Some(&mut *store));
                    }
                    let mut table = BlockTable::default();
                    let hybrid = prefix.keeps_checkpoints();
                    if self.pool.grow(&mut table, len).is_ok()
                        && store
                            .load(&path, &table.blocks, hybrid.then_some(slot))
                            .is_ok()
                    {
                        seq.table = table;
                        seq.computed = len;
                        seq.uncopied = 0;
                        seq.checkpoint_at.retain(|&p| p > len);
                    } else {
                        self.pool.release(&mut table);
                        take_cached_prefix(
                            prefix,
                            &mut self.pool,
                            &mut seq,
                            slot,
                            &mut restores,
                            &mut copies,
                            Some(&mut *store),
                        );
                    }
                }
                // What the client's first token waited for; a re-admission after preemption
                // recomputes from the cache but does not change what is reported.
                if seq.first_token.is_none() {
                    seq.cached = seq.computed.min(seq.prompt_len);
                }
            }
            self.running.push(seq);
        }
        let mut budget = self.config.max_prefill_tokens.max(1);
        let mut runs = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            let remaining = seq.tokens.len() - seq.computed;
            let mut n = if remaining == 1 {
                1
            } else {
                remaining.min(budget)
            };
            // A chunk ends where a state checkpoint is to be taken.
            if let Some(&point) = seq
                .checkpoint_at
                .iter()
                .find(|&&p| p > seq.computed && p < seq.computed + n)
            {
                n = point - seq.computed;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            let need = seq.computed + n;
            let blocks = need.div_ceil(self.pool.block_size());
            if blocks > self.pool.num_blocks() {
                // More than the whole cache: preempting it would bring it back for ever.
                let mut seq = self.running.remove(i);
                let message = format!(
                    "the sequence needs {blocks} KV blocks ({need} tokens) and the cache has {}",
                    self.pool.num_blocks()
                );
                self.release(&mut seq);
                let _ = seq.events.send(Event::Failed(message));
                continue;
            }
            if let Some(prefix) = &mut self.prefix {
                // Cached blocks nobody holds go before any sequence is preempted.
                let short = need
                    .div_ceil(self.pool.block_size())
                    .saturating_sub(self.running[i].table.blocks.len());
                if short > self.pool.num_free() {
                    evict(prefix, &mut self.pool, short, store.as_deref_mut());
                }
            }
            if self.pool.grow(&mut self.running[i].table, need).is_err() {
                // Preempt the youngest sequence holding blocks (freeing them), or else this
                // one, which then waits at the front of the queue.
                let victim = (i + 1..self.running.len())
                    .rev()
                    .find(|&j| !self.running[j].table.blocks.is_empty())
                    .unwrap_or(i);
                self.preempt(victim);
                continue;
            }
            // Decode rows count too, so that a step is never more tokens than the budget
            // (the activation buffers sized for it serve every step) unless its decode rows
            // alone are.
            budget = budget.saturating_sub(n);
            let seq = &self.running[i];
            runs.push(PlannedRun {
                seq: seq.id,
                tokens: n,
                logits: usize::from(need == seq.tokens.len()),
            });
            i += 1;
        }
        // A restore is made before this step's forward even for a sequence without a run in
        // it (out of budget); a preempted sequence looks its prefix up again.
        restores.retain(|r: &(SeqId, SlotId, SlotId)| {
            self.running
                .iter()
                .any(|s| s.id == r.0 && s.slot == Some(r.2))
        });
        let running = &self.running;
        drop_copies(&mut copies, &mut self.pool, |c| {
            !running
                .iter()
                .any(|s| s.id == c.0 && s.table.blocks.contains(&c.2))
        });
        if runs.is_empty() {
            self.abandon(&restores, copies);
            return None;
        }
        let built = (|| {
            let mut batch = RaggedBatch::new(self.pool.block_size());
            for run in &runs {
                let Some(seq) = self.running.iter().find(|s| s.id == run.seq) else {
                    return Err(format!("sequence {} is not running", run.seq.0));
                };
                let ids: Vec<TokenId> = seq.tokens[seq.computed..seq.computed + run.tokens]
                    .iter()
                    .map(|&t| TokenId(t))
                    .collect();
                let wanted = if run.logits > 0 {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                };
                batch
                    .push_run(seq.id, &ids, seq.computed, &seq.table, wanted)
                    .map_err(|e| e.to_string())?;
                if let Some(slot) = seq.slot {
                    batch
                        .set_state_slot(seq.id, slot)
                        .map_err(|e| e.to_string())?;
                }
            }
            Ok(batch)
        })();
        let plan = StepPlan {
            batch: RaggedBatch::new(self.pool.block_size()),
            runs,
            restores,
            block_copies: copies,
        };
        match built {
            Ok(batch) => Some(StepPlan { batch, ..plan }),
            Err(e) => {
                // Not expected (the scheduler made every run), but never planned again and
                // again: the step's sequences end with the error.
                self.fail_step(plan, &format!("the step could not be built: {e}"));
                None
            }
        }
    }

    /// A plan that does not run: its copies give their holders back, and the sequences it
    /// was to restore state or copy a block for start over (what they counted is not there).
    fn abandon(&mut self, restores: &[(SeqId, SlotId, SlotId)], mut copies: Vec<BlockCopy>) {
        let ids: Vec<SeqId> = restores
            .iter()
            .map(|r| r.0)
            .chain(copies.iter().map(|c| c.0))
            .collect();
        drop_copies(&mut copies, &mut self.pool, |_| true);
        for id in ids {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                self.preempt(i);
            }
        }
    }

    /// Returns a sequence's KV blocks and state slot; with a prefix cache, its computed full
    /// blocks stay indexed there.
    fn release(&mut self, seq: &mut Sequence) {
        if let Some(prefix) = &mut self.prefix {
            // Checkpoints past what is computed (a failed step's) are not trusted.
            // A block still to be copied holds nothing yet.
            let computed = seq.computed - std::mem::take(&mut seq.uncopied);
            seq.output_checkpoint = None;
            let (kept, dropped): (Vec<_>, Vec<_>) =
                seq.checkpoints.drain(..).partition(|c| c.0 <= computed);
            let end = prefix.insert_with_checkpoints(
                &seq.tokens[..computed],
                &seq.table,
                &kept,
                &mut self.pool,
            );
            if let (Some(session), Some(end), false) =
                (&seq.session, end, self.config.session_pin.is_zero())
            {
                prefix.pin(session, end, Instant::now() + self.config.session_pin);
            }
            for (_, slot) in dropped {
                prefix.release_checkpoint(slot);
            }
        }
        self.pool.release(&mut seq.table);
        if let Some(slot) = seq.slot.take() {
            self.slots.release(slot);
        }
    }

    /// Frees sequence `index`'s blocks and puts it back at the front of the queue, to be
    /// recomputed from its tokens (prompt and generated so far).
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        if !seq.table.blocks.is_empty() {
            self.preemptions += 1;
        }
        self.release(&mut seq);
        seq.computed = 0;
        seq.checkpoint_at.clear();
        self.waiting.push_front(seq);
    }

    /// Ends every sequence of a failed step with `Failed` (those with a state restore planned
    /// too: it may not have been made), freeing its blocks.
    pub fn fail_step(&mut self, plan: StepPlan, message: &str) {
        let ids: Vec<SeqId> = plan
            .runs
            .iter()
            .map(|r| r.seq)
            .chain(plan.restores.iter().map(|r| r.0))
            .chain(plan.block_copies.iter().map(|c| c.0))
            .collect();
        let mut copies = plan.block_copies;
        drop_copies(&mut copies, &mut self.pool, |_| true);
        for id in ids {
            if let Some(index) = self.running.iter().position(|s| s.id == id) {
                let mut seq = self.running.remove(index);
                // The failed step's KV is not trusted: nothing of it is cached.
                seq.computed = 0;
                self.release(&mut seq);
                let _ = seq.events.send(Event::Failed(message.to_string()));
            }
        }
    }
}

/// Evicts cached blocks until `free` are free, writing what goes to `store` if there is one.
fn evict<'s>(
    prefix: &mut PrefixCache,
    pool: &mut KvBlockPool,
    free: usize,
    store: Option<&mut (dyn SessionStore + 's)>,
) {
    match store {
        Some(store) => prefix.evict_with(pool, free, Some(&mut |e| store.spill(e))),
        None => prefix.evict(pool, free),
    };
}

/// Drops the planned block copies that `gone` picks, returning the holder each took on its
/// cached block.
fn drop_copies(
    copies: &mut Vec<BlockCopy>,
    pool: &mut KvBlockPool,
    mut gone: impl FnMut(&BlockCopy) -> bool,
) {
    copies.retain(|c| {
        let drop = gone(c);
        if drop {
            pool.release(&mut BlockTable { blocks: vec![c.1] });
        }
        !drop
    });
}

/// Starts `seq` from its longest cached prefix: the shared blocks (a holder taken for each),
/// a partly matching block to copy into its own next block (a cached block evicted for it if
/// none is free, else the hit in whole blocks), and for a hybrid the checkpoint to restore
/// into `slot` and the points at which to take new ones.
fn take_cached_prefix<'s>(
    prefix: &mut PrefixCache,
    pool: &mut KvBlockPool,
    seq: &mut Sequence,
    slot: SlotId,
    restores: &mut Vec<(SeqId, SlotId, SlotId)>,
    copies: &mut Vec<BlockCopy>,
    store: Option<&mut (dyn SessionStore + 's)>,
) {
    let bs = pool.block_size();
    // At least the last token is computed, for its logits.
    let usable = seq.tokens.len() - 1;
    let mut hit = prefix.lookup_hit(&seq.tokens, usable, pool);
    if hit.copy.is_some() && pool.num_free() == 0 {
        evict(prefix, pool, 1, store);
    }
    let mut dst = None;
    if let Some((src, _)) = hit.copy {
        let mut table = BlockTable::default();
        if pool.grow(&mut table, 1).is_ok() {
            dst = table.blocks.first().copied();
        } else {
            pool.release(&mut hit.table);
            pool.release(&mut BlockTable { blocks: vec![src] });
            hit = prefix.lookup_whole_blocks(&seq.tokens, usable, pool);
        }
    }
    seq.table = std::mem::take(&mut hit.table);
    seq.computed = seq.table.blocks.len() * bs;
    seq.uncopied = 0;
    if let (Some((src, used)), Some(dst)) = (hit.copy, dst) {
        seq.table.blocks.push(dst);
        copies.push((seq.id, src, dst));
        seq.computed += used;
        seq.uncopied = used;
    }
    if prefix.keeps_checkpoints() {
        if let Some(checkpoint) = hit.checkpoint {
            restores.push((seq.id, checkpoint, slot));
        }
        // Where the prompt leaves the cached tree (unless within a block of where it resumes:
        // a checkpoint there would save little and cost the prefill a chunk of its own), and
        // its end.
        let branch = hit.matched_tokens;
        let points = [
            (branch >= seq.computed + bs).then_some(branch),
            Some(seq.prompt_len),
        ];
        seq.checkpoint_at = points
            .into_iter()
            .flatten()
            .filter(|&p| p > seq.computed)
            .collect();
        seq.checkpoint_at.sort_unstable();
        seq.checkpoint_at.dedup();
    }
}

/// After a step: a hybrid sequence that has just computed a planned checkpoint point, or the
/// next whole block of its output (replacing its previous output checkpoint), gets a
/// checkpoint slot and a copy of its state queued into it.
fn take_checkpoint(
    prefix: &mut PrefixCache,
    seq: &mut Sequence,
    slot: SlotId,
    block_size: usize,
    counts: &mut StepCounts,
) {
    let at = seq.computed;
    if !prefix.keeps_checkpoints() || at == 0 {
        return;
    }
    let planned = seq.checkpoint_at.contains(&at);
    let output = at > seq.prompt_len && at.is_multiple_of(block_size);
    if !planned && !output {
        return;
    }
    queue_checkpoint(prefix, seq, slot, output && !planned, counts);
}

/// Takes a checkpoint slot and queues a copy of `slot`'s state (after `seq.computed`
/// tokens) into it; as the output checkpoint, in place of the previous one.
fn queue_checkpoint(
    prefix: &mut PrefixCache,
    seq: &mut Sequence,
    slot: SlotId,
    output: bool,
    counts: &mut StepCounts,
) {
    let at = seq.computed;
    let Some(dst) = prefix.take_checkpoint_slot() else {
        return;
    };
    if output
        && let Some(old_at) = seq.output_checkpoint.replace(at)
        && let Some(i) = seq.checkpoints.iter().position(|c| c.0 == old_at)
    {
        let (_, old) = seq.checkpoints.remove(i);
        prefix.release_checkpoint(old);
    }
    seq.checkpoints.push((at, dst));
    counts.checkpoint_copies.push((slot, dst));
}

/// A hybrid sequence that ends past its prompt gets a checkpoint at its last computed token
/// (replacing its previous output checkpoint): the next turn re-sends all of it.
fn take_final_checkpoint(
    prefix: &mut PrefixCache,
    seq: &mut Sequence,
    slot: SlotId,
    counts: &mut StepCounts,
) {
    let at = seq.computed;
    if !prefix.keeps_checkpoints()
        || at <= seq.prompt_len
        || seq.checkpoints.iter().any(|c| c.0 == at)
    {
        return;
    }
    queue_checkpoint(prefix, seq, slot, true, counts);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    fn request(tokens: &[u32], max_tokens: usize) -> EngineRequest {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        EngineRequest {
            prompt: tokens.to_vec(),
            params: SamplingParams::default(),
            max_tokens,
            max_context: 4096,
            stop_token_ids: Vec::new(),
            top_logprobs: None,
            events,
            session: None,
            constraint: None,
        }
    }

    fn config(max_batch: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_batch,
            max_prefill_tokens: 64,
            session_pin: std::time::Duration::ZERO,
        }
    }

    /// Decode rows count against the step's token budget: a prefill beside them takes what
    /// they leave, so no step is larger than the budget the workspace was sized for (unless
    /// its decode rows alone are, which always run).
    #[test]
    fn decode_rows_and_a_prefill_share_the_step_budget() {
        let mut s = Scheduler::new(config(4), KvBlockPool::new(64, 16));
        let mut receivers = Vec::new();
        let long: Vec<u32> = (0..300).collect();
        for (prompt, max_tokens) in [(&[1, 2, 3][..], 8), (&[4, 5], 8), (&[6], 8), (&long, 4)] {
            let (events, rx) = tokio::sync::mpsc::unbounded_channel();
            receivers.push(rx);
            s.add(EngineRequest {
                events,
                ..request(prompt, max_tokens)
            });
        }
        let vocab = 16;
        let mut shared = 0;
        for _ in 0..40 {
            let Some(plan) = s.step() else { break };
            let tokens: usize = plan.runs.iter().map(|r| r.tokens).sum();
            let decode = plan.runs.iter().filter(|r| r.tokens == 1).count();
            assert!(
                tokens <= 64,
                "a step of {tokens} tokens over a budget of 64"
            );
            // A prefill chunk that does not end its prompt takes what the decode rows leave.
            let mid_prompt = plan.runs.iter().any(|r| r.tokens > 1 && r.logits == 0);
            if decode > 0 && mid_prompt {
                shared += 1;
                assert_eq!(
                    tokens, 64,
                    "a prefill beside decode rows takes what they leave"
                );
            }
            let rows = plan.runs.iter().filter(|r| r.logits > 0).count();
            let mut logits = vec![0.0f32; rows * vocab];
            let _ = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
        }
        assert!(shared > 0, "no step had decode rows beside a prefill");
    }

    /// A constrained sequence samples only what its grammar allows, whatever its logits
    /// favour, and ends when the document is complete; a free one in the same steps samples
    /// its logits' favourite as before.
    #[test]
    fn a_constrained_sequence_follows_its_grammar_beside_a_free_one() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/tiny-qwen3-moe");
        let tok =
            crate::Tokenizer::from_file(&std::path::Path::new(dir).join("tokenizer.json")).unwrap();
        let grammar = crate::Grammar::JsonSchema(serde_json::json!({"enum": ["yes", "no!"]}));
        let constraint = tok
            .grammar_compiler(&[])
            .unwrap()
            .compile(&grammar)
            .unwrap();
        let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4));
        let (events_a, mut rx_a) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events: events_a,
            constraint: Some(constraint),
            ..request(&[1, 2, 3], 16)
        });
        let (events_b, mut rx_b) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events: events_b,
            ..request(&[4, 5, 6], 3)
        });
        let (vocab, favourite) = (1600, 7);
        for _ in 0..20 {
            let Some(plan) = s.step() else { break };
            let rows = plan.runs.iter().filter(|r| r.logits > 0).count();
            let mut logits = vec![0.0f32; rows * vocab];
            for row in 0..rows {
                logits[row * vocab + favourite] = 10.0;
                // Among what the grammar allows, "n" stands out.
                let n = tok.encode("n").unwrap()[0] as usize;
                logits[row * vocab + n] = 5.0;
            }
            let counts = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
            // As the engine does: the end goes to the request's channel.
            for (events, finished) in counts.finished {
                let _ = events.send(Event::Finished(finished));
            }
        }
        let drain = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>| {
            let (mut ids, mut end) = (Vec::new(), None);
            while let Ok(event) = rx.try_recv() {
                match event {
                    Event::Token(t) => ids.push(t.id),
                    Event::Finished(f) => end = Some(f),
                    Event::Failed(e) => panic!("{e}"),
                }
            }
            (ids, end.expect("finished"))
        };
        let (ids, end) = drain(&mut rx_a);
        assert_eq!(tok.decode(&ids).unwrap(), "\"no!\"");
        assert_eq!(end.reason, FinishReason::Stop);
        assert!(end.constraint.is_some_and(|c| c.masks == ids.len()));
        let (ids, end) = drain(&mut rx_b);
        assert_eq!(ids, [favourite as u32; 3]);
        assert_eq!(end.reason, FinishReason::Length);
        assert!(s.is_idle());
    }

    /// A request whose prompt needs more blocks than the whole cache fails at once (before,
    /// it was preempted and re-admitted for ever); the others run.
    #[test]
    fn a_sequence_larger_than_the_whole_cache_fails() {
        let mut s = Scheduler::new(config(2), KvBlockPool::new(4, 4));
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            ..request(&(0..17).collect::<Vec<u32>>(), 1)
        });
        s.add(request(&[1, 2, 3], 1));
        let plan = s.step().expect("the small request runs");
        assert_eq!(plan.runs.len(), 1);
        match rx.try_recv() {
            Ok(Event::Failed(message)) => assert!(message.contains("5 KV blocks"), "{message}"),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    /// A step whose batch cannot be built fails its sequences instead of being planned again
    /// and again (the engine loop spun on it).
    #[test]
    fn a_step_that_cannot_be_built_fails_its_sequences() {
        let mut s = Scheduler::new(config(2), KvBlockPool::new(8, 4));
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            ..request(&[1, 2, 3], 1)
        });
        s.add(request(&[4, 5, 6], 1));
        // Two sequences under one id: the batch refuses the second run.
        let id = s.waiting[0].id;
        s.waiting[1].id = id;
        assert!(s.step().is_none());
        assert!(matches!(rx.try_recv(), Ok(Event::Failed(_))));
        assert!(s.is_idle(), "the failed sequences are gone");
        assert_eq!(s.pool().num_free(), 8, "their blocks are free");
    }

    /// A sequence that starts from a partly matching cached block and is preempted before
    /// its first step (so before the copy into its own block is made) leaves only what it
    /// really holds in the cache: its own, never written, block is not indexed.
    #[test]
    fn a_block_whose_copy_was_never_made_is_not_cached() {
        let config = SchedulerConfig {
            max_batch: 2,
            max_prefill_tokens: 64,
            session_pin: std::time::Duration::ZERO,
        };
        let mut s = Scheduler::new(config, KvBlockPool::new(8, 4)).with_prefix_cache();
        // A: two whole blocks and a tail of 2 cached when it ends.
        s.add(request(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1));
        let plan = s.step().unwrap();
        let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
        assert_eq!(s.cached_blocks(), 3);
        // B shares the first block and 2 ids of the second (a copy into a block of its
        // own), but needs more blocks than the pool has: it fails in the same step.
        let b: Vec<u32> = [1, 2, 3, 4, 5, 6].into_iter().chain(90..120).collect();
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            ..request(&b, 1)
        });
        assert!(s.step().is_none());
        assert!(matches!(rx.try_recv(), Ok(Event::Failed(_))));
        // A's blocks stay; B's never-written block is not a tail [5, 6].
        assert_eq!(s.cached_blocks(), 3);
    }

    /// With every block of the pool cached (a warm server), a partly matching block is still
    /// copied: a cached block nobody holds is evicted for the copy.
    #[test]
    fn a_full_pool_makes_room_for_the_copy() {
        let config = SchedulerConfig {
            max_batch: 2,
            max_prefill_tokens: 64,
            session_pin: std::time::Duration::ZERO,
        };
        let mut s = Scheduler::new(config, KvBlockPool::new(4, 4)).with_prefix_cache();
        let a: Vec<u32> = (1..=13).collect();
        s.add(request(&a, 1));
        let plan = s.step().unwrap();
        let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
        assert_eq!(
            s.cached_blocks(),
            4,
            "the whole pool: three blocks and a tail"
        );
        s.add(request(&[1, 2, 3, 4, 5, 6, 99, 98], 1));
        let plan = s.step().unwrap();
        assert_eq!(
            plan.block_copies.len(),
            1,
            "the second block's first 2 ids, copied"
        );
        let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
    }
}
