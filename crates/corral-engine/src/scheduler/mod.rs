//! Continuous batching: which sequences run in the next forward pass, and with how many tokens.
//!
//! Each step takes every running sequence: one decode row for those past their prompt (with
//! the tokens a [`Drafter`] proposes after it, to verify in the same run), and a prefill
//! chunk for the others, prefill limited to a token budget so that long prompts do not stall
//! decoding. Blocks are granted per step, oldest sequence first; when the pool runs dry the
//! youngest running sequence is preempted by recompute (its blocks freed, its tokens kept,
//! re-queued at the front). There is no prefill or decode phase: a sequence simply has tokens
//! not yet in the cache. [`Scheduler::step`] returns a [`StepPlan`]; the engine runs it and
//! hands the logits back to [`Scheduler::finish_step`] (the output step, `output.rs`).
//!
//! What a sequence holds in the cache is the [`KvManager`]'s: its blocks, state slot, the
//! prefix cache with its hybrid state checkpoints (a sequence starts from the longest cached
//! prefix of its tokens and leaves its computed blocks there when it ends), and sessions on
//! disk. The scheduler is policy: admission, the token budget, chunk ends at checkpoint
//! points, preemption.

use std::collections::VecDeque;
use std::time::Instant;

use corral_backend::DispatchStats;
use corral_backend::sampling::{Filter, MAX_REDUCED_VOCAB};
use corral_model::{LogitsWanted, RaggedBatch, SampledStep, SeqId, SlotId, TokenId};
use tokio::sync::mpsc::UnboundedSender;

use crate::kv::RestoreId;
use crate::kv::manager::{Copies, KvManager, NoGrant, SeqKv};
use crate::request::{EngineRequest, Event, Finished, RequestHandle, TokenEvent};
use crate::{Constraint, FinishReason, KvBlockPool, Sampler, SessionStore};

mod draft_lengths;
mod output;

use draft_lengths::{Acceptance, StepCosts};

/// Proposes the tokens that may follow a sequence, for the target model to verify in one
/// run (the model's MTP head, prompt lookup, a draft model).
pub trait Drafter: Send {
    /// Up to `max` tokens that may follow `tokens`; fewer or none where it has no guess.
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32>;
    /// [`Drafter::propose`] for each of `requests` (`(seq, tokens, max)`), in order: in one
    /// pass for all where the drafter batches them (an MTP head runs all sequences' rows a
    /// draft position at once), else each in turn.
    fn propose_many(&mut self, requests: &[(SeqId, &[u32], usize)]) -> Vec<Vec<u32>> {
        requests
            .iter()
            .map(|&(seq, tokens, max)| self.propose(seq, tokens, max))
            .collect()
    }
    /// Sequence `seq` has ended or left the batch: what the drafter keeps for it may go.
    fn forget(&mut self, _seq: SeqId) {}
    /// Whether it reads the model's final hidden state of every token a step computes
    /// ([`Drafter::observe`]): an MTP head does.
    fn wants_hidden(&self) -> bool {
        false
    }
    /// The model's final hidden states (after its final norm) of the tokens a step computed
    /// for `seq`, from position `first`, `[tokens, hidden]` row-major. Rows past the tokens
    /// the step accepted are a rejected draft's, replaced by the next step's.
    fn observe(&mut self, _seq: SeqId, _first: usize, _hidden: &[f32]) {}
}

/// Speculative decoding's settings: the drafter, the most tokens a step verifies for a
/// sequence, and the most running sequences at which drafts are still proposed (verifying
/// drafts stops paying once a step has enough rows of its own).
pub struct Speculation {
    /// What proposes the drafts.
    pub drafter: Box<dyn Drafter>,
    /// Most draft tokens a sequence's step verifies.
    pub max_tokens: usize,
    /// Most running sequences at which sequences draft.
    pub max_running: usize,
    /// Whether each sequence's draft length is chosen by cost, from 0 to `max_tokens`: the
    /// most expected tokens a second by its recent acceptance and the engine's measured
    /// step times (`draft_lengths.rs`), else always `max_tokens`.
    pub adaptive: bool,
    /// A benchmark's stand-in for a drafter that agrees with the model: each draft token is
    /// taken with this probability whatever the model samples (the output is then not the
    /// model's). For synthetic weights, whose drafts mean nothing, to time speculation at a
    /// stated acceptance.
    pub forced_acceptance: Option<f64>,
    /// How a hybrid's recurrent state goes back to the last accepted token after a
    /// rejection: kept after each draft position during the verify and the accepted one
    /// taken (true), or snapshotted before it and the accepted tokens computed again.
    pub keep_states: bool,
}

/// Most sequences whose verify steps keep a hybrid's state after each draft position at
/// once (each keeps one state a draft token: tens of MB a state at full size); others
/// snapshot and compute their accepted tokens again.
const MAX_KEPT_STATE_GROUPS: usize = 8;

/// The groups of kept states an engine of `max_batch` sequences, drafting while at most
/// `max_running` run, sets aside for a hybrid model (for memory plans made before the
/// drafter).
pub fn kept_state_groups(max_batch: usize, max_running: usize) -> usize {
    max_batch.min(max_running).min(MAX_KEPT_STATE_GROUPS)
}

impl Speculation {
    /// `drafter` proposing up to `max_tokens` tokens a step, whatever the batch.
    pub fn new(drafter: Box<dyn Drafter>, max_tokens: usize) -> Self {
        Self {
            drafter,
            max_tokens,
            max_running: usize::MAX,
            adaptive: true,
            forced_acceptance: None,
            keep_states: true,
        }
    }

    /// Hybrids roll a rejected draft back by a snapshot and computing the accepted tokens
    /// again ([`Speculation::keep_states`] off): the alternative, for measuring.
    pub fn replaying(self) -> Self {
        Self {
            keep_states: false,
            ..self
        }
    }

    /// The groups of kept states (of [`Speculation::max_tokens`] slots each) that an engine
    /// of `max_batch` sequences sets aside for a hybrid model; 0 when it snapshots instead.
    pub fn kept_state_groups(&self, max_batch: usize) -> usize {
        if !self.keep_states {
            return 0;
        }
        kept_state_groups(max_batch, self.max_running)
    }

    /// Every draft `max_tokens` long, whatever is accepted.
    pub fn fixed(self) -> Self {
        Self {
            adaptive: false,
            ..self
        }
    }

    /// Drafts only while at most `max_running` sequences run.
    pub fn up_to_running(self, max_running: usize) -> Self {
        Self {
            max_running,
            ..self
        }
    }

    /// Takes each draft token with probability `rate` whatever the model samples
    /// ([`Speculation::forced_acceptance`]): for benchmarks only.
    pub fn forcing_acceptance(self, rate: f64) -> Self {
        Self {
            forced_acceptance: Some(rate.clamp(0.0, 1.0)),
            ..self
        }
    }
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
    /// What it holds in the cache.
    kv: SeqKv,
    /// Tokens proposed to follow `tokens`, verified by the planned step.
    draft: Vec<u32>,
    /// Its recent acceptance, which chooses its draft lengths where they adapt.
    acceptance: Acceptance,
    /// Prompt tokens taken from the prefix cache before its first token.
    cached: usize,
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
    /// Draft tokens verified for it, and accepted.
    drafted: (usize, usize),
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens it may still add: to `max_tokens` and to the context.
    fn room(&self) -> usize {
        (self.max_tokens.saturating_sub(self.generated()))
            .min(self.max_context.saturating_sub(self.tokens.len()))
    }
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
struct PlannedRun {
    seq: SeqId,
    tokens: usize,
    /// Rows of logits it asks for (its last tokens'): one where it ends a prompt or decodes,
    /// one more per draft token it verifies.
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
    pub block_copies: Vec<(SeqId, corral_model::BlockId, corral_model::BlockId)>,
    /// State copies to make after the restores: `(sequence, from slot, to slot)`, a running
    /// state's snapshot before a draft is verified, or its roll-back after one was rejected.
    pub state_copies: Vec<(SeqId, SlotId, SlotId)>,
}

impl StepPlan {
    /// Whether every run of the step is a sequence's next token (with any draft tokens it
    /// verifies): no prompt tokens.
    pub fn decodes_only(&self) -> bool {
        self.runs.iter().all(|r| r.tokens == r.logits)
    }

    /// The step's sequences, and the draft tokens one of them verifies on average
    /// (rounded).
    pub fn decode_shape(&self) -> (usize, usize) {
        let drafts: usize = self.runs.iter().map(|r| r.logits.saturating_sub(1)).sum();
        let runs = self.runs.len().max(1);
        (self.runs.len(), (drafts + runs / 2) / runs)
    }
}

/// Waiting and running sequences; the cache they hold is the KV manager's.
pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    next_id: u64,
    preemptions: u64,
    /// Queued requests that left the queue (first admitted, or cancelled while waiting)
    /// since [`Scheduler::take_departures`] last read them.
    departures: usize,
    /// Copies the last step's output left for the next forward (roll-backs).
    pending: Copies,
    /// Drafts for decoding sequences, and most tokens a draft.
    drafter: Option<(Box<dyn Drafter>, usize)>,
    /// Most running sequences at which drafts are proposed.
    draft_max_running: usize,
    /// A forced acceptance rate and its random stream ([`Speculation::forced_acceptance`]).
    forced_acceptance: Option<(f64, crate::sampler::SplitMix64)>,
    /// Whether draft lengths follow acceptance ([`Speculation::adaptive`]).
    adaptive_drafts: bool,
    /// Decode steps' measured time by their sequences (index) and the draft tokens one
    /// verified, which chooses adaptive draft lengths.
    step_costs: Vec<StepCosts>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("kv", &self.kv)
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("drafter", &self.drafter.as_ref().map(|d| d.1))
            .finish_non_exhaustive()
    }
}

/// What a step did, for metrics.
#[derive(Clone, Debug, Default)]
pub struct StepCounts {
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Draft tokens verified.
    pub draft_tokens: usize,
    /// Draft tokens accepted.
    pub accepted_tokens: usize,
    /// Drafts verified.
    pub drafts: usize,
    /// Draft tokens accepted by position in their draft.
    pub accepted_by_position: [usize; crate::metrics::DRAFT_POSITIONS],
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
            kv: KvManager::new(pool, config.max_batch, config.session_pin),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            preemptions: 0,
            departures: 0,
            pending: Copies::default(),
            drafter: None,
            draft_max_running: usize::MAX,
            forced_acceptance: None,
            adaptive_drafts: false,
            step_costs: Vec::new(),
        }
    }

    /// Keeps computed blocks in a prefix cache for later sequences (models without recurrent
    /// state).
    pub fn with_prefix_cache(mut self) -> Self {
        self.kv = self.kv.with_prefix_cache();
        self
    }

    /// Keeps computed blocks and recurrent-state checkpoints in a prefix cache (hybrid
    /// models): `checkpoints` state slots from `first_slot` on (after the running ones).
    pub fn with_state_checkpoints(mut self, first_slot: usize, checkpoints: usize) -> Self {
        self.kv = self.kv.with_state_checkpoints(first_slot, checkpoints);
        self
    }

    /// The model keeps recurrent state (a hybrid without the prefix cache's checkpoints): a
    /// draft's rejection rolls it back to a snapshot, taken in one of `snapshot_slots` slots
    /// after the running ones.
    pub fn with_recurrent_state(mut self, snapshot_slots: usize) -> Self {
        self.kv = self.kv.with_recurrent_state(snapshot_slots);
        self
    }

    /// Verify steps keep a hybrid's state after each draft position in `groups` groups of
    /// `group_len` consecutive state slots from `first_slot` on, and a rejection takes the
    /// state at the last accepted token from there (sequences without a free group snapshot
    /// and compute their accepted tokens again).
    pub fn with_kept_states(mut self, first_slot: usize, groups: usize, group_len: usize) -> Self {
        self.kv = self.kv.with_kept_states(first_slot, groups, group_len);
        self
    }

    /// The prefix cache evicts by recency and prefill FLOPs saved per byte (`cost`).
    pub fn with_eviction_cost(mut self, cost: crate::EvictionCost) -> Self {
        self.kv = self.kv.with_eviction_cost(cost);
        self
    }

    /// Decoding sequences verify up to `max_tokens` tokens `drafter` proposes in each step.
    pub fn with_drafter(mut self, drafter: Box<dyn Drafter>, max_tokens: usize) -> Self {
        self.drafter = (max_tokens > 0).then_some((drafter, max_tokens));
        self
    }

    /// Sequences draft only while at most `max_running` run.
    pub fn with_draft_limit(mut self, max_running: usize) -> Self {
        self.draft_max_running = max_running;
        self
    }

    /// Speculative decoding as `speculation` sets it: its drafter, draft lengths, running
    /// limit and any forced acceptance.
    pub fn with_speculation(self, speculation: Speculation) -> Self {
        let mut scheduler = self
            .with_drafter(speculation.drafter, speculation.max_tokens)
            .with_draft_limit(speculation.max_running);
        scheduler.adaptive_drafts = speculation.adaptive;
        match speculation.forced_acceptance {
            Some(rate) => scheduler.with_forced_acceptance(rate),
            None => scheduler,
        }
    }

    /// Each sequence's draft length is chosen by cost ([`Speculation::adaptive`]).
    pub fn with_adaptive_drafts(mut self) -> Self {
        self.adaptive_drafts = true;
        self
    }

    /// Takes the time of a step that only decoded, `micros` from planning to its outputs,
    /// of `sequences` verifying `drafts` tokens each ([`StepPlan::decode_shape`]): what
    /// adaptive draft lengths weigh their expected tokens against, at that many sequences.
    pub fn observe_decode_step(&mut self, (sequences, drafts): (usize, usize), micros: f64) {
        if self.step_costs.len() <= sequences {
            self.step_costs.resize(sequences + 1, StepCosts::default());
        }
        self.step_costs[sequences].observe(drafts, micros);
    }

    /// Each draft token is taken with probability `rate` whatever the model samples
    /// ([`Speculation::forced_acceptance`]); the draws are seeded, so runs repeat.
    pub fn with_forced_acceptance(mut self, rate: f64) -> Self {
        self.forced_acceptance = Some((rate, crate::sampler::SplitMix64(0x5EED)));
        self
    }

    /// Whether the drafter reads every computed token's hidden state: the step runs
    /// [`corral_model::Model::forward_with_all_hidden`] and hands them to
    /// [`Scheduler::observe_hidden`]. Not while more sequences run than draft: a sequence
    /// that drafts again later is drafted from the rows seen from then on.
    pub fn drafter_wants_hidden(&self) -> bool {
        self.running.len() <= self.draft_max_running
            && self.drafter.as_ref().is_some_and(|d| d.0.wants_hidden())
    }

    /// Hands the drafter the hidden states of `plan`'s tokens (`[tokens, width]`, in batch
    /// order), run by run.
    pub fn observe_hidden(&mut self, plan: &StepPlan, hidden: &[f32], width: usize) {
        let Some((drafter, _)) = &mut self.drafter else {
            return;
        };
        let mut row = 0;
        for run in plan.batch.runs() {
            let rows = hidden.get(row * width..(row + run.len) * width);
            if let Some(rows) = rows {
                drafter.observe(run.seq_id, run.first_position, rows);
            }
            row += run.len;
        }
    }

    /// Tokens sequence `id` has computed (resumed ones: what it took from the cache).
    pub fn computed_tokens(&self, id: SeqId) -> usize {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map_or(0, |s| s.kv.computed)
    }

    /// State checkpoints the prefix cache holds.
    pub fn cached_checkpoints(&self) -> usize {
        self.kv.cached_checkpoints()
    }

    /// Drops the checkpoint in `slot`, wherever it is held (its copy failed, so it must not
    /// be resumed from).
    pub fn forget_checkpoint(&mut self, slot: SlotId) {
        for seq in &mut self.running {
            if self.kv.forget_held_checkpoint(&mut seq.kv, slot) {
                return;
            }
        }
        self.kv.forget_cached_checkpoint(slot);
    }

    /// Session pins in force (clients' session ids whose prefix eviction passes by).
    pub fn session_pins(&self) -> usize {
        self.kv.session_pins()
    }

    /// KV blocks the prefix cache indexes (none without a cache).
    pub fn cached_blocks(&self) -> usize {
        self.kv.cached_blocks()
    }

    /// Recurrent-state slots held by running sequences.
    pub fn slots_in_use(&self) -> usize {
        self.kv.slots_in_use()
    }

    /// KV blocks held by sequences (the cache's idle blocks excluded).
    pub fn blocks_in_use(&self) -> usize {
        self.kv.blocks_in_use()
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
            kv: SeqKv::default(),
            draft: Vec::new(),
            acceptance: Acceptance::default(),
            cached: 0,
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
            drafted: (0, 0),
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
        self.kv.pool()
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

    /// While idle: shows `store` the next cached prefix not yet written, so that the
    /// eviction that later needs its blocks does not copy them out on the admission path.
    /// False when there is none.
    pub fn write_ahead(&mut self, store: &mut dyn SessionStore) -> bool {
        self.kv.write_ahead(store)
    }

    /// [`Scheduler::step`] with sessions on disk: evicted prefixes are shown to `store`, and
    /// a new sequence whose tokens extend a spilled prefix longer than its cached one starts
    /// from the spilled one (falling back to the cache and recompute if it cannot be read).
    pub fn step_with(&mut self, mut store: Option<&mut dyn SessionStore>) -> Option<StepPlan> {
        self.kv.begin_step();
        // Roll-backs the last step left are made before this one's forward.
        let mut copies = std::mem::take(&mut self.pending);
        for seq in &mut self.running {
            seq.kv.state_ahead = false;
        }
        self.admit(&mut copies, store.as_deref_mut());
        if let Some(store) = store.as_deref_mut() {
            self.poll_restores(&mut copies, store);
        }
        let runs = self.plan_runs(&mut copies, store);
        // A restore is made before this step's forward even for a sequence without a run in
        // it (out of budget); a preempted sequence looks its prefix up again.
        let running = &self.running;
        let holds = |id: SeqId, slot: SlotId| {
            running
                .iter()
                .any(|s| s.id == id && s.kv.slot == Some(slot))
        };
        copies.restores.retain(|r| holds(r.0, r.2));
        copies
            .states
            .retain(|c| running.iter().any(|s| s.id == c.0 && s.kv.slot.is_some()));
        self.kv.drop_copies(&mut copies.blocks, |c| {
            !running
                .iter()
                .any(|s| s.id == c.0 && s.kv.table.blocks.contains(&c.2))
        });
        if runs.is_empty() {
            self.abandon(copies);
            return None;
        }
        let built = self.build_batch(&runs);
        let plan = StepPlan {
            batch: RaggedBatch::new(self.kv.block_size()),
            runs,
            restores: copies.restores,
            block_copies: copies.blocks,
            state_copies: copies.states,
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

    /// Admits waiting sequences while the batch has room and a state slot is free, each
    /// starting from what the cache (or `store`) holds of its tokens.
    fn admit<'s>(&mut self, copies: &mut Copies, mut store: Option<&mut (dyn SessionStore + 's)>) {
        while self.running.len() < self.config.max_batch && !self.waiting.is_empty() {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if !self.kv.acquire_slot(&mut seq.kv) {
                self.waiting.push_front(seq);
                break;
            }
            if std::mem::take(&mut seq.queued) {
                self.departures += 1;
            }
            self.kv.admit(
                seq.id,
                &mut seq.kv,
                &seq.tokens,
                seq.prompt_len,
                copies,
                store.as_deref_mut(),
            );
            // What the client's first token waited for; a re-admission after preemption
            // recomputes from the cache but does not change what is reported.
            if seq.first_token.is_none() {
                seq.cached = seq.kv.computed.min(seq.prompt_len);
            }
            self.running.push(seq);
        }
    }

    /// Moves the restores from session files on: a sequence whose restore ended runs from
    /// its tokens (or, where the file failed, from the cache); the store drops the reads of
    /// sequences that went away.
    fn poll_restores<'s>(&mut self, copies: &mut Copies, store: &mut (dyn SessionStore + 's)) {
        let ids: Vec<RestoreId> = self
            .running
            .iter()
            .filter_map(|s| s.kv.restoring.map(|r| r.1))
            .collect();
        store.keep_restores(&ids);
        for seq in &mut self.running {
            if seq.kv.restoring.is_some()
                && self.kv.poll_restore(
                    seq.id,
                    &mut seq.kv,
                    (&seq.tokens, seq.prompt_len),
                    copies,
                    &mut *store,
                )
                && seq.first_token.is_none()
            {
                seq.cached = seq.kv.computed.min(seq.prompt_len);
            }
        }
    }

    /// Whether a running sequence waits for its restore from a session file.
    pub fn restoring(&self) -> bool {
        self.running.iter().any(|s| s.kv.restoring.is_some())
    }

    /// Each running sequence's run of this step, oldest first, within the token budget:
    /// blocks granted (cached ones evicted, the youngest preempted where the pool is short),
    /// drafts proposed for decoding ones.
    fn plan_runs<'s>(
        &mut self,
        copies: &mut Copies,
        mut store: Option<&mut (dyn SessionStore + 's)>,
    ) -> Vec<PlannedRun> {
        let mut budget = self.config.max_prefill_tokens.max(1);
        let mut runs = Vec::new();
        let drafts = self.propose_drafts();
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            seq.draft.clear();
            if seq.kv.restoring.is_some() {
                i += 1;
                continue;
            }
            let remaining = seq.tokens.len() - seq.kv.computed;
            let mut n = if remaining == 1 {
                1
            } else {
                remaining.min(budget)
            };
            // A chunk ends where a state checkpoint is to be taken.
            if let Some(&point) = seq
                .kv
                .checkpoint_at
                .iter()
                .find(|&&p| p > seq.kv.computed && p < seq.kv.computed + n)
            {
                n = point - seq.kv.computed;
            }
            if n == 0 {
                i += 1;
                continue;
            }
            if remaining == 1
                && let Some((_, draft)) = drafts.iter().find(|d| d.0 == seq.id)
            {
                seq.draft.clone_from(draft);
            }
            let need = seq.kv.computed + n + seq.draft.len();
            match self.kv.grant(&mut seq.kv, need, store.as_deref_mut()) {
                Ok(()) => {}
                Err(NoGrant::Never { blocks, pool }) => {
                    // More than the whole cache: preempting it would bring it back for ever.
                    let mut seq = self.running.remove(i);
                    let message = format!(
                        "the sequence needs {blocks} KV blocks ({need} tokens) and the cache has {pool}"
                    );
                    self.release(&mut seq);
                    let _ = seq.events.send(Event::Failed(message));
                    continue;
                }
                Err(NoGrant::Short) => {
                    // Preempt the youngest sequence holding blocks (freeing them), or else
                    // this one, which then waits at the front of the queue.
                    let victim = (i + 1..self.running.len())
                        .rev()
                        .find(|&j| !self.running[j].kv.table.blocks.is_empty())
                        .unwrap_or(i);
                    self.preempt(victim);
                    continue;
                }
            }
            // A draft is verified keeping the state after each position, or against a
            // snapshot of the state to roll back to.
            let seq = &mut self.running[i];
            if !seq.draft.is_empty()
                && !self.kv.keep_states(&mut seq.kv, seq.draft.len())
                && !self.kv.snapshot(seq.id, &mut seq.kv, copies)
            {
                seq.draft.clear();
            }
            // Decode rows count too, so that a step is never more tokens than the budget
            // (the activation buffers sized for it serve every step) unless its decode rows
            // alone are.
            let tokens = n + seq.draft.len();
            budget = budget.saturating_sub(tokens);
            let ends = seq.kv.computed + n == seq.tokens.len();
            runs.push(PlannedRun {
                seq: seq.id,
                tokens,
                logits: if ends { 1 + seq.draft.len() } else { 0 },
            });
            i += 1;
        }
        runs
    }

    /// Drafts for the decoding sequences (one token to compute, room after it), all asked of
    /// the drafter at once, each at most its draft length.
    fn propose_drafts(&mut self) -> Vec<(SeqId, Vec<u32>)> {
        let Some((drafter, max)) = &mut self.drafter else {
            return Vec::new();
        };
        if self.running.len() > self.draft_max_running {
            return Vec::new();
        }
        // The costs of steps of as many sequences as decode now.
        let decoding = self
            .running
            .iter()
            .filter(|s| s.tokens.len() == s.kv.computed + 1)
            .count();
        let unmeasured = StepCosts::default();
        let costs = self.step_costs.get(decoding).unwrap_or(&unmeasured);
        let adaptive = self.adaptive_drafts;
        let requests: Vec<(SeqId, &[u32], usize)> = self
            .running
            .iter_mut()
            .filter(|s| s.tokens.len() == s.kv.computed + 1)
            .filter_map(|s| {
                // Where lengths adapt, by cost: possibly none this step.
                let len = match adaptive {
                    true => s.acceptance.choose(costs, *max),
                    false => *max,
                };
                let s: &Sequence = s;
                let most = len.min(s.room().saturating_sub(1));
                (s.kv.restoring.is_none() && most > 0).then(|| (s.id, &s.tokens[..], most))
            })
            .collect();
        if requests.is_empty() {
            return Vec::new();
        }
        let proposals = drafter.propose_many(&requests);
        requests
            .iter()
            .zip(proposals)
            .map(|(r, mut draft)| {
                draft.truncate(r.2);
                (r.0, draft)
            })
            .collect()
    }

    /// The ragged batch of `runs`: each run's tokens from its computed ones on (a draft's
    /// after its last), its blocks and state slot.
    fn build_batch(&self, runs: &[PlannedRun]) -> Result<RaggedBatch, String> {
        let mut batch = RaggedBatch::new(self.kv.block_size());
        for run in runs {
            let Some(seq) = self.running.iter().find(|s| s.id == run.seq) else {
                return Err(format!("sequence {} is not running", run.seq.0));
            };
            let own = run.tokens - seq.draft.len();
            let ids: Vec<TokenId> = seq.tokens[seq.kv.computed..seq.kv.computed + own]
                .iter()
                .chain(&seq.draft)
                .map(|&t| TokenId(t))
                .collect();
            let wanted = match run.logits {
                0 => LogitsWanted::None,
                1 => LogitsWanted::Last,
                _ => LogitsWanted::All,
            };
            batch
                .push_run(seq.id, &ids, seq.kv.computed, &seq.kv.table, wanted)
                .map_err(|e| e.to_string())?;
            if let Some(slot) = seq.kv.slot {
                batch
                    .set_state_slot(seq.id, slot)
                    .map_err(|e| e.to_string())?;
            }
            if let Some(first) = seq.kv.kept.filter(|_| !seq.draft.is_empty()) {
                batch
                    .keep_states(seq.id, first)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(batch)
    }

    /// A plan that does not run: its copies give their holders back, and the sequences it
    /// was to restore state or copy a block for start over (what they counted is not there).
    fn abandon(&mut self, mut copies: Copies) {
        let ids: Vec<SeqId> = copies
            .restores
            .iter()
            .chain(&copies.states)
            .map(|r| r.0)
            .chain(copies.blocks.iter().map(|c| c.0))
            .collect();
        self.kv.drop_copies(&mut copies.blocks, |_| true);
        for id in ids {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                self.preempt(i);
            }
        }
    }

    /// Returns a sequence's KV blocks and state slot; with a prefix cache, its computed full
    /// blocks stay indexed there.
    fn release(&mut self, seq: &mut Sequence) {
        seq.draft.clear();
        if let Some((drafter, _)) = &mut self.drafter {
            drafter.forget(seq.id);
        }
        self.kv
            .release(&mut seq.kv, &seq.tokens, seq.session.as_deref());
    }

    /// Frees sequence `index`'s blocks and puts it back at the front of the queue, to be
    /// recomputed from its tokens (prompt and generated so far).
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        if !seq.kv.table.blocks.is_empty() {
            self.preemptions += 1;
        }
        self.release(&mut seq);
        seq.kv.computed = 0;
        seq.kv.checkpoint_at.clear();
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
            .chain(plan.state_copies.iter().map(|r| r.0))
            .chain(plan.block_copies.iter().map(|c| c.0))
            .collect();
        let mut copies = plan.block_copies;
        self.kv.drop_copies(&mut copies, |_| true);
        for id in ids {
            if let Some(index) = self.running.iter().position(|s| s.id == id) {
                let mut seq = self.running.remove(index);
                // The failed step's KV is not trusted: nothing of it is cached.
                seq.kv.computed = 0;
                self.release(&mut seq);
                let _ = seq.events.send(Event::Failed(message.to_string()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
