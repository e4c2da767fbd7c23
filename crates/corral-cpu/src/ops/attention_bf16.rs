//! A prefill tile's attention over a bf16 cache with AVX-512 BF16 dot products: the scores
//! `(scale · Q) Kᵀ` and the outputs `P V` take bf16 operands (the cache's own values, the
//! queries and probabilities rounded to bf16 once) and accumulate pairs of products in f32,
//! twice the products an f32 FMA makes per instruction. Keys come in blocks: each block's K
//! is packed as pairs of dims for 32 keys at a time and its V as pairs of keys, with an
//! online softmax between blocks as on the GEMM path.

#![cfg(target_arch = "x86_64")]
#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::cell::Cell;

use super::attention::{PagedLayout, Tile, TileBuffers, online_softmax_step};

/// Keys a score pass takes at once: two registers of 16.
const KEY_STEP: usize = 32;

/// Query rows a score pass keeps in registers (two accumulators each).
const SCORE_ROWS: usize = 8;

/// Query rows an output pass keeps in registers (up to four accumulators of 16 dims each).
const OUTPUT_ROWS: usize = 4;

thread_local! {
    /// Per-thread room for a tile's packed bf16 pairs and its scores: grown once, reused
    /// (taken out while a tile runs, so no closure stands between the kernels).
    static PACKED: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    static SCORES: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// This thread's reusable buffer, at least `len` long (its contents are stale).
fn reused<T: Copy + Default>(
    slot: &'static std::thread::LocalKey<Cell<Vec<T>>>,
    len: usize,
) -> Vec<T> {
    let mut buffer = slot.take();
    if buffer.len() < len {
        buffer.resize(len, T::default());
    }
    buffer
}

/// Whether the CPU has AVX-512 with BF16 dot products.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// The outputs of `tile`'s query rows over the first `longest` keys of its run into `bufs.o`, in blocks
/// of `key_block` keys (as [`super::attention`]'s GEMM path computes them). Callers check
/// [`available`] first; the tile's head dim is a multiple of 32.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_tile(
    tile: &Tile,
    q: &[f32],
    cache_k: &[u16],
    cache_v: &[u16],
    layout: &PagedLayout<'_>,
    longest: usize,
    key_block: usize,
    bufs: &mut TileBuffers,
) {
    let hd = tile.head_dim;
    let pairs = hd / 2;
    let run = layout.token_runs[tile.t0] as usize;
    let rows = (tile.t1 - tile.t0) * tile.group;
    // Whole steps of 32 keys a block (the last block's tail padded with zero keys).
    let block = key_block.clamp(1, longest.max(1)).div_ceil(KEY_STEP) * KEY_STEP;
    bufs.prepare(tile, layout, run, longest);
    let TileBuffers {
        o,
        max,
        sum,
        bases,
        row: scaled,
    } = bufs;
    // The scaled queries as bf16 pairs of dims; K as [pair of dims][key] and V as [pair of
    // keys][dim] for a block; the block's scores and their bf16 pairs. Every element is
    // written before it is read.
    let mut packed = reused(
        &PACKED,
        rows * pairs + pairs * block + block / 2 * hd + rows * block / 2,
    );
    let mut scores = reused(&SCORES, rows * block);
    let (qp, rest) = packed.split_at_mut(rows * pairs);
    let (kp, rest) = rest.split_at_mut(pairs * block);
    let (vp, pp) = rest.split_at_mut(block / 2 * hd);
    let s = &mut scores[..rows * block];
    for r in 0..rows {
        let at = tile.q_at(r);
        for (s, x) in scaled.iter_mut().zip(&q[at..at + hd]) {
            *s = x * tile.scale;
        }
        pack_pairs(scaled, &mut qp[r * pairs..(r + 1) * pairs]);
    }
    for j0 in (0..longest).step_by(block) {
        let n = block.min(longest - j0);
        let width = n.div_ceil(KEY_STEP) * KEY_STEP;
        pack_block(
            (cache_k, cache_v),
            &bases[j0..j0 + n],
            hd,
            width,
            (&mut *kp, &mut *vp),
        );
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(SCORE_ROWS);
            let scores = &mut s[r * width..];
            let queries = &qp[r * pairs..];
            match nr {
                8 => score_rows::<8>(queries, kp, pairs, width, scores),
                7 => score_rows::<7>(queries, kp, pairs, width, scores),
                6 => score_rows::<6>(queries, kp, pairs, width, scores),
                5 => score_rows::<5>(queries, kp, pairs, width, scores),
                4 => score_rows::<4>(queries, kp, pairs, width, scores),
                3 => score_rows::<3>(queries, kp, pairs, width, scores),
                2 => score_rows::<2>(queries, kp, pairs, width, scores),
                _ => score_rows::<1>(queries, kp, pairs, width, scores),
            }
            r += nr;
        }
        for r in 0..rows {
            let valid = tile.len(layout, r).saturating_sub(j0).min(n);
            let row = &mut s[r * width..(r + 1) * width];
            let (kept, past) = row.split_at_mut(valid);
            past.fill(0.0);
            let out = &mut o[r * hd..(r + 1) * hd];
            online_softmax_step(kept, (&mut max[r], &mut sum[r]), out, true);
            pack_pairs(row, &mut pp[r * width / 2..(r + 1) * width / 2]);
        }
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(OUTPUT_ROWS);
            let probs = &pp[r * width / 2..];
            let out = &mut o[r * hd..];
            match nr {
                4 => sum_values::<4>(probs, vp, width / 2, hd, out),
                3 => sum_values::<3>(probs, vp, width / 2, hd, out),
                2 => sum_values::<2>(probs, vp, width / 2, hd, out),
                _ => sum_values::<1>(probs, vp, width / 2, hd, out),
            }
            r += nr;
        }
    }
    PACKED.set(packed);
    SCORES.set(scores);
    for (orow, total) in o.chunks_exact_mut(hd).zip(sum.iter()) {
        let inv = 1.0 / total;
        orow.iter_mut().for_each(|x| *x *= inv);
    }
}

/// `x` (an even count of floats) rounded to bf16 (nearest, ties to even) as pairs: pair i
/// holds `x[2i]` in its low half and `x[2i + 1]` in its high half.
#[target_feature(enable = "avx512f,avx512bf16")]
fn pack_pairs(x: &[f32], out: &mut [u32]) {
    let whole = x.len() / 32 * 32;
    for (i, c) in (0..whole).step_by(32).enumerate() {
        // SAFETY: x holds 32 floats from c, out 16 pairs from 16 i.
        unsafe {
            let lo = _mm512_loadu_ps(x.as_ptr().add(c));
            let hi = _mm512_loadu_ps(x.as_ptr().add(c + 16));
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(out.as_mut_ptr().add(16 * i).cast(), packed);
        }
    }
    for (i, p) in out.iter_mut().enumerate().skip(whole / 2) {
        let (a, b) = (bf16_bits(x[2 * i]), bf16_bits(x[2 * i + 1]));
        *p = a | (b << 16);
    }
}

/// `x` rounded to bf16 (nearest, ties to even), as the pair packing rounds it.
fn bf16_bits(x: f32) -> u32 {
    u32::from(half::bf16::from_f32(x).to_bits())
}

/// The block's keys `bases` (row offsets in the caches) packed for the dot products: K as
/// `kp[pair][key]` (`width` keys a pair, zero past the block), V as `vp[pair of keys][dim]`.
fn pack_block(
    (cache_k, cache_v): (&[u16], &[u16]),
    bases: &[usize],
    hd: usize,
    width: usize,
    (kp, vp): (&mut [u32], &mut [u32]),
) {
    let pairs = hd / 2;
    for (j, &base) in bases.iter().enumerate() {
        let k = &cache_k[base..base + hd];
        for (i, d) in k.chunks_exact(2).enumerate() {
            kp[i * width + j] = u32::from(d[0]) | (u32::from(d[1]) << 16);
        }
    }
    for i in 0..pairs {
        kp[i * width + bases.len()..(i + 1) * width].fill(0);
    }
    for jp in 0..width / 2 {
        let row = &mut vp[jp * hd..(jp + 1) * hd];
        let (a, b) = (2 * jp, 2 * jp + 1);
        match (bases.get(a), bases.get(b)) {
            (Some(&x), Some(&y)) => {
                let (va, vb) = (&cache_v[x..x + hd], &cache_v[y..y + hd]);
                for ((dst, &lo), &hi) in row.iter_mut().zip(va).zip(vb) {
                    *dst = u32::from(lo) | (u32::from(hi) << 16);
                }
            }
            (Some(&x), None) => {
                for (dst, &lo) in row.iter_mut().zip(&cache_v[x..x + hd]) {
                    *dst = u32::from(lo);
                }
            }
            _ => row.fill(0),
        }
    }
}

/// Scores of R query rows (`queries`: R rows of `pairs` bf16 pairs) against the block's
/// `width` packed keys, into R rows of `width` floats of `scores`.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::needless_range_loop)]
fn score_rows<const R: usize>(
    queries: &[u32],
    kp: &[u32],
    pairs: usize,
    width: usize,
    scores: &mut [f32],
) {
    assert!(queries.len() >= R * pairs && kp.len() >= pairs * width);
    assert!(scores.len() >= R * width && width.is_multiple_of(KEY_STEP));
    for j in (0..width).step_by(KEY_STEP) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for i in 0..pairs {
            // SAFETY: the asserts above bound every load and store.
            unsafe {
                let k0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(kp.as_ptr().add(i * width + j).cast()));
                let k1: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                    kp.as_ptr().add(i * width + j + 16).cast(),
                ));
                for r in 0..R {
                    let q: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(queries[r * pairs + i] as i32));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, k0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, k1);
                }
            }
        }
        for r in 0..R {
            // SAFETY: as above.
            unsafe {
                let dst = scores.as_mut_ptr().add(r * width + j);
                _mm512_storeu_ps(dst, acc[r][0]);
                _mm512_storeu_ps(dst.add(16), acc[r][1]);
            }
        }
    }
}

/// `out[r] += Σ_k p[r][k] · v[k]` for R rows (`probs`: R rows of `key_pairs` bf16 pairs of
/// probabilities; `out`: rows `hd` apart) over the block's packed values, 64 dims at a time
/// (the last 32 on their own).
#[target_feature(enable = "avx512f,avx512bf16")]
fn sum_values<const R: usize>(
    probs: &[u32],
    vp: &[u32],
    key_pairs: usize,
    hd: usize,
    out: &mut [f32],
) {
    assert!(probs.len() >= R * key_pairs && vp.len() >= key_pairs * hd);
    assert!(out.len() >= R * hd && hd.is_multiple_of(32));
    for d0 in (0..hd).step_by(64) {
        if hd - d0 >= 64 {
            sum_value_dims::<R, 4>(probs, vp, key_pairs, hd, d0, out);
        } else {
            sum_value_dims::<R, 2>(probs, vp, key_pairs, hd, d0, out);
        }
    }
}

/// [`sum_values`] for the C · 16 dims from `d0`, the R × C accumulators in registers.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::needless_range_loop)]
fn sum_value_dims<const R: usize, const C: usize>(
    probs: &[u32],
    vp: &[u32],
    key_pairs: usize,
    hd: usize,
    d0: usize,
    out: &mut [f32],
) {
    assert!(probs.len() >= R * key_pairs && vp.len() >= key_pairs * hd);
    assert!(out.len() >= R * hd && d0 + 16 * C <= hd);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for r in 0..R {
        for c in 0..C {
            // SAFETY: the asserts above bound every load and store.
            acc[r][c] = unsafe { _mm512_loadu_ps(out.as_ptr().add(r * hd + d0 + 16 * c)) };
        }
    }
    for jp in 0..key_pairs {
        let mut v = [_mm512_setzero_si512(); C];
        for c in 0..C {
            // SAFETY: as above.
            v[c] = unsafe { _mm512_loadu_si512(vp.as_ptr().add(jp * hd + d0 + 16 * c).cast()) };
        }
        for r in 0..R {
            // SAFETY: __m512i and __m512bh are the same 64 bytes.
            let p: __m512bh =
                unsafe { std::mem::transmute(_mm512_set1_epi32(probs[r * key_pairs + jp] as i32)) };
            for c in 0..C {
                // SAFETY: as above.
                let vc: __m512bh = unsafe { std::mem::transmute(v[c]) };
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vc);
            }
        }
    }
    for r in 0..R {
        for c in 0..C {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r * hd + d0 + 16 * c), acc[r][c]) };
        }
    }
}
