//! Ownership of KV cache blocks, recurrent-state slots, the prefix cache and sessions on
//! disk; the [`manager`] is the one owner the scheduler calls.

mod block_pool;
pub(crate) mod manager;
mod prefix;
mod spill;
mod state_slots;

pub use block_pool::{KvBlockPool, OutOfBlocks};
pub use manager::SessionStore;
pub use prefix::{EvictedPrefix, EvictionCost, PrefixCache, PrefixHit};
pub use spill::{SpillDir, SpillFile, SpilledPrefix, fingerprint};
pub use state_slots::StateSlotPool;
