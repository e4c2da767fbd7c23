//! Dispatch accounting: the exact counts behind Corral's fixed-cost claims.
//!
//! A *dispatch* is one unit of device work: a kernel launch on a GPU, one parallel region on
//! the CPU. A *host sync* is any read-back that makes the host wait for the device. Every op
//! and every transfer goes through a backend's launch helper, which bumps these counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of the counters. Subtract two snapshots for a per-forward delta.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct DispatchStats {
    /// Units of device work launched.
    pub dispatches: u64,
    /// Read-backs that made the host wait for the device.
    pub host_syncs: u64,
    /// Device buffers newly allocated (pool misses included, pool hits not).
    pub allocations: u64,
    /// Bytes copied between host and device, either way.
    pub bytes_transferred: u64,
    /// Bytes of weights the ops load: the CPU counts a matrix once per op (an expert read by
    /// several tokens in one op once); a GPU counts what its kernels load, so a matrix read
    /// by several tiles of rows counts once per tile.
    pub weight_bytes_read: u64,
    /// Recorded graphs replayed; their kernels are counted in `dispatches` too.
    pub graph_replays: u64,
}

impl std::ops::Add for DispatchStats {
    type Output = DispatchStats;

    fn add(self, other: DispatchStats) -> DispatchStats {
        DispatchStats {
            dispatches: self.dispatches + other.dispatches,
            host_syncs: self.host_syncs + other.host_syncs,
            allocations: self.allocations + other.allocations,
            bytes_transferred: self.bytes_transferred + other.bytes_transferred,
            weight_bytes_read: self.weight_bytes_read + other.weight_bytes_read,
            graph_replays: self.graph_replays + other.graph_replays,
        }
    }
}

impl std::ops::Sub for DispatchStats {
    type Output = DispatchStats;

    fn sub(self, earlier: DispatchStats) -> DispatchStats {
        DispatchStats {
            dispatches: self.dispatches - earlier.dispatches,
            host_syncs: self.host_syncs - earlier.host_syncs,
            allocations: self.allocations - earlier.allocations,
            bytes_transferred: self.bytes_transferred - earlier.bytes_transferred,
            weight_bytes_read: self.weight_bytes_read - earlier.weight_bytes_read,
            graph_replays: self.graph_replays - earlier.graph_replays,
        }
    }
}

/// The live counters a backend owns; cheap to bump from any thread.
#[derive(Debug, Default)]
pub struct StatsCounter {
    dispatches: AtomicU64,
    host_syncs: AtomicU64,
    allocations: AtomicU64,
    bytes_transferred: AtomicU64,
    weight_bytes_read: AtomicU64,
    graph_replays: AtomicU64,
}

impl StatsCounter {
    /// Counts `n` dispatches.
    pub fn dispatch(&self, n: u64) {
        self.dispatches.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes back `n` dispatches recorded into a graph rather than run.
    pub fn uncount_dispatches(&self, n: u64) {
        self.dispatches.fetch_sub(n, Ordering::Relaxed);
    }

    /// Takes back weight bytes counted on the host while recording a graph (its replays
    /// count them).
    pub fn uncount_weight_bytes(&self, bytes: u64) {
        self.weight_bytes_read.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Counts one replay of a graph holding `kernels` dispatches, whose library calls read
    /// `weight_bytes` that no kernel of ours counts.
    pub fn graph_replay(&self, kernels: u64, weight_bytes: u64) {
        self.dispatches.fetch_add(kernels, Ordering::Relaxed);
        self.weight_bytes_read
            .fetch_add(weight_bytes, Ordering::Relaxed);
        self.graph_replays.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one host sync.
    pub fn host_sync(&self) {
        self.host_syncs.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one allocation.
    pub fn allocation(&self) {
        self.allocations.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts bytes moved between host and device.
    pub fn transfer(&self, bytes: usize) {
        self.bytes_transferred
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts weight bytes read by an op.
    pub fn weight_read(&self, bytes: usize) {
        self.weight_bytes_read
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The current totals.
    pub fn snapshot(&self) -> DispatchStats {
        DispatchStats {
            dispatches: self.dispatches.load(Ordering::Relaxed),
            host_syncs: self.host_syncs.load(Ordering::Relaxed),
            allocations: self.allocations.load(Ordering::Relaxed),
            bytes_transferred: self.bytes_transferred.load(Ordering::Relaxed),
            weight_bytes_read: self.weight_bytes_read.load(Ordering::Relaxed),
            graph_replays: self.graph_replays.load(Ordering::Relaxed),
        }
    }
}

/// CPU time (user + system) this process has used so far, across all its threads.
pub fn process_cpu_time() -> std::time::Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a complete rusage into the pointer it is given; the buffer is
    // zero-initialised and sized for it.
    #[allow(unsafe_code)]
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return std::time::Duration::ZERO;
        }
        usage.assume_init()
    };
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    std::time::Duration::from_micros(micros(usage.ru_utime) + micros(usage.ru_stime))
}
