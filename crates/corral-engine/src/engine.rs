//! The engine thread: it owns the model, the KV cache and the scheduler, and runs steps for as
//! long as there is work, sleeping on its command channel when there is none. Handlers talk to
//! it through a cloneable [`EngineHandle`]; each request streams [`Event`]s back on its own
//! channel, and a dropped receiver cancels the request at the next step.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;

use corral_model::{Model, PagedKvCache, RecurrentStateCache};

use crate::SessionStore;
use crate::disk_sessions::{DiskSessions, Reads};
use crate::metrics::EngineMetrics;
use crate::request::{EngineRequest, Event, RequestHandle};
use crate::scheduler::{Scheduler, SchedulerConfig, Speculation, StepPlan};
use crate::{EngineError, KvBlockPool};

/// Sizes and limits of the engine.
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    /// Most sequences running at once.
    pub max_batch: usize,
    /// Most tokens a step computes, decode rows included (which always run).
    pub max_prefill_tokens: usize,
    /// Most requests waiting for admission; more are refused.
    pub max_queue: usize,
    /// KV cache blocks.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Longest sequence (prompt plus generated tokens).
    pub max_context: usize,
    /// Keep computed KV blocks for later requests that share their prefix (and, for hybrid
    /// models, recurrent-state checkpoints where those prefixes end).
    pub prefix_cache: bool,
    /// State slots for checkpoints (hybrid models with the prefix cache), beyond one per
    /// running sequence.
    pub state_checkpoints: usize,
    /// A folder where prefixes the cache evicts are written, and read back by later
    /// requests that extend them (with the prefix cache).
    pub session_dir: Option<std::path::PathBuf>,
    /// Most bytes of session files in `session_dir` (least recently used deleted first).
    pub session_dir_bytes: u64,
    /// What the weights are (their files' names, sizes and times, or a synthetic model's
    /// config): part of session files' fingerprint, so that another checkpoint of the same
    /// shape never reads them.
    pub model_identity: String,
    /// How long a request's session id (`X-Session-Id`, or `user`) keeps its prefix from
    /// eviction after its turn; zero for not at all.
    pub session_pin: std::time::Duration,
    /// How often a throughput line is logged while there is work; zero for never.
    pub throughput_log_interval: std::time::Duration,
}

enum Command {
    Submit(Box<EngineRequest>, RequestHandle),
    Shutdown,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The wait queue is full; retry later.
    #[error("the server is busy: {0} requests are waiting")]
    QueueFull(usize),
    /// The engine has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// A cloneable handle to the engine thread.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    commands: Sender<Command>,
    metrics: Arc<EngineMetrics>,
    config: EngineConfig,
}

impl EngineHandle {
    /// Queues a request, unless the queue is full (checked and counted in one atomic step,
    /// so that submissions at once never overfill it). The handle ends it as a stop.
    pub fn submit(&self, request: EngineRequest) -> Result<RequestHandle, SubmitError> {
        let max = self.config.max_queue as u64;
        self.metrics
            .queue_depth
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max).then_some(w + 1)
            })
            .map_err(|w| SubmitError::QueueFull(w as usize))?;
        let handle = RequestHandle::default();
        self.commands
            .send(Command::Submit(Box::new(request), handle.clone()))
            .map_err(|_| {
                leave_queue(&self.metrics, 1);
                SubmitError::Stopped
            })?;
        Ok(handle)
    }

    /// Asks the engine thread to stop after its current step; live requests end with
    /// `Failed`.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// The engine's live measurements.
    pub fn metrics(&self) -> &Arc<EngineMetrics> {
        &self.metrics
    }

    /// The engine's limits.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
}

/// Starts the engine thread with `model` and a KV cache of `config.kv_blocks` blocks. The
/// thread gives the model back when it ends (for another engine on the same weights).
pub fn spawn_engine(
    model: Model,
    config: EngineConfig,
) -> Result<(EngineHandle, JoinHandle<Model>), EngineError> {
    spawn_engine_drafting(model, config, None)
}

/// [`spawn_engine`] with speculative decoding: each decoding sequence's step verifies the
/// tokens its drafter proposes.
pub fn spawn_engine_drafting(
    model: Model,
    config: EngineConfig,
    speculation: Option<Speculation>,
) -> Result<(EngineHandle, JoinHandle<Model>), EngineError> {
    let cache = PagedKvCache::new(
        model.backend().as_ref(),
        model.config(),
        config.kv_blocks,
        config.block_size,
    )?;
    let checkpoints = if config.prefix_cache && model.is_hybrid() {
        config.state_checkpoints
    } else {
        0
    };
    // Without the prefix cache's checkpoint slots, a hybrid verifying drafts snapshots its
    // state in slots of its own, one per running sequence.
    let snapshots = if speculation.is_some() && model.is_hybrid() && !config.prefix_cache {
        config.max_batch.max(1)
    } else {
        0
    };
    // Verify steps keep a hybrid's state after each draft position in groups of their own.
    let (kept_groups, kept_len) = match &speculation {
        Some(s) if model.is_hybrid() => {
            (s.kept_state_groups(config.max_batch.max(1)), s.max_tokens)
        }
        _ => (0, 0),
    };
    let first_kept = config.max_batch.max(1) + checkpoints + snapshots;
    let state = RecurrentStateCache::new(
        model.backend().as_ref(),
        model.config(),
        first_kept + kept_groups * kept_len,
    )?;
    let metrics = Arc::new(EngineMetrics::default());
    let spill = match (&config.session_dir, config.prefix_cache) {
        (Some(dir), true) => {
            let fp = crate::kv::fingerprint(&[
                &config.model_identity,
                &model.backend().device_name(),
                &format!("{:?}", model.config()),
                &format!("{:?}", model.backend().kv_dtype()),
                &config.block_size.to_string(),
                env!("CARGO_PKG_VERSION"),
            ]);
            let dir = crate::SpillDir::open(
                dir,
                fp,
                config.block_size,
                config.session_dir_bytes,
                Arc::clone(&metrics.session_spill_writes),
            )?;
            crate::disk_sessions::show_folder(&metrics, &dir);
            Some(dir)
        }
        _ => None,
    };
    metrics
        .kv_blocks_total
        .store(config.kv_blocks as u64, Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::channel();
    let scheduler = Scheduler::new(
        SchedulerConfig {
            max_batch: config.max_batch.max(1),
            max_prefill_tokens: config.max_prefill_tokens.max(1),
            session_pin: config.session_pin,
        },
        KvBlockPool::new(config.kv_blocks, config.block_size),
    );
    // A hybrid model's prefix also needs its recurrent state: checkpoints in their own slots.
    let scheduler = match (config.prefix_cache, model.is_hybrid()) {
        (true, false) => scheduler.with_prefix_cache(),
        (true, true) => scheduler.with_state_checkpoints(config.max_batch.max(1), checkpoints),
        (false, true) => scheduler.with_recurrent_state(snapshots),
        (false, false) => scheduler,
    }
    .with_kept_states(first_kept, kept_groups, kept_len)
    .with_eviction_cost(eviction_cost(
        model.config(),
        model.backend().kv_dtype(),
        config.block_size,
    ));
    let scheduler = match speculation {
        Some(s) => scheduler.with_speculation(s),
        None => scheduler,
    };
    metrics.engine_alive.store(true, Ordering::Relaxed);
    let thread_metrics = Arc::clone(&metrics);
    let config_interval = config.throughput_log_interval;
    let thread = std::thread::Builder::new()
        .name("corral-engine".to_string())
        .spawn(move || {
            let _alive = AliveFlag(&thread_metrics);
            let log = ThroughputLog::new(config_interval);
            run(
                model,
                (cache, state),
                scheduler,
                spill,
                rx,
                &thread_metrics,
                log,
            )
        })
        .map_err(|source| EngineError::Io {
            path: "engine thread".into(),
            source,
        })?;
    Ok((
        EngineHandle {
            commands: tx,
            metrics,
            config,
        },
        thread,
    ))
}

/// Clears `engine_alive` when the engine thread ends, by returning or by unwinding from a
/// panic outside a forward pass (which `/health` must then report).
struct AliveFlag<'a>(&'a EngineMetrics);

impl Drop for AliveFlag<'_> {
    fn drop(&mut self) {
        self.0.engine_alive.store(false, Ordering::Relaxed);
    }
}

/// How often the buffer pool's free bytes are read for `/metrics`.
const POOL_GAUGE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

fn run(
    model: Model,
    (mut cache, mut state): (PagedKvCache, RecurrentStateCache),
    mut scheduler: Scheduler,
    mut spill: Option<crate::SpillDir>,
    commands: Receiver<Command>,
    metrics: &EngineMetrics,
    mut log: ThroughputLog,
) -> Model {
    let vocab = model.config().vocab_size;
    let mut logits = Vec::new();
    let mut hidden = Vec::new();
    let mut sampling = corral_model::SampledStep::default();
    let mut reads = Reads::new();
    let mut next_restore = 0;
    let mut pool_gauge_at: Option<std::time::Instant> = None;
    // Queues a submitted request; false on shutdown.
    let receive = |scheduler: &mut Scheduler, command: Command| match command {
        Command::Submit(request, handle) => {
            scheduler.add_handled(*request, handle);
            true
        }
        Command::Shutdown => false,
    };
    loop {
        if scheduler.is_idle() {
            let ahead = match &mut spill {
                Some(dir) => write_ahead_until_command(
                    &commands,
                    &mut scheduler,
                    &mut DiskSessions {
                        backend: model.backend().as_ref(),
                        cache: &mut cache,
                        state: &mut state,
                        dir,
                        hybrid: model.is_hybrid(),
                        metrics,
                        reads: &mut reads,
                        next_restore: &mut next_restore,
                    },
                ),
                None => Ok(None),
            };
            let Ok(Some(command)) = ahead.map(|c| c.or_else(|| commands.recv().ok())) else {
                return model;
            };
            if !receive(&mut scheduler, command) {
                return model;
            }
            log.restart(metrics);
        }
        loop {
            match commands.try_recv() {
                Ok(command) => {
                    if !receive(&mut scheduler, command) {
                        return model;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return model,
            }
        }
        let departed = scheduler.retire_departed();
        metrics
            .finished_abort
            .fetch_add(departed.aborted as u64, Ordering::Relaxed);
        // Most steps see no client leave: nothing to settle.
        if !departed.finished.is_empty() {
            let backend = model.backend().as_ref();
            settle(departed, &mut scheduler, &mut state, backend, metrics);
        }
        let planning = std::time::Instant::now();
        let plan = match &mut spill {
            Some(dir) => scheduler.step_with(Some(&mut DiskSessions {
                backend: model.backend().as_ref(),
                cache: &mut cache,
                state: &mut state,
                dir,
                hybrid: model.is_hybrid(),
                metrics,
                reads: &mut reads,
                next_restore: &mut next_restore,
            })),
            None => scheduler.step(),
        };
        leave_queue(metrics, scheduler.take_departures());
        if plan.is_none() && scheduler.restoring() {
            // Only restores from disk are left: their reads, not a spin, are what to wait on.
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        if let Some(plan) = plan {
            let backend = model.backend().as_ref();
            // A panic in a forward pass (a bug) fails the step's requests, not the engine.
            // Rows are sampled where the logits are unless one needs them whole.
            // A drafter reading hidden states (an MTP head) takes every token's.
            let wants_hidden = scheduler.drafter_wants_hidden();
            let sampled = scheduler.prepare_sampling(&plan, vocab, &mut sampling);
            let decodes_only = plan.decodes_only();
            let shape = plan.decode_shape();
            let started = std::time::Instant::now();
            let planned = started - planning;
            let forward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                restore(backend, &mut cache, &mut state, &scheduler, &plan, metrics)?;
                if sampled && wants_hidden {
                    model.forward_sampled_with_all_hidden(
                        &plan.batch,
                        &mut cache,
                        Some(&mut state),
                        &mut sampling,
                        &mut hidden,
                    )
                } else if sampled {
                    model.forward_sampled(&plan.batch, &mut cache, Some(&mut state), &mut sampling)
                } else if wants_hidden {
                    model.forward_with_all_hidden(
                        &plan.batch,
                        &mut cache,
                        Some(&mut state),
                        &mut logits,
                        &mut hidden,
                    )
                } else {
                    model.forward_with_state(&plan.batch, &mut cache, &mut state, &mut logits)
                }
            }))
            .unwrap_or_else(|_| {
                Err(corral_model::ModelError::Unsupported(
                    "the forward pass panicked".to_string(),
                ))
            });
            match forward {
                Ok(report) => {
                    tracing::debug!(
                        runs = plan.batch.runs().len(),
                        tokens = report.tokens,
                        longest = plan
                            .batch
                            .runs()
                            .iter()
                            .map(|r| r.first_position + r.len)
                            .max()
                            .unwrap_or(0),
                        ms = started.elapsed().as_secs_f64() * 1e3,
                        allocations = report.stats.allocations,
                        host_syncs = report.stats.host_syncs,
                        "step"
                    );
                    metrics
                        .forward_tokens
                        .fetch_add(report.tokens as u64, Ordering::Relaxed);
                    metrics
                        .dispatches
                        .fetch_add(report.stats.dispatches, Ordering::Relaxed);
                    let finishing = std::time::Instant::now();
                    // Counted before the step's outputs go out, so that a client that has its
                    // tokens finds the step counted.
                    if decodes_only {
                        metrics.decode_steps.fetch_add(1, Ordering::Relaxed);
                    }
                    if wants_hidden {
                        scheduler.observe_hidden(&plan, &hidden, model.config().hidden_size);
                    }
                    let counts = if sampled {
                        scheduler.finish_sampled_step(plan, &mut sampling, report.stats)
                    } else {
                        scheduler.finish_step(plan, &mut logits, vocab, report.stats)
                    };
                    settle(counts, &mut scheduler, &mut state, backend, metrics);
                    if decodes_only {
                        let phases = [planned, finishing - started, finishing.elapsed()];
                        let micros = phases.iter().map(|t| t.as_secs_f64() * 1e6).sum();
                        scheduler.observe_decode_step(shape, micros);
                        for (sum, t) in metrics.decode_step_micros.iter().zip(phases) {
                            sum.fetch_add(t.as_micros() as u64, Ordering::Relaxed);
                        }
                    }
                }
                Err(e) => scheduler.fail_step(plan, &e.to_string()),
            }
        }
        update_gauges(&scheduler, metrics);
        // Summing the pool's free list takes its lock: once a second, not every step.
        if pool_gauge_at.is_none_or(|at| at.elapsed() >= POOL_GAUGE_INTERVAL) {
            metrics
                .buffer_pool_free_bytes
                .store(model.backend().pool_bytes().0 as u64, Ordering::Relaxed);
            pool_gauge_at = Some(std::time::Instant::now());
        }
        log.tick(metrics);
    }
}

/// What a step (or the clients that went away) left to do: the state checkpoints it queued
/// copied, its tokens and latencies counted, and its finished requests counted by reason and
/// told, in that order (a client that sees its end also sees it counted).
fn settle(
    counts: crate::scheduler::StepCounts,
    scheduler: &mut Scheduler,
    state: &mut RecurrentStateCache,
    backend: &dyn corral_backend::Backend,
    metrics: &EngineMetrics,
) {
    for &(src, dst) in &counts.checkpoint_copies {
        match state.copy_slot(backend, src, dst) {
            Ok(()) => {
                metrics
                    .state_checkpoints_taken
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(error = %e, "a state checkpoint could not be copied");
                scheduler.forget_checkpoint(dst);
            }
        }
    }
    metrics
        .prompt_tokens
        .fetch_add(counts.prefill_tokens as u64, Ordering::Relaxed);
    metrics
        .generated_tokens
        .fetch_add(counts.generated_tokens as u64, Ordering::Relaxed);
    metrics
        .draft_tokens
        .fetch_add(counts.draft_tokens as u64, Ordering::Relaxed);
    metrics
        .accepted_draft_tokens
        .fetch_add(counts.accepted_tokens as u64, Ordering::Relaxed);
    metrics
        .drafts
        .fetch_add(counts.drafts as u64, Ordering::Relaxed);
    for (total, &n) in metrics
        .accepted_by_position
        .iter()
        .zip(&counts.accepted_by_position)
    {
        total.fetch_add(n as u64, Ordering::Relaxed);
    }
    counts.ttft.iter().for_each(|s| metrics.ttft.observe(*s));
    counts
        .inter_token
        .iter()
        .for_each(|s| metrics.inter_token.observe(*s));
    update_gauges(scheduler, metrics);
    for (events, finished) in counts.finished {
        metrics
            .e2e
            .observe((finished.prompt_ms + finished.decode_ms) / 1e3);
        let by_reason = match finished.reason {
            crate::FinishReason::Stop => &metrics.finished_stop,
            crate::FinishReason::Length => &metrics.finished_length,
            crate::FinishReason::Cancelled => &metrics.finished_abort,
        };
        by_reason.fetch_add(1, Ordering::Relaxed);
        metrics
            .finished_prompt_tokens
            .fetch_add(finished.prompt_tokens as u64, Ordering::Relaxed);
        if finished.cached_tokens > 0 {
            metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
            metrics
                .cached_prompt_tokens
                .fetch_add(finished.cached_tokens as u64, Ordering::Relaxed);
        }
        let _ = events.send(Event::Finished(finished));
    }
}

/// A throughput line every `interval` while the engine works (as vLLM logs one): prompt and
/// generation tokens per second since the last line, running and waiting requests, KV use.
struct ThroughputLog {
    interval: std::time::Duration,
    last: std::time::Instant,
    tokens: (u64, u64),
}

impl ThroughputLog {
    fn new(interval: std::time::Duration) -> Self {
        Self {
            interval,
            last: std::time::Instant::now(),
            tokens: (0, 0),
        }
    }

    /// Starts measuring afresh (work arrived after idling: the idle time is not averaged in).
    fn restart(&mut self, metrics: &EngineMetrics) {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        self.tokens = (
            load(&metrics.prompt_tokens),
            load(&metrics.generated_tokens),
        );
        self.last = std::time::Instant::now();
    }

    fn tick(&mut self, metrics: &EngineMetrics) {
        let elapsed = self.last.elapsed();
        if self.interval.is_zero() || elapsed < self.interval {
            return;
        }
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let now = (
            load(&metrics.prompt_tokens),
            load(&metrics.generated_tokens),
        );
        if let Some(line) = throughput_line(self.tokens, now, elapsed.as_secs_f64(), metrics) {
            tracing::info!("{line}");
        }
        self.tokens = now;
        self.last = std::time::Instant::now();
    }
}

/// The throughput line for token counters going from `before` to `now` over `seconds`;
/// `None` when nothing ran.
fn throughput_line(
    before: (u64, u64),
    now: (u64, u64),
    seconds: f64,
    metrics: &EngineMetrics,
) -> Option<String> {
    let (prompt, generated) = (now.0 - before.0, now.1 - before.1);
    if prompt == 0 && generated == 0 {
        return None;
    }
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let total = load(&metrics.kv_blocks_total).max(1);
    Some(format!(
        "throughput: prompt {:.1} tok/s, generation {:.1} tok/s, {} running, {} waiting, KV cache {:.1}% used",
        prompt as f64 / seconds.max(1e-9),
        generated as f64 / seconds.max(1e-9),
        load(&metrics.running),
        load(&metrics.queue_depth),
        100.0 * load(&metrics.kv_blocks_used) as f64 / total as f64,
    ))
}

/// What a cached block saves, from the model's shape: 2 FLOPs per active parameter a token
/// (the embedding lookup and the experts a token does not use excluded), and 4 per head
/// dimension of every attention layer for each earlier position.
fn eviction_cost(
    config: &corral_model::ModelConfig,
    kv_dtype: corral_backend::DType,
    block_size: usize,
) -> crate::EvictionCost {
    let h = config.hidden_size;
    let idle_experts = config.moe.as_ref().map_or(0, |m| {
        let sparse = (0..config.num_layers)
            .filter(|&l| config.is_sparse_layer(l))
            .count();
        sparse * m.num_experts.saturating_sub(m.top_k) * 3 * h * m.moe_intermediate_size
    });
    let active = config
        .num_parameters()
        .saturating_sub(idle_experts + config.vocab_size * h);
    crate::EvictionCost {
        flops_per_token: 2.0 * active as f64,
        attention_flops_per_position: (4
            * config.num_heads
            * config.head_dim
            * config.num_attention_layers()) as f64,
        block_bytes: (config.kv_bytes_per_token(kv_dtype) * block_size) as f64,
        checkpoint_bytes: RecurrentStateCache::bytes_per_slot(config) as f64,
    }
}

/// How long the engine stays idle before it writes cached prefixes to the session folder
/// (see [`Scheduler::write_ahead`]): longer than the gap between back-to-back requests.
const WRITE_AHEAD_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

/// Idle with sessions on disk: after a pause that back-to-back requests do not leave, writes
/// cached prefixes out one at a time until a command comes (so that evictions later find
/// them on disk); the command, `None` when nothing is left to write, `Err` when the sender
/// is gone.
fn write_ahead_until_command(
    commands: &Receiver<Command>,
    scheduler: &mut Scheduler,
    store: &mut dyn SessionStore,
) -> Result<Option<Command>, ()> {
    match commands.recv_timeout(WRITE_AHEAD_AFTER) {
        Ok(c) => return Ok(Some(c)),
        Err(RecvTimeoutError::Disconnected) => return Err(()),
        Err(RecvTimeoutError::Timeout) => {}
    }
    loop {
        match commands.try_recv() {
            Ok(c) => return Ok(Some(c)),
            Err(TryRecvError::Disconnected) => return Err(()),
            Err(TryRecvError::Empty) if !scheduler.write_ahead(store) => return Ok(None),
            Err(TryRecvError::Empty) => {}
        }
    }
}

/// Makes the copies a step needs before its forward: cached blocks into sequences' own,
/// each resumed sequence's checkpoint into its slot (one log line a restore), then running
/// states' snapshots and roll-backs.
fn restore(
    backend: &dyn corral_backend::Backend,
    cache: &mut PagedKvCache,
    state: &mut RecurrentStateCache,
    scheduler: &Scheduler,
    plan: &StepPlan,
    metrics: &EngineMetrics,
) -> Result<(), corral_model::ModelError> {
    for &(_, src, dst) in &plan.block_copies {
        cache.copy_block(backend, src, dst)?;
        metrics.kv_block_copies.fetch_add(1, Ordering::Relaxed);
    }
    for &(seq, src, dst) in &plan.restores {
        let start = std::time::Instant::now();
        state.copy_slot(backend, src, dst)?;
        let tokens = scheduler.computed_tokens(seq);
        metrics.state_restores.fetch_add(1, Ordering::Relaxed);
        metrics
            .state_restored_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        tracing::info!(
            seq = seq.0,
            tokens,
            ms = start.elapsed().as_secs_f64() * 1e3,
            "restored a state checkpoint from memory"
        );
    }
    for &(_, src, dst) in &plan.state_copies {
        state.copy_slot(backend, src, dst)?;
    }
    Ok(())
}

/// Takes `n` requests off the count of waiting ones.
fn leave_queue(metrics: &EngineMetrics, n: usize) {
    let _ = metrics
        .queue_depth
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            Some(w.saturating_sub(n as u64))
        });
}

/// Running, KV and preemption gauges from the scheduler's current state.
fn update_gauges(scheduler: &Scheduler, metrics: &EngineMetrics) {
    let store = |gauge: &std::sync::atomic::AtomicU64, value: usize| {
        gauge.store(value as u64, Ordering::Relaxed)
    };
    store(&metrics.running, scheduler.num_running());
    store(&metrics.kv_blocks_used, scheduler.blocks_in_use());
    store(&metrics.state_slots_used, scheduler.slots_in_use());
    store(&metrics.kv_blocks_cached, scheduler.cached_blocks());
    store(
        &metrics.state_checkpoints_cached,
        scheduler.cached_checkpoints(),
    );
    store(&metrics.session_pins, scheduler.session_pins());
    metrics
        .preemptions
        .store(scheduler.preemptions(), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    fn request() -> EngineRequest {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        EngineRequest {
            prompt: vec![1, 2, 3],
            params: SamplingParams::default(),
            max_tokens: 1,
            max_context: 64,
            stop_token_ids: Vec::new(),
            top_logprobs: None,
            events,
            session: None,
            constraint: None,
        }
    }

    /// Submissions from many threads at once never fill the queue past its limit: the check
    /// and the count are one atomic step (they were a load, then an add).
    #[test]
    fn concurrent_submissions_stop_exactly_at_the_queue_limit() {
        let (commands, received) = std::sync::mpsc::channel();
        let handle = EngineHandle {
            commands,
            metrics: Arc::new(EngineMetrics::default()),
            config: EngineConfig {
                max_queue: 10,
                ..Default::default()
            },
        };
        let start = Arc::new(std::sync::Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (handle, start) = (handle.clone(), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    (0..4).filter(|_| handle.submit(request()).is_ok()).count()
                })
            })
            .collect();
        let accepted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(accepted, 10);
        assert_eq!(received.try_iter().count(), 10);
        assert!(matches!(
            handle.submit(request()),
            Err(SubmitError::QueueFull(10))
        ));
    }

    #[test]
    fn the_throughput_line_gives_rates_and_gauges() {
        let m = EngineMetrics::default();
        m.kv_blocks_total.store(200, Ordering::Relaxed);
        m.kv_blocks_used.store(50, Ordering::Relaxed);
        m.running.store(3, Ordering::Relaxed);
        m.queue_depth.store(1, Ordering::Relaxed);
        assert_eq!(throughput_line((10, 10), (10, 10), 10.0, &m), None);
        assert_eq!(
            throughput_line((10, 10), (1010, 260), 10.0, &m).unwrap(),
            "throughput: prompt 100.0 tok/s, generation 25.0 tok/s, 3 running, 1 waiting, KV cache 25.0% used"
        );
    }

    /// The engine thread's liveness flag clears when the thread unwinds, not only when it
    /// returns.
    #[test]
    fn the_alive_flag_clears_when_the_thread_panics() {
        let metrics = Arc::new(EngineMetrics::default());
        metrics.engine_alive.store(true, Ordering::Relaxed);
        let inner = Arc::clone(&metrics);
        let joined = std::thread::spawn(move || {
            let _alive = AliveFlag(&inner);
            panic!("a scheduler bug");
        })
        .join();
        assert!(joined.is_err());
        assert!(!metrics.engine_alive.load(Ordering::Relaxed));
    }
}
