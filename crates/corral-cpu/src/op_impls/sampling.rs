//! Sampling where the logits are. The CPU backend's entries: the computations in `ops/` on
//! arguments `dyn Backend`'s entries have checked.

use corral_backend::SamplingOps;

use crate::*;
impl SamplingOps for CpuBackend {
    fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        let op = "logit_penalties";
        let entries = read_u32(op, entries, n * DRAW_WORDS)?;
        let logits = write_f32(op, logits, len)?;
        if let Some(e) = entries
            .chunks_exact(DRAW_WORDS)
            .find(|e| e[0] as usize >= len)
        {
            return Err(bad(
                op,
                format!("index {} is out of range for {len} logits", e[0]),
            ));
        }
        self.stats.dispatch(1);
        for penalty in entries.chunks_exact(DRAW_WORDS).map(Penalty::from_words) {
            let l = &mut logits[penalty.index as usize];
            *l = penalty.apply(*l);
        }
        Ok(())
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
        let logits = read_f32(op, logits, rows * vocab)?;
        let draws = read_u32(op, draws, rows * DRAW_WORDS)?;
        let out = write_u32(op, out, rows * CANDIDATE_ROW_WORDS)?;
        self.stats.dispatch(1);
        out.par_chunks_mut(CANDIDATE_ROW_WORDS)
            .zip(logits.par_chunks(vocab))
            .zip(draws.par_chunks(DRAW_WORDS))
            .for_each(|((out, row), draw)| {
                ops::with_reused(&CANDIDATE_KEYS, |keys| {
                    sampling::reduce_row(row, draw, keys, out)
                })
            });
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
        let logits = read_f32(op, logits, rows * vocab)?;
        let ids = write_u32(op, ids, rows)?;
        self.stats.dispatch(1);
        ids.par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .for_each(|(id, row)| {
                let best = row.iter().enumerate().filter(|(_, l)| l.is_finite()).fold(
                    None,
                    |best: Option<(usize, f32)>, (i, &l)| match best {
                        Some((_, b)) if b >= l => best,
                        _ => Some((i, l)),
                    },
                );
                *id = best.map_or(sampling::NO_FINITE_LOGIT, |(i, _)| i as u32);
            });
        Ok(())
    }
}
