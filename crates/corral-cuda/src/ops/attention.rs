//! Attention: RoPE, the KV cache's stores, paged attention. The CUDA backend's host halves:
//! launches of the kernels beside them, on arguments `dyn Backend`'s entries have checked.

use corral_backend::AttentionOps;

use crate::*;
impl AttentionOps for CudaBackend {
    fn rope(
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
        let items = tokens * heads * (rotary_dim / 2);
        if items == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, positions)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            u32_of(op, head_dim)?,
            u32_of(op, rotary_dim)?,
        ];
        let args = [&args[..], &rope_args(rope, rotary_dim)].concat();
        self.launch(
            &self.kernels.rope,
            Self::elementwise_grid(op, items)?,
            256,
            &args,
        )
    }

    fn kv_store(
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
        let kv_dim = kv_heads * head_dim;
        if tokens == 0 || kv_dim == 0 {
            return Ok(());
        }
        let dtype = cache_k.dtype();
        let row = kv_row_elems(dtype, kv_heads, head_dim);
        let cache_slots = cache_k.len().min(cache_v.len()) / row;
        let mut args = vec![
            addr(op, k)?,
            addr(op, v)?,
            addr(op, slots)?,
            u32_of(op, tokens)?,
        ];
        if dtype == DType::F8E4M3 {
            args.extend([u32_of(op, kv_heads)?, u32_of(op, head_dim)?]);
        } else {
            args.push(u32_of(op, kv_dim)?);
        }
        args.extend([
            Arg::U64(cache_slots as u64),
            addr(op, cache_k)?,
            addr(op, cache_v)?,
            self.diag(),
        ]);
        let kernel = match dtype {
            DType::BF16 => &self.kernels.kv_store_bf16,
            DType::F32 => &self.kernels.kv_store_f32,
            DType::F8E4M3 => &self.kernels.kv_store_fp8,
            other => return Err(bad(op, format!("KV cache of {other}"))),
        };
        self.launch(kernel, (grid_of(op, tokens)?, 1, 1), 128, &args)
    }

    fn qkv_norm_rope_store(
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
            rope,
            eps,
        } = shape;
        if tokens == 0 {
            return Ok(());
        }
        let dtype = cache_k.dtype();
        let row = kv_row_elems(dtype, kv_heads, head_dim);
        let cache_slots = cache_k.len().min(cache_v.len()) / row.max(1);
        let per_token = heads + 2 * kv_heads;
        let args = [
            addr(op, qkv)?,
            addr(op, q_weight)?,
            addr(op, k_weight)?,
            addr(op, positions)?,
            addr(op, slots)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            u32_of(op, kv_heads)?,
            u32_of(op, head_dim)?,
            u32_of(op, rotary_dim)?,
        ];
        let rest = [
            Arg::F32(eps),
            Arg::U64(cache_slots as u64),
            addr(op, q_out)?,
            addr(op, cache_k)?,
            addr(op, cache_v)?,
            self.diag(),
        ];
        let args = [&args[..], &rope_args(rope, rotary_dim), &rest].concat();
        let kernels = match dtype {
            DType::BF16 => &self.kernels.qkv_norm_rope_store_bf16,
            DType::F32 => &self.kernels.qkv_norm_rope_store_f32,
            DType::F8E4M3 => &self.kernels.qkv_norm_rope_store_fp8,
            other => return Err(bad(op, format!("KV cache of {other}"))),
        };
        // A block per (token, eight warps' heads): one head a warp for a few tokens, five
        // for prefill (a block a token of up to 40 heads, every load in flight at once).
        let heads_per_warp = if tokens >= QKV_WIDE_MIN_TOKENS { 5 } else { 1 };
        let kernel = &kernels[2 * usize::from(head_dim > 128) + usize::from(heads_per_warp == 5)];
        let grid = (
            grid_of(op, tokens)?,
            grid_of(op, per_token.div_ceil(8 * heads_per_warp))?,
            1,
        );
        self.launch(kernel, grid, 256, &args)
    }

    fn paged_attention(
        &self,
        q: &DeviceBuffer,
        cache_k: &DeviceBuffer,
        cache_v: &DeviceBuffer,
        meta: &AttentionMeta<'_>,
        shape: AttentionShape,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "paged_attention";
        let head_dim = shape.head_dim;
        let tokens = meta.tokens;
        if tokens == 0 {
            return Ok(());
        }
        if meta.block_tables.len() / meta.max_blocks_per_run.max(1) == 0 {
            return Err(bad(op, "no block table for the batch's tokens".to_string()));
        }
        // Prefill chunks of 64 or more tokens: tensor-core tiles (head dims 64, 128 and 256,
        // bf16), writing f32 or bf16.
        let flash = match head_dim {
            64 => Some(&self.kernels.flash_attention_hd64),
            128 => Some(&self.kernels.flash_attention_hd128),
            256 => Some(&self.kernels.flash_attention_hd256),
            _ => None,
        }
        .filter(|_| {
            matches!(cache_k.dtype(), DType::BF16 | DType::F8E4M3)
                && meta.max_run_tokens >= FLASH_MIN_RUN
        });
        let attention = Attention {
            q,
            cache_k,
            cache_v,
            meta,
            shape,
        };
        let Some(kernels) = flash else {
            return self.decode_attention(&attention, 0..tokens, out);
        };
        // Decode rows ahead of the prefill runs take the decode kernel, split over their
        // keys: in a prefill tile a decode row's whole context would be one block's walk.
        let lead = meta.leading_decode_tokens.min(tokens);
        if lead > 0 && lead < tokens {
            self.decode_attention(&attention, 0..lead, out)?;
        } else if lead == tokens {
            return self.decode_attention(&attention, 0..tokens, out);
        }
        self.flash_attention(kernels, &attention, lead..tokens, out)
    }
}

impl CudaBackend {
    /// The kernels' common arguments for the batch's tokens `range`: the query and token
    /// arrays start at its first token, the output at token `out_first` of `out` (run
    /// indices and block tables stay whole).
    pub(crate) fn attention_args(
        &self,
        a: &Attention<'_>,
        range: &std::ops::Range<usize>,
        (out, out_dtype, out_first): (&DeviceBuffer, DType, usize),
    ) -> Result<Vec<Arg>> {
        let op = "paged_attention";
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        } = a.shape;
        let meta = a.meta;
        let (first, count) = (range.start, range.len());
        let row = num_heads * head_dim;
        let dtype = a.cache_k.dtype();
        let kv_row = kv_row_elems(dtype, num_kv_heads, head_dim);
        let slots = a.cache_k.len().min(a.cache_v.len()) / kv_row;
        let runs = meta.block_tables.len() / meta.max_blocks_per_run.max(1);
        Ok(vec![
            buf_range(op, "q", a.q, DType::F32, first * row, count * row)?,
            addr(op, a.cache_k)?,
            addr(op, a.cache_v)?,
            buf_range(op, "positions", meta.positions, DType::U32, first, count)?,
            buf_range(op, "token_runs", meta.token_runs, DType::U32, first, count)?,
            u32_of(op, runs)?,
            addr(op, meta.block_tables)?,
            u32_of(op, meta.max_blocks_per_run)?,
            u32_of(op, meta.block_size)?,
            u32_of(op, slots / meta.block_size.max(1))?,
            u32_of(op, count)?,
            u32_of(op, num_heads)?,
            u32_of(op, num_kv_heads)?,
            u32_of(op, head_dim)?,
            Arg::F32(scale),
            buf_range(op, "out", out, out_dtype, out_first * row, count * row)?,
            self.diag(),
        ])
    }

    /// Prefill-shaped attention for the batch's tokens `range`: 64-token tiles on tensor
    /// cores, writing f32 or bf16; the keys split over blocks where the tiles are too few to
    /// fill the GPU, and a merge joins the splits.
    pub(crate) fn flash_attention(
        &self,
        kernels: &FlashKernels,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "paged_attention";
        let out_dtype = match out.dtype() {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        let variant = usize::from(out_dtype == DType::BF16);
        let tiles = if a.cache_k.dtype() == DType::F8E4M3 {
            &kernels.tiles_fp8
        } else {
            &kernels.tiles
        };
        let mut args = self.attention_args(a, &range, (out, out_dtype, range.start))?;
        // Every argument but head_dim (the kernel's template parameter).
        args.remove(13);
        let (num_heads, head_dim) = (a.shape.num_heads, a.shape.head_dim);
        let tile_count = range.len().div_ceil(64);
        let max_context = a.meta.max_blocks_per_run * a.meta.block_size;
        let items = range.len() * num_heads;
        let split_keys = flash_split_keys(
            tile_count * num_heads,
            range.len(),
            max_context,
            tiles[variant].blocks_per_sm * self.gpu.multiprocessors.max(1) as usize,
            OP_SCRATCH_FLOATS / (items * (head_dim + 2)).max(1),
        );
        let splits = max_context.div_ceil(split_keys).max(1);
        let out_arg = args[14];
        args.splice(
            14..14,
            [
                u32_of(op, split_keys)?,
                Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            ],
        );
        // Heads along x, so that the heaviest tiles (the last) start first.
        let grid = (
            grid_of(op, num_heads)?,
            grid_of(op, tile_count)?,
            grid_of(op, splits)?,
        );
        self.launch(&tiles[variant].kernel, grid, FLASH_THREADS, &args)?;
        if splits == 1 {
            return Ok(());
        }
        let merge_args = [
            Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            u32_of(op, splits)?,
            u32_of(op, items)?,
            out_arg,
        ];
        let grid = (grid_of(op, items.div_ceil(8))?, 1, 1);
        self.launch(&kernels.merge[variant], grid, 256, &merge_args)
    }

    /// Decode-shaped attention for the batch's tokens `range`: tensor cores over a bf16
    /// cache for groups of up to 8 heads of 64, 128 or 256 dims, otherwise lanes owning D
    /// consecutive dims of a head; the keys split as far as the scratch allows. A bf16
    /// output is written f32 into a pooled copy and rounded after.
    pub(crate) fn decode_attention(
        &self,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.decode_attention_into(a, range.clone(), out, range.start)
    }

    /// [`Self::decode_attention`] writing from token `out_first` of `out`.
    pub(crate) fn decode_attention_into(
        &self,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
        out_first: usize,
    ) -> Result<()> {
        let op = "paged_attention";
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            ..
        } = a.shape;
        let meta = a.meta;
        let count = range.len();
        let row = num_heads * head_dim;
        if out.dtype() == DType::BF16 {
            let out_len = count * row;
            let mut out32 = self.take_buffer(DType::F32, out_len, BufferUsage::Activations)?;
            let queued = self
                .decode_attention_into(a, range.clone(), &mut out32, 0)
                .and_then(|()| {
                    let args = [
                        addr(op, &out32)?,
                        Arg::U64(out_len as u64),
                        buf_range(op, "out", out, DType::BF16, out_first * row, out_len)?,
                        Arg::U64(0),
                        self.diag(),
                    ];
                    let grid = Self::elementwise_grid(op, out_len.div_ceil(4))?;
                    self.launch(&self.kernels.to_bf16, grid, 256, &args)
                });
            self.give_buffer(out32);
            return queued;
        }
        let dtype = a.cache_k.dtype();
        let group = num_heads / num_kv_heads;
        let mma_index = match head_dim {
            64 => Some(0),
            128 => Some(1),
            256 => Some(2),
            _ => None,
        }
        .filter(|_| group <= DECODE_MMA_MAX_GROUP);
        let mma = match (dtype, mma_index) {
            (DType::BF16, Some(i)) => Some(&self.kernels.decode_attention_mma[i]),
            (DType::F8E4M3, Some(i)) => Some(&self.kernels.decode_attention_mma_fp8[i]),
            _ => None,
        };
        let on_tensor_cores = mma.is_some();
        let lane_dims = head_dim.div_ceil(32).next_power_of_two();
        let variant = lane_dims.trailing_zeros() as usize;
        let kernel = match (dtype, mma) {
            (_, Some(mma)) => mma,
            (DType::BF16, None) => &self.kernels.paged_attention_bf16[variant],
            (DType::F32, None) => &self.kernels.paged_attention_f32[variant],
            (DType::F8E4M3, None) => &self.kernels.paged_attention_fp8[variant],
            (other, None) => return Err(bad(op, format!("KV cache of {other}"))),
        };
        let args = self.attention_args(a, &range, (out, DType::F32, out_first))?;
        // Split the keys, as far as the fixed scratch and one merge's shared memory allow.
        let items = count * num_heads;
        let blocks = count * num_kv_heads;
        let max_context = (meta.max_blocks_per_run * meta.block_size).max(1);
        let fit = OP_SCRATCH_FLOATS / (items * (head_dim + 2)).max(1);
        let splits = attention_splits(blocks, max_context)
            .min(fit)
            .min(ATTENTION_MERGE_SLOTS / group.max(1))
            .max(1);
        // The last split of each block row merges them, counting on one ticket per row.
        let splits = if blocks > ATTENTION_COUNTERS {
            1
        } else {
            splits
        };
        // Whole chunks of 16 keys (the tensor-core kernel's warp step) per split.
        let split_keys = max_context.div_ceil(splits).div_ceil(16) * 16;
        let splits = max_context.div_ceil(split_keys);
        let (out_arg, diag) = (args[15], args[16]);
        let mut all = args;
        all.truncate(15);
        all.push(u32_of(op, split_keys)?);
        if on_tensor_cores {
            // Whether every run is one token: the kernel then reads a token's earlier keys
            // before waiting for the kernel that stores its own.
            all.push(Arg::U32(u32::from(meta.max_run_tokens == 1)));
        }
        all.extend([
            Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            Arg::Ptr(ptr_of(op, &self.attention_counters)?),
            out_arg,
            diag,
        ]);
        let grid = (grid_of(op, blocks)?, grid_of(op, splits)?, 1);
        self.launch(kernel, grid, ATTENTION_THREADS, &all)
    }
}
