//! `PrefixCache`: which full KV blocks hold which token prefixes, so that a request that
//! re-sends a history can take those blocks instead of recomputing them.
//!
//! A tree of full blocks: each node is one block of `block_size` token ids that follows its
//! parent's, found among its siblings by those exact ids (no hash to collide). The cache holds
//! one reference, in the [`KvBlockPool`], to every block it indexes, so a finished sequence's
//! blocks outlive it; eviction drops least recently used leaves that no sequence holds. It
//! indexes attention KV only: a hybrid model's prefix is reusable only where a recurrent-state
//! checkpoint also exists, which this index does not record.

use std::collections::{BTreeSet, HashMap};

use corral_model::{BlockId, BlockTable};

use super::KvBlockPool;

type NodeId = usize;

const ROOT: NodeId = 0;

#[derive(Debug)]
struct Node {
    parent: NodeId,
    /// The block's token ids (empty for the root).
    tokens: Box<[u32]>,
    block: BlockId,
    children: HashMap<Box<[u32]>, NodeId>,
    last_used: u64,
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
        };
        Self {
            nodes: vec![Some(root)],
            free_nodes: Vec::new(),
            leaves: BTreeSet::new(),
            block_size: block_size.max(1),
            clock: 0,
            cached: 0,
        }
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
        let mut table = BlockTable::default();
        let mut at = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some(&child) = self.node(at).children.get(chunk) else {
                break;
            };
            self.touch(child);
            table.blocks.push(self.node(child).block);
            at = child;
        }
        pool.share(&table);
        table
    }

    /// Indexes the full blocks of `tokens` that `table` holds (a sequence's table once those
    /// tokens are computed), taking the cache's reference to each block it adds. Where the
    /// same tokens are indexed already, the cached block stays and the sequence's stays its
    /// own, released with the sequence.
    pub fn insert(&mut self, tokens: &[u32], table: &BlockTable, pool: &mut KvBlockPool) {
        let mut at = ROOT;
        for (chunk, &block) in tokens.chunks_exact(self.block_size).zip(&table.blocks) {
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
            at = next;
        }
    }

    /// Frees cached blocks, least recently used leaves first, until `pool` has `free` free
    /// blocks or nothing more may go; a block that a sequence still holds is never freed (nor
    /// its ancestors). Returns how many blocks were freed.
    pub fn evict(&mut self, pool: &mut KvBlockPool, free: usize) -> usize {
        let mut freed = 0;
        let mut skipped = Vec::new();
        while pool.num_free() < free {
            let Some((used, id)) = self.leaves.pop_first() else {
                break;
            };
            let block = self.node(id).block;
            if pool.holders(block) > 1 {
                skipped.push((used, id));
                continue;
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
