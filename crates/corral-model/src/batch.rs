//! The ragged batch a forward pass runs on, and the ids that cross the engine–model boundary.
//!
//! A batch is a flat list of tokens split into runs, one per sequence: a prefill chunk or a
//! single decode token, at consecutive positions, each with the block table through which it
//! reads and writes the paged KV cache. Prefill, decode and mixes of both are the same call.

use crate::{ModelError, Result};

/// A token id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct TokenId(pub u32);

/// A KV cache block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct BlockId(pub u32);

/// A recurrent-state slot (hybrid models): where a sequence's conv and delta-rule state lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct SlotId(pub u32);

/// A sequence being generated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct SeqId(pub u64);

/// The blocks holding a sequence's KV cache, in position order: position `p` lives in block
/// `blocks[p / block_size]` at offset `p % block_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// Blocks in position order.
    pub blocks: Vec<BlockId>,
}

/// Which rows of a run need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token's (decode, or the end of a prompt).
    Last,
    /// Every token's (scoring a whole sequence).
    All,
}

/// One sequence's part of a batch.
#[derive(Clone, Debug)]
pub struct SequenceRun {
    /// The sequence.
    pub seq_id: SeqId,
    /// Index of the run's first token in the batch.
    pub start: usize,
    /// Tokens in the run.
    pub len: usize,
    /// Position of the run's first token; earlier positions are already in the cache.
    pub first_position: usize,
    /// The sequence's block table, covering at least `first_position + len` positions.
    pub block_table: BlockTable,
    /// Which rows need logits.
    pub logits: LogitsWanted,
    /// The sequence's recurrent-state slot (hybrid models only).
    pub state_slot: Option<SlotId>,
    /// The first of `len - 1` consecutive slots that take its recurrent state after each
    /// of its tokens but the last (a speculative verify's), if any.
    pub kept_states: Option<SlotId>,
}

/// Tokens of several sequences for one forward pass.
#[derive(Clone, Debug, Default)]
pub struct RaggedBatch {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    runs: Vec<SequenceRun>,
    block_size: usize,
}

impl RaggedBatch {
    /// An empty batch for a cache with `block_size` tokens per block.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Self::default()
        }
    }

    /// Appends a run of `tokens` at positions `first_position..`, checking that the block
    /// table covers them and that the sequence is not already in the batch.
    pub fn push_run(
        &mut self,
        seq_id: SeqId,
        tokens: &[TokenId],
        first_position: usize,
        block_table: &BlockTable,
        logits: LogitsWanted,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {} has an empty run",
                seq_id.0
            )));
        }
        if self.runs.iter().any(|r| r.seq_id == seq_id) {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {} appears twice",
                seq_id.0
            )));
        }
        let end = first_position + tokens.len();
        if end > block_table.blocks.len() * self.block_size || end > u32::MAX as usize {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {} reaches position {end} but its {} blocks hold {}",
                seq_id.0,
                block_table.blocks.len(),
                block_table.blocks.len() * self.block_size
            )));
        }
        self.runs.push(SequenceRun {
            seq_id,
            start: self.tokens.len(),
            len: tokens.len(),
            first_position,
            block_table: block_table.clone(),
            logits,
            state_slot: None,
            kept_states: None,
        });
        self.tokens.extend(tokens.iter().map(|t| t.0));
        self.positions
            .extend((first_position..end).map(|p| p as u32));
        Ok(())
    }

    /// Gives the run of `seq` its recurrent-state slot (hybrid models need one per run).
    pub fn set_state_slot(&mut self, seq: SeqId, slot: SlotId) -> Result<()> {
        self.run_mut(seq)?.state_slot = Some(slot);
        Ok(())
    }

    /// The run of `seq`.
    fn run_mut(&mut self, seq: SeqId) -> Result<&mut SequenceRun> {
        self.runs
            .iter_mut()
            .find(|r| r.seq_id == seq)
            .ok_or_else(|| {
                ModelError::InvalidBatch(format!("sequence {} is not in the batch", seq.0))
            })
    }

    /// Has the run of `seq` keep its recurrent state after each of its tokens but the last,
    /// in the consecutive slots from `first` (a verify step's, so that the state at any
    /// accepted draft position can be taken without computing again).
    pub fn keep_states(&mut self, seq: SeqId, first: SlotId) -> Result<()> {
        self.run_mut(seq)?.kept_states = Some(first);
        Ok(())
    }

    /// Per run, the first slot keeping its states (`NO_KEPT_STATES` for none) into `out`;
    /// false (and `out` empty) where no run keeps any.
    pub(crate) fn kept_states_into(&self, out: &mut Vec<u32>) -> bool {
        out.clear();
        if self.runs.iter().all(|r| r.kept_states.is_none()) {
            return false;
        }
        out.extend(self.runs.iter().map(|r| {
            r.kept_states
                .map_or(corral_backend::NO_KEPT_STATES, |s| s.0)
        }));
        true
    }

    /// `[start, len, slot, fresh]` per run into `out`, for recurrent layers; false (and `out`
    /// empty) if a run has no slot.
    pub(crate) fn recurrent_runs_into(&self, out: &mut Vec<u32>) -> bool {
        out.clear();
        for run in &self.runs {
            let Some(slot) = run.state_slot else {
                out.clear();
                return false;
            };
            out.extend([
                run.start as u32,
                run.len as u32,
                slot.0,
                u32::from(run.first_position == 0),
            ]);
        }
        true
    }

    /// Token ids, flat.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Each token's position in its sequence.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// The runs, in batch order.
    pub fn runs(&self) -> &[SequenceRun] {
        &self.runs
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the batch has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Batch rows whose logits are wanted, in order; the forward returns logits in this order.
    pub fn logit_rows(&self) -> Vec<u32> {
        let mut rows = Vec::new();
        self.logit_rows_into(&mut rows);
        rows
    }

    /// [`RaggedBatch::logit_rows`] into `out`.
    pub(crate) fn logit_rows_into(&self, out: &mut Vec<u32>) {
        out.clear();
        for run in &self.runs {
            let range = run.start..run.start + run.len;
            match run.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => out.push((range.end - 1) as u32),
                LogitsWanted::All => out.extend(range.map(|r| r as u32)),
            }
        }
    }

    /// Each token's run index, into `out`.
    pub(crate) fn token_runs_into(&self, out: &mut Vec<u32>) {
        out.clear();
        for (i, run) in self.runs.iter().enumerate() {
            out.extend(std::iter::repeat_n(i as u32, run.len));
        }
    }

    /// Each token's cache slot, into `out`.
    pub(crate) fn slots_into(&self, out: &mut Vec<u32>) {
        let bs = self.block_size;
        out.clear();
        for run in &self.runs {
            for p in run.first_position..run.first_position + run.len {
                let block = run.block_table.blocks[p / bs].0 as usize;
                out.push((block * bs + p % bs) as u32);
            }
        }
    }

    /// Block tables flat into `out`, each padded with zeros to `width` (at least
    /// [`RaggedBatch::table_width`]).
    pub(crate) fn block_tables_into(&self, width: usize, out: &mut Vec<u32>) {
        out.clear();
        out.resize(width * self.runs.len(), 0);
        for (row, run) in out.chunks_exact_mut(width).zip(&self.runs) {
            row[..run.block_table.blocks.len()]
                .iter_mut()
                .zip(&run.block_table.blocks)
                .for_each(|(o, b)| *o = b.0);
        }
    }

    /// The width of the longest block table (at least 1).
    pub(crate) fn table_width(&self) -> usize {
        self.runs
            .iter()
            .map(|r| r.block_table.blocks.len())
            .max()
            .unwrap_or(0)
            .max(1)
    }
}
