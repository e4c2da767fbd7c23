//! How `serve` sizes its KV pool: from the same memory plan as `corral plan`, within a byte
//! budget that is given, or else read: a discrete GPU's free memory after the weights are
//! loaded, less headroom; on the CPU or a unified-memory device, `MemAvailable` read before
//! loading, less headroom (never a unified device's free-memory report, which counts memory
//! the host needs).

use anyhow::{Context, Result, bail};
use corral_engine::{BLOCK_SIZE, MemoryNeeds, MemoryPlan, PlanRequest, plan};
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache,
    SeqId, SlotId, TokenId,
};

use super::plan::{gib, host_budget, plan_text};

/// Device memory a budget read from a discrete GPU leaves free: the larger of 1 GiB and 5%.
const GPU_HEADROOM_MIN: u64 = 1 << 30;
const GPU_HEADROOM_SHARE: f64 = 0.05;

/// Device memory serving allocates after its plan (CUDA graphs of decode steps, small
/// buffers): 23–31 MiB measured on the H200 with Qwen3.5-35B-A3B, kept for with a margin.
const GPU_AFTER_PLAN_BYTES: u64 = 64 << 20;

/// Contexts below this get a warning: agents' prompts alone run to tens of thousands of tokens.
const SHORT_CONTEXT: usize = 32_768;

/// What serving needs, sized.
pub(crate) struct ServePlan {
    pub(crate) plan: MemoryPlan,
    /// Where the budget came from, for the log.
    pub(crate) source: String,
}

/// What the server is asked to hold.
pub(crate) struct ServeShape {
    /// The budget given (`--memory`), if any.
    pub(crate) memory: Option<u64>,
    pub(crate) max_batch: usize,
    pub(crate) context: usize,
    pub(crate) checkpoints: usize,
    pub(crate) prefill_tokens: usize,
    /// The session folder's byte cap (`--session-dir-bytes`), if there is a folder: its
    /// index takes host memory in proportion.
    pub(crate) session_dir_bytes: Option<u64>,
    /// An MTP head drafting beside the model: its weight bytes, and its KV bytes a token
    /// (its cache holds as many tokens as the model's).
    pub(crate) drafter_head: Option<(u64, u64)>,
    /// Recurrent states verify steps keep after each draft position (a hybrid drafting).
    pub(crate) kept_states: usize,
}

/// Device buffers the KV pool and recurrent states take: K and V for each attention layer,
/// conv and recurrent state for each linear one. Each rounds up to the allocation granularity.
fn pool_buffers(config: &corral_model::ModelConfig) -> u64 {
    2 * (config.num_attention_layers() + config.num_linear_layers()) as u64
}

/// Plans `shape` for the loaded `model`; fails, printing the plan, when the weights and
/// workspace alone do not fit the budget or it holds no KV block.
pub(crate) fn plan_serving(
    model: &Model,
    name: &str,
    shape: &ServeShape,
    host_before_load: Option<u64>,
) -> Result<ServePlan> {
    let backend = model.backend();
    let config = model.config();
    let kv_dtype = backend.kv_dtype();
    let (head_weights, head_kv) = shape.drafter_head.unwrap_or((0, 0));
    let weights = model.weight_bytes() as u64 + head_weights;
    let step = measure_step_workspace(model, shape.prefill_tokens)?;
    // A GPU's fixed buffers and the measured step's are allocated by now: its free memory
    // is read after them.
    let device = backend.device_memory()?;
    let needs = |fixed: u64| {
        let mut needs =
            MemoryNeeds::with_workspace(config, weights, kv_dtype, fixed + step, BLOCK_SIZE);
        // (The head's weights are in `weights`: it is loaded, as the model is.)
        needs.add_draft_head(0, head_kv);
        needs.add_kept_states(shape.kept_states);
        needs
    };
    let (needs, budget, source) = match (shape.memory, device) {
        // A budget for the whole process leaves room for the device runtime too. On a
        // discrete GPU all it has in use after the measured step counts (the libraries'
        // modules loaded on first use and the allocator's rounding beyond the buffers' own
        // bytes: 219–249 MiB on the H200 that runtime and buffers alone left out), and what
        // serving allocates after the plan (decode graphs: 23–31 MiB there).
        (Some(bytes), Some(d)) => {
            let fixed = if d.unified {
                d.fixed_buffers
            } else {
                let in_use = d.total.saturating_sub(d.free);
                in_use
                    .saturating_sub(weights + step)
                    .max(d.fixed_buffers + d.runtime)
                    + GPU_AFTER_PLAN_BYTES
                    + pool_buffers(config) * d.allocation_granularity
            };
            (needs(fixed), bytes, "given".to_string())
        }
        (Some(bytes), None) => (needs(0), bytes, "given".to_string()),
        (None, Some(d)) if !d.unified => {
            let headroom = GPU_HEADROOM_MIN.max((d.total as f64 * GPU_HEADROOM_SHARE) as u64);
            (
                needs(0),
                weights + step + d.free.saturating_sub(headroom),
                format!(
                    "the weights, a step's buffers and the GPU's {} free after them, less {} headroom",
                    gib(d.free),
                    gib(headroom)
                ),
            )
        }
        (None, d) => {
            let (budget, source) = host_budget(host_before_load, " before loading")?;
            (needs(d.map_or(0, |d| d.fixed_buffers)), budget, source)
        }
    };
    // The index is host memory: it counts where the budget is.
    let host_budget = device.is_none_or(|d| d.unified);
    let session_index = match shape.session_dir_bytes {
        Some(bytes) if host_budget => {
            corral_engine::SpillDir::max_index_bytes(bytes, needs.kv_per_token * BLOCK_SIZE as u64)
        }
        _ => 0,
    };
    let request = PlanRequest {
        budget,
        context: shape.context,
        concurrency: shape.max_batch.max(1),
        checkpoints: shape.checkpoints,
        session_index,
    };
    let planned = plan(&needs, request);
    // A model without attention layers needs no KV block.
    let holds_kv = planned.kv_blocks > 0 || needs.kv_per_token == 0;
    if !planned.weights_fit || !holds_kv {
        eprint!("{}", plan_text(name, &source, &planned, kv_dtype));
        if planned.weights_fit {
            bail!(
                "the memory budget holds no KV block once the weights, workspace and recurrent states ({} checkpoints: --state-cache-bytes) are placed",
                shape.checkpoints
            );
        }
        bail!("the weights and workspace alone do not fit the memory budget");
    }
    Ok(ServePlan {
        plan: planned,
        source,
    })
}

/// Runs one step of `tokens` prompt tokens on a scratch cache (freed after) and returns the
/// bytes of the buffers it left in the backend's pool: the activations every later step
/// reuses, measured rather than estimated.
fn measure_step_workspace(model: &Model, tokens: usize) -> Result<u64> {
    let backend = model.backend().as_ref();
    let config = model.config();
    let started = std::time::Instant::now();
    let before = backend.pool_bytes().0;
    let blocks = tokens.div_ceil(BLOCK_SIZE);
    let mut cache = PagedKvCache::new(backend, config, blocks, BLOCK_SIZE)
        .context("a KV cache for the step that measures the workspace")?;
    let mut state = RecurrentStateCache::new(backend, config, 1)
        .context("a recurrent state for the step that measures the workspace")?;
    let table = BlockTable {
        blocks: (0..blocks as u32).map(BlockId).collect(),
    };
    let ids: Vec<TokenId> = (0..tokens)
        .map(|i| TokenId((i % config.vocab_size.max(1)) as u32))
        .collect();
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch.push_run(SeqId(0), &ids, 0, &table, LogitsWanted::Last)?;
    batch.set_state_slot(SeqId(0), SlotId(0))?;
    let _report = model
        .forward_with_state(&batch, &mut cache, &mut state, &mut Vec::new())
        .context("the step that measures the workspace")?;
    let bytes = backend.pool_bytes().0.saturating_sub(before) as u64;
    tracing::info!(
        tokens,
        bytes,
        ms = started.elapsed().as_millis() as u64,
        "measured the workspace of the largest step"
    );
    Ok(bytes)
}

/// Warns when the longest context is short of what agents need, naming what limits it: the
/// KV pool (`capacity` tokens), the model or `--max-context` (`asked`).
pub(crate) fn warn_short(max_context: usize, capacity: usize, asked: Option<usize>) {
    if max_context >= SHORT_CONTEXT {
        return;
    }
    let limit = if capacity <= max_context {
        "the KV pool: give more --memory"
    } else if asked == Some(max_context) {
        "--max-context"
    } else {
        "the model's own context"
    };
    tracing::warn!(
        context = max_context,
        "the longest context is under 32,768 tokens, set by {limit}; agents' prompts need more"
    );
}
