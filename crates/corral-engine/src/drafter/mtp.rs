//! The model's own MTP head as the drafter: row t of the head takes the model's final hidden
//! state at t and the token at t + 1 and predicts the token at t + 2; chained on its own
//! hidden state, it drafts several.
//!
//! The engine hands it the hidden state of every token a step computes
//! ([`Drafter::observe`]). A proposal runs the head over the rows it has not seen (a
//! prompt's, the tokens accepted since), in its own one-layer KV cache, the last row giving
//! the first draft; each further draft is one more row on the head's own output. Draft rows
//! are overwritten by the true rows of the next proposal (same positions), so a rejected
//! draft leaves nothing behind. A sequence the head first sees part-way (its prompt's start
//! taken from the prefix cache, not computed) is drafted from there: its rows sit at
//! positions counted from the first one seen, which RoPE cannot tell apart.

use std::collections::HashMap;

use corral_model::{BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, SeqId, TokenId};

use crate::{Drafter, EngineError, KvBlockPool, argmax};

/// Most of the model's hidden states kept for a sequence the head has not run over yet.
const MAX_PENDING_ROWS: usize = 1024;

/// A sequence's rows in the head.
#[derive(Debug)]
struct MtpSeq {
    /// The first position the head has seen: its KV row 0.
    offset: usize,
    /// True rows (the model's hidden state, the sequence's next token) the head's KV holds:
    /// positions `offset..done`.
    done: usize,
    /// The model's hidden states not yet run through the head: positions from
    /// `hidden_start`, `[rows, width]`.
    hidden_start: usize,
    hidden: Vec<f32>,
    table: BlockTable,
    /// The proposal it was last used for, for eviction.
    used: u64,
}

/// An MTP head ([`Model::load_mtp`]) and its KV cache.
pub struct MtpDrafter {
    head: Model,
    cache: PagedKvCache,
    pool: KvBlockPool,
    seqs: HashMap<SeqId, MtpSeq>,
    /// Most sequences kept at once.
    capacity: usize,
    clock: u64,
    logits: Vec<f32>,
    out: Vec<f32>,
    input: Vec<f32>,
}

impl std::fmt::Debug for MtpDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpDrafter")
            .field("sequences", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

impl MtpDrafter {
    /// `head` with a KV cache of `kv_blocks` blocks of `block_size` tokens (one attention
    /// layer's), for up to `sequences` sequences at once.
    pub fn new(
        head: Model,
        kv_blocks: usize,
        block_size: usize,
        sequences: usize,
    ) -> Result<Self, EngineError> {
        let cache = PagedKvCache::new(
            head.backend().as_ref(),
            head.config(),
            kv_blocks,
            block_size,
        )?;
        Ok(Self {
            cache,
            pool: KvBlockPool::new(kv_blocks, block_size),
            seqs: HashMap::new(),
            capacity: sequences.max(1),
            clock: 0,
            logits: Vec::new(),
            out: Vec::new(),
            input: Vec::new(),
            head,
        })
    }

    fn width(&self) -> usize {
        self.head.config().hidden_size
    }

    /// Runs the head over `seq`'s unseen rows up to the last token of `tokens` and chains
    /// `max` drafts after it.
    fn draft(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Result<Vec<u32>, String> {
        let width = self.width();
        let n = tokens.len();
        let s = self.seqs.get_mut(&seq).ok_or("no rows")?;
        // The model's hidden states reach position n - 2 (the last token is not computed yet).
        let stored = s.hidden.len() / width;
        if n < 2 || s.hidden_start + stored < n - 1 {
            return Err(format!(
                "hidden states to position {} of {n} tokens",
                s.hidden_start + stored
            ));
        }
        // The row before the last is run again when nothing new was computed since (its
        // logits are the first draft's).
        let mut start = s.done.min(n - 2);
        if s.hidden_start > start {
            // Rows were never seen (computed before the head was asked, or forgotten): the
            // head starts afresh from the first it has.
            s.offset = s.hidden_start;
            s.done = s.hidden_start;
            start = s.hidden_start;
            self.pool.truncate(&mut s.table, 0);
        }
        if start < s.offset {
            return Err("rows before the head's first".to_string());
        }
        let last = n - 1 - s.offset;
        self.pool
            .grow(&mut s.table, last + max)
            .map_err(|e| e.to_string())?;
        let ids: Vec<TokenId> = tokens[start + 1..n].iter().map(|&t| TokenId(t)).collect();
        let rows = &s.hidden[(start - s.hidden_start) * width..(n - 1 - s.hidden_start) * width];
        let mut head = HeadRun {
            head: &self.head,
            cache: &mut self.cache,
            block_size: self.pool.block_size(),
            seq,
            table: &s.table,
        };
        let mut drafts = vec![head.forward(
            &ids,
            start - s.offset,
            rows,
            (&mut self.logits, &mut self.out),
        )?];
        while drafts.len() < max {
            std::mem::swap(&mut self.input, &mut self.out);
            let token = [TokenId(drafts[drafts.len() - 1])];
            let position = last + drafts.len() - 1;
            let next = head.forward(
                &token,
                position,
                &self.input,
                (&mut self.logits, &mut self.out),
            )?;
            drafts.push(next);
        }
        // Rows up to n - 2 are true rows now; the hidden state at n - 2 is kept in case the
        // next proposal comes before a step computes more.
        s.done = n - 1;
        let drop = (n - 2 - s.hidden_start) * width;
        s.hidden.drain(..drop);
        s.hidden_start = n - 2;
        Ok(drafts)
    }
}

/// One sequence's rows through the head.
struct HeadRun<'a> {
    head: &'a Model,
    cache: &'a mut PagedKvCache,
    block_size: usize,
    seq: SeqId,
    table: &'a BlockTable,
}

impl HeadRun<'_> {
    /// Runs `ids` from KV position `position` with the hidden states `hidden` (one row
    /// each); the last row's top token, its logits and head output left in `(logits, out)`.
    fn forward(
        &mut self,
        ids: &[TokenId],
        position: usize,
        hidden: &[f32],
        (logits, out): (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<u32, String> {
        let mut batch = RaggedBatch::new(self.block_size);
        batch
            .push_run(self.seq, ids, position, self.table, LogitsWanted::Last)
            .map_err(|e| e.to_string())?;
        let _ = self
            .head
            .forward_mtp(&batch, self.cache, hidden, logits, out)
            .map_err(|e| e.to_string())?;
        Ok(argmax(logits))
    }
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        if max == 0 || !self.seqs.contains_key(&seq) {
            return Vec::new();
        }
        self.clock += 1;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.used = self.clock;
        }
        match self.draft(seq, tokens, max) {
            Ok(drafts) => drafts,
            Err(e) => {
                // Out of blocks, hidden states missing, or a failed pass: no draft this step,
                // and a fresh start from the next step's rows.
                tracing::debug!(error = %e, "the MTP head proposed nothing");
                self.forget(seq);
                Vec::new()
            }
        }
    }

    fn forget(&mut self, seq: SeqId) {
        if let Some(mut s) = self.seqs.remove(&seq) {
            self.pool.release(&mut s.table);
        }
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, seq: SeqId, first: usize, hidden: &[f32]) {
        let width = self.width();
        if !self.seqs.contains_key(&seq) && self.seqs.len() >= self.capacity {
            let oldest = self.seqs.iter().min_by_key(|s| s.1.used).map(|s| *s.0);
            if let Some(oldest) = oldest {
                self.forget(oldest);
            }
        }
        let s = self.seqs.entry(seq).or_insert_with(|| MtpSeq {
            offset: first,
            done: first,
            hidden_start: first,
            hidden: Vec::new(),
            table: BlockTable::default(),
            used: 0,
        });
        let stored = s.hidden.len() / width;
        if first >= s.hidden_start && first <= s.hidden_start + stored {
            // Rows from `first` on were a rejected draft's (or are computed again).
            s.hidden.truncate((first - s.hidden_start) * width);
        } else {
            s.hidden.clear();
            s.hidden_start = first;
        }
        s.hidden.extend_from_slice(hidden);
        // A sequence that does not draft for a while (a full batch) keeps only its latest
        // rows: the head starts again from them when it drafts.
        let excess = (s.hidden.len() / width).saturating_sub(MAX_PENDING_ROWS);
        if excess > 0 {
            s.hidden.drain(..excess * width);
            s.hidden_start += excess;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use corral_backend::CpuBackend;

    use super::*;

    /// A sequence the head has not drafted for keeps only its latest hidden states, and
    /// drafts from them.
    #[test]
    fn a_waiting_sequence_keeps_its_latest_rows() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen3_5_moe_mtp");
        let head = Model::load_mtp(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).unwrap();
        let width = head.config().hidden_size;
        let mut drafter = MtpDrafter::new(head, 512, 4, 1).unwrap();
        let rows = MAX_PENDING_ROWS + 176;
        let hidden: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let seq = SeqId(1);
        for (chunk, start) in hidden.chunks(100 * width).zip((0..).step_by(100)) {
            drafter.observe(seq, start, chunk);
        }
        let s = &drafter.seqs[&seq];
        assert_eq!(s.hidden.len(), MAX_PENDING_ROWS * width);
        assert_eq!(s.hidden_start, rows - MAX_PENDING_ROWS);
        assert_eq!(s.hidden[..], hidden[(rows - MAX_PENDING_ROWS) * width..]);
        let tokens: Vec<u32> = (0..=rows as u32).map(|t| (t * 31 + 7) % 250).collect();
        assert_eq!(drafter.propose(seq, &tokens, 3).len(), 3);
        assert_eq!(
            drafter.seqs[&seq].offset,
            rows - MAX_PENDING_ROWS,
            "drafted from the rows kept"
        );
    }
}
