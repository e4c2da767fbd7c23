//! Attention: RoPE, the KV cache's stores, paged attention. The CPU backend's entries: the
//! computations in `ops/` on arguments `dyn Backend`'s entries have checked.

use corral_backend::AttentionOps;

use crate::*;
impl AttentionOps for CpuBackend {
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
        let positions = read_u32(op, positions, tokens)?;
        let x = write_f32(op, x, tokens * heads * head_dim)?;
        self.stats.dispatch(1);
        ops::rope::rope(x, positions, heads, head_dim, rotary_dim, rope);
        Ok(())
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
        let slots = read_u32(op, slots, tokens)?;
        let capacity = cache_k.len().min(cache_v.len()) / kv_dim.max(1);
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
            return Err(bad(
                op,
                format!("slot {s} is out of range for {capacity} slots"),
            ));
        }
        let k = read_f32(op, k, tokens * kv_dim)?;
        let v = read_f32(op, v, tokens * kv_dim)?;
        let len = capacity * kv_dim;
        let cache_k = kv_rows_mut(op, "cache_k", cache_k, len)?;
        let cache_v = kv_rows_mut(op, "cache_v", cache_v, len)?;
        self.stats.dispatch(1);
        ops::attention::kv_store(k, v, slots, kv_dim, cache_k, cache_v);
        Ok(())
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
        let kv_dim = kv_heads * head_dim;
        let slots = read_u32(op, slots, tokens)?;
        let capacity = cache_k.len().min(cache_v.len()) / kv_dim.max(1);
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
            return Err(bad(
                op,
                format!("slot {s} is out of range for {capacity} slots"),
            ));
        }
        let positions = read_u32(op, positions, tokens)?;
        let qkv = read_f32(op, qkv, tokens * (heads * head_dim + 2 * kv_dim))?;
        let q_weight = read_f32(op, q_weight, head_dim)?;
        let k_weight = read_f32(op, k_weight, head_dim)?;
        let q_out = write_f32(op, q_out, tokens * heads * head_dim)?;
        let len = capacity * kv_dim;
        let cache_k = kv_rows_mut(op, "cache_k", cache_k, len)?;
        let cache_v = kv_rows_mut(op, "cache_v", cache_v, len)?;
        self.stats.dispatch(1);
        let fused = ops::attention::FusedQkv {
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
            rope,
            eps,
        };
        ops::attention::qkv_norm_rope_store(
            qkv, q_weight, k_weight, positions, slots, fused, q_out, cache_k, cache_v,
        );
        Ok(())
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
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        } = shape;
        let tokens = meta.tokens;
        let kv_dim = num_kv_heads * head_dim;
        let num_blocks = cache_k.len().min(cache_v.len()) / (kv_dim * meta.block_size);
        let positions = read_u32(op, meta.positions, tokens)?;
        let token_runs = read_u32(op, meta.token_runs, tokens)?;
        let num_runs = token_runs
            .iter()
            .map(|&r| r as usize + 1)
            .max()
            .unwrap_or(0);
        let block_tables = read_u32(op, meta.block_tables, num_runs * meta.max_blocks_per_run)?;
        if let Some(&b) = block_tables.iter().find(|&&b| b as usize >= num_blocks) {
            return Err(bad(
                op,
                format!("block {b} is out of range for {num_blocks} blocks"),
            ));
        }
        if let Some(&p) = positions
            .iter()
            .find(|&&p| p as usize / meta.block_size >= meta.max_blocks_per_run)
        {
            return Err(bad(op, format!("position {p} is beyond the block table")));
        }
        let layout = ops::attention::PagedLayout {
            positions,
            token_runs,
            block_tables,
            max_blocks_per_run: meta.max_blocks_per_run,
            block_size: meta.block_size,
        };
        let len = num_blocks * meta.block_size * kv_dim;
        let q = read_f32(op, q, tokens * num_heads * head_dim)?;
        let cache_k = kv_rows(op, "cache_k", cache_k, len)?;
        let cache_v = kv_rows(op, "cache_v", cache_v, len)?;
        let out = write_f32(op, out, tokens * num_heads * head_dim)?;
        self.stats.dispatch(1);
        ops::attention::paged_attention(
            q,
            cache_k,
            cache_v,
            &layout,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            out,
        );
        Ok(())
    }
}
