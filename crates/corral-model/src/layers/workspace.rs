//! Activation buffers of one forward pass, taken from the backend's pool at its start and
//! given back at its end, so that steady-state forwards allocate nothing.

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
}

/// Scratch of the grouped MoE strategy, in sorted-pair order.
pub(crate) struct MoeScratch {
    pub(crate) expert_offsets: DeviceBuffer,
    pub(crate) sorted_pairs: DeviceBuffer,
    pub(crate) pair_positions: DeviceBuffer,
    /// `[pairs, moe_intermediate]`.
    pub(crate) act: DeviceBuffer,
    /// `[pairs, hidden]`.
    pub(crate) y: DeviceBuffer,
}

/// Every activation buffer a layer may need, sized for `tokens`.
pub(crate) struct Workspace {
    pub(crate) batch: BatchBuffers,
    /// Columns of the padded block tables.
    pub(crate) table_width: usize,
    /// Rows whose logits are wanted.
    pub(crate) num_logit_rows: usize,
    /// Residual stream `[T, H]`.
    pub(crate) x: DeviceBuffer,
    /// Normalised input of a sub-block `[T, H]`.
    pub(crate) h: DeviceBuffer,
    /// Output of a sub-block `[T, H]`.
    pub(crate) out: DeviceBuffer,
    pub(crate) q: DeviceBuffer,
    pub(crate) k: DeviceBuffer,
    pub(crate) v: DeviceBuffer,
    pub(crate) q_normed: DeviceBuffer,
    pub(crate) k_normed: DeviceBuffer,
    pub(crate) attn: DeviceBuffer,
    pub(crate) gate: DeviceBuffer,
    pub(crate) up: DeviceBuffer,
    pub(crate) act: DeviceBuffer,
    pub(crate) router_logits: DeviceBuffer,
    pub(crate) expert_ids: DeviceBuffer,
    pub(crate) expert_weights: DeviceBuffer,
    pub(crate) moe: MoeScratch,
    /// Final-norm input rows whose logits are wanted `[R, H]`, and their norm.
    pub(crate) rows: DeviceBuffer,
    pub(crate) rows_normed: DeviceBuffer,
    pub(crate) logits: DeviceBuffer,
}

impl Workspace {
    /// Takes every buffer from the pool.
    pub(crate) fn take(
        backend: &dyn Backend,
        config: &ModelConfig,
        tokens: usize,
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
        let inter = config.intermediate_size.max(1);
        let (experts, top_k, moe_inter) = config.moe.as_ref().map_or((1, 1, 1), |m| {
            (m.num_experts, m.top_k, m.moe_intermediate_size)
        });
        let pairs = tokens * top_k;
        Ok(Self {
            table_width,
            num_logit_rows: logit_rows,
            batch: BatchBuffers {
                ids: u32_buf(tokens)?,
                positions: u32_buf(tokens)?,
                token_runs: u32_buf(tokens)?,
                slots: u32_buf(tokens)?,
                block_tables: u32_buf(runs * table_width)?,
                logit_rows: u32_buf(logit_rows)?,
            },
            x: f32_buf(tokens * h)?,
            h: f32_buf(tokens * h)?,
            out: f32_buf(tokens * h)?,
            q: f32_buf(tokens * q_dim)?,
            k: f32_buf(tokens * kv_dim)?,
            v: f32_buf(tokens * kv_dim)?,
            q_normed: f32_buf(tokens * q_dim)?,
            k_normed: f32_buf(tokens * kv_dim)?,
            attn: f32_buf(tokens * q_dim)?,
            gate: f32_buf(tokens * inter)?,
            up: f32_buf(tokens * inter)?,
            act: f32_buf(tokens * inter)?,
            router_logits: f32_buf(tokens * experts)?,
            expert_ids: u32_buf(tokens * top_k)?,
            expert_weights: f32_buf(pairs)?,
            moe: MoeScratch {
                expert_offsets: u32_buf(experts + 1)?,
                sorted_pairs: u32_buf(pairs)?,
                pair_positions: u32_buf(pairs)?,
                act: f32_buf(pairs * moe_inter)?,
                y: f32_buf(pairs * h)?,
            },
            rows: f32_buf(logit_rows * h)?,
            rows_normed: f32_buf(logit_rows * h)?,
            logits: f32_buf(logit_rows * config.vocab_size)?,
        })
    }

    /// Gives every buffer back to the pool.
    pub(crate) fn give(self, backend: &dyn Backend) {
        let b = self.batch;
        for buf in [
            b.ids,
            b.positions,
            b.token_runs,
            b.slots,
            b.block_tables,
            b.logit_rows,
            self.x,
            self.h,
            self.out,
            self.q,
            self.k,
            self.v,
            self.q_normed,
            self.k_normed,
            self.attn,
            self.gate,
            self.up,
            self.act,
            self.router_logits,
            self.expert_ids,
            self.expert_weights,
            self.moe.expert_offsets,
            self.moe.sorted_pairs,
            self.moe.pair_positions,
            self.moe.act,
            self.moe.y,
            self.rows,
            self.rows_normed,
            self.logits,
        ] {
            backend.give_buffer(buf);
        }
    }
}
