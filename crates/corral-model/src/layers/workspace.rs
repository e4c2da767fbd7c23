//! Activation buffers of one forward pass, taken from the backend's pool at its start and
//! given back at its end, so that steady-state forwards allocate nothing.

use corral_backend::sampling::{CANDIDATE_ROW_WORDS, DRAW_WORDS};
use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer};

use crate::{ModelConfig, Result};

/// Batch metadata on the device.
pub(crate) struct BatchBuffers {
    pub(crate) ids: DeviceBuffer,
    pub(crate) positions: DeviceBuffer,
    pub(crate) token_runs: DeviceBuffer,
    pub(crate) slots: DeviceBuffer,
    pub(crate) block_tables: DeviceBuffer,
    pub(crate) logit_rows: DeviceBuffer,
    /// `[runs, 4]` for recurrent layers (hybrids).
    pub(crate) recurrent_runs: DeviceBuffer,
    /// `[runs]`: the first slot keeping each run's intermediate states (hybrids' verify
    /// steps), read where [`Workspace::keeps_states`].
    pub(crate) kept_states: DeviceBuffer,
}

/// Scratch of Gated DeltaNet layers and gated attention (hybrids; one element otherwise).
pub(crate) struct HybridScratch {
    /// `[T, conv channels]`: projection before and after the convolution.
    pub(crate) qkv: DeviceBuffer,
    pub(crate) conv: DeviceBuffer,
    /// `[T, value dim]`: output gate, delta-rule output, gated-norm output.
    pub(crate) z: DeviceBuffer,
    pub(crate) core: DeviceBuffer,
    pub(crate) normed: DeviceBuffer,
    /// `[T, value heads]`.
    pub(crate) a: DeviceBuffer,
    pub(crate) b: DeviceBuffer,
    pub(crate) g: DeviceBuffer,
    pub(crate) beta: DeviceBuffer,
    /// `[T, heads · head_dim]`: the attention output gate and the gated output.
    pub(crate) attn_gate: DeviceBuffer,
    pub(crate) attn_gated: DeviceBuffer,
    /// `[T]`: the shared expert's gate logit.
    pub(crate) shared_gate: DeviceBuffer,
}

/// Scratch of the grouped MoE strategy, in sorted-pair order.
pub(crate) struct MoeScratch {
    pub(crate) expert_offsets: DeviceBuffer,
    /// `[experts + 1]`: how many experts have pairs, then their ids.
    pub(crate) hit_experts: DeviceBuffer,
    pub(crate) sorted_pairs: DeviceBuffer,
    pub(crate) pair_positions: DeviceBuffer,
    /// `[pairs, moe_intermediate]`.
    pub(crate) act: DeviceBuffer,
    /// `[pairs, hidden]`.
    pub(crate) y: DeviceBuffer,
}

/// Calls `$f` with every buffer of workspace `$ws` (by reference or by value, as `$ws` is
/// given): the one list of a workspace's buffers.
macro_rules! for_each_buffer {
    ($ws:expr, [$($by:tt)*], $f:expr) => {{
        let ws = $ws;
        #[allow(unused_mut)]
        let mut f = $f;
        for buffer in [
            $($by)* ws.batch.ids,
            $($by)* ws.batch.positions,
            $($by)* ws.batch.token_runs,
            $($by)* ws.batch.slots,
            $($by)* ws.batch.block_tables,
            $($by)* ws.batch.logit_rows,
            $($by)* ws.batch.recurrent_runs,
            $($by)* ws.batch.kept_states,
            $($by)* ws.hybrid.qkv,
            $($by)* ws.hybrid.conv,
            $($by)* ws.hybrid.z,
            $($by)* ws.hybrid.core,
            $($by)* ws.hybrid.normed,
            $($by)* ws.hybrid.a,
            $($by)* ws.hybrid.b,
            $($by)* ws.hybrid.g,
            $($by)* ws.hybrid.beta,
            $($by)* ws.hybrid.attn_gate,
            $($by)* ws.hybrid.attn_gated,
            $($by)* ws.hybrid.shared_gate,
            $($by)* ws.shared_out,
            $($by)* ws.x,
            $($by)* ws.h,
            $($by)* ws.out,
            $($by)* ws.q,
            $($by)* ws.k,
            $($by)* ws.v,
            $($by)* ws.q_normed,
            $($by)* ws.k_normed,
            $($by)* ws.attn,
            $($by)* ws.gate,
            $($by)* ws.up,
            $($by)* ws.act,
            $($by)* ws.router_logits,
            $($by)* ws.expert_ids,
            $($by)* ws.expert_weights,
            $($by)* ws.moe.expert_offsets,
            $($by)* ws.moe.hit_experts,
            $($by)* ws.moe.sorted_pairs,
            $($by)* ws.moe.pair_positions,
            $($by)* ws.moe.act,
            $($by)* ws.moe.y,
            $($by)* ws.rows,
            $($by)* ws.rows_normed,
            $($by)* ws.logits,
            $($by)* ws.draws,
            $($by)* ws.candidates,
        ] {
            f(buffer);
        }
    }};
}

/// Every activation buffer a layer may need, sized for `tokens`.
pub(crate) struct Workspace {
    pub(crate) batch: BatchBuffers,
    /// Columns of the padded block tables.
    pub(crate) table_width: usize,
    /// Rows whose logits are wanted.
    pub(crate) num_logit_rows: usize,
    /// Tokens of the batch's longest run.
    pub(crate) max_run_tokens: usize,
    /// Tokens at the batch's start that are one-token runs (decode rows ahead of prefill).
    pub(crate) leading_decode_tokens: usize,
    /// Whether runs keep their recurrent states after each token (`batch.kept_states`).
    pub(crate) keeps_states: bool,
    /// Residual stream `[T, H]`.
    pub(crate) x: DeviceBuffer,
    /// Normalised input of a sub-block `[T, H]`, f32 or the type projections take
    /// ([`Device::gemm_input_dtype`](corral_backend::Device::gemm_input_dtype)): only projections and grouped experts read it.
    pub(crate) h: DeviceBuffer,
    /// Output of a sub-block `[T, H]`.
    pub(crate) out: DeviceBuffer,
    /// Query projection `[T, heads · head_dim]`; for Qwen3 attention the fused q/k/v
    /// projection `[T, (heads + 2 kv_heads) · head_dim]`.
    pub(crate) q: DeviceBuffer,
    pub(crate) k: DeviceBuffer,
    pub(crate) v: DeviceBuffer,
    pub(crate) q_normed: DeviceBuffer,
    pub(crate) k_normed: DeviceBuffer,
    /// Attention output `[T, heads · head_dim]`: for Qwen3 in the type of `h`, for the
    /// hybrids (which gate it first) f32.
    pub(crate) attn: DeviceBuffer,
    pub(crate) gate: DeviceBuffer,
    pub(crate) up: DeviceBuffer,
    pub(crate) act: DeviceBuffer,
    pub(crate) router_logits: DeviceBuffer,
    pub(crate) expert_ids: DeviceBuffer,
    pub(crate) expert_weights: DeviceBuffer,
    pub(crate) moe: MoeScratch,
    pub(crate) hybrid: HybridScratch,
    /// `[T, H]`: the shared expert's output.
    pub(crate) shared_out: DeviceBuffer,
    /// Final-norm input rows whose logits are wanted `[R, H]`, and their norm.
    pub(crate) rows: DeviceBuffer,
    pub(crate) rows_normed: DeviceBuffer,
    pub(crate) logits: DeviceBuffer,
    /// `[R, DRAW_WORDS]` and `[R, CANDIDATE_ROW_WORDS]`: sampling on the device.
    pub(crate) draws: DeviceBuffer,
    pub(crate) candidates: DeviceBuffer,
    /// `[T, H]` f32: every token's final hidden state after the final norm, where a step
    /// reads them all back (an MTP drafter's input).
    pub(crate) all_hidden: Option<DeviceBuffer>,
    /// An MTP head's step: `[T, H]`, the model's hidden states it takes (uploaded each step,
    /// so that a recorded graph reads them from one place).
    pub(crate) mtp_input: Option<DeviceBuffer>,
}

impl Workspace {
    /// Takes every buffer from the pool, `h` in `norm_out` ([`Device::gemm_input_dtype`](corral_backend::Device::gemm_input_dtype)).
    pub(crate) fn take(
        backend: &dyn Backend,
        config: &ModelConfig,
        (tokens, norm_out): (usize, DType),
        runs: usize,
        table_width: usize,
        logit_rows: usize,
    ) -> Result<Self> {
        let f32_buf =
            |len: usize| backend.take_buffer(DType::F32, len.max(1), BufferUsage::Activations);
        let u32_buf =
            |len: usize| backend.take_buffer(DType::U32, len.max(1), BufferUsage::Metadata);
        let h = config.hidden_size;
        let q_dim = config.num_heads * config.head_dim;
        let kv_dim = config.kv_dim();
        // The shared expert's own MLP buffers, unless it runs folded into the routed ops.
        let shared_inter = config
            .hybrid
            .as_ref()
            .and_then(|h| h.shared_expert_intermediate_size)
            .filter(|_| !config.folds_shared_expert())
            .unwrap_or(0);
        let inter = config.intermediate_size.max(shared_inter).max(1);
        let (channels, value_dim, value_heads) = config.hybrid.as_ref().map_or((1, 1, 1), |h| {
            (
                h.linear.conv_channels(),
                h.linear.value_dim(),
                h.linear.num_value_heads,
            )
        });
        let hybrid = config.hybrid.is_some();
        let t = |n: usize| if hybrid { tokens * n } else { 1 };
        // A shared expert folded into the MoE is one more expert and one more choice a token.
        let folded = config.folds_shared_expert() as usize;
        let (experts, top_k, moe_inter) = config.moe.as_ref().map_or((1, 1, 1), |m| {
            (
                m.num_experts + folded,
                m.top_k + folded,
                m.moe_intermediate_size,
            )
        });
        let pairs = tokens * top_k;
        Ok(Self {
            table_width,
            num_logit_rows: logit_rows,
            max_run_tokens: tokens,
            leading_decode_tokens: 0,
            keeps_states: false,
            batch: BatchBuffers {
                ids: u32_buf(tokens)?,
                positions: u32_buf(tokens)?,
                token_runs: u32_buf(tokens)?,
                slots: u32_buf(tokens)?,
                block_tables: u32_buf(runs * table_width)?,
                logit_rows: u32_buf(logit_rows)?,
                recurrent_runs: u32_buf(runs * 4)?,
                kept_states: u32_buf(runs)?,
            },
            hybrid: HybridScratch {
                qkv: f32_buf(t(channels))?,
                conv: f32_buf(t(channels))?,
                z: f32_buf(t(value_dim))?,
                core: f32_buf(t(value_dim))?,
                normed: f32_buf(t(value_dim))?,
                a: f32_buf(t(value_heads))?,
                b: f32_buf(t(value_heads))?,
                g: f32_buf(t(value_heads))?,
                beta: f32_buf(t(value_heads))?,
                attn_gate: f32_buf(t(q_dim))?,
                attn_gated: f32_buf(t(q_dim))?,
                shared_gate: f32_buf(t(1))?,
            },
            shared_out: f32_buf(if shared_inter > 0 { tokens * h } else { 1 })?,
            x: f32_buf(tokens * h)?,
            h: backend.take_buffer(norm_out, (tokens * h).max(1), BufferUsage::Activations)?,
            out: f32_buf(tokens * h)?,
            q: f32_buf(tokens * (q_dim + 2 * kv_dim))?,
            k: f32_buf(tokens * kv_dim)?,
            v: f32_buf(tokens * kv_dim)?,
            q_normed: f32_buf(tokens * q_dim)?,
            k_normed: f32_buf(tokens * kv_dim)?,
            // The hybrids gate the attention's output first (in f32); Qwen3 projects it at
            // once, so it takes the projections' input type.
            attn: if hybrid {
                f32_buf(tokens * q_dim)?
            } else {
                backend.take_buffer(norm_out, (tokens * q_dim).max(1), BufferUsage::Activations)?
            },
            gate: f32_buf(tokens * inter)?,
            up: f32_buf(tokens * inter)?,
            act: f32_buf(tokens * inter)?,
            router_logits: f32_buf(tokens * experts)?,
            expert_ids: u32_buf(tokens * top_k)?,
            expert_weights: f32_buf(pairs)?,
            moe: MoeScratch {
                expert_offsets: u32_buf(experts + 1)?,
                hit_experts: u32_buf(experts + 1)?,
                sorted_pairs: u32_buf(pairs)?,
                pair_positions: u32_buf(pairs)?,
                act: f32_buf(pairs * moe_inter)?,
                y: f32_buf(pairs * h)?,
            },
            rows: f32_buf(logit_rows * h)?,
            rows_normed: f32_buf(logit_rows * h)?,
            logits: f32_buf(logit_rows * config.vocab_size)?,
            draws: u32_buf(logit_rows * DRAW_WORDS)?,
            candidates: u32_buf(logit_rows * CANDIDATE_ROW_WORDS)?,
            all_hidden: None,
            mtp_input: None,
        })
    }

    /// Bytes of every buffer held.
    pub(crate) fn size_bytes(&self) -> usize {
        let mut total = 0;
        for_each_buffer!(self, [&], |b: &DeviceBuffer| total += b.size_bytes());
        total
            + [&self.all_hidden, &self.mtp_input]
                .into_iter()
                .flatten()
                .map(DeviceBuffer::size_bytes)
                .sum::<usize>()
    }

    /// Gives every buffer back to the pool.
    pub(crate) fn give(mut self, backend: &dyn Backend) {
        for b in [self.all_hidden.take(), self.mtp_input.take()]
            .into_iter()
            .flatten()
        {
            backend.give_buffer(b);
        }
        for_each_buffer!(self, [], |b: DeviceBuffer| backend.give_buffer(b));
    }
}
