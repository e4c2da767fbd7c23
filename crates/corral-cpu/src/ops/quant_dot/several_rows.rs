//! Q4_K and Q6_K products against several activation rows at once, on AVX2: each
//! super-block's values and scales are unpacked once for all of them, where a row at a time
//! unpacks them again for every activation row. (Q8_0 has little to unpack: a kernel of its
//! own measured 25.3 / 22.5 / 28.2 / 25.9 GB/s at two, three, four and seven rows against
//! 26.2 / 27.0 / 26.7 / 26.6 a row at a time, and was not kept.)

use std::arch::x86_64::*;

use crate::ops::align_frame;

use super::{
    ActRow, ActRows, PREFETCH_AHEAD, QA, QK, QuantFormat, SCALE_SPREAD, SUB_BLOCK_SLOT, half_at,
    half_sums16, hsums, k_scales_mins, load8f, load8i16, load16, load32, min_sums, prefetch,
    q6k_half, q6k_sub_block_sums, weight_blocks,
};

/// Weight rows a call. One thread, 256 Q4_K rows of 512 values in cache, four activation
/// rows: 20.2 GB/s of weight rows (bytes times activation rows) with four weight rows a call,
/// 15.0 with two, 9.4 with one, against 14.0 for the kernel of a row at a time.
const WEIGHTS: usize = 4;
/// Activation rows a call (the calls below name four). As for [`WEIGHTS`], two, three, four,
/// five, seven and ten rows took 19.3, 16.9, 23.3, 21.1, 18.4 and 21.2 GB/s of Q4_K against
/// 13.4 to 13.8 a row at a time, and 22.1, 21.8, 29.3, 24.5, 25.3 and 27.9 of Q6_K against
/// 14.5 to 14.9.
const ACTS: usize = 4;
const _: () = assert!(ACTS == 4);

/// Activation rows whose [`ActRow`]s a call of [`rows`] sets up at once.
const CHUNK_ROWS: usize = 16;

/// [`super::dot_rows`] for `m` ≥ 2 activation rows of Q4_K (with `Q6`, of Q6_K): [`WEIGHTS`]
/// weight rows by [`ACTS`] activation rows a call, then what is left over.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows<const Q6: bool>(
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: &mut [f32],
) {
    align_frame();
    let row_bytes = w.len() / n.max(1);
    for r0 in (0..m).step_by(CHUNK_ROWS) {
        let mut a = [ActRow::default(); CHUNK_ROWS];
        let chunk = (m - r0).min(CHUNK_ROWS);
        for (t, at) in a[..chunk].iter_mut().enumerate() {
            *at = acts.row(r0 + t);
        }
        let a = &a[..chunk];
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
            by_acts::<Q6, WEIGHTS>(rows, (r0, j, n), a, out);
        }
        for j in WEIGHTS * groups..n {
            let row = [&w[j * row_bytes..(j + 1) * row_bytes]];
            by_acts::<Q6, 1>(row, (r0, j, n), a, out);
        }
    }
}

/// The products of the weight rows `w` (rows `j..` of `n`) with the activation rows `a`
/// (rows `r0..` of the product), [`ACTS`] of them a call, into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn by_acts<const Q6: bool, const W: usize>(
    w: [&[u8]; W],
    (r0, j, n): (usize, usize, usize),
    a: &[ActRow<'_>],
    out: &mut [f32],
) {
    let m = a.len();
    let mut r = 0;
    while m - r >= ACTS {
        let rows = [a[r], a[r + 1], a[r + 2], a[r + 3]];
        put(out, (r0 + r, j, n), &kernel::<Q6, W, ACTS>(w, rows));
        r += ACTS;
    }
    match m - r {
        // Three rows as four, the last twice: a kernel of three measured slower than one of
        // four.
        3 => {
            let rows = [a[r], a[r + 1], a[r + 2], a[r + 2]];
            let v = kernel::<Q6, W, ACTS>(w, rows);
            put(out, (r0 + r, j, n), &first_of::<W, 3>(v));
        }
        2 => put(
            out,
            (r0 + r, j, n),
            &kernel::<Q6, W, 2>(w, [a[r], a[r + 1]]),
        ),
        1 => put(out, (r0 + r, j, n), &kernel::<Q6, W, 1>(w, [a[r]])),
        _ => {}
    }
}

/// `W` weight rows of Q4_K ([`q4k`]), or with `Q6` of Q6_K ([`q6k`]), against `A` activation
/// rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn kernel<const Q6: bool, const W: usize, const A: usize>(
    w: [&[u8]; W],
    a: [ActRow<'_>; A],
) -> [[f32; A]; W] {
    if Q6 { q6k(w, a) } else { q4k(w, a) }
}

/// The first `A` values of each of `v`'s rows.
#[inline(always)]
fn first_of<const W: usize, const A: usize>(v: [[f32; ACTS]; W]) -> [[f32; A]; W] {
    std::array::from_fn(|i| std::array::from_fn(|t| v[i][t]))
}

/// `v[i][t]` to `out[(r + t) n + j + i]`.
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

/// The super-blocks of Q4_K in each of the rows `w`, whose products read each of `a` per
/// super-block.
#[inline(always)]
fn super_blocks<const W: usize, const A: usize>(w: &[&[u8]; W], a: &[ActRow<'_>; A]) -> usize {
    let blocks = weight_blocks(w, QuantFormat::Q4K.block().1);
    for at in a {
        assert!(
            at.holds_super_blocks(blocks),
            "Q4_K products need activations per super-block"
        );
    }
    blocks
}

/// The products of `W` Q4_K weight rows with `A` activation rows quantized per super-block:
/// per sub-block, the weights' nibbles and scale are unpacked once, then multiplied with
/// each activation row as [`super::avx2`]'s Q4_K kernel does.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4k<const W: usize, const A: usize>(w: [&[u8]; W], a: [ActRow<'_>; A]) -> [[f32; A]; W] {
    align_frame();
    let bytes = QuantFormat::Q4K.block().1;
    let blocks = super_blocks(&w, &a);
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

/// The products of `W` Q6_K weight rows with `A` activation rows quantized per block of 32:
/// per super-block, the weights' 6-bit values and scales are unpacked once, then multiplied
/// with each activation row as [`super::avx2`]'s Q6_K kernel does.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q6k<const W: usize, const A: usize>(w: [&[u8]; W], a: [ActRow<'_>; A]) -> [[f32; A]; W] {
    align_frame();
    let (block, bytes) = QuantFormat::Q6K.block();
    let blocks = weight_blocks(&w, bytes);
    for at in &a {
        assert!(
            at.q.len() >= blocks * block && at.d.len() >= blocks * block / QA,
            "Q6_K products need activations per block of {QA}"
        );
    }
    let mut acc = [[_mm256_setzero_ps(); A]; W];
    for n in 0..blocks {
        let ab = n * block / QA;
        let mut xs: [&[u8]; A] = [&[]; A];
        let mut halves = [_mm256_setzero_si256(); A];
        for t in 0..A {
            xs[t] = bytemuck::cast_slice(&a[t].q[QA * ab..QA * (ab + 8)]);
            halves[t] = half_sums16(&a[t].sums[2 * ab..]);
        }
        for i in 0..W {
            let blk = &w[i][bytes * n..bytes * (n + 1)];
            let scales = load16(&blk[192..208]);
            let scales16 = _mm256_cvtepi8_epi16(scales);
            let [u0, u1] = [0, 1].map(|h| q6k_half(blk, h));
            let u: [__m256i; 8] = std::array::from_fn(|j| if j < 4 { u0[j] } else { u1[j - 4] });
            let (d, ones) = (_mm256_set1_ps(half_at(blk, 208)), _mm256_set1_epi16(1));
            for t in 0..A {
                let p: [__m256i; 8] = std::array::from_fn(|j| {
                    let pairs = _mm256_maddubs_epi16(u[j], load32(&xs[t][QA * j..]));
                    _mm256_madd_epi16(pairs, ones)
                });
                let offsets = _mm256_madd_epi16(scales16, halves[t]);
                let exact = _mm256_sub_epi32(
                    q6k_sub_block_sums(p, scales),
                    _mm256_slli_epi32::<5>(offsets),
                );
                let scale = _mm256_mul_ps(load8f(&a[t].d[ab..]), d);
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[i][t]);
            }
        }
    }
    let mut out = [[0.0; A]; W];
    for i in 0..W {
        out[i] = hsums(acc[i]);
    }
    out
}
