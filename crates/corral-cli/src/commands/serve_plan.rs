//! How `serve` sizes its KV pool: from the same memory plan as `corral plan`, within a byte
//! budget that is given, or else read: a discrete GPU's free memory after the weights are
//! loaded, less headroom; on the CPU or a unified-memory device, `MemAvailable` read before
//! loading, less headroom (never a unified device's free-memory report, which counts memory
//! the host needs).

use anyhow::{Result, bail};
use corral_engine::{BLOCK_SIZE, MemoryNeeds, MemoryPlan, PlanRequest, mem_available, plan};
use corral_model::Model;

use super::plan::{MEM_AVAILABLE_SHARE, gib, plan_text};

/// Device memory a budget read from a discrete GPU leaves free: the larger of 1 GiB and 5%.
const GPU_HEADROOM_MIN: u64 = 1 << 30;
const GPU_HEADROOM_SHARE: f64 = 0.05;

/// Contexts below this get a warning: agents' prompts alone run to tens of thousands of tokens.
const SHORT_CONTEXT: usize = 32_768;

/// The host memory a budget may come from, read before the model is loaded.
pub(crate) fn host_available() -> Option<u64> {
    mem_available()
}

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
    let kv_element = backend.kv_dtype().size_bytes();
    let fixed = if backend.device_name().starts_with("cpu") {
        0
    } else {
        corral_backend::cuda_fixed_buffer_bytes() as u64
    };
    let weights = model.weight_bytes() as u64;
    let needs = MemoryNeeds::of(
        config,
        weights,
        kv_element,
        shape.prefill_tokens,
        fixed,
        BLOCK_SIZE,
    );
    let device = backend.device_memory()?;
    let (budget, source) = match (shape.memory, device) {
        (Some(bytes), _) => (bytes, "given".to_string()),
        (None, Some(d)) if !d.unified => {
            let headroom = GPU_HEADROOM_MIN.max((d.total as f64 * GPU_HEADROOM_SHARE) as u64);
            (
                weights + d.free.saturating_sub(headroom),
                format!(
                    "the weights and the GPU's {} free after loading, less {} headroom",
                    gib(d.free),
                    gib(headroom)
                ),
            )
        }
        (None, _) => {
            let Some(available) = host_before_load else {
                bail!("no /proc/meminfo to read MemAvailable from: give --memory or --kv-memory");
            };
            (
                (available as f64 * MEM_AVAILABLE_SHARE) as u64,
                format!("90% of MemAvailable {} before loading", gib(available)),
            )
        }
    };
    let request = PlanRequest {
        budget,
        context: shape.context,
        concurrency: shape.max_batch.max(1),
        checkpoints: shape.checkpoints,
    };
    let planned = plan(&needs, request);
    if !planned.weights_fit || planned.kv_blocks == 0 {
        eprint!("{}", plan_text(name, &source, &planned, kv_element));
        if planned.weights_fit {
            bail!("the memory budget holds no KV block once the weights are placed");
        }
        bail!("the weights and workspace alone do not fit the memory budget");
    }
    Ok(ServePlan {
        plan: planned,
        source,
    })
}

/// Warns when the contexts the pool allows are short of what agents need or of what was asked.
pub(crate) fn warn_short(context_at_one: usize, asked: Option<usize>) {
    if context_at_one < SHORT_CONTEXT {
        tracing::warn!(
            context = context_at_one,
            "the KV pool holds fewer than 32,768 tokens for one sequence; agents' prompts need more"
        );
    }
    if let Some(asked) = asked.filter(|&a| a > context_at_one) {
        tracing::warn!(
            asked,
            context = context_at_one,
            "--max-context is more than the KV pool holds for one sequence"
        );
    }
}
