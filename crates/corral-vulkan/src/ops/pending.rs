//! The ops this backend does not compute yet: each refuses with an error that says so. The
//! conformance suite runs this backend on the op families it computes
//! (`VulkanBackend::FAMILIES`).

use corral_backend::{
    AttentionMeta, AttentionOps, AttentionShape, BackendError, DeviceBuffer, ExpertWeights, MoeOps,
    MoeRouting, MoeSorted, QkShape, Result, RopeParams, SamplingOps,
};

use crate::VulkanBackend;

/// The refusal of an op not computed yet.
fn not_yet(op: &'static str) -> Result<()> {
    Err(BackendError::BadArgument {
        op,
        detail: "not computed by the Vulkan backend yet".to_string(),
    })
}

impl AttentionOps for VulkanBackend {
    fn rope(
        &self,
        _x: &mut DeviceBuffer,
        _positions: &DeviceBuffer,
        _tokens: usize,
        _heads: usize,
        _head_dim: usize,
        _rotary_dim: usize,
        _rope: RopeParams,
    ) -> Result<()> {
        not_yet("rope")
    }

    fn kv_store(
        &self,
        _k: &DeviceBuffer,
        _v: &DeviceBuffer,
        _slots: &DeviceBuffer,
        _tokens: usize,
        _kv_heads: usize,
        _head_dim: usize,
        _cache_k: &mut DeviceBuffer,
        _cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("kv_store")
    }

    fn qkv_norm_rope_store(
        &self,
        _qkv: &DeviceBuffer,
        _q_weight: &DeviceBuffer,
        _k_weight: &DeviceBuffer,
        _positions: &DeviceBuffer,
        _slots: &DeviceBuffer,
        _shape: QkShape,
        _q_out: &mut DeviceBuffer,
        _cache_k: &mut DeviceBuffer,
        _cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("qkv_norm_rope_store")
    }

    fn paged_attention(
        &self,
        _q: &DeviceBuffer,
        _cache_k: &DeviceBuffer,
        _cache_v: &DeviceBuffer,
        _meta: &AttentionMeta<'_>,
        _shape: AttentionShape,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("paged_attention")
    }
}

impl MoeOps for VulkanBackend {
    fn moe_route(
        &self,
        _logits: &DeviceBuffer,
        _tokens: usize,
        _num_experts: usize,
        _top_k: usize,
        _renormalize: bool,
        _shared_gate: bool,
        _expert_ids: &mut DeviceBuffer,
        _expert_weights: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_route")
    }

    fn scale_scatter_add(
        &self,
        _y: &DeviceBuffer,
        _rows: &DeviceBuffer,
        _scales: &DeviceBuffer,
        _num_rows: usize,
        _dim: usize,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("scale_scatter_add")
    }

    fn moe_sort(
        &self,
        _routing: MoeRouting<'_>,
        _num_experts: usize,
        _expert_offsets: &mut DeviceBuffer,
        _hit_experts: &mut DeviceBuffer,
        _sorted_pairs: &mut DeviceBuffer,
        _pair_positions: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_sort")
    }

    fn moe_grouped_gate_up(
        &self,
        _x: &DeviceBuffer,
        _routing: MoeRouting<'_>,
        _sorted: MoeSorted<'_>,
        _experts: &ExpertWeights,
        _act: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_grouped_gate_up")
    }

    fn moe_grouped_down(
        &self,
        _act: &DeviceBuffer,
        _routing: MoeRouting<'_>,
        _sorted: MoeSorted<'_>,
        _experts: &ExpertWeights,
        _y: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_grouped_down")
    }

    fn moe_combine(
        &self,
        _y: &DeviceBuffer,
        _routing: MoeRouting<'_>,
        _sorted: MoeSorted<'_>,
        _hidden: usize,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_combine")
    }

    fn moe_experts_per_token(
        &self,
        _x: &DeviceBuffer,
        _routing: MoeRouting<'_>,
        _experts: &ExpertWeights,
        _act: &mut DeviceBuffer,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("moe_experts_per_token")
    }
}

impl SamplingOps for VulkanBackend {
    fn logit_penalties(
        &self,
        _logits: &mut DeviceBuffer,
        _len: usize,
        _entries: &DeviceBuffer,
        _n: usize,
    ) -> Result<()> {
        not_yet("logit_penalties")
    }

    fn top_candidates(
        &self,
        _logits: &DeviceBuffer,
        _rows: usize,
        _vocab: usize,
        _draws: &DeviceBuffer,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("top_candidates")
    }

    fn argmax(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        ids: &mut DeviceBuffer,
    ) -> Result<()> {
        self.argmax_rows(logits, rows, vocab, ids)
    }
}
