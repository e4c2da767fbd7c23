//! Products of K-quant weights (Q4_K, Q6_K), and on AVX2 of 32-value block formats (Q8_0,
//! Q4_0, Q5_0), with many activation rows by integer tiles.
//! Sixteen weight rows at a time are decoded into a panel whose bytes interleave the rows four
//! values apiece, so that one `vpdpbusd` multiplies four values of sixteen rows by the same
//! four activation values (broadcast) and each i32 lane holds one output's sum: no
//! horizontal sums, and four times the products of an f32 multiply-add an instruction. The
//! sub-blocks' integer scales apply per lane to their integer sums; each Q4_K super-block ends
//! in one float multiply-add per activation row (each Q6_K block of 32 values and each block of
//! a block format, against activations per 32 values, in one of its own). The
//! panel is decoded once per work item and read by all its activation rows (llama.cpp
//! repacks its weights at load for the same reason).

use super::matmul::OutPtr;
#[cfg(target_arch = "x86_64")]
use super::quant_dot::prefetch;
use super::quant_dot::{ActRows, Isa, QA, QK, SUB_BLOCK_SLOT, per_super_block};
use super::with_reused;
use corral_backend::QuantFormat;

/// Weight rows per panel: the i32 lanes of a 512-bit register.
const LANES: usize = 16;
/// Activation rows per call of the kernel.
const ROWS: usize = 4;
/// Bytes of one super-block's values in a panel: a byte per value and lane.
const SUPER_BYTES: usize = QK * LANES;
/// Bytes of one 32-value block's values in a panel ([`per_block`] formats).
const BLOCK_BYTES: usize = QA * LANES;

/// Whether products with `format` weights run as integer panels on this CPU: the K-quants
/// with AVX-512 VNNI or AVX2; the formats of 32-value blocks ([`per_block`]) where AVX2 is the
/// best the CPU has (with AVX-512, f32 tiles multiply them).
pub(crate) fn available(format: QuantFormat) -> bool {
    #[cfg(target_arch = "x86_64")]
    return match format {
        QuantFormat::Q4K | QuantFormat::Q6K => {
            matches!(super::quant_dot::best_isa(), Isa::Vnni | Isa::Avx2)
        }
        _ if per_block(format) => super::quant_dot::best_isa() == Isa::Avx2,
        _ => false,
    };
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU runs panels of `format` on `isa`'s kernels: the K-quants' on VNNI where
/// it has it, every panel format's on AVX2 (which a CPU with VNNI has too).
fn kernels_on(isa: Isa, format: QuantFormat) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let k_quant = matches!(format, QuantFormat::Q4K | QuantFormat::Q6K);
        let best = super::quant_dot::best_isa();
        match isa {
            Isa::Vnni => k_quant && best == Isa::Vnni,
            Isa::Avx2 => (k_quant || per_block(format)) && best != Isa::Scalar,
            Isa::Scalar => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, format);
        false
    }
}

/// Whether `format` is one of 32-value blocks with a float scale each (Q8_0, Q4_0, Q5_0),
/// whose panels keep a scale per block and row, against activations quantized per block.
pub(crate) const fn per_block(format: QuantFormat) -> bool {
    matches!(
        format,
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0
    )
}

/// Values per sub-block of `format`: the span of one integer scale.
const fn sub_block(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q6K => 16,
        _ => 32,
    }
}

/// Up to sixteen weight rows of a K-quant format, decoded for integer tiles (rows past the
/// last are zero).
#[derive(Debug, Default)]
struct Panel {
    /// Per super-block, per step of four values: the sixteen rows' four values, unsigned.
    values: Vec<u8>,
    /// Per super-block, per sub-block: the sixteen rows' integer scales.
    scales: Vec<i32>,
    /// Per super-block, per pair of sub-blocks: the sixteen rows' two integer offsets, whose
    /// products with the activations' sub-block sums the result loses (Q4_K's mins, in f32)
    /// or gains (Q6_K's, −32 times the scale, in i32).
    offsets: Vec<i16>,
    /// Per super-block (per block, for [`per_block`] formats): the sixteen rows' float scales
    /// of the integer sums, and of the offsets.
    d: Vec<f32>,
    dm: Vec<f32>,
}

impl Panel {
    /// Whether this panel holds `supers` super-blocks of `subs` sub-blocks each.
    fn holds(&self, supers: usize, subs: usize) -> bool {
        self.values.len() >= supers * SUPER_BYTES
            && self.scales.len() >= supers * subs * LANES
            && self.offsets.len() >= supers * subs * LANES
            && self.d.len() >= supers * LANES
            && self.dm.len() >= supers * LANES
    }

    /// Its values, scales and offsets, as the kernels' loads address them (in bytes).
    fn bytes(&self) -> (*const u8, *const u8, *const u8) {
        (
            self.values.as_ptr(),
            self.scales.as_ptr().cast(),
            self.offsets.as_ptr().cast(),
        )
    }

    /// Decodes `rows` (at most [`LANES`]) rows of `format`, `supers` super-blocks each, packed
    /// in `w`, a super-block at a time ([`vnni::super_block`], [`avx2::super_block`]). On a
    /// CPU with `isa` ([`available`]).
    #[cfg(target_arch = "x86_64")]
    fn decode(
        &mut self,
        isa: Isa,
        format: QuantFormat,
        w: &[u8],
        rows: usize,
        supers: usize,
        ahead: &[u8],
    ) {
        debug_assert!(rows <= LANES);
        if per_block(format) {
            for at in (0..ahead.len()).step_by(64) {
                prefetch(ahead, at);
            }
            // `supers` counts blocks here.
            self.values.resize(supers * BLOCK_BYTES, 0);
            self.d.resize(supers * LANES, 0.0);
            for b in 0..supers {
                let values = &mut self.values[b * BLOCK_BYTES..][..BLOCK_BYTES];
                let d = &mut self.d[b * LANES..][..LANES];
                // SAFETY: the caller checked that the CPU has AVX2 (available).
                #[allow(unsafe_code)]
                unsafe {
                    avx2::block(format, w, (rows, supers), b, values, d)
                };
            }
            return;
        }
        let subs = QK / sub_block(format);
        self.values.resize(supers * SUPER_BYTES, 0);
        self.scales.resize(supers * subs * LANES, 0);
        self.offsets.resize(supers * subs * LANES, 0);
        self.d.resize(supers * LANES, 0.0);
        self.dm.resize(supers * LANES, 0.0);
        let bytes = format.block().1;
        for n in 0..supers {
            for c in 0..ahead.len() / (supers * bytes).max(1) {
                let block = (c * supers + n) * bytes;
                let last = std::iter::once(block + bytes - 1);
                for at in (block..block + bytes).step_by(64).chain(last) {
                    prefetch(ahead, at);
                }
            }
            let into = SuperBlockOut {
                values: &mut self.values[n * SUPER_BYTES..][..SUPER_BYTES],
                scales: &mut self.scales[n * subs * LANES..][..subs * LANES],
                offsets: &mut self.offsets[n * subs * LANES..][..subs * LANES],
                d: &mut self.d[n * LANES..][..LANES],
                dm: &mut self.dm[n * LANES..][..LANES],
            };
            // SAFETY: the caller checked that the CPU has `isa` (available).
            #[allow(unsafe_code)]
            unsafe {
                match isa {
                    Isa::Vnni => vnni::super_block(format, w, (rows, supers), n, into),
                    _ => avx2::super_block(format, w, (rows, supers), n, into),
                }
            };
        }
    }
}

/// Where one super-block of a [`Panel`] goes.
struct SuperBlockOut<'a> {
    values: &'a mut [u8],
    scales: &'a mut [i32],
    offsets: &'a mut [i16],
    d: &'a mut [f32],
    dm: &'a mut [f32],
}

/// Activation rows quantized per super-block (row `r`'s at `r` times its share of each), as
/// Q4_K's products read them.
#[derive(Clone, Copy)]
struct SuperActs<'a> {
    q: &'a [i8],
    d: &'a [f32],
    /// The sums of each block of [`QA`] values.
    sums: &'a [i16],
    supers: usize,
}

/// Activation rows quantized per block of [`QA`] values (row `r`'s at `r` times its share).
#[derive(Clone, Copy)]
struct BlockActs<'a> {
    q: &'a [i8],
    d: &'a [f32],
    /// The sums of each block's two halves.
    sums: &'a [i16],
    blocks: usize,
}

thread_local! {
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::default();
}

/// `out[r * ld + j] = w_j · acts row r` for `r < m`, `j < n`: `w` packs `n` rows of `format`
/// ([`available`]), each as many values as the activation rows, which are quantized per
/// super-block.
///
/// The caller guarantees that these output elements are in bounds and written by no other
/// work item while this runs.
pub(crate) fn multiply(
    format: QuantFormat,
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: OutPtr,
    ld: usize,
) {
    multiply_on(super::quant_dot::best_isa(), format, w, n, acts, m, out, ld)
}

/// [`multiply`] on `isa`'s kernels (VNNI, or AVX2, which a CPU with VNNI has too).
#[allow(clippy::too_many_arguments)]
fn multiply_on(
    isa: Isa,
    format: QuantFormat,
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: OutPtr,
    ld: usize,
) {
    assert!(
        kernels_on(isa, format),
        "integer panels of {format:?} on {isa:?}, which this CPU lacks or which has none"
    );
    let row_bytes = w.len() / n.max(1);
    let bytes = format.block().1;
    // Super-blocks a row, or blocks for `per_block` formats.
    let supers = row_bytes / bytes;
    assert!(
        w.len() == n * supers * bytes,
        "integer panels over mismatched rows"
    );
    let (q, d, sums) = acts.super_blocks();
    let super_acts = SuperActs { q, d, sums, supers };
    let (q, d, sums) = acts.blocks();
    // Activation blocks a row.
    let blocks = supers * format.block().0 / QA;
    let block_acts = BlockActs { q, d, sums, blocks };
    assert!(
        if per_super_block(format) {
            super_acts.q.len() >= m * supers * QK
                && super_acts.d.len() >= m * supers
                && super_acts.sums.len() >= m * supers * QK / QA
        } else {
            q.len() >= m * blocks * QA && d.len() >= m * blocks && sums.len() >= 2 * m * blocks
        },
        "integer panels need {m} rows of activations as the weights' products read them"
    );
    with_reused(&PANEL, |panel| {
        for j0 in (0..n).step_by(LANES) {
            let lanes = LANES.min(n - j0);
            // The next panel's rows, asked for a super-block at a time as this one's are
            // decoded: a panel reads sixteen short streams at once, which the hardware
            // prefetcher does not follow.
            let ahead =
                &w[((j0 + LANES).min(n) * row_bytes)..((j0 + 2 * LANES).min(n) * row_bytes)];
            let w = &w[j0 * row_bytes..][..lanes * row_bytes];
            #[cfg(target_arch = "x86_64")]
            {
                panel.decode(isa, format, w, lanes, supers, ahead);
                // SAFETY: the CPU has `isa` (available); the caller vouches for `out`'s rows
                // and columns `j0..j0 + lanes`.
                #[allow(unsafe_code)]
                unsafe {
                    let out = out.offset(j0);
                    match isa {
                        _ if per_block(format) => {
                            avx2::block_rows(format, panel, block_acts, m, out, ld, lanes)
                        }
                        Isa::Vnni => {
                            vnni::rows(format, panel, (super_acts, block_acts), m, out, ld, lanes)
                        }
                        _ => avx2::rows(format, panel, (super_acts, block_acts), m, out, ld, lanes),
                    }
                };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::*;

    /// All `m` activation rows against one panel, [`ROWS`] at a time.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows(
        format: QuantFormat,
        panel: &Panel,
        (acts, blocks): (SuperActs<'_>, BlockActs<'_>),
        m: usize,
        out: OutPtr,
        ld: usize,
        lanes: usize,
    ) {
        let mask: __mmask16 = if lanes == LANES { !0 } else { (1 << lanes) - 1 };
        let mut r0 = 0;
        while r0 < m {
            let left = m - r0;
            let store = |sums: &[__m512]| {
                for (i, &v) in sums.iter().enumerate() {
                    // SAFETY: row r0 + i, columns 0..lanes of the caller's window (see
                    // `multiply`).
                    #[allow(unsafe_code)]
                    unsafe {
                        _mm512_mask_storeu_ps(out.offset((r0 + i) * ld).as_ptr(), mask, v)
                    }
                }
            };
            match (format, left) {
                (QuantFormat::Q6K, 1) => store(&q6k_kernel::<1>(panel, blocks, r0)),
                (QuantFormat::Q6K, 2) => store(&q6k_kernel::<2>(panel, blocks, r0)),
                (QuantFormat::Q6K, 3) => store(&q6k_kernel::<3>(panel, blocks, r0)),
                (QuantFormat::Q6K, _) => store(&q6k_kernel::<ROWS>(panel, blocks, r0)),
                (_, 1) => store(&q4k_kernel::<1>(panel, acts, r0)),
                (_, 2) => store(&q4k_kernel::<2>(panel, acts, r0)),
                (_, 3) => store(&q4k_kernel::<3>(panel, acts, r0)),
                (_, _) => store(&q4k_kernel::<ROWS>(panel, acts, r0)),
            }
            r0 += ROWS.min(left);
        }
    }

    /// Dword `u` of the 64 bytes at `at` of super-block `n` of each of the `rows` rows of
    /// `w` (`supers` super-blocks of `bytes` a row), in lane `c` for row `c` (zero past
    /// `rows`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn columns(
        w: &[u8],
        (rows, supers, bytes): (usize, usize, usize),
        n: usize,
        at: usize,
    ) -> [__m512i; 16] {
        let mut r = [_mm512_setzero_si512(); 16];
        for (c, r) in r.iter_mut().enumerate().take(rows) {
            *r = load(w, (c * supers + n) * bytes + at);
        }
        transpose(r)
    }

    /// 64 bytes into `to`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn store<T: bytemuck::Pod>(to: &mut [T], v: __m512i) {
        let to: &mut [u8] = bytemuck::cast_slice_mut(to);
        assert!(to.len() >= 64);
        // SAFETY: 64 bytes in bounds (checked above); unaligned store.
        #[allow(unsafe_code)]
        unsafe {
            _mm512_storeu_si512(to.as_mut_ptr().cast(), v)
        }
    }

    /// Lane-wise i16 pairs: `lo` in the low half of each i32 lane, `hi` in the high one.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn pairs(lo: __m512i, hi: __m512i) -> __m512i {
        _mm512_or_si512(
            _mm512_and_si512(lo, _mm512_set1_epi32(0xffff)),
            _mm512_slli_epi32::<16>(hi),
        )
    }

    /// The sixteen f16 in the low (`HIGH` false) or high halves of `v`'s lanes, as f32.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn halves<const HIGH: bool>(v: __m512i) -> __m512 {
        let v = if HIGH { _mm512_srli_epi32::<16>(v) } else { v };
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
    }

    /// Super-block `n` of each of the `rows` rows of `format` in `w` (`supers` super-blocks
    /// a row) into `out` (rows past `rows` zero). Values: step `t` of four is 64 bytes, row
    /// `c`'s at `4 c`; the packed bytes are transposed as dwords, which keeps each dword's
    /// four values together, then unpacked. Scales likewise, a row a lane.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(super) fn super_block(
        format: QuantFormat,
        w: &[u8],
        (rows, supers): (usize, usize),
        n: usize,
        out: SuperBlockOut<'_>,
    ) {
        let bytes = format.block().1;
        let shape = (rows, supers, bytes);
        assert!(out.values.len() >= SUPER_BYTES && w.len() >= rows * supers * bytes);
        let values = out.values;
        let m4 = _mm512_set1_epi8(0x0f);
        let low = |v| _mm512_and_si512(v, m4);
        let high = |v| _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
        let byte = |v, i: u32| {
            _mm512_and_si512(
                _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * i as i32)),
                _mm512_set1_epi32(0xff),
            )
        };
        if format == QuantFormat::Q4K {
            // d and dmin, then the 12 bytes of 6-bit scales and mins (a, b, c): scales 0-3
            // the low six bits of a's bytes, 4-7 c's low nibbles with a's top two bits above;
            // mins alike from b, and c's high nibbles.
            let head = columns(w, shape, n, 0);
            let (a, b, c) = (head[1], head[2], head[3]);
            let (low6, low4, top2) = (
                _mm512_set1_epi8(0x3f),
                _mm512_set1_epi8(0x0f),
                _mm512_set1_epi8(0x03),
            );
            let top = |v| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(v), top2));
            let scales = [
                _mm512_and_si512(a, low6),
                _mm512_or_si512(_mm512_and_si512(c, low4), top(a)),
            ];
            let mins = [
                _mm512_and_si512(b, low6),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(c), low4), top(b)),
            ];
            for j in 0..8 {
                store(
                    &mut out.scales[j * LANES..],
                    byte(scales[j / 4], j as u32 % 4),
                );
            }
            for q in 0..4 {
                let (lo, hi) = (
                    byte(mins[q / 2], 2 * (q as u32 % 2)),
                    byte(mins[q / 2], 2 * (q as u32 % 2) + 1),
                );
                store(&mut out.offsets[q * 2 * LANES..], pairs(lo, hi));
            }
            store(out.d, _mm512_castps_si512(halves::<false>(head[0])));
            store(out.dm, _mm512_castps_si512(halves::<true>(head[0])));
            // 64 values a pair p of sub-blocks: the low nibbles of its 32 bytes, then their
            // high ones; a load of 64 bytes holds pairs 2h and 2h + 1.
            for h in 0..2 {
                let d = columns(w, shape, n, 16 + 64 * h);
                for (u, &v) in d.iter().enumerate() {
                    let (p, t) = (2 * h + u / 8, u % 8);
                    store(&mut values[64 * (16 * p + t)..], low(v));
                    store(&mut values[64 * (16 * p + 8 + t)..], high(v));
                }
            }
            return;
        }
        // Q6_K: 128 bytes of low nibbles, 64 of two-bit highs, 16 signed scales, d. Each 128
        // values h take 64 bytes of low nibbles `ql` and 32 of highs `qh`; the values at l,
        // l + 32, l + 64, l + 96 (l < 32) are nibbles of ql[l], ql[l + 32], ql[l], ql[l + 32]
        // with bits 0-1, 2-3, 4-5, 6-7 of qh[l]. The offset of each 16 is −32 · its scale.
        let tail = columns(w, shape, n, 144);
        let scale = |j: usize| {
            let v = tail[12 + j / 4];
            // Byte j % 4 of the dword, sign-extended.
            let shifted = _mm512_sllv_epi32(v, _mm512_set1_epi32(24 - 8 * (j % 4) as i32));
            _mm512_srai_epi32::<24>(shifted)
        };
        for q in 0..8 {
            let (lo, hi) = (scale(2 * q), scale(2 * q + 1));
            store(&mut out.scales[2 * q * LANES..], lo);
            store(&mut out.scales[(2 * q + 1) * LANES..], hi);
            let minus_32 = |v| _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(v));
            store(
                &mut out.offsets[q * 2 * LANES..],
                pairs(minus_32(lo), minus_32(hi)),
            );
        }
        let mut d = [0u16; LANES];
        for (c, d) in d.iter_mut().enumerate().take(rows) {
            let at = (c * supers + n) * bytes + 208;
            *d = u16::from_le_bytes([w[at], w[at + 1]]);
        }
        let d = _mm512_cvtph_ps(load_half(&d));
        store(out.d, _mm512_castps_si512(d));
        store(out.dm, _mm512_castps_si512(d));
        let qh = columns(w, shape, n, 128);
        let m3 = _mm512_set1_epi8(0x30);
        for h in 0..2 {
            let ql = columns(w, shape, n, 64 * h);
            for t in 0..8 {
                let (a, b, hi) = (ql[t], ql[8 + t], qh[8 * h + t]);
                let first = 32 * h + t;
                let bits = |v| _mm512_and_si512(v, m3);
                let steps = [
                    (first, low(a), bits(_mm512_slli_epi16::<4>(hi))),
                    (first + 8, low(b), bits(_mm512_slli_epi16::<2>(hi))),
                    (first + 16, high(a), bits(hi)),
                    (first + 24, high(b), bits(_mm512_srli_epi16::<2>(hi))),
                ];
                for (step, nibbles, top) in steps {
                    store(&mut values[64 * step..], _mm512_or_si512(nibbles, top));
                }
            }
        }
    }

    /// Sixteen u16.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load_half(p: &[u16; LANES]) -> __m256i {
        // SAFETY: 32 bytes; unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm256_loadu_si256(p.as_ptr().cast())
        }
    }

    /// The sixteen vectors of sixteen dwords transposed: lane c of vector u is lane u of
    /// vector c.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane L, a 4 × 4 transpose of the dwords of rows 4i..4i + 4:
        // u[4 i + s] lane L holds dword 4 L + s of those rows.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        // Then the 128-bit lanes: out[4 L + s] lane i is u[4 i + s] lane L.
        let mut out = [_mm512_setzero_si512(); 16];
        for s in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[s], u[4 + s]);
            let v1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[s], u[4 + s]);
            let v2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + s], u[12 + s]);
            let v3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + s], u[12 + s]);
            out[s] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
            out[4 + s] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
            out[8 + s] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
            out[12 + s] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
        }
        out
    }

    /// 64 bytes at `at` of `p`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load<T: bytemuck::Pod>(p: &[T], at: usize) -> __m512i {
        let bytes: &[u8] = bytemuck::cast_slice(&p[at..]);
        assert!(bytes.len() >= 64);
        // SAFETY: 64 bytes are in bounds (checked above); unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm512_loadu_si512(bytes.as_ptr().cast())
        }
    }

    /// The sixteen lanes' Q4_K products with activation rows `r0..r0 + R`, quantized per
    /// super-block: each sub-block's integer sum times its scale, the mins' products with the
    /// sub-blocks' sums, then one float multiply-add each a super-block.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    #[inline]
    fn q4k_kernel<const R: usize>(panel: &Panel, acts: SuperActs<'_>, r0: usize) -> [__m512; R] {
        let (supers, subs) = (acts.supers, QK / QA);
        assert!(
            acts.q.len() >= (r0 + R) * supers * QK
                && acts.d.len() >= (r0 + R) * supers
                && acts.sums.len() >= (r0 + R) * supers * subs
                && panel.holds(supers, subs),
            "a panel kernel past its operands"
        );
        let row_q: [*const u8; R] =
            std::array::from_fn(|r| acts.q[(r0 + r) * supers * QK..].as_ptr().cast());
        let row_sums: [*const u8; R] =
            std::array::from_fn(|r| acts.sums[(r0 + r) * supers * subs..].as_ptr().cast());
        let (values, scales, offsets) = panel.bytes();
        let mut f = [_mm512_setzero_ps(); R];
        for n in 0..supers {
            let mut isc = [_mm512_setzero_si512(); R];
            for (j, slot) in SUB_BLOCK_SLOT.into_iter().enumerate() {
                // Where this sub-block's activations start in each row.
                let x_at = QK * n + QA * slot;
                let mut iacc = [_mm512_setzero_si512(); R];
                for t in 0..QA / 4 {
                    let w = at(values, n * SUPER_BYTES + 64 * (QA / 4 * j + t));
                    for r in 0..R {
                        let x = broadcast(row_q[r], x_at + 4 * t);
                        iacc[r] = _mm512_dpbusd_epi32(iacc[r], w, x);
                    }
                }
                let sc = at(scales, 4 * (n * subs + j) * LANES);
                for r in 0..R {
                    isc[r] = _mm512_add_epi32(isc[r], _mm512_mullo_epi32(iacc[r], sc));
                }
            }
            let mut oacc = [_mm512_setzero_si512(); R];
            for q in 0..subs / 2 {
                let o = at(offsets, 2 * (n * subs / 2 + q) * 2 * LANES);
                for r in 0..R {
                    let s = broadcast(row_sums[r], 2 * (n * subs + 2 * q));
                    oacc[r] = _mm512_dpwssd_epi32(oacc[r], o, s);
                }
            }
            let d = _mm512_castsi512_ps(load(&panel.d, n * LANES));
            let dm = _mm512_castsi512_ps(load(&panel.dm, n * LANES));
            for r in 0..R {
                let dx = _mm512_set1_ps(acts.d[(r0 + r) * supers + n]);
                let (sums, offs) = (_mm512_cvtepi32_ps(isc[r]), _mm512_cvtepi32_ps(oacc[r]));
                f[r] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, dx), f[r]);
                f[r] = _mm512_fnmadd_ps(offs, _mm512_mul_ps(dm, dx), f[r]);
            }
        }
        f
    }

    /// The sixteen lanes' Q6_K products with activation rows `r0..r0 + R`, quantized per
    /// block of [`QA`]: per block, its two sub-blocks' integer sums times their scales, less
    /// the offsets' products with the block's halves' sums, exactly in i32; then one float
    /// multiply-add by the weights' scale times the block's.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    #[inline]
    fn q6k_kernel<const R: usize>(panel: &Panel, acts: BlockActs<'_>, r0: usize) -> [__m512; R] {
        let (blocks, per_super) = (acts.blocks, QK / QA);
        let supers = blocks / per_super;
        assert!(
            acts.q.len() >= (r0 + R) * blocks * QA
                && acts.d.len() >= (r0 + R) * blocks
                && acts.sums.len() >= 2 * (r0 + R) * blocks
                && panel.holds(supers, 2 * per_super),
            "a panel kernel past its operands"
        );
        let row_q: [*const u8; R] =
            std::array::from_fn(|r| acts.q[(r0 + r) * blocks * QA..].as_ptr().cast());
        let row_sums: [*const u8; R] =
            std::array::from_fn(|r| acts.sums[2 * (r0 + r) * blocks..].as_ptr().cast());
        let row_d: [&[f32]; R] = std::array::from_fn(|r| &acts.d[(r0 + r) * blocks..]);
        let (values, scales, offsets) = panel.bytes();
        let mut f = [_mm512_setzero_ps(); R];
        for n in 0..supers {
            // Σ over the blocks of their exact sums times their activations' scale.
            let mut g = [_mm512_setzero_ps(); R];
            for b in 0..per_super {
                let ab = n * per_super + b;
                let mut isc = [_mm512_setzero_si512(); R];
                for j in [2 * b, 2 * b + 1] {
                    let mut iacc = [_mm512_setzero_si512(); R];
                    for t in 0..4 {
                        let w = at(values, n * SUPER_BYTES + 64 * (4 * j + t));
                        for r in 0..R {
                            let x = broadcast(row_q[r], QA * ab + 16 * (j % 2) + 4 * t);
                            iacc[r] = _mm512_dpbusd_epi32(iacc[r], w, x);
                        }
                    }
                    let sc = at(scales, 4 * (n * 2 * per_super + j) * LANES);
                    for r in 0..R {
                        isc[r] = _mm512_add_epi32(isc[r], _mm512_mullo_epi32(iacc[r], sc));
                    }
                }
                let o = at(offsets, 2 * ab * 2 * LANES);
                for r in 0..R {
                    // The block's two sums of halves, as two i16.
                    let s = broadcast(row_sums[r], 4 * ab);
                    let exact = _mm512_dpwssd_epi32(isc[r], o, s);
                    let dx = _mm512_set1_ps(row_d[r][ab]);
                    g[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), dx, g[r]);
                }
            }
            let d = _mm512_castsi512_ps(load(&panel.d, n * LANES));
            for r in 0..R {
                f[r] = _mm512_fmadd_ps(g[r], d, f[r]);
            }
        }
        f
    }

    /// Four bytes (two i16) at byte `at` of `p`, broadcast; the caller's assertion keeps the
    /// read in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn broadcast(p: *const u8, at: usize) -> __m512i {
        // SAFETY: in bounds (see above); unaligned read.
        #[allow(unsafe_code)]
        let v = unsafe { p.add(at).cast::<i32>().read_unaligned() };
        _mm512_set1_epi32(v)
    }

    /// 64 bytes at byte `bytes` of `p`; the caller's assertion keeps the load in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn at(p: *const u8, bytes: usize) -> __m512i {
        // SAFETY: in bounds (see above); unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm512_loadu_si512(p.add(bytes).cast())
        }
    }
}

/// Panels on AVX2: each 512-bit step of the VNNI kernel as two halves of eight rows, and
/// `vpdpbusd` as `vpmaddubsw` (pairs of u8 × i8 into i16), the pairs of a sub-block summed
/// in i16 and multiplied by the sub-block's scale by one `vpmaddwd` (Q4_K values are below
/// 16, so eight steps' pairs stay under 2^15; Q6_K's below 64, two steps).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;
    use crate::ops::quant_dot::half_at;
    use crate::ops::quant_dot::k_scales_mins;

    /// Rows of a half panel: the i32 lanes of a 256-bit register.
    const HALF: usize = LANES / 2;

    /// All `m` activation rows against one panel, [`ROWS`] at a time, a half panel at a time.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows(
        format: QuantFormat,
        panel: &Panel,
        (acts, blocks): (SuperActs<'_>, BlockActs<'_>),
        m: usize,
        out: OutPtr,
        ld: usize,
        lanes: usize,
    ) {
        crate::ops::align_frame();
        in_halves(m, out, ld, lanes, |h, r0, left| match (format, left) {
            (QuantFormat::Q6K, 1) => padded(q6k_kernel::<1>(panel, blocks, r0, h)),
            (QuantFormat::Q6K, 2) => padded(q6k_kernel::<2>(panel, blocks, r0, h)),
            (QuantFormat::Q6K, 3) => padded(q6k_kernel::<3>(panel, blocks, r0, h)),
            (QuantFormat::Q6K, _) => q6k_kernel::<ROWS>(panel, blocks, r0, h),
            (_, 1) => padded(q4k_kernel::<1>(panel, acts, r0, h)),
            (_, 2) => padded(q4k_kernel::<2>(panel, acts, r0, h)),
            (_, 3) => padded(q4k_kernel::<3>(panel, acts, r0, h)),
            (_, _) => q4k_kernel::<ROWS>(panel, acts, r0, h),
        })
    }

    /// `m` activation rows' products with a panel's `lanes` rows into `out` (rows `ld`
    /// apart), a half panel `h` and up to [`ROWS`] rows from `r0` at a time: `sums(h, r0,
    /// left)` gives the first `left.min(ROWS)` rows' sums, stored masked to the lanes.
    #[target_feature(enable = "avx2,fma")]
    fn in_halves(
        m: usize,
        out: OutPtr,
        ld: usize,
        lanes: usize,
        sums: impl Fn(usize, usize, usize) -> [__m256; ROWS],
    ) {
        for h in 0..lanes.div_ceil(HALF) {
            let valid = (lanes - h * HALF).min(HALF);
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32(valid as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            let mut r0 = 0;
            while r0 < m {
                let left = m - r0;
                for (i, &v) in sums(h, r0, left).iter().take(left).enumerate() {
                    // SAFETY: row r0 + i, columns h * HALF.. of the first `lanes` of the
                    // caller's window (see `multiply`), the mask keeping to them.
                    #[allow(unsafe_code)]
                    unsafe {
                        let at = out.offset((r0 + i) * ld + h * HALF).as_ptr();
                        _mm256_maskstore_ps(at, mask, v)
                    }
                }
                r0 += ROWS.min(left);
            }
        }
    }

    /// `R` rows' sums in the first of [`ROWS`].
    #[inline(always)]
    fn padded<const R: usize>(v: [__m256; R]) -> [__m256; ROWS] {
        // SAFETY: an all-zero __m256 is a valid value.
        #[allow(unsafe_code)]
        let mut p = [unsafe { std::mem::zeroed::<__m256>() }; ROWS];
        p[..R].copy_from_slice(&v);
        p
    }

    /// Half `h` of the panel's lanes: their Q4_K products with activation rows `r0..r0 +
    /// R`, quantized per super-block, as the VNNI kernel computes them.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q4k_kernel<const R: usize>(
        panel: &Panel,
        acts: SuperActs<'_>,
        r0: usize,
        h: usize,
    ) -> [__m256; R] {
        let (supers, subs) = (acts.supers, QK / QA);
        assert!(
            h < 2
                && acts.q.len() >= (r0 + R) * supers * QK
                && acts.d.len() >= (r0 + R) * supers
                && acts.sums.len() >= (r0 + R) * supers * subs
                && panel.holds(supers, subs),
            "a panel kernel past its operands"
        );
        let row_q: [*const u8; R] =
            std::array::from_fn(|r| acts.q[(r0 + r) * supers * QK..].as_ptr().cast());
        let row_sums: [*const u8; R] =
            std::array::from_fn(|r| acts.sums[(r0 + r) * supers * subs..].as_ptr().cast());
        let (values, scales, offsets) = panel.bytes();
        let at = |p: *const u8, bytes: usize| at(p, bytes + 32 * h);
        let mut f = [_mm256_setzero_ps(); R];
        for n in 0..supers {
            let mut isc = [_mm256_setzero_si256(); R];
            for (j, slot) in SUB_BLOCK_SLOT.into_iter().enumerate() {
                let x_at = QK * n + QA * slot;
                let sc = i16_pairs(at(scales, 4 * (n * subs + j) * LANES));
                // Q4_K values are below 16: eight steps' pairs stay under 2^15.
                let mut pairs = [_mm256_setzero_si256(); R];
                for t in 0..QA / 4 {
                    let w = at(values, n * SUPER_BYTES + 64 * (QA / 4 * j + t));
                    for r in 0..R {
                        let x = broadcast(row_q[r], x_at + 4 * t);
                        pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(w, x));
                    }
                }
                for r in 0..R {
                    isc[r] = _mm256_add_epi32(isc[r], _mm256_madd_epi16(pairs[r], sc));
                }
            }
            let mut oacc = [_mm256_setzero_si256(); R];
            for q in 0..subs / 2 {
                let o = at(offsets, 2 * (n * subs / 2 + q) * 2 * LANES);
                for r in 0..R {
                    let s = broadcast(row_sums[r], 2 * (n * subs + 2 * q));
                    oacc[r] = _mm256_add_epi32(oacc[r], _mm256_madd_epi16(o, s));
                }
            }
            let (d, dm) = (half_of(&panel.d, n, h), half_of(&panel.dm, n, h));
            for r in 0..R {
                let dx = _mm256_set1_ps(acts.d[(r0 + r) * supers + n]);
                let (sums, offs) = (_mm256_cvtepi32_ps(isc[r]), _mm256_cvtepi32_ps(oacc[r]));
                f[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, dx), f[r]);
                f[r] = _mm256_fnmadd_ps(offs, _mm256_mul_ps(dm, dx), f[r]);
            }
        }
        f
    }

    /// Half `h` of the panel's lanes: their Q6_K products with activation rows `r0..r0 +
    /// R`, quantized per block of [`QA`], as the VNNI kernel computes them.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn q6k_kernel<const R: usize>(
        panel: &Panel,
        acts: BlockActs<'_>,
        r0: usize,
        h: usize,
    ) -> [__m256; R] {
        let (blocks, per_super) = (acts.blocks, QK / QA);
        let supers = blocks / per_super;
        assert!(
            h < 2
                && acts.q.len() >= (r0 + R) * blocks * QA
                && acts.d.len() >= (r0 + R) * blocks
                && acts.sums.len() >= 2 * (r0 + R) * blocks
                && panel.holds(supers, 2 * per_super),
            "a panel kernel past its operands"
        );
        let row_q: [*const u8; R] =
            std::array::from_fn(|r| acts.q[(r0 + r) * blocks * QA..].as_ptr().cast());
        let row_sums: [*const u8; R] =
            std::array::from_fn(|r| acts.sums[2 * (r0 + r) * blocks..].as_ptr().cast());
        let row_d: [&[f32]; R] = std::array::from_fn(|r| &acts.d[(r0 + r) * blocks..]);
        let (values, scales, offsets) = panel.bytes();
        let at = |p: *const u8, bytes: usize| at(p, bytes + 32 * h);
        let mut f = [_mm256_setzero_ps(); R];
        for n in 0..supers {
            // Σ over the blocks of their exact sums times their activations' scale.
            let mut g = [_mm256_setzero_ps(); R];
            for b in 0..per_super {
                let ab = n * per_super + b;
                let mut isc = [_mm256_setzero_si256(); R];
                for j in [2 * b, 2 * b + 1] {
                    let sc = i16_pairs(at(scales, 4 * (n * 2 * per_super + j) * LANES));
                    // Q6_K values are below 64: two steps' pairs stay under 2^15.
                    for t0 in [0, 2] {
                        let mut pairs = [_mm256_setzero_si256(); R];
                        for t in t0..t0 + 2 {
                            let w = at(values, n * SUPER_BYTES + 64 * (4 * j + t));
                            for r in 0..R {
                                let x = broadcast(row_q[r], QA * ab + 16 * (j % 2) + 4 * t);
                                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(w, x));
                            }
                        }
                        for r in 0..R {
                            isc[r] = _mm256_add_epi32(isc[r], _mm256_madd_epi16(pairs[r], sc));
                        }
                    }
                }
                let o = at(offsets, 2 * ab * 2 * LANES);
                for r in 0..R {
                    // The block's two sums of halves, as two i16.
                    let s = broadcast(row_sums[r], 4 * ab);
                    let exact = _mm256_add_epi32(isc[r], _mm256_madd_epi16(o, s));
                    let dx = _mm256_set1_ps(row_d[r][ab]);
                    g[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), dx, g[r]);
                }
            }
            let d = half_of(&panel.d, n, h);
            for r in 0..R {
                f[r] = _mm256_fmadd_ps(g[r], d, f[r]);
            }
        }
        f
    }

    /// Lanes of i32 scales as i16 pairs, the scale in both halves, for `vpmaddwd`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn i16_pairs(sc: __m256i) -> __m256i {
        let low16 = _mm256_set1_epi32(0xffff);
        _mm256_or_si256(_mm256_and_si256(sc, low16), _mm256_slli_epi32::<16>(sc))
    }

    /// Half `h` of super-block `n`'s sixteen lanes of `v`.
    #[target_feature(enable = "avx")]
    #[inline]
    fn half_of(v: &[f32], n: usize, h: usize) -> __m256 {
        let v = &v[n * LANES + h * HALF..][..HALF];
        // SAFETY: eight f32 in bounds (the slice above); unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm256_loadu_ps(v.as_ptr())
        }
    }

    /// Four bytes (two i16) at byte `at` of `p`, broadcast; the caller's assertion keeps the
    /// read in bounds.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn broadcast(p: *const u8, at: usize) -> __m256i {
        // SAFETY: in bounds (see above); unaligned read.
        #[allow(unsafe_code)]
        let v = unsafe { p.add(at).cast::<i32>().read_unaligned() };
        _mm256_set1_epi32(v)
    }

    /// 32 bytes at byte `bytes` of `p`; the caller's assertion keeps the load in bounds.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn at(p: *const u8, bytes: usize) -> __m256i {
        // SAFETY: in bounds (see above); unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm256_loadu_si256(p.add(bytes).cast())
        }
    }

    /// Super-block `n` of each of the `rows` rows of `format` in `w` (`supers` super-blocks
    /// a row) into `out` (rows past `rows` zero): the values of eight rows at a time
    /// transposed as dwords ([`transpose`]), which keeps each dword's four values together,
    /// then unpacked; scales, offsets and float scales a row at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn super_block(
        format: QuantFormat,
        w: &[u8],
        (rows, supers): (usize, usize),
        n: usize,
        out: SuperBlockOut<'_>,
    ) {
        let bytes = format.block().1;
        assert!(
            rows <= LANES && out.values.len() >= SUPER_BYTES && w.len() >= rows * supers * bytes
        );
        out.scales.fill(0);
        out.offsets.fill(0);
        out.d.fill(0.0);
        out.dm.fill(0.0);
        let block = |c: usize| &w[(c * supers + n) * bytes..][..bytes];
        for c in 0..rows {
            let b = block(c);
            if format == QuantFormat::Q4K {
                let (scales, mins) = k_scales_mins(&b[4..16]);
                for j in 0..8 {
                    out.scales[j * LANES + c] = i32::from((scales >> (8 * j)) as u8);
                    out.offsets[(j / 2) * 2 * LANES + 2 * c + j % 2] =
                        i16::from((mins >> (8 * j)) as u8);
                }
                (out.d[c], out.dm[c]) = (half_at(b, 0), half_at(b, 2));
            } else {
                for j in 0..16 {
                    let scale = i32::from(b[192 + j] as i8);
                    out.scales[j * LANES + c] = scale;
                    out.offsets[(j / 2) * 2 * LANES + 2 * c + j % 2] = (-32 * scale) as i16;
                }
                (out.d[c], out.dm[c]) = (half_at(b, 208), half_at(b, 208));
            }
        }
        let values = &mut *out.values;
        for h in 0..2 {
            let half_rows = (h * HALF..rows).map(|c| block(c).as_ptr());
            let mut first = [std::ptr::null(); HALF];
            for (p, b) in first.iter_mut().zip(half_rows) {
                *p = b;
            }
            // SAFETY (all below): each non-null pointer is a whole block of `bytes` (checked
            // above), and every offset read is within its first `bytes`; each step stored is
            // within `values` (SUPER_BYTES, checked above).
            #[allow(unsafe_code)]
            unsafe {
                if format == QuantFormat::Q4K {
                    // Pair p of sub-blocks: 32 bytes whose low nibbles are its first 32 values
                    // and high nibbles the next 32.
                    for p in 0..4 {
                        let v = columns(&first, 16 + 32 * p);
                        for (t, &v) in v.iter().enumerate() {
                            put(values, 16 * p + t, h, low(v));
                            put(values, 16 * p + 8 + t, h, high(v));
                        }
                    }
                    continue;
                }
                // Q6_K, as `vnni::super_block` lays it out.
                for g in 0..2 {
                    let a = columns(&first, 64 * g);
                    let b = columns(&first, 64 * g + 32);
                    let hi = columns(&first, 128 + 32 * g);
                    for t in 0..8 {
                        let step = 32 * g + t;
                        let top = |v: __m256i| _mm256_and_si256(v, _mm256_set1_epi8(0x30));
                        put(
                            values,
                            step,
                            h,
                            _mm256_or_si256(low(a[t]), top(_mm256_slli_epi16::<4>(hi[t]))),
                        );
                        put(
                            values,
                            step + 8,
                            h,
                            _mm256_or_si256(low(b[t]), top(_mm256_slli_epi16::<2>(hi[t]))),
                        );
                        put(
                            values,
                            step + 16,
                            h,
                            _mm256_or_si256(high(a[t]), top(hi[t])),
                        );
                        put(
                            values,
                            step + 24,
                            h,
                            _mm256_or_si256(high(b[t]), top(_mm256_srli_epi16::<2>(hi[t]))),
                        );
                    }
                }
            }
        }
    }

    /// All `m` activation rows against a panel of a [`per_block`] format, [`ROWS`] at a time, a
    /// half panel at a time.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block_rows(
        format: QuantFormat,
        panel: &Panel,
        acts: BlockActs<'_>,
        m: usize,
        out: OutPtr,
        ld: usize,
        lanes: usize,
    ) {
        crate::ops::align_frame();
        // What the unsigned values of Q4_0 and Q5_0 carry above the signed ones.
        let offset = match format {
            QuantFormat::Q4_0 => 8,
            _ => 16,
        };
        let signed = format == QuantFormat::Q8_0;
        in_halves(m, out, ld, lanes, |h, r0, left| match (signed, left) {
            (true, 1) => padded(block_kernel::<1, true>(panel, acts, r0, h, 0)),
            (true, 2) => padded(block_kernel::<2, true>(panel, acts, r0, h, 0)),
            (true, 3) => padded(block_kernel::<3, true>(panel, acts, r0, h, 0)),
            (true, _) => block_kernel::<ROWS, true>(panel, acts, r0, h, 0),
            (false, 1) => padded(block_kernel::<1, false>(panel, acts, r0, h, offset)),
            (false, 2) => padded(block_kernel::<2, false>(panel, acts, r0, h, offset)),
            (false, 3) => padded(block_kernel::<3, false>(panel, acts, r0, h, offset)),
            (false, _) => block_kernel::<ROWS, false>(panel, acts, r0, h, offset),
        })
    }

    /// Half `h` of a [`per_block`] panel's lanes: their products with activation rows
    /// `r0..r0 + R`. `SIGNED` (Q8_0): the values' signs moved onto the activations, so that
    /// `vpmaddubsw` multiplies magnitudes (at most 128 · 127 twice, under 2^15), each step's
    /// pairs summed into i32 at once. Otherwise values below 32, offset by `offset`: four
    /// steps' pairs summed in i16, the offset taken off by the activation block's sum.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn block_kernel<const R: usize, const SIGNED: bool>(
        panel: &Panel,
        acts: BlockActs<'_>,
        r0: usize,
        h: usize,
        offset: i32,
    ) -> [__m256; R] {
        let blocks = acts.blocks;
        assert!(
            h < 2
                && acts.q.len() >= (r0 + R) * blocks * QA
                && acts.d.len() >= (r0 + R) * blocks
                && acts.sums.len() >= 2 * (r0 + R) * blocks
                && panel.values.len() >= blocks * BLOCK_BYTES
                && panel.d.len() >= blocks * LANES,
            "a panel kernel past its operands"
        );
        let row_q: [*const u8; R] =
            std::array::from_fn(|r| acts.q[(r0 + r) * blocks * QA..].as_ptr().cast());
        // Four activation bytes at `at` of row `r`, broadcast; in bounds by the assertion.
        let broadcast = |r: usize, at: usize| {
            // SAFETY: in bounds (see above); unaligned read.
            #[allow(unsafe_code)]
            let v = unsafe { row_q[r].add(at).cast::<i32>().read_unaligned() };
            _mm256_set1_epi32(v)
        };
        let values: *const u8 = panel.values.as_ptr();
        // Step `t` of block `b`: half `h` of its 64 bytes.
        let step = |b: usize, t: usize| {
            // SAFETY: in bounds (see above); unaligned load.
            #[allow(unsafe_code)]
            unsafe {
                _mm256_loadu_si256(values.add(b * BLOCK_BYTES + 64 * t + 32 * h).cast())
            }
        };
        let ones = _mm256_set1_epi16(1);
        let mut f = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let mut isum = [_mm256_setzero_si256(); R];
            if SIGNED {
                for t in 0..QA / 4 {
                    let w = step(b, t);
                    let magnitudes = _mm256_abs_epi8(w);
                    for (r, isum) in isum.iter_mut().enumerate() {
                        let x = _mm256_sign_epi8(broadcast(r, QA * b + 4 * t), w);
                        let pairs = _mm256_maddubs_epi16(magnitudes, x);
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(pairs, ones));
                    }
                }
            } else {
                for t0 in [0, 4] {
                    let mut pairs = [_mm256_setzero_si256(); R];
                    for t in t0..t0 + 4 {
                        let w = step(b, t);
                        for (r, p) in pairs.iter_mut().enumerate() {
                            let x = broadcast(r, QA * b + 4 * t);
                            *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(w, x));
                        }
                    }
                    for r in 0..R {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs[r], ones));
                    }
                }
                for (r, isum) in isum.iter_mut().enumerate() {
                    let at = 2 * ((r0 + r) * blocks + b);
                    let sum = i32::from(acts.sums[at]) + i32::from(acts.sums[at + 1]);
                    *isum = _mm256_sub_epi32(*isum, _mm256_set1_epi32(offset * sum));
                }
            }
            // SAFETY: eight f32 in bounds (see above).
            #[allow(unsafe_code)]
            let d = unsafe { _mm256_loadu_ps(panel.d[b * LANES + h * HALF..][..HALF].as_ptr()) };
            for r in 0..R {
                let dx = _mm256_set1_ps(acts.d[(r0 + r) * blocks + b]);
                f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), f[r]);
            }
        }
        f
    }

    /// Block `b` of each of the `rows` rows of a [`per_block`] `format` in `w` (`blocks` a
    /// row) into a panel block's `values` and scales `d` (rows past `rows` zero): each row's
    /// 32 values in a register ([`block_values`]), eight rows' transposed as dwords.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn block(
        format: QuantFormat,
        w: &[u8],
        (rows, blocks): (usize, usize),
        b: usize,
        values: &mut [u8],
        d: &mut [f32],
    ) {
        let bytes = format.block().1;
        assert!(
            rows <= LANES
                && values.len() >= BLOCK_BYTES
                && d.len() >= LANES
                && w.len() >= rows * blocks * bytes
        );
        let block = |c: usize| &w[(c * blocks + b) * bytes..][..bytes];
        for (c, d) in d.iter_mut().enumerate() {
            *d = if c < rows { half_at(block(c), 0) } else { 0.0 };
        }
        for h in 0..2 {
            let mut v = [_mm256_setzero_si256(); HALF];
            for (c, v) in v.iter_mut().enumerate() {
                if h * HALF + c < rows {
                    *v = block_values(format, block(h * HALF + c));
                }
            }
            for (t, v) in transpose(v).into_iter().enumerate() {
                put(values, t, h, v);
            }
        }
    }

    /// The 32 values of a block of a [`per_block`] `format` in order: Q8_0's signed, Q4_0's
    /// and Q5_0's unsigned (before their offset).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn block_values(format: QuantFormat, blk: &[u8]) -> __m256i {
        let load16 = |at: usize| {
            let b = &blk[at..at + 16];
            // SAFETY: 16 bytes in bounds; unaligned load.
            #[allow(unsafe_code)]
            unsafe {
                _mm_loadu_si128(b.as_ptr().cast())
            }
        };
        // Low nibbles are values 0..16, high ones 16..32.
        let nibbles = |at: usize| {
            let raw = load16(at);
            let m4 = _mm_set1_epi8(0x0f);
            _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16::<4>(raw), m4),
                _mm_and_si128(raw, m4),
            )
        };
        match format {
            QuantFormat::Q8_0 => {
                let b = &blk[2..34];
                // SAFETY: 32 bytes in bounds; unaligned load.
                #[allow(unsafe_code)]
                unsafe {
                    _mm256_loadu_si256(b.as_ptr().cast())
                }
            }
            QuantFormat::Q4_0 => nibbles(2),
            _ => {
                // Q5_0: bit i of qh is value i's fifth: byte i takes qh's byte i / 8, then
                // tests its bit i % 8.
                let qh = i32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(qh),
                    _mm256_setr_epi8(
                        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                        3, 3, 3, 3, 3, 3, 3,
                    ),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                _mm256_or_si256(nibbles(6), _mm256_and_si256(set, _mm256_set1_epi8(16)))
            }
        }
    }

    /// The low nibbles of `v`'s bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn low(v: __m256i) -> __m256i {
        _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
    }

    /// The high nibbles of `v`'s bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn high(v: __m256i) -> __m256i {
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0f))
    }

    /// Dword t of the 32 bytes at `at` of each block in `rows` (null: a row past the last,
    /// zero), in lane c for row c.
    ///
    /// # Safety
    /// Every non-null pointer has `at + 32` bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    #[allow(unsafe_code)]
    unsafe fn columns(rows: &[*const u8; HALF], at: usize) -> [__m256i; HALF] {
        let mut r = [_mm256_setzero_si256(); HALF];
        for (r, &p) in r.iter_mut().zip(rows) {
            if !p.is_null() {
                // SAFETY: the caller's.
                *r = unsafe { _mm256_loadu_si256(p.add(at).cast()) };
            }
        }
        transpose(r)
    }

    /// `v` as half `h` of step `step` of a panel super-block's values.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn put(values: &mut [u8], step: usize, h: usize, v: __m256i) {
        let to = &mut values[64 * step + 32 * h..][..32];
        // SAFETY: 32 bytes in bounds; unaligned store.
        #[allow(unsafe_code)]
        unsafe {
            _mm256_storeu_si256(to.as_mut_ptr().cast(), v)
        }
    }

    /// Eight vectors of eight dwords transposed: lane c of vector u is lane u of vector c.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn transpose(r: [__m256i; HALF]) -> [__m256i; HALF] {
        let t: [__m256i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        // u[4 g + s], 128-bit lane L: dword 4 L + s of rows 4 g..4 g + 4.
        let u: [__m256i; 8] = std::array::from_fn(|i| {
            let (g, s) = (i / 4, i % 4);
            let (a, b) = (t[4 * g + s / 2], t[4 * g + 2 + s / 2]);
            if s % 2 == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            }
        });
        std::array::from_fn(|d| {
            let s = d % 4;
            if d < 4 {
                _mm256_permute2x128_si256::<0x20>(u[s], u[4 + s])
            } else {
                _mm256_permute2x128_si256::<0x31>(u[s], u[4 + s])
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::ops::quant_dot::tests::{random_blocks, xorshift};
    use crate::ops::quant_dot::{ActBlocks, QuantizedRows, dot_rows};

    /// The instruction sets with panel kernels for `format` on this CPU.
    fn isas(format: QuantFormat) -> Vec<Isa> {
        #[cfg(target_arch = "x86_64")]
        return [Isa::Vnni, Isa::Avx2]
            .into_iter()
            .filter(|&isa| kernels_on(isa, format))
            .collect();
        #[cfg(not(target_arch = "x86_64"))]
        Vec::new()
    }

    /// Panels of `n` random rows of `k` values of `format` times `m` random activation rows
    /// (from row `skip` of those quantized) equal the scalar definition's products a row at a
    /// time (up to float summation order), into a window of a wider output whose other
    /// elements stay as they were.
    fn check(
        format: QuantFormat,
        (n, k, m, skip): (usize, usize, usize, usize),
        seed: u64,
    ) -> Result<(), TestCaseError> {
        let mut next = xorshift(seed);
        let x: Vec<f32> = (0..(skip + m) * k)
            .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        let mut acts = QuantizedRows::default();
        acts.quantize(&x, skip + m, k, ActBlocks::of([format]));
        let w = random_blocks(format, n * k / format.block().0, &mut next);
        let mut decoded = vec![0.0f32; n * k];
        corral_backend::quant::dequantize(format, &w, &mut decoded);
        let mut want = vec![f32::NAN; m * n];
        dot_rows(
            Isa::Scalar,
            format,
            &w,
            n,
            acts.rows_from(skip),
            m,
            &mut want,
        );
        let isas = isas(format);
        // Every CPU with AVX2 runs each panel format's AVX2 kernels at least.
        prop_assert!(
            !isas.is_empty() || super::super::quant_dot::best_isa() == Isa::Scalar,
            "no panel kernels for {:?} on this CPU",
            format
        );
        for isa in isas {
            let ld = n + 3;
            let mut got = vec![7.0f32; m * ld];
            multiply_on(
                isa,
                format,
                &w,
                n,
                acts.rows_from(skip),
                m,
                OutPtr::new(&mut got),
                ld,
            );
            for r in 0..m {
                for j in 0..ld {
                    let g = got[r * ld + j];
                    if j >= n {
                        prop_assert_eq!(
                            g,
                            7.0,
                            "{:?} on {:?}: row {} column {} past the window",
                            format,
                            isa,
                            r,
                            j
                        );
                        continue;
                    }
                    let w = want[r * n + j];
                    // Sums of products of both signs: float rounding scales with the
                    // products' magnitudes, not the sum's.
                    let xr = &x[(skip + r) * k..(skip + r + 1) * k];
                    let magnitude: f32 = decoded[j * k..(j + 1) * k]
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| (a * b).abs())
                        .sum();
                    prop_assert!(
                        (g - w).abs() <= 1e-5 * magnitude + 1e-6,
                        "{:?} on {:?}, {} rows of {}: row {} column {}: {} against {} (magnitude {})",
                        format,
                        isa,
                        m,
                        k,
                        r,
                        j,
                        g,
                        w,
                        magnitude
                    );
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// K-quant panels, at any count of weight rows (whole panels of sixteen and a partial
        /// one) and of activation rows (whole kernels of four and the rest, from a row past the
        /// first).
        #[test]
        fn panels_equal_the_scalar_products(
            supers in 1usize..4,
            n in 1usize..40,
            m in 1usize..11,
            skip in 0usize..3,
            seed in any::<u64>(),
        ) {
            for format in [QuantFormat::Q4K, QuantFormat::Q6K] {
                check(format, (n, QK * supers, m, skip), seed)?;
            }
        }

        /// Panels of 32-value blocks (Q8_0, Q4_0, Q5_0), rows of any count of blocks.
        #[test]
        fn block_panels_equal_the_scalar_products(
            blocks in 1usize..20,
            n in 1usize..40,
            m in 1usize..11,
            skip in 0usize..3,
            seed in any::<u64>(),
        ) {
            for format in [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Q5_0] {
                check(format, (n, QA * blocks, m, skip), seed)?;
            }
        }
    }
}
