//! Dense matmul `out[m, n] = x[m, k] · w[n, k]ᵀ` with weights in f32, bf16 or f16.
//!
//! Work items are (row block, weight panel) pairs. A panel of weight rows is converted to f32
//! in thread-local scratch when there are enough rows, then multiplied by tiles of four
//! activation rows and four weight rows ([`tiles`], AVX-512) or the GEMM crate; few rows
//! (decode) stream weight rows through dot products, where the kernel is bandwidth-bound.
//! bf16 weights on AVX-512 are read in place by tiles at any row count above one.
//! [`multiply_tile`] is shared with the grouped MoE kernels.

use rayon::prelude::*;

use super::quant_dot::{self, ActRows, QuantizedRows};
use super::quant_panel;
use super::{WeightRows, dot, quant_range, with_reused, with_scratch};
use corral_backend::QuantFormat;

/// Rows of `x` from which converting a weight panel to f32 for [`multiply_tile`] (tiles, or
/// the GEMM crate without AVX-512) beats streaming weight rows through dot products.
pub(crate) const GEMM_MIN_ROWS: usize = 8;
/// As [`GEMM_MIN_ROWS`] for weights with integer dot products, whose panels cost more to
/// decode than bf16's to widen.
const QUANT_GEMM_MIN_ROWS: usize = 16;
/// As [`QUANT_GEMM_MIN_ROWS`] for Q8_0 where panels go through [`tiles`]: its blocks decode
/// cheaply. 64 experts, 2 threads, alternated, 10 / 300 tokens: 1,963 / 3,940 tok/s against
/// 1,906 / 3,648 at 16 rows and 1,815 / 3,890 at 4; a Q4_K_M file from 8 rows took 2,521 tok/s against
/// 3,071 at 10 tokens.
const Q8_0_TILE_MIN_ROWS: usize = 8;
/// As [`GEMM_MIN_ROWS`] for weights multiplied as integer panels ([`quant_panel`]). Q4_K_M,
/// 2 threads, alternated, 10 tokens: 3,162 tok/s against 2,884 from 16 rows on the 64-expert
/// shape (551 against 534 on the 1.25B one); 300 tokens alike within noise.
const PANEL_MIN_ROWS: usize = 8;
/// As [`PANEL_MIN_ROWS`] for the panels of 32-value blocks (Q8_0, Q4_0, Q5_0), whose few-row
/// dot products cost about what a panel's do. Q8_0, 1.25B-parameter shape, 2 threads,
/// alternated: from 8 rows, a 10-token prefill took 364 and 323 tok/s against 391 and 390 by
/// dot products; 40 tokens, 409 and 498 from 16 rows against 384 and 455 from 32.
const BLOCK_PANEL_MIN_ROWS: usize = 16;
/// As [`GEMM_MIN_ROWS`] for f16 weights, and bf16 without AVX-512, whose panels are widened
/// to f32 first: with the GEMM crate, a 10-token bf16 prefill, 2 threads, took 1,528 tok/s
/// against 1,399 at 8 rows on the 64-expert shape, 309 against 200 on the 1.25B-parameter
/// one; 300 tokens within 2% (32 rows measured alike).
const HALF_GEMM_MIN_ROWS: usize = 16;

/// Rows of `x` from which products with `w` convert weight panels to f32 for
/// [`multiply_tile`] rather than stream weight rows through dot products (`usize::MAX`:
/// never; bf16 read in place by [`multiply_bf16`]).
pub(crate) fn gemm_min_rows(w: WeightRows<'_>) -> usize {
    match w {
        WeightRows::Quant(format, _) if panels(w) && quant_panel::per_block(format) => {
            BLOCK_PANEL_MIN_ROWS
        }
        _ if panels(w) => PANEL_MIN_ROWS,
        WeightRows::Quant(QuantFormat::Q8_0, _) if tiles_available() => Q8_0_TILE_MIN_ROWS,
        WeightRows::Quant(format, _) if quant_dot::supports(format) => QUANT_GEMM_MIN_ROWS,
        WeightRows::Bf16(_) if simd().is_some() => usize::MAX,
        WeightRows::Bf16(_) | WeightRows::F16(_) => HALF_GEMM_MIN_ROWS,
        _ => GEMM_MIN_ROWS,
    }
}

/// The vector instructions [`tiles`] and single rows' bf16 dot products run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// AVX-512F and BW: 16 lanes.
    Avx512,
    /// AVX2 and FMA: 8 lanes.
    Avx2,
}

/// The widest [`Simd`] this CPU has, if any.
pub(crate) fn simd() -> Option<Simd> {
    #[cfg(target_arch = "x86_64")]
    {
        static SIMD: std::sync::LazyLock<Option<Simd>> = std::sync::LazyLock::new(|| {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") {
                Some(Simd::Avx512)
            } else if has!("avx2") && has!("fma") {
                Some(Simd::Avx2)
            } else {
                None
            }
        });
        *SIMD
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Whether f32 panels of any size run as [`tiles`] (AVX-512) instead of the GEMM crate. At 300
/// tokens, widening bf16 panels and the GEMM crate's packing took a quarter of a bf16
/// prefill; Q4_K_M panels through tiles, 300 tokens, 2 threads: 3,937 against 3,720 tok/s (64
/// experts), 651 against 531 (1.25B). AVX2's tiles lost to the GEMM crate there (Q8_0, 300
/// tokens, 64 experts, alternated: 2,545 / 2,608 against 3,023 / 2,922 tok/s).
fn tiles_available() -> bool {
    simd() == Some(Simd::Avx512)
}

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

/// `out[r * ld + j] = Σ_l x[r * k + l] · w[j * k + l]` for `r < m`, `j < n`: by [`tiles`]
/// on AVX-512 and for fewer than [`GEMM_MIN_ROWS`] rows on AVX2, else by the GEMM crate from
/// [`GEMM_MIN_ROWS`] rows.
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
    if simd().is_some() && (tiles_available() || m < GEMM_MIN_ROWS) {
        return multiply_f32_rows(x, m, k, w, n, out, ld);
    }
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

/// `out[r * ld + j] = x[r] · w[j]` for `r < m`, `j < n` (rows of `k`) by [`tiles`] wherever
/// the CPU has a [`Simd`], else as [`multiply_tile`]: for products that must not allocate
/// (attention's scores).
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
pub(crate) fn multiply_f32_rows(
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
        "multiply_f32_rows: operands shorter than their shapes"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd() {
        let xr = |r: usize| &x[r * k..(r + 1) * k];
        return tiles(simd, m, n, out, ld, xr, |j| &w[j * k..(j + 1) * k], false);
    }
    multiply_tile(x, m, k, w, n, out, ld)
}

/// `out[r * ld + j] = x[r] · w[j]` for `r < m`, `j < n`, weight row `j` the `k` values from
/// `w_offset + j * k`: f32 weights read in place and f16 or bf16 ones widened into `buf`
/// (`n * k` long) for [`multiply_f32_rows`] (no allocation); block formats decoded into `buf`
/// for [`multiply_tile`].
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn multiply_widened(
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    w_offset: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
    buf: &mut [f32],
) {
    match w {
        WeightRows::F32(w) => {
            multiply_f32_rows(x, m, k, &w[w_offset..w_offset + n * k], n, out, ld)
        }
        WeightRows::Quant(..) => {
            w.to_f32(w_offset, &mut buf[..n * k]);
            multiply_tile(x, m, k, buf, n, out, ld)
        }
        _ => {
            w.to_f32(w_offset, &mut buf[..n * k]);
            multiply_f32_rows(x, m, k, buf, n, out, ld)
        }
    }
}

/// `out[r * ld + j] = x[r] · w[j]` for `r < m`, `j < n`, where weight row `j` starts at
/// element `w_offset + j * k` of `w`: each weight row is converted into `row` (length `k`)
/// once and used by all `m` rows while it is in L1. The few-row (decode) path, every product
/// over bf16 weights read in place ([`multiply_bf16`]), and every one over weights with
/// integer panels ([`multiply_quantized`]).
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
    if let WeightRows::Quant(format, _) = w
        && quant_dot::supports(format)
    {
        let per = quant_dot::ActBlocks::of([format]);
        return with_quantized(x, m, k, per, |acts| {
            multiply_quantized(acts.rows_from(0), m, k, w, w_offset, n, out, ld, row)
        });
    }
    if let Some(bits) = bf16_in_place(w) {
        return with_bf16_lane_order(x, m, k, |xp| {
            multiply_bf16(xp, m, k, bits, w_offset, n, out, ld)
        });
    }
    #[cfg(target_arch = "x86_64")]
    if let WeightRows::F32(f32s) = w
        && std::arch::is_x86_feature_detected!("avx512f")
    {
        let span = |j: usize| w_offset + j * k..w_offset + (j + 1) * k;
        // SAFETY: the CPU has AVX-512F (checked above).
        #[allow(unsafe_code)]
        return each_output(m, n, out, ld, |r, j| unsafe {
            dot_f32_avx512(&x[r * k..(r + 1) * k], &f32s[span(j)])
        });
    }
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

/// [`multiply_streaming`] for activations already quantized (`acts`, `m` rows of `k`) and
/// block weights with integer dot products ([`quant_dot::supports`]; others are skipped):
/// from [`gemm_min_rows`] rows integer panels ([`quant_panel`]) where the weights have them,
/// else tiles of weight rows, their products for all `m` rows gathered in `row`.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn multiply_quantized(
    acts: ActRows<'_>,
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    w_offset: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
    row: &mut [f32],
) {
    let WeightRows::Quant(format, bytes) = w else {
        return;
    };
    let panel = m >= gemm_min_rows(w) && panels(w);
    let w = &bytes[quant_range(format, w_offset, n * k)];
    if panel {
        return quant_panel::multiply(format, w, n, acts, m, out, ld);
    }
    let isa = quant_dot::best_isa();
    let tile = (row.len() / m.max(1)).clamp(1, n.max(1));
    let row_bytes = format.bytes_of(k);
    for j0 in (0..n).step_by(tile) {
        let nt = tile.min(n - j0);
        let tile_w = &w[j0 * row_bytes..(j0 + nt) * row_bytes];
        quant_dot::dot_rows(isa, format, tile_w, nt, acts, m, row);
        each_output(m, nt, out.offset(j0), ld, |r, j| row[r * nt + j]);
    }
}

/// Whether products with `w` run as integer panels from [`gemm_min_rows`] rows.
pub(crate) fn panels(w: WeightRows<'_>) -> bool {
    matches!(w, WeightRows::Quant(format, _) if quant_panel::available(format))
}

/// `out[r * ld + j] = value(r, j)` for `r < m`, `j < n`, a weight row at a time.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
fn each_output(m: usize, n: usize, out: OutPtr, ld: usize, value: impl Fn(usize, usize) -> f32) {
    for j in 0..n {
        for r in 0..m {
            let v = value(r, j);
            // SAFETY: (r, j) is in the caller's disjoint, in-bounds window.
            #[allow(unsafe_code)]
            unsafe {
                *out.0.add(r * ld + j) = v;
            }
        }
    }
}

thread_local! {
    static QUANTIZED: std::cell::RefCell<QuantizedRows> = Default::default();
}

/// Runs `f` with `m` rows of `k` values of `x` quantized for integer dot products (per
/// block or super-block as `per` says), in this thread's reused buffers.
fn with_quantized<R>(
    x: &[f32],
    m: usize,
    k: usize,
    per: quant_dot::ActBlocks,
    f: impl FnOnce(&QuantizedRows) -> R,
) -> R {
    with_reused(&QUANTIZED, |rows| {
        rows.quantize(x, m, k, per);
        f(rows)
    })
}

/// bf16 rows of at least this many bytes are read two at a time as long streams
/// ([`in_stream_pairs`]), shorter ones one at a time. Decode, 2 threads, alternated: on the
/// 1.25B-parameter shape (rows of 2 KiB) 7.5 ms a step against 9.1 one at a time; on the
/// 64-expert shape (1 KiB) 1.56 against 1.40.
#[cfg(target_arch = "x86_64")]
const BF16_STREAM_ROW_BYTES: usize = 2048;

/// `out[r * ld + j]` for weight rows `j` (`at(j)` each) taken two at a time by `two`, row `j`
/// with row `j + n / 2`: two long streams, which share their activation loads (adjacent
/// rows, two short interleaved streams, measured slower); by `one` for a row left over.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn in_stream_pairs<'w, W: 'w>(
    m: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
    at: impl Fn(usize) -> &'w [W],
    two: impl Fn(usize, [&'w [W]; 2]) -> [f32; 2],
    one: impl Fn(usize, [&'w [W]; 1]) -> [f32; 1],
) {
    let write = |r: usize, j: usize, v: f32| {
        // SAFETY: (r, j) is in the caller's disjoint, in-bounds window.
        #[allow(unsafe_code)]
        unsafe {
            *out.0.add(r * ld + j) = v;
        }
    };
    let half = n / 2;
    for j in 0..half {
        let rows = [at(j), at(j + half)];
        for r in 0..m {
            let [v0, v1] = two(r, rows);
            write(r, j, v0);
            write(r, j + half, v1);
        }
    }
    for j in 2 * half..n {
        for r in 0..m {
            write(r, j, one(r, [at(j)])[0]);
        }
    }
}

/// The bits of bf16 weights that products read in place, by [`multiply_bf16`] with the
/// activations in [`to_bf16_lane_order`] (the CPU has a [`Simd`]); `None` for other weights.
pub(crate) fn bf16_in_place(w: WeightRows<'_>) -> Option<&[u16]> {
    match w {
        WeightRows::Bf16(bf16) if simd().is_some() => {
            Some(half::slice::HalfFloatSliceExt::reinterpret_cast(bf16))
        }
        _ => None,
    }
}

/// `row` into `into` in the order bf16 weights are widened into (`TileWeight for u16`): of
/// each 32 values, 0..4, 8..12, 16..20, 24..28, then 4..8, 12..16, 20..24, 28..32 (the rest
/// as they are).
pub(crate) fn to_bf16_lane_order(row: &[f32], into: &mut [f32]) {
    let whole = row.len() / 32 * 32;
    for (chunk, to) in row[..whole].chunks_exact(32).zip(into.chunks_exact_mut(32)) {
        for (i, to) in to.chunks_exact_mut(4).enumerate() {
            let from = 8 * (i % 4) + 4 * (i / 4);
            to.copy_from_slice(&chunk[from..from + 4]);
        }
    }
    into[whole..row.len()].copy_from_slice(&row[whole..]);
}

thread_local! {
    static BF16_LANE_ORDER: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with the `m` rows of `k` values of `x` in [`to_bf16_lane_order`], in this
/// thread's reused buffer (a buffer of its own where this thread, waiting inside a parallel
/// region, holds that one already).
pub(crate) fn with_bf16_lane_order<R>(
    x: &[f32],
    m: usize,
    k: usize,
    f: impl FnOnce(&[f32]) -> R,
) -> R {
    let run = |xp: &mut Vec<f32>| {
        xp.resize(m * k, 0.0);
        for (row, to) in x[..m * k]
            .chunks_exact(k.max(1))
            .zip(xp.chunks_exact_mut(k.max(1)))
        {
            to_bf16_lane_order(row, to);
        }
        f(xp)
    };
    with_reused(&BF16_LANE_ORDER, run)
}

/// `out[r * ld + j] = xp[r] · w[j]` for `r < m`, `j < n`, `xp` in [`to_bf16_lane_order`],
/// weight row `j` the `k` bf16 values (`bits`, from [`bf16_in_place`]) from
/// `w_offset + j * k`: tiles for several rows, single rows' dot products for one.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn multiply_bf16(
    xp: &[f32],
    m: usize,
    k: usize,
    bits: &[u16],
    w_offset: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd() {
        return multiply_bf16_on(simd, xp, m, k, bits, w_offset, n, out, ld);
    }
    let xr = |r: usize| &xp[r * k..(r + 1) * k];
    let at = |j: usize| &bits[w_offset + j * k..w_offset + (j + 1) * k];
    each_output(m, n, out, ld, |r, j| {
        let whole = k / 32 * 32;
        let natural = |p: usize| match p < whole {
            true => p / 32 * 32 + 8 * (p % 32 / 4 % 4) + 4 * (p % 32 / 16) + p % 4,
            false => p,
        };
        let widen = |b: u16| f32::from_bits(u32::from(b) << 16);
        (0..k).map(|p| xr(r)[p] * widen(at(j)[natural(p)])).sum()
    })
}

/// [`multiply_bf16`] on `simd`, which this CPU has.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn multiply_bf16_on(
    simd: Simd,
    xp: &[f32],
    m: usize,
    k: usize,
    bits: &[u16],
    w_offset: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
) {
    let xr = |r: usize| &xp[r * k..(r + 1) * k];
    let at = |j: usize| &bits[w_offset + j * k..w_offset + (j + 1) * k];
    if m > 1 {
        return tiles(simd, m, n, out, ld, xr, at, true);
    }
    match simd {
        Simd::Avx512 => {
            // SAFETY (both): the CPU has AVX-512F and BW (the caller's `simd`).
            #[allow(unsafe_code)]
            let one = |r, rows| unsafe { dot_bf16_avx512::<1>(xr(r), rows) };
            if 2 * k < BF16_STREAM_ROW_BYTES {
                return each_output(m, n, out, ld, |r, j| one(r, [at(j)])[0]);
            }
            #[allow(unsafe_code)]
            let two = |r, rows| unsafe { dot_bf16_avx512::<2>(xr(r), rows) };
            in_stream_pairs(m, n, out, ld, at, two, one)
        }
        Simd::Avx2 => {
            // SAFETY (both): the CPU has AVX2 and FMA (the caller's `simd`).
            #[allow(unsafe_code)]
            let one =
                |r, rows: [&[u16]; 1]| unsafe { avx2::rows::<u16, 1, 1>([xr(r)], rows, 0)[0] };
            if 2 * k < BF16_STREAM_ROW_BYTES {
                return each_output(m, n, out, ld, |r, j| one(r, [at(j)])[0]);
            }
            #[allow(unsafe_code)]
            let two =
                |r, rows: [&[u16]; 2]| unsafe { avx2::rows::<u16, 1, 2>([xr(r)], rows, 0)[0] };
            in_stream_pairs(m, n, out, ld, at, two, one)
        }
    }
}

/// Activation rows of a [`tile`]. Tiles measured at 10 and 300 tokens, 64 experts,
/// 2 threads, in one alternated run: 4 × 4 1,500 / 3,872 tok/s, 8 × 2 1,646 / 3,407, 2 × 8
/// 1,498 / 3,454, 8 × 1 1,586 / 2,256; weights widened by shifts instead of unpacking,
/// 1,425 / 3,233 against 1,630 / 3,800 (bench/results/cpu-tile-kernel-variants-cpu-qwen3-moe.txt).
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 4;
/// Weight rows of a [`tile`].
#[cfg(target_arch = "x86_64")]
const TILE_COLS: usize = 4;

/// Weights a [`tile`] reads: f32, or bf16 (their bits) widened in registers.
#[cfg(target_arch = "x86_64")]
trait TileWeight: Copy {
    /// Thirty-two weights from `at` as f32, in the order the activations of a tile over
    /// these weights are in ([`with_bf16_lane_order`]'s for bf16, as they are for f32).
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512BW; `w` holds `at + 32` weights.
    #[allow(unsafe_code)]
    unsafe fn load32(
        w: &[Self],
        at: usize,
    ) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512);
    /// Sixteen of the thirty-two weights from `at` as f32, half `h` (0 or 1) of them: the
    /// eight that activations `at + 8 h..` multiply, then the eight of `at + 16 + 8 h..`.
    ///
    /// # Safety
    /// The CPU has AVX2; `w` holds `at + 32` weights.
    #[allow(unsafe_code)]
    unsafe fn load16(
        w: &[Self],
        at: usize,
        h: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256);
    /// One weight as f32.
    fn widen(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
impl TileWeight for u16 {
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    #[allow(unsafe_code)]
    unsafe fn load32(
        w: &[u16],
        at: usize,
    ) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees `at + 32` weights.
        #[allow(unsafe_code)]
        let wv = unsafe { _mm512_loadu_si512(w.as_ptr().add(at).cast()) };
        let zero = _mm512_setzero_si512();
        (
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, wv)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, wv)),
        )
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    #[allow(unsafe_code)]
    unsafe fn load16(
        w: &[u16],
        at: usize,
        h: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        // Sixteen bf16 from `at + 16 h`: the low four of each 128-bit lane are values
        // 0..4 and 8..12 of them, which lane order puts at `at + 8 h`; the high four at
        // `at + 16 + 8 h`.
        // SAFETY: the caller guarantees `at + 32` weights.
        #[allow(unsafe_code)]
        let wv = unsafe { _mm256_loadu_si256(w.as_ptr().add(at + 16 * h).cast()) };
        let zero = _mm256_setzero_si256();
        (
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv)),
        )
    }

    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
}

#[cfg(target_arch = "x86_64")]
impl TileWeight for f32 {
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    #[allow(unsafe_code)]
    unsafe fn load32(
        w: &[f32],
        at: usize,
    ) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees `at + 32` weights.
        #[allow(unsafe_code)]
        unsafe {
            (
                _mm512_loadu_ps(w.as_ptr().add(at)),
                _mm512_loadu_ps(w.as_ptr().add(at + 16)),
            )
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    #[allow(unsafe_code)]
    unsafe fn load16(
        w: &[f32],
        at: usize,
        h: usize,
    ) -> (std::arch::x86_64::__m256, std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees `at + 32` weights.
        #[allow(unsafe_code)]
        unsafe {
            (
                _mm256_loadu_ps(w.as_ptr().add(at + 8 * h)),
                _mm256_loadu_ps(w.as_ptr().add(at + 16 + 8 * h)),
            )
        }
    }

    fn widen(self) -> f32 {
        self
    }
}

/// `out[r * ld + j] = xr(r) · at(j)` for `r < m`, `j < n` by [`tile`]s of up to
/// [`TILE_ROWS`] × [`TILE_COLS`], a row of tiles at a time: each weight row loaded (and
/// widened) once for four activation rows, and sixteen sums reduced together. With
/// `prefetch`, weight rows `at(j)` lie one after another in memory and are read from it. On a
/// CPU with `simd`, as the callers check.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn tiles<'x, 'w, W: TileWeight + 'w>(
    simd: Simd,
    m: usize,
    n: usize,
    out: OutPtr,
    ld: usize,
    xr: impl Fn(usize) -> &'x [f32],
    at: impl Fn(usize) -> &'w [W],
    prefetch: bool,
) {
    fn one<'x, 'w, W: TileWeight + 'w, const R: usize, const C: usize>(
        (r0, j0): (usize, usize),
        xr: &impl Fn(usize) -> &'x [f32],
        at: &impl Fn(usize) -> &'w [W],
        (out, ld, ahead, simd): (OutPtr, usize, usize, Simd),
    ) {
        let x = std::array::from_fn(|i| xr(r0 + i));
        let w = std::array::from_fn(|c| at(j0 + c));
        // SAFETY: the caller's `simd` is one this CPU has.
        #[allow(unsafe_code)]
        let sums: [[f32; C]; R] = unsafe {
            match simd {
                Simd::Avx512 => tile(x, w, ahead),
                Simd::Avx2 => avx2::tile(x, w, ahead),
            }
        };
        for (i, row) in sums.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                // SAFETY: (r0 + i, j0 + c) is in the caller's disjoint, in-bounds window.
                #[allow(unsafe_code)]
                unsafe {
                    *out.0.add((r0 + i) * ld + j0 + c) = v;
                }
            }
        }
    }
    debug_assert!(
        self::simd().is_some_and(|have| have == simd || simd == Simd::Avx2),
        "tiles on instructions this CPU lacks"
    );
    const R: usize = TILE_ROWS;
    const C: usize = TILE_COLS;
    let (mr, nc) = (m / R * R, n / C * C);
    // The first pass over the weights reads them from memory: the next tile's rows are
    // fetched while this one's are used (bf16, 64 experts, 2 threads, alternated: 10 tokens
    // 1,816 against 1,563 tok/s, 300 tokens 4,004 against 3,841; the same 2 KiB ahead in
    // single rows' dot products, decode: 1.26 against 1.18 ms a step, not kept).
    let ahead = if prefetch && n > 0 {
        C * at(0).len()
    } else {
        0
    };
    let first = |r0: usize| (out, ld, if r0 == 0 { ahead } else { 0 }, simd);
    for r0 in (0..mr).step_by(R) {
        for j0 in (0..nc).step_by(C) {
            one::<W, R, C>((r0, j0), &xr, &at, first(r0));
        }
        for j in nc..n {
            one::<W, R, 1>((r0, j), &xr, &at, first(r0));
        }
    }
    // The rows left over as one tile of their own height.
    let rest = |j0: usize| match m - mr {
        0 => {}
        1 => one::<W, 1, C>((mr, j0), &xr, &at, first(mr)),
        2 => one::<W, 2, C>((mr, j0), &xr, &at, first(mr)),
        _ => one::<W, 3, C>((mr, j0), &xr, &at, first(mr)),
    };
    const { assert!(R == 4) };
    for j0 in (0..nc).step_by(C) {
        rest(j0);
    }
    for r in mr..m {
        for j in nc..n {
            one::<W, 1, 1>((r, j), &xr, &at, first(r));
        }
    }
}

/// `x[r] · w[c]` for `R` activation rows and `C` weight rows, `R · C` at most 16: each
/// thirty-two weights loaded (and widened) once for all rows, one accumulator per product,
/// the sixteen accumulators summed together by [`lane_sums`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn tile<W: TileWeight, const R: usize, const C: usize>(
    x: [&[f32]; R],
    w: [&[W]; C],
    ahead: usize,
) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    const { assert!(R * C <= 16) };
    let n = w
        .iter()
        .fold(x.iter().fold(usize::MAX, |n, x| n.min(x.len())), |n, w| {
            n.min(w.len())
        });
    let whole = n / 32 * 32;
    let mut acc = [_mm512_setzero_ps(); 16];
    for at in (0..whole).step_by(32) {
        if ahead > 0 {
            for w in w {
                _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(at + ahead).cast());
            }
        }
        // SAFETY: at + 32 <= whole <= every row's length.
        #[allow(unsafe_code)]
        let wide: [(__m512, __m512); C] = std::array::from_fn(|c| unsafe { W::load32(w[c], at) });
        for (r, x) in x.iter().enumerate() {
            // SAFETY: as above.
            #[allow(unsafe_code)]
            let (lo, hi) = unsafe { f32::load32(x, at) };
            for (c, &(wlo, whi)) in wide.iter().enumerate() {
                let a = &mut acc[r * C + c];
                *a = _mm512_fmadd_ps(lo, wlo, *a);
                *a = _mm512_fmadd_ps(hi, whi, *a);
            }
        }
    }
    let sums = lane_sums(&acc);
    std::array::from_fn(|r| {
        std::array::from_fn(|c| {
            let tail = x[r][whole..n].iter().zip(&w[c][whole..n]);
            tail.fold(sums[r * C + c], |s, (a, &b)| s + a * b.widen())
        })
    })
}

/// The sums of the sixteen lanes of each of sixteen vectors, by a tree of shuffles and adds
/// over all of them at once (45 operations) rather than a reduction after each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn lane_sums(v: &[std::arch::x86_64::__m512; 16]) -> [f32; 16] {
    use std::arch::x86_64::*;
    // Halves of each 512 bits: s[i] holds v[2i]'s partial sums in its low 256 bits, v[2i+1]'s
    // in its high.
    let s: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    });
    // u[i]'s 128-bit lane q holds four partial sums of v[4i + q].
    let u: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (s[2 * i], s[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
        )
    });
    // t[i]'s lane q: two partial sums of v[8i + q], then two of v[8i + 4 + q].
    let t: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (u[2 * i], u[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    });
    // Lane q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q].
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(t[0], t[1]),
        _mm512_shuffle_ps::<0b11_01_11_01>(t[0], t[1]),
    );
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds sixteen f32.
    #[allow(unsafe_code)]
    unsafe {
        _mm512_storeu_ps(lanes.as_mut_ptr(), z)
    };
    std::array::from_fn(|i| lanes[4 * (i % 4) + i / 4])
}

/// `x · w` for a row of bf16 weights (their bits), `x` in [`with_bf16_lane_order`]'s order:
/// thirty-two weights a load, widened to f32 exactly (a bf16 is an f32's top half) by
/// interleaving zeros below each 16 bits, in registers rather than in memory first.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn dot_bf16_avx512<const R: usize>(x: &[f32], w: [&[u16]; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let n = w.iter().fold(x.len(), |n, w| n.min(w.len()));
    let whole = n / 64 * 64;
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for i in (0..whole).step_by(64) {
        for c in 0..2 {
            let at = i + 32 * c;
            // SAFETY: at + 32 <= whole <= the length of `x` and of every row; the caller
            // checked AVX-512F and BW.
            #[allow(unsafe_code)]
            let (lo, hi) = unsafe { f32::load32(x, at) };
            for (acc, w) in acc.iter_mut().zip(&w) {
                // SAFETY: as above.
                #[allow(unsafe_code)]
                let (wlo, whi) = unsafe { u16::load32(w, at) };
                acc[2 * c] = _mm512_fmadd_ps(lo, wlo, acc[2 * c]);
                acc[2 * c + 1] = _mm512_fmadd_ps(hi, whi, acc[2 * c + 1]);
            }
        }
    }
    std::array::from_fn(|r| {
        let (acc, w) = (&acc[r], w[r]);
        let pairs = [_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])];
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(pairs[0], pairs[1]));
        // A whole chunk of 32 after the last 64 is in lane order too.
        let chunked = n / 32 * 32;
        for at in (whole..chunked).step_by(32) {
            for i in 0..16 {
                let (lane, e) = (i / 4, i % 4);
                sum += x[at + i] * w[at + 8 * lane + e].widen();
                sum += x[at + 16 + i] * w[at + 8 * lane + 4 + e].widen();
            }
        }
        for (a, &b) in x[chunked..n].iter().zip(&w[chunked..n]) {
            sum += a * b.widen();
        }
        sum
    })
}

/// `x · w` for a row of f32 weights, sixteen lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn dot_f32_avx512(x: &[f32], w: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(w.len());
    let whole = n / 64 * 64;
    let mut acc = [_mm512_setzero_ps(); 4];
    for i in (0..whole).step_by(64) {
        for (c, acc) in acc.iter_mut().enumerate() {
            let at = i + 16 * c;
            // SAFETY: at + 16 <= whole <= the length of `x` and of `w`.
            #[allow(unsafe_code)]
            let (xv, wv) = unsafe {
                (
                    _mm512_loadu_ps(x.as_ptr().add(at)),
                    _mm512_loadu_ps(w.as_ptr().add(at)),
                )
            };
            *acc = _mm512_fmadd_ps(xv, wv, *acc);
        }
    }
    let pairs = [_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])];
    let sum = _mm512_reduce_add_ps(_mm512_add_ps(pairs[0], pairs[1]));
    x[whole..n]
        .iter()
        .zip(&w[whole..n])
        .fold(sum, |s, (a, b)| s + a * b)
}

/// [`tiles`] and single rows' bf16 dot products on AVX2: eight lanes, so a tile runs as
/// pairs of activation rows (sixteen accumulators would not fit in its sixteen registers).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::TileWeight;

    /// `x[r] · w[c]` for `R` activation rows and `C` weight rows, `R · C` at most 16: a pair
    /// of rows at a time by [`rows`], the first pair prefetching `ahead` weights on.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn tile<W: TileWeight, const R: usize, const C: usize>(
        x: [&[f32]; R],
        w: [&[W]; C],
        ahead: usize,
    ) -> [[f32; C]; R] {
        let mut sums = [[0.0f32; C]; R];
        let mut r = 0;
        while r < R {
            let ahead = if r == 0 { ahead } else { 0 };
            if R - r >= 2 {
                let pair = rows::<W, 2, C>([x[r], x[r + 1]], w, ahead);
                sums[r] = pair[0];
                sums[r + 1] = pair[1];
                r += 2;
            } else {
                sums[r] = rows::<W, 1, C>([x[r]], w, ahead)[0];
                r += 1;
            }
        }
        sums
    }

    /// `x[r] · w[c]` for `R` (at most 2) activation rows and `C` (at most 4) weight rows,
    /// thirty-two weights a step, each product over as many accumulators as keep the
    /// multiply-adds from waiting on each other (eight in all, or more for few products).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn rows<W: TileWeight, const R: usize, const C: usize>(
        x: [&[f32]; R],
        w: [&[W]; C],
        ahead: usize,
    ) -> [[f32; C]; R] {
        const { assert!(R <= 2 && C <= 4) };
        let n = w
            .iter()
            .fold(x.iter().fold(usize::MAX, |n, x| n.min(x.len())), |n, w| {
                n.min(w.len())
            });
        let whole = n / 32 * 32;
        // Accumulators per product: 4 for one or two products, 2 for up to four, else 1.
        let split = match R * C {
            1 | 2 => 4,
            3 | 4 => 2,
            _ => 1,
        };
        let mut acc = [[[_mm256_setzero_ps(); 4]; C]; R];
        for at in (0..whole).step_by(32) {
            if ahead > 0 {
                for w in w {
                    _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().wrapping_add(at + ahead).cast());
                }
            }
            for h in 0..2 {
                // SAFETY: at + 32 <= whole <= every row's length; the CPU has AVX2.
                #[allow(unsafe_code)]
                let wide: [(__m256, __m256); C] =
                    std::array::from_fn(|c| unsafe { W::load16(w[c], at, h) });
                for (r, x) in x.iter().enumerate() {
                    // SAFETY: as above.
                    #[allow(unsafe_code)]
                    let (lo, hi) = unsafe { f32::load16(x, at, h) };
                    for (c, &(wlo, whi)) in wide.iter().enumerate() {
                        let a = &mut acc[r][c];
                        a[(2 * h) % split] = _mm256_fmadd_ps(lo, wlo, a[(2 * h) % split]);
                        a[(2 * h + 1) % split] = _mm256_fmadd_ps(hi, whi, a[(2 * h + 1) % split]);
                    }
                }
            }
        }
        std::array::from_fn(|r| {
            std::array::from_fn(|c| {
                let a = acc[r][c];
                let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
                let tail = x[r][whole..n].iter().zip(&w[c][whole..n]);
                tail.fold(hsum(sum), |s, (a, &b)| s + a * b.widen())
            })
        })
    }

    /// The sum of eight lanes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
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

/// Where a product's `n` columns go in rows of its output: from column `first` of rows `ld`
/// wide.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Columns {
    pub(crate) ld: usize,
    pub(crate) first: usize,
}

/// `out[r * ld + first + j] = x[r] · w[j]` for `r < m`, `j < n`: a product into some columns of
/// `out`'s rows (all of them where `first` is 0 and `ld` is `n`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows<'_>,
    n: usize,
    out: &mut [f32],
    columns: Columns,
    threads: usize,
) {
    let Columns { ld, first } = columns;
    assert!(
        x.len() >= m * k && first + n <= ld && out.len() >= m * ld,
        "matmul: operands shorter than their shapes"
    );
    let row_blocks = m.div_ceil(ROW_BLOCK).max(1);
    // Enough panels to keep every thread busy, each at least 8 and at most 256 rows.
    let panel = (n * row_blocks / (threads * 4).max(1))
        .clamp(8, 256)
        .min(n.max(1));
    let panels = n.div_ceil(panel);
    let out_ptr = OutPtr::new(out);
    // `ordered`: bf16 weights read in place, and all of x in their lane order.
    let run = |ordered: Option<(&[f32], &[u16])>| {
        (0..row_blocks * panels).into_par_iter().for_each(|item| {
            let (rb, p) = (item / panels, item % panels);
            let (r0, r1) = (rb * ROW_BLOCK, ((rb + 1) * ROW_BLOCK).min(m));
            let (n0, n1) = (p * panel, ((p + 1) * panel).min(n));
            let tile_out = out_ptr.offset(r0 * ld + first + n0);
            match ordered {
                Some((xp, bits)) => {
                    let xs = &xp[r0 * k..r1 * k];
                    multiply_bf16(xs, r1 - r0, k, bits, n0 * k, n1 - n0, tile_out, ld)
                }
                None => matmul_item(&x[r0 * k..r1 * k], (r1 - r0, k), w, (n0, n1), tile_out, ld),
            }
        })
    };
    match bf16_in_place(w) {
        Some(bits) => with_bf16_lane_order(x, m, k, |xp| run(Some((xp, bits)))),
        None => run(None),
    }
}

/// One work item of [`matmul`]: `rows` rows of `k` values (`xs`) times weight rows `n0..n1`.
fn matmul_item(
    xs: &[f32],
    (rows, k): (usize, usize),
    w: WeightRows<'_>,
    (n0, n1): (usize, usize),
    out: OutPtr,
    ld: usize,
) {
    let nb = n1 - n0;
    // Integer panels take many rows through the few-row path's quantized activations.
    if rows < gemm_min_rows(w) || panels(w) {
        return with_scratch(k, |row| {
            multiply_streaming(xs, rows, k, w, n0 * k, nb, out, ld, row)
        });
    }
    match w {
        WeightRows::F32(_) => multiply_widened(xs, rows, k, w, n0 * k, nb, out, ld, &mut []),
        _ => with_scratch(nb * k, |buf| {
            multiply_widened(xs, rows, k, w, n0 * k, nb, out, ld, buf)
        }),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::ops::quant_dot::tests::{random_blocks, xorshift};

    /// The [`Simd`]s this CPU has: AVX2 as well where it has AVX-512.
    #[cfg(target_arch = "x86_64")]
    fn simds() -> Vec<Simd> {
        match simd() {
            Some(Simd::Avx512) => vec![Simd::Avx512, Simd::Avx2],
            Some(Simd::Avx2) => vec![Simd::Avx2],
            None => Vec::new(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The few-row path over bf16 weights (widened in registers where the CPU has
        /// vector instructions: each of AVX-512 and AVX2 it has), and over the same weights as
        /// f32, and f32 tiles on each, equal dot products with the weights converted to f32
        /// first.
        #[test]
        fn streaming_bf16_rows_match_converted_rows(
            // One row, and tiles of four rows with rows left over.
            m in 1usize..11,
            // Short rows one at a time, rows of 2 KiB and more two at a time.
            k in prop_oneof![1usize..300, 1024usize..1100],
            n in 1usize..9,
            offset in 0usize..40,
            seed in any::<u64>(),
        ) {
            let mut bits = xorshift(seed);
            let mut next = || (bits() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            let xs: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<half::bf16> = (0..offset + n * k).map(|_| half::bf16::from_f32(next())).collect();
            let wide: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let mut outs = Vec::new();
            for (kind, weights) in [("bf16", WeightRows::Bf16(&w)), ("f32", WeightRows::F32(&wide))] {
                let mut out = vec![f32::NAN; m * n];
                let mut row = vec![0.0f32; k];
                multiply_streaming(&xs, m, k, weights, offset, n, OutPtr::new(&mut out), n, &mut row);
                outs.push((kind.to_string(), out));
            }
            #[cfg(target_arch = "x86_64")]
            for simd in simds() {
                let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(&w[..]);
                let mut out = vec![f32::NAN; m * n];
                with_bf16_lane_order(&xs, m, k, |xp| {
                    multiply_bf16_on(simd, xp, m, k, bits, offset, n, OutPtr::new(&mut out), n)
                });
                outs.push((format!("bf16 on {simd:?}"), out));
                let mut out = vec![f32::NAN; m * n];
                let xr = |r: usize| &xs[r * k..(r + 1) * k];
                let at = |j: usize| &wide[offset + j * k..offset + (j + 1) * k];
                tiles(simd, m, n, OutPtr::new(&mut out), n, xr, at, false);
                outs.push((format!("f32 tiles on {simd:?}"), out));
            }
            for (kind, out) in outs {
                for r in 0..m {
                    for j in 0..n {
                        let wj = &wide[offset + j * k..offset + (j + 1) * k];
                        let xr = &xs[r * k..(r + 1) * k];
                        let expected = dot(xr, wj);
                        let scale: f32 = xr.iter().zip(wj).map(|(a, b)| (a * b).abs()).sum();
                        let got = out[r * n + j];
                        prop_assert!((got - expected).abs() <= 1e-5 * (1.0 + scale), "{kind} row {r} col {j}: {got} against {expected}");
                    }
                }
            }
        }

        /// Two products written into their columns of wider rows equal the product of the
        /// stacked weights, on the few-row path and the GEMM's.
        #[test]
        fn products_into_columns_equal_the_stacked_product(
            m in 1usize..24,
            k in 1usize..80,
            n1 in 1usize..30,
            n2 in 1usize..30,
            seed in any::<u64>(),
        ) {
            let mut next = xorshift(seed);
            let mut value = || (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let xs: Vec<f32> = (0..m * k).map(|_| value()).collect();
            let stacked: Vec<f32> = (0..(n1 + n2) * k).map(|_| value()).collect();
            let n = n1 + n2;
            let mut whole = vec![f32::NAN; m * n];
            matmul(&xs, m, k, WeightRows::F32(&stacked), n, &mut whole, Columns { ld: n, first: 0 }, 2);
            let mut parts = vec![f32::NAN; m * n];
            let (w1, w2) = stacked.split_at(n1 * k);
            matmul(&xs, m, k, WeightRows::F32(w1), n1, &mut parts, Columns { ld: n, first: 0 }, 2);
            matmul(&xs, m, k, WeightRows::F32(w2), n2, &mut parts, Columns { ld: n, first: n1 }, 2);
            for (i, (a, b)) in parts.iter().zip(&whole).enumerate() {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "element {i}: {a} against {b}");
            }
        }

        /// Matmuls over block-quantized weights (the few-row path's integer dot products and
        /// the many-row path's decoded panels) equal the decoded weights' matmul, within what
        /// quantizing the activations per 32 values can move each output.
        #[test]
        fn quantized_matmuls_match_the_decoded_weights(
            m in 1usize..20,
            blocks in 1usize..3,
            n in 1usize..40,
            format in prop::sample::select(vec![
                corral_backend::QuantFormat::Q8_0,
                corral_backend::QuantFormat::Q4_0,
                corral_backend::QuantFormat::Q5_0,
                corral_backend::QuantFormat::Q4K,
                corral_backend::QuantFormat::Q6K,
            ]),
            seed in any::<u64>(),
        ) {
            let mut next = xorshift(seed);
            let k = format.block().0 * blocks.max(256 / format.block().0);
            let w = random_blocks(format, n * k / format.block().0, &mut next);
            let xs: Vec<f32> = (0..m * k).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0).collect();
            let mut decoded = vec![0.0f32; n * k];
            corral_backend::quant::dequantize(format, &w, &mut decoded);
            let mut out = vec![f32::NAN; m * n];
            matmul(&xs, m, k, WeightRows::Quant(format, &w), n, &mut out, Columns { ld: n, first: 0 }, 2);
            for r in 0..m {
                let xr = &xs[r * k..(r + 1) * k];
                for j in 0..n {
                    let wj = &decoded[j * k..(j + 1) * k];
                    let expected = dot(xr, wj);
                    let bound: f32 = wj.chunks(32).zip(xr.chunks(32)).map(|(wb, xb)| {
                        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                        amax / 254.0 * wb.iter().map(|v| v.abs()).sum::<f32>()
                    }).sum();
                    let scale: f32 = xr.iter().zip(wj).map(|(a, b)| (a * b).abs()).sum();
                    let got = out[r * n + j];
                    prop_assert!(
                        (got - expected).abs() <= bound * 1.001 + 1e-5 * (1.0 + scale),
                        "{format:?} m {m} row {r} col {j}: {got} against {expected} (bound {bound})"
                    );
                }
            }
        }
    }
}
