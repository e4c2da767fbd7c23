//! Sampling where the logits are. The CUDA backend's host halves: launches of the kernels
//! beside them, on arguments `dyn Backend`'s entries have checked.

use corral_backend::SamplingOps;

use crate::*;
impl SamplingOps for CudaBackend {
    fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        let op = "logit_penalties";
        if n == 0 {
            return Ok(());
        }
        let args = [
            addr(op, logits)?,
            u32_of(op, len)?,
            addr(op, entries)?,
            u32_of(op, n)?,
            self.diag(),
        ];
        self.launch(
            &self.kernels.logit_penalties,
            (grid_of(op, n.div_ceil(256))?, 1, 1),
            256,
            &args,
        )
    }

    fn top_candidates(
        &self,
        logits_buf: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        draws: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "top_candidates";
        if rows == 0 {
            return Ok(());
        }
        let parts = vocab.div_ceil(SAMPLE_CHUNK);
        let logits = ptr_of(op, logits_buf)?;
        let draws_at = ptr_of(op, draws)?;
        let out_at = ptr_of(op, out)?;
        // Rows in launches of at most SAMPLE_MAX_ROWS, the scratch's and tickets' rows.
        for first in (0..rows).step_by(SAMPLE_MAX_ROWS) {
            let n = (rows - first).min(SAMPLE_MAX_ROWS);
            let args = [
                Arg::Ptr(logits + (first * vocab * 4) as u64),
                u32_of(op, vocab)?,
                Arg::Ptr(draws_at + (first * DRAW_WORDS * 4) as u64),
                Arg::Ptr(ptr_of(op, &self.sampling_scratch)?),
                Arg::Ptr(ptr_of(op, &self.sampling_tickets)?),
                Arg::Ptr(out_at + (first * CANDIDATE_ROW_WORDS * 4) as u64),
            ];
            self.launch(
                &self.kernels.top_candidates,
                (grid_of(op, parts)?, grid_of(op, n)?, 1),
                SAMPLE_THREADS,
                &args,
            )?;
        }
        Ok(())
    }

    fn argmax(
        &self,
        logits: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        ids: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "argmax";
        if rows == 0 {
            return Ok(());
        }
        let args = [addr(op, logits)?, u32_of(op, vocab)?, addr(op, ids)?];
        // A block a row, its threads striding over the vocabulary.
        let grid = (grid_of(op, rows)?, 1, 1);
        self.launch(&self.kernels.argmax_rows, grid, 256, &args)
    }
}
