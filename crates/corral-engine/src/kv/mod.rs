//! Ownership of KV cache blocks.

mod block_pool;
mod prefix;
mod state_slots;

pub use block_pool::{KvBlockPool, OutOfBlocks};
pub use prefix::{PrefixCache, PrefixHit};
pub use state_slots::StateSlotPool;
