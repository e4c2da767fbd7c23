//! Dense matmul `out[m, n] = x[m, k] · w[n, k]ᵀ` with weights in f32, bf16 or f16.
//!
//! Work items are (row block, weight panel) pairs. A panel of weight rows is converted to f32
//! in thread-local scratch, then multiplied with the GEMM crate when there are enough rows, or
//! with plain dot products for the few-row (decode) case, where the kernel is bandwidth-bound.

use rayon::prelude::*;

use super::{WeightRows, dot, with_scratch};

/// Rows of `x` from which the GEMM crate beats dot products.
const GEMM_MIN_ROWS: usize = 8;
/// Rows of `x` per work item.
const ROW_BLOCK: usize = 128;

/// Raw output pointer shared by work items that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: work items write disjoint (row, column) ranges of the output, which outlives them.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer; a method so closures capture the `Send` wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

pub(crate) fn matmul(
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    n: usize,
    out: &mut [f32],
    threads: usize,
) {
    debug_assert!(x.len() >= m * k && out.len() >= m * n);
    let row_blocks = m.div_ceil(ROW_BLOCK).max(1);
    // Enough panels to keep every thread busy, each at least 8 and at most 256 rows.
    let panel = (n * row_blocks / (threads * 4).max(1))
        .clamp(8, 256)
        .min(n.max(1));
    let panels = n.div_ceil(panel);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..row_blocks * panels).into_par_iter().for_each(|item| {
        let (rb, p) = (item / panels, item % panels);
        let (r0, r1) = (rb * ROW_BLOCK, ((rb + 1) * ROW_BLOCK).min(m));
        let (n0, n1) = (p * panel, ((p + 1) * panel).min(n));
        let nb = n1 - n0;
        let run = |panel_w: &[f32]| {
            if r1 - r0 >= GEMM_MIN_ROWS {
                // SAFETY: dst addresses rows r0..r1, columns n0..n1 of `out` (row stride n),
                // which only this work item writes; lhs and rhs are in-bounds slices.
                #[allow(unsafe_code)]
                unsafe {
                    gemm::gemm(
                        r1 - r0,
                        nb,
                        k,
                        out_ptr.get().add(r0 * n + n0),
                        1,
                        n as isize,
                        false,
                        x.as_ptr().add(r0 * k),
                        1,
                        k as isize,
                        panel_w.as_ptr(),
                        k as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            } else {
                for r in r0..r1 {
                    let xr = &x[r * k..(r + 1) * k];
                    for j in 0..nb {
                        let v = dot(xr, &panel_w[j * k..(j + 1) * k]);
                        // SAFETY: (r, n0 + j) lies in this work item's disjoint output range.
                        #[allow(unsafe_code)]
                        unsafe {
                            *out_ptr.get().add(r * n + n0 + j) = v;
                        }
                    }
                }
            }
        };
        match w {
            WeightRows::F32(w) => run(&w[n0 * k..n1 * k]),
            _ => with_scratch(nb * k, |buf| {
                w.to_f32(n0 * k, buf);
                run(buf)
            }),
        }
    });
}
