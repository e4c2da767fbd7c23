//! The device half of the interface: what a device is and can do, its memory, graphs and
//! profiling.

use crate::{BackendError, DType, DispatchStats, QuantFormat, Result};

/// A device's memory, as its driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
    /// The device shares the host's memory (an integrated GPU or APU): its free memory
    /// report counts memory the host needs, so budgets come from `MemAvailable` instead.
    pub unified: bool,
    /// Bytes in use when the backend had loaded its context and kernels, before its first
    /// buffer (other processes' included): what a budget for the whole process leaves them.
    pub runtime: u64,
    /// What each allocation's size rounds up to (2 MiB for the CUDA driver's large ones):
    /// a pool of many buffers takes up to this much more than its bytes, per buffer.
    pub allocation_granularity: u64,
    /// Bytes of the buffers the backend allocated once at start, whatever the model (its
    /// scratch and library workspaces).
    pub fixed_buffers: u64,
}

/// A recorded sequence of dispatches the backend can replay with one call (a CUDA graph):
/// the same kernels on the same buffers, so inputs change only through buffer contents.
pub struct Graph {
    /// The backend's own handle, which only it reads.
    inner: Box<dyn std::any::Any + Send + Sync>,
    kernels: u64,
    /// Weight bytes its library calls read (counted on the host when recorded).
    host_weight_bytes: u64,
}

impl Graph {
    /// A graph of the backend's own `inner` handle, holding `kernels` dispatches whose
    /// library calls read `host_weight_bytes` of weights.
    pub fn new(
        inner: Box<dyn std::any::Any + Send + Sync>,
        kernels: u64,
        host_weight_bytes: u64,
    ) -> Self {
        Self {
            inner,
            kernels,
            host_weight_bytes,
        }
    }

    /// Dispatches the graph holds.
    pub fn kernels(&self) -> u64 {
        self.kernels
    }

    /// Weight bytes its library calls read on each replay.
    pub fn host_weight_bytes(&self) -> u64 {
        self.host_weight_bytes
    }

    /// The backend's handle, if it is a `T` (a graph another backend recorded is not).
    pub fn inner<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({} kernels)", self.kernels)
    }
}

/// Device time spent in one kernel, summed over its launches.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// Kernel name.
    pub name: &'static str,
    /// Launches timed.
    pub launches: u64,
    /// Milliseconds of device time.
    pub ms: f64,
}

/// What a device can do, as data: callers ask before they rely on a feature rather than
/// meet an error when they use it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Records steps as graphs and replays them ([`Device::begin_capture`]).
    pub graphs: bool,
    /// Times every dispatch by kernel ([`Device::set_profiling`]).
    pub profiling: bool,
    /// Block formats whose weights the ops read as stored ([`DType::Quant`]); loaders
    /// decode weights of other formats first.
    pub weight_formats: Vec<QuantFormat>,
    /// Element types the device keeps the attention KV cache in.
    pub kv_dtypes: Vec<DType>,
    /// Ops whose output only projections read (norms, attention) may write it in bf16, for
    /// projections that round their input so ([`Device::gemm_input_dtype`]).
    pub bf16_projection_inputs: bool,
}

impl Capabilities {
    /// Whether weights of block format `format` may be given to the device as they are.
    pub fn reads(&self, format: QuantFormat) -> bool {
        self.weight_formats.contains(&format)
    }
}

/// FNV-1a of `bytes`: a hash stable across builds and toolchains, for
/// [`Device::kernels_id`] (kept on disk with the measurements it keys).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The device: what it is and can do ([`Capabilities`]), its counters, graphs and profiling.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// Human-readable device name, e.g. `cpu (16 threads)`.
    fn device_name(&self) -> String;

    /// Identifies the kernels this backend runs, changing whenever they do: measurements
    /// cached on disk (the MoE calibration) are keyed by it, so none outlives its kernels.
    fn kernels_id(&self) -> u64 {
        0
    }

    /// Current totals of dispatches, host syncs, allocations and bytes moved.
    fn stats(&self) -> DispatchStats;

    /// Runs one model step, `step`, where this backend's ops run best. The CPU runs it on a
    /// thread of its pool, so that each op's parallel region starts there rather than handing
    /// off from the caller's thread to the pool and back.
    fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        step()
    }

    /// What the device can do.
    fn capabilities(&self) -> &Capabilities;

    /// Starts recording the ops queued from now on into a graph instead of running them
    /// (only where [`Capabilities::graphs`]). Nothing may be copied to or from the device
    /// until [`Device::end_capture`].
    fn begin_capture(&self) -> Result<()> {
        Err(BackendError::BadArgument {
            op: "begin_capture",
            detail: "this backend records no graphs".to_string(),
        })
    }

    /// Ends a recording begun by [`Device::begin_capture`]; its dispatches are not counted
    /// until the graph is replayed.
    fn end_capture(&self) -> Result<Graph> {
        Err(BackendError::BadArgument {
            op: "end_capture",
            detail: "this backend records no graphs".to_string(),
        })
    }

    /// Runs a recorded graph: one call, counted as the dispatches it holds and one replay.
    fn replay(&self, _graph: &Graph) -> Result<()> {
        Err(BackendError::BadArgument {
            op: "replay",
            detail: "this backend records no graphs".to_string(),
        })
    }

    /// Starts (or stops) timing every dispatch by kernel name, for [`Device::kernel_profile`].
    /// Backends that cannot time dispatches ignore it.
    fn set_profiling(&self, _on: bool) {}

    /// Device time per kernel name since profiling started or was last taken, longest first;
    /// empty unless profiling is on. Waits for queued work.
    fn kernel_profile(&self) -> Result<Vec<KernelTime>> {
        Ok(Vec::new())
    }

    /// The element type the backend keeps the attention KV cache in.
    fn kv_dtype(&self) -> DType {
        DType::F32
    }

    /// The memory of the device the backend places buffers on, read now; `None` for host
    /// memory (the CPU backend: size from `MemAvailable`).
    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        Ok(None)
    }

    /// Blocks until all launched work has finished: one host sync.
    fn synchronize(&self) -> Result<()>;

    /// The element type projections of `rows` rows by `weights`-typed matrices take their
    /// input in best: a norm whose only readers are projections (and grouped experts) writes
    /// it so. F32 unless the backend rounds such inputs anyway (a GPU's bf16 GEMMs), where
    /// the rounding done once by the norm saves a conversion per projection.
    fn gemm_input_dtype(&self, _rows: usize, _weights: DType) -> DType {
        DType::F32
    }
}
