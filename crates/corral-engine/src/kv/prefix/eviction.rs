//! Eviction from the prefix cache: which cached leaves go when the pool runs short (least
//! recently used, or scored by the prefill FLOPs they save per byte), session pins that keep
//! a path, and the prefixes shown to the spill store as they go or, while idle, ahead.

use std::collections::HashSet;
use std::time::Instant;

use corral_model::{BlockId, BlockTable, SlotId};

use super::{FLOPS_WEIGHT, KvBlockPool, NodeId, PrefixCache, PrefixNode};

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
    /// Token ids (the last block partly filled where the leaf is a tail).
    pub tokens: &'a [u32],
    /// The blocks holding them.
    pub blocks: &'a [BlockId],
    /// The recurrent state after the last token (hybrid models).
    pub checkpoint: Option<SlotId>,
    /// Tokens from the start up to the end of the deepest block a later request took (from
    /// the cache, or restored from disk): how much of it goes on being used.
    pub reused: usize,
}

impl PrefixCache {
    /// Keeps the path to `node` (a session's last turn) from eviction until `until`, in
    /// place of the session's previous pin. Eviction drops pins only when nothing else is
    /// left to free.
    pub fn pin(&mut self, session: &str, node: PrefixNode, until: Instant) {
        let now = Instant::now();
        self.pins.retain(|_, p| p.1 > now);
        if self.nodes.get(node.0).is_some_and(Option::is_some) {
            self.pins.insert(session.to_string(), (node.0, until));
        }
    }

    /// Session pins in force at `now`.
    pub fn num_pins(&self, now: Instant) -> usize {
        self.pins.values().filter(|p| p.1 > now).count()
    }

    /// Nodes pinned at `now`.
    pub(super) fn pinned(&self, now: Instant) -> HashSet<NodeId> {
        self.pins
            .values()
            .filter(|p| p.1 > now)
            .map(|p| p.0)
            .collect()
    }

    /// Frees cached blocks, leaves in eviction order (least recently used first, or by the
    /// eviction cost's score), until `pool` has `free` free blocks or nothing more may go; a
    /// block that a sequence still holds is never freed (nor its ancestors). Returns how many
    /// blocks were freed.
    pub fn evict(&mut self, pool: &mut KvBlockPool, free: usize) -> usize {
        self.evict_with(pool, free, None)
    }

    /// [`PrefixCache::evict`], showing `spill` (if any) each leaf's whole prefix before its
    /// block is freed (its blocks' contents are intact until the next forward). Once a path
    /// was shown, the nodes on it are shown again only where they carry a checkpoint (a
    /// hybrid prefix's own state): the rest are prefixes of what `spill` just took, and
    /// building each one's path again would cost a chain of n blocks n² token copies.
    pub fn evict_with(
        &mut self,
        pool: &mut KvBlockPool,
        free: usize,
        mut spill: Option<&mut dyn FnMut(&EvictedPrefix<'_>)>,
    ) -> usize {
        let mut freed = 0;
        let mut skipped = Vec::new();
        let mut pinned = self.pinned(Instant::now());
        let mut shown = HashSet::new();
        loop {
            if pool.num_free() >= free {
                break;
            }
            let next = match self.cost {
                Some(cost) => self.cheapest_leaf(&cost, pool),
                None => self.leaves.pop_first(),
            };
            let Some((used, id)) = next else {
                // Only held and pinned leaves are left: the pins give way.
                if pinned.is_empty()
                    || !skipped
                        .iter()
                        .any(|s: &(u64, NodeId)| pinned.contains(&s.1))
                {
                    break;
                }
                pinned.clear();
                self.pins.clear();
                self.leaves.extend(skipped.drain(..));
                continue;
            };
            let block = self.node(id).block;
            if !self.idle(block, pool) || pinned.contains(&id) {
                skipped.push((used, id));
                continue;
            }
            if let Some(spill) = spill.as_deref_mut()
                && (!shown.contains(&id) || self.node(id).checkpoint.is_some())
            {
                let nodes = self.path_nodes(id);
                let (tokens, blocks) = self.path_of(&nodes);
                spill(&EvictedPrefix {
                    tokens: &tokens,
                    blocks: &blocks,
                    checkpoint: self.node(id).checkpoint,
                    reused: self.reused_tokens(&nodes),
                });
                shown = nodes.into_iter().collect();
            }
            self.remove_leaf(id);
            pool.release(&mut BlockTable {
                blocks: vec![block],
            });
            if pool.holders(block) == 0 {
                freed += 1;
            }
        }
        self.leaves.extend(skipped);
        freed
    }

    /// The least recently used prefix not yet shown to a store while the engine is idle (write-
    /// behind: the eviction that later needs its blocks then finds it on disk already): a
    /// leaf's, or one ending at a checkpoint; its tokens, blocks and checkpoint. It and the
    /// nodes on its path without a checkpoint (which its file covers) are marked shown.
    pub fn next_unwritten(&mut self) -> Option<(Vec<u32>, Vec<BlockId>, Option<SlotId>)> {
        let id = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|(_, n)| !n.written && (n.children.is_empty() || n.checkpoint.is_some()))
            .min_by_key(|(_, n)| n.last_used)
            .map(|(id, _)| id)?;
        let nodes = self.path_nodes(id);
        let (tokens, blocks) = self.path_of(&nodes);
        let checkpoint = self.node(id).checkpoint;
        self.node_mut(id).written = true;
        for &n in &nodes {
            let node = self.node_mut(n);
            if node.checkpoint.is_none() {
                node.written = true;
            }
        }
        Some((tokens, blocks, checkpoint))
    }

    /// Tokens of the path `nodes` up to the end of its deepest reused node.
    fn reused_tokens(&self, nodes: &[NodeId]) -> usize {
        let mut end = 0;
        let mut reused = 0;
        for &n in nodes {
            let node = self.node(n);
            end += node.tokens.len();
            if node.reused {
                reused = end;
            }
        }
        reused
    }

    /// The evictable leaf (no holder but the cache) with the lowest score, taken out of
    /// `leaves`: recency and FLOPs saved per byte, each scaled to 0..1 over the candidates,
    /// the second weighed `FLOPS_WEIGHT` times the first (long histories are what agents
    /// come back to).
    fn cheapest_leaf(&mut self, cost: &EvictionCost, pool: &KvBlockPool) -> Option<(u64, NodeId)> {
        let candidates: Vec<(u64, NodeId, f64)> = self
            .leaves
            .iter()
            .filter(|&&(_, id)| self.idle(self.node(id).block, pool))
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
}

#[cfg(test)]
mod tests {
    use super::super::tests::computed;
    use super::*;
    use crate::StateSlotPool;

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

    /// An evicted prefix says how much of it later requests took: a history a turn went on
    /// from up to where it was taken (by a lookup, or as a sequence's own restored start), a
    /// prompt nobody came back to not at all.
    #[test]
    fn eviction_shows_how_much_of_a_prefix_was_reused() {
        let mut pool = KvBlockPool::new(16, 2);
        let mut cache = PrefixCache::new(2);
        let (history, alone) = (vec![1, 2, 3, 4, 5, 6], vec![7, 8, 9, 10]);
        for tokens in [&history, &alone] {
            let mut t = computed(&mut pool, tokens);
            cache.insert(tokens, &t, &mut pool);
            pool.release(&mut t);
        }
        // A turn that goes on from the history takes its first two blocks.
        let mut taken = cache.lookup_hit(&[1, 2, 3, 4, 99], 4, &mut pool).table;
        pool.release(&mut taken);
        // A sequence that restored [11 12] from disk and went on.
        let restored = vec![11, 12, 13, 14];
        let mut t = computed(&mut pool, &restored);
        cache.insert_with_checkpoints(&restored, &t, &[], 2, &mut pool);
        pool.release(&mut t);
        let mut shown = Vec::new();
        cache.evict_with(
            &mut pool,
            usize::MAX,
            Some(&mut |p: &EvictedPrefix<'_>| shown.push((p.tokens.to_vec(), p.reused))),
        );
        for expected in [(history, 4), (alone, 0), (restored, 2)] {
            assert!(shown.contains(&expected), "{expected:?} in {shown:?}");
        }
    }

    /// Evicting a chain shows the store its whole path once, then only the nodes on it that
    /// carry a checkpoint (their own prefixes); another branch is shown whole.
    #[test]
    fn eviction_shows_a_spilled_path_once_and_its_checkpoints_again() {
        let mut pool = KvBlockPool::new(16, 2);
        let mut cache = PrefixCache::with_checkpoints(2, StateSlotPool::range(10, 2));
        let long: Vec<u32> = (0..10).collect();
        let mut table = computed(&mut pool, &long);
        let (c4, c10) = (
            cache.take_checkpoint_slot().unwrap(),
            cache.take_checkpoint_slot().unwrap(),
        );
        cache.insert_with_checkpoints(&long, &table, &[(4, c4), (10, c10)], 0, &mut pool);
        pool.release(&mut table);
        let branch: Vec<u32> = vec![0, 1, 7, 7];
        let mut tb = cache.lookup(&branch, usize::MAX, &mut pool);
        pool.grow(&mut tb, 4).unwrap();
        cache.insert(&branch, &tb, &mut pool);
        pool.release(&mut tb);
        let mut shown = Vec::new();
        let mut record = |e: &EvictedPrefix<'_>| {
            assert_eq!(e.blocks.len() * 2, e.tokens.len());
            shown.push((e.tokens.len(), e.checkpoint));
        };
        cache.evict_with(&mut pool, usize::MAX, Some(&mut record));
        assert_eq!(cache.num_blocks(), 0);
        shown.sort_unstable();
        assert_eq!(
            shown,
            vec![(4, None), (4, Some(c4)), (10, Some(c10))],
            "the chain's 10 tokens, its checkpoint at 4 again, the branch's 4; not the chain's \
             other nodes"
        );
    }

    /// While idle, each leaf's prefix and each checkpoint's is shown once, least recently
    /// used first; a new checkpoint on a shown node, or a longer history, is shown again.
    #[test]
    fn idle_write_behind_shows_each_prefix_once() {
        let mut pool = KvBlockPool::new(16, 2);
        let mut cache = PrefixCache::with_checkpoints(2, StateSlotPool::range(10, 3));
        let long: Vec<u32> = (0..10).collect();
        let mut table = computed(&mut pool, &long);
        let c4 = cache.take_checkpoint_slot().unwrap();
        cache.insert_with_checkpoints(&long, &table, &[(4, c4)], 0, &mut pool);
        pool.release(&mut table);
        let other: Vec<u32> = vec![9, 9, 8, 8];
        let mut tb = computed(&mut pool, &other);
        cache.insert(&other, &tb, &mut pool);
        pool.release(&mut tb);
        let mut shown = Vec::new();
        while let Some((tokens, blocks, checkpoint)) = cache.next_unwritten() {
            assert_eq!(blocks.len() * 2, tokens.len());
            shown.push((tokens, checkpoint));
        }
        assert_eq!(
            shown,
            vec![
                (long[..4].to_vec(), Some(c4)),
                (long.clone(), None),
                (other.clone(), None)
            ],
            "the older history's checkpoint and leaf, then the newer leaf; nothing twice"
        );
        // A checkpoint taken later on a shown node, and a longer history: shown again.
        let longer: Vec<u32> = (0..12).collect();
        let mut hit = cache.lookup(&longer, usize::MAX, &mut pool);
        pool.grow(&mut hit, 12).unwrap();
        let c12 = cache.take_checkpoint_slot().unwrap();
        cache.insert_with_checkpoints(&longer, &hit, &[(12, c12)], 0, &mut pool);
        pool.release(&mut hit);
        let again: Vec<_> = std::iter::from_fn(|| cache.next_unwritten()).collect();
        assert_eq!(again.len(), 1);
        assert_eq!((again[0].0.clone(), again[0].2), (longer, Some(c12)));
        // The same history again (its own blocks), now with a state after 8 tokens.
        let mut same = computed(&mut pool, &long);
        let c8 = cache.take_checkpoint_slot().unwrap();
        cache.insert_with_checkpoints(&long, &same, &[(8, c8)], 0, &mut pool);
        pool.release(&mut same);
        let again: Vec<_> = std::iter::from_fn(|| cache.next_unwritten()).collect();
        assert_eq!(again.len(), 1, "the node that now ends at a checkpoint");
        assert_eq!(
            (again[0].0.clone(), again[0].2),
            (long[..8].to_vec(), Some(c8))
        );
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
}
