//! Kernel sources and their compilation: NVRTC turns each CUDA C file into a CUBIN for the
//! device's architecture during start-up warm-up, and the CUBIN is cached on disk under a key
//! of source hash, architecture and NVRTC version, so that a second start compiles nothing.

use std::ffi::{CString, c_char, c_int};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nvrtc;

use corral_backend::{BackendError, Result};

/// One kernel file and the headers it is compiled with (in order, before it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelSource {
    /// File name, for logs and cache keys.
    pub(crate) name: &'static str,
    /// Headers placed before the body.
    pub(crate) headers: &'static [&'static str],
    /// The file itself.
    pub(crate) body: &'static str,
}

impl KernelSource {
    /// The whole translation unit.
    pub(crate) fn text(&self) -> String {
        let mut text = String::new();
        for h in self.headers {
            text.push_str(h);
            text.push('\n');
        }
        text.push_str(self.body);
        text
    }
}

const COMMON: &str = include_str!("ops/common.cuh");
const MMA_TILE: &str = include_str!("ops/mma_tile.cuh");
const MMA_VEC: &str = include_str!("ops/mma_vec.cuh");
const MMA_BIG_TILE: &str = include_str!("ops/mma_big_tile.cuh");
const BULK_COPY: &str = include_str!("ops/bulk_copy.cuh");
const STREAMED_MVM: &str = include_str!("ops/streamed_mvm.cuh");

/// Every kernel file, one per op family.
pub(crate) const SOURCES: [KernelSource; 9] = [
    KernelSource {
        name: "elementwise.cu",
        headers: &[COMMON],
        body: include_str!("ops/elementwise.cu"),
    },
    KernelSource {
        name: "norms.cu",
        headers: &[COMMON],
        body: include_str!("ops/norms.cu"),
    },
    KernelSource {
        name: "attention.cu",
        headers: &[COMMON, MMA_TILE],
        body: include_str!("ops/attention.cu"),
    },
    KernelSource {
        name: "flash_attention.cu",
        headers: &[COMMON, MMA_TILE],
        body: include_str!("ops/flash_attention.cu"),
    },
    KernelSource {
        name: "matmul.cu",
        headers: &[COMMON, MMA_TILE, MMA_VEC, BULK_COPY, STREAMED_MVM],
        body: include_str!("ops/matmul.cu"),
    },
    KernelSource {
        name: "moe.cu",
        headers: &[
            COMMON,
            MMA_TILE,
            MMA_VEC,
            MMA_BIG_TILE,
            BULK_COPY,
            STREAMED_MVM,
        ],
        body: include_str!("ops/moe.cu"),
    },
    KernelSource {
        name: "delta_net.cu",
        headers: &[COMMON, MMA_TILE],
        body: include_str!("ops/delta_net.cu"),
    },
    KernelSource {
        name: "sampling.cu",
        headers: &[COMMON],
        body: include_str!("ops/sampling.cu"),
    },
    KernelSource {
        name: "quant.cu",
        headers: &[COMMON, MMA_TILE, MMA_VEC],
        body: include_str!("ops/quant.cu"),
    },
];

fn nvrtc_err(what: &str, detail: impl Into<String>) -> BackendError {
    BackendError::Device {
        what: format!("NVRTC: {what}"),
        detail: detail.into(),
    }
}

/// Whether libnvrtc can be opened (cudarc panics on calls into a missing library).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    #[allow(unsafe_code)]
    unsafe {
        nvrtc::is_culib_present()
    }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(nvrtc_err(
            "library",
            "libnvrtc.so (CUDA 13 or 12) could not be opened; install the CUDA runtime \
             compiler or put its folder on LD_LIBRARY_PATH",
        ))
    }
}

/// NVRTC's version.
pub(crate) fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters, library present.
    #[allow(unsafe_code)]
    let status = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("version", format!("{status:?}")));
    }
    Ok((major, minor))
}

/// Compiles `source` to machine code for `arch` (`sm_90`).
pub(crate) fn compile(source: &KernelSource, arch: &str) -> Result<Vec<u8>> {
    require_nvrtc()?;
    let name = source.name;
    let bad = |what: &str, e: String| nvrtc_err(&format!("{what} {name}"), e);
    let text = CString::new(source.text()).map_err(|e| bad("source", e.to_string()))?;
    let cname = CString::new(name).map_err(|e| bad("name", e.to_string()))?;
    let options: Vec<CString> = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ]
    .into_iter()
    .map(|o| CString::new(o).map_err(|e| bad("option", e.to_string())))
    .collect::<Result<_>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: every pointer passed lives until the program is destroyed below, and each
    // NVRTC call gets the program it created.
    #[allow(unsafe_code)]
    unsafe {
        let mut program: nvrtc::nvrtcProgram = std::ptr::null_mut();
        let status = nvrtc::nvrtcCreateProgram(
            &mut program,
            text.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(bad("creating", format!("{status:?}")));
        }
        let status =
            nvrtc::nvrtcCompileProgram(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let mut log_len = 0usize;
        nvrtc::nvrtcGetProgramLogSize(program, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        nvrtc::nvrtcGetProgramLog(program, log.as_mut_ptr().cast::<c_char>());
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim()
            .to_string();
        let result = if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            Err(bad("compiling", format!("{status:?}\n{log}")))
        } else {
            let mut size = 0usize;
            let size_status = nvrtc::nvrtcGetCUBINSize(program, &mut size);
            if size_status != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(bad("reading the output of", format!("{size_status:?}")))
            } else {
                let mut image = vec![0u8; size];
                let status = nvrtc::nvrtcGetCUBIN(program, image.as_mut_ptr().cast::<c_char>());
                if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
                    Err(bad("reading the output of", format!("{status:?}")))
                } else {
                    Ok(image)
                }
            }
        };
        nvrtc::nvrtcDestroyProgram(&mut program);
        result
    }
}

/// FNV-1a over every kernel file with its headers: what the kernels are.
pub(crate) fn sources_id() -> u64 {
    SOURCES.iter().fold(0, |h, s| {
        h ^ corral_backend::fnv1a(s.text().as_bytes()).rotate_left(7)
    })
}

/// The on-disk cache of compiled kernels.
#[derive(Debug, Clone)]
pub(crate) struct KernelCache {
    dir: Option<PathBuf>,
}

impl KernelCache {
    /// `dir`, or `$CORRAL_KERNEL_CACHE`, `$XDG_CACHE_HOME/corral/kernels`,
    /// `$HOME/.cache/corral/kernels`; none when nothing is set (compile every start).
    pub(crate) fn new(dir: Option<PathBuf>) -> Self {
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = dir
            .or_else(|| env("CORRAL_KERNEL_CACHE"))
            .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("corral/kernels")))
            .or_else(|| env("HOME").map(|d| d.join(".cache/corral/kernels")));
        Self { dir }
    }

    /// The cache's folder, if any.
    pub(crate) fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn path(&self, source: &KernelSource, arch: &str, nvrtc: (i32, i32)) -> Option<PathBuf> {
        let key = corral_backend::fnv1a(source.text().as_bytes());
        let stem = source.name.trim_end_matches(".cu");
        self.dir.as_ref().map(|d| {
            d.join(format!(
                "{stem}-{key:016x}-{arch}-nvrtc{}.{}.cubin",
                nvrtc.0, nvrtc.1
            ))
        })
    }

    /// The CUBIN of `source` for `arch`, from the cache or freshly compiled (and then
    /// stored). The flag says whether it was compiled.
    pub(crate) fn load_or_compile(
        &self,
        source: &KernelSource,
        arch: &str,
    ) -> Result<(Vec<u8>, bool)> {
        let nvrtc = nvrtc_version()?;
        let path = self.path(source, arch, nvrtc);
        if let Some(image) = path.as_ref().and_then(|p| std::fs::read(p).ok())
            && image.starts_with(b"\x7fELF")
        {
            return Ok((image, false));
        }
        let image = compile(source, arch)?;
        if let Some(path) = path {
            // A cache that cannot be written costs a compile next start, nothing more.
            let _ = store_atomically(&path, &image);
        }
        Ok((image, true))
    }
}

fn store_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel file compiles for the H100/H200's architecture wherever NVRTC can be
    /// opened (it needs no GPU), so a kernel's syntax and register errors show before a GPU
    /// run; without NVRTC the test says it skipped.
    #[test]
    fn every_kernel_compiles_where_nvrtc_is_present() {
        if !nvrtc_present() {
            eprintln!("skipped: libnvrtc could not be opened (LD_LIBRARY_PATH)");
            return;
        }
        let failures: Vec<String> = SOURCES
            .iter()
            .filter_map(|s| compile(s, "sm_90").err().map(|e| e.to_string()))
            .collect();
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }
}
