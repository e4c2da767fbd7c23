//! cuBLAS, opened at run time when present, for the dense projections of many rows with bf16
//! weights (prefill). It runs on the backend's one stream with a fixed workspace, so its
//! calls need no allocation and can be recorded into a graph.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys};

use super::device::{DeviceMem, Gpu};
use corral_backend::{BackendError, Result};

/// Workspace handed to cuBLAS once, so that it never allocates during a step.
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle bound to the backend's stream.
pub(crate) struct Blas {
    handle: sys::cublasHandle_t,
    _workspace: DeviceMem,
}

// SAFETY: cuBLAS handles may move between threads; the handle is used only through the
// backend's ops, which one thread at a time calls (the thread that owns the model).
#[allow(unsafe_code)]
unsafe impl Send for Blas {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas")
    }
}

fn blas_err(what: &str, e: blas::CublasError) -> BackendError {
    BackendError::Device {
        what: what.to_string(),
        detail: format!("{e:?}"),
    }
}

impl Blas {
    /// Opens cuBLAS on `gpu`'s stream; `Ok(None)` when the library is not installed.
    pub(crate) fn open(gpu: &Gpu) -> Result<Option<Self>> {
        // SAFETY: only tries to open the shared library.
        #[allow(unsafe_code)]
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        gpu.bind()?;
        let workspace = gpu.alloc(WORKSPACE_BYTES)?;
        let handle = blas::create_handle().map_err(|e| blas_err("cublasCreate", e))?;
        let this = Self {
            handle,
            _workspace: workspace,
        };
        // SAFETY: the handle is live; the stream and workspace outlive it (the backend owns
        // all three and drops the handle first).
        #[allow(unsafe_code)]
        unsafe {
            blas::set_stream(this.handle, gpu.stream.cu_stream() as sys::cudaStream_t)
                .map_err(|e| blas_err("cublasSetStream", e))?;
            sys::cublasSetWorkspace_v2(
                this.handle,
                this._workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
            )
            .result()
            .map_err(|e| blas_err("cublasSetWorkspace", e))?;
        }
        Ok(Some(this))
    }

    /// Queues out[rows, n] (f32) = x[rows, k] · wᵀ, x bf16 [rows, k] and w bf16 [n, k], both
    /// row-major, f32 accumulation. The caller checked every extent.
    pub(crate) fn gemm_bf16(
        &self,
        x: u64,
        rows: usize,
        w: u64,
        n: usize,
        k: usize,
        out: u64,
    ) -> Result<()> {
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| BackendError::BadArgument {
                op: "matmul",
                detail: format!("extent {v} beyond cuBLAS's 32-bit sizes"),
            })
        };
        let (m, nn, kk) = (dim(n)?, dim(rows)?, dim(k)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view: outᵀ [n, rows] = (w as [k, n])ᵀ · (x as [k, rows]).
        // SAFETY: the pointers are live device allocations holding the extents checked by
        // the caller; alpha and beta are host scalars read before the call returns.
        #[allow(unsafe_code)]
        unsafe {
            blas::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                nn,
                kk,
                (&alpha as *const f32).cast(),
                w as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                kk,
                x as *const c_void,
                sys::cudaDataType::CUDA_R_16BF,
                kk,
                (&beta as *const f32).cast(),
                out as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                m,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas_err("cublasGemmEx", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `open`, destroyed once here.
        #[allow(unsafe_code)]
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}
