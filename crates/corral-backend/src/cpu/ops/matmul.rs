//! Dense matmul `out[m, n] = x[m, k] · w[n, k]ᵀ` with weights in f32, bf16 or f16.
//!
//! Work items are (row block, weight panel) pairs. A panel of weight rows is converted to f32
//! in thread-local scratch, then multiplied with the GEMM crate when there are enough rows, or
//! with plain dot products for the few-row (decode) case, where the kernel is bandwidth-bound.
//! [`multiply_tile`] is shared with the grouped MoE kernels.

use rayon::prelude::*;

use super::{WeightRows, dot, with_scratch};

/// Rows of `x` from which converting a weight panel and calling the GEMM crate beats
/// streaming weight rows through dot products.
pub(crate) const GEMM_MIN_ROWS: usize = 8;
/// Rows of `x` per work item.
const ROW_BLOCK: usize = 128;

/// Raw output pointer shared by work items that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(*mut f32);
// SAFETY: every user hands each work item a disjoint set of output elements, and the output
// outlives the parallel region.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr())
    }
}

/// `out[r * ld + j] = Σ_l x[r * k + l] · w[j * k + l]` for `r < m`, `j < n`.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
pub(crate) fn multiply_tile(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    out: OutPtr,
    ld: usize,
) {
    assert!(
        x.len() >= m * k && w.len() >= n * k,
        "multiply_tile: operands shorter than the tile"
    );
    if m >= GEMM_MIN_ROWS {
        // SAFETY: lhs and rhs are in-bounds slices; dst is the caller's disjoint, in-bounds
        // m × n window with row stride ld.
        #[allow(unsafe_code)]
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.0,
                1,
                ld as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
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
        for r in 0..m {
            let xr = &x[r * k..(r + 1) * k];
            for j in 0..n {
                let v = dot(xr, &w[j * k..(j + 1) * k]);
                // SAFETY: (r, j) is in the caller's disjoint, in-bounds window.
                #[allow(unsafe_code)]
                unsafe {
                    *out.0.add(r * ld + j) = v;
                }
            }
        }
    }
}

/// `out[r * ld + j] = x[r] · w[j]` for `r < m`, `j < n`, where weight row `j` starts at
/// element `w_offset + j * k` of `w`: each weight row is converted into `row` (length `k`)
/// once and used by all `m` rows while it is in L1. The few-row (decode) path.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn multiply_streaming(
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    w_offset: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
    row: &mut [f32],
) {
    for j in 0..n {
        let wj: &[f32] = match w {
            WeightRows::F32(w) => &w[w_offset + j * k..w_offset + (j + 1) * k],
            _ => {
                w.to_f32(w_offset + j * k, row);
                row
            }
        };
        for r in 0..m {
            let v = dot(&x[r * k..(r + 1) * k], wj);
            // SAFETY: (r, j) is in the caller's disjoint, in-bounds window.
            #[allow(unsafe_code)]
            unsafe {
                *out.0.add(r * ld + j) = v;
            }
        }
    }
}

impl OutPtr {
    /// The raw pointer, for a single in-bounds element write.
    pub(crate) fn as_ptr(self) -> *mut f32 {
        self.0
    }

    /// The pointer `offset` elements further on.
    pub(crate) fn offset(self, offset: usize) -> Self {
        // Wrapping arithmetic: computing an address is safe; writes through it are what the
        // callers' disjointness argument covers.
        Self(self.0.wrapping_add(offset))
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
    let out_ptr = OutPtr::new(out);
    (0..row_blocks * panels).into_par_iter().for_each(|item| {
        let (rb, p) = (item / panels, item % panels);
        let (r0, r1) = (rb * ROW_BLOCK, ((rb + 1) * ROW_BLOCK).min(m));
        let (n0, n1) = (p * panel, ((p + 1) * panel).min(n));
        let nb = n1 - n0;
        let tile_out = out_ptr.offset(r0 * n + n0);
        let xs = &x[r0 * k..r1 * k];
        if r1 - r0 < GEMM_MIN_ROWS {
            return with_scratch(k, |row| {
                multiply_streaming(xs, r1 - r0, k, w, n0 * k, nb, tile_out, n, row)
            });
        }
        match w {
            WeightRows::F32(w) => {
                multiply_tile(xs, r1 - r0, k, &w[n0 * k..n1 * k], nb, tile_out, n)
            }
            _ => with_scratch(nb * k, |buf| {
                w.to_f32(n0 * k, buf);
                multiply_tile(xs, r1 - r0, k, buf, nb, tile_out, n)
            }),
        }
    });
}
