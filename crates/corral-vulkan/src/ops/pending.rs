//! The ops this backend does not compute yet: each refuses with an error that says so. The
//! conformance suite runs this backend on the op families it computes
//! (`VulkanBackend::FAMILIES`).

use corral_backend::{
    BackendError, DeltaNetShape, DeviceBuffer, RecurrentOps, RecurrentRuns, Result,
};

use crate::VulkanBackend;

/// The refusal of an op not computed yet.
fn not_yet(op: &'static str) -> Result<()> {
    Err(BackendError::BadArgument {
        op,
        detail: "not computed by the Vulkan backend yet".to_string(),
    })
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
