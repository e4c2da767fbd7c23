//! Sampling where the logits are (`logit_penalties.comp`, `top_candidates.comp`,
//! `argmax.comp`): a step reads back a few words a row instead of its logits.

use corral_backend::sampling::DRAW_WORDS;
use corral_backend::{DeviceBuffer, Result, SamplingOps};

use super::{grid, grid_of};
use crate::VulkanBackend;
use crate::args::Args;

impl SamplingOps for VulkanBackend {
    fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        let op = "logit_penalties";
        debug_assert_eq!(
            DRAW_WORDS, 4,
            "logit_penalties.comp reads entries of 4 words"
        );
        let args = Args::new(op)
            .buf(logits)?
            .buf(entries)?
            .address(self.fault.address())?
            .count(n)?
            .count(len)?;
        self.dispatch(op, grid_of(op, n)?, &args)
    }

    fn top_candidates(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        draws: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "top_candidates";
        let args = Args::new(op)
            .buf(logits)?
            .buf(draws)?
            .buf(out)?
            .count(vocab)?
            .count(rows)?;
        self.dispatch(op, grid(op, rows)?, &args)
    }

    fn argmax(
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
