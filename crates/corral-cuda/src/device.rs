//! The thin layer over cudarc (pinned exactly; its API moves between minor versions): the
//! context and stream, device allocations, copies and raw kernel launches. Everything that
//! touches cudarc outside compiling kernels is here.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, result, sys};

use corral_backend::{BackendError, DeviceAllocation, Result, Storage};

/// `what: detail` from a driver error.
pub(crate) fn driver_err(what: &str, e: result::DriverError) -> BackendError {
    BackendError::Device {
        what: what.to_string(),
        detail: format!("{e:?}"),
    }
}

/// Whether the CUDA driver library can be opened. cudarc panics on a call into a missing
/// library, so this is asked before anything else.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; no CUDA call is made.
    #[allow(unsafe_code)]
    unsafe {
        sys::is_culib_present()
    }
}

/// A device's context and the one stream every op is queued on.
#[derive(Debug)]
pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) name: String,
    pub(crate) compute_capability: (i32, i32),
    pub(crate) multiprocessors: i32,
    pub(crate) total_memory: usize,
    /// Whether kernels are launched with programmatic dependent launch (sm_90+): each may
    /// be scheduled while the one before it finishes, and waits in `begin_kernel()`.
    pub(crate) overlap_launches: bool,
    /// Page-locked staging for large read-backs, made on the first.
    staging: std::sync::Mutex<Option<PinnedHost>>,
}

/// Bytes of the page-locked staging buffer, and of each of its slots: a staged copy keeps
/// one slot's bus transfer in flight while the host fills or empties another.
const STAGING_BYTES: usize = 16 << 20;
const STAGING_SLOTS: usize = 4;
const STAGING_SLOT_BYTES: usize = STAGING_BYTES / STAGING_SLOTS;
/// What cuMemAlloc rounds a large allocation up to: uncounted, it put a server with 96 KV
/// buffers on the H200 59-73 MiB over its budget.
const ALLOCATION_GRANULARITY: u64 = 2 << 20;

/// Copies `src` into `dst` (equal lengths) on several threads: a staged copy's host half,
/// which one thread makes slower than the bus.
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 20;
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

impl Gpu {
    /// Opens device `ordinal`; `overlap_launches` asks for programmatic dependent launch
    /// where the device has it.
    pub(crate) fn open(ordinal: usize, overlap_launches: bool) -> Result<Self> {
        if !driver_present() {
            return Err(BackendError::Device {
                what: "CUDA driver".to_string(),
                detail: "libcuda.so could not be opened (no NVIDIA driver on this machine?)"
                    .to_string(),
            });
        }
        let count = CudaContext::device_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(BackendError::Device {
                what: format!("cuda:{ordinal}"),
                detail: format!("no such device ({count} CUDA device(s) present)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("creating the context", e))?;
        // One stream, synchronised by hand: cudarc's per-buffer events would add work to
        // every launch and break graph capture.
        // SAFETY: Corral never shares cudarc slices between streams.
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking()
        };
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err("creating a stream", e))?;
        let name = ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_err("multiprocessor count", e))?;
        let total_memory = ctx
            .total_mem()
            .map_err(|e| driver_err("cuDeviceTotalMem", e))?;
        Ok(Self {
            ctx,
            stream,
            name,
            compute_capability,
            multiprocessors,
            total_memory,
            overlap_launches: overlap_launches && compute_capability.0 >= 9,
            staging: std::sync::Mutex::new(None),
        })
    }

    /// The page-locked staging buffer, made on first use.
    fn staging_buffer<'a>(
        &self,
        staging: &'a mut Option<PinnedHost>,
    ) -> Result<&'a mut PinnedHost> {
        Ok(match staging {
            Some(pinned) => pinned,
            empty => empty.insert(PinnedHost::new(&self.ctx, STAGING_BYTES)?),
        })
    }

    /// Copies `src` to device address `dst` through the page-locked buffer's slots in turn:
    /// the host fills one while the bus carries the ones before (each slot's event waited
    /// for before it is filled again), then waits for the last. A session's KV restored. The
    /// host syncs it made.
    pub(crate) fn upload_staged(&self, src: &[u8], dst: u64) -> Result<usize> {
        self.bind()?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let pinned = self.staging_buffer(&mut staging)?;
        let mut in_flight: [Option<cudarc::driver::CudaEvent>; STAGING_SLOTS] = Default::default();
        let mut syncs = 0;
        for (i, piece) in src.chunks(STAGING_SLOT_BYTES).enumerate() {
            let slot = i % STAGING_SLOTS;
            if let Some(event) = in_flight[slot].take() {
                event
                    .synchronize()
                    .map_err(|e| driver_err("waiting for a copy to the device", e))?;
                syncs += 1;
            }
            let buf = pinned.slot_mut(slot, piece.len());
            parallel_copy(buf, piece);
            // SAFETY: the caller checked that `dst` has room for `src`; the slot is written
            // again only after this copy's event (or the final sync) has completed.
            #[allow(unsafe_code)]
            unsafe {
                result::memcpy_htod_async(
                    dst + (i * STAGING_SLOT_BYTES) as u64,
                    &*buf,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("copying to the device", e))?;
            in_flight[slot] = Some(self.record_event()?);
        }
        self.sync()?;
        Ok(syncs + 1)
    }

    /// Copies device memory at `src` into `dst` through the page-locked buffer's slots (the
    /// driver copies pageable memory through a small staging of its own at a fraction of the
    /// bus's rate): every slot's transfer is queued, and each slot, once its event completes,
    /// is copied out by the host and given the next piece. A session's KV read back. The
    /// host syncs it made.
    pub(crate) fn download_staged(&self, src: u64, dst: &mut [u8]) -> Result<usize> {
        self.bind()?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let pinned = self.staging_buffer(&mut staging)?;
        let total = dst.len();
        let pieces = total.div_ceil(STAGING_SLOT_BYTES);
        let piece_len = |i: usize| STAGING_SLOT_BYTES.min(total - i * STAGING_SLOT_BYTES);
        let queue = |pinned: &mut PinnedHost, i: usize| -> Result<cudarc::driver::CudaEvent> {
            let buf = pinned.slot_mut(i % STAGING_SLOTS, piece_len(i));
            // SAFETY: the caller checked that `src` holds `dst.len()` bytes; the slot is read
            // only after this copy's event has completed, and refilled only after that read.
            #[allow(unsafe_code)]
            unsafe {
                result::memcpy_dtoh_async(
                    buf,
                    src + (i * STAGING_SLOT_BYTES) as u64,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_err("copying from the device", e))?;
            self.record_event()
        };
        let mut in_flight = std::collections::VecDeque::with_capacity(STAGING_SLOTS);
        for i in 0..pieces.min(STAGING_SLOTS) {
            in_flight.push_back(queue(pinned, i)?);
        }
        let mut syncs = 0;
        for (i, piece) in dst.chunks_mut(STAGING_SLOT_BYTES).enumerate() {
            if let Some(event) = in_flight.pop_front() {
                event
                    .synchronize()
                    .map_err(|e| driver_err("waiting for a copy from the device", e))?;
                syncs += 1;
            }
            parallel_copy(piece, pinned.slot_mut(i % STAGING_SLOTS, piece.len()));
            if i + STAGING_SLOTS < pieces {
                in_flight.push_back(queue(pinned, i + STAGING_SLOTS)?);
            }
        }
        Ok(syncs)
    }

    /// Free and total device memory now, and whether the device is integrated (shares the
    /// host's memory).
    pub(crate) fn memory(&self) -> Result<corral_backend::DeviceMemory> {
        self.bind()?;
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| driver_err("cuMemGetInfo", e))?;
        let integrated = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
            .map_err(|e| driver_err("cuDeviceGetAttribute(INTEGRATED)", e))?;
        Ok(corral_backend::DeviceMemory {
            free: free as u64,
            total: total as u64,
            unified: integrated != 0,
            runtime: 0,
            allocation_granularity: ALLOCATION_GRANULARITY,
            fixed_buffers: crate::cuda_fixed_buffer_bytes() as u64,
        })
    }

    /// Makes the context current on the calling thread (the engine runs on its own).
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the CUDA context", e))
    }

    /// A new device allocation of `bytes` (at least one byte).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DeviceMem> {
        self.bind()?;
        // SAFETY: the context is current; the pointer is freed once, by DeviceMem's drop.
        #[allow(unsafe_code)]
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| driver_err(&format!("allocating {bytes} bytes on the device"), e))?;
        Ok(DeviceMem {
            ptr,
            bytes,
            ctx: Arc::clone(&self.ctx),
        })
    }

    /// Queues a copy of `src` to device address `dst`.
    pub(crate) fn upload<T>(&self, src: &[T], dst: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked that `dst` has room for `src`; pageable host memory is
        // staged by the driver before the call returns, so `src` may go right after.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_err("copying to the device", e))
    }

    /// Queues a copy of device memory at `src` into `dst`; valid once the stream is synced.
    pub(crate) fn download<T>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked that `src` holds `dst.len()` elements, and syncs the
        // stream before reading `dst`.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| driver_err("copying from the device", e))
    }

    /// Queues a copy of `bytes` bytes of device memory from `src` to `dst`.
    pub(crate) fn copy_device(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked that both ranges lie in one allocation and do not
        // overlap.
        #[allow(unsafe_code)]
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_err("copying within the device", e))
    }

    /// Queues a fill of `bytes` bytes at `dst` with zero.
    pub(crate) fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked that `dst` holds `bytes` bytes.
        #[allow(unsafe_code)]
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_err("clearing device memory", e))
    }

    /// Waits for everything queued.
    pub(crate) fn sync(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| driver_err("synchronising the stream", e))
    }

    /// An event recorded on the stream now (profiling).
    pub(crate) fn record_event(&self) -> Result<cudarc::driver::CudaEvent> {
        let event = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_err("creating an event", e))?;
        event
            .record(&self.stream)
            .map_err(|e| driver_err("recording an event", e))?;
        Ok(event)
    }

    /// Queues `kernel` over `grid` blocks of `block` threads, each with `smem` bytes of
    /// dynamic shared memory; `params` point at each argument.
    pub(crate) fn launch(
        &self,
        kernel: &Kernel,
        (grid, block, smem): ((u32, u32, u32), u32, u32),
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let mut overlap = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.overlap_launches),
        };
        // SAFETY: `kernel` comes from a module loaded in this context and `params` match its
        // signature (every launch site passes the arguments its kernel declares, with device
        // pointers to buffers checked large enough for the shapes passed); `config` and the
        // attribute it points at outlive the call. Every kernel begins with begin_kernel(),
        // which waits for the previous kernel, so overlapping launches is safe.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuLaunchKernelEx(&config, kernel.0, params.as_mut_ptr(), std::ptr::null_mut())
        }
        .result()
        .map_err(|e| driver_err(kernel.1, e))
    }
}

/// A kernel's handle, name and the dynamic shared memory each launch gives it (the most a
/// launch may ask for, where launches size it).
#[derive(Debug)]
pub(crate) struct Kernel(
    pub(crate) sys::CUfunction,
    pub(crate) &'static str,
    pub(crate) u32,
);

impl Kernel {
    /// This kernel with `bytes` of dynamic shared memory per block (beyond the 48 KiB a
    /// kernel gets without asking).
    pub(crate) fn with_dynamic_smem(mut self, bytes: u32) -> Result<Self> {
        let value = i32::try_from(bytes).map_err(|_| BackendError::Device {
            what: self.1.to_string(),
            detail: format!("{bytes} bytes of shared memory"),
        })?;
        // SAFETY: the handle is a loaded function of a live module; the attribute takes a
        // byte count.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuFuncSetAttribute(
                self.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                value,
            )
        }
        .result()
        .map_err(|e| driver_err(self.1, e))?;
        self.2 = bytes;
        Ok(self)
    }

    /// Blocks of `threads` threads, each with this kernel's dynamic shared memory, that an SM
    /// holds at once: the driver's count from the kernel's registers and shared memory.
    pub(crate) fn blocks_per_sm(&self, threads: u32) -> Result<usize> {
        let mut blocks: std::ffi::c_int = 0;
        // SAFETY: the handle is a loaded function of a live module; `blocks` outlives the call.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut blocks,
                self.0,
                threads as std::ffi::c_int,
                self.2 as usize,
            )
        }
        .result()
        .map_err(|e| driver_err(self.1, e))?;
        Ok(usize::try_from(blocks).unwrap_or(0))
    }

    /// Registers a thread of this kernel takes and its local (spilled) memory in bytes, as
    /// the driver reports them: what decides how many blocks fit an SM.
    pub(crate) fn resources(&self) -> Result<(i32, i32)> {
        let attribute = |which| -> Result<i32> {
            let mut value: std::ffi::c_int = 0;
            // SAFETY: the handle is a loaded function of a live module; `value` outlives the call.
            #[allow(unsafe_code)]
            unsafe { sys::cuFuncGetAttribute(&mut value, which, self.0) }
                .result()
                .map_err(|e| driver_err(self.1, e))?;
            Ok(value)
        };
        Ok((
            attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
        ))
    }

    /// This kernel preferring all of an SM's L1 as shared memory, so that as many of its
    /// blocks fit an SM as their shared memory allows.
    pub(crate) fn preferring_shared_memory(self) -> Result<Self> {
        // SAFETY: as in `with_dynamic_smem`; the attribute takes a percentage.
        #[allow(unsafe_code)]
        unsafe {
            sys::cuFuncSetAttribute(
                self.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
        }
        .result()
        .map_err(|e| driver_err(self.1, e))?;
        Ok(self)
    }
}

// SAFETY: a CUfunction is a handle valid on every thread that binds its context; launching
// it does not mutate the handle.
#[allow(unsafe_code)]
unsafe impl Send for Kernel {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Kernel {}

/// Page-locked host memory, freed on drop.
struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned by this value alone (freed once, in drop) and only used
// through `&mut self`.
#[allow(unsafe_code)]
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_err("binding the CUDA context", e))?;
        // SAFETY: the context is current; the memory is zeroed before any view of it exists
        // and freed once, by drop.
        #[allow(unsafe_code)]
        let ptr: *mut u8 = unsafe {
            let ptr = result::malloc_host(bytes, 0)
                .map_err(|e| driver_err(&format!("allocating {bytes} page-locked bytes"), e))?
                .cast::<u8>();
            std::ptr::write_bytes(ptr, 0, bytes);
            ptr
        };
        Ok(Self {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    /// The first `len` bytes (at most a slot's) of staging slot `slot`.
    fn slot_mut(&mut self, slot: usize, len: usize) -> &mut [u8] {
        let start = (slot * STAGING_SLOT_BYTES).min(self.bytes);
        let len = len.min(STAGING_SLOT_BYTES).min(self.bytes - start);
        // SAFETY: `ptr` holds `bytes` initialised bytes for as long as self lives, and
        // start + len stays within them; borrowed mutably here.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(start), len)
        }
    }
}

impl std::fmt::Debug for PinnedHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHost({} bytes)", self.bytes)
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host in this context, freed exactly once here.
            #[allow(unsafe_code)]
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// One device allocation, freed on drop.
pub(crate) struct DeviceMem {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMem {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation as a buffer's storage, freed when the buffer drops.
    pub(crate) fn into_storage(self) -> Storage {
        Storage::Device(DeviceAllocation::new(self.ptr, Box::new(self)))
    }
}

impl std::fmt::Debug for DeviceMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMem({:#x}, {} bytes)", self.ptr, self.bytes)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context, freed exactly once here.
            #[allow(unsafe_code)]
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
