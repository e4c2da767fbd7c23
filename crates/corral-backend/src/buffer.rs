//! Device buffers, weight views and memory-mapped files.
//!
//! A [`DeviceBuffer`] has exactly one owner and is neither `Clone` nor `Copy`: copying device
//! memory can fail and must be explicit. Weights may live in a [`MappedFile`] without a copy.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{BackendError, DType, QuantFormat, Result, synthetic};

/// What a buffer is for; lets the pool and the memory planner tell buffers apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferUsage {
    /// Model weights, loaded once.
    Weights,
    /// Paged attention KV cache.
    KvCache,
    /// Per-forward activations, taken from and given back to the pool.
    Activations,
    /// Small per-batch metadata (token ids, positions, slot mappings).
    Metadata,
}

/// A read-only memory-mapped file (a safetensors shard).
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps `path` read-only, its pages faulted in up front (`MAP_POPULATE`, as llama.cpp
    /// maps weights): otherwise the first steps after a load pay a page fault for every page
    /// of experts they touch.
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let io = |source| BackendError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and Corral never writes checkpoint files while serving.
        // A file truncated by another process underneath us is outside what a mapping can guard
        // against, as in every engine that maps weights.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(io)?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            map,
        }))
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `byte_len` bytes from `byte_offset`, or an error of `op` naming the file where they
    /// run past its end.
    pub fn range(&self, op: &'static str, byte_offset: usize, byte_len: usize) -> Result<&[u8]> {
        byte_offset
            .checked_add(byte_len)
            .and_then(|end| self.map.get(byte_offset..end))
            .ok_or_else(|| BackendError::BadArgument {
                op,
                detail: format!(
                    "{}: tensor data out of range ({byte_len} bytes from byte {byte_offset} of {})",
                    self.path.display(),
                    self.map.len()
                ),
            })
    }
}

/// Where a buffer's elements live: host memory for the CPU backend, a device backend's own
/// allocation otherwise. Only the backend that made a buffer reads its storage.
#[derive(Debug)]
pub enum Storage {
    /// f32 elements in host memory.
    F32(Vec<f32>),
    /// u32 elements (or packed fp8 bytes) in host memory.
    U32(Vec<u32>),
    /// bf16 or f16 bit patterns (the buffer's dtype says which).
    Half(Vec<u16>),
    /// Blocks of a block-quantized format.
    Bytes(Vec<u8>),
    /// Bytes of a mapped file, suitably aligned for the dtype.
    Mapped {
        /// The file.
        file: Arc<MappedFile>,
        /// Where the elements start in it.
        byte_offset: usize,
        /// Bytes they take.
        byte_len: usize,
    },
    /// An allocation in a device's memory, which its backend owns and frees on drop.
    Device(DeviceAllocation),
}

/// A device backend's allocation: its device address, read on every launch, and the owner
/// whose drop frees it (the backend's own type, which it can look at again).
pub struct DeviceAllocation {
    address: u64,
    owner: Box<dyn std::any::Any + Send + Sync>,
}

impl DeviceAllocation {
    /// An allocation at `address`, freed when `owner` drops.
    pub fn new(address: u64, owner: Box<dyn std::any::Any + Send + Sync>) -> Self {
        Self { address, owner }
    }

    /// The device address.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The owner, if it is a `T`: a backend's check that a buffer is its own.
    pub fn owner<T: 'static>(&self) -> Option<&T> {
        self.owner.downcast_ref()
    }
}

impl std::fmt::Debug for DeviceAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceAllocation({:#x})", self.address)
    }
}

/// One allocation on a backend's device. Ops read and write buffers the caller passes in.
#[derive(Debug)]
pub struct DeviceBuffer {
    dtype: DType,
    len: usize,
    capacity: usize,
    usage: BufferUsage,
    /// Taken while a graph was recorded: a graph may write it on every replay, so the pool
    /// never frees it.
    held_by_graphs: bool,
    storage: Storage,
}

impl DeviceBuffer {
    /// A buffer of `len` elements of `dtype` in `storage` (made by backends).
    pub fn new(dtype: DType, len: usize, usage: BufferUsage, storage: Storage) -> Self {
        Self {
            dtype,
            len,
            capacity: len,
            usage,
            held_by_graphs: false,
            storage,
        }
    }

    /// Where the elements live (read by the backend that made the buffer).
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Where the elements live, to write them (by the backend that made the buffer).
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// Marks the buffer as written by a recorded graph (see [`crate::BufferPool`]).
    pub fn hold_for_graphs(&mut self) {
        self.held_by_graphs = true;
    }

    /// Whether a recorded graph may write the buffer.
    pub fn is_held_by_graphs(&self) -> bool {
        self.held_by_graphs
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the allocation can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// What the buffer is for.
    pub fn usage(&self) -> BufferUsage {
        self.usage
    }

    /// Bytes of the allocation.
    pub fn size_bytes(&self) -> usize {
        self.dtype.bytes_of(self.capacity)
    }

    /// Changes the number of elements in use, within the capacity (pool reuse).
    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }

    /// Changes what the buffer is for (a backend's table that outlives its load).
    pub fn set_usage(&mut self, usage: BufferUsage) {
        self.usage = usage;
    }
}

/// A row-major `[rows, cols]` matrix inside a weight buffer, starting at element `offset`:
/// one expert of a fused 3-D tensor, or the gate half of a fused gate/up projection.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// The buffer holding the matrix.
    pub buffer: &'a DeviceBuffer,
    /// First element of the matrix.
    pub offset: usize,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
}

impl<'a> WeightView<'a> {
    /// The whole buffer as a `[rows, cols]` matrix.
    pub fn new(buffer: &'a DeviceBuffer, rows: usize, cols: usize) -> Result<Self> {
        Self {
            buffer,
            offset: 0,
            rows,
            cols,
        }
        .checked()
    }

    /// Rows `start..start + rows` of this matrix.
    pub fn rows(&self, start: usize, rows: usize) -> Result<Self> {
        Self {
            buffer: self.buffer,
            offset: self.offset + start * self.cols,
            rows,
            cols: self.cols,
        }
        .checked()
    }

    /// Matrix `index` of a stack of `[rows, cols]` matrices starting at this view's offset.
    pub fn stacked(
        buffer: &'a DeviceBuffer,
        index: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        Self {
            buffer,
            offset: index * rows * cols,
            rows,
            cols,
        }
        .checked()
    }

    fn checked(self) -> Result<Self> {
        let needed = self.offset + self.rows * self.cols;
        if needed > self.buffer.len() {
            return Err(BackendError::TooSmall {
                op: "weight view",
                what: "weights",
                len: self.buffer.len(),
                needed,
            });
        }
        if !self.buffer.dtype().is_float() {
            return Err(BackendError::BadArgument {
                op: "weight view",
                detail: format!("weights must be float, got {}", self.buffer.dtype()),
            });
        }
        Ok(self)
    }
}

/// The device's buffers: its pool, weights, and copies to and from the host. The copies and
/// weights (`*_unchecked`) are the backend's, computing only: callers use `dyn Backend`'s
/// entries of the same names without the suffix, which check the arguments first, once for
/// every backend.
pub trait Buffers {
    /// A buffer of `len` elements from the pool, allocating (and counting it) on a miss.
    /// Contents are unspecified.
    fn take_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer>;

    /// Gives a buffer back to the pool.
    fn give_buffer(&self, buffer: DeviceBuffer);

    /// Bytes of free buffers the pool retains now, and the most it will retain.
    fn pool_bytes(&self) -> (usize, usize);

    /// A newly allocated zero-filled buffer that never returns to the pool (KV cache).
    fn alloc_zeroed(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer>;

    /// A weight buffer of `len` values of block format `dtype` from their `blocks`, for
    /// backends whose [`Capabilities::weight_formats`](crate::Capabilities::weight_formats) hold it.
    fn weight_from_blocks_unchecked(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let _ = (blocks, len);
        Err(BackendError::BadArgument {
            op: "weight_from_blocks",
            detail: format!("weights of {dtype}"),
        })
    }

    /// A weight buffer over `len` elements of `dtype` at `byte_offset` in a mapped file,
    /// without copying where the device can read the mapping directly.
    fn weight_from_file_unchecked(
        &self,
        file: &Arc<MappedFile>,
        byte_offset: usize,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer>;

    /// A weight buffer holding `values` converted to `dtype` (synthetic models, tests).
    fn weight_from_f32_unchecked(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer>;

    /// A weight buffer of `len` deterministic normal values ([`synthetic::normal_values`] of
    /// `seed`), made where the backend's memory is.
    fn weight_normal_unchecked(
        &self,
        len: usize,
        dtype: DType,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        self.weight_from_f32_unchecked(&synthetic::normal_values(seed, len, std), dtype)
    }

    /// A weight buffer of `len` values of block format `format`: [`synthetic::quant_blocks`]
    /// of `seed`, made where the backend's memory is.
    fn weight_synthetic_blocks_unchecked(
        &self,
        format: QuantFormat,
        len: usize,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        let blocks = synthetic::quant_blocks(format, seed, len, std);
        self.weight_from_blocks_unchecked(blocks, DType::Quant(format), len)
    }

    /// Copies host values into the first `src.len()` elements of an F32 buffer.
    fn upload_f32_unchecked(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()>;

    /// Copies host values into the first `src.len()` elements of a U32 buffer.
    fn upload_u32_unchecked(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()>;

    /// Reads the first `dst.len()` elements of an F32 buffer back to the host: one host sync.
    fn download_f32_unchecked(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()>;

    /// Reads the first `dst.len()` elements of a U32 buffer back to the host: one host sync.
    fn download_u32_unchecked(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()>;

    /// Copies elements from `offset` of `src` to host memory as they are stored (`out.len()`
    /// bytes, a whole number of elements): KV blocks and state for a session file. Waits.
    fn read_bytes_unchecked(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8])
    -> Result<()>;

    /// Writes `bytes` (elements as stored) into `dst` from element `offset`: a session file
    /// read back.
    fn write_bytes_unchecked(
        &self,
        bytes: &[u8],
        dst: &mut DeviceBuffer,
        offset: usize,
    ) -> Result<()>;
}
