//! A draft model beside the target: a second [`Model`] with its own KV cache and recurrent
//! states, proposing a sequence's next tokens greedily for the target to verify in one run.
//!
//! For each sequence it keeps the tokens its caches hold. A proposal first brings them up to
//! the sequence's tokens: what the target rejected is cut (KV truncated to the common prefix;
//! a recurrent state copied back from the snapshot taken before the last draft, the accepted
//! tokens computed again), the new tokens computed in one run; then each draft token is a
//! decode step.

use std::collections::HashMap;

use corral_model::{
    BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache, SeqId, SlotId,
    TokenId,
};

use crate::{Drafter, EngineError, KvBlockPool, StateSlotPool, argmax};

/// A sequence's part of the draft model's caches.
#[derive(Debug)]
struct Draft {
    /// Tokens its KV and state hold.
    computed: Vec<u32>,
    table: BlockTable,
    slot: SlotId,
    /// A copy of the state after `computed[..at]` (taken before the draft tokens), `(at,
    /// slot)`.
    snapshot: (usize, SlotId),
    /// The step it was last proposed for, for eviction.
    used: u64,
}

/// A draft model and its caches.
pub struct ModelDrafter {
    model: Model,
    cache: PagedKvCache,
    state: RecurrentStateCache,
    pool: KvBlockPool,
    slots: StateSlotPool,
    seqs: HashMap<SeqId, Draft>,
    /// Most sequences at once (a pair of slots each).
    capacity: usize,
    clock: u64,
    logits: Vec<f32>,
}

impl std::fmt::Debug for ModelDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDrafter")
            .field("sequences", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

impl ModelDrafter {
    /// `model` with a KV cache of `kv_blocks` blocks of `block_size` tokens, for up to
    /// `sequences` sequences at once (two state slots each: running and snapshot).
    pub fn new(
        model: Model,
        kv_blocks: usize,
        block_size: usize,
        sequences: usize,
    ) -> Result<Self, EngineError> {
        let backend = model.backend().as_ref();
        let cache = PagedKvCache::new(backend, model.config(), kv_blocks, block_size)?;
        let state = RecurrentStateCache::new(backend, model.config(), 2 * sequences.max(1))?;
        Ok(Self {
            cache,
            state,
            pool: KvBlockPool::new(kv_blocks, block_size),
            slots: StateSlotPool::new(2 * sequences.max(1)),
            seqs: HashMap::new(),
            capacity: sequences.max(1),
            clock: 0,
            logits: Vec::new(),
            model,
        })
    }

    /// The draft for `seq`, made room for (the least recently used sequence's dropped when
    /// no slots are free).
    fn entry(&mut self, seq: SeqId) -> Option<&mut Draft> {
        if !self.seqs.contains_key(&seq) {
            // Slots go in pairs: with every pair taken, the least recently used gives its up.
            if self.seqs.len() == self.capacity {
                let oldest = self.seqs.iter().min_by_key(|d| d.1.used).map(|d| *d.0)?;
                self.forget(oldest);
            }
            let (slot, spare) = (self.slots.acquire()?, self.slots.acquire()?);
            self.seqs.insert(
                seq,
                Draft {
                    computed: Vec::new(),
                    table: BlockTable::default(),
                    slot,
                    snapshot: (0, spare),
                    used: 0,
                },
            );
        }
        self.seqs.get_mut(&seq)
    }

    /// Runs `ids` after what `seq` has computed and returns the greedy next token.
    fn run(&mut self, seq: SeqId, ids: &[u32]) -> Result<u32, String> {
        let draft = self.seqs.get_mut(&seq).ok_or("no draft")?;
        let start = draft.computed.len();
        self.pool
            .grow(&mut draft.table, start + ids.len())
            .map_err(|e| e.to_string())?;
        let mut batch = RaggedBatch::new(self.pool.block_size());
        let tokens: Vec<TokenId> = ids.iter().map(|&t| TokenId(t)).collect();
        batch
            .push_run(seq, &tokens, start, &draft.table, LogitsWanted::Last)
            .map_err(|e| e.to_string())?;
        batch
            .set_state_slot(seq, draft.slot)
            .map_err(|e| e.to_string())?;
        let _report = self
            .model
            .forward_with_state(&batch, &mut self.cache, &mut self.state, &mut self.logits)
            .map_err(|e| e.to_string())?;
        draft.computed.extend_from_slice(ids);
        Ok(argmax(&self.logits))
    }

    /// Brings `seq`'s caches to `tokens` and proposes up to `max` tokens after them.
    fn draft(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Result<Vec<u32>, String> {
        let hybrid = self.model.is_hybrid();
        let backend = std::sync::Arc::clone(self.model.backend());
        let draft = self.seqs.get_mut(&seq).ok_or("no draft")?;
        let common = draft
            .computed
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            // At least the last token is run, for its logits.
            .min(tokens.len() - 1);
        if common < draft.computed.len() {
            let (at, spare) = draft.snapshot;
            let keep = if !hybrid {
                common
            } else if at <= common {
                self.state
                    .copy_slot(backend.as_ref(), spare, draft.slot)
                    .map_err(|e| e.to_string())?;
                at
            } else {
                0
            };
            draft.computed.truncate(keep);
            self.pool.truncate(&mut draft.table, keep);
        }
        let start = draft.computed.len();
        let mut next = self.run(seq, &tokens[start..])?;
        let draft = self.seqs.get_mut(&seq).ok_or("no draft")?;
        if hybrid {
            let (slot, spare) = (draft.slot, draft.snapshot.1);
            self.state
                .copy_slot(backend.as_ref(), slot, spare)
                .map_err(|e| e.to_string())?;
            draft.snapshot.0 = tokens.len();
        }
        let mut out = vec![next];
        while out.len() < max {
            next = self.run(seq, &[next])?;
            out.push(next);
        }
        Ok(out)
    }
}

impl Drafter for ModelDrafter {
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        if tokens.is_empty() || max == 0 {
            return Vec::new();
        }
        self.clock += 1;
        let clock = self.clock;
        let Some(draft) = self.entry(seq) else {
            return Vec::new();
        };
        draft.used = clock;
        match self.draft(seq, tokens, max) {
            Ok(tokens) => tokens,
            Err(e) => {
                // Out of blocks, or a failed pass: no draft this step, and a fresh start next.
                tracing::debug!(error = %e, "the draft model proposed nothing");
                self.forget(seq);
                Vec::new()
            }
        }
    }

    fn forget(&mut self, seq: SeqId) {
        if let Some(mut draft) = self.seqs.remove(&seq) {
            self.pool.release(&mut draft.table);
            self.slots.release(draft.slot);
            self.slots.release(draft.snapshot.1);
        }
    }
}
