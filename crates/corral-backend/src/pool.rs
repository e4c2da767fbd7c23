//! The buffer pool: activations are taken from it and given back, so steady-state forwards
//! allocate nothing. A miss allocates (and is counted by the backend); a hit reuses the
//! smallest free buffer of the right type that is large enough.

use std::sync::Mutex;

use crate::{BufferUsage, DType, DeviceBuffer};

/// Free buffers waiting for reuse, per backend.
#[derive(Debug, Default)]
pub struct BufferPool {
    free: Mutex<Vec<DeviceBuffer>>,
}

impl BufferPool {
    /// Takes the smallest free buffer of `dtype` holding at least `len` elements, resized to
    /// `len`; `None` when the caller must allocate.
    pub fn take(&self, dtype: DType, len: usize, usage: BufferUsage) -> Option<DeviceBuffer> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.dtype() == dtype && b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)?;
        let mut buffer = free.swap_remove(best);
        buffer.set_len(len);
        buffer.set_usage(usage);
        Some(buffer)
    }

    /// Returns a buffer for reuse.
    pub fn give(&self, buffer: DeviceBuffer) {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buffer);
    }

    /// Bytes held by free buffers.
    pub fn free_bytes(&self) -> usize {
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(DeviceBuffer::size_bytes)
            .sum()
    }
}
