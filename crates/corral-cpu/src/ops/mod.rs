//! CPU kernels, one file per op. Each works on plain slices that the backend has already
//! checked against the op's shape, and runs as one rayon parallel region.

pub(crate) mod attention;
mod attention_bf16;
pub(crate) mod delta_net;
pub(crate) mod elementwise;
pub(crate) mod matmul;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod quant_dot;
pub(crate) mod quant_panel;
pub(crate) mod rope;

use corral_backend::QuantFormat;

/// A weight matrix's elements in their stored type.
#[derive(Clone, Copy, Debug)]
pub(crate) enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    F16(&'a [half::f16]),
    /// Blocks of a block format; every offset into them falls on a block boundary.
    Quant(QuantFormat, &'a [u8]),
}

impl<'a> WeightRows<'a> {
    /// Elements `start..start + len` converted to f32 into `dst` (of length `len`).
    pub(crate) fn to_f32(self, start: usize, dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let end = start + dst.len();
        match self {
            WeightRows::F32(w) => dst.copy_from_slice(&w[start..end]),
            WeightRows::Bf16(w) => w[start..end].convert_to_f32_slice(dst),
            WeightRows::F16(w) => w[start..end].convert_to_f32_slice(dst),
            WeightRows::Quant(format, w) => {
                let bytes = quant_range(format, start, dst.len());
                corral_backend::quant::dequantize(format, &w[bytes], dst);
            }
        }
    }

    /// Elements `start..start + len`.
    pub(crate) fn slice(self, start: usize, len: usize) -> WeightRows<'a> {
        let end = start + len;
        match self {
            WeightRows::F32(w) => WeightRows::F32(&w[start..end]),
            WeightRows::Bf16(w) => WeightRows::Bf16(&w[start..end]),
            WeightRows::F16(w) => WeightRows::F16(&w[start..end]),
            WeightRows::Quant(format, w) => {
                WeightRows::Quant(format, &w[quant_range(format, start, len)])
            }
        }
    }
}

/// The bytes of values `start..start + len` of `format`, both on block boundaries.
pub(crate) fn quant_range(format: QuantFormat, start: usize, len: usize) -> std::ops::Range<usize> {
    let (values, bytes) = format.block();
    debug_assert!(start.is_multiple_of(values) && len.is_multiple_of(values));
    start / values * bytes..(start + len) / values * bytes
}

/// `Σ a[i]·b[i]` with eight independent accumulators, which the compiler vectorises.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (a8, a_tail) = a.split_at(a.len() / 8 * 8);
    let (b8, b_tail) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

thread_local! {
    /// Per-thread scratch for converted weight rows and attention scores: grown once, reused.
    pub(crate) static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's reused buffer in `key`, or with a fresh one where this thread,
/// waiting inside a parallel region, took up work of another's that holds it already.
pub(crate) fn with_reused<T: Default + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut held) => f(&mut held),
        Err(_) => f(&mut T::default()),
    })
}

/// Aligns the calling function's stack frame to a cache line. LLVM spills 256-bit registers
/// with unaligned moves into a frame aligned to 16 bytes only; in a build where a kernel's
/// frame lands 16 or 48 bytes past a line, every spill in its loops straddles two lines. The
/// AVX2 panel kernel's 300-token Q4_K_M prefill ran at 3,670-3,960 tok/s in such a build
/// against 4,100-4,300 aligned, the same instructions. An over-aligned local makes LLVM
/// realign the frame, and its spills aligned.
#[inline(always)]
pub(crate) fn align_frame() {
    #[repr(align(64))]
    struct Line(#[allow(dead_code)] [u8; 64]);
    // A local, not a promoted constant: it has to live in the frame.
    let line = Line([0; 64]);
    std::hint::black_box(&line);
}

/// Runs `f` with this thread's scratch, at least `len` long.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        if scratch.len() < len {
            scratch.resize(len, 0.0);
        }
        f(&mut scratch[..len])
    })
}
