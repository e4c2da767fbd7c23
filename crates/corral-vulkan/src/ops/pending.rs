//! The ops this backend does not compute yet: each refuses with an error that says so. The
//! conformance suite runs this backend on the op families it computes
//! (`VulkanBackend::FAMILIES`).

use corral_backend::{
    BackendError, DeltaNetShape, DeviceBuffer, ExpertWeights, MoeOps, MoeRouting, MoeSorted,
    RecurrentOps, RecurrentRuns, Result,
};

use crate::VulkanBackend;

/// The refusal of an op not computed yet.
fn not_yet(op: &'static str) -> Result<()> {
    Err(BackendError::BadArgument {
        op,
        detail: "not computed by the Vulkan backend yet".to_string(),
    })
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

impl RecurrentOps for VulkanBackend {
    fn causal_conv1d(
        &self,
        _x: &DeviceBuffer,
        _weight: &DeviceBuffer,
        _channels: usize,
        _kernel: usize,
        _runs: RecurrentRuns<'_>,
        _conv_state: &mut DeviceBuffer,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("causal_conv1d")
    }

    fn delta_net_gates(
        &self,
        _a: &DeviceBuffer,
        _b: &DeviceBuffer,
        _a_log: &DeviceBuffer,
        _dt_bias: &DeviceBuffer,
        _tokens: usize,
        _heads: usize,
        _g: &mut DeviceBuffer,
        _beta: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("delta_net_gates")
    }

    fn gated_delta_rule(
        &self,
        _qkv: &DeviceBuffer,
        _g: &DeviceBuffer,
        _beta: &DeviceBuffer,
        _shape: DeltaNetShape,
        _runs: RecurrentRuns<'_>,
        _recurrent_state: &mut DeviceBuffer,
        _out: &mut DeviceBuffer,
    ) -> Result<()> {
        not_yet("gated_delta_rule")
    }
}
