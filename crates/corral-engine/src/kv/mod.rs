//! Ownership of KV cache blocks.

mod block_pool;
mod prefix;
mod spill;
mod state_slots;

pub use block_pool::{KvBlockPool, OutOfBlocks};
pub use prefix::{EvictedPrefix, EvictionCost, PrefixCache, PrefixHit};
pub use spill::{SpillDir, SpillFile, SpilledPrefix, fingerprint};
pub use state_slots::StateSlotPool;
