//! The KV manager: the one owner of what sequences hold in the cache — KV blocks, recurrent
//! state slots, the prefix cache with its state checkpoints, and sessions on disk — behind
//! the calls the scheduler plans with: what a new sequence finds computed for its tokens
//! ([`KvManager::admit`]), blocks for n tokens or not ([`KvManager::grant`]), a sequence cut
//! back to n tokens ([`KvManager::truncate`]), a snapshot of its recurrent state and its
//! return ([`KvManager::snapshot`], [`KvManager::roll_back`]), and its end
//! ([`KvManager::release`]).
//!
//! Copies between blocks and between state slots are planned here and made by the engine
//! around the forward pass ([`Copies`]), so that no call waits on the device.

use std::time::{Duration, Instant};

use corral_model::{BlockId, BlockTable, SeqId, SlotId};

use super::{EvictedPrefix, EvictionCost, KvBlockPool, PrefixCache, StateSlotPool};

/// A restore from sessions on disk under way, as its store names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RestoreId(pub u64);

/// Sessions on disk as the KV manager uses them: the engine implements it over its caches, so
/// that a cold prefix is written out when the cache evicts it and read back into a new
/// sequence's blocks (and state slot) at admission.
pub trait SessionStore {
    /// Writes an evicted prefix to disk if worth it; failures are the store's to log.
    fn spill(&mut self, prefix: &EvictedPrefix<'_>);
    /// Writes a cached prefix that stays cached, while the engine is idle, if worth it and
    /// the folder has room for it without dropping another file.
    fn write_ahead(&mut self, prefix: &EvictedPrefix<'_>);
    /// The longest spilled prefix of `tokens` of at most `max_tokens` tokens, if it holds more
    /// than `beyond` (what the cache gave already): its length and the restore, whose reads
    /// start in the background; its files are kept from the byte cap until it ends.
    fn find(
        &mut self,
        tokens: &[u32],
        beyond: usize,
        max_tokens: usize,
    ) -> Option<(usize, RestoreId)>;
    /// Restore `id` into `blocks`, and its state into `slot` (hybrid models): `None` while
    /// its reads are in flight, then its result (the data copied in). On an error the files
    /// at fault are deleted and nothing it held may be used.
    fn poll_load(
        &mut self,
        id: RestoreId,
        blocks: &[BlockId],
        slot: Option<SlotId>,
    ) -> Option<Result<(), String>>;
    /// Drops every restore but `ids` (the others' sequences went away), and lets the byte cap
    /// have their files again.
    fn keep_restores(&mut self, ids: &[RestoreId]);
}

/// A block copy planned for a sequence: `(sequence, cached block, its block)`.
pub(crate) type BlockCopy = (SeqId, BlockId, BlockId);

/// A state copy planned for a sequence: `(sequence, from slot, to slot)`.
pub(crate) type StateCopy = (SeqId, SlotId, SlotId);

/// What one sequence holds in the cache.
#[derive(Debug, Default)]
pub(crate) struct SeqKv {
    /// Tokens whose KV (and recurrent state) is in the cache.
    pub(crate) computed: usize,
    /// Tokens of `computed` in a block whose copy from the prefix cache is planned but not
    /// yet made (before the sequence's first step): not to be cached if it ends first.
    pub(crate) uncopied: usize,
    pub(crate) table: BlockTable,
    /// Recurrent-state slot while running.
    pub(crate) slot: Option<SlotId>,
    /// Tokens computed at which a state checkpoint is to be taken (hybrids, prefill).
    pub(crate) checkpoint_at: Vec<usize>,
    /// State checkpoints taken, `(tokens covered, checkpoint slot)`, for the prefix cache.
    pub(crate) checkpoints: Vec<(usize, SlotId)>,
    /// Which of them is the output checkpoint (tokens covered), replaced as decode goes on.
    pub(crate) output_checkpoint: Option<usize>,
    /// A copy of its recurrent state, `(tokens covered, slot)`, to roll back to.
    pub(crate) snapshot: Option<(usize, SlotId)>,
    /// Its slot's state has taken tokens past `computed` (a rejected draft's) and is not to
    /// be checkpointed until the roll-back is made.
    pub(crate) state_ahead: bool,
    /// The first of the slots its verify step keeps its states in, after each token but the
    /// last ([`KvManager::keep_states`]), in place of a snapshot.
    pub(crate) kept: Option<SlotId>,
    /// A restore from session files under way, `(tokens it gives, restore)`: its blocks are
    /// held, nothing is computed until it ends.
    pub(crate) restoring: Option<(usize, RestoreId)>,
    /// Tokens it found computed at admission (in the cache or on disk): reused, for the
    /// prefix cache's record of what goes on being used.
    pub(crate) reused: usize,
}

/// Copies to make before a step's forward pass, in this order: blocks, checkpoint restores,
/// then snapshots and roll-backs of running states.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    pub(crate) blocks: Vec<BlockCopy>,
    /// `(sequence, checkpoint slot, its slot)`: a resumed sequence's state.
    pub(crate) restores: Vec<StateCopy>,
    /// `(sequence, from, to)`: a snapshot taken or rolled back to.
    pub(crate) states: Vec<StateCopy>,
}

/// Why [`KvManager::grant`] gave no blocks.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoGrant {
    /// More blocks than the whole pool: preempting others would not help.
    Never { blocks: usize, pool: usize },
    /// Not now: others hold them.
    Short,
}

/// The owner of the cache's blocks, state slots, prefix cache and spill store.
#[derive(Debug)]
pub(crate) struct KvManager {
    pool: KvBlockPool,
    slots: StateSlotPool,
    prefix: Option<PrefixCache>,
    /// Whether the model keeps recurrent state (snapshots copy it).
    recurrent: bool,
    session_pin: Duration,
    /// Snapshot slots that a planned roll-back still copies from; free from the next step on.
    retired: Vec<SlotId>,
    /// Groups of consecutive slots that verify steps keep intermediate states in: the free
    /// groups' first slots, and the slots of a group.
    kept_groups: Vec<SlotId>,
    kept_group_len: usize,
    /// Groups that a planned selection still copies from; free from the next step on.
    retired_groups: Vec<SlotId>,
}

impl KvManager {
    /// A manager over `pool`, with `running_slots` recurrent-state slots.
    pub(crate) fn new(pool: KvBlockPool, running_slots: usize, session_pin: Duration) -> Self {
        Self {
            pool,
            slots: StateSlotPool::new(running_slots),
            prefix: None,
            recurrent: false,
            session_pin,
            retired: Vec::new(),
            kept_groups: Vec::new(),
            kept_group_len: 0,
            retired_groups: Vec::new(),
        }
    }

    /// Verify steps keep a hybrid's state after each draft position, in `groups` groups of
    /// `group_len` consecutive slots from `first_slot` on: a rejection then takes the state
    /// at the last accepted token from its group instead of computing the accepted tokens
    /// again from a snapshot (which sequences fall back to when no group is free).
    pub(crate) fn with_kept_states(
        mut self,
        first_slot: usize,
        groups: usize,
        group_len: usize,
    ) -> Self {
        self.kept_groups = (0..groups)
            .rev()
            .map(|g| SlotId((first_slot + g * group_len) as u32))
            .collect();
        self.kept_group_len = group_len;
        self
    }

    /// Keeps computed blocks in a prefix cache for later sequences.
    pub(crate) fn with_prefix_cache(mut self) -> Self {
        self.prefix = Some(PrefixCache::new(self.pool.block_size()));
        self
    }

    /// Keeps computed blocks and recurrent-state checkpoints in a prefix cache (hybrid
    /// models): `checkpoints` state slots from `first_slot` on (after the running ones).
    pub(crate) fn with_state_checkpoints(mut self, first_slot: usize, checkpoints: usize) -> Self {
        self.prefix = Some(PrefixCache::with_checkpoints(
            self.pool.block_size(),
            StateSlotPool::range(first_slot, checkpoints),
        ));
        self.recurrent = true;
        self
    }

    /// The model keeps recurrent state without the prefix cache's checkpoints: snapshots
    /// take spare slots, `snapshot_slots` of them past the running ones.
    pub(crate) fn with_recurrent_state(mut self, snapshot_slots: usize) -> Self {
        self.recurrent = true;
        self.slots = StateSlotPool::new(self.slots.capacity() + snapshot_slots);
        self
    }

    /// The prefix cache evicts by recency and prefill FLOPs saved per byte (`cost`).
    pub(crate) fn with_eviction_cost(mut self, cost: EvictionCost) -> Self {
        self.prefix = self.prefix.map(|p| p.with_eviction_cost(cost));
        self
    }

    /// The block pool.
    pub(crate) fn pool(&self) -> &KvBlockPool {
        &self.pool
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// State checkpoints the prefix cache holds.
    pub(crate) fn cached_checkpoints(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::num_checkpoints)
    }

    /// Session pins in force.
    pub(crate) fn session_pins(&self) -> usize {
        let now = Instant::now();
        self.prefix.as_ref().map_or(0, |p| p.num_pins(now))
    }

    /// KV blocks the prefix cache indexes (none without a cache).
    pub(crate) fn cached_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixCache::num_blocks)
    }

    /// Recurrent-state slots held by running sequences.
    pub(crate) fn slots_in_use(&self) -> usize {
        self.slots.num_used()
    }

    /// KV blocks held by sequences (the cache's idle blocks excluded).
    pub(crate) fn blocks_in_use(&self) -> usize {
        let idle = self
            .prefix
            .as_ref()
            .map_or(0, |p| p.num_idle_blocks(&self.pool));
        self.pool.num_used() - idle
    }

    /// Frees the snapshot slots that roll-backs of the last step copy from (the copies are
    /// planned first in this step); called as a step is planned.
    pub(crate) fn begin_step(&mut self) {
        for spare in std::mem::take(&mut self.retired) {
            self.free_spare(spare);
        }
        self.kept_groups.append(&mut self.retired_groups);
    }

    /// Before a step verifying `drafted` tokens: a group of slots to keep `kv`'s state in
    /// after each of the run's tokens but the last. False where none is free or a group is
    /// too short (a snapshot is taken instead).
    pub(crate) fn keep_states(&mut self, kv: &mut SeqKv, drafted: usize) -> bool {
        self.drop_kept(kv);
        if !self.recurrent || kv.slot.is_none() || drafted > self.kept_group_len {
            return false;
        }
        match self.kept_groups.pop() {
            Some(first) => {
                self.drop_snapshot(kv);
                kv.kept = Some(first);
                true
            }
            None => false,
        }
    }

    /// Gives `kv`'s group of kept states back, if it holds one.
    fn drop_kept(&mut self, kv: &mut SeqKv) {
        if let Some(first) = kv.kept.take() {
            self.kept_groups.push(first);
        }
    }

    /// A running slot for a sequence being admitted, if one is free.
    pub(crate) fn acquire_slot(&mut self, kv: &mut SeqKv) -> bool {
        match self.slots.acquire() {
            Some(slot) => {
                kv.slot = Some(slot);
                true
            }
            None => false,
        }
    }

    /// What sequence `id` (with a slot, holding no blocks) finds computed for `tokens`, whose
    /// first `prompt_len` are its prompt: the longest cached prefix (down to a token), or a
    /// longer spilled one from `store`; at least the last token is left to compute, for its
    /// logits. The copies it needs go to `copies`.
    pub(crate) fn admit<'s>(
        &mut self,
        id: SeqId,
        kv: &mut SeqKv,
        tokens: &[u32],
        prompt_len: usize,
        copies: &mut Copies,
        mut store: Option<&mut (dyn SessionStore + 's)>,
    ) {
        let (Some(prefix), Some(slot)) = (&mut self.prefix, kv.slot) else {
            return;
        };
        if !kv.table.blocks.is_empty() {
            return;
        }
        let bs = self.pool.block_size();
        let usable = tokens.len() - 1;
        let pool = &mut self.pool;
        take_cached_prefix(
            prefix,
            pool,
            (id, kv, slot),
            (tokens, prompt_len),
            copies,
            store.as_deref_mut(),
        );
        let Some(store) = store else {
            return;
        };
        let Some((len, restore)) = store.find(tokens, kv.computed, usable) else {
            return;
        };
        // The file holds the whole prefix: the cached blocks go back first (and may be
        // evicted to make room); its restore goes on while the sequence waits, and where it
        // fails the cache is looked up again (see `poll_restore`).
        pool.release(&mut kv.table);
        copies.restores.retain(|r| r.0 != id);
        drop_copies(&mut copies.blocks, pool, |c| c.0 == id);
        let need = len.div_ceil(bs);
        if need > pool.num_free() {
            evict(prefix, pool, need, Some(&mut *store));
        }
        let mut table = BlockTable::default();
        if pool.grow(&mut table, len).is_ok() {
            kv.table = table;
            kv.computed = 0;
            kv.uncopied = 0;
            kv.restoring = Some((len, restore));
        } else {
            take_cached_prefix(
                prefix,
                pool,
                (id, kv, slot),
                (tokens, prompt_len),
                copies,
                Some(store),
            );
        }
    }

    /// Moves sequence `id`'s restore from a session file on: true once it has ended (or
    /// there was none), its tokens computed, or, where the file could not be read, the
    /// sequence started from the cache instead (its copies in `copies`).
    pub(crate) fn poll_restore<'s>(
        &mut self,
        id: SeqId,
        kv: &mut SeqKv,
        (tokens, prompt_len): (&[u32], usize),
        copies: &mut Copies,
        store: &mut (dyn SessionStore + 's),
    ) -> bool {
        let (Some((len, restore)), Some(prefix), Some(slot)) =
            (kv.restoring, &mut self.prefix, kv.slot)
        else {
            return true;
        };
        let hybrid = prefix.keeps_checkpoints();
        match store.poll_load(restore, &kv.table.blocks, hybrid.then_some(slot)) {
            None => false,
            Some(Ok(())) => {
                kv.restoring = None;
                kv.computed = len;
                kv.reused = len;
                kv.checkpoint_at.retain(|&p| p > len);
                true
            }
            Some(Err(_)) => {
                kv.restoring = None;
                self.pool.release(&mut kv.table);
                take_cached_prefix(
                    prefix,
                    &mut self.pool,
                    (id, kv, slot),
                    (tokens, prompt_len),
                    copies,
                    Some(store),
                );
                true
            }
        }
    }

    /// Blocks for `kv` to hold `tokens` tokens: cached blocks nobody holds are evicted first
    /// (written to `store` if there is one).
    pub(crate) fn grant<'s>(
        &mut self,
        kv: &mut SeqKv,
        tokens: usize,
        store: Option<&mut (dyn SessionStore + 's)>,
    ) -> Result<(), NoGrant> {
        let blocks = tokens.div_ceil(self.pool.block_size());
        if blocks > self.pool.num_blocks() {
            return Err(NoGrant::Never {
                blocks,
                pool: self.pool.num_blocks(),
            });
        }
        if let Some(prefix) = &mut self.prefix {
            let short = blocks.saturating_sub(kv.table.blocks.len());
            if short > self.pool.num_free() {
                evict(prefix, &mut self.pool, short, store);
            }
        }
        self.pool
            .grow(&mut kv.table, tokens)
            .map_err(|_| NoGrant::Short)
    }

    /// Cuts `kv` back to its first `tokens` tokens (a rejected draft's tail): blocks past
    /// them go back, checkpoints past them are dropped. Its recurrent state is not touched
    /// (see [`KvManager::roll_back`]).
    pub(crate) fn truncate(&mut self, kv: &mut SeqKv, tokens: usize) {
        kv.computed = kv.computed.min(tokens);
        self.pool.truncate(&mut kv.table, tokens);
        if let Some(prefix) = &mut self.prefix {
            let (kept, dropped): (Vec<_>, Vec<_>) =
                kv.checkpoints.drain(..).partition(|c| c.0 <= tokens);
            kv.checkpoints = kept;
            for (_, slot) in dropped {
                prefix.release_checkpoint(slot);
            }
            if kv.output_checkpoint.is_some_and(|at| at > tokens) {
                kv.output_checkpoint = None;
            }
        }
    }

    /// Takes a copy of `kv`'s recurrent state as it is now (after `kv.computed` tokens) into
    /// a spare slot, planned in `copies`; false where no slot is spare. Without recurrent
    /// state there is nothing to copy and it always succeeds.
    pub(crate) fn snapshot(&mut self, id: SeqId, kv: &mut SeqKv, copies: &mut Copies) -> bool {
        if !self.recurrent {
            return true;
        }
        let Some(slot) = kv.slot else {
            return false;
        };
        self.drop_snapshot(kv);
        let spare = match &mut self.prefix {
            Some(prefix) => prefix.take_checkpoint_slot(),
            None => self.slots.acquire(),
        };
        let Some(spare) = spare else {
            return false;
        };
        kv.snapshot = Some((kv.computed, spare));
        copies.states.push((id, slot, spare));
        true
    }

    /// Puts `kv` back to its snapshot: KV and state as they were after the snapshot's
    /// tokens (the state copied back before the next step, planned in `copies`). False, with
    /// nothing changed, where there is no snapshot.
    pub(crate) fn roll_back(&mut self, id: SeqId, kv: &mut SeqKv, copies: &mut Copies) -> bool {
        let (Some((at, spare)), Some(slot)) = (kv.snapshot, kv.slot) else {
            return false;
        };
        kv.snapshot = None;
        self.truncate(kv, at);
        copies.states.push((id, spare, slot));
        self.retired.push(spare);
        kv.state_ahead = true;
        true
    }

    /// After a step that verified `drafted` tokens past `kv.computed` and accepted the first
    /// `accepted`: KV (and state) kept for those, the rest cut. A recurrent state that took
    /// a rejected token goes back to its snapshot where the sequence `goes_on` (its accepted
    /// tokens then computed again), or else is only marked ahead (no checkpoint from it).
    pub(crate) fn settle_draft(
        &mut self,
        id: SeqId,
        kv: &mut SeqKv,
        (accepted, drafted): (usize, usize),
        goes_on: bool,
        copies: &mut Copies,
    ) {
        if let Some(first) = kv.kept {
            if accepted == drafted {
                self.drop_kept(kv);
                kv.computed += drafted;
                return;
            }
            // The state after the last accepted token (the run's token `accepted`) is copied
            // into the sequence's slot before the next step; its group is free after that.
            kv.kept = None;
            match kv.slot.filter(|_| goes_on) {
                Some(slot) => {
                    copies
                        .states
                        .push((id, SlotId(first.0 + accepted as u32), slot));
                    self.retired_groups.push(first);
                }
                None => self.kept_groups.push(first),
            }
            kv.state_ahead = true;
            kv.computed += accepted;
            let kept = kv.computed;
            self.truncate(kv, kept);
            return;
        }
        if accepted == drafted {
            kv.computed += drafted;
            self.drop_snapshot(kv);
            return;
        }
        if self.recurrent && goes_on && self.roll_back(id, kv, copies) {
            return;
        }
        kv.state_ahead |= self.recurrent;
        self.drop_snapshot(kv);
        kv.computed += accepted;
        let kept = kv.computed;
        self.truncate(kv, kept);
    }

    /// Drops `kv`'s snapshot, if any (no copy reads it any more).
    pub(crate) fn drop_snapshot(&mut self, kv: &mut SeqKv) {
        if let Some((_, spare)) = kv.snapshot.take() {
            self.free_spare(spare);
        }
    }

    fn free_spare(&mut self, spare: SlotId) {
        match &mut self.prefix {
            Some(prefix) => prefix.release_checkpoint(spare),
            None => self.slots.release(spare),
        }
    }

    /// Returns a sequence's KV blocks, state slot and snapshot; with a prefix cache, its
    /// computed whole blocks of `tokens` (and the checkpoints within them) stay indexed there,
    /// pinned for `session` if it has one.
    pub(crate) fn release(&mut self, kv: &mut SeqKv, tokens: &[u32], session: Option<&str>) {
        self.drop_snapshot(kv);
        self.drop_kept(kv);
        kv.restoring = None;
        if let Some(prefix) = &mut self.prefix {
            // Checkpoints past what is computed (a failed step's) are not trusted.
            // A block still to be copied holds nothing yet.
            let computed = kv.computed - std::mem::take(&mut kv.uncopied);
            kv.output_checkpoint = None;
            let (kept, dropped): (Vec<_>, Vec<_>) =
                kv.checkpoints.drain(..).partition(|c| c.0 <= computed);
            let end = prefix.insert_with_checkpoints(
                &tokens[..computed],
                &kv.table,
                &kept,
                kv.reused.min(computed),
                &mut self.pool,
            );
            if let (Some(session), Some(end), false) = (session, end, self.session_pin.is_zero()) {
                prefix.pin(session, end, Instant::now() + self.session_pin);
            }
            for (_, slot) in dropped {
                prefix.release_checkpoint(slot);
            }
        }
        self.pool.release(&mut kv.table);
        if let Some(slot) = kv.slot.take() {
            self.slots.release(slot);
        }
    }

    /// Drops the planned block copies that `gone` picks, returning the holder each took on
    /// its cached block.
    pub(crate) fn drop_copies(
        &mut self,
        copies: &mut Vec<BlockCopy>,
        gone: impl FnMut(&BlockCopy) -> bool,
    ) {
        drop_copies(copies, &mut self.pool, gone);
    }

    /// Drops the checkpoint in `slot` if `kv` holds it (its copy failed); true if it did.
    pub(crate) fn forget_held_checkpoint(&mut self, kv: &mut SeqKv, slot: SlotId) -> bool {
        let Some(i) = kv.checkpoints.iter().position(|c| c.1 == slot) else {
            return false;
        };
        kv.checkpoints.remove(i);
        if let Some(prefix) = &mut self.prefix {
            prefix.release_checkpoint(slot);
        }
        true
    }

    /// Drops the cached checkpoint in `slot` (its copy failed), held by no sequence.
    pub(crate) fn forget_cached_checkpoint(&mut self, slot: SlotId) {
        if let Some(prefix) = &mut self.prefix {
            prefix.forget_checkpoint(slot);
        }
    }

    /// While idle: shows `store` the next cached prefix not yet shown (see
    /// [`PrefixCache::next_unwritten`]), so that the eviction that later needs its blocks
    /// does not copy them out on the admission path. False when there is none.
    pub(crate) fn write_ahead(&mut self, store: &mut dyn SessionStore) -> bool {
        let Some(prefix) = &mut self.prefix else {
            return false;
        };
        let Some((tokens, blocks, checkpoint)) = prefix.next_unwritten() else {
            return false;
        };
        store.write_ahead(&EvictedPrefix {
            tokens: &tokens,
            blocks: &blocks,
            checkpoint,
            reused: tokens.len(),
        });
        true
    }

    /// After a step that took `kv` to `kv.computed` tokens of `prompt_len` prompt: where a
    /// planned checkpoint point, or the next whole block of its output, is reached (the
    /// latter replacing its previous output checkpoint), a checkpoint slot is taken and the
    /// copy of its state into it returned, `(its slot, checkpoint slot)`.
    pub(crate) fn checkpoint(
        &mut self,
        kv: &mut SeqKv,
        prompt_len: usize,
    ) -> Option<(SlotId, SlotId)> {
        let at = kv.computed;
        let planned = kv.checkpoint_at.contains(&at);
        let output = at > prompt_len && at.is_multiple_of(self.pool.block_size());
        if at == 0 || (!planned && !output) {
            return None;
        }
        queue_checkpoint(self.checkpoints_for(kv)?, kv, output && !planned)
    }

    /// A hybrid sequence that ends past its prompt gets a checkpoint at its last computed
    /// token (replacing its previous output checkpoint): the next turn re-sends all of it.
    pub(crate) fn final_checkpoint(
        &mut self,
        kv: &mut SeqKv,
        prompt_len: usize,
    ) -> Option<(SlotId, SlotId)> {
        let at = kv.computed;
        if at <= prompt_len || kv.checkpoints.iter().any(|c| c.0 == at) {
            return None;
        }
        queue_checkpoint(self.checkpoints_for(kv)?, kv, true)
    }

    /// The prefix cache, where it keeps checkpoints and `kv`'s state is one to keep (not
    /// ahead of its tokens).
    fn checkpoints_for(&mut self, kv: &SeqKv) -> Option<&mut PrefixCache> {
        self.prefix
            .as_mut()
            .filter(|p| p.keeps_checkpoints() && !kv.state_ahead)
    }
}

/// Evicts cached blocks until `free` are free, writing what goes to `store` if there is one.
fn evict<'s>(
    prefix: &mut PrefixCache,
    pool: &mut KvBlockPool,
    free: usize,
    store: Option<&mut (dyn SessionStore + 's)>,
) {
    match store {
        Some(store) => prefix.evict_with(pool, free, Some(&mut |e| store.spill(e))),
        None => prefix.evict(pool, free),
    };
}

/// Drops the planned block copies that `gone` picks, returning the holder each took on its
/// cached block.
fn drop_copies(
    copies: &mut Vec<BlockCopy>,
    pool: &mut KvBlockPool,
    mut gone: impl FnMut(&BlockCopy) -> bool,
) {
    copies.retain(|c| {
        let drop = gone(c);
        if drop {
            pool.release(&mut BlockTable { blocks: vec![c.1] });
        }
        !drop
    });
}

/// Starts sequence `id` from the longest cached prefix of `tokens`: the shared blocks (a
/// holder taken for each), a partly matching block to copy into its own next block (a
/// cached block evicted for it if none is free, else the hit in whole blocks), and for a
/// hybrid the checkpoint to restore into `slot` and the points at which to take new ones.
fn take_cached_prefix<'s>(
    prefix: &mut PrefixCache,
    pool: &mut KvBlockPool,
    (id, kv, slot): (SeqId, &mut SeqKv, SlotId),
    (tokens, prompt_len): (&[u32], usize),
    copies: &mut Copies,
    store: Option<&mut (dyn SessionStore + 's)>,
) {
    let bs = pool.block_size();
    // At least the last token is computed, for its logits.
    let usable = tokens.len() - 1;
    let mut hit = prefix.lookup_hit(tokens, usable, pool);
    if hit.copy.is_some() && pool.num_free() == 0 {
        evict(prefix, pool, 1, store);
    }
    let mut dst = None;
    if let Some((src, _)) = hit.copy {
        let mut table = BlockTable::default();
        if pool.grow(&mut table, 1).is_ok() {
            dst = table.blocks.first().copied();
        } else {
            pool.release(&mut hit.table);
            pool.release(&mut BlockTable { blocks: vec![src] });
            hit = prefix.lookup_whole_blocks(tokens, usable, pool);
        }
    }
    kv.table = std::mem::take(&mut hit.table);
    kv.computed = kv.table.blocks.len() * bs;
    kv.uncopied = 0;
    if let (Some((src, used)), Some(dst)) = (hit.copy, dst) {
        kv.table.blocks.push(dst);
        copies.blocks.push((id, src, dst));
        kv.computed += used;
        kv.uncopied = used;
    }
    kv.reused = kv.computed;
    if prefix.keeps_checkpoints() {
        if let Some(checkpoint) = hit.checkpoint {
            copies.restores.push((id, checkpoint, slot));
        }
        // Where the prompt leaves the cached tree (unless within a block of where it resumes:
        // a checkpoint there would save little and cost the prefill a chunk of its own), and
        // one token short of its end: a revisit computes at least its last token, so there an
        // identical re-send (a client's retry, a regenerate) resumes, as a longer one does.
        let branch = hit.matched_tokens;
        let points = [
            (branch >= kv.computed + bs).then_some(branch),
            Some(prompt_len.saturating_sub(1)),
        ];
        kv.checkpoint_at = points
            .into_iter()
            .flatten()
            .filter(|&p| p > kv.computed)
            .collect();
        kv.checkpoint_at.sort_unstable();
        kv.checkpoint_at.dedup();
    }
}

/// Takes a checkpoint slot and returns the copy of `kv`'s state (after `kv.computed`
/// tokens) into it; as the output checkpoint, in place of the previous one.
fn queue_checkpoint(
    prefix: &mut PrefixCache,
    kv: &mut SeqKv,
    output: bool,
) -> Option<(SlotId, SlotId)> {
    let slot = kv.slot?;
    let at = kv.computed;
    let dst = prefix.take_checkpoint_slot()?;
    if output
        && let Some(old_at) = kv.output_checkpoint.replace(at)
        && let Some(i) = kv.checkpoints.iter().position(|c| c.0 == old_at)
    {
        let (_, old) = kv.checkpoints.remove(i);
        prefix.release_checkpoint(old);
    }
    kv.checkpoints.push((at, dst));
    Some((slot, dst))
}
