//! Storage of the paged attention KV cache: per attention layer, K and V buffers of
//! `[num_blocks * block_size, kv_dim]`. Which blocks belong to whom is the engine's
//! `KvBlockPool`; this type only owns the memory.

use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer};

use crate::{ModelConfig, Result};

/// K and V of one attention layer.
#[derive(Debug)]
pub struct LayerKv {
    /// Keys, `[slots, kv_dim]`, after k-norm and RoPE.
    pub k: DeviceBuffer,
    /// Values, `[slots, kv_dim]`.
    pub v: DeviceBuffer,
}

/// The paged KV cache of every attention layer.
#[derive(Debug)]
pub struct PagedKvCache {
    /// Per attention layer.
    pub layers: Vec<LayerKv>,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
}

impl PagedKvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for every attention layer.
    pub fn new(
        backend: &dyn Backend,
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let len = num_blocks * block_size * config.kv_dim();
        let layers = (0..config.num_attention_layers())
            .map(|_| {
                Ok(LayerKv {
                    k: backend.alloc_zeroed(DType::F32, len, BufferUsage::KvCache)?,
                    v: backend.alloc_zeroed(DType::F32, len, BufferUsage::KvCache)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            block_size,
            num_blocks,
        })
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.k.size_bytes() + l.v.size_bytes())
            .sum()
    }
}
