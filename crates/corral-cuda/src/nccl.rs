//! NCCL, opened at run time like the rest of CUDA: the collectives of a group of CUDA
//! backends of one process ([`nccl_group`]), each call queued on its rank's stream (so that
//! graphs capture it) and counted as a dispatch. Its own small binding rather than cudarc's:
//! that one looks for none of the names NCCL's packages install (`libnccl.so.2`) and panics
//! where the library is missing; here a missing library is an error naming what was tried.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;

use corral_backend::{BackendError, Collective, DeviceBuffer, Result};

use crate::{CudaBackend, ptr_of};

/// `ncclResult_t`'s success.
const NCCL_SUCCESS: c_int = 0;
/// `ncclDataType_t`'s `ncclFloat32`.
const NCCL_FLOAT32: c_int = 7;
/// `ncclRedOp_t`'s `ncclSum`.
const NCCL_SUM: c_int = 0;

/// An `ncclComm_t`.
type Comm = *mut c_void;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type CommInitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type CommOp = unsafe extern "C" fn(Comm) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The NCCL library and the entry points Corral calls.
pub struct Nccl {
    version: i32,
    comm_init_all: CommInitAll,
    all_reduce: AllReduce,
    all_gather: AllGather,
    broadcast: Broadcast,
    comm_abort: CommOp,
    comm_destroy: CommOp,
    error_string: ErrorString,
    /// Held as long as the entry points above are.
    _library: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({})", self.version)
    }
}

/// The names tried, in order: `$CORRAL_NCCL_LIBRARY` if set, then the runtime library of
/// NCCL's packages (apt's `libnccl2`, pip's `nvidia-nccl-cu12`), then the development link.
fn candidates() -> Vec<String> {
    let mut names: Vec<String> = std::env::var("CORRAL_NCCL_LIBRARY").into_iter().collect();
    names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    names
}

impl Nccl {
    /// Opens the library and resolves its entry points.
    pub fn open() -> Result<Arc<Self>> {
        let names = candidates();
        let mut why = Vec::new();
        for name in &names {
            // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
            #[allow(unsafe_code)]
            match unsafe { libloading::Library::new(name) } {
                Ok(library) => return Self::resolve(library, name).map(Arc::new),
                Err(e) => why.push(format!("{name}: {e}")),
            }
        }
        Err(BackendError::Device {
            what: "NCCL".to_string(),
            detail: format!(
                "no NCCL library could be opened (install NCCL 2, e.g. Debian's libnccl2, or set \
                 CORRAL_NCCL_LIBRARY to its path): {}",
                why.join("; ")
            ),
        })
    }

    fn resolve(library: libloading::Library, name: &str) -> Result<Self> {
        fn symbol<T: Copy>(library: &libloading::Library, name: &str, what: &str) -> Result<T> {
            // SAFETY: each symbol is read as the type NCCL 2's nccl.h declares for it.
            #[allow(unsafe_code)]
            unsafe { library.get::<T>(what.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| BackendError::Device {
                    what: "NCCL".to_string(),
                    detail: format!("{name} lacks {what}: {e}"),
                })
        }
        let get_version: GetVersion = symbol(&library, name, "ncclGetVersion")?;
        let mut version = 0;
        // SAFETY: ncclGetVersion writes one int.
        #[allow(unsafe_code)]
        let result = unsafe { get_version(&mut version) };
        if result != NCCL_SUCCESS || version < 20_000 {
            return Err(BackendError::Device {
                what: "NCCL".to_string(),
                detail: format!(
                    "{name} reports version {version} (result {result}); NCCL 2 is needed"
                ),
            });
        }
        Ok(Self {
            version,
            comm_init_all: symbol(&library, name, "ncclCommInitAll")?,
            all_reduce: symbol(&library, name, "ncclAllReduce")?,
            all_gather: symbol(&library, name, "ncclAllGather")?,
            broadcast: symbol(&library, name, "ncclBroadcast")?,
            comm_abort: symbol(&library, name, "ncclCommAbort")?,
            comm_destroy: symbol(&library, name, "ncclCommDestroy")?,
            error_string: symbol(&library, name, "ncclGetErrorString")?,
            _library: library,
        })
    }

    /// NCCL's version code (`NCCL_VERSION_CODE`: 22703 for 2.27.3).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// `result` of `call` as an error naming both.
    fn check(&self, call: &str, result: c_int) -> Result<()> {
        if result == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any result.
        #[allow(unsafe_code)]
        let text = unsafe { CStr::from_ptr((self.error_string)(result)) }.to_string_lossy();
        Err(BackendError::Device {
            what: call.to_string(),
            detail: format!("NCCL error {result}: {text}"),
        })
    }
}

/// One rank of a group of CUDA backends connected by NCCL.
pub struct NcclCollective {
    nccl: Arc<Nccl>,
    backend: Arc<CudaBackend>,
    comm: Comm,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator may be used from any thread; the model calls each rank's from one
// thread at a time (its rank's), as NCCL requires.
#[allow(unsafe_code)]
unsafe impl Send for NcclCollective {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for NcclCollective {}

/// A group of `backends.len()` ranks, rank `r` on `backends[r]` (each on a device of its
/// own: NCCL refuses two ranks on one device).
pub fn nccl_group(nccl: &Arc<Nccl>, backends: &[Arc<CudaBackend>]) -> Result<Vec<NcclCollective>> {
    let devices = backends
        .iter()
        .map(|b| c_int::try_from(b.ordinal))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| BackendError::Device {
            what: "ncclCommInitAll".to_string(),
            detail: e.to_string(),
        })?;
    let world = c_int::try_from(devices.len()).map_err(|e| BackendError::Device {
        what: "ncclCommInitAll".to_string(),
        detail: e.to_string(),
    })?;
    let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: `comms` has room for one communicator a device of `devices`.
    #[allow(unsafe_code)]
    let result = unsafe { (nccl.comm_init_all)(comms.as_mut_ptr(), world, devices.as_ptr()) };
    nccl.check("ncclCommInitAll", result)?;
    Ok(comms
        .into_iter()
        .zip(backends)
        .enumerate()
        .map(|(rank, (comm, backend))| NcclCollective {
            nccl: Arc::clone(nccl),
            backend: Arc::clone(backend),
            comm,
            rank,
            world: devices.len(),
        })
        .collect())
}

impl NcclCollective {
    /// Queues `call` on the rank's stream as one counted dispatch.
    fn queue(&self, name: &'static str, call: impl FnOnce(*mut c_void) -> c_int) -> Result<()> {
        self.backend.counted(name, || {
            let stream = self.backend.gpu.stream.cu_stream().cast::<c_void>();
            self.nccl.check(name, call(stream))
        })
    }
}

/// A buffer's device address as NCCL takes it.
fn device_ptr(op: &'static str, b: &DeviceBuffer) -> Result<*mut c_void> {
    Ok(ptr_of(op, b)? as usize as *mut c_void)
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum_unchecked(&self, buf: &mut DeviceBuffer, len: usize) -> Result<()> {
        let op = "all_reduce_sum";
        let p = device_ptr(op, buf)?;
        // SAFETY: `p` holds `len` f32 values on this rank's device (checked by the caller).
        #[allow(unsafe_code)]
        self.queue(op, |stream| unsafe {
            (self.nccl.all_reduce)(p, p, len, NCCL_FLOAT32, NCCL_SUM, self.comm, stream)
        })
    }

    fn all_gather_unchecked(
        &self,
        src: &DeviceBuffer,
        len: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "all_gather";
        let (s, d) = (device_ptr(op, src)?, device_ptr(op, dst)?);
        // SAFETY: `s` holds `len` f32 values, `d` `len · world` (checked by the caller).
        #[allow(unsafe_code)]
        self.queue(op, |stream| unsafe {
            (self.nccl.all_gather)(s, d, len, NCCL_FLOAT32, self.comm, stream)
        })
    }

    fn broadcast_unchecked(&self, buf: &mut DeviceBuffer, len: usize, root: usize) -> Result<()> {
        let op = "broadcast";
        let p = device_ptr(op, buf)?;
        let root = c_int::try_from(root).map_err(|e| BackendError::BadArgument {
            op,
            detail: e.to_string(),
        })?;
        // SAFETY: `p` holds `len` f32 values (checked by the caller).
        #[allow(unsafe_code)]
        self.queue(op, |stream| unsafe {
            (self.nccl.broadcast)(p, p, len, NCCL_FLOAT32, root, self.comm, stream)
        })
    }

    fn abort(&self) {
        // SAFETY: the communicator is live until drop; abort ends its pending work.
        #[allow(unsafe_code)]
        let result = unsafe { (self.nccl.comm_abort)(self.comm) };
        if let Err(e) = self.nccl.check("ncclCommAbort", result) {
            tracing::warn!("{e}");
        }
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by ncclCommInitAll and is dropped once.
        #[allow(unsafe_code)]
        let result = unsafe { (self.nccl.comm_destroy)(self.comm) };
        if let Err(e) = self.nccl.check("ncclCommDestroy", result) {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where NCCL is missing, opening it is an error naming every name tried and what to
    /// install; never a panic.
    #[test]
    fn a_missing_nccl_is_an_error_naming_what_was_tried() {
        // SAFETY: tests of this crate set no other environment variable.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var("CORRAL_NCCL_LIBRARY", "/nonexistent/libnccl-corral-test.so")
        };
        match Nccl::open() {
            Err(BackendError::Device { what, detail }) => {
                assert_eq!(what, "NCCL");
                assert!(
                    detail.contains("/nonexistent/libnccl-corral-test.so"),
                    "{detail}"
                );
                assert!(detail.contains("libnccl.so.2"), "{detail}");
            }
            Err(other) => panic!("{other}"),
            // A machine with NCCL installed opens it from its usual names.
            Ok(nccl) => assert!(nccl.version() >= 20_000),
        }
    }
}
