//! Qwen3 attention: one fused q/k/v projection, per-head q/k RMSNorm with RoPE and the KV
//! store in one op, paged GQA attention, o_proj.

use corral_backend::{
    AttentionMeta, AttentionShape, Backend, DeviceBuffer, QkShape, RopeParams, WeightView,
};

use super::Workspace;
use crate::kv_cache::LayerKv;
use crate::weights::{Projection, WeightSource};
use crate::{ModelConfig, Result};

/// Weights of one attention layer.
#[derive(Debug)]
pub(crate) struct Attention {
    /// q_proj, k_proj and v_proj: `[(heads + 2 kv_heads) · head_dim, hidden]`, stacked
    /// unless stored in different block formats.
    qkv_proj: Projection,
    o_proj: DeviceBuffer,
    q_norm: DeviceBuffer,
    k_norm: DeviceBuffer,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    hidden: usize,
    eps: f32,
    rope: RopeParams,
}

impl Attention {
    /// Binds `{prefix}self_attn.*`.
    pub(crate) fn load(
        ckpt: &dyn WeightSource,
        backend: &dyn Backend,
        config: &ModelConfig,
        prefix: &str,
    ) -> Result<Self> {
        let (h, hd) = (config.hidden_size, config.head_dim);
        let q_dim = config.num_heads * hd;
        let kv_dim = config.kv_dim();
        let p = format!("{prefix}self_attn.");
        Ok(Self {
            qkv_proj: ckpt.projection(
                backend,
                &[
                    (&format!("{p}q_proj.weight"), &[q_dim, h]),
                    (&format!("{p}k_proj.weight"), &[kv_dim, h]),
                    (&format!("{p}v_proj.weight"), &[kv_dim, h]),
                ],
            )?,
            o_proj: ckpt.weight(backend, &format!("{p}o_proj.weight"), &[h, q_dim])?,
            q_norm: ckpt.weight_f32(backend, &format!("{p}q_norm.weight"), &[hd])?,
            k_norm: ckpt.weight_f32(backend, &format!("{p}k_norm.weight"), &[hd])?,
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
            head_dim: hd,
            hidden: h,
            eps: config.rms_norm_eps,
            rope: config.rope,
        })
    }

    /// `ws.out = o_proj(attention(ws.h))`, storing this batch's K and V in `kv` first; the
    /// fused projection goes through `ws.q`.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        ws: &mut Workspace,
        tokens: usize,
        block_size: usize,
        kv: &mut LayerKv,
    ) -> Result<()> {
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let h = self.hidden;
        let qkv_rows = (nh + 2 * nkv) * hd;
        self.qkv_proj
            .forward(backend, &ws.h, tokens, (qkv_rows, h), &mut ws.q)?;
        let b = &ws.batch;
        let shape = QkShape {
            tokens,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            rotary_dim: hd,
            rope: self.rope,
            eps: self.eps,
        };
        backend.qkv_norm_rope_store(
            &ws.q,
            &self.q_norm,
            &self.k_norm,
            &b.positions,
            &b.slots,
            shape,
            &mut ws.q_normed,
            &mut kv.k,
            &mut kv.v,
        )?;
        paged_attention(backend, ws, tokens, block_size, (nh, nkv, hd), kv)?;
        backend.matmul(
            &ws.attn,
            tokens,
            WeightView::new(&self.o_proj, h, nh * hd)?,
            &mut ws.out,
        )?;
        Ok(())
    }
}

/// Causal GQA attention of `ws.q_normed` over the paged cache `kv` (which already holds this
/// batch's K and V) into `ws.attn`, for `(heads, kv_heads, head_dim)`.
pub(crate) fn paged_attention(
    backend: &dyn Backend,
    ws: &mut Workspace,
    tokens: usize,
    block_size: usize,
    (num_heads, num_kv_heads, head_dim): (usize, usize, usize),
    kv: &LayerKv,
) -> Result<()> {
    let b = &ws.batch;
    let meta = AttentionMeta {
        positions: &b.positions,
        token_runs: &b.token_runs,
        block_tables: &b.block_tables,
        slots: &b.slots,
        max_blocks_per_run: ws.table_width,
        block_size,
        tokens,
        max_run_tokens: ws.max_run_tokens,
        leading_decode_tokens: ws.leading_decode_tokens,
    };
    let shape = AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    backend.paged_attention(&ws.q_normed, &kv.k, &kv.v, &meta, shape, &mut ws.attn)?;
    Ok(())
}
