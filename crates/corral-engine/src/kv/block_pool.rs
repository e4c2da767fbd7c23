//! `KvBlockPool`: which KV cache blocks are free and how many sequences hold each used one.
//!
//! A flat `Vec` of reference counts indexed by block id and a stack of free ids: allocation and
//! release are O(blocks touched), with no allocation per block. The pool knows nothing of
//! scheduling; the memory itself is the model's `PagedKvCache`.

use corral_model::{BlockId, BlockTable};

/// Not enough free blocks for a request; nothing was allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV cache full: {needed} blocks needed, {free} free")]
pub struct OutOfBlocks {
    /// Blocks asked for.
    pub needed: usize,
    /// Blocks free at the time.
    pub free: usize,
}

/// Free list and reference counts of the KV cache's blocks.
#[derive(Debug)]
pub struct KvBlockPool {
    ref_counts: Vec<u32>,
    free: Vec<BlockId>,
    block_size: usize,
}

impl KvBlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            ref_counts: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().map(BlockId).collect(),
            block_size,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks not held by any sequence.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// How many holders (sequences, and the prefix cache) `block` has.
    pub fn holders(&self, block: BlockId) -> u32 {
        self.ref_counts.get(block.0 as usize).copied().unwrap_or(0)
    }

    /// Extends `table` with fresh blocks until it covers `tokens` positions; all or nothing.
    pub fn grow(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = tokens
            .div_ceil(self.block_size)
            .saturating_sub(table.blocks.len());
        if needed > self.free.len() {
            return Err(OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            let Some(block) = self.free.pop() else { break };
            self.ref_counts[block.0 as usize] = 1;
            table.blocks.push(block);
        }
        Ok(())
    }

    /// Adds a holder to each block of `table` (a sequence sharing a prefix).
    pub fn share(&mut self, table: &BlockTable) {
        for b in &table.blocks {
            self.ref_counts[b.0 as usize] += 1;
        }
    }

    /// Shortens `table` to the blocks that cover `tokens` positions, dropping one holder from
    /// each block past them (a sequence whose last tokens were rejected: a draft's). Blocks
    /// nobody holds are free again; the blocks kept, a partly filled last one included, are
    /// untouched.
    pub fn truncate(&mut self, table: &mut BlockTable, tokens: usize) {
        let keep = tokens.div_ceil(self.block_size).min(table.blocks.len());
        let mut tail = BlockTable {
            blocks: table.blocks.split_off(keep),
        };
        self.release(&mut tail);
    }

    /// Drops one holder from each block of `table` and empties it; blocks nobody holds are
    /// free again.
    pub fn release(&mut self, table: &mut BlockTable) {
        for b in table.blocks.drain(..) {
            let count = &mut self.ref_counts[b.0 as usize];
            debug_assert!(*count > 0, "block {} released twice", b.0);
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_is_all_or_nothing_and_release_frees() {
        let mut pool = KvBlockPool::new(4, 16);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 33).unwrap();
        assert_eq!(a.blocks.len(), 3);
        let mut b = BlockTable::default();
        assert_eq!(
            pool.grow(&mut b, 40),
            Err(OutOfBlocks { needed: 3, free: 1 })
        );
        assert!(b.blocks.is_empty());
        assert_eq!(pool.num_free(), 1);
        pool.grow(&mut a, 48).unwrap();
        assert_eq!(a.blocks.len(), 3, "48 tokens fit in 3 blocks");
        pool.release(&mut a);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn truncate_frees_the_blocks_past_the_tokens_kept() {
        let mut pool = KvBlockPool::new(6, 4);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 17).unwrap();
        let shared = BlockTable {
            blocks: a.blocks[..4].to_vec(),
        };
        pool.share(&shared);
        // 9 tokens keep 3 blocks; the 4th, shared, keeps its other holder; the 5th is free.
        pool.truncate(&mut a, 9);
        assert_eq!(a.blocks, shared.blocks[..3]);
        assert_eq!(pool.holders(shared.blocks[3]), 1);
        assert_eq!(pool.num_free(), 2);
        // Truncating past the end, or to what it holds, changes nothing.
        pool.truncate(&mut a, 40);
        pool.truncate(&mut a, 12);
        assert_eq!((a.blocks.len(), pool.num_free()), (3, 2));
        pool.truncate(&mut a, 0);
        assert!(a.blocks.is_empty());
        assert_eq!(pool.holders(shared.blocks[0]), 1);
    }

    #[test]
    fn shared_blocks_free_after_last_holder() {
        let mut pool = KvBlockPool::new(2, 8);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 8).unwrap();
        let mut b = a.clone();
        pool.share(&b);
        pool.release(&mut a);
        assert_eq!(pool.num_free(), 1);
        pool.release(&mut b);
        assert_eq!(pool.num_free(), 2);
    }
}
