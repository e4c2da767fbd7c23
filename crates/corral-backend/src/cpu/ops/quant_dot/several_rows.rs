//! Q4_K products against several activation rows at once, on AVX2: each super-block's
//! nibbles and scales are unpacked once for all of them, where a row at a time unpacks them
//! again for every activation row.

use std::arch::x86_64::*;

use super::{
    ActRow, ActRows, PREFETCH_AHEAD, QA, QK, QuantFormat, SUB_BLOCK_SLOT, half_at, hsums,
    k_scales_mins, load8i16, min_sums, prefetch,
};

/// Weight rows a call. One thread, 256 rows of 512 values in cache, four activation rows:
/// 20.2 GB/s of weight rows (bytes times activation rows) with four weight rows a call, 15.0
/// with two, 9.4 with one, against 14.0 for the kernel of a row at a time.
const WEIGHTS: usize = 4;
/// Activation rows a call. As for [`WEIGHTS`], two, three, four, five, seven and ten rows took
/// 17.3, 16.0, 21.1, 18.8, 17.6 and 18.6 GB/s, against 13.7 to 14.4 a row at a time.
const ACTS: usize = 4;

/// [`super::dot_rows`] for Q4_K and `m` ≥ 2 activation rows: [`WEIGHTS`] weight rows by
/// [`ACTS`] activation rows a call, then what is left over.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4k_rows(w: &[u8], n: usize, acts: ActRows<'_>, m: usize, out: &mut [f32]) {
    let row_bytes = w.len() / n.max(1);
    for at in (0..PREFETCH_AHEAD.min(w.len())).step_by(64) {
        prefetch(w, at);
    }
    let groups = n / WEIGHTS;
    for g in 0..groups {
        let j = WEIGHTS * g;
        for at in (j * row_bytes..(j + WEIGHTS) * row_bytes).step_by(64) {
            prefetch(w, at + PREFETCH_AHEAD);
        }
        let mut rows: [&[u8]; WEIGHTS] = [&[]; WEIGHTS];
        for (i, r) in rows.iter_mut().enumerate() {
            *r = &w[(j + i) * row_bytes..(j + i + 1) * row_bytes];
        }
        by_acts::<WEIGHTS>(rows, j, n, acts, m, out);
    }
    for j in WEIGHTS * groups..n {
        by_acts::<1>([&w[j * row_bytes..(j + 1) * row_bytes]], j, n, acts, m, out);
    }
}

/// The products of the weight rows `w` (rows `j..` of `n`) with the `m` activation rows,
/// [`ACTS`] of them a call, into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn by_acts<const W: usize>(
    w: [&[u8]; W],
    j: usize,
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: &mut [f32],
) {
    let mut r = 0;
    while m - r >= ACTS {
        put(out, (r, j, n), &q4k::<W, ACTS>(w, rows_at(&acts, r)));
        r += ACTS;
    }
    match m - r {
        // Three rows as four, the last twice: a kernel of three measured slower than one
        // of four.
        3 => {
            let rows = [
                acts.row(r),
                acts.row(r + 1),
                acts.row(r + 2),
                acts.row(r + 2),
            ];
            put(out, (r, j, n), &first_of::<W, 3>(q4k::<W, ACTS>(w, rows)));
        }
        2 => put(out, (r, j, n), &q4k::<W, 2>(w, rows_at(&acts, r))),
        1 => put(out, (r, j, n), &q4k::<W, 1>(w, rows_at(&acts, r))),
        _ => {}
    }
}

/// The first `A` values of each of `v`'s rows.
#[inline(always)]
fn first_of<const W: usize, const A: usize>(v: [[f32; ACTS]; W]) -> [[f32; A]; W] {
    std::array::from_fn(|i| std::array::from_fn(|t| v[i][t]))
}

/// Activation rows `r..r + A`.
#[inline(always)]
fn rows_at<'a, const A: usize>(acts: &'a ActRows<'_>, r: usize) -> [ActRow<'a>; A] {
    std::array::from_fn(|t| acts.row(r + t))
}

/// `v[i][t]` to `out[(r + t) n + j + i]`, where `(r, j, n)` is `at`.
#[inline(always)]
fn put<const W: usize, const A: usize>(
    out: &mut [f32],
    (r, j, n): (usize, usize, usize),
    v: &[[f32; A]; W],
) {
    for (i, vi) in v.iter().enumerate() {
        for (t, &x) in vi.iter().enumerate() {
            out[(r + t) * n + j + i] = x;
        }
    }
}

/// Thirty-two bytes from `p`.
#[target_feature(enable = "avx2")]
#[inline]
fn load32(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: 32 bytes are in bounds (checked above); unaligned load.
    #[allow(unsafe_code)]
    unsafe {
        _mm256_loadu_si256(p.as_ptr().cast())
    }
}

/// For each sub-block `j`, the shuffle that spreads scale byte `j` over sixteen i16 lanes
/// (high bytes zero).
const SCALE_SPREAD: [[u8; 32]; 8] = {
    let mut idx = [[0x80u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        let mut b = 0;
        while b < 32 {
            idx[j][b] = j as u8;
            b += 2;
        }
        j += 1;
    }
    idx
};

/// The products of `W` Q4_K weight rows with `A` activation rows quantized per super-block:
/// per sub-block, the weights' nibbles and scale are unpacked once, then multiplied with
/// each activation row as [`super::avx2`]'s Q4_K kernel does.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4k<const W: usize, const A: usize>(w: [&[u8]; W], a: [ActRow<'_>; A]) -> [[f32; A]; W] {
    let bytes = QuantFormat::Q4K.block().1;
    let blocks = w[0].len() / bytes;
    for wi in &w {
        assert!(wi.len() == blocks * bytes, "Q4_K rows of different lengths");
    }
    for at in &a {
        assert!(
            at.holds_super_blocks(blocks),
            "Q4_K products need activations per super-block"
        );
    }
    let m4 = _mm256_set1_epi8(15);
    let mut acc = [[_mm256_setzero_ps(); A]; W];
    let mut macc = [[_mm_setzero_ps(); A]; W];
    for n in 0..blocks {
        let mut xs: [&[u8]; A] = [&[]; A];
        for t in 0..A {
            xs[t] = bytemuck::cast_slice(&a[t].sq[QK * n..QK * (n + 1)]);
        }
        for i in 0..W {
            let blk = &w[i][bytes * n..bytes * (n + 1)];
            let (d, dmin) = (half_at(blk, 0), half_at(blk, 2));
            let (sc, mn) = k_scales_mins(&blk[4..16]);
            let scv = _mm256_set1_epi64x(sc as i64);
            let mut iacc = [_mm256_setzero_si256(); A];
            for h in 0..4 {
                let raw = load32(&blk[16 + 32 * h..]);
                let lo = _mm256_and_si256(raw, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                for (j, u) in [(2 * h, lo), (2 * h + 1, hi)] {
                    let scale = _mm256_shuffle_epi8(scv, load32(&SCALE_SPREAD[j]));
                    for t in 0..A {
                        let x = load32(&xs[t][QA * SUB_BLOCK_SLOT[j]..]);
                        let pairs = _mm256_maddubs_epi16(u, x);
                        iacc[t] = _mm256_add_epi32(iacc[t], _mm256_madd_epi16(pairs, scale));
                    }
                }
            }
            for t in 0..A {
                let dx = a[t].sd[n];
                let scale = _mm256_set1_ps(d * dx);
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t]), scale, acc[i][t]);
                let sums = load8i16(&a[t].ss[8 * n..]);
                macc[i][t] = min_sums(mn, sums, dmin * dx, macc[i][t]);
            }
        }
    }
    let mut out = [[0.0; A]; W];
    for i in 0..W {
        let mut v = [_mm256_setzero_ps(); A];
        for t in 0..A {
            v[t] = _mm256_sub_ps(acc[i][t], _mm256_zextps128_ps256(macc[i][t]));
        }
        out[i] = hsums(v);
    }
    out
}
