//! The op entry points the model calls, on `dyn Backend`: the one place where an op's
//! arguments can be checked for every backend before the backend's [`Ops`] run. Each entry
//! forwards to the backend now, whose own checks still run; the checks move here op by op.

use crate::{
    AttentionMeta, AttentionShape, Backend, DeltaNetShape, DeviceBuffer, ExpertWeights, MoeRouting,
    MoeSorted, QkShape, RecurrentRuns, Result, RopeParams, WeightView,
};

impl<'b> dyn Backend + 'b {
    /// [`Ops::fill_zero`](crate::Ops::fill_zero).
    pub fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()> {
        self.ops().fill_zero(buffer, len)
    }

    /// [`Ops::embedding`](crate::Ops::embedding).
    pub fn embedding(
        &self,
        table: WeightView<'_>,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().embedding(table, ids, tokens, out)
    }

    /// [`Ops::gather_rows`](crate::Ops::gather_rows).
    pub fn gather_rows(
        &self,
        x: &DeviceBuffer,
        row_ids: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().gather_rows(x, row_ids, num_rows, dim, out)
    }

    /// [`Ops::gather_blocks`](crate::Ops::gather_blocks).
    pub fn gather_blocks(
        &self,
        paged: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        packed: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .gather_blocks(paged, ids, count, block_elems, packed)
    }

    /// [`Ops::scatter_blocks`](crate::Ops::scatter_blocks).
    pub fn scatter_blocks(
        &self,
        packed: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        paged: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .scatter_blocks(packed, ids, count, block_elems, paged)
    }

    /// [`Ops::copy_within`](crate::Ops::copy_within).
    pub fn copy_within(
        &self,
        x: &mut DeviceBuffer,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<()> {
        self.ops().copy_within(x, src, dst, len)
    }

    /// [`Ops::rms_norm`](crate::Ops::rms_norm).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .rms_norm(x, weight, rows, dim, eps, offset_one, out)
    }

    /// [`Ops::matmul`](crate::Ops::matmul).
    pub fn matmul(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().matmul(x, rows, w, out)
    }

    /// [`Ops::matmul_parts`](crate::Ops::matmul_parts).
    pub fn matmul_parts(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        (parts, cols): (&[(DeviceBuffer, usize)], usize),
        out: &mut DeviceBuffer,
        out_cols: usize,
    ) -> Result<()> {
        self.ops()
            .matmul_parts(x, rows, (parts, cols), out, out_cols)
    }

    /// [`Ops::matmul_columns`](crate::Ops::matmul_columns).
    pub fn matmul_columns(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
        out_cols: usize,
        col0: usize,
    ) -> Result<()> {
        self.ops().matmul_columns(x, rows, w, out, out_cols, col0)
    }

    /// [`Ops::matmuls`](crate::Ops::matmuls).
    pub fn matmuls(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        weights: &[WeightView<'_>],
        outs: &mut [&mut DeviceBuffer],
    ) -> Result<()> {
        self.ops().matmuls(x, rows, weights, outs)
    }

    /// [`Ops::add_in_place`](crate::Ops::add_in_place).
    pub fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        self.ops().add_in_place(acc, x, len)
    }

    /// [`Ops::add_rms_norm`](crate::Ops::add_rms_norm).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .add_rms_norm(acc, x, weight, rows, dim, eps, offset_one, out)
    }

    /// [`Ops::silu_mul`](crate::Ops::silu_mul).
    pub fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().silu_mul(gate, up, len, out)
    }

    /// [`Ops::rope`](crate::Ops::rope).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut DeviceBuffer,
        positions: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        rope: RopeParams,
    ) -> Result<()> {
        self.ops()
            .rope(x, positions, tokens, heads, head_dim, rotary_dim, rope)
    }

    /// [`Ops::kv_store`](crate::Ops::kv_store).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        k: &DeviceBuffer,
        v: &DeviceBuffer,
        slots: &DeviceBuffer,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .kv_store(k, v, slots, tokens, kv_heads, head_dim, cache_k, cache_v)
    }

    /// [`Ops::qkv_norm_rope_store`](crate::Ops::qkv_norm_rope_store).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_norm_rope_store(
        &self,
        qkv: &DeviceBuffer,
        q_weight: &DeviceBuffer,
        k_weight: &DeviceBuffer,
        positions: &DeviceBuffer,
        slots: &DeviceBuffer,
        shape: QkShape,
        q_out: &mut DeviceBuffer,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().qkv_norm_rope_store(
            qkv, q_weight, k_weight, positions, slots, shape, q_out, cache_k, cache_v,
        )
    }

    /// [`Ops::paged_attention`](crate::Ops::paged_attention).
    pub fn paged_attention(
        &self,
        q: &DeviceBuffer,
        cache_k: &DeviceBuffer,
        cache_v: &DeviceBuffer,
        meta: &AttentionMeta<'_>,
        shape: AttentionShape,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .paged_attention(q, cache_k, cache_v, meta, shape, out)
    }

    /// [`Ops::moe_route`](crate::Ops::moe_route).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        logits: &DeviceBuffer,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
        shared_gate: bool,
        expert_ids: &mut DeviceBuffer,
        expert_weights: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().moe_route(
            logits,
            tokens,
            num_experts,
            top_k,
            renormalize,
            shared_gate,
            expert_ids,
            expert_weights,
        )
    }

    /// [`Ops::scale_scatter_add`](crate::Ops::scale_scatter_add).
    #[allow(clippy::too_many_arguments)]
    pub fn scale_scatter_add(
        &self,
        y: &DeviceBuffer,
        rows: &DeviceBuffer,
        scales: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .scale_scatter_add(y, rows, scales, num_rows, dim, out)
    }

    /// [`Ops::moe_sort`](crate::Ops::moe_sort).
    pub fn moe_sort(
        &self,
        routing: MoeRouting<'_>,
        num_experts: usize,
        expert_offsets: &mut DeviceBuffer,
        hit_experts: &mut DeviceBuffer,
        sorted_pairs: &mut DeviceBuffer,
        pair_positions: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().moe_sort(
            routing,
            num_experts,
            expert_offsets,
            hit_experts,
            sorted_pairs,
            pair_positions,
        )
    }

    /// [`Ops::moe_grouped_gate_up`](crate::Ops::moe_grouped_gate_up).
    pub fn moe_grouped_gate_up(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .moe_grouped_gate_up(x, routing, sorted, experts, act)
    }

    /// [`Ops::moe_grouped_down`](crate::Ops::moe_grouped_down).
    pub fn moe_grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .moe_grouped_down(act, routing, sorted, experts, y)
    }

    /// [`Ops::moe_combine`](crate::Ops::moe_combine).
    pub fn moe_combine(
        &self,
        y: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().moe_combine(y, routing, sorted, hidden, out)
    }

    /// [`Ops::moe_grouped_down_combine`](crate::Ops::moe_grouped_down_combine).
    pub fn moe_grouped_down_combine(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .moe_grouped_down_combine(act, routing, sorted, experts, y, out)
    }

    /// [`Ops::sigmoid_mul`](crate::Ops::sigmoid_mul).
    pub fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().sigmoid_mul(x, gate, len, out)
    }

    /// [`Ops::add_sigmoid_gated`](crate::Ops::add_sigmoid_gated).
    pub fn add_sigmoid_gated(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        self.ops().add_sigmoid_gated(acc, x, gate, rows, dim)
    }

    /// [`Ops::causal_conv1d`](crate::Ops::causal_conv1d).
    #[allow(clippy::too_many_arguments)]
    pub fn causal_conv1d(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        channels: usize,
        kernel: usize,
        runs: RecurrentRuns<'_>,
        conv_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .causal_conv1d(x, weight, channels, kernel, runs, conv_state, out)
    }

    /// [`Ops::delta_net_gates`](crate::Ops::delta_net_gates).
    #[allow(clippy::too_many_arguments)]
    pub fn delta_net_gates(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        a_log: &DeviceBuffer,
        dt_bias: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        g: &mut DeviceBuffer,
        beta: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .delta_net_gates(a, b, a_log, dt_bias, tokens, heads, g, beta)
    }

    /// [`Ops::gated_delta_rule`](crate::Ops::gated_delta_rule).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_rule(
        &self,
        qkv: &DeviceBuffer,
        g: &DeviceBuffer,
        beta: &DeviceBuffer,
        shape: DeltaNetShape,
        runs: RecurrentRuns<'_>,
        recurrent_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .gated_delta_rule(qkv, g, beta, shape, runs, recurrent_state, out)
    }

    /// [`Ops::gated_rms_norm`](crate::Ops::gated_rms_norm).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rms_norm(
        &self,
        x: &DeviceBuffer,
        z: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().gated_rms_norm(x, z, weight, rows, dim, eps, out)
    }

    /// [`Ops::logit_penalties`](crate::Ops::logit_penalties).
    pub fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        self.ops().logit_penalties(logits, len, entries, n)
    }

    /// [`Ops::top_candidates`](crate::Ops::top_candidates).
    pub fn top_candidates(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        draws: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops().top_candidates(logits, rows, vocab, draws, out)
    }

    /// [`Ops::moe_experts_per_token`](crate::Ops::moe_experts_per_token).
    pub fn moe_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.ops()
            .moe_experts_per_token(x, routing, experts, act, out)
    }
}
