//! The memory plan: what serving a model at a context and a concurrency needs within a byte
//! budget (weights, KV bytes per token, each sequence's recurrent state, the state
//! checkpoints of resident sessions, activation workspace and fixed backend buffers), whether
//! it fits and by how much, the largest context at that concurrency and the largest
//! concurrency at that context.

use corral_backend::DType;
use corral_model::{ModelConfig, RecurrentStateCache};
use serde::Serialize;

/// What a model needs, apart from the budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryNeeds {
    /// Weight bytes as loaded.
    pub weights: u64,
    /// KV cache bytes per token (every attention layer's K and V).
    pub kv_per_token: u64,
    /// Recurrent state bytes per sequence (Gated DeltaNet layers; 0 without them).
    pub state_per_sequence: u64,
    /// Activation workspace and the backend's fixed buffers (an estimate, or what a step
    /// of the largest size took, measured), and the device runtime's own memory where known.
    pub workspace: u64,
    /// Tokens per KV block: the KV of a sequence comes in whole blocks.
    pub block_size: usize,
    /// The longest context the model takes (`max_position_embeddings`, or YaRN's scaled context).
    pub max_position: usize,
}

impl MemoryNeeds {
    /// The needs of `config` with `weights` bytes, a KV cache of `kv_dtype`,
    /// and a prefill of up to `prefill_tokens` a step on a backend with `fixed` bytes of its
    /// own buffers.
    pub fn of(
        config: &ModelConfig,
        weights: u64,
        kv_dtype: DType,
        prefill_tokens: usize,
        fixed: u64,
        block_size: usize,
    ) -> Self {
        let workspace = fixed + activation_bytes(config, prefill_tokens);
        Self::with_workspace(config, weights, kv_dtype, workspace, block_size)
    }

    /// [`MemoryNeeds::of`] with a `workspace` already known (measured) instead of estimated.
    pub fn with_workspace(
        config: &ModelConfig,
        weights: u64,
        kv_dtype: DType,
        workspace: u64,
        block_size: usize,
    ) -> Self {
        Self {
            weights,
            kv_per_token: config.kv_bytes_per_token(kv_dtype) as u64,
            state_per_sequence: RecurrentStateCache::bytes_per_slot(config) as u64,
            workspace,
            block_size: block_size.max(1),
            max_position: config.max_context(),
        }
    }

    /// An MTP head drafting beside the model: `weights` more bytes, and its one layer's KV
    /// (`kv_per_token` bytes) for every token the model's cache holds.
    pub fn add_draft_head(&mut self, weights: u64, kv_per_token: u64) {
        self.weights += weights;
        self.kv_per_token += kv_per_token;
    }

    /// `slots` recurrent states that verify steps keep after each draft position (a
    /// hybrid's speculation), beside the running and checkpointed ones.
    pub fn add_kept_states(&mut self, slots: usize) {
        self.workspace += slots as u64 * self.state_per_sequence;
    }
}

/// f32 activations of one prefill step of `tokens` tokens, the largest layer's worth live at
/// once: the residual stream and its norm, attention's q/k/v and output (gated for the
/// hybrids), the linear-attention layers' projections, convolution, gates and output, the
/// routed experts' gate, up and output rows, the shared expert's output, and the last rows'
/// logits. An estimate; `serve` measures a step instead.
fn activation_bytes(config: &ModelConfig, tokens: usize) -> u64 {
    let q = config.num_heads * config.head_dim;
    let attention = 3 * q + 4 * config.kv_dim();
    let mlp = match &config.moe {
        Some(moe) => {
            moe.top_k * (3 * moe.moe_intermediate_size + config.hidden_size) + moe.num_experts
        }
        None => 3 * config.intermediate_size,
    };
    let hybrid = config.hybrid.as_ref().map_or(0, |h| {
        let l = &h.linear;
        2 * l.conv_channels()
            + 3 * l.value_dim()
            + 4 * l.num_value_heads
            + 2 * q
            + 2 * config.hidden_size
    });
    let per_token = 4 * config.hidden_size + attention + mlp + hybrid;
    (tokens * per_token * 4 + config.vocab_size * 4 * 64) as u64
}

/// What is asked of the plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlanRequest {
    /// Bytes the server may use.
    pub budget: u64,
    /// Tokens each sequence may reach.
    pub context: usize,
    /// Sequences at once.
    pub concurrency: usize,
    /// Recurrent-state checkpoints kept for resident sessions (hybrid models).
    pub checkpoints: usize,
    /// Bytes the session folder's index may take at its byte cap, where the budget is the
    /// host's memory (0 without a session folder, or when the budget is a discrete GPU's).
    pub session_index: u64,
}

/// The plan for one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// What the model needs.
    pub needs: MemoryNeeds,
    /// What was asked.
    pub request: PlanRequest,
    /// KV bytes of `concurrency` sequences of `context` tokens (whole blocks).
    pub kv: u64,
    /// Recurrent states of the sequences and the checkpoints.
    pub states: u64,
    /// Weights, workspace, KV and states.
    pub total: u64,
    /// Budget left over (negative: short by that much).
    pub spare: i128,
    /// Whether the weights and workspace alone fit.
    pub weights_fit: bool,
    /// The longest context each of `concurrency` sequences can reach in the budget, at most
    /// the model's (0: not one token).
    pub max_context: usize,
    /// The most sequences of `context` tokens the budget holds.
    pub max_concurrency: usize,
    /// KV blocks the budget holds once weights, workspace and states are placed.
    pub kv_blocks: usize,
}

impl MemoryPlan {
    /// Whether the request fits.
    pub fn fits(&self) -> bool {
        self.spare >= 0
    }
}

/// Plans `request` for `needs`.
pub fn plan(needs: &MemoryNeeds, request: PlanRequest) -> MemoryPlan {
    let block = needs.block_size as u64;
    let block_bytes = block * needs.kv_per_token;
    let blocks_of = |tokens: usize| (tokens as u64).div_ceil(block);
    let states_of =
        |sequences: usize| (sequences + request.checkpoints) as u64 * needs.state_per_sequence;
    let fixed = needs.weights + needs.workspace + request.session_index;
    let kv = request.concurrency as u64 * blocks_of(request.context) * block_bytes;
    let states = states_of(request.concurrency);
    let total = fixed + kv + states;
    let room = |sequences: usize| request.budget.saturating_sub(fixed + states_of(sequences));
    let kv_blocks = room(request.concurrency)
        .checked_div(block_bytes)
        .map_or(0, |b| usize::try_from(b).unwrap_or(usize::MAX));
    let max_context = match (request.concurrency, block_bytes) {
        (0, _) => 0,
        (_, 0) if room(request.concurrency) > 0 => needs.max_position,
        (_, 0) => 0,
        (c, _) => (kv_blocks / c)
            .saturating_mul(needs.block_size)
            .min(needs.max_position),
    };
    let per_sequence = blocks_of(request.context) * block_bytes + needs.state_per_sequence;
    let max_concurrency = room(0)
        .checked_div(per_sequence)
        .map_or(usize::MAX, |c| usize::try_from(c).unwrap_or(usize::MAX));
    MemoryPlan {
        needs: needs.clone(),
        request,
        kv,
        states,
        total,
        spare: request.budget as i128 - total as i128,
        weights_fit: fixed <= request.budget,
        max_context,
        max_concurrency,
        kv_blocks,
    }
}

/// `MemAvailable` of /proc/meminfo in bytes, where there is one: what a CPU or a
/// unified-memory machine can give without swapping.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs() -> MemoryNeeds {
        MemoryNeeds {
            weights: 1000,
            kv_per_token: 10,
            state_per_sequence: 50,
            workspace: 100,
            block_size: 16,
            max_position: 1024,
        }
    }

    fn ask(budget: u64, context: usize, concurrency: usize, checkpoints: usize) -> PlanRequest {
        PlanRequest {
            budget,
            context,
            concurrency,
            checkpoints,
            session_index: 0,
        }
    }

    #[test]
    fn totals_count_whole_blocks_states_and_checkpoints() {
        // 2 sequences of 20 tokens: 2 blocks each of 160 bytes; 2 + 3 states of 50.
        let p = plan(&needs(), ask(3000, 20, 2, 3));
        assert_eq!(p.kv, 2 * 2 * 160);
        assert_eq!(p.states, 5 * 50);
        assert_eq!(p.total, 1000 + 100 + 640 + 250);
        assert_eq!(p.spare, 3000 - 1990);
        assert!(p.fits() && p.weights_fit);
        // A session folder's index counts beside the weights.
        let indexed = plan(
            &needs(),
            PlanRequest {
                session_index: 500,
                ..ask(3000, 20, 2, 3)
            },
        );
        assert_eq!(indexed.total, p.total + 500);
        assert!(indexed.kv_blocks < p.kv_blocks);
    }

    #[test]
    fn the_largest_context_and_concurrency_are_what_the_budget_holds() {
        let n = needs();
        // Room for KV at C = 2 with no checkpoints: 3000 - 1100 - 100 = 1800 bytes = 11 blocks.
        let p = plan(&n, ask(3000, 100, 2, 0));
        assert_eq!(p.kv_blocks, 11);
        assert_eq!(p.max_context, 5 * 16);
        // A sequence of 100 tokens: 7 blocks (1120 bytes) and a state (50): 1 of them in 1900.
        assert_eq!(p.max_concurrency, 1);
        assert!(!p.fits(), "2 x 100 tokens need 2240 bytes of KV");
        let check = plan(&n, ask(3000, p.max_context, 2, 0));
        assert!(check.fits(), "the largest context it reports fits");
        let over = plan(&n, ask(3000, p.max_context + n.block_size, 2, 0));
        assert!(!over.fits(), "one block more does not");
        // The model's own limit caps the context.
        assert_eq!(plan(&n, ask(1 << 40, 100, 1, 0)).max_context, 1024);
    }

    #[test]
    fn weights_that_do_not_fit_say_so() {
        let p = plan(&needs(), ask(900, 10, 1, 0));
        assert!(!p.weights_fit && !p.fits());
        assert_eq!(p.max_context, 0);
        assert_eq!(p.max_concurrency, 0);
        assert_eq!(p.spare, 900 - (1100 + 160 + 50));
    }

    #[test]
    fn meminfo_is_read_where_there_is_one() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(mem_available().is_some_and(|b| b > 0));
        }
    }
}
