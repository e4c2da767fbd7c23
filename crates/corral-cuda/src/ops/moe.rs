//! Mixture-of-experts: routing, sorting, the grouped and per-token experts. The CUDA backend's
//! host halves: launches of the kernels beside them, on arguments `dyn Backend`'s entries have
//! checked.

use corral_backend::MoeOps;

use crate::*;
impl MoeOps for CudaBackend {
    fn moe_route(
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
        if tokens == 0 {
            return Ok(());
        }
        let args = [
            addr(op, logits)?,
            u32_of(op, tokens)?,
            u32_of(op, num_experts)?,
            u32_of(op, top_k)?,
            Arg::U32(renormalize as u32),
            Arg::U32(shared_gate as u32),
            addr(op, expert_ids)?,
            addr(op, expert_weights)?,
        ];
        // A block per token ranking its experts in one pass (a thread an expert, up to 256)
        // for a few tokens, or up to 128 experts; else a warp per token, eight to a block
        // (ranking costs experts² a token: at 256 experts and 2,048 tokens the warps are
        // faster, at 128 ranking is).
        if (tokens <= RANKED_ROUTE_MAX_TOKENS || num_experts <= RANKED_ROUTE_ALWAYS_EXPERTS)
            && num_experts <= RANKED_ROUTE_MAX_EXPERTS
            && top_k <= RANKED_ROUTE_MAX_CHOICES
        {
            let grid = (grid_of(op, tokens)?, 1, 1);
            let threads = num_experts.next_multiple_of(32).clamp(64, 256) as u32;
            return self.launch(&self.kernels.moe_route_ranked, grid, threads, &args);
        }
        let grid = (grid_of(op, tokens.div_ceil(8))?, 1, 1);
        self.launch(&self.kernels.moe_route, grid, 256, &args)
    }

    fn scale_scatter_add(
        &self,
        y: &DeviceBuffer,
        rows: &DeviceBuffer,
        scales: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "scale_scatter_add";
        if num_rows == 0 || dim == 0 {
            return Ok(());
        }
        let args = [
            addr(op, y)?,
            addr(op, rows)?,
            addr(op, scales)?,
            u32_of(op, num_rows)?,
            u32_of(op, dim)?,
            u32_of(op, out.len() / dim)?,
            addr(op, out)?,
            self.diag(),
        ];
        self.launch(
            &self.kernels.scale_scatter_add,
            (grid_of(op, num_rows)?, 1, 1),
            256,
            &args,
        )
    }

    fn moe_sort(
        &self,
        routing: MoeRouting<'_>,
        num_experts: usize,
        expert_offsets: &mut DeviceBuffer,
        hit_experts: &mut DeviceBuffer,
        sorted_pairs: &mut DeviceBuffer,
        pair_positions: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_sort";
        let pairs = routing.tokens * routing.top_k;
        let args = [
            addr(op, routing.expert_ids)?,
            u32_of(op, pairs)?,
            u32_of(op, num_experts)?,
            addr(op, expert_offsets)?,
            addr(op, hit_experts)?,
            addr(op, sorted_pairs)?,
            addr(op, pair_positions)?,
            self.diag(),
        ];
        // Past one chunk: a block per chunk (at most SORT_MAX_BLOCKS), each counting every
        // pair and placing its own, rather than one block placing them all.
        if pairs > SORT_CHUNK && num_experts <= SORT_CHUNKED_MAX_EXPERTS {
            let chunk = SORT_CHUNK.max(pairs.div_ceil(SORT_MAX_BLOCKS));
            let mut chunked = args.to_vec();
            chunked.insert(3, u32_of(op, chunk)?);
            let grid = (grid_of(op, pairs.div_ceil(chunk))?, 1, 1);
            return self.launch(&self.kernels.moe_sort_chunked, grid, 1024, &chunked);
        }
        self.launch(&self.kernels.moe_sort, (1, 1, 1), 1024, &args)
    }

    fn moe_grouped_gate_up(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_grouped_gate_up";
        let (num_experts, inter, hidden) = (
            experts.gate.num_experts(),
            experts.gate.rows(),
            experts.gate.cols(),
        );
        let pairs = routing.tokens * routing.top_k;
        if pairs == 0 || inter == 0 {
            return Ok(());
        }
        let (gate, gate_dtype, gate_vec) = self.experts(op, &experts.gate)?;
        let (up, up_dtype, up_vec) = self.experts(op, &experts.up)?;
        if gate_dtype != up_dtype {
            return Err(bad(op, "gate and up stored in different types".to_string()));
        }
        if quant::quant_format(gate_dtype).is_some() {
            return self.with_decoded_experts(op, experts, sorted, [true, true, false], |d| {
                self.moe_grouped_gate_up(x, routing, sorted, d, act)
            });
        }
        let kernels = self.kernels.for_weights(op, gate_dtype)?;
        let big = self.big_tiles(op, kernels, experts)?;
        let few_rows = kernels
            .grouped_mvm
            .as_ref()
            .filter(|_| gate_vec && up_vec)
            .zip(few_rows_variant(pairs, num_experts, big.is_some()));
        let x_len = routing.tokens * hidden;
        let x_arg = match x.dtype() {
            // Only the bf16 tiles read x as a norm left it in bf16.
            DType::BF16
                if few_rows.is_some() || big.is_none_or(|b| self.split_tiles(b).is_some()) =>
            {
                return self.with_f32_copy(op, x, x_len, |x32| {
                    self.moe_grouped_gate_up(x32, routing, sorted, experts, act)
                });
            }
            _ => addr(op, x)?,
        };
        let [offsets, hit, sorted_pairs, pairs_a, experts_a] =
            sorted_args(op, sorted, num_experts, pairs)?;
        let args = [
            x_arg,
            u32_of(op, hidden)?,
            u32_of(op, routing.top_k)?,
            offsets,
            hit,
            sorted_pairs,
            pairs_a,
            experts_a,
            gate,
            up,
            u32_of(op, inter)?,
            Arg::U32((gate_vec && up_vec) as u32),
            addr(op, act)?,
            self.diag(),
        ];
        if let Some((mvm, variant)) = few_rows {
            if let Some(stream) = self.streamed_experts(kernels, hidden, routing.tokens) {
                return self.launch(&stream[0], self.stream_grid(op)?, STREAM_THREADS, &args);
            }
            // A block row per expert that can have rows: at most one per routed pair; a
            // block per 8 features of gate and up.
            let grid = (
                grid_of(op, inter.div_ceil(8))?,
                grid_of(op, num_experts.min(pairs))?,
                1,
            );
            return self.launch(&mvm[0][variant], grid, MVM_THREADS, &args);
        }
        if let Some(big) = big {
            let tiles = pairs.div_ceil(BIG_TILE_ROWS) + num_experts.min(pairs);
            let grid = (grid_of(op, tiles)?, grid_of(op, inter.div_ceil(64))?, 1);
            if let Some(split) = self.split_tiles(big) {
                // x as split pairs once, both planes in one pooled buffer.
                let convert = |x2_ptr| {
                    let args = [args[0], Arg::U64(x_len as u64), Arg::Ptr(x2_ptr)];
                    let grid = Self::elementwise_grid(op, x_len.div_ceil(4))?;
                    self.launch(&self.kernels.to_bf16_split, grid, 256, &args)
                };
                return self.with_converted_copy(op, (DType::BF16, 2 * x_len), convert, |x2| {
                    let mut big_args = args;
                    big_args[0] = Arg::Ptr(ptr_of(op, x2)?);
                    self.launch(&split[0], grid, BIG_TILE_THREADS, &big_args)
                });
            }
            // x rounded to bf16 once (the tiles would round it the same way as they stage it).
            if x.dtype() == DType::BF16 {
                return self.launch(&big.bf16[0], grid, BIG_TILE_THREADS, &args);
            }
            return self.with_bf16_copy(op, args[0], x_len, 0, |x16_ptr| {
                let mut big_args = args;
                big_args[0] = Arg::Ptr(x16_ptr);
                self.launch(&big.bf16[0], grid, BIG_TILE_THREADS, &big_args)
            });
        }
        let tiles = pairs.div_ceil(64) + num_experts.min(pairs);
        let grid = (grid_of(op, tiles)?, grid_of(op, inter.div_ceil(64))?, 1);
        self.launch(&kernels.grouped_gate_up, grid, 128, &args)
    }

    fn moe_grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
    ) -> Result<()> {
        self.grouped_down(act, routing, sorted, experts, y, false)
            .map(|_| ())
    }

    fn moe_grouped_down_combine(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let y_dtype = self.grouped_down(act, routing, sorted, experts, y, true)?;
        self.combine(y, y_dtype, routing, sorted, experts.down.rows(), out)
    }

    fn moe_combine(
        &self,
        y: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.combine(y, DType::F32, routing, sorted, hidden, out)
    }

    fn moe_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_experts_per_token";
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        let (num_experts, inter, hidden) = (
            experts.gate.num_experts(),
            experts.gate.rows(),
            experts.gate.cols(),
        );
        let pairs = tokens * top_k;
        if pairs == 0 {
            return Ok(());
        }
        let (gate, dtype, gate_vec) = self.experts(op, &experts.gate)?;
        let (up, up_dtype, up_vec) = self.experts(op, &experts.up)?;
        let (down, down_dtype, down_vec) = self.experts(op, &experts.down)?;
        if let (Some(g), Some(d)) = (quant::quant_format(dtype), quant::quant_format(down_dtype))
            && up_dtype == dtype
        {
            // Block formats may differ between gate/up and down (Q4_K_M's Q6_K down).
            let tables = [gate, up, down];
            let shape = (num_experts, inter, hidden);
            return self.quant_experts_per_token(x, routing, (g, d), tables, shape, act, out);
        }
        if up_dtype != dtype || down_dtype != dtype {
            return Err(bad(
                op,
                "expert projections stored in different types".to_string(),
            ));
        }
        let kernels = self.kernels.for_weights(op, dtype)?;
        let (gate_up_kernel, down_kernel) = (&kernels.per_token_gate_up, &kernels.per_token_down);
        let ids = addr(op, routing.expert_ids)?;
        let act_arg = addr(op, act)?;
        let first = [
            addr(op, x)?,
            u32_of(op, hidden)?,
            ids,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            gate,
            up,
            u32_of(op, inter)?,
            Arg::U32((gate_vec && up_vec) as u32),
            act_arg,
            self.diag(),
        ];
        let grid = (grid_of(op, inter.div_ceil(8) * pairs)?, 1, 1);
        self.launch(gate_up_kernel, grid, 256, &first)?;
        let second = [
            act_arg,
            u32_of(op, inter)?,
            ids,
            addr(op, routing.expert_weights)?,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            down,
            u32_of(op, hidden)?,
            Arg::U32(down_vec as u32),
            addr(op, out)?,
            self.diag(),
        ];
        let grid = (grid_of(op, hidden.div_ceil(8) * tokens)?, 1, 1);
        self.launch(down_kernel, grid, 256, &second)
    }
}

impl CudaBackend {
    /// Expert `m`'s device pointer table, its element type and whether 16-byte loads hold.
    pub(crate) fn experts(
        &self,
        op: &'static str,
        m: &ExpertMatrices,
    ) -> Result<(Arg, DType, bool)> {
        let dtype = m
            .dtype()
            .ok_or_else(|| bad(op, "a projection without experts".to_string()))?;
        let (table, vec) = m.device_table(|m| {
            let mut addrs = Vec::with_capacity(m.num_experts());
            let mut vec = m.cols().is_multiple_of(8);
            for (b, offset) in m.locations() {
                let addr = ptr_of(op, b)? + dtype.bytes_of(offset) as u64;
                vec &= addr.is_multiple_of(16) && !matches!(dtype, DType::Quant(_));
                addrs.push(addr);
            }
            let words: Vec<u32> = addrs
                .iter()
                .flat_map(|a| [*a as u32, (*a >> 32) as u32])
                .collect();
            let mut table = self.new_buffer(DType::U32, words.len(), BufferUsage::Weights)?;
            self.gpu.upload(&words, ptr_of(op, &table)?)?;
            self.stats.transfer(words.len() * 4);
            table.set_usage(BufferUsage::Weights);
            Ok((table, vec))
        })?;
        Ok((Arg::Ptr(ptr_of(op, table)?), dtype, *vec))
    }

    /// The streamed few-row expert kernels, where they run: sm_90+, 16-bit weights, K (of
    /// 16-byte rows, which the few-row path already requires) that a stage holds, and
    /// at most STREAM_MAX_TOKENS tokens.
    pub(crate) fn streamed_experts<'k>(
        &self,
        kernels: &'k WeightKernels,
        k: usize,
        tokens: usize,
    ) -> Option<&'k [Kernel; 2]> {
        kernels.grouped_stream.as_ref().filter(|_| {
            !self.unstreamed_experts && k <= STREAM_MAX_K && tokens <= STREAM_MAX_TOKENS
        })
    }

    /// A streamed block per SM: each takes the units of weight rows in turn.
    pub(crate) fn stream_grid(&self, op: &'static str) -> Result<(u32, u32, u32)> {
        Ok((grid_of(op, self.gpu.multiprocessors.max(1) as usize)?, 1, 1))
    }

    /// The 128-row expert tiles, where they run for enough rows: bf16 experts whose three
    /// projections have 16-byte rows. Gate/up and down decide alike (and so pick few-row
    /// products alike), for the first leaves `act` in the bf16 layout the second reads.
    pub(crate) fn big_tiles<'k>(
        &self,
        op: &'static str,
        kernels: &'k WeightKernels,
        experts: &ExpertWeights,
    ) -> Result<Option<&'k BigTileKernels>> {
        let Some(big) = &kernels.grouped_big else {
            return Ok(None);
        };
        for m in [&experts.gate, &experts.up, &experts.down] {
            let (_, dtype, vec) = self.experts(op, m)?;
            if dtype != DType::BF16 || !vec {
                return Ok(None);
            }
        }
        Ok(Some(big))
    }

    /// The split-operand tiles, where the options choose them.
    pub(crate) fn split_tiles<'k>(&self, big: &'k BigTileKernels) -> Option<&'k [Kernel; 2]> {
        self.precise_experts.then_some(&big.split)
    }

    /// The grouped down projection into `y`: f32, or bf16 where `bf16_y` allows and the
    /// prefill tiles run (half the bytes written and combined); returns y's type.
    pub(crate) fn grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        bf16_y: bool,
    ) -> Result<DType> {
        let op = "moe_grouped_down";
        let (num_experts, hidden, inter) = (
            experts.down.num_experts(),
            experts.down.rows(),
            experts.down.cols(),
        );
        let pairs = routing.tokens * routing.top_k;
        if pairs == 0 || hidden == 0 {
            return Ok(DType::F32);
        }
        let (down, dtype, vec) = self.experts(op, &experts.down)?;
        if quant::quant_format(dtype).is_some() {
            return self.with_decoded_experts(op, experts, sorted, [false, false, true], |d| {
                self.grouped_down(act, routing, sorted, d, y, bf16_y)
            });
        }
        let [offsets, hit, sorted_pairs, pairs_a, experts_a] =
            sorted_args(op, sorted, num_experts, pairs)?;
        let args = [
            addr(op, act)?,
            u32_of(op, inter)?,
            addr(op, routing.expert_weights)?,
            offsets,
            hit,
            sorted_pairs,
            pairs_a,
            experts_a,
            down,
            u32_of(op, hidden)?,
            Arg::U32(vec as u32),
            addr(op, y)?,
            self.diag(),
        ];
        let kernels = self.kernels.for_weights(op, dtype)?;
        let big = self.big_tiles(op, kernels, experts)?;
        if let (Some(mvm), true, Some(variant)) = (
            &kernels.grouped_mvm,
            vec,
            few_rows_variant(pairs, num_experts, big.is_some()),
        ) {
            if let Some(stream) = self.streamed_experts(kernels, inter, routing.tokens) {
                return self
                    .launch(&stream[1], self.stream_grid(op)?, STREAM_THREADS, &args)
                    .map(|()| DType::F32);
            }
            // A block row per expert that can have rows: at most one per routed pair; a
            // block per DOWN_MVM_FEATURES features.
            let grid = (
                grid_of(op, hidden.div_ceil(DOWN_MVM_FEATURES))?,
                grid_of(op, num_experts.min(pairs))?,
                1,
            );
            return self
                .launch(&mvm[1][variant], grid, MVM_THREADS, &args)
                .map(|()| DType::F32);
        }
        if let Some(big) = big {
            let tiles = pairs.div_ceil(BIG_TILE_ROWS) + num_experts.min(pairs);
            let grid = (grid_of(op, tiles)?, grid_of(op, hidden.div_ceil(128))?, 1);
            let (kernel, y_dtype) = match (self.split_tiles(big), bf16_y) {
                (Some(split), _) => (&split[1], DType::F32),
                (None, true) => (&big.bf16[2], DType::BF16),
                (None, false) => (&big.bf16[1], DType::F32),
            };
            return self
                .launch(kernel, grid, BIG_TILE_THREADS, &args)
                .map(|()| y_dtype);
        }
        let tiles = pairs.div_ceil(64) + num_experts.min(pairs);
        let grid = (grid_of(op, tiles)?, grid_of(op, hidden.div_ceil(64))?, 1);
        self.launch(&kernels.grouped_down, grid, 128, &args)
            .map(|()| DType::F32)
    }

    /// `out[t] = Σ_j y[pair (t, j)]` from y of `y_dtype` (f32, or bf16 from the tiles).
    pub(crate) fn combine(
        &self,
        y: &DeviceBuffer,
        y_dtype: DType,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_combine";
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        let pairs = tokens * top_k;
        if tokens == 0 || hidden == 0 {
            return Ok(());
        }
        let args = [
            // A bf16 y lies in the first half of the f32 scratch.
            addr(op, y)?,
            addr(op, sorted.pair_positions)?,
            u32_of(op, tokens)?,
            u32_of(op, top_k)?,
            u32_of(op, hidden)?,
            u32_of(op, pairs)?,
            addr(op, out)?,
            self.diag(),
        ];
        // Four features a thread when the rows allow (as the kernel decides).
        let per = if hidden.is_multiple_of(4) { 4 } else { 1 };
        let grid = Self::elementwise_grid(op, (tokens * hidden).div_ceil(per))?;
        let kernel = match y_dtype {
            DType::BF16 => &self.kernels.moe_combine_y16,
            _ => &self.kernels.moe_combine,
        };
        self.launch(kernel, grid, 256, &args)
    }
}
