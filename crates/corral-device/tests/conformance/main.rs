//! The op conformance suite: every op each backend computes, against the plain references
//! of `corral_backend::reference` on random shapes, and its arguments refused alike by every
//! backend. It runs for every backend this machine can open ([`subjects`]): the CPU always,
//! CUDA where a GPU is usable, Vulkan where a Vulkan device is (lavapipe in CI). A new
//! backend gets every test by adding its line there.
//! Where a GPU runs, run it with `--test-threads=1`: the tests share one backend a device,
//! and a fault a test provokes on purpose is reported by the device's next read-back, which
//! must be that test's.

use std::sync::OnceLock;

use corral_backend::{Backend, DType};
use corral_cpu::CpuBackend;
use corral_cuda::{CudaBackend, CudaOptions, cuda_available};
use corral_vulkan::{VulkanBackend, VulkanOptions};

#[path = "../common/mod.rs"]
mod common;

pub(crate) use common::{Rng, download, f32_buf, out_buf, u32_buf};
pub(crate) use experts::strategies_agree;

mod attention;
mod buffers;
mod collective;
mod copies;
mod elementwise;
mod experts;
mod matmul;
mod moe;
mod recurrent;
mod sampling;

/// A backend under test, and how near the references its results must be (relative to the
/// reference's norm).
pub(crate) struct Subject {
    pub(crate) name: &'static str,
    pub(crate) backend: &'static dyn Backend,
    pub(crate) tol: f64,
    /// How near the delta rule's outputs must be (relative to each run's norm, or the batch's):
    /// the CUDA backend runs a batch whose longest run has 16 tokens or more chunked on
    /// tensor cores, q̂ and k̂ f16 operands in Q Kᵀ and K Kᵀ and bf16 where they meet the state
    /// and V', T, V, M, V' and the state split bf16 pairs (about 16 significant bits):
    /// measured 2.8e-4 to 5.9e-4 on an H100 and an H200 at every run length up to 3,300
    /// tokens (with every operand bf16, the kernels before, 3.9e-3 to 4.7e-3). Shorter runs
    /// take its f32 recurrence, which the tests hold to 1e-3. The others run the recurrence
    /// in f32, within `tol`.
    pub(crate) recurrence_out_tol: f64,
    /// How near the delta rule's states must be: the chunked form's state update reads k̂ in
    /// bf16 (measured 1.75e-3 to 1.78e-3; every operand bf16, 3.1e-3 to 3.2e-3); the others
    /// within `tol`.
    pub(crate) recurrence_state_tol: f64,
    /// How near RoPE (alone, and in the fused norm/RoPE/store) must be at positions to
    /// 5,000: the CUDA kernels form the angle in f32 with the GPU's powf and sincosf, off by
    /// up to 5,000 * 2^-24 radians, 3e-4, in a head's fastest-turning pairs (measured, as a
    /// share of the norm, up to 4.8e-5 for RoPE and 1.45e-5 for the fused op, at positions to
    /// 2,000, on an H100); the others within `tol`.
    pub(crate) angle_tol: f64,
    /// How near paged attention over a bf16 or fp8 cache must be to the reference over the
    /// values the cache holds (queries rounded to bf16 alike): the CUDA kernels' tensor
    /// cores take the queries rounded again after scaling, and the probabilities in 16
    /// bits, which moves a single decode row over a few dozen keys scaled up to 16 most
    /// (measured 1.24e-2, heads of 256 in a group of 8 over 26 keys, on an H100); the others
    /// within 1e-2.
    pub(crate) kv16_attention_tol: f64,
    /// Whether the subject's tile kernels (Vulkan's, on cooperative matrices) round x and the
    /// weights to f16: its products of more than 8 rows, float weights too, are then within
    /// 1e-2 of the exact ones, and its grouped experts' within 1.5e-2.
    pub(crate) f16_tiles: bool,
}

/// Every backend this machine can open, one line each; a backend's other strategies for
/// the same ops (the CUDA backend's own kernels where it would call cuBLAS or stream
/// weights) are subjects of their own.
pub(crate) fn subjects() -> Vec<Subject> {
    all_subjects(false)
}

/// [`subjects`], and the Vulkan backend copying through staging buffers as on a discrete
/// GPU, wherever it runs: for the tests of copies (every op's test copies its inputs in and
/// its outputs out the same way, so the others leave it out).
pub(crate) fn subjects_and_staged_copies() -> Vec<Subject> {
    all_subjects(true)
}

/// [`subjects`], with the staged Vulkan subject if `with_staged`.
fn all_subjects(with_staged: bool) -> Vec<Subject> {
    static CPU: OnceLock<CpuBackend> = OnceLock::new();
    static CUDA: OnceLock<Option<[CudaBackend; 2]>> = OnceLock::new();
    let mut all = vec![Subject {
        name: "cpu",
        backend: CPU.get_or_init(CpuBackend::new),
        tol: 1e-6,
        recurrence_out_tol: 1e-6,
        recurrence_state_tol: 1e-6,
        angle_tol: 1e-6,
        kv16_attention_tol: 1e-2,
        f16_tiles: false,
    }];
    let cuda = CUDA.get_or_init(|| match cuda_available() {
        Ok(_) => {
            let own_kernels = CudaOptions {
                without_cublas: true,
                serial_launches: true,
                unstreamed_experts: true,
                unstreamed_projections: true,
                ..Default::default()
            };
            let open = |options| CudaBackend::new(options).expect("open cuda:0");
            Some([open(CudaOptions::default()), open(own_kernels)])
        }
        Err(why) => {
            eprintln!("cuda: not run ({why})");
            None
        }
    });
    if let Some([cuda, own_kernels]) = cuda {
        all.push(Subject {
            name: "cuda",
            backend: cuda,
            tol: 1e-5,
            recurrence_out_tol: 1.5e-3,
            recurrence_state_tol: 2.5e-3,
            angle_tol: 2e-4,
            kv16_attention_tol: 2.5e-2,
            f16_tiles: false,
        });
        all.push(Subject {
            name: "cuda, own kernels",
            backend: own_kernels,
            tol: 1e-5,
            recurrence_out_tol: 1.5e-3,
            recurrence_state_tol: 2.5e-3,
            angle_tol: 2e-4,
            kv16_attention_tol: 2.5e-2,
            f16_tiles: false,
        });
    }
    // A pair of Vulkan backends a test thread at a time, so that a fault a test provokes
    // on purpose is reported by that test's own next read-back with the tests running in
    // parallel: a thread leases one from a pool, and its end gives it back (the test
    // harness runs each test on a thread of its own; a driver caps the devices a process
    // opens, so each pair is reused rather than one opened a test). The second copies
    // through staging buffers, as on a discrete GPU, wherever it runs.
    thread_local! {
        static VULKAN: VulkanLease = VulkanLease::take();
    }
    if let Some([vulkan, staged]) = VULKAN.with(|v| v.0) {
        all.push(Subject {
            name: "vulkan",
            backend: vulkan,
            tol: 1e-5,
            recurrence_out_tol: 1e-5,
            recurrence_state_tol: 1e-5,
            angle_tol: 1e-5,
            kv16_attention_tol: 1e-2,
            f16_tiles: vulkan.matrix_tiles().is_some(),
        });
        if with_staged {
            all.push(Subject {
                name: "vulkan, staged copies",
                backend: staged,
                tol: 1e-5,
                recurrence_out_tol: 1e-5,
                recurrence_state_tol: 1e-5,
                angle_tol: 1e-5,
                kv16_attention_tol: 1e-2,
                f16_tiles: staged.matrix_tiles().is_some(),
            });
        }
    }
    all
}

/// Vulkan backend pairs no test thread holds.
static VULKAN_POOL: std::sync::Mutex<Vec<&'static [VulkanBackend; 2]>> =
    std::sync::Mutex::new(Vec::new());

/// A test thread's pair of Vulkan backends (mapped, staged copies), back to the pool when the
/// thread ends; `None` where no Vulkan device opens.
struct VulkanLease(Option<&'static [VulkanBackend; 2]>);

impl VulkanLease {
    fn take() -> Self {
        let pooled = VULKAN_POOL.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(pair) = pooled {
            return Self(Some(pair));
        }
        let open = |force_staging| {
            VulkanBackend::new(VulkanOptions {
                force_staging,
                ..Default::default()
            })
        };
        match open(false).and_then(|mapped| Ok([mapped, open(true)?])) {
            Ok(pair) => Self(Some(Box::leak(Box::new(pair)))),
            Err(why) if std::env::var("CORRAL_REQUIRE_VULKAN").is_ok_and(|v| v == "1") => {
                panic!("Vulkan is required here: {why}")
            }
            Err(why) => {
                eprintln!("vulkan: not run ({why})");
                Self(None)
            }
        }
    }
}

impl Drop for VulkanLease {
    fn drop(&mut self) {
        if let Some(pair) = self.0.take() {
            // A read-back reports and clears a fault the last test left (one that panicked
            // before its own read-back), so that the next lease starts clean.
            for b in pair {
                let b: &dyn Backend = b;
                let one = b.take_buffer(DType::U32, 1, corral_backend::BufferUsage::Metadata);
                if let Ok(one) = one {
                    let _ = b.download_u32(&one, &mut [0]);
                    b.give_buffer(one);
                }
            }
            VULKAN_POOL
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(pair);
        }
    }
}

/// `v` as weights of `dtype` hold it.
pub(crate) fn stored(dtype: DType, v: &[f32]) -> Vec<f32> {
    match dtype {
        DType::BF16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

/// Asserts `got` is within the subject's tolerance of `want`, relative to `want`'s norm.
pub(crate) fn assert_near(s: &Subject, what: &str, got: &[f32], want: &[f32]) {
    assert_within(s, what, got, want, s.tol);
}

/// As [`assert_near`], within `tol` (or the subject's own, if larger): for ops whose
/// backends round to 16 bits by design.
pub(crate) fn assert_within(s: &Subject, what: &str, got: &[f32], want: &[f32], tol: f64) {
    let tol = tol.max(s.tol);
    assert_eq!(got.len(), want.len(), "{}: {what}: lengths", s.name);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{}: {what}: a value not finite (or not written)",
        s.name
    );
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let n: f64 = want.iter().map(|y| (*y as f64).powi(2)).sum();
    let err = (d / n.max(1e-30)).sqrt();
    assert!(
        err <= tol,
        "{}: {what}: relative error {err:e} > {tol:e}",
        s.name
    );
}

/// Asserts an op refused its arguments with an error naming `op`, or, where the backend finds
/// the fault on the device (an index out of range), that the next read-back reports it (a
/// GPU's error flag, which that read-back also clears).
pub(crate) fn assert_refused(s: &Subject, op: &str, result: corral_backend::Result<()>) {
    match result {
        Err(e) => assert!(e.to_string().contains(op), "{}: {op}: {e}", s.name),
        Ok(()) => {
            let probe = f32_buf(s.backend, &[0.0]);
            let mut back = [0.0];
            assert!(
                s.backend.download_f32(&probe, &mut back).is_err(),
                "{}: {op}: accepted",
                s.name
            );
        }
    }
}
