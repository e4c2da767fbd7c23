//! Sampling's reductions on the device (`argmax.comp`).

use corral_backend::{DeviceBuffer, Result};

use super::grid;
use crate::VulkanBackend;
use crate::args::Args;

impl VulkanBackend {
    /// Each row's first id of its largest finite logit.
    pub(crate) fn argmax_rows(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        ids: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "argmax";
        let args = Args::new(op)
            .buf(logits)?
            .buf(ids)?
            .count(vocab)?
            .count(rows)?;
        self.dispatch(op, grid(op, rows)?, &args)
    }
}
