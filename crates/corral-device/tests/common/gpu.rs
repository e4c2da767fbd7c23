//! What the CUDA backend's tests take: the device (or a skip without one), the comparisons,
//! and the fp8 and block-format values the tests build.

use std::sync::OnceLock;

use corral_backend::{Backend, QuantFormat, quant, synthetic};
use corral_cuda::{CudaBackend, CudaOptions, cuda_available};

pub(crate) fn gpu() -> Option<&'static dyn Backend> {
    cuda().map(|g| g as &dyn Backend)
}

/// The CUDA backend itself, for what only it offers.
pub(crate) fn cuda() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
    GPU.get_or_init(|| match cuda_available() {
        Err(why) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Ok(_) => Some(CudaBackend::new(CudaOptions::default()).expect("open cuda:0")),
    })
    .as_ref()
}

/// The device, or a skip of the test that asks (it passes) where none is usable.
macro_rules! gpu_or_skip {
    () => {
        gpu_or_skip!(gpu)
    };
    ($open:ident) => {
        match $open() {
            Some(g) => g,
            None => {
                eprintln!("skipped: no CUDA device");
                return;
            }
        }
    };
}

/// ‖a − b‖ / ‖b‖, and NaN anywhere fails.
pub(crate) fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite output");
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

pub(crate) fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], tol: f64) {
    let err = rel(gpu, cpu);
    assert!(err <= tol, "{what}: relative error {err:e} > {tol:e}");
}

/// The e4m3 code nearest `x` (ties to the even code), saturating at ±448: by search over
/// every finite code, independent of the arithmetic the kernels use.
pub(crate) fn e4m3_bits(x: f32) -> u8 {
    let mut best = 0u8;
    for code in 0u8..=0x7e {
        let (d, db) = (
            (e4m3_value(code) - x.abs()).abs(),
            (e4m3_value(best) - x.abs()).abs(),
        );
        if d < db || (d == db && code & 1 == 0 && best & 1 == 1) {
            best = code;
        }
    }
    if x.is_sign_negative() {
        best | 0x80
    } else {
        best
    }
}

/// Synthetic blocks of `len` values (every bit pattern of the quants and sub-block scales
/// occurs) and their values by the CPU's decoder.
pub(crate) fn blocks_and_values(format: QuantFormat, seed: u64, len: usize) -> (Vec<u8>, Vec<f32>) {
    let blocks = synthetic::quant_blocks(format, seed, len, 0.5);
    let mut values = vec![0.0; len];
    quant::dequantize(format, &blocks, &mut values);
    (blocks, values)
}

/// The value of an e4m3 code.
pub(crate) use corral_backend::reference::e4m3_value;
