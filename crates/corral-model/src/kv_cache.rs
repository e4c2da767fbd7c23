//! Storage of the paged attention KV cache: per attention layer, K and V buffers of
//! `[num_blocks * block_size, kv_row_elems]` (a slot's heads, and an fp8 cache's head scales). Which blocks belong to whom is the engine's
//! `KvBlockPool`; this type only owns the memory.

use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer};

use crate::{BlockId, ModelConfig, ModelError, Result, SlotId};

/// K and V of one attention layer.
#[derive(Debug)]
pub struct LayerKv {
    /// Keys, `[slots, kv_row_elems]`, after k-norm and RoPE.
    pub k: DeviceBuffer,
    /// Values, `[slots, kv_row_elems]`.
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
    /// Distinguishes caches (recorded graphs are bound to one cache's memory).
    id: u64,
    /// Most bytes of one layer's K (or V) a session copy moves at once.
    copy_piece_bytes: usize,
}

impl PagedKvCache {
    /// Sets the most bytes of one layer's K (or V) that [`PagedKvCache::read_blocks`] and
    /// [`PagedKvCache::write_blocks`] move at once: the device memory they need beside the
    /// cache (default 64 MiB: a 32k-token layer of a large model in one piece, which the
    /// staged copies stream through without a wait between pieces).
    pub fn with_copy_piece_bytes(mut self, bytes: usize) -> Self {
        self.copy_piece_bytes = bytes.max(1);
        self
    }

    /// Allocates `num_blocks` blocks of `block_size` tokens for every attention layer, in the
    /// backend's KV type.
    pub fn new(
        backend: &dyn Backend,
        config: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let dtype = backend.kv_dtype();
        let row = corral_backend::kv_row_elems(dtype, config.num_kv_heads, config.head_dim);
        let len = num_blocks * block_size * row;
        let layers = (0..config.num_attention_layers())
            .map(|_| {
                Ok(LayerKv {
                    k: backend.alloc_zeroed(dtype, len, BufferUsage::KvCache)?,
                    v: backend.alloc_zeroed(dtype, len, BufferUsage::KvCache)?,
                })
            })
            .collect::<Result<_>>()?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            layers,
            block_size,
            num_blocks,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            copy_piece_bytes: COPY_PIECE_BYTES,
        })
    }

    /// This cache's identity, unique in the process.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.k.size_bytes() + l.v.size_bytes())
            .sum()
    }

    /// Bytes of one block in every layer, K and V.
    pub fn block_bytes(&self) -> usize {
        self.size_bytes() / self.num_blocks.max(1)
    }

    /// Elements of one block in one layer's K (or V).
    fn block_elems(&self) -> usize {
        self.layers
            .first()
            .map_or(0, |l| l.k.len() / self.num_blocks.max(1))
    }

    fn check_blocks(&self, blocks: &[BlockId]) -> Result<()> {
        match blocks.iter().find(|b| b.0 as usize >= self.num_blocks) {
            Some(b) => Err(ModelError::InvalidBatch(format!(
                "block {} is out of range for {} blocks",
                b.0, self.num_blocks
            ))),
            None => Ok(()),
        }
    }

    /// The bytes of `blocks` in every layer, as stored: per layer, the K of each block in
    /// order, then the V of each (a session written to disk), read into `reuse`'s buffers
    /// where it has them (their bytes are overwritten). The blocks are gathered on the device
    /// and cross to the host a piece at a time (see [`PagedKvCache::with_copy_piece_bytes`]).
    pub fn read_blocks(
        &self,
        backend: &dyn Backend,
        blocks: &[BlockId],
        reuse: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>> {
        self.check_blocks(blocks)?;
        let elems = self.block_elems();
        let count = blocks.len();
        let mut reuse = reuse.into_iter();
        let mut outs = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let size = elems * layer.k.dtype().size_bytes();
            let mut out = reuse.next().unwrap_or_default();
            out.truncate(2 * size * count);
            out.resize(2 * size * count, 0);
            outs.push(out);
        }
        let Some(first) = self.layers.first() else {
            return Ok(outs);
        };
        if count == 0 || elems == 0 {
            return Ok(outs);
        }
        let (dtype, size) = (first.k.dtype(), elems * first.k.dtype().size_bytes());
        let pieces = PiecesOf::upload(backend, blocks, size, self.copy_piece_bytes)?;
        let mut packed =
            match backend.take_buffer(dtype, pieces.blocks * elems, BufferUsage::Activations) {
                Ok(p) => p,
                Err(e) => {
                    pieces.give(backend);
                    return Err(e.into());
                }
            };
        let copied = (|| -> Result<()> {
            for (layer, out) in self.layers.iter().zip(&mut outs) {
                let (k_part, v_part) = out.split_at_mut(size * count);
                for (at, n, ids) in pieces.iter() {
                    let range = at * size..(at + n) * size;
                    backend.gather_blocks(&layer.k, ids, n, elems, &mut packed)?;
                    backend.read_bytes(&packed, 0, &mut k_part[range.clone()])?;
                    backend.gather_blocks(&layer.v, ids, n, elems, &mut packed)?;
                    backend.read_bytes(&packed, 0, &mut v_part[range])?;
                }
            }
            Ok(())
        })();
        backend.give_buffer(packed);
        pieces.give(backend);
        copied.map(|()| outs)
    }

    /// Copies block `src` into block `dst` in every layer, on the device: a cached block's
    /// first tokens continuing a sequence that writes on in its own block (copy-on-write).
    pub fn copy_block(&mut self, backend: &dyn Backend, src: BlockId, dst: BlockId) -> Result<()> {
        self.check_blocks(&[src, dst])?;
        let elems = self.block_elems();
        let (s, d) = (src.0 as usize * elems, dst.0 as usize * elems);
        for layer in &mut self.layers {
            backend.copy_within(&mut layer.k, s, d, elems)?;
            backend.copy_within(&mut layer.v, s, d, elems)?;
        }
        Ok(())
    }

    /// Writes into `blocks` what [`PagedKvCache::read_blocks`] read: per layer, the K and
    /// the V bytes of those blocks in order (a session read back). They cross to the device
    /// a piece at a time and are scattered there.
    pub fn write_blocks(
        &mut self,
        backend: &dyn Backend,
        blocks: &[BlockId],
        layers: &[(&[u8], &[u8])],
    ) -> Result<()> {
        self.check_blocks(blocks)?;
        let elems = self.block_elems();
        let count = blocks.len();
        if layers.len() != self.layers.len() {
            return Err(ModelError::InvalidBatch(format!(
                "KV bytes for {} layers, the cache has {}",
                layers.len(),
                self.layers.len()
            )));
        }
        for (layer, (k, v)) in self.layers.iter().zip(layers) {
            let size = elems * layer.k.dtype().size_bytes();
            if k.len() != size * count || v.len() != size * count {
                return Err(ModelError::InvalidBatch(format!(
                    "{} K and {} V bytes for {count} blocks of {size}",
                    k.len(),
                    v.len()
                )));
            }
        }
        let Some(first) = self.layers.first() else {
            return Ok(());
        };
        if count == 0 || elems == 0 {
            return Ok(());
        }
        let (dtype, size) = (first.k.dtype(), elems * first.k.dtype().size_bytes());
        let pieces = PiecesOf::upload(backend, blocks, size, self.copy_piece_bytes)?;
        let mut packed =
            match backend.take_buffer(dtype, pieces.blocks * elems, BufferUsage::Activations) {
                Ok(p) => p,
                Err(e) => {
                    pieces.give(backend);
                    return Err(e.into());
                }
            };
        let written = (|| -> Result<()> {
            for (layer, (k, v)) in self.layers.iter_mut().zip(layers) {
                for (at, n, ids) in pieces.iter() {
                    let range = at * size..(at + n) * size;
                    // One stream: each piece lands after the scatter before it read the buffer.
                    backend.write_bytes(&k[range.clone()], &mut packed, 0)?;
                    backend.scatter_blocks(&packed, ids, n, elems, &mut layer.k)?;
                    backend.write_bytes(&v[range], &mut packed, 0)?;
                    backend.scatter_blocks(&packed, ids, n, elems, &mut layer.v)?;
                }
            }
            Ok(())
        })();
        backend.give_buffer(packed);
        pieces.give(backend);
        written
    }
}

/// Recurrent state of every Gated DeltaNet layer, in slots: per layer, the last
/// `kernel - 1` convolution inputs and the fp32 delta-rule state of each slot. Which slot
/// belongs to whom is the engine's business; a run that starts its sequence (position 0)
/// ignores what its slot held.
#[derive(Debug)]
pub struct RecurrentStateCache {
    /// Per linear layer: `[slots, conv channels, kernel - 1]`.
    pub conv: Vec<DeviceBuffer>,
    /// Per linear layer: `[slots, value heads, key dim, value dim]`.
    pub recurrent: Vec<DeviceBuffer>,
    /// Slots.
    pub num_slots: usize,
    id: u64,
}

impl RecurrentStateCache {
    /// Allocates `num_slots` slots for every linear layer of `config` (none for non-hybrids).
    pub fn new(backend: &dyn Backend, config: &ModelConfig, num_slots: usize) -> Result<Self> {
        let (mut conv, mut recurrent) = (Vec::new(), Vec::new());
        if let Some(h) = &config.hybrid {
            for _ in 0..config.num_linear_layers() {
                let c = h.linear.conv_state_len() * num_slots;
                let r = h.linear.recurrent_state_len() * num_slots;
                conv.push(backend.alloc_zeroed(DType::F32, c, BufferUsage::KvCache)?);
                recurrent.push(backend.alloc_zeroed(DType::F32, r, BufferUsage::KvCache)?);
            }
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            conv,
            recurrent,
            num_slots,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// This cache's identity, unique in the process (recorded decode graphs are bound to it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Copies slot `src`'s state (every linear layer's convolution and recurrent state) into
    /// slot `dst`: a checkpoint taken, or one restored for a sequence to continue.
    pub fn copy_slot(&mut self, backend: &dyn Backend, src: SlotId, dst: SlotId) -> Result<()> {
        let (s, d) = (self.slot_index(src)?, self.slot_index(dst)?);
        if s == d {
            return Ok(());
        }
        for buffer in self.conv.iter_mut().chain(self.recurrent.iter_mut()) {
            let per = buffer.len() / self.num_slots;
            backend.copy_within(buffer, s * per, d * per, per)?;
        }
        Ok(())
    }

    /// Bytes of one slot's state in every layer ([`RecurrentStateCache::read_slot`]'s).
    pub fn slot_bytes(&self) -> usize {
        self.conv
            .iter()
            .chain(&self.recurrent)
            .map(|b| b.len() / self.num_slots.max(1) * 4)
            .sum()
    }

    /// Slot `slot`'s state as stored, every layer's convolution state then every layer's
    /// recurrent state (a session written to disk).
    pub fn read_slot(&self, backend: &dyn Backend, slot: SlotId) -> Result<Vec<u8>> {
        let s = self.slot_index(slot)?;
        let mut out = Vec::new();
        for buffer in self.conv.iter().chain(&self.recurrent) {
            let per = buffer.len() / self.num_slots;
            let mut part = vec![0u8; per * 4];
            backend.read_bytes(buffer, s * per, &mut part)?;
            out.extend_from_slice(&part);
        }
        Ok(out)
    }

    /// Writes what [`RecurrentStateCache::read_slot`] read into `slot`.
    pub fn write_slot(&mut self, backend: &dyn Backend, slot: SlotId, bytes: &[u8]) -> Result<()> {
        let s = self.slot_index(slot)?;
        let total: usize = self
            .conv
            .iter()
            .chain(&self.recurrent)
            .map(|b| b.len() / self.num_slots * 4)
            .sum();
        if bytes.len() != total {
            return Err(ModelError::InvalidBatch(format!(
                "{} state bytes, a slot holds {total}",
                bytes.len()
            )));
        }
        let mut at = 0;
        let num_slots = self.num_slots;
        for buffer in self.conv.iter_mut().chain(self.recurrent.iter_mut()) {
            let per = buffer.len() / num_slots;
            backend.write_bytes(&bytes[at..at + per * 4], buffer, s * per)?;
            at += per * 4;
        }
        Ok(())
    }

    fn slot_index(&self, slot: SlotId) -> Result<usize> {
        let s = slot.0 as usize;
        if s >= self.num_slots {
            return Err(ModelError::InvalidBatch(format!(
                "state slot {} is out of range for {} slots",
                slot.0, self.num_slots
            )));
        }
        Ok(s)
    }

    /// Bytes of state per sequence (all linear layers).
    pub fn bytes_per_slot(config: &ModelConfig) -> usize {
        config.hybrid.as_ref().map_or(0, |h| {
            config.num_linear_layers()
                * (h.linear.conv_state_len() + h.linear.recurrent_state_len())
                * 4
        })
    }
}

/// The default of [`PagedKvCache::with_copy_piece_bytes`].
const COPY_PIECE_BYTES: usize = 64 << 20;

/// A session copy's blocks in pieces of at most a number of bytes, each piece's ids in a
/// device buffer from the pool.
struct PiecesOf {
    /// Blocks of the largest piece.
    blocks: usize,
    /// (index of the piece's first block, its blocks, their ids).
    pieces: Vec<(usize, usize, DeviceBuffer)>,
}

impl PiecesOf {
    fn upload(
        backend: &dyn Backend,
        blocks: &[BlockId],
        block_bytes: usize,
        piece_bytes: usize,
    ) -> Result<Self> {
        let per_piece = (piece_bytes / block_bytes.max(1)).max(1);
        let mut out = Self {
            blocks: per_piece.min(blocks.len()),
            pieces: Vec::new(),
        };
        for (i, chunk) in blocks.chunks(per_piece).enumerate() {
            let ids: Vec<u32> = chunk.iter().map(|b| b.0).collect();
            let uploaded = backend
                .take_buffer(DType::U32, ids.len(), BufferUsage::Metadata)
                .and_then(|mut buffer| {
                    backend.upload_u32(&ids, &mut buffer)?;
                    Ok(buffer)
                });
            match uploaded {
                Ok(buffer) => out.pieces.push((i * per_piece, chunk.len(), buffer)),
                Err(e) => {
                    out.give(backend);
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    fn iter(&self) -> impl Iterator<Item = (usize, usize, &DeviceBuffer)> {
        self.pieces.iter().map(|(at, n, ids)| (*at, *n, ids))
    }

    /// Gives the id buffers back to the pool.
    fn give(self, backend: &dyn Backend) {
        for (_, _, ids) in self.pieces {
            backend.give_buffer(ids);
        }
    }
}
