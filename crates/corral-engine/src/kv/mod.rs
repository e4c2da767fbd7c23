//! Ownership of KV cache blocks.

mod block_pool;

pub use block_pool::{KvBlockPool, OutOfBlocks};
