//! The backend layer: device buffers, their pool, dispatch accounting, and the op-level
//! [`Backend`] trait the model calls.
//!
//! The model never touches device memory directly. It takes activation buffers from the
//! backend's pool ([`Buffers::take_buffer`]), calls ops that write into buffers it passes in,
//! and gives the buffers back. Each op is exactly one dispatch unless its doc says otherwise,
//! and every dispatch, host sync, allocation and transfer is counted in [`DispatchStats`].
//!
//! The backends live in crates of their own (`corral-cpu`, `corral-cuda`), and
//! `corral-device` opens the one a `--device` choice names. What a backend needs beyond the
//! trait is public here too: a buffer's [`Storage`], a [`Graph`]'s handle, the shared checks.
//! [`reference`] holds plain, obviously-correct versions of the ops for tests.

pub mod alloc_count;
mod buffer;
mod checked;
mod checked_buffers;
mod collective;
mod device;
mod dtype;
mod error;
mod experts;
mod ops;
mod pool;
pub mod quant;
pub mod reference;
pub mod rope;
pub mod sampling;
mod stats;
pub mod synthetic;

pub use buffer::{
    BufferUsage, Buffers, DeviceAllocation, DeviceBuffer, MappedFile, Storage, WeightView,
};
pub use checked::{
    MAX_CONV_KERNEL, MAX_DELTA_KEY_DIM, MAX_DELTA_VALUE_DIM, MAX_EXPERTS, MAX_HEAD_DIM,
    whole_blocks,
};
pub use collective::{Collective, LoopbackCollective, loopback_group};
pub use device::{Capabilities, Device, DeviceMemory, Graph, KernelTime, fnv1a};
pub use dtype::{DType, kv_row_elems};
pub use error::{BackendError, Result};
pub use experts::{ExpertMatrices, ExpertWeights};
pub use ops::{
    AttentionMeta, AttentionOps, AttentionShape, CopyOps, DeltaNetShape, MatmulOps, MoeOps,
    MoeRouting, MoeSorted, NO_KEPT_STATES, NormOps, Ops, QkShape, RecurrentOps, RecurrentRuns,
    SamplingOps, byte_range, matmul_parts_by_columns,
};
pub use pool::{BufferPool, DEFAULT_POOL_LIMIT};
pub use quant::QuantFormat;
pub use rope::{RopeParams, Yarn};

pub use stats::{DispatchStats, StatsCounter, process_cpu_time};

/// A backend: a device, its buffers and its ops. The model calls each op on `dyn Backend`,
/// whose entry point runs the backend's [`Ops`] (see `checked.rs`).
pub trait Backend: Device + Buffers {
    /// The backend's ops, called once their arguments are checked.
    fn ops(&self) -> &dyn Ops;
}
