//! Attention (`rope.comp`, `kv_store.comp`, `qkv_norm_rope_store.comp`,
//! `attention_split.comp`, `attention_combine.comp`): RoPE to the references' precision from the host's inverse
//! frequencies, the paged KV cache in f32, bf16 or fp8 (`kv.glsl`).

use corral_backend::{
    AttentionMeta, AttentionOps, AttentionShape, BackendError, BufferUsage, Buffers, DType,
    DeviceBuffer, QkShape, Result, RopeParams, kv_row_elems,
};

use super::{grid, grid_of};
use crate::VulkanBackend;
use crate::args::{Args, address};

/// A KV cache's element type as `kv.glsl` takes it.
fn kv_type(op: &'static str, dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F8E4M3 => Ok(2),
        other => Err(BackendError::BadArgument {
            op,
            detail: format!("a KV cache of {other} (this backend keeps f32, bf16 or fp8)"),
        }),
    }
}

/// Slots a pair of caches holds: rows of `kv_row_elems` elements (bytes, for fp8).
fn cache_slots(
    cache_k: &DeviceBuffer,
    cache_v: &DeviceBuffer,
    kv_heads: usize,
    head_dim: usize,
) -> usize {
    let row = kv_row_elems(cache_k.dtype(), kv_heads, head_dim);
    cache_k.len().min(cache_v.len()) / row.max(1)
}

impl VulkanBackend {
    /// The address of the `rotary_dim / 2` inverse frequencies of `rope` (the host's f32
    /// values, as the references form them), and its attention factor: made once a set of
    /// parameters, in a buffer no queued work reads yet, so written without a wait.
    fn rope_freqs(&self, rope: RopeParams, rotary_dim: usize) -> Result<(u64, f32)> {
        let args = rope.args(rotary_dim);
        let key = [
            args.theta.to_bits(),
            args.factor.to_bits(),
            args.ramp_low.to_bits(),
            args.ramp_width.to_bits(),
            rotary_dim as u32,
        ];
        let mut tables = self
            .rope_tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(b) = tables.get(&key) {
            return Ok((address("rope", b)?, args.attention_factor));
        }
        let freqs: Vec<f32> = (0..rotary_dim / 2)
            .map(|p| args.inverse_frequency(p, rotary_dim))
            .collect();
        let mut b = self.new_buffer(DType::F32, freqs.len().max(1), BufferUsage::Weights)?;
        b.hold_for_graphs();
        self.write_new("rope", &b, bytemuck::cast_slice(&freqs))?;
        let at = address("rope", &b)?;
        tables.insert(key, b);
        Ok((at, args.attention_factor))
    }
}

impl AttentionOps for VulkanBackend {
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
        let (freqs, factor) = self.rope_freqs(rope, rotary_dim)?;
        let len = tokens * heads * rotary_dim / 2;
        let args = Args::new(op)
            .buf(x)?
            .buf(positions)?
            .address(freqs)?
            .count(len)?
            .count(heads)?
            .count(head_dim)?
            .count(rotary_dim / 2)?
            .float(factor)?;
        self.dispatch(op, grid_of(op, len)?, &args)
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
        let args = Args::new(op)
            .buf(k)?
            .buf(v)?
            .buf(slots)?
            .buf(cache_k)?
            .buf(cache_v)?
            .address(self.fault.address())?
            .count(tokens)?
            .count(kv_heads)?
            .count(head_dim)?
            .count(cache_slots(cache_k, cache_v, kv_heads, head_dim))?
            .count(kv_type(op, cache_k.dtype())?)?;
        // A workgroup a (token, K or V head).
        self.dispatch(op, grid(op, tokens * 2 * kv_heads)?, &args)
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
        let (freqs, factor) = self.rope_freqs(shape.rope, shape.rotary_dim)?;
        let slots_held = cache_slots(cache_k, cache_v, shape.kv_heads, shape.head_dim);
        let args = Args::new(op)
            .buf(qkv)?
            .buf(q_weight)?
            .buf(k_weight)?
            .buf(positions)?
            .buf(slots)?
            .address(freqs)?
            .buf(q_out)?
            .buf(cache_k)?
            .buf(cache_v)?
            .address(self.fault.address())?
            .count(shape.tokens)?
            .count(shape.heads)?
            .count(shape.kv_heads)?
            .count(shape.head_dim)?
            .count(shape.rotary_dim / 2)?
            .float(factor)?
            .float(shape.eps)?
            .count(slots_held)?
            .count(kv_type(op, cache_k.dtype())?)?;
        let groups = shape.tokens * (shape.heads + shape.kv_heads);
        self.dispatch(op, grid(op, groups)?, &args)
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
        let rows = cache_slots(cache_k, cache_v, shape.num_kv_heads, shape.head_dim);
        self.attention_in_splits(q, (cache_k, cache_v, rows), meta, shape, out)
    }
}

/// Query heads a workgroup of attention takes at most, and their values at most
/// (`MAX_GROUP`, `MAX_GROUP * MAX_DIM` of attention_split.comp).
const ATTENTION_CHUNK_HEADS: usize = 16;
const ATTENTION_CHUNK_VALUES: usize = 4096;

/// Workgroups (token, KV head, chunk of heads) past which attention takes its keys in one
/// split; fewer share the keys out so that a few decode rows still fill the device.
const ATTENTION_SPLIT_WORKGROUPS: usize = 4096;

/// The most splits of one token's keys, and the fewest keys a split (a multiple of
/// attention_split.comp's `TILE`).
const ATTENTION_MAX_SPLITS: usize = 64;
const ATTENTION_MIN_SPLIT: usize = 256;

impl VulkanBackend {
    /// Attention a workgroup a (token, KV head, chunk of its query heads, split of the
    /// keys), each key and value read once for the chunk (`attention_split.comp`), the
    /// splits then combined (`attention_combine.comp`) where there is more than one.
    fn attention_in_splits(
        &self,
        q: &DeviceBuffer,
        (cache_k, cache_v, rows): (&DeviceBuffer, &DeviceBuffer, usize),
        meta: &AttentionMeta<'_>,
        shape: AttentionShape,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "paged_attention";
        let keys = meta.max_blocks_per_run * meta.block_size;
        let group = shape.num_heads / shape.num_kv_heads.max(1);
        let chunk_heads = group
            .min(ATTENTION_CHUNK_HEADS)
            .min(ATTENTION_CHUNK_VALUES / shape.head_dim.max(1))
            .max(1);
        let work = meta.tokens * shape.num_kv_heads * group.div_ceil(chunk_heads);
        let splits = keys
            .div_ceil(ATTENTION_MIN_SPLIT)
            .min(ATTENTION_MAX_SPLITS)
            .min((ATTENTION_SPLIT_WORKGROUPS / work.max(1)).max(1))
            .max(1);
        let split_len = keys.div_ceil(splits).next_multiple_of(32).max(32);
        let rows_out = meta.tokens * shape.num_heads;
        let partial = if splits > 1 {
            Some(self.take_buffer(
                DType::F32,
                rows_out * splits * (shape.head_dim + 2),
                BufferUsage::Activations,
            )?)
        } else {
            None
        };
        let target: &DeviceBuffer = partial.as_ref().unwrap_or(out);
        let args = Args::new(op)
            .buf(q)?
            .buf(cache_k)?
            .buf(cache_v)?
            .buf(meta.positions)?
            .buf(meta.token_runs)?
            .buf(meta.block_tables)?
            .buf(target)?
            .address(self.fault.address())?
            .count(meta.tokens)?
            .count(shape.num_heads)?
            .count(shape.num_kv_heads)?
            .count(shape.head_dim)?
            .count(meta.max_blocks_per_run)?
            .count(meta.block_size)?
            .count(rows / meta.block_size.max(1))?
            .float(shape.scale)?
            .count(kv_type(op, cache_k.dtype())?)?
            .count(splits)?
            .count(split_len)?
            .count(chunk_heads)?;
        let result = self
            .dispatch("attention_split", grid(op, work * splits)?, &args)
            .and_then(|()| {
                let Some(partial) = &partial else {
                    return Ok(());
                };
                let args = Args::new(op)
                    .buf(partial)?
                    .buf(out)?
                    .count(rows_out)?
                    .count(shape.head_dim)?
                    .count(splits)?;
                self.dispatch("attention_combine", grid(op, rows_out)?, &args)
            });
        if let Some(partial) = partial {
            self.give_buffer(partial);
        }
        result
    }
}
