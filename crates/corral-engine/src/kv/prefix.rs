//! `PrefixCache`: which full KV blocks hold which token prefixes, so that a request that
//! re-sends a history can take those blocks instead of recomputing them.
//!
//! A tree of full blocks: each node is one block of `block_size` token ids that follows its
//! parent's, found among its siblings by those exact ids (no hash to collide). The cache holds
//! one reference, in the [`KvBlockPool`], to every block it indexes, so a finished sequence's
//! blocks outlive it; eviction drops leaves that no sequence holds, least recently used
//! first or, given an [`EvictionCost`], scored by recency and the prefill FLOPs they save per
//! byte.
//!
//! For hybrid models a prefix is reusable only where the recurrent state at its end exists
//! too: a node may hold a state checkpoint (a slot of the model's state cache, from the
//! cache's own pool of checkpoint slots), and [`PrefixCache::lookup_resumable`] stops at the
//! deepest node on the path that has one. When the pool is empty, the least recently used
//! checkpoint gives its slot up (its blocks stay).

use std::collections::{BTreeSet, HashMap};

use corral_model::{BlockId, BlockTable, SlotId};

use super::{KvBlockPool, StateSlotPool};

type NodeId = usize;

const ROOT: NodeId = 0;

/// How much FLOPs saved per byte counts against recency in eviction scores.
const FLOPS_WEIGHT: f64 = 2.0;

#[derive(Debug)]
struct Node {
    parent: NodeId,
    /// The block's token ids (empty for the root).
    tokens: Box<[u32]>,
    block: BlockId,
    children: HashMap<Box<[u32]>, NodeId>,
    last_used: u64,
    /// The recurrent state after this node's last token.
    checkpoint: Option<SlotId>,
    /// Blocks from the root to this node, itself included.
    depth: usize,
}

/// What [`PrefixCache::lookup_resumable`] found.
#[derive(Debug, Default)]
pub struct PrefixHit {
    /// The blocks to start from, up to the deepest checkpoint (a holder taken for each).
    pub table: BlockTable,
    /// The state at the end of `table`, to copy into the sequence's own slot.
    pub checkpoint: Option<SlotId>,
    /// Whole blocks of the tokens the index holds, checkpoint or not: where the tokens leave
    /// the cached tree, the place for a new checkpoint.
    pub matched_blocks: usize,
}

/// What keeping a cached block is worth, for eviction: the prefill FLOPs it saves per byte
/// it holds (Marconi's measure), from the model's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvictionCost {
    /// FLOPs to prefill one token, attention over earlier tokens excluded.
    pub flops_per_token: f64,
    /// Attention FLOPs a token spends per earlier position.
    pub attention_flops_per_position: f64,
    /// Bytes of one KV block (every layer).
    pub block_bytes: f64,
    /// Bytes of one recurrent-state checkpoint.
    pub checkpoint_bytes: f64,
}

impl EvictionCost {
    /// FLOPs per byte of the block at `depth` (1 = the first) of `block_size` tokens.
    fn value(&self, depth: usize, block_size: usize, checkpoint: bool) -> f64 {
        let bs = block_size as f64;
        let mean_position = (depth as f64 - 0.5) * bs;
        let flops = bs * (self.flops_per_token + self.attention_flops_per_position * mean_position);
        let bytes = self.block_bytes
            + if checkpoint {
                self.checkpoint_bytes
            } else {
                0.0
            };
        flops / bytes.max(1.0)
    }
}

/// A cached prefix about to be evicted: its tokens, its blocks (root first) and the state
/// checkpoint at its end, if any.
#[derive(Debug)]
pub struct EvictedPrefix<'a> {
    /// Token ids, whole blocks.
    pub tokens: &'a [u32],
    /// The blocks holding them.
    pub blocks: &'a [BlockId],
    /// The recurrent state after the last token (hybrid models).
    pub checkpoint: Option<SlotId>,
}

/// An index of cached full KV blocks by the token ids they hold, with the cache's own
/// reference to each block.
#[derive(Debug)]
pub struct PrefixCache {
    nodes: Vec<Option<Node>>,
    free_nodes: Vec<NodeId>,
    /// Childless nodes (the only ones eviction may take), by last use.
    leaves: BTreeSet<(u64, NodeId)>,
    block_size: usize,
    clock: u64,
    cached: usize,
    /// Free checkpoint slots (hybrid models only).
    checkpoint_slots: Option<StateSlotPool>,
    checkpoints: usize,
    /// With a cost, eviction weighs FLOPs saved per byte against recency; without, least
    /// recently used first.
    cost: Option<EvictionCost>,
}

impl PrefixCache {
    /// An empty index of blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        let root = Node {
            parent: ROOT,
            tokens: Box::new([]),
            block: BlockId(u32::MAX),
            children: HashMap::new(),
            last_used: 0,
            checkpoint: None,
            depth: 0,
        };
        Self {
            nodes: vec![Some(root)],
            free_nodes: Vec::new(),
            leaves: BTreeSet::new(),
            block_size: block_size.max(1),
            clock: 0,
            cached: 0,
            checkpoint_slots: None,
            checkpoints: 0,
            cost: None,
        }
    }

    /// Eviction from now on scores leaves by recency and by the prefill FLOPs they save per
    /// byte: of two equally recent leaves, the one that saves less per byte goes first.
    pub fn with_eviction_cost(mut self, cost: EvictionCost) -> Self {
        self.cost = Some(cost);
        self
    }

    /// An empty index that also keeps recurrent-state checkpoints in `slots`.
    pub fn with_checkpoints(block_size: usize, slots: StateSlotPool) -> Self {
        Self {
            checkpoint_slots: Some(slots),
            ..Self::new(block_size)
        }
    }

    /// Whether this index keeps state checkpoints (a hybrid model's).
    pub fn keeps_checkpoints(&self) -> bool {
        self.checkpoint_slots.is_some()
    }

    /// Checkpoints held by nodes.
    pub fn num_checkpoints(&self) -> usize {
        self.checkpoints
    }

    /// A free checkpoint slot for a new checkpoint; with none free, the least recently used
    /// node's checkpoint gives its slot up. `None` without checkpoint slots.
    pub fn take_checkpoint_slot(&mut self) -> Option<SlotId> {
        if let Some(slot) = self.checkpoint_slots.as_mut()?.acquire() {
            return Some(slot);
        }
        let oldest = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| {
                n.as_ref()
                    .filter(|n| n.checkpoint.is_some())
                    .map(|n| (n.last_used, id))
            })
            .min()?;
        self.checkpoints -= 1;
        self.node_mut(oldest.1).checkpoint.take()
    }

    /// Returns a checkpoint slot that no node holds.
    pub fn release_checkpoint(&mut self, slot: SlotId) {
        if let Some(pool) = &mut self.checkpoint_slots {
            pool.release(slot);
        }
    }

    /// Drops the checkpoint in `slot` if a node holds it (its copy failed); true if one did.
    pub fn forget_checkpoint(&mut self, slot: SlotId) -> bool {
        let held = self
            .nodes
            .iter()
            .position(|n| n.as_ref().is_some_and(|n| n.checkpoint == Some(slot)));
        match held {
            Some(id) => {
                self.node_mut(id).checkpoint = None;
                self.checkpoints -= 1;
                self.release_checkpoint(slot);
                true
            }
            None => false,
        }
    }

    /// [`PrefixCache::lookup`] for a sequence that must also resume the recurrent state: the
    /// blocks stop at the deepest node on the path with a checkpoint.
    pub fn lookup_resumable(
        &mut self,
        tokens: &[u32],
        max_blocks: usize,
        pool: &mut KvBlockPool,
    ) -> PrefixHit {
        let path = self.walk(tokens, max_blocks);
        let deepest = path
            .iter()
            .rposition(|n| self.node(*n).checkpoint.is_some());
        let resumed = deepest.map_or(0, |i| i + 1);
        let hit = PrefixHit {
            table: BlockTable {
                blocks: path[..resumed]
                    .iter()
                    .map(|&n| self.node(n).block)
                    .collect(),
            },
            checkpoint: deepest.and_then(|i| self.node(path[i]).checkpoint),
            matched_blocks: path.len(),
        };
        pool.share(&hit.table);
        hit
    }

    /// The nodes of the cached blocks of `tokens` from the root, at most `max_blocks`, each
    /// marked as used now.
    fn walk(&mut self, tokens: &[u32], max_blocks: usize) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut at = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some(&child) = self.node(at).children.get(chunk) else {
                break;
            };
            self.touch(child);
            path.push(child);
            at = child;
        }
        path
    }

    /// Blocks indexed (each holding one reference in the pool).
    pub fn num_blocks(&self) -> usize {
        self.cached
    }

    /// Indexed blocks that no sequence holds besides the cache.
    pub fn num_idle_blocks(&self, pool: &KvBlockPool) -> usize {
        self.nodes
            .iter()
            .skip(1)
            .flatten()
            .filter(|n| pool.holders(n.block) == 1)
            .count()
    }

    /// The longest cached prefix of `tokens` in whole blocks, at most `max_blocks` of them: a
    /// table of those blocks in order, each with one more holder taken for the caller (who
    /// releases it like any table). The blocks count as used now.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        max_blocks: usize,
        pool: &mut KvBlockPool,
    ) -> BlockTable {
        let table = BlockTable {
            blocks: self
                .walk(tokens, max_blocks)
                .iter()
                .map(|&n| self.node(n).block)
                .collect(),
        };
        pool.share(&table);
        table
    }

    /// Indexes the full blocks of `tokens` that `table` holds (a sequence's table once those
    /// tokens are computed), taking the cache's reference to each block it adds. Where the
    /// same tokens are indexed already, the cached block stays and the sequence's stays its
    /// own, released with the sequence.
    pub fn insert(&mut self, tokens: &[u32], table: &BlockTable, pool: &mut KvBlockPool) {
        self.insert_with_checkpoints(tokens, table, &[], pool);
    }

    /// [`PrefixCache::insert`], and the state checkpoints `(tokens covered, slot)` of the
    /// sequence (at whole blocks) go to the nodes they end at; a node that has one already
    /// keeps it, and the extra slot goes back to the pool, as does one past the blocks.
    pub fn insert_with_checkpoints(
        &mut self,
        tokens: &[u32],
        table: &BlockTable,
        checkpoints: &[(usize, SlotId)],
        pool: &mut KvBlockPool,
    ) {
        let mut at = ROOT;
        let mut placed = vec![false; checkpoints.len()];
        for (i, (chunk, &block)) in tokens
            .chunks_exact(self.block_size)
            .zip(&table.blocks)
            .enumerate()
        {
            let next = match self.node(at).children.get(chunk) {
                Some(&child) => child,
                None => {
                    pool.share(&BlockTable {
                        blocks: vec![block],
                    });
                    self.add_child(at, chunk, block)
                }
            };
            self.touch(next);
            let covered = (i + 1) * self.block_size;
            for (k, &(at_tokens, slot)) in checkpoints.iter().enumerate() {
                if at_tokens == covered && self.node(next).checkpoint.is_none() {
                    self.node_mut(next).checkpoint = Some(slot);
                    self.checkpoints += 1;
                    placed[k] = true;
                }
            }
            at = next;
        }
        for (k, &(_, slot)) in checkpoints.iter().enumerate() {
            if !placed[k] {
                self.release_checkpoint(slot);
            }
        }
    }

    /// Frees cached blocks, leaves in eviction order (least recently used first, or by the
    /// eviction cost's score), until `pool` has `free` free blocks or nothing more may go; a
    /// block that a sequence still holds is never freed (nor its ancestors). Returns how many
    /// blocks were freed.
    pub fn evict(&mut self, pool: &mut KvBlockPool, free: usize) -> usize {
        self.evict_with(pool, free, None)
    }

    /// [`PrefixCache::evict`], showing `spill` (if any) each leaf's whole prefix before its
    /// block is freed (its blocks' contents are intact until the next forward).
    pub fn evict_with(
        &mut self,
        pool: &mut KvBlockPool,
        free: usize,
        mut spill: Option<&mut dyn FnMut(&EvictedPrefix<'_>)>,
    ) -> usize {
        let mut freed = 0;
        let mut skipped = Vec::new();
        while pool.num_free() < free {
            let next = match self.cost {
                Some(cost) => self.cheapest_leaf(&cost, pool),
                None => self.leaves.pop_first(),
            };
            let Some((used, id)) = next else {
                break;
            };
            let block = self.node(id).block;
            if pool.holders(block) > 1 {
                skipped.push((used, id));
                continue;
            }
            if let Some(spill) = spill.as_deref_mut() {
                let (tokens, blocks) = self.path(id);
                spill(&EvictedPrefix {
                    tokens: &tokens,
                    blocks: &blocks,
                    checkpoint: self.node(id).checkpoint,
                });
            }
            self.remove_leaf(id);
            pool.release(&mut BlockTable {
                blocks: vec![block],
            });
            freed += 1;
        }
        self.leaves.extend(skipped);
        freed
    }

    /// The evictable leaf (no holder but the cache) with the lowest score, taken out of
    /// `leaves`: recency and FLOPs saved per byte, each scaled to 0..1 over the candidates,
    /// the second weighed `FLOPS_WEIGHT` times the first (long histories are what agents
    /// come back to).
    fn cheapest_leaf(&mut self, cost: &EvictionCost, pool: &KvBlockPool) -> Option<(u64, NodeId)> {
        let candidates: Vec<(u64, NodeId, f64)> = self
            .leaves
            .iter()
            .filter(|&&(_, id)| pool.holders(self.node(id).block) <= 1)
            .map(|&(used, id)| {
                let node = self.node(id);
                let value = cost.value(node.depth, self.block_size, node.checkpoint.is_some());
                (used, id, value)
            })
            .collect();
        let (oldest, newest) = candidates
            .iter()
            .fold((u64::MAX, 0), |(lo, hi), c| (lo.min(c.0), hi.max(c.0)));
        let top = candidates.iter().map(|c| c.2).fold(0.0, f64::max);
        let span = newest.saturating_sub(oldest).max(1) as f64;
        let score = |c: &(u64, NodeId, f64)| {
            let value = if top > 0.0 { c.2 / top } else { 0.0 };
            (c.0 - oldest) as f64 / span + FLOPS_WEIGHT * value
        };
        let pick = candidates
            .iter()
            .min_by(|a, b| score(a).total_cmp(&score(b)))
            .map(|c| (c.0, c.1))?;
        self.leaves.remove(&pick);
        Some(pick)
    }

    /// The token ids and blocks from the root to node `id`.
    fn path(&self, id: NodeId) -> (Vec<u32>, Vec<BlockId>) {
        let mut nodes = Vec::new();
        let mut at = id;
        while at != ROOT {
            nodes.push(at);
            at = self.node(at).parent;
        }
        nodes.reverse();
        let tokens = nodes
            .iter()
            .flat_map(|&n| self.node(n).tokens.iter().copied())
            .collect();
        let blocks = nodes.iter().map(|&n| self.node(n).block).collect();
        (tokens, blocks)
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("a live node")
    }

    fn touch(&mut self, id: NodeId) {
        self.clock += 1;
        let clock = self.clock;
        let node = self.node_mut(id);
        let old = std::mem::replace(&mut node.last_used, clock);
        if node.children.is_empty() && self.leaves.remove(&(old, id)) {
            self.leaves.insert((clock, id));
        }
    }

    fn add_child(&mut self, parent: NodeId, tokens: &[u32], block: BlockId) -> NodeId {
        let node = Node {
            parent,
            tokens: tokens.into(),
            block,
            children: HashMap::new(),
            last_used: self.clock,
            checkpoint: None,
            depth: self.node(parent).depth + 1,
        };
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        let parent_node = self.node_mut(parent);
        let was_leaf = parent_node.children.is_empty();
        parent_node.children.insert(tokens.into(), id);
        let parent_used = parent_node.last_used;
        if was_leaf && parent != ROOT {
            self.leaves.remove(&(parent_used, parent));
        }
        self.leaves.insert((self.clock, id));
        self.cached += 1;
        id
    }

    /// Removes the childless node `id` (already out of `leaves`); its parent may become a leaf.
    fn remove_leaf(&mut self, id: NodeId) {
        let Some(node) = self.nodes[id].take() else {
            return;
        };
        self.free_nodes.push(id);
        self.cached -= 1;
        if let Some(slot) = node.checkpoint {
            self.checkpoints -= 1;
            self.release_checkpoint(slot);
        }
        let parent = self.node_mut(node.parent);
        parent.children.remove(&node.tokens);
        if parent.children.is_empty() && node.parent != ROOT {
            let used = parent.last_used;
            self.leaves.insert((used, node.parent));
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A sequence computed from scratch: a fresh table covering `tokens`.
    fn computed(pool: &mut KvBlockPool, tokens: &[u32]) -> BlockTable {
        let mut table = BlockTable::default();
        pool.grow(&mut table, tokens.len()).unwrap();
        table
    }

    #[test]
    fn a_resent_history_finds_its_full_blocks() {
        let mut pool = KvBlockPool::new(16, 4);
        let mut cache = PrefixCache::new(4);
        let turn: Vec<u32> = (0..10).collect();
        let mut table = computed(&mut pool, &turn);
        cache.insert(&turn, &table, &mut pool);
        assert_eq!(
            cache.num_blocks(),
            2,
            "the partial third block is not indexed"
        );
        pool.release(&mut table);
        assert_eq!(pool.num_used(), 2, "the cache keeps the two full blocks");
        // The next turn extends the history: both full blocks hit, in order.
        let next: Vec<u32> = (0..17).collect();
        let mut hit = cache.lookup(&next, usize::MAX, &mut pool);
        assert_eq!(hit.blocks.len(), 2);
        assert_eq!(pool.holders(hit.blocks[0]), 2);
        // A prompt that diverges inside the second block hits only the first.
        let other: Vec<u32> = vec![0, 1, 2, 3, 4, 9, 9, 9];
        let mut partial = cache.lookup(&other, usize::MAX, &mut pool);
        assert_eq!(partial.blocks, hit.blocks[..1]);
        // At most max_blocks.
        assert_eq!(cache.lookup(&next, 1, &mut pool).blocks.len(), 1);
        pool.release(&mut hit);
        pool.release(&mut partial);
    }

    #[test]
    fn eviction_takes_least_recently_used_leaves_and_spares_held_blocks() {
        let mut pool = KvBlockPool::new(6, 2);
        let mut cache = PrefixCache::new(2);
        // Two histories sharing their first block: a = [0 1][2 3], b = [0 1][5 6].
        let (a, b) = (vec![0, 1, 2, 3], vec![0, 1, 5, 6]);
        let mut ta = computed(&mut pool, &a);
        cache.insert(&a, &ta, &mut pool);
        pool.release(&mut ta);
        let mut tb = cache.lookup(&b, usize::MAX, &mut pool);
        pool.grow(&mut tb, 4).unwrap();
        cache.insert(&b, &tb, &mut pool);
        assert_eq!(cache.num_blocks(), 3);
        // b is still running: only a's leaf may go, though b's leaf is newer.
        assert_eq!(cache.evict(&mut pool, usize::MAX), 1);
        assert_eq!(cache.num_blocks(), 2);
        assert!(cache.lookup(&a, usize::MAX, &mut pool).blocks.len() == 1);
        pool.release(&mut tb);
        // With b done, its leaf and then the shared first block go.
        let freed = cache.evict(&mut pool, usize::MAX);
        assert_eq!(
            freed, 1,
            "the first block is still held by the lookup above"
        );
        assert_eq!(cache.num_blocks(), 1);
    }

    #[test]
    fn a_hybrid_resumes_at_its_deepest_checkpoint_and_slots_come_back() {
        let mut pool = KvBlockPool::new(32, 2);
        let mut cache = PrefixCache::with_checkpoints(2, StateSlotPool::range(10, 2));
        let turn: Vec<u32> = (0..8).collect();
        let mut table = computed(&mut pool, &turn);
        let (c1, c2) = (
            cache.take_checkpoint_slot().unwrap(),
            cache.take_checkpoint_slot().unwrap(),
        );
        assert!([c1, c2].iter().all(|s| (10..12).contains(&s.0)));
        // Checkpoints after 4 and 8 tokens; one past the blocks goes back to the pool.
        cache.insert_with_checkpoints(&turn, &table, &[(4, c1), (8, c2)], &mut pool);
        pool.release(&mut table);
        assert_eq!(cache.num_checkpoints(), 2);
        // The whole turn and more: the deepest checkpoint (8) within the blocks asked for.
        let longer: Vec<u32> = (0..11).collect();
        let mut hit = cache.lookup_resumable(&longer, 5, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_blocks),
            (4, Some(c2), 4)
        );
        pool.release(&mut hit.table);
        // At most 3 blocks: the checkpoint at 4 tokens, though 3 blocks match.
        let mut hit = cache.lookup_resumable(&longer, 3, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_blocks),
            (2, Some(c1), 3)
        );
        pool.release(&mut hit.table);
        // Diverging in the first block: nothing to resume from.
        let hit = cache.lookup_resumable(&[0, 9, 9], 1, &mut pool);
        assert!(hit.table.blocks.is_empty() && hit.checkpoint.is_none());
        // The pool is empty: the least recently used checkpoint (at 8: the lookups since
        // touched the first two blocks last) gives its slot up, its blocks stay.
        assert_eq!(cache.take_checkpoint_slot(), Some(c2));
        assert_eq!(cache.num_checkpoints(), 1);
        let mut hit = cache.lookup_resumable(&longer, 5, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_blocks),
            (2, Some(c1), 4)
        );
        pool.release(&mut hit.table);
        cache.release_checkpoint(c2);
        // Evicting everything returns the remaining checkpoint's slot too.
        cache.evict(&mut pool, usize::MAX);
        assert_eq!((cache.num_blocks(), cache.num_checkpoints()), (0, 0));
        let slots = [cache.take_checkpoint_slot(), cache.take_checkpoint_slot()];
        assert!(slots.iter().all(Option::is_some));
        assert_eq!(cache.take_checkpoint_slot(), None);
    }

    #[test]
    fn eviction_weighs_flops_saved_per_byte_against_recency() {
        // Two histories of one and of four blocks; the short one is used last.
        let run = |cost: Option<EvictionCost>| {
            let mut pool = KvBlockPool::new(16, 2);
            let mut cache = PrefixCache::new(2);
            if let Some(c) = cost {
                cache = cache.with_eviction_cost(c);
            }
            let long: Vec<u32> = (0..8).collect();
            let short: Vec<u32> = vec![9, 9];
            for tokens in [&long, &short] {
                let mut table = computed(&mut pool, tokens);
                cache.insert(tokens, &table, &mut pool);
                pool.release(&mut table);
            }
            let want = pool.num_free() + 1;
            cache.evict(&mut pool, want);
            let mut probe = cache.lookup(&short, 1, &mut pool);
            let short_kept = probe.blocks.len() == 1;
            pool.release(&mut probe);
            short_kept
        };
        assert!(
            run(None),
            "least recently used first: the long history's leaf goes"
        );
        // Attention makes the deep leaf save far more per byte than the short history.
        let cost = EvictionCost {
            flops_per_token: 1.0,
            attention_flops_per_position: 100.0,
            block_bytes: 1.0,
            checkpoint_bytes: 0.0,
        };
        assert!(
            !run(Some(cost)),
            "the short history's block saves least per byte and goes first"
        );
    }

    proptest! {
        /// Random histories over a small alphabet (so prefixes collide), each computed,
        /// indexed and released, with lookups and evictions in between: every lookup's blocks
        /// are the ones indexed for exactly those tokens; reference counts stay exactly
        /// cache + callers; eviction frees only blocks nobody else holds.
        #[test]
        fn cache_and_pool_stay_consistent(
            ops in proptest::collection::vec((0u8..3, proptest::collection::vec(0u32..3, 0..12)), 1..40)
        ) {
            let bs = 2;
            let mut pool = KvBlockPool::new(64, bs);
            let mut cache = PrefixCache::new(bs);
            let mut indexed: HashMap<Vec<u32>, BlockId> = HashMap::new();
            let mut held: Vec<BlockTable> = Vec::new();
            for (op, tokens) in ops {
                match op {
                    0 => {
                        let mut table = cache.lookup(&tokens, usize::MAX, &mut pool);
                        for (i, b) in table.blocks.iter().enumerate() {
                            let prefix = tokens[..(i + 1) * bs].to_vec();
                            prop_assert_eq!(indexed.get(&prefix), Some(b));
                        }
                        if pool.grow(&mut table, tokens.len()).is_err() {
                            pool.release(&mut table);
                            continue;
                        }
                        cache.insert(&tokens, &table, &mut pool);
                        for i in 0..tokens.len() / bs {
                            let prefix = tokens[..(i + 1) * bs].to_vec();
                            indexed.entry(prefix).or_insert(table.blocks[i]);
                        }
                        pool.release(&mut table);
                    }
                    1 => held.push(cache.lookup(&tokens, usize::MAX, &mut pool)),
                    _ => {
                        let protected: Vec<BlockId> =
                            held.iter().flat_map(|t| t.blocks.clone()).collect();
                        cache.evict(&mut pool, usize::MAX);
                        for b in &protected {
                            prop_assert!(pool.holders(*b) >= 2, "a held block lost the cache's reference");
                        }
                        // Forget what the cache dropped (the probe's references are returned).
                        indexed.retain(|prefix, _| {
                            let mut probe = cache.lookup(prefix, usize::MAX, &mut pool);
                            let found = probe.blocks.len() * bs == prefix.len();
                            pool.release(&mut probe);
                            found
                        });
                    }
                }
            }
            for mut t in held.drain(..) {
                pool.release(&mut t);
            }
            // Only the cache's references remain.
            prop_assert_eq!(pool.num_used(), cache.num_blocks());
        }
    }
}
