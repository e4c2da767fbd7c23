//! The Vulkan backend: one device, its kernels (a pipeline for every shader, made at
//! start-up), its stream of work, its buffer pool and counters.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use corral_backend::{
    Backend, BackendError, BufferPool, BufferUsage, Capabilities, DType, DeviceAllocation,
    DeviceBuffer, Ops, Result, StatsCounter, Storage,
};

use crate::args::Args;
use crate::memory::Placement;
use crate::stream::Stream;
use crate::{Kernel, SHADERS, VulkanBuffer, VulkanDevice};

/// The name suffix of the shaders' cooperative-matrix variants (build.rs compiles them).
const COOPMAT_SUFFIX: &str = "_coopmat";

/// How to open the Vulkan backend.
#[derive(Debug, Clone, Default)]
pub struct VulkanOptions {
    /// Device ordinal (`vulkan:N`), in the loader's order.
    pub ordinal: usize,
    /// KV cache element type: bf16 (default), f32 or fp8.
    pub kv_dtype: Option<DType>,
    /// Keep buffers unmapped and copy to and from them through staging buffers even where
    /// the device's memory is mapped: a discrete GPU's path, on any device (tests).
    pub force_staging: bool,
    /// Copy weights from files into the device's memory even where an integrated GPU could
    /// import the mapped file as it is (tests, and drivers whose imports misbehave).
    pub copy_weights: bool,
    /// Multiply tiles with the portable kernels even where the device has cooperative
    /// matrices (tests, and drivers whose matrix units misbehave).
    pub portable_tiles: bool,
    /// Run the delta rule token by token in prefill too, not in chunks (A/B runs, and the
    /// reference its chunked form is tested against).
    pub recurrent_delta_rule: bool,
}

impl VulkanOptions {
    /// These options with the switches the environment sets: `CORRAL_VULKAN_PORTABLE_TILES=1`
    /// sets [`VulkanOptions::portable_tiles`], `CORRAL_RECURRENT_DELTA_RULE=1`
    /// [`VulkanOptions::recurrent_delta_rule`].
    pub fn with_switches_from_env(mut self) -> Self {
        let on = |name| std::env::var(name).is_ok_and(|v| v == "1");
        self.portable_tiles |= on("CORRAL_VULKAN_PORTABLE_TILES");
        self.recurrent_delta_rule |= on("CORRAL_RECURRENT_DELTA_RULE");
        self
    }
}

/// Codes the shaders leave in the fault word when an index they were given is out of
/// range: the next read-back reports it.
pub(crate) mod fault {
    /// A token id past the embedding table.
    pub(crate) const TOKEN_ID: u32 = 1;
    /// A row or block index past its buffer.
    pub(crate) const ROW_INDEX: u32 = 2;
    /// A penalty's index past the logits.
    pub(crate) const PENALTY_INDEX: u32 = 3;
    /// A KV cache slot past the cache.
    pub(crate) const KV_SLOT: u32 = 4;
    /// A block table entry past the cache, or a position past the table.
    pub(crate) const BLOCK_TABLE: u32 = 5;
    /// An expert id past the layer's experts.
    pub(crate) const EXPERT_ID: u32 = 6;
    /// A recurrent run beyond the batch, or a state slot (its own or a kept one) beyond the
    /// pool.
    pub(crate) const RECURRENT_RUN: u32 = 7;
    /// A recurrent run longer than the batch's promised longest run.
    pub(crate) const RUN_LENGTH: u32 = 8;
}

/// What a fault code means.
fn fault_text(code: u32) -> &'static str {
    match code {
        fault::TOKEN_ID => "embedding: token id",
        fault::ROW_INDEX => "row index (gather, scatter or block copy)",
        fault::PENALTY_INDEX => "logit_penalties: a penalty's index past the logits",
        fault::KV_SLOT => "kv_store: cache slot",
        fault::BLOCK_TABLE => "paged_attention: a block table entry, or a position past the table",
        fault::EXPERT_ID => "MoE: expert id",
        fault::RECURRENT_RUN => {
            "Gated DeltaNet: a run beyond the batch or a state slot beyond the pool"
        }
        fault::RUN_LENGTH => "Gated DeltaNet: a run longer than the batch's promised longest run",
        _ => "unknown device error",
    }
}

/// The Vulkan backend on one device.
pub struct VulkanBackend {
    pub(crate) device: VulkanDevice,
    ordinal: usize,
    kernels: HashMap<&'static str, Kernel>,
    /// Dropped before the profiler and the buffers below: it waits for the device.
    pub(crate) stream: Stream,
    pub(crate) pool: BufferPool,
    pub(crate) stats: StatsCounter,
    pub(crate) capabilities: Capabilities,
    pub(crate) capturing: AtomicBool,
    /// Dispatches recorded into the graph being recorded.
    pub(crate) captured: AtomicU64,
    /// Where shaders report an index out of range ([`fault`]); read and cleared with every
    /// read-back.
    pub(crate) fault: VulkanBuffer,
    pub(crate) kv_dtype: DType,
    /// Whether dispatches are timed ([`corral_backend::Device::set_profiling`]).
    pub(crate) profiling: AtomicBool,
    /// The timestamps of timed dispatches, where the device writes them.
    pub(crate) profiler: Mutex<Option<crate::profile::Profiler>>,
    /// RoPE's inverse frequencies, a buffer a set of parameters
    /// ([`corral_backend::RopeParams::args`] and the rotated dims, as bits).
    pub(crate) rope_tables: Mutex<HashMap<[u32; 5], DeviceBuffer>>,
    /// Where read-backs of unmapped buffers land: host memory, grown to the largest.
    pub(crate) read_back: Mutex<Option<VulkanBuffer>>,
    /// Bytes staged into unmapped buffers since the stream last waited: bounded, so that a
    /// model's upload does not hold a second copy of its weights in staging buffers.
    pub(crate) staged_bytes: AtomicUsize,
    /// Weights from files are imported where they are mapped ([`VulkanOptions::copy_weights`]).
    import_weights: bool,
    /// The side of the cooperative-matrix products the tile kernels run on, if they do.
    matrix_tiles: Option<u32>,
    /// Where the chunked delta rule keeps each chunk's products between its two halves.
    pub(crate) delta_scratch: VulkanBuffer,
    /// [`VulkanOptions::recurrent_delta_rule`].
    pub(crate) recurrent_delta_rule: bool,
}

impl std::fmt::Debug for VulkanBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VulkanBackend({:?})", self.device)
    }
}

impl VulkanBackend {
    /// Opens Vulkan device `options.ordinal` and makes a pipeline for every shader.
    pub fn new(options: VulkanOptions) -> Result<Self> {
        let device = VulkanDevice::open_with(options.ordinal, options.force_staging)?;
        // A shader with a cooperative-matrix variant runs as that variant where the device
        // has the matrix units it takes (the variant keeps the shader's name in `kernels`).
        let device_tiles = device
            .info()
            .cooperative_matrix
            .filter(|_| !options.portable_tiles);
        let coopmat = device_tiles.is_some();
        let kernels = SHADERS
            .iter()
            .filter(|(name, _)| !name.ends_with(COOPMAT_SUFFIX))
            .map(|&(name, _)| {
                let variant = SHADERS
                    .iter()
                    .find(|(v, _)| v.strip_suffix(COOPMAT_SUFFIX) == Some(name))
                    .filter(|_| coopmat);
                let source = variant.map_or(name, |&(v, _)| v);
                Ok((name, Kernel::new(&device, source)?))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        if let Some(side) = device_tiles {
            tracing::info!(
                "vulkan:{}: tiles multiply f16 on cooperative matrices of {side} by {side}",
                options.ordinal
            );
        }
        let kv_dtype = options.kv_dtype.unwrap_or(DType::BF16);
        let profiler = device
            .info()
            .timestamp_period
            .map(|period| crate::profile::Profiler::new(&device.inner, period))
            .transpose()?;
        let capabilities = Capabilities {
            graphs: true,
            profiling: profiler.is_some(),
            weight_formats: crate::ops::BLOCK_FORMATS.to_vec(),
            kv_dtypes: vec![DType::BF16, DType::F32, DType::F8E4M3],
            bf16_projection_inputs: false,
        };
        if !capabilities.kv_dtypes.contains(&kv_dtype) {
            return Err(BackendError::Device {
                what: format!("vulkan:{}", options.ordinal),
                detail: format!("a KV cache of {kv_dtype} (this backend keeps bf16, f32 or fp8)"),
            });
        }
        let delta_scratch = VulkanBuffer::make(
            &device.inner,
            crate::ops::DELTA_SCRATCH_BYTES,
            crate::memory::Placement::Device,
        )?;
        Ok(Self {
            stream: Stream::new(std::sync::Arc::clone(&device.inner))?,
            fault: VulkanBuffer::new(&device, 16)?,
            device,
            ordinal: options.ordinal,
            kernels,
            pool: BufferPool::default(),
            stats: StatsCounter::default(),
            capabilities,
            capturing: AtomicBool::new(false),
            captured: AtomicU64::new(0),
            kv_dtype,
            rope_tables: Mutex::default(),
            profiling: AtomicBool::new(false),
            profiler: Mutex::new(profiler),
            read_back: Mutex::default(),
            staged_bytes: AtomicUsize::new(0),
            import_weights: !options.copy_weights && !options.force_staging,
            matrix_tiles: device_tiles,
            delta_scratch,
            recurrent_delta_rule: options.recurrent_delta_rule,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// What the device is and can do.
    pub fn info(&self) -> &crate::VulkanInfo {
        self.device.info()
    }

    /// The side of the cooperative-matrix products the tile kernels (projections of more
    /// than 8 rows, grouped experts' tiles) run on, their inputs rounded to f16; `None` where
    /// they run the portable f32 kernels.
    pub fn matrix_tiles(&self) -> Option<u32> {
        self.matrix_tiles
    }

    /// Whether weights from mapped files are imported as they are: on an integrated GPU
    /// that imports host memory, unless the options copy them.
    pub(crate) fn imports_weights(&self) -> bool {
        self.import_weights && self.device.info().unified && self.device.buffers_mapped()
    }

    /// Queues one dispatch of the shader `kernel` over `groups` workgroups with `args`;
    /// counted now, or when the graph being recorded replays.
    pub(crate) fn dispatch(&self, kernel: &str, groups: [u32; 3], args: &Args) -> Result<()> {
        let k = self
            .kernels
            .get(kernel)
            .ok_or_else(|| BackendError::Device {
                what: "vulkan".to_string(),
                detail: format!("no shader named {kernel}"),
            })?;
        if groups.contains(&0) {
            return Ok(());
        }
        let capturing = self.capturing.load(Ordering::Relaxed);
        let timed = if self.profiling.load(Ordering::Relaxed) && !capturing {
            self.profiler
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_mut()
                .and_then(|p| p.next(k.name()))
        } else {
            None
        };
        self.stream.dispatch(k, (groups, args.bytes()), timed)?;
        if capturing {
            self.captured.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.dispatch(1);
        }
        Ok(())
    }

    /// Refuses what may not happen while a graph is recorded (copies to and from the host).
    pub(crate) fn not_capturing(&self, op: &'static str) -> Result<()> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(BackendError::BadArgument {
                op,
                detail: "not allowed while a graph is being recorded".to_string(),
            });
        }
        Ok(())
    }

    /// Waits for all queued work, so that the host may touch buffers.
    pub(crate) fn finish(&self, op: &'static str) -> Result<()> {
        self.not_capturing(op)?;
        self.stream.finish()?;
        self.staged_bytes.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Waits for all queued work for a read-back of `bytes`: one host sync; an index fault
    /// a shader reported turns into an error (and is cleared).
    pub(crate) fn finish_read_back(&self, op: &'static str, bytes: usize) -> Result<()> {
        self.finish(op)?;
        self.stats.host_sync();
        self.stats.transfer(bytes);
        let mut code = [0u8; 4];
        self.fault.read(0, &mut code);
        let code = u32::from_le_bytes(code);
        if code != 0 {
            self.fault.write(0, &[0; 4]);
            return Err(BackendError::DeviceIndex {
                what: fault_text(code),
            });
        }
        Ok(())
    }

    /// A new buffer of `len` elements of `dtype`, zeroed (counted as an allocation): mapped
    /// memory when it is made, other memory on the queue before any work that reads it.
    pub(crate) fn new_buffer(
        &self,
        dtype: DType,
        len: usize,
        usage: BufferUsage,
    ) -> Result<DeviceBuffer> {
        let memory =
            VulkanBuffer::make(&self.device.inner, dtype.bytes_of(len), Placement::Device)?;
        if !memory.is_mapped() {
            self.zero_on_queue(&memory)?;
        }
        Ok(self.wrap(memory, dtype, len, usage))
    }

    /// `memory` as a buffer of `len` elements of `dtype` (counted as an allocation).
    pub(crate) fn wrap(
        &self,
        memory: VulkanBuffer,
        dtype: DType,
        len: usize,
        usage: BufferUsage,
    ) -> DeviceBuffer {
        self.stats.allocation();
        let address = memory.address();
        DeviceBuffer::new(
            dtype,
            len,
            usage,
            Storage::Device(DeviceAllocation::new(address, Box::new(memory))),
        )
    }
}

/// The memory behind a buffer this backend made.
pub(crate) fn memory<'a>(op: &'static str, buffer: &'a DeviceBuffer) -> Result<&'a VulkanBuffer> {
    match buffer.storage() {
        Storage::Device(a) => a.owner::<VulkanBuffer>(),
        _ => None,
    }
    .ok_or(BackendError::ForeignBuffer { op })
}

impl Backend for VulkanBackend {
    fn ops(&self) -> &dyn Ops {
        self
    }
}
