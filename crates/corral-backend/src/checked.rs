//! The op entry points the model calls, on `dyn Backend`: the one place where an op's
//! arguments are checked for every backend (the buffers' element types and lengths against
//! the shape, the shape itself, and the weights' types against what the device reads)
//! before the backend's [`Ops`](crate::Ops) run, so that a backend computes only. What is
//! left to a backend is the values inside buffers (token ids, slots, expert ids, sorted
//! offsets), which it checks as it reads them: the CPU on the host, a GPU on the device.

use crate::ops::{check_block_copy, check_copy_ranges};
use crate::sampling::{CANDIDATE_ROW_WORDS, DRAW_WORDS, MAX_REDUCED_VOCAB};
use crate::{
    AttentionMeta, AttentionShape, Backend, BackendError, DType, DeltaNetShape, DeviceBuffer,
    ExpertWeights, MoeRouting, MoeSorted, QkShape, RecurrentRuns, Result, RopeParams, WeightView,
    kv_row_elems,
};

impl<'b> dyn Backend + 'b {
    /// [`Ops::fill_zero`](crate::Ops::fill_zero).
    pub fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()> {
        holds("fill_zero", "buffer", buffer, DType::F32, len)?;
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
        let op = "embedding";
        whole_blocks(op, table)?;
        holds(op, "ids", ids, DType::U32, tokens)?;
        holds(op, "out", out, DType::F32, tokens * table.cols)?;
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
        let op = "gather_rows";
        holds(op, "x", x, DType::F32, dim)?;
        holds(op, "row_ids", row_ids, DType::U32, num_rows)?;
        holds(op, "out", out, DType::F32, num_rows * dim)?;
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
        let op = "gather_blocks";
        check_block_copy(op, paged, packed, count, block_elems)?;
        holds(op, "ids", ids, DType::U32, count)?;
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
        let op = "scatter_blocks";
        check_block_copy(op, paged, packed, count, block_elems)?;
        holds(op, "ids", ids, DType::U32, count)?;
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
        check_copy_ranges("copy_within", x.len(), src, dst, len)?;
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
        let op = "rms_norm";
        holds(op, "x", x, DType::F32, rows * dim)?;
        holds(op, "weight", weight, DType::F32, dim)?;
        self.projection_input(op, "out", out, rows * dim)?;
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
        let op = "matmul";
        self.projection(op, x, rows, w)?;
        holds(op, "out", out, DType::F32, rows * w.rows)?;
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
        let op = "matmul_parts";
        let total: usize = parts.iter().map(|(_, part_rows)| part_rows).sum();
        if total > out_cols {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("parts of {total} rows into rows {out_cols} wide"),
            });
        }
        self.projection_input(op, "x", x, rows * cols)?;
        for (buffer, part_rows) in parts {
            let part = WeightView {
                buffer,
                offset: 0,
                rows: *part_rows,
                cols,
            };
            self.weights(op, part)?;
        }
        holds(op, "out", out, DType::F32, rows * out_cols)?;
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
        let op = "matmul_columns";
        if col0 + w.rows > out_cols {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("columns {col0}..{} of rows {out_cols} wide", col0 + w.rows),
            });
        }
        self.projection(op, x, rows, w)?;
        holds(op, "out", out, DType::F32, rows * out_cols)?;
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
        let op = "matmuls";
        crate::ops::matmuls_arity(weights.len(), outs.len())?;
        for (w, out) in weights.iter().zip(outs.iter()) {
            self.projection(op, x, rows, *w)?;
            holds(op, "out", out, DType::F32, rows * w.rows)?;
        }
        self.ops().matmuls(x, rows, weights, outs)
    }

    /// [`Ops::add_in_place`](crate::Ops::add_in_place).
    pub fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        let op = "add_in_place";
        holds(op, "acc", acc, DType::F32, len)?;
        holds(op, "x", x, DType::F32, len)?;
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
        let op = "add_rms_norm";
        holds(op, "acc", acc, DType::F32, rows * dim)?;
        holds(op, "x", x, DType::F32, rows * dim)?;
        holds(op, "weight", weight, DType::F32, dim)?;
        self.projection_input(op, "out", out, rows * dim)?;
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
        let op = "silu_mul";
        holds(op, "gate", gate, DType::F32, len)?;
        holds(op, "up", up, DType::F32, len)?;
        holds(op, "out", out, DType::F32, len)?;
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
        let op = "rope";
        heads_of(op, head_dim, rotary_dim)?;
        holds(op, "x", x, DType::F32, tokens * heads * head_dim)?;
        holds(op, "positions", positions, DType::U32, tokens)?;
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
        let op = "kv_store";
        heads_of(op, head_dim, 0)?;
        self.kv_cache(op, cache_k, cache_v, kv_heads, head_dim)?;
        holds(op, "k", k, DType::F32, tokens * kv_heads * head_dim)?;
        holds(op, "v", v, DType::F32, tokens * kv_heads * head_dim)?;
        holds(op, "slots", slots, DType::U32, tokens)?;
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
        let op = "qkv_norm_rope_store";
        let QkShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
            ..
        } = shape;
        heads_of(op, head_dim, rotary_dim)?;
        self.kv_cache(op, cache_k, cache_v, kv_heads, head_dim)?;
        let per_token = (heads + 2 * kv_heads) * head_dim;
        holds(op, "qkv", qkv, DType::F32, tokens * per_token)?;
        holds(op, "q_weight", q_weight, DType::F32, head_dim)?;
        holds(op, "k_weight", k_weight, DType::F32, head_dim)?;
        holds(op, "positions", positions, DType::U32, tokens)?;
        holds(op, "slots", slots, DType::U32, tokens)?;
        holds(op, "q_out", q_out, DType::F32, tokens * heads * head_dim)?;
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
        let op = "paged_attention";
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            ..
        } = shape;
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) || meta.block_size == 0 {
            return Err(BackendError::BadArgument {
                op,
                detail: format!(
                    "{num_heads} heads over {num_kv_heads} KV heads, blocks of {} tokens",
                    meta.block_size
                ),
            });
        }
        heads_of(op, head_dim, 0)?;
        self.kv_cache(op, cache_k, cache_v, num_kv_heads, head_dim)?;
        let tokens = meta.tokens;
        holds(op, "q", q, DType::F32, tokens * num_heads * head_dim)?;
        self.projection_input(op, "out", out, tokens * num_heads * head_dim)?;
        holds(op, "positions", meta.positions, DType::U32, tokens)?;
        holds(op, "token_runs", meta.token_runs, DType::U32, tokens)?;
        // At least one run's table where there are tokens (each token's run is read on the
        // device, or by the CPU as it computes).
        let tables = if tokens > 0 {
            meta.max_blocks_per_run
        } else {
            0
        };
        holds(op, "block_tables", meta.block_tables, DType::U32, tables)?;
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
        let op = "moe_route";
        if top_k == 0 || top_k > num_experts || num_experts > MAX_EXPERTS {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("top {top_k} of {num_experts} experts (at most {MAX_EXPERTS})"),
            });
        }
        let (row, choices) = (
            num_experts + usize::from(shared_gate),
            top_k + usize::from(shared_gate),
        );
        holds(op, "logits", logits, DType::F32, tokens * row)?;
        holds(op, "expert_ids", expert_ids, DType::U32, tokens * choices)?;
        holds(
            op,
            "expert_weights",
            expert_weights,
            DType::F32,
            tokens * choices,
        )?;
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
        let op = "scale_scatter_add";
        holds(op, "y", y, DType::F32, num_rows * dim)?;
        holds(op, "rows", rows, DType::U32, num_rows)?;
        holds(op, "scales", scales, DType::F32, num_rows)?;
        holds(op, "out", out, DType::F32, dim)?;
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
        let op = "moe_sort";
        expert_count(op, num_experts)?;
        let pairs = routing.tokens * routing.top_k;
        holds(op, "expert_ids", routing.expert_ids, DType::U32, pairs)?;
        let sorted = MoeSorted {
            expert_offsets,
            hit_experts,
            sorted_pairs,
            pair_positions,
        };
        sorted_of(op, sorted, num_experts, pairs)?;
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
        let op = "moe_grouped_gate_up";
        let (num_experts, inter, hidden) = self.experts(op, experts)?;
        let pairs = routing_of(op, routing)?;
        sorted_of(op, sorted, num_experts, pairs)?;
        self.projection_input(op, "x", x, routing.tokens * hidden)?;
        holds(op, "act", act, DType::F32, pairs * inter)?;
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
        let op = "moe_grouped_down";
        self.grouped_down(op, act, routing, sorted, experts, y)?;
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
        combine_of("moe_combine", y, routing, sorted, hidden, out)?;
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
        let op = "moe_grouped_down_combine";
        let hidden = self.grouped_down(op, act, routing, sorted, experts, y)?;
        combine_of(op, y, routing, sorted, hidden, out)?;
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
        let op = "sigmoid_mul";
        holds(op, "x", x, DType::F32, len)?;
        holds(op, "gate", gate, DType::F32, len)?;
        holds(op, "out", out, DType::F32, len)?;
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
        let op = "add_sigmoid_gated";
        holds(op, "acc", acc, DType::F32, rows * dim)?;
        holds(op, "x", x, DType::F32, rows * dim)?;
        holds(op, "gate", gate, DType::F32, rows)?;
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
        let op = "causal_conv1d";
        if !(2..=MAX_CONV_KERNEL).contains(&kernel) || channels == 0 {
            return Err(BackendError::BadArgument {
                op,
                detail: format!(
                    "a kernel of {kernel} (2 to {MAX_CONV_KERNEL}) over {channels} channels"
                ),
            });
        }
        let tokens = x.len() / channels;
        holds(op, "x", x, DType::F32, tokens * channels)?;
        holds(op, "weight", weight, DType::F32, channels * kernel)?;
        holds(
            op,
            "conv_state",
            conv_state,
            DType::F32,
            channels * (kernel - 1),
        )?;
        holds(op, "out", out, DType::F32, tokens * channels)?;
        runs_of(op, runs)?;
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
        let op = "delta_net_gates";
        for (what, buffer) in [("a", a), ("b", b)] {
            holds(op, what, buffer, DType::F32, tokens * heads)?;
        }
        holds(op, "a_log", a_log, DType::F32, heads)?;
        holds(op, "dt_bias", dt_bias, DType::F32, heads)?;
        holds(op, "g", g, DType::F32, tokens * heads)?;
        holds(op, "beta", beta, DType::F32, tokens * heads)?;
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
        let op = "gated_delta_rule";
        let DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        } = shape;
        if nk == 0
            || !nv.is_multiple_of(nk)
            || !(1..=MAX_DELTA_KEY_DIM).contains(&dk)
            || !(1..=MAX_DELTA_VALUE_DIM).contains(&dv)
        {
            return Err(BackendError::BadArgument {
                op,
                detail: format!(
                    "{nv} value heads of {dv} over {nk} key heads of {dk} (key dim at most \
                     {MAX_DELTA_KEY_DIM}, value dim at most {MAX_DELTA_VALUE_DIM}, value heads a \
                     multiple of key heads)"
                ),
            });
        }
        let width = 2 * nk * dk + nv * dv;
        let tokens = qkv.len() / width;
        holds(op, "qkv", qkv, DType::F32, tokens * width)?;
        holds(op, "g", g, DType::F32, tokens * nv)?;
        holds(op, "beta", beta, DType::F32, tokens * nv)?;
        holds(
            op,
            "recurrent_state",
            recurrent_state,
            DType::F32,
            nv * dk * dv,
        )?;
        holds(op, "out", out, DType::F32, tokens * nv * dv)?;
        runs_of(op, runs)?;
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
        let op = "gated_rms_norm";
        holds(op, "x", x, DType::F32, rows * dim)?;
        holds(op, "z", z, DType::F32, rows * dim)?;
        holds(op, "weight", weight, DType::F32, dim)?;
        holds(op, "out", out, DType::F32, rows * dim)?;
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
        let op = "logit_penalties";
        holds(op, "logits", logits, DType::F32, len)?;
        holds(op, "entries", entries, DType::U32, n * DRAW_WORDS)?;
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
        let op = "top_candidates";
        if !(1..=MAX_REDUCED_VOCAB).contains(&vocab) {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("a vocabulary of {vocab} (1 to {MAX_REDUCED_VOCAB})"),
            });
        }
        holds(op, "logits", logits, DType::F32, rows * vocab)?;
        holds(op, "draws", draws, DType::U32, rows * DRAW_WORDS)?;
        holds(op, "out", out, DType::U32, rows * CANDIDATE_ROW_WORDS)?;
        self.ops().top_candidates(logits, rows, vocab, draws, out)
    }

    /// [`Ops::argmax`](crate::Ops::argmax).
    pub fn argmax(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        ids: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "argmax";
        if vocab == 0 || u32::try_from(vocab).is_err() {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("a vocabulary of {vocab} (1 to {})", u32::MAX),
            });
        }
        holds(op, "logits", logits, DType::F32, rows * vocab)?;
        holds(op, "ids", ids, DType::U32, rows)?;
        self.ops().argmax(logits, rows, vocab, ids)
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
        let op = "moe_experts_per_token";
        let (_, inter, hidden) = self.experts(op, experts)?;
        let pairs = routing_of(op, routing)?;
        holds(op, "x", x, DType::F32, routing.tokens * hidden)?;
        holds(op, "act", act, DType::F32, pairs * inter)?;
        holds(op, "out", out, DType::F32, routing.tokens * hidden)?;
        self.ops()
            .moe_experts_per_token(x, routing, experts, act, out)
    }

    /// Checks a layer's KV cache: both halves of one element type the device keeps caches in,
    /// each at least one row of `kv_heads` heads of `head_dim`.
    fn kv_cache(
        &self,
        op: &'static str,
        cache_k: &DeviceBuffer,
        cache_v: &DeviceBuffer,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let dtype = cache_k.dtype();
        if !self.capabilities().kv_dtypes.contains(&dtype) {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("a KV cache of {dtype}, which this device does not keep"),
            });
        }
        if dtype == DType::F8E4M3 && !head_dim.is_multiple_of(4) {
            return Err(BackendError::BadArgument {
                op,
                detail: format!(
                    "an fp8 KV cache needs a head dim that is a multiple of 4, not {head_dim}"
                ),
            });
        }
        let row = kv_row_elems(dtype, kv_heads, head_dim);
        holds(op, "cache_k", cache_k, dtype, row)?;
        holds(op, "cache_v", cache_v, dtype, row)
    }

    /// Checks the output of an op whose output projections read (a norm, attention): f32,
    /// or bf16 where the device writes such outputs so
    /// ([`Capabilities::bf16_projection_inputs`](crate::Capabilities::bf16_projection_inputs)).
    fn projection_input(
        &self,
        op: &'static str,
        what: &'static str,
        b: &DeviceBuffer,
        needed: usize,
    ) -> Result<()> {
        let dtype = b.dtype();
        let bf16 = dtype == DType::BF16 && self.capabilities().bf16_projection_inputs;
        if dtype != DType::F32 && !bf16 {
            return Err(BackendError::WrongDType {
                op,
                expected: DType::F32,
                got: dtype,
            });
        }
        holds(op, what, b, dtype, needed)
    }

    /// Checks a projection of `rows` rows of `x` by `w`: the weights as [`Self::weights`], x
    /// as a projection's input.
    fn projection(
        &self,
        op: &'static str,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
    ) -> Result<()> {
        self.weights(op, w)?;
        self.projection_input(op, "x", x, rows * w.cols)
    }

    /// Checks a weight matrix: of a float type or a block format the device reads, in whole
    /// blocks, and within its buffer.
    fn weights(&self, op: &'static str, w: WeightView<'_>) -> Result<()> {
        self.weight_type(op, w.buffer.dtype())?;
        whole_blocks(op, w)?;
        let needed = w.offset + w.rows * w.cols;
        if needed > w.buffer.len() {
            return Err(BackendError::TooSmall {
                op,
                what: "weights",
                len: w.buffer.len(),
                needed,
            });
        }
        Ok(())
    }

    /// Checks that weights of `dtype` are read by the device as they are: a float type, or
    /// a block format of [`Capabilities::weight_formats`](crate::Capabilities::weight_formats).
    pub(crate) fn weight_type(&self, op: &'static str, dtype: DType) -> Result<()> {
        let readable = match dtype {
            DType::F32 | DType::BF16 | DType::F16 => true,
            DType::Quant(format) => self.capabilities().reads(format),
            DType::U32 | DType::F8E4M3 => false,
        };
        if readable {
            return Ok(());
        }
        Err(BackendError::BadArgument {
            op,
            detail: format!("weights of {dtype}, which this device does not read"),
        })
    }

    /// Checks a layer's experts (`(experts, intermediate, hidden)`, returned): gate and up
    /// `[intermediate, hidden]`, down `[hidden, intermediate]`, as many of each, and every
    /// projection of a type the device reads (which types a backend's kernels pair is its own). Each projection's experts share its
    /// type and whole blocks ([`ExpertMatrices`](crate::ExpertMatrices) is made so).
    fn experts(&self, op: &'static str, experts: &ExpertWeights) -> Result<(usize, usize, usize)> {
        let ExpertWeights { gate, up, down } = experts;
        let (num_experts, inter, hidden) = (gate.num_experts(), gate.rows(), gate.cols());
        let shaped = up.num_experts() == num_experts
            && down.num_experts() == num_experts
            && (up.rows(), up.cols()) == (inter, hidden)
            && (down.rows(), down.cols()) == (hidden, inter);
        if !shaped {
            return Err(BackendError::BadArgument {
                op,
                detail: format!(
                    "experts of mismatched projections: gate {num_experts} x [{inter}, {hidden}], \
                     up {} x [{}, {}], down {} x [{}, {}]",
                    up.num_experts(),
                    up.rows(),
                    up.cols(),
                    down.num_experts(),
                    down.rows(),
                    down.cols()
                ),
            });
        }
        expert_count(op, num_experts)?;
        for matrices in [gate, up, down] {
            if let Some(dtype) = matrices.dtype() {
                self.weight_type(op, dtype)?;
            }
        }
        Ok((num_experts, inter, hidden))
    }

    /// Checks a grouped down projection's arguments; its hidden size.
    fn grouped_down(
        &self,
        op: &'static str,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &DeviceBuffer,
    ) -> Result<usize> {
        let (num_experts, inter, hidden) = self.experts(op, experts)?;
        let pairs = routing_of(op, routing)?;
        sorted_of(op, sorted, num_experts, pairs)?;
        holds(op, "act", act, DType::F32, pairs * inter)?;
        holds(op, "y", y, DType::F32, pairs * hidden)?;
        Ok(hidden)
    }
}

/// Checks a layer's expert count: 1 to [`MAX_EXPERTS`].
fn expert_count(op: &'static str, num_experts: usize) -> Result<()> {
    if (1..=MAX_EXPERTS).contains(&num_experts) {
        return Ok(());
    }
    Err(BackendError::BadArgument {
        op,
        detail: format!("{num_experts} experts (1 to {MAX_EXPERTS})"),
    })
}

/// Checks a routing's ids and weights, a row of `top_k` a token; the routed pairs.
fn routing_of(op: &'static str, routing: MoeRouting<'_>) -> Result<usize> {
    let pairs = routing.tokens * routing.top_k;
    holds(op, "expert_ids", routing.expert_ids, DType::U32, pairs)?;
    holds(
        op,
        "expert_weights",
        routing.expert_weights,
        DType::F32,
        pairs,
    )?;
    Ok(pairs)
}

/// Checks the routed pairs sorted by expert: offsets and hit experts one more than the
/// experts, the permutation and its inverse a word a pair. Their values are the backend's
/// to check as it reads them.
fn sorted_of(
    op: &'static str,
    sorted: MoeSorted<'_>,
    num_experts: usize,
    pairs: usize,
) -> Result<()> {
    let words = [
        ("expert_offsets", sorted.expert_offsets, num_experts + 1),
        ("hit_experts", sorted.hit_experts, num_experts + 1),
        ("sorted_pairs", sorted.sorted_pairs, pairs),
        ("pair_positions", sorted.pair_positions, pairs),
    ];
    for (what, buffer, needed) in words {
        holds(op, what, buffer, DType::U32, needed)?;
    }
    Ok(())
}

/// Checks a combine of the pairs' rows `y` (`[pairs, hidden]`, sorted) into `out`
/// (`[tokens, hidden]`) through the pairs' sorted positions.
fn combine_of(
    op: &'static str,
    y: &DeviceBuffer,
    routing: MoeRouting<'_>,
    sorted: MoeSorted<'_>,
    hidden: usize,
    out: &DeviceBuffer,
) -> Result<()> {
    let pairs = routing.tokens * routing.top_k;
    holds(op, "y", y, DType::F32, pairs * hidden)?;
    holds(
        op,
        "pair_positions",
        sorted.pair_positions,
        DType::U32,
        pairs,
    )?;
    holds(op, "out", out, DType::F32, routing.tokens * hidden)
}

/// Dimensions of a head at most (every backend's kernels hold a head's row, or its
/// rotation's frequencies, whole).
pub const MAX_HEAD_DIM: usize = 512;

/// Checks a head of `head_dim` (at most [`MAX_HEAD_DIM`]) whose leading `rotary_dim` rotate
/// (even, at most the head).
fn heads_of(op: &'static str, head_dim: usize, rotary_dim: usize) -> Result<()> {
    if head_dim > MAX_HEAD_DIM || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
        return Err(BackendError::BadArgument {
            op,
            detail: format!(
                "head dim {head_dim} (at most {MAX_HEAD_DIM}), rotary dim {rotary_dim} (even, at most the head dim)"
            ),
        });
    }
    Ok(())
}

/// The most experts a MoE layer routes over (every backend's router holds a token's logits).
pub const MAX_EXPERTS: usize = 4096;

/// The widest depthwise convolution kernel (every backend's kernels hold a channel's taps).
pub const MAX_CONV_KERNEL: usize = 16;
/// The largest key dim of a Gated DeltaNet head (every backend's kernels hold a key whole).
pub const MAX_DELTA_KEY_DIM: usize = 128;
/// The largest value dim of a Gated DeltaNet head.
pub const MAX_DELTA_VALUE_DIM: usize = 512;

/// Checks a recurrent op's runs: `[start, len, slot, fresh]` each in u32, and the slots
/// that keep intermediate states, one a run, where given. Their values are the backend's
/// to check as it reads them (the CPU's on the host, a GPU's on the device).
fn runs_of(op: &'static str, runs: RecurrentRuns<'_>) -> Result<()> {
    holds(op, "runs", runs.runs, DType::U32, runs.num_runs * 4)?;
    match runs.kept {
        Some(kept) => holds(op, "kept", kept, DType::U32, runs.num_runs),
        None => Ok(()),
    }
}

/// Checks that `b` holds at least `needed` elements of `dtype`.
pub(crate) fn holds(
    op: &'static str,
    what: &'static str,
    b: &DeviceBuffer,
    dtype: DType,
    needed: usize,
) -> Result<()> {
    if b.dtype() != dtype {
        return Err(BackendError::WrongDType {
            op,
            expected: dtype,
            got: b.dtype(),
        });
    }
    if b.len() < needed {
        return Err(BackendError::TooSmall {
            op,
            what,
            len: b.len(),
            needed,
        });
    }
    Ok(())
}

/// Checks that a weight view's rows start and end on whole blocks of its format, as every
/// reader of them assumes.
pub fn whole_blocks(op: &'static str, w: WeightView<'_>) -> Result<()> {
    let dtype = w.buffer.dtype();
    let block = dtype.block_values();
    if w.offset.is_multiple_of(block) && w.cols.is_multiple_of(block) {
        return Ok(());
    }
    Err(BackendError::BadArgument {
        op,
        detail: format!(
            "{dtype} rows of {} values from value {}: not whole blocks of {block}",
            w.cols, w.offset
        ),
    })
}
