//! Grouped strategy: pairs sorted by expert on the device, then one dispatch per operator
//! over all experts: gate/up with SwiGLU, down with the routing weight, and the combine back
//! to token order. No host round trip and no allocation: scratch comes from the workspace.
//! // [NO_SYNC_IN_LAYER]

use corral_backend::{Backend, DeviceBuffer, ExpertWeights, MoeRouting, MoeSorted};

use crate::Result;
use crate::layers::workspace::MoeScratch;

/// `out = Σ_j w_j · expert_j(x)` per token, four dispatches after routing.
pub(super) fn forward(
    backend: &dyn Backend,
    x: &DeviceBuffer,
    routing: MoeRouting<'_>,
    experts: &ExpertWeights,
    scratch: &mut MoeScratch,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let num_experts = experts.gate.num_experts();
    backend.moe_sort(
        routing,
        num_experts,
        &mut scratch.expert_offsets,
        &mut scratch.hit_experts,
        &mut scratch.sorted_pairs,
        &mut scratch.pair_positions,
    )?;
    let sorted = MoeSorted {
        expert_offsets: &scratch.expert_offsets,
        hit_experts: &scratch.hit_experts,
        sorted_pairs: &scratch.sorted_pairs,
        pair_positions: &scratch.pair_positions,
    };
    backend.moe_grouped_gate_up(x, routing, sorted, experts, &mut scratch.act)?;
    backend.moe_grouped_down_combine(
        &scratch.act,
        routing,
        sorted,
        experts,
        &mut scratch.y,
        out,
    )?;
    Ok(())
}
