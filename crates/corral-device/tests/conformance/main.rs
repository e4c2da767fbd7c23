//! The op conformance suite: every op each backend computes, against the plain references
//! of `corral_backend::reference` on random shapes, and its arguments refused alike by every
//! backend. It runs for every backend this machine can open ([`subjects`]): the CPU always,
//! CUDA where a GPU is usable. A new backend gets every test by adding its line there.
//! Where a GPU runs, run it with `--test-threads=1`: the tests share one backend a device,
//! and a fault a test provokes on purpose is reported by the device's next read-back, which
//! must be that test's.

use std::sync::OnceLock;

use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer};
use corral_cpu::CpuBackend;
use corral_cuda::{CudaBackend, CudaOptions, cuda_available};

mod attention;
mod copies;
mod elementwise;
mod matmul;
mod moe;
mod recurrent;

/// A backend under test, and how near the references its results must be (relative to the
/// reference's norm).
pub(crate) struct Subject {
    pub(crate) name: &'static str,
    pub(crate) backend: &'static dyn Backend,
    pub(crate) tol: f64,
}

/// Every backend this machine can open, one line each.
pub(crate) fn subjects() -> Vec<Subject> {
    static CPU: OnceLock<CpuBackend> = OnceLock::new();
    static CUDA: OnceLock<Option<CudaBackend>> = OnceLock::new();
    let mut all = vec![Subject {
        name: "cpu",
        backend: CPU.get_or_init(CpuBackend::new),
        tol: 1e-6,
    }];
    let cuda = CUDA.get_or_init(|| match cuda_available() {
        Ok(_) => Some(CudaBackend::new(CudaOptions::default()).expect("open cuda:0")),
        Err(why) => {
            eprintln!("cuda: not run ({why})");
            None
        }
    });
    all.extend(cuda.as_ref().map(|b| Subject {
        name: "cuda",
        backend: b,
        tol: 1e-5,
    }));
    all
}

/// A deterministic stream of values in [-1, 1) and indices.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// A value below `n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` values in [-1, 1).
    pub(crate) fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / (1u64 << 31) as f32) * 2.0 - 1.0)
            .collect()
    }
}

/// `v` in a buffer of exactly its length (at least one element).
pub(crate) fn f32_buf(b: &dyn Backend, v: &[f32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::F32, v.len().max(1), BufferUsage::Activations)
        .unwrap();
    b.upload_f32(v, &mut buf).unwrap();
    buf
}

/// `v` in a metadata buffer of exactly its length (at least one element).
pub(crate) fn u32_buf(b: &dyn Backend, v: &[u32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::U32, v.len().max(1), BufferUsage::Metadata)
        .unwrap();
    b.upload_u32(v, &mut buf).unwrap();
    buf
}

/// An f32 buffer of `n` NaNs, so that an element an op fails to write shows.
pub(crate) fn out_buf(b: &dyn Backend, n: usize) -> DeviceBuffer {
    f32_buf(b, &vec![f32::NAN; n])
}

/// The first `n` values of `buf`.
pub(crate) fn download(b: &dyn Backend, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    b.download_f32(buf, &mut out).unwrap();
    out
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
