//! Ownership of KV cache blocks, recurrent-state slots, the prefix cache and sessions on
//! disk; the [`manager`] is the one owner the scheduler calls.

mod block_pool;
pub(crate) mod manager;
mod prefix;
mod spill;
mod state_slots;

pub use block_pool::{KvBlockPool, OutOfBlocks};
pub use manager::{RestoreId, SessionStore};
pub use prefix::{EvictedPrefix, EvictionCost, PrefixCache, PrefixHit};
pub use spill::{
    ChainHash, RestorePiece, RestorePlan, SpillDir, SpillFile, SpilledRun, WritePlan, fingerprint,
};
pub use state_slots::StateSlotPool;
