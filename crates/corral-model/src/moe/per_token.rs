//! Per-token strategy: one matrix-vector product per (token, expert) pair, no sorting. Two
//! dispatches after routing; cheapest when only a few tokens are routed.

use corral_backend::{Backend, DeviceBuffer, ExpertWeights, MoeRouting};

use crate::Result;

/// `out = Σ_j w_j · expert_j(x)` per token.
pub(super) fn forward(
    backend: &dyn Backend,
    x: &DeviceBuffer,
    routing: MoeRouting<'_>,
    experts: &ExpertWeights,
    act: &mut DeviceBuffer,
    out: &mut DeviceBuffer,
) -> Result<()> {
    Ok(backend.moe_experts_per_token(x, routing, experts, act, out)?)
}
