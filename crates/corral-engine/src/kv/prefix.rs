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
//! A node may also be a *tail*: fewer than `block_size` ids, a leaf beside its parent's full
//! children, indexing the first ids of a block (a sequence's partly filled last block, or the
//! block a checkpoint falls inside, which a full node may reference too). A tail is never
//! shared by reference: a hit copies its block into the sequence's own (copy-on-write), and
//! the sequence writes on from there. Matching part of a full child works the same way.
//!
//! For hybrid models a prefix is reusable only where the recurrent state at its end exists
//! too: a node may hold a state checkpoint (a slot of the model's state cache, from the
//! cache's own pool of checkpoint slots), and [`PrefixCache::lookup_hit`] stops at the
//! deepest node on the path that has one. When the pool is empty, the least recently used
//! checkpoint gives its slot up (its blocks stay).

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use corral_model::{BlockId, BlockTable, SlotId};

use super::{KvBlockPool, StateSlotPool};

mod eviction;

pub use eviction::{EvictedPrefix, EvictionCost};

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
    /// Shown to a store while idle ([`PrefixCache::next_unwritten`]): its prefix is on disk,
    /// or the store declined it.
    written: bool,
    /// A request after the one that computed it took it (from here or, restored, from disk):
    /// part of a conversation that goes on, or of a prompt requests share.
    reused: bool,
}

/// How many ids `a` and `b` share from the start.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A node of the cache (where a sequence's tokens ended), for [`PrefixCache::pin`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixNode(NodeId);

/// What [`PrefixCache::lookup_hit`] found.
#[derive(Debug, Default)]
pub struct PrefixHit {
    /// The blocks to start from, up to the deepest checkpoint (a holder taken for each).
    pub table: BlockTable,
    /// A block whose first tokens continue `table` (copy-on-write: a holder is taken on it
    /// until it is copied into the sequence's own next block), and how many of them count.
    pub copy: Option<(BlockId, usize)>,
    /// The state at the end of the hit (`table` and `copy`), to copy into the sequence's own
    /// slot.
    pub checkpoint: Option<SlotId>,
    /// Tokens the index holds, checkpoint or not (a tail or part of a child included): where
    /// the tokens leave the cached tree, the place for a new checkpoint.
    pub matched_tokens: usize,
}

impl PrefixHit {
    /// Tokens the hit saves: its whole blocks and the copied block's part.
    pub fn tokens(&self, block_size: usize) -> usize {
        self.table.blocks.len() * block_size + self.copy.map_or(0, |c| c.1)
    }
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
    /// Nodes referencing each indexed block (a tail may share its full sibling's), each
    /// holding one pool reference.
    refs: HashMap<BlockId, u32>,
    /// Free checkpoint slots (hybrid models only).
    checkpoint_slots: Option<StateSlotPool>,
    checkpoints: usize,
    /// With a cost, eviction weighs FLOPs saved per byte against recency; without, least
    /// recently used first.
    cost: Option<EvictionCost>,
    /// Session pins: a client's session id, the node its last turn ended at, and until when
    /// eviction passes that node by (and so its path).
    pins: HashMap<String, (NodeId, Instant)>,
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
            written: true,
            reused: false,
        };
        Self {
            nodes: vec![Some(root)],
            free_nodes: Vec::new(),
            leaves: BTreeSet::new(),
            block_size: block_size.max(1),
            clock: 0,
            refs: HashMap::new(),
            pins: HashMap::new(),
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
        // The least recently used, pinned ones last.
        let pinned = self.pinned(Instant::now());
        let oldest = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| {
                n.as_ref()
                    .filter(|n| n.checkpoint.is_some())
                    .map(|n| (pinned.contains(&id), n.last_used, id))
            })
            .min()
            .map(|(_, used, id)| (used, id))?;
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

    /// The longest cached prefix of at most `max_tokens` of `tokens`, down to a token: the
    /// whole blocks, then the child (a tail or a full block) that shares the most of the ids
    /// after them, to be copied. With checkpoints (a hybrid model), only as far as the
    /// deepest checkpoint: on a whole block of the path, or on a tail hanging off it (or off
    /// the root) that matches entirely.
    pub fn lookup_hit(
        &mut self,
        tokens: &[u32],
        max_tokens: usize,
        pool: &mut KvBlockPool,
    ) -> PrefixHit {
        self.lookup_in(tokens, max_tokens, true, pool)
    }

    /// [`PrefixCache::lookup_hit`] in whole blocks only (no block to copy): where there is no
    /// block free for the copy.
    pub fn lookup_whole_blocks(
        &mut self,
        tokens: &[u32],
        max_tokens: usize,
        pool: &mut KvBlockPool,
    ) -> PrefixHit {
        self.lookup_in(tokens, max_tokens, false, pool)
    }

    fn lookup_in(
        &mut self,
        tokens: &[u32],
        max_tokens: usize,
        partial: bool,
        pool: &mut KvBlockPool,
    ) -> PrefixHit {
        let bs = self.block_size;
        let max_tokens = max_tokens.min(tokens.len());
        let path = self.walk(tokens, max_tokens / bs);
        let base = path.len() * bs;
        let last = path.last().copied().unwrap_or(ROOT);
        let rest = &tokens[base..max_tokens.max(base)];
        // Ids after the whole blocks that some child shares: where the tokens leave the tree.
        let shared = self
            .node(last)
            .children
            .keys()
            .map(|key| common_prefix(key, rest))
            .max()
            .unwrap_or(0);
        // (tokens, whole blocks, node to copy from and its tokens used, checkpoint).
        let mut best: (usize, usize, Option<(NodeId, usize)>, Option<SlotId>) = (0, 0, None, None);
        if self.keeps_checkpoints() {
            for (i, &n) in path.iter().enumerate() {
                if let Some(slot) = self.node(n).checkpoint {
                    best = ((i + 1) * bs, i + 1, None, Some(slot));
                }
            }
            for i in (0..=path.len()).filter(|_| partial) {
                let parent = if i == 0 { ROOT } else { path[i - 1] };
                for (key, &child) in &self.node(parent).children {
                    let end = i * bs + key.len();
                    let tail = key.len() < bs && end <= max_tokens;
                    if let (true, Some(slot)) = (tail, self.node(child).checkpoint)
                        && end > best.0
                        && tokens[i * bs..].starts_with(key)
                    {
                        best = (end, i, Some((child, key.len())), Some(slot));
                    }
                }
            }
        } else {
            best = (base, path.len(), None, None);
            for (key, &child) in self.node(last).children.iter().filter(|_| partial) {
                let common = common_prefix(key, rest);
                if common > 0 && base + common > best.0 {
                    best = (base + common, path.len(), Some((child, common)), None);
                }
            }
        }
        let (_, blocks, copy, checkpoint) = best;
        if let Some((child, _)) = copy {
            self.touch(child);
            self.node_mut(child).reused = true;
        }
        for &n in &path[..blocks] {
            self.node_mut(n).reused = true;
        }
        let hit = PrefixHit {
            table: BlockTable {
                blocks: path[..blocks].iter().map(|&n| self.node(n).block).collect(),
            },
            copy: copy.map(|(child, used)| (self.node(child).block, used)),
            checkpoint,
            matched_tokens: base + shared,
        };
        pool.share(&hit.table);
        if let Some((block, _)) = hit.copy {
            pool.share(&BlockTable {
                blocks: vec![block],
            });
        }
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

    /// Distinct blocks indexed (each holding one pool reference per node on it).
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Indexed blocks that no sequence holds besides the cache.
    pub fn num_idle_blocks(&self, pool: &KvBlockPool) -> usize {
        self.refs
            .iter()
            .filter(|&(&block, &refs)| pool.holders(block) <= refs)
            .count()
    }

    /// Whether only the cache holds `block`.
    fn idle(&self, block: BlockId, pool: &KvBlockPool) -> bool {
        pool.holders(block) <= self.refs.get(&block).copied().unwrap_or(0)
    }

    /// The longest cached prefix of `tokens` in whole blocks, at most `max_blocks` of them
    /// ([`PrefixCache::lookup_whole_blocks`]'s table; with checkpoints, as far as the deepest
    /// one): those blocks in order, each with one more holder taken for the caller (who
    /// releases it like any table).
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        max_blocks: usize,
        pool: &mut KvBlockPool,
    ) -> BlockTable {
        let max_tokens = max_blocks.saturating_mul(self.block_size);
        self.lookup_in(tokens, max_tokens, false, pool).table
    }

    /// Indexes the full blocks of `tokens` that `table` holds (a sequence's table once those
    /// tokens are computed), taking the cache's reference to each block it adds. Where the
    /// same tokens are indexed already, the cached block stays and the sequence's stays its
    /// own, released with the sequence.
    pub fn insert(&mut self, tokens: &[u32], table: &BlockTable, pool: &mut KvBlockPool) {
        self.insert_blocks(tokens, table, &[], (false, 0), pool);
    }

    /// [`PrefixCache::insert`], and tails: the partly filled end of `tokens`, and the block
    /// each checkpoint inside a block falls in. The state checkpoints `(tokens covered, slot)`
    /// of the sequence go to the nodes they end at; a node that has one already keeps it, and
    /// the extra slot goes back to the pool, as does one past the blocks.
    /// The first `reused` tokens came to the sequence from the cache or from disk: their
    /// nodes are marked reused (see [`EvictedPrefix::reused`]).
    /// Returns the node the tokens end at, for [`PrefixCache::pin`].
    pub fn insert_with_checkpoints(
        &mut self,
        tokens: &[u32],
        table: &BlockTable,
        checkpoints: &[(usize, SlotId)],
        reused: usize,
        pool: &mut KvBlockPool,
    ) -> Option<PrefixNode> {
        self.insert_blocks(tokens, table, checkpoints, (true, reused), pool)
            .map(PrefixNode)
    }

    fn insert_blocks(
        &mut self,
        tokens: &[u32],
        table: &BlockTable,
        checkpoints: &[(usize, SlotId)],
        (tails, reused): (bool, usize),
        pool: &mut KvBlockPool,
    ) -> Option<NodeId> {
        let bs = self.block_size;
        let mut end_node = None;
        let mut placed = vec![false; checkpoints.len()];
        // The node after each number of whole blocks, the root first.
        let mut path = vec![ROOT];
        for (i, (chunk, &block)) in tokens.chunks_exact(bs).zip(&table.blocks).enumerate() {
            let next = self.child_or_add(path[i], chunk, block, pool);
            if (i + 1) * bs <= reused {
                self.node_mut(next).reused = true;
            }
            self.place(next, (i + 1) * bs, checkpoints, &mut placed);
            path.push(next);
            end_node = Some(next);
        }
        if tails {
            let mut ends: Vec<usize> = checkpoints
                .iter()
                .map(|c| c.0)
                .filter(|&at| !at.is_multiple_of(bs))
                .chain((!tokens.len().is_multiple_of(bs)).then_some(tokens.len()))
                .filter(|&at| {
                    at <= tokens.len() && at / bs < path.len() && at / bs < table.blocks.len()
                })
                .collect();
            ends.sort_unstable();
            ends.dedup();
            for end in ends {
                let q = end / bs;
                // The whole block's node shares its block; past the whole blocks, the table's.
                let block = path
                    .get(q + 1)
                    .map_or(table.blocks[q], |&n| self.node(n).block);
                let tail = self.child_or_add(path[q], &tokens[q * bs..end], block, pool);
                if end <= reused {
                    self.node_mut(tail).reused = true;
                }
                self.place(tail, end, checkpoints, &mut placed);
                if end == tokens.len() {
                    end_node = Some(tail);
                }
            }
        }
        for (k, &(_, slot)) in checkpoints.iter().enumerate() {
            if !placed[k] {
                self.release_checkpoint(slot);
            }
        }
        end_node
    }

    /// The child of `parent` indexing `tokens`, added on `block` (the cache's reference
    /// taken) if there is none; marked as used now.
    fn child_or_add(
        &mut self,
        parent: NodeId,
        tokens: &[u32],
        block: BlockId,
        pool: &mut KvBlockPool,
    ) -> NodeId {
        let id = match self.node(parent).children.get(tokens) {
            Some(&child) => child,
            None => {
                pool.share(&BlockTable {
                    blocks: vec![block],
                });
                self.add_child(parent, tokens, block)
            }
        };
        self.touch(id);
        id
    }

    /// Gives node `id` (ending at `covered` tokens) the first checkpoint there, if it has none.
    fn place(
        &mut self,
        id: NodeId,
        covered: usize,
        checkpoints: &[(usize, SlotId)],
        placed: &mut [bool],
    ) {
        for (k, &(at, slot)) in checkpoints.iter().enumerate() {
            if at == covered && !placed[k] && self.node(id).checkpoint.is_none() {
                let node = self.node_mut(id);
                node.checkpoint = Some(slot);
                // A state to keep on disk with the prefix it ends, in a file of its own.
                node.written = false;
                self.checkpoints += 1;
                placed[k] = true;
            }
        }
    }

    /// The nodes from the root (excluded) to `id`.
    fn path_nodes(&self, id: NodeId) -> Vec<NodeId> {
        let mut nodes = Vec::new();
        let mut at = id;
        while at != ROOT {
            nodes.push(at);
            at = self.node(at).parent;
        }
        nodes.reverse();
        nodes
    }

    /// The token ids and blocks of `nodes`, a path from the root.
    fn path_of(&self, nodes: &[NodeId]) -> (Vec<u32>, Vec<BlockId>) {
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
            written: false,
            reused: false,
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
        *self.refs.entry(block).or_default() += 1;
        id
    }

    /// Removes the childless node `id` (already out of `leaves`); its parent may become a leaf.
    fn remove_leaf(&mut self, id: NodeId) {
        let Some(node) = self.nodes[id].take() else {
            return;
        };
        self.pins.retain(|_, p| p.0 != id);
        self.free_nodes.push(id);
        if let Some(refs) = self.refs.get_mut(&node.block) {
            *refs -= 1;
            if *refs == 0 {
                self.refs.remove(&node.block);
            }
        }
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
    pub(super) fn computed(pool: &mut KvBlockPool, tokens: &[u32]) -> BlockTable {
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
        cache.insert_with_checkpoints(&turn, &table, &[(4, c1), (8, c2)], 0, &mut pool);
        pool.release(&mut table);
        assert_eq!(cache.num_checkpoints(), 2);
        // The whole turn and more: the deepest checkpoint (8) within the blocks asked for.
        let longer: Vec<u32> = (0..11).collect();
        let mut hit = cache.lookup_hit(&longer, 10, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_tokens),
            (4, Some(c2), 8)
        );
        pool.release(&mut hit.table);
        // At most 3 blocks: the checkpoint at 4 tokens, though 3 blocks match.
        let mut hit = cache.lookup_hit(&longer, 6, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_tokens),
            (2, Some(c1), 6)
        );
        pool.release(&mut hit.table);
        // Diverging in the first block: nothing to resume from.
        let hit = cache.lookup_hit(&[0, 9, 9], 2, &mut pool);
        assert!(hit.table.blocks.is_empty() && hit.checkpoint.is_none());
        // The pool is empty: the least recently used checkpoint (at 8: the lookups since
        // touched the first two blocks last) gives its slot up, its blocks stay.
        assert_eq!(cache.take_checkpoint_slot(), Some(c2));
        assert_eq!(cache.num_checkpoints(), 1);
        let mut hit = cache.lookup_hit(&longer, 10, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.matched_tokens),
            (2, Some(c1), 8)
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
    fn a_prefix_ending_inside_a_block_is_copied_not_shared() {
        let mut pool = KvBlockPool::new(16, 4);
        let mut cache = PrefixCache::new(4);
        let turn: Vec<u32> = (0..10).collect();
        let mut table = computed(&mut pool, &turn);
        cache.insert_with_checkpoints(&turn, &table, &[], 0, &mut pool);
        assert_eq!(
            cache.num_blocks(),
            3,
            "two whole blocks and the partly filled third"
        );
        pool.release(&mut table);
        // The next turn extends the history: two shared blocks, the third's 2 ids copied.
        let next: Vec<u32> = (0..17).collect();
        let mut hit = cache.lookup_hit(&next, 16, &mut pool);
        assert_eq!(hit.table.blocks.len(), 2);
        let (src, used) = hit.copy.unwrap();
        assert_eq!((used, hit.tokens(4), hit.matched_tokens), (2, 10, 10));
        assert_eq!(
            pool.holders(src),
            2,
            "the copy's source is held until it is made"
        );
        pool.release(&mut hit.table);
        pool.release(&mut BlockTable { blocks: vec![src] });
        // Diverging inside the second block: the first shared, 2 ids of the second copied.
        let branch = [0, 1, 2, 3, 4, 5, 99, 98];
        let mut hit = cache.lookup_hit(&branch, 7, &mut pool);
        assert_eq!((hit.table.blocks.len(), hit.tokens(4)), (1, 6));
        let (src, _) = hit.copy.unwrap();
        pool.release(&mut hit.table);
        pool.release(&mut BlockTable { blocks: vec![src] });
        // Never the last token: the same history again takes 9 of its 10.
        let mut hit = cache.lookup_hit(&turn, 9, &mut pool);
        assert_eq!(hit.tokens(4), 9);
        pool.release(&mut hit.table);
        pool.release(&mut BlockTable {
            blocks: vec![hit.copy.unwrap().0],
        });
        cache.evict(&mut pool, usize::MAX);
        assert_eq!((cache.num_blocks(), pool.num_used()), (0, 0));
    }

    #[test]
    fn a_hybrid_resumes_at_a_checkpoint_inside_a_block() {
        let mut pool = KvBlockPool::new(32, 4);
        let mut cache = PrefixCache::with_checkpoints(4, StateSlotPool::range(0, 4));
        let turn: Vec<u32> = (0..13).collect();
        // The turn cached once without checkpoints, then again (other blocks) with a branch
        // point after 6 tokens and its last token (13).
        let mut first = computed(&mut pool, &turn);
        cache.insert_with_checkpoints(&turn, &first, &[], 0, &mut pool);
        pool.release(&mut first);
        let mut table = computed(&mut pool, &turn);
        let (c6, c13) = (
            cache.take_checkpoint_slot().unwrap(),
            cache.take_checkpoint_slot().unwrap(),
        );
        cache.insert_with_checkpoints(&turn, &table, &[(6, c6), (13, c13)], 0, &mut pool);
        pool.release(&mut table);
        assert_eq!(cache.num_checkpoints(), 2);
        // 3 whole blocks and the 13th token's, all the first's: the tail at 6 shares the
        // cached second block, not the second table's.
        assert_eq!((cache.num_blocks(), pool.num_used()), (4, 4));
        // Extending the turn: resumed at its last token, the fourth block's first id copied.
        let next: Vec<u32> = (0..20).collect();
        let mut hit = cache.lookup_hit(&next, 19, &mut pool);
        assert_eq!(
            (hit.table.blocks.len(), hit.checkpoint, hit.tokens(4)),
            (3, Some(c13), 13)
        );
        pool.release(&mut hit.table);
        pool.release(&mut BlockTable {
            blocks: vec![hit.copy.unwrap().0],
        });
        // Diverging after 8 tokens: the checkpoint at 6, inside the second block, is the
        // deepest; the tokens leave the tree at 8.
        let branch = [0, 1, 2, 3, 4, 5, 6, 7, 50, 51];
        let mut hit = cache.lookup_hit(&branch, 9, &mut pool);
        assert_eq!(
            (
                hit.table.blocks.len(),
                hit.checkpoint,
                hit.tokens(4),
                hit.matched_tokens
            ),
            (1, Some(c6), 6, 8)
        );
        let (src, _) = hit.copy.unwrap();
        pool.release(&mut hit.table);
        pool.release(&mut BlockTable { blocks: vec![src] });
        // A block held by a tail and a whole node goes back only when both are evicted.
        cache.evict(&mut pool, usize::MAX);
        assert_eq!((cache.num_blocks(), cache.num_checkpoints()), (0, 0));
        assert_eq!(pool.num_used(), 0);
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

        /// Histories indexed with their partly filled blocks, hits taken down to a token and
        /// copied as a sequence would: every block a hit shares, and the copied part of the
        /// one it copies, hold exactly the ids they stand for (each block records what was
        /// written into it); references stay exactly the cache's once callers let go, and
        /// evicting everything frees every block.
        #[test]
        fn hits_down_to_a_token_hold_the_ids_they_stand_for(
            ops in proptest::collection::vec((0u8..4, proptest::collection::vec(0u32..3, 1..12)), 1..40)
        ) {
            let bs = 2;
            let mut pool = KvBlockPool::new(64, bs);
            let mut cache = PrefixCache::new(bs);
            let mut written: HashMap<BlockId, Vec<u32>> = HashMap::new();
            let mut held: Vec<PrefixHit> = Vec::new();
            let release = |pool: &mut KvBlockPool, mut hit: PrefixHit| {
                pool.release(&mut hit.table);
                if let Some((src, _)) = hit.copy {
                    pool.release(&mut BlockTable { blocks: vec![src] });
                }
            };
            for (op, tokens) in ops {
                if op == 3 {
                    cache.evict(&mut pool, usize::MAX);
                    continue;
                }
                let most = tokens.len() - 1;
                let mut hit = cache.lookup_hit(&tokens, most, &mut pool);
                let base = hit.table.blocks.len() * bs;
                for (i, b) in hit.table.blocks.iter().enumerate() {
                    prop_assert_eq!(&written[b][..], &tokens[i * bs..(i + 1) * bs]);
                }
                if let Some((src, used)) = hit.copy {
                    prop_assert!(used > 0 && base + used <= most);
                    prop_assert_eq!(&written[&src][..used], &tokens[base..base + used]);
                }
                prop_assert!(hit.tokens(bs) <= most);
                if op == 1 {
                    held.push(hit);
                    continue;
                }
                let mut table = std::mem::take(&mut hit.table);
                if pool.grow(&mut table, tokens.len()).is_err() {
                    pool.release(&mut table);
                    release(&mut pool, hit);
                    continue;
                }
                // The copy's part and every later position written, as a forward would.
                for (i, b) in table.blocks.iter().enumerate().skip(base / bs) {
                    let end = ((i + 1) * bs).min(tokens.len());
                    written.insert(*b, tokens[i * bs..end].to_vec());
                }
                release(&mut pool, hit);
                cache.insert_with_checkpoints(&tokens, &table, &[], 0, &mut pool);
                pool.release(&mut table);
            }
            for hit in held.drain(..) {
                release(&mut pool, hit);
            }
            prop_assert_eq!(pool.num_used(), cache.num_blocks());
            cache.evict(&mut pool, usize::MAX);
            prop_assert_eq!((pool.num_used(), cache.num_blocks()), (0, 0));
        }
    }
}
