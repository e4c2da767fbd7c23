//! The engine thread: it owns the model, the KV cache and the scheduler, and runs steps for as
//! long as there is work, sleeping on its command channel when there is none. Handlers talk to
//! it through a cloneable [`EngineHandle`]; each request streams [`Event`]s back on its own
//! channel, and a dropped receiver cancels the request at the next step.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;

use corral_model::{Model, PagedKvCache, RecurrentStateCache};

use crate::metrics::EngineMetrics;
use crate::request::{EngineRequest, Event};
use crate::scheduler::{Scheduler, SchedulerConfig, StepPlan};
use crate::{EngineError, KvBlockPool};

/// Sizes and limits of the engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Most sequences running at once.
    pub max_batch: usize,
    /// Most prompt tokens prefilled per step.
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
}

enum Command {
    Submit(EngineRequest),
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
    /// Queues a request, unless the queue is full.
    pub fn submit(&self, request: EngineRequest) -> Result<(), SubmitError> {
        let waiting = self.metrics.queue_depth.load(Ordering::Relaxed) as usize;
        if waiting >= self.config.max_queue {
            return Err(SubmitError::QueueFull(waiting));
        }
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        self.commands
            .send(Command::Submit(request))
            .map_err(|_| SubmitError::Stopped)
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

/// Starts the engine thread with `model` and a KV cache of `config.kv_blocks` blocks.
pub fn spawn_engine(
    model: Model,
    config: EngineConfig,
) -> Result<(EngineHandle, JoinHandle<()>), EngineError> {
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
    let state = RecurrentStateCache::new(
        model.backend().as_ref(),
        model.config(),
        config.max_batch.max(1) + checkpoints,
    )?;
    let metrics = Arc::new(EngineMetrics::default());
    metrics
        .kv_blocks_total
        .store(config.kv_blocks as u64, Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::channel();
    let scheduler = Scheduler::new(
        SchedulerConfig {
            max_batch: config.max_batch.max(1),
            max_prefill_tokens: config.max_prefill_tokens.max(1),
        },
        KvBlockPool::new(config.kv_blocks, config.block_size),
    );
    // A hybrid model's prefix also needs its recurrent state, which is not cached yet.
    let scheduler = match (config.prefix_cache, model.is_hybrid()) {
        (true, false) => scheduler.with_prefix_cache(),
        (true, true) => scheduler.with_state_checkpoints(config.max_batch.max(1), checkpoints),
        (false, _) => scheduler,
    };
    metrics.engine_alive.store(true, Ordering::Relaxed);
    let thread_metrics = Arc::clone(&metrics);
    let thread = std::thread::Builder::new()
        .name("corral-engine".to_string())
        .spawn(move || {
            run(model, (cache, state), scheduler, rx, &thread_metrics);
            thread_metrics.engine_alive.store(false, Ordering::Relaxed);
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

fn run(
    model: Model,
    (mut cache, mut state): (PagedKvCache, RecurrentStateCache),
    mut scheduler: Scheduler,
    commands: Receiver<Command>,
    metrics: &EngineMetrics,
) {
    let vocab = model.config().vocab_size;
    let mut logits = Vec::new();
    // Queues a submitted request; false on shutdown.
    let receive = |scheduler: &mut Scheduler, command: Command| match command {
        Command::Submit(request) => {
            scheduler.add(request);
            true
        }
        Command::Shutdown => false,
    };
    loop {
        if scheduler.is_idle() {
            let Ok(command) = commands.recv() else { return };
            if !receive(&mut scheduler, command) {
                return;
            }
        }
        loop {
            match commands.try_recv() {
                Ok(command) => {
                    if !receive(&mut scheduler, command) {
                        return;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        scheduler.drop_cancelled();
        let plan = scheduler.step();
        metrics
            .queue_depth
            .store(scheduler.num_waiting() as u64, Ordering::Relaxed);
        if let Some(plan) = plan {
            let backend = model.backend().as_ref();
            // A panic in a forward pass (a bug) fails the step's requests, not the engine.
            let forward = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                restore(backend, &mut state, &scheduler, &plan, metrics)?;
                model.forward_with_state(&plan.batch, &mut cache, &mut state, &mut logits)
            }))
            .unwrap_or_else(|_| {
                Err(corral_model::ModelError::Unsupported(
                    "the forward pass panicked".to_string(),
                ))
            });
            match forward {
                Ok(report) => {
                    metrics
                        .forward_tokens
                        .fetch_add(report.tokens as u64, Ordering::Relaxed);
                    metrics
                        .dispatches
                        .fetch_add(report.stats.dispatches, Ordering::Relaxed);
                    let counts = scheduler.finish_step(plan, &mut logits, vocab, report.stats);
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
                    counts.ttft.iter().for_each(|s| metrics.ttft.observe(*s));
                    counts
                        .inter_token
                        .iter()
                        .for_each(|s| metrics.inter_token.observe(*s));
                    update_gauges(&scheduler, metrics);
                    for (events, finished) in counts.finished {
                        if finished.cached_tokens > 0 {
                            metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
                            metrics
                                .cached_prompt_tokens
                                .fetch_add(finished.cached_tokens as u64, Ordering::Relaxed);
                        }
                        let _ = events.send(Event::Finished(finished));
                    }
                }
                Err(e) => scheduler.fail_step(plan, &e.to_string()),
            }
        }
        update_gauges(&scheduler, metrics);
    }
}

/// Queue, running, KV and preemption gauges from the scheduler's current state.
/// Copies each resumed sequence's checkpoint into its own slot before the step, one log line
/// a restore.
fn restore(
    backend: &dyn corral_backend::Backend,
    state: &mut RecurrentStateCache,
    scheduler: &Scheduler,
    plan: &StepPlan,
    metrics: &EngineMetrics,
) -> Result<(), corral_model::ModelError> {
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
    Ok(())
}

fn update_gauges(scheduler: &Scheduler, metrics: &EngineMetrics) {
    let store = |gauge: &std::sync::atomic::AtomicU64, value: usize| {
        gauge.store(value as u64, Ordering::Relaxed)
    };
    store(&metrics.queue_depth, scheduler.num_waiting());
    store(&metrics.running, scheduler.num_running());
    store(&metrics.kv_blocks_used, scheduler.blocks_in_use());
    store(&metrics.kv_blocks_cached, scheduler.cached_blocks());
    store(
        &metrics.state_checkpoints_cached,
        scheduler.cached_checkpoints(),
    );
    metrics
        .preemptions
        .store(scheduler.preemptions(), Ordering::Relaxed);
}
