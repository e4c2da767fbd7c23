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

use corral_backend::sampling::Filter;
use corral_model::{
    BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, SampledStep, SeqId, TokenId,
};

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
    /// The greedy reduction of each pass's rows.
    picks: SampledStep,
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
            picks: SampledStep::default(),
            out: Vec::new(),
            input: Vec::new(),
            head,
        })
    }

    fn width(&self) -> usize {
        self.head.config().hidden_size
    }

    /// Brings `seq`'s rows in the head up to the last token of `tokens`: the rows it has not
    /// run yet (true rows: the model's hidden state, the next token), as one run of a
    /// proposal's first pass, with KV room for `max` drafts after them.
    fn prepare(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Result<Prepared, String> {
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
        Ok(Prepared {
            seq,
            ids: tokens[start + 1..n].iter().map(|&t| TokenId(t)).collect(),
            position: start - s.offset,
            rows: (start - s.hidden_start) * width..(n - 1 - s.hidden_start) * width,
            last,
            max,
            n,
        })
    }

    /// One pass of the head over `runs` (`(sequence, tokens, KV position)`), `hidden` their
    /// rows' inputs in order: each run's last row's top token, its head output in `self.out`
    /// (one row a run).
    fn pass(
        &mut self,
        runs: &[(SeqId, &[TokenId], usize)],
        hidden: &[f32],
    ) -> Result<Vec<u32>, String> {
        let mut batch = RaggedBatch::new(self.pool.block_size());
        for &(seq, ids, position) in runs {
            let table = &self.seqs.get(&seq).ok_or("no rows")?.table;
            batch
                .push_run(seq, ids, position, table, LogitsWanted::Last)
                .map_err(|e| e.to_string())?;
        }
        // Each run's last row reduced to its top token where it is computed.
        let rows = runs.len();
        let step = &mut self.picks;
        step.rows.clear();
        step.rows
            .resize(rows, (Filter::GREEDY, Filter::GREEDY.draw(0)));
        step.penalties.clear();
        step.logprobs.clear();
        let _ = self
            .head
            .forward_mtp_sampled(&batch, &mut self.cache, hidden, step, &mut self.out)
            .map_err(|e| e.to_string())?;
        step.candidates
            .iter()
            .zip(&step.full_rows)
            .map(|(c, full)| match full {
                Some(logits) => Ok(argmax(logits)),
                None => c
                    .top
                    .first()
                    .map(|&(id, _)| id)
                    .ok_or_else(|| "a row without candidates".to_string()),
            })
            .collect()
    }

    /// Drafts for every one of `prepared` at once: a first pass over all their unseen rows,
    /// then one pass a further draft token over the sequences that want it, each row on its
    /// sequence's own last head output.
    fn draft(&mut self, prepared: &[Prepared]) -> Result<Vec<Vec<u32>>, String> {
        let width = self.width();
        let mut input = std::mem::take(&mut self.input);
        input.clear();
        for p in prepared {
            let s = self.seqs.get(&p.seq).ok_or("no rows")?;
            input.extend_from_slice(&s.hidden[p.rows.clone()]);
        }
        let runs: Vec<_> = prepared
            .iter()
            .map(|p| (p.seq, &p.ids[..], p.position))
            .collect();
        let first = self.pass(&runs, &input);
        let mut drafts: Vec<Vec<u32>> = first?.into_iter().map(|t| vec![t]).collect();
        // Sequences still drafting (index into `prepared`), in the order of `self.out`'s rows.
        let mut going: Vec<usize> = (0..prepared.len()).collect();
        loop {
            // Those wanting another token, each on its own last head output.
            input.clear();
            let mut next = Vec::new();
            for (row, &i) in going.iter().enumerate() {
                if drafts[i].len() < prepared[i].max {
                    next.push(i);
                    input.extend_from_slice(&self.out[row * width..(row + 1) * width]);
                }
            }
            if next.is_empty() {
                break;
            }
            let tokens: Vec<[TokenId; 1]> = next
                .iter()
                .map(|&i| [TokenId(drafts[i][drafts[i].len() - 1])])
                .collect();
            let runs: Vec<_> = next
                .iter()
                .zip(&tokens)
                .map(|(&i, token)| {
                    (
                        prepared[i].seq,
                        &token[..],
                        prepared[i].last + drafts[i].len() - 1,
                    )
                })
                .collect();
            let picked = self.pass(&runs, &input)?;
            for (&i, token) in next.iter().zip(picked) {
                drafts[i].push(token);
            }
            going = next;
        }
        self.input = input;
        // Rows up to n - 2 are true rows now; the hidden state at n - 2 is kept in case the
        // next proposal comes before a step computes more.
        for p in prepared {
            if let Some(s) = self.seqs.get_mut(&p.seq) {
                s.done = p.n - 1;
                let drop = (p.n - 2 - s.hidden_start) * width;
                s.hidden.drain(..drop);
                s.hidden_start = p.n - 2;
            }
        }
        Ok(drafts)
    }
}

/// A sequence's part of a proposal ([`MtpDrafter::prepare`]).
struct Prepared {
    seq: SeqId,
    /// The tokens of its unseen rows, and the KV position of the first.
    ids: Vec<TokenId>,
    position: usize,
    /// Their hidden states' range in its `hidden`.
    rows: std::ops::Range<usize>,
    /// The KV position of its last true row.
    last: usize,
    /// Most draft tokens.
    max: usize,
    /// Tokens of the sequence.
    n: usize,
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        self.propose_many(&[(seq, tokens, max)])
            .pop()
            .unwrap_or_default()
    }

    /// One pass of the head a draft position for all of `requests` together.
    fn propose_many(&mut self, requests: &[(SeqId, &[u32], usize)]) -> Vec<Vec<u32>> {
        self.clock += 1;
        let mut prepared = Vec::new();
        let mut at = Vec::new();
        for (i, &(seq, tokens, max)) in requests.iter().enumerate() {
            let Some(s) = self.seqs.get_mut(&seq).filter(|_| max > 0) else {
                continue;
            };
            s.used = self.clock;
            match self.prepare(seq, tokens, max) {
                Ok(p) => {
                    prepared.push(p);
                    at.push(i);
                }
                Err(e) => {
                    // Out of blocks or hidden states missing: no draft this step, and a
                    // fresh start from the next step's rows.
                    tracing::debug!(error = %e, "the MTP head proposed nothing");
                    self.forget(seq);
                }
            }
        }
        let mut drafts = vec![Vec::new(); requests.len()];
        if prepared.is_empty() {
            return drafts;
        }
        match self.draft(&prepared) {
            Ok(found) => {
                for (i, d) in at.into_iter().zip(found) {
                    drafts[i] = d;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "the MTP head's pass failed");
                for p in &prepared {
                    self.forget(p.seq);
                }
            }
        }
        drafts
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

    use corral_cpu::CpuBackend;

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

    /// Sequences drafted together (one pass of the head a draft position, rows of unequal
    /// counts and draft lengths) get what each gets drafted alone.
    #[test]
    fn drafts_made_together_equal_drafts_made_alone() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen3_5_moe_mtp");
        let head = || Model::load_mtp(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).unwrap();
        let width = head().config().hidden_size;
        let sequences: Vec<(SeqId, Vec<u32>, Vec<f32>, usize)> = (0..3u32)
            .map(|k| {
                let n = 9 + 5 * k as usize;
                let tokens = (0..n as u32).map(|t| (t * 31 + k * 17 + 7) % 250).collect();
                let hidden = (0..(n - 1) * width)
                    .map(|i| (((i + k as usize * 101) * 7919 % 1000) as f32 / 500.0) - 1.0)
                    .collect();
                (SeqId(u64::from(k)), tokens, hidden, 1 + k as usize)
            })
            .collect();
        let mut together = MtpDrafter::new(head(), 512, 4, 3).unwrap();
        for (seq, _, hidden, _) in &sequences {
            together.observe(*seq, 0, hidden);
        }
        let requests: Vec<(SeqId, &[u32], usize)> = sequences
            .iter()
            .map(|(seq, tokens, _, max)| (*seq, &tokens[..], *max))
            .collect();
        let drafts = together.propose_many(&requests);
        for ((seq, tokens, hidden, max), draft) in sequences.iter().zip(&drafts) {
            let mut alone = MtpDrafter::new(head(), 512, 4, 1).unwrap();
            alone.observe(*seq, 0, hidden);
            assert_eq!(draft.len(), *max);
            assert_eq!(draft, &alone.propose(*seq, tokens, *max), "{seq:?}");
        }
    }
}
