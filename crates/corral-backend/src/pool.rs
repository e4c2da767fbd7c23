//! The buffer pool: activations are taken from it and given back, so steady-state forwards
//! allocate nothing. A miss allocates (and is counted by the backend); a hit reuses the
//! smallest free buffer of the right type that is large enough. What the pool retains is
//! bounded: a buffer given back past the bound is freed (largest free buffers first), except
//! buffers a recorded graph writes, which live as long as the pool.

use std::sync::Mutex;

use crate::{BufferUsage, DType, DeviceBuffer};

/// Free buffers waiting for reuse, per backend.
#[derive(Debug)]
pub struct BufferPool {
    free: Mutex<Vec<DeviceBuffer>>,
    limit_bytes: usize,
}

/// Bytes a pool retains by default (activations of the largest batch fit well within it).
pub const DEFAULT_POOL_LIMIT: usize = 8 << 30;

impl Default for BufferPool {
    fn default() -> Self {
        Self::with_limit(DEFAULT_POOL_LIMIT)
    }
}

impl BufferPool {
    /// A pool that retains at most `limit_bytes` of free buffers.
    pub fn with_limit(limit_bytes: usize) -> Self {
        Self {
            free: Mutex::new(Vec::new()),
            limit_bytes,
        }
    }

    /// The most bytes of free buffers the pool keeps.
    pub fn limit_bytes(&self) -> usize {
        self.limit_bytes
    }

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

    /// Returns a buffer for reuse; past the bound the largest free buffers are freed, but
    /// never one a recorded graph writes ([`DeviceBuffer::is_held_by_graphs`]).
    pub fn give(&self, buffer: DeviceBuffer) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.push(buffer);
        let mut held: usize = free
            .iter()
            .filter(|b| !b.is_held_by_graphs())
            .map(DeviceBuffer::size_bytes)
            .sum();
        while held > self.limit_bytes {
            let Some(largest) = free
                .iter()
                .enumerate()
                .filter(|(_, b)| !b.is_held_by_graphs())
                .max_by_key(|(_, b)| b.size_bytes())
                .map(|(i, _)| i)
            else {
                break;
            };
            held -= free.swap_remove(largest).size_bytes();
        }
    }

    /// Returns a buffer for reuse without freeing any (nothing may be freed while a graph is
    /// being recorded); the next [`BufferPool::give`] restores the bound.
    pub fn give_keeping_all(&self, buffer: DeviceBuffer) {
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

#[cfg(test)]
mod tests {
    use super::BufferPool;
    use crate::{BufferUsage, DType, DeviceBuffer, Storage};

    /// A host buffer of `len` f32s, as the CPU backend makes them.
    fn host(len: usize) -> DeviceBuffer {
        DeviceBuffer::new(
            DType::F32,
            len,
            BufferUsage::Activations,
            Storage::F32(vec![0.0; len]),
        )
    }

    #[test]
    fn the_pool_frees_the_largest_buffers_past_its_bound() {
        let pool = BufferPool::with_limit(1000);
        for len in [100, 50, 200] {
            let b = host(len);
            pool.give(b);
        }
        // 1,400 bytes given; the 800-byte buffer goes, the two small ones stay.
        assert_eq!(pool.free_bytes(), 600);
        assert!(
            pool.take(DType::F32, 150, BufferUsage::Activations)
                .is_none()
        );
        assert!(
            pool.take(DType::F32, 90, BufferUsage::Activations)
                .is_some()
        );
    }

    #[test]
    fn buffers_graphs_write_outlive_the_bound_and_count_against_nothing() {
        let pool = BufferPool::with_limit(1000);
        let mut held = host(400);
        held.hold_for_graphs();
        pool.give(held);
        // Kept although 1,600 bytes pass the bound; the others fit beside it.
        for len in [100, 150] {
            pool.give(host(len));
        }
        assert_eq!(pool.free_bytes(), 2600);
        pool.give_keeping_all(host(200));
        assert_eq!(pool.free_bytes(), 3400, "nothing freed while keeping all");
        pool.give(host(10));
        // The others alone pass the bound: the largest of them go (800 and 600 bytes), the
        // held one stays.
        assert_eq!(pool.free_bytes(), 1600 + 400 + 40);
        assert!(
            pool.take(DType::F32, 400, BufferUsage::Activations)
                .is_some_and(|b| b.is_held_by_graphs())
        );
    }
}
