//! Dot products of block-quantized weight rows with activations quantized to int8 per 32
//! values (per 256 for Q4_K), as llama.cpp's CPU path runs them: integer products summed per
//! block, then one float multiply-add per block with the weight's and the activation's scales. AVX-512 VNNI
//! or AVX2 where the CPU has them (chosen at run time); a scalar loop otherwise, and as the
//! reference the tests hold the others to.

use std::sync::LazyLock;

use corral_backend::QuantFormat;
use corral_backend::quant::k_scale_min;

#[cfg(target_arch = "x86_64")]
mod several_rows;

/// Values per activation block.
pub(crate) const QA: usize = 32;

/// Rows of activations quantized per [`QA`] values: block `b` of a row is `d[b] · q[32 b..]`,
/// and `sums[2 b]`, `sums[2 b + 1]` are the sums of its two halves' `q` (for formats whose
/// values carry an offset or a min). Where asked for, also per super-block of [`QK`]
/// values, as Q4_K products read them (see [`SuperBlocks`]).
#[derive(Debug, Default)]
pub(crate) struct QuantizedRows {
    q: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
    supers: SuperBlocks,
    k: usize,
}

/// Values per super-block of the K-quant formats.
pub(crate) const QK: usize = 256;

/// Where sub-block `j` of a super-block sits in [`SuperBlocks::q`]: a 64-byte load of Q4_K
/// nibbles holds sub-blocks 4h, 4h + 2 in its low nibbles and 4h + 1, 4h + 3 in its high ones.
pub(super) const SUB_BLOCK_SLOT: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

/// Activations quantized with one scale `d[s]` per [`QK`] values (llama.cpp's Q8_K): the
/// sub-blocks' scales of a Q4_K weight then apply to integer sums, and only the
/// super-block's product is a float. `q` holds each super-block's sub-blocks of 32 in the
/// order [`SUB_BLOCK_SLOT`] gives; `sums[8 s + j]` is sub-block `j`'s sum (Q4_K's mins
/// read them).
#[derive(Debug, Default)]
struct SuperBlocks {
    q: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
}

/// One row of [`QuantizedRows`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ActRow<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sums: &'a [i16],
    /// Per super-block, or empty where not asked for.
    sq: &'a [i8],
    sd: &'a [f32],
    ss: &'a [i16],
}

impl ActRow<'_> {
    /// Whether this row holds `supers` super-blocks' activations.
    fn holds_super_blocks(&self, supers: usize) -> bool {
        self.sq.len() >= supers * QK && self.sd.len() >= supers && self.ss.len() >= supers * 8
    }
}

pub(crate) use corral_backend::quant::per_super_block;

/// Which quantizations of the activations products read: per block of [`QA`] values, per
/// super-block of [`QK`], or both.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ActBlocks {
    pub(crate) blocks: bool,
    pub(crate) super_blocks: bool,
}

impl ActBlocks {
    /// Those that products with weights of `formats` read.
    pub(crate) fn of(formats: impl IntoIterator<Item = QuantFormat>) -> Self {
        formats.into_iter().fold(Self::default(), |per, f| {
            let supers = per_super_block(f);
            Self {
                blocks: per.blocks || !supers,
                super_blocks: per.super_blocks || supers,
            }
        })
    }

    /// Both (tests).
    #[cfg(test)]
    pub(crate) const BOTH: Self = Self {
        blocks: true,
        super_blocks: true,
    };
}

impl QuantizedRows {
    /// Quantizes `m` rows of `k` values of `x` (`k` a multiple of [`QA`]), each block's
    /// largest magnitude to 127, rounding to nearest, ties to even: `per.blocks`, per
    /// [`QA`] values; `per.super_blocks` (`k` a multiple of [`QK`]), per super-block.
    pub(crate) fn quantize(&mut self, x: &[f32], m: usize, k: usize, per: ActBlocks) {
        debug_assert!(k.is_multiple_of(QA) && x.len() >= m * k);
        let blocks = if per.blocks { m * k / QA } else { 0 };
        self.k = k;
        self.q.resize(QA * blocks, 0);
        self.d.resize(blocks, 0.0);
        self.sums.resize(2 * blocks, 0);
        let isa = best_isa();
        for (b, (xb, qb)) in x[..QA * blocks]
            .chunks_exact(QA)
            .zip(self.q.chunks_exact_mut(QA))
            .enumerate()
        {
            let d = block_amax(isa, xb) / 127.0;
            quantize_by(isa, xb, d, qb);
            self.d[b] = d;
            // Each at most 16 · 127 in magnitude.
            let (lo, hi) = half_sums_on(isa, qb);
            self.sums[2 * b] = lo as i16;
            self.sums[2 * b + 1] = hi as i16;
        }
        let supers = &mut self.supers;
        if !per.super_blocks {
            supers.q.clear();
            supers.d.clear();
            supers.sums.clear();
            return;
        }
        assert!(k.is_multiple_of(QK), "super-blocks of rows of {k} values");
        supers.q.resize(m * k, 0);
        supers.d.resize(m * k / QK, 0.0);
        supers.sums.resize(m * k / QA, 0);
        for (s, (xs, qs)) in x[..m * k]
            .chunks_exact(QK)
            .zip(supers.q.chunks_exact_mut(QK))
            .enumerate()
        {
            let amax = xs
                .chunks_exact(QA)
                .fold(0.0f32, |a, b| a.max(block_amax(isa, b)));
            let d = amax / 127.0;
            supers.d[s] = d;
            for (j, xb) in xs.chunks_exact(QA).enumerate() {
                let qb = &mut qs[QA * SUB_BLOCK_SLOT[j]..][..QA];
                quantize_by(isa, xb, d, qb);
                let (lo, hi) = half_sums_on(isa, qb);
                // At most 32 · 127 in magnitude.
                supers.sums[8 * s + j] = (lo + hi) as i16;
            }
        }
    }

    /// Row `r`.
    #[inline(always)]
    pub(crate) fn row(&self, r: usize) -> ActRow<'_> {
        let (k, blocks) = if self.d.is_empty() {
            (0, 0)
        } else {
            (self.k, self.k / QA)
        };
        let supers = &self.supers;
        let has = !supers.d.is_empty();
        let full = self.k;
        let (sk, sblocks, ssums) = if has {
            (full, full / QK, full / QA)
        } else {
            (0, 0, 0)
        };
        ActRow {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[r * blocks..(r + 1) * blocks],
            sums: &self.sums[2 * r * blocks..2 * (r + 1) * blocks],
            sq: &supers.q[r * sk..(r + 1) * sk],
            sd: &supers.d[r * sblocks..(r + 1) * sblocks],
            ss: &supers.sums[r * ssums..(r + 1) * ssums],
        }
    }
}

/// Rows `first..` of [`QuantizedRows`]: the activations a product reads, which need not start
/// at the first row quantized (the per-token experts quantize every token's row once).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActRows<'a> {
    rows: &'a QuantizedRows,
    first: usize,
}

impl ActRows<'_> {
    /// Row `r` of these.
    #[inline(always)]
    fn row(&self, r: usize) -> ActRow<'_> {
        self.rows.row(self.first + r)
    }
}

impl<'a> ActRows<'a> {
    /// All rows from the first on, quantized per super-block: their values, scales and sums
    /// per 32 values (each row's after the last's).
    pub(super) fn super_blocks(&self) -> (&'a [i8], &'a [f32], &'a [i16]) {
        let (supers, k) = (&self.rows.supers, self.rows.k);
        let (from, per_qk, per_qa) = (self.first * k, self.first * k / QK, self.first * k / QA);
        (
            supers.q.get(from..).unwrap_or_default(),
            supers.d.get(per_qk..).unwrap_or_default(),
            supers.sums.get(per_qa..).unwrap_or_default(),
        )
    }

    /// All rows from the first on, quantized per block of [`QA`] values: their values,
    /// scales and sums of halves (each row's after the last's).
    pub(super) fn blocks(&self) -> (&'a [i8], &'a [f32], &'a [i16]) {
        let (rows, k) = (self.rows, self.rows.k);
        let per_qa = self.first * k / QA;
        (
            rows.q.get(self.first * k..).unwrap_or_default(),
            rows.d.get(per_qa..).unwrap_or_default(),
            rows.sums.get(2 * per_qa..).unwrap_or_default(),
        )
    }
}

impl QuantizedRows {
    /// The rows from `first` on.
    pub(crate) fn rows_from(&self, first: usize) -> ActRows<'_> {
        ActRows { rows: self, first }
    }
}

/// The sums of a block's two halves of 16 values.
fn half_sums(q: &[i8]) -> (i32, i32) {
    let half = |h: &[i8]| h.iter().map(|&v| i32::from(v)).sum::<i32>();
    (half(&q[..QA / 2]), half(&q[QA / 2..QA]))
}

/// [`half_sums`] by AVX2: the bytes offset to unsigned, summed eight at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn half_sums_avx2(q: &[i8]) -> (i32, i32) {
    use std::arch::x86_64::*;
    assert!(q.len() >= QA);
    // SAFETY: 32 bytes are in bounds (asserted); unaligned load.
    #[allow(unsafe_code)]
    let v = unsafe { _mm256_loadu_si256(q.as_ptr().cast()) };
    let sums = _mm256_sad_epu8(
        _mm256_xor_si256(v, _mm256_set1_epi8(i8::MIN)),
        _mm256_setzero_si256(),
    );
    // Lanes 0, 1 sum the first half's bytes, 2, 3 the second's, each offset by 128.
    let [a, b, c, d] = std::array::from_fn(|i| {
        let lanes: [i64; 4] = bytemuck::cast(sums);
        lanes[i] as i32
    });
    (a + b - 16 * 128, c + d - 16 * 128)
}

/// Quantizes 32 values into `q`, returning their scale: the largest magnitude maps to 127,
/// values round to nearest, ties to even (as the SIMD conversions do).
#[cfg(test)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let d = amax(x) / 127.0;
    quantize_scaled(x, d, q);
    d
}

/// The largest magnitude of `x`.
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// `q = x / d` rounded to nearest, ties to even (0 where `d` is 0).
fn quantize_scaled(x: &[f32], d: f32, q: &mut [i8]) {
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even() as i8;
    }
}

/// [`amax`] of a block of [`QA`] values on `isa`.
fn block_amax(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        Isa::Scalar => amax(&x[..QA]),
        // SAFETY (both): callers pass best_isa or below.
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Avx2 => unsafe { avx2::block_amax(x) },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Vnni => unsafe { vnni::block_amax(x) },
    }
}

/// [`quantize_scaled`] of a block of [`QA`] values on `isa`.
fn quantize_by(isa: Isa, x: &[f32], d: f32, q: &mut [i8]) {
    match isa {
        Isa::Scalar => quantize_scaled(&x[..QA], d, &mut q[..QA]),
        // SAFETY (both): callers pass best_isa or below.
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Avx2 => unsafe { avx2::quantize_scaled(x, d, q) },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Vnni => unsafe { vnni::quantize_scaled(x, d, q) },
    }
}

/// [`half_sums`] on `isa`.
fn half_sums_on(isa: Isa, q: &[i8]) -> (i32, i32) {
    match isa {
        Isa::Scalar => half_sums(q),
        // SAFETY: callers pass best_isa or below, which has AVX2.
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Avx2 | Isa::Vnni => unsafe { half_sums_avx2(q) },
    }
}

/// The instructions the dot products run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

/// The best this CPU has, or less where `CORRAL_CPU_ISA` (`avx2` or `scalar`) caps it: the
/// kernels of a smaller CPU measured and checked on a bigger one.
pub(crate) fn best_isa() -> Isa {
    static BEST: LazyLock<Isa> = LazyLock::new(|| {
        let cap = std::env::var("CORRAL_CPU_ISA").unwrap_or_default();
        if cap == "scalar" {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let vnni = has!("avx512vnni") && has!("avx512vl") && has!("avx512bw");
            if avx2 && vnni && cap != "avx2" {
                return Isa::Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    });
    *BEST
}

/// Whether weights of `format` have integer dot products here (the rest are decoded to f32).
pub(crate) fn supports(format: QuantFormat) -> bool {
    matches!(
        format,
        QuantFormat::Q8_0
            | QuantFormat::Q4_0
            | QuantFormat::Q5_0
            | QuantFormat::Q4K
            | QuantFormat::Q5K
            | QuantFormat::Q6K
    )
}

/// `out[r * n + j] = w_j · row r` for the `n` weight rows `w_j` packed in `w` (each as many
/// values as the rows of `acts`) and the first `m` rows of `acts`: one call for a tile of
/// weight rows, each read once for all `m` activation rows.
pub(crate) fn dot_rows(
    isa: Isa,
    format: QuantFormat,
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: &mut [f32],
) {
    let k = acts.rows.k;
    // The quantization of the activations this format's products read.
    let held = if per_super_block(format) {
        acts.rows.supers.q.len()
    } else {
        acts.rows.q.len()
    };
    assert!(
        k.is_multiple_of(format.block().0)
            && w.len() == n * format.bytes_of(k)
            && held >= (acts.first + m) * k
            && out.len() >= m * n,
        "quantized dot products over mismatched rows"
    );
    match isa {
        Isa::Scalar => each_row(w, n, acts, m, out, |w, a| scalar::dot(format, w, a)),
        // SAFETY (all): the caller picked an ISA the CPU has (best_isa or below). Several
        // activation rows of Q4_K or Q6_K: the weights' values unpacked once for them all.
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Avx2 if m >= 2 && matches!(format, QuantFormat::Q4K | QuantFormat::Q6K) => unsafe {
            if format == QuantFormat::Q6K {
                several_rows::rows::<true>(w, n, acts, m, out)
            } else {
                several_rows::rows::<false>(w, n, acts, m, out)
            }
        },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Avx2 => unsafe { avx2::dot_rows(format, w, n, acts, m, out) },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        Isa::Vnni => unsafe { vnni::dot_rows(format, w, n, acts, m, out) },
    }
}

/// [`dot_rows`] by `dot`, a (weight row, activation row) pair at a time.
#[inline(always)]
fn each_row(
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: &mut [f32],
    dot: impl Fn(&[u8], ActRow<'_>) -> f32,
) {
    let row_bytes = w.len() / n.max(1);
    for (j, wj) in w.chunks_exact(row_bytes.max(1)).take(n).enumerate() {
        for r in 0..m {
            out[r * n + j] = dot(wj, acts.row(r));
        }
    }
}

/// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block (its 12 bytes of them), as the
/// bytes of two little-endian words: [`k_scale_min`] for all eight at once, by bytes in words.
#[inline(always)]
pub(super) fn k_scales_mins(packed: &[u8]) -> (u64, u64) {
    let word =
        |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let scales_hi = (c & low4) | (((a >> 6) & top2) << 4);
    let mins_hi = ((c >> 4) & low4) | (((b >> 6) & top2) << 4);
    (
        u64::from(a & low6) | (u64::from(scales_hi) << 32),
        u64::from(b & low6) | (u64::from(mins_hi) << 32),
    )
}

/// The format's definitions, a value at a time.
mod scalar {
    use super::*;
    use corral_backend::quant::half_at;

    /// Σ u[i] · q[i] over one activation block's values `range`.
    fn isum(u: impl Fn(usize) -> i32, q: &[i8], range: std::ops::Range<usize>) -> i32 {
        range.map(|i| u(i) * i32::from(q[i])).sum()
    }

    pub(super) fn dot(format: QuantFormat, w: &[u8], a: ActRow<'_>) -> f32 {
        let (block, bytes) = format.block();
        let mut acc = 0.0f32;
        for (n, blk) in w.chunks_exact(bytes).enumerate() {
            // The first activation block of this weight block.
            let ab = n * block / QA;
            let q = |b: usize| &a.q[QA * (ab + b)..QA * (ab + b + 1)];
            let sum32 = |b: usize| {
                (i32::from(a.sums[2 * (ab + b)]) + i32::from(a.sums[2 * (ab + b) + 1])) as f32
            };
            match format {
                QuantFormat::Q8_0 => {
                    let s = isum(|i| i32::from(blk[2 + i] as i8), q(0), 0..QA);
                    acc += half_at(blk, 0) * a.d[ab] * s as f32;
                }
                QuantFormat::Q4_0 => {
                    let u = |i: usize| {
                        i32::from(if i < 16 {
                            blk[2 + i] & 15
                        } else {
                            blk[2 + i - 16] >> 4
                        })
                    };
                    let s = isum(u, q(0), 0..QA) as f32 - 8.0 * sum32(0);
                    acc += half_at(blk, 0) * a.d[ab] * s;
                }
                QuantFormat::Q5_0 => {
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    let u = |i: usize| {
                        let nib = if i < 16 {
                            blk[6 + i] & 15
                        } else {
                            blk[6 + i - 16] >> 4
                        };
                        i32::from(nib) | (((qh >> i) & 1) << 4) as i32
                    };
                    let s = isum(u, q(0), 0..QA) as f32 - 16.0 * sum32(0);
                    acc += half_at(blk, 0) * a.d[ab] * s;
                }
                QuantFormat::Q4K => {
                    // Integer sums per super-block (activations per super-block), scaled once.
                    let (d, dmin, dx) = (half_at(blk, 0), half_at(blk, 2), a.sd[n]);
                    let (scales, qs) = (&blk[4..16], &blk[16..144]);
                    let (mut products, mut mins) = (0i32, 0i32);
                    for sb in 0..8 {
                        let xq = &a.sq[QK * n + QA * SUB_BLOCK_SLOT[sb]..][..QA];
                        let u = |l: usize| {
                            let byte = qs[32 * (sb / 2) + l];
                            i32::from(if sb % 2 == 0 { byte & 15 } else { byte >> 4 })
                        };
                        let (sc, m) = k_scale_min(scales, sb);
                        products += i32::from(sc) * isum(u, xq, 0..QA);
                        mins += i32::from(m) * i32::from(a.ss[8 * n + sb]);
                    }
                    acc += d * dx * products as f32 - dmin * dx * mins as f32;
                }
                QuantFormat::Q5K => {
                    let (d, dmin) = (half_at(blk, 0), half_at(blk, 2));
                    let scales = &blk[4..16];
                    let (qh, qs) = (&blk[16..48], &blk[48..176]);
                    for sb in 0..8 {
                        let i = sb / 2;
                        let u = |l: usize| {
                            let byte = qs[32 * i + l];
                            let nib = if sb % 2 == 0 { byte & 15 } else { byte >> 4 };
                            i32::from(nib | (((qh[l] >> sb) & 1) << 4))
                        };
                        let (sc, m) = k_scale_min(scales, sb);
                        let da = a.d[ab + sb];
                        acc += d * f32::from(sc) * da * isum(u, q(sb), 0..QA) as f32
                            - dmin * f32::from(m) * da * sum32(sb);
                    }
                }
                QuantFormat::Q6K => {
                    // Integer sums per sub-block of 32, each scaled by its activation block's.
                    let d = half_at(blk, 208);
                    for h in 0..2 {
                        let (ql, qh, sc) =
                            (&blk[64 * h..], &blk[128 + 32 * h..], &blk[192 + 8 * h..]);
                        for g in 0..4 {
                            let u = |l: usize| {
                                let low = match g {
                                    0 => ql[l] & 15,
                                    1 => ql[l + 32] & 15,
                                    2 => ql[l] >> 4,
                                    _ => ql[l + 32] >> 4,
                                };
                                i32::from(low | (((qh[l] >> (2 * g)) & 3) << 4))
                            };
                            let j = 4 * h + g;
                            let mut total = 0i32;
                            for half in 0..2 {
                                let range = 16 * half..16 * half + 16;
                                let offset = 32 * i32::from(a.sums[2 * (ab + j) + half]);
                                let scale = i32::from(sc[2 * g + half] as i8);
                                total += scale * (isum(u, q(j), range) - offset);
                            }
                            acc += d * a.d[ab + j] * total as f32;
                        }
                    }
                }
                _ => unreachable!("dot_rows is only given supported formats"),
            }
        }
        acc
    }
}

/// The f16 at byte `at` of a block, by F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
#[inline]
pub(super) fn half_at(b: &[u8], at: usize) -> f32 {
    use std::arch::x86_64::*;
    let bits = i32::from(u16::from_le_bytes([b[at], b[at + 1]]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// Eight f32 from `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn load8f(p: &[f32]) -> std::arch::x86_64::__m256 {
    assert!(p.len() >= 8);
    // SAFETY: 8 floats are in bounds (checked above); unaligned load.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm256_loadu_ps(p.as_ptr())
    }
}

/// Eight unsigned bytes (little-endian in `v`) as f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn u8x8(v: u64) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// The sums of eight activation blocks (from their 16 half sums), as f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn block_sums(halves: &[i16]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let pairs = _mm256_madd_epi16(half_sums16(halves), _mm256_set1_epi16(1));
    _mm256_cvtepi32_ps(pairs)
}

/// The sum of eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// The SIMD kernels of one instruction set: `$dp(u, s)` sums the products of 32 unsigned by
/// 32 signed bytes into eight i32 lanes (lane i: bytes 4i..4i + 3); `$q4k` is its Q4_K kernel.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_dot {
    ($isa:ident, $features:literal, $dp:ident, $q4k:ident) => {
        mod $isa {
            use std::arch::x86_64::*;

            use super::*;

            /// Eight lanes of a block of [`QA`] values.
            #[target_feature(enable = $features)]
            fn lanes(x: &[f32]) -> [__m256; 4] {
                assert!(x.len() >= QA);
                // SAFETY: 32 floats are in bounds (checked above); unaligned loads.
                #[allow(unsafe_code)]
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) })
            }

            /// [`super::amax`] of a block of [`QA`] values, eight lanes at a time.
            #[target_feature(enable = $features)]
            pub(super) fn block_amax(x: &[f32]) -> f32 {
                let abs = _mm256_set1_ps(f32::from_bits(0x7fff_ffff));
                let m = lanes(x).iter().fold(_mm256_setzero_ps(), |m, &v| {
                    _mm256_max_ps(m, _mm256_and_ps(v, abs))
                });
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
            }

            /// [`super::quantize_scaled`] of a block of [`QA`] values, eight lanes at a time.
            #[target_feature(enable = $features)]
            pub(super) fn quantize_scaled(x: &[f32], d: f32, q: &mut [i8]) {
                assert!(q.len() >= QA);
                let v = lanes(x);
                let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
                let i: [__m256i; 4] =
                    std::array::from_fn(|j| _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)));
                // Packing interleaves 128-bit lanes; the permute puts them back in order.
                let w = _mm256_packs_epi16(
                    _mm256_packs_epi32(i[0], i[1]),
                    _mm256_packs_epi32(i[2], i[3]),
                );
                let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                // SAFETY: 32 bytes are in bounds (checked above); unaligned store.
                #[allow(unsafe_code)]
                unsafe {
                    _mm256_storeu_si256(q.as_mut_ptr().cast(), w)
                };
            }

            /// The 32 nibbles of 16 bytes as bytes: the low nibbles (values 0..16), then the
            /// high ones (16..32), as Q4_0 and Q5_0 pack them.
            #[target_feature(enable = $features)]
            fn nibbles(packed: &[u8]) -> __m256i {
                assert!(packed.len() >= 16);
                // SAFETY: 16 bytes are in bounds (checked above); unaligned load.
                #[allow(unsafe_code)]
                let r = unsafe { _mm_loadu_si128(packed.as_ptr().cast()) };
                let m4 = _mm_set1_epi8(15);
                let (lo, hi) = (
                    _mm_and_si128(r, m4),
                    _mm_and_si128(_mm_srli_epi16::<4>(r), m4),
                );
                _mm256_set_m128i(hi, lo)
            }

            /// [`super::dot_rows`] on this instruction set: the format's kernel chosen once,
            /// then run on [`ROWS`] weight rows at a time.
            #[target_feature(enable = $features)]
            pub(super) fn dot_rows(
                format: QuantFormat,
                w: &[u8],
                n: usize,
                acts: ActRows<'_>,
                m: usize,
                out: &mut [f32],
            ) {
                match format {
                    QuantFormat::Q8_0 => {
                        in_groups(w, n, acts, m, out, |w, a| q8_0(w, a), |w, a| q8_0(w, a))
                    }
                    QuantFormat::Q4_0 => in_groups(
                        w,
                        n,
                        acts,
                        m,
                        out,
                        |w, a| q45_0::<ROWS, false>(w, a),
                        |w, a| q45_0::<1, false>(w, a),
                    ),
                    QuantFormat::Q5_0 => in_groups(
                        w,
                        n,
                        acts,
                        m,
                        out,
                        |w, a| q45_0::<ROWS, true>(w, a),
                        |w, a| q45_0::<1, true>(w, a),
                    ),
                    QuantFormat::Q4K => {
                        in_groups(w, n, acts, m, out, |w, a| $q4k(w, a), |w, a| $q4k(w, a))
                    }
                    QuantFormat::Q5K => {
                        in_groups(w, n, acts, m, out, |w, a| q5k(w, a), |w, a| q5k(w, a))
                    }
                    QuantFormat::Q6K => {
                        in_groups(w, n, acts, m, out, |w, a| q6k(w, a), |w, a| q6k(w, a))
                    }
                    _ => unreachable!("dot_rows is only given supported formats"),
                }
            }

            /// Q8_0 rows: per block, the weights' signs moved onto the activations so that
            /// the unsigned-by-signed product applies. Four blocks at a time: their integer
            /// sums reduced together, then scaled as one vector of four (a block at a time,
            /// each scale was a conversion, a multiply and a broadcast of its own).
            #[target_feature(enable = $features)]
            #[inline]
            fn q8_0<const R: usize>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
                let (_, bytes) = QuantFormat::Q8_0.block();
                let blocks = rows_of_blocks(&w, QuantFormat::Q8_0, a);
                let xq: &[u8] = bytemuck::cast_slice(a.q);
                let mut acc = [_mm_setzero_ps(); R];
                let quads = blocks / 4 * 4;
                for b0 in (0..quads).step_by(4) {
                    let x0 = load32(&xq[QA * b0..]);
                    let x1 = load32(&xq[QA * (b0 + 1)..]);
                    let x2 = load32(&xq[QA * (b0 + 2)..]);
                    let x3 = load32(&xq[QA * (b0 + 3)..]);
                    let d = &a.d[b0..b0 + 4];
                    // SAFETY: `d` holds four f32; unaligned load.
                    #[allow(unsafe_code)]
                    let da = unsafe { _mm_loadu_ps(d.as_ptr()) };
                    for r in 0..R {
                        let blk = &w[r][bytes * b0..bytes * (b0 + 4)];
                        let (b1, b2, b3) = (&blk[bytes..], &blk[2 * bytes..], &blk[3 * bytes..]);
                        // Lane i of each half: block i's partial sum.
                        let h = _mm256_hadd_epi32(
                            _mm256_hadd_epi32(q8_0_block(blk, x0), q8_0_block(b1, x1)),
                            _mm256_hadd_epi32(q8_0_block(b2, x2), q8_0_block(b3, x3)),
                        );
                        let sums = _mm_add_epi32(
                            _mm256_castsi256_si128(h),
                            _mm256_extracti128_si256::<1>(h),
                        );
                        let bits = |b: &[u8]| i16::from_le_bytes([b[0], b[1]]);
                        let dw = _mm_cvtph_ps(_mm_setr_epi16(
                            bits(blk),
                            bits(b1),
                            bits(b2),
                            bits(b3),
                            0,
                            0,
                            0,
                            0,
                        ));
                        acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(dw, da), acc[r]);
                    }
                }
                let mut out = [0.0f32; R];
                for r in 0..R {
                    let s = _mm_add_ps(acc[r], _mm_movehl_ps(acc[r], acc[r]));
                    out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)));
                    for b in quads..blocks {
                        let blk = &w[r][bytes * b..];
                        let p = q8_0_block(blk, load32(&xq[QA * b..]));
                        out[r] += hsum(_mm256_cvtepi32_ps(p)) * (half_at(blk, 0) * a.d[b]);
                    }
                }
                out
            }

            /// A Q8_0 block's (`blk`, scale first) products with 32 activations in eight
            /// lanes, the weights' signs moved onto the activations.
            #[target_feature(enable = $features)]
            #[inline]
            fn q8_0_block(blk: &[u8], x: __m256i) -> __m256i {
                let wv = load32(&blk[2..]);
                $dp(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv))
            }

            /// Q4_0 (or with `FIVE`, Q5_0) rows: unsigned values, their offset (8 or 16)
            /// taken off at the end by the activation block's sum.
            #[target_feature(enable = $features)]
            #[inline]
            fn q45_0<const R: usize, const FIVE: bool>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
                let format = if FIVE {
                    QuantFormat::Q5_0
                } else {
                    QuantFormat::Q4_0
                };
                let bytes = format.block().1;
                let blocks = rows_of_blocks(&w, format, a);
                let xq: &[u8] = bytemuck::cast_slice(a.q);
                let offset = if FIVE { 16.0 } else { 8.0 };
                let (mut acc, mut corr) = ([_mm256_setzero_ps(); R], [0.0f32; R]);
                for b in 0..blocks {
                    let x = load32(&xq[QA * b..]);
                    let sum = i32::from(a.sums[2 * b]) + i32::from(a.sums[2 * b + 1]);
                    let (da, sum) = (a.d[b], sum as f32);
                    for r in 0..R {
                        let blk = &w[r][bytes * b..];
                        let u = if FIVE {
                            let nibs = nibbles(&blk[6..22]);
                            // Bit i of qh is value i's fifth bit: byte i takes qh's byte
                            // i / 8, then tests its bit i % 8.
                            let qh = i32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            let spread = _mm256_shuffle_epi8(
                                _mm256_set1_epi32(qh),
                                _mm256_setr_epi8(
                                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2,
                                    2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                ),
                            );
                            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                            _mm256_or_si256(nibs, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                        } else {
                            nibbles(&blk[2..18])
                        };
                        let d = half_at(blk, 0) * da;
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps($dp(u, x)),
                            _mm256_set1_ps(d),
                            acc[r],
                        );
                        corr[r] += d * offset * sum;
                    }
                }
                let sums = hsums(acc);
                std::array::from_fn(|r| sums[r] - corr[r])
            }

            /// Q5_K rows: each 32-value sub-block's product times its scale and its
            /// activation block's, the mins taken off by the activation blocks' sums.
            #[target_feature(enable = $features)]
            #[inline]
            fn q5k<const R: usize>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
                let (block, bytes) = QuantFormat::Q5K.block();
                let blocks = rows_of_blocks(&w, QuantFormat::Q5K, a);
                let xq: &[u8] = bytemuck::cast_slice(a.q);
                let x = |b: usize| load32(&xq[QA * b..]);
                let (m4, one) = (_mm256_set1_epi8(15), _mm256_set1_epi8(1));
                let (mut acc, mut corr) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
                for n in 0..blocks {
                    let ab = n * block / QA;
                    let da = load8f(&a.d[ab..]);
                    let sums = block_sums(&a.sums[2 * ab..]);
                    for r in 0..R {
                        let blk = &w[r][bytes * n..bytes * (n + 1)];
                        let (d, dmin) = (half_at(blk, 0), half_at(blk, 2));
                        let (sc, mn) = k_scales_mins(&blk[4..16]);
                        let scales = _mm256_mul_ps(_mm256_mul_ps(u8x8(sc), _mm256_set1_ps(d)), da);
                        let mins = _mm256_mul_ps(_mm256_mul_ps(u8x8(mn), _mm256_set1_ps(dmin)), da);
                        corr[r] = _mm256_fmadd_ps(mins, sums, corr[r]);
                        let qs = &blk[48..176];
                        let mut qh = load32(&blk[16..48]);
                        for i in 0..4 {
                            let raw = load32(&qs[32 * i..]);
                            let nibs = [
                                _mm256_and_si256(raw, m4),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4),
                            ];
                            for (half, nib) in nibs.into_iter().enumerate() {
                                let sb = 2 * i + half;
                                let high = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, one));
                                qh = _mm256_srli_epi16::<1>(qh);
                                let u = _mm256_or_si256(nib, high);
                                let scale =
                                    _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(sb as i32));
                                let p = _mm256_cvtepi32_ps($dp(u, x(ab + sb)));
                                acc[r] = _mm256_fmadd_ps(p, scale, acc[r]);
                            }
                        }
                    }
                }
                hsums(std::array::from_fn(|r| _mm256_sub_ps(acc[r], corr[r])))
            }

            /// Q4_K rows, 256 bits wide, against activations per super-block: each
            /// sub-block's products summed into pairs of i16, which one multiply-add by its
            /// scale sums into i32; one float multiply-add a super-block.
            #[allow(dead_code)]
            #[target_feature(enable = $features)]
            #[inline]
            fn q4k<const R: usize>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
                let bytes = QuantFormat::Q4K.block().1;
                let blocks = super_block_rows(QuantFormat::Q4K, &w, a);
                let xq: &[u8] = bytemuck::cast_slice(a.sq);
                let m4 = _mm256_set1_epi8(15);
                let idx: [__m256i; 8] = std::array::from_fn(|j| load32(&SCALE_SPREAD[j]));
                let (mut acc, mut macc) = ([_mm256_setzero_ps(); R], [_mm_setzero_ps(); R]);
                for n in 0..blocks {
                    let x = |j: usize| load32(&xq[QK * n + QA * SUB_BLOCK_SLOT[j]..]);
                    let dx = a.sd[n];
                    let sums = load8i16(&a.ss[8 * n..]);
                    for r in 0..R {
                        let blk = &w[r][bytes * n..bytes * (n + 1)];
                        let (d, dmin) = (half_at(blk, 0), half_at(blk, 2));
                        let (sc, mn) = k_scales_mins(&blk[4..16]);
                        let scv = _mm256_set1_epi64x(sc as i64);
                        let mut iacc = _mm256_setzero_si256();
                        for i in 0..4 {
                            let raw = load32(&blk[16 + 32 * i..]);
                            let lo = _mm256_and_si256(raw, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                            for (j, u) in [(2 * i, lo), (2 * i + 1, hi)] {
                                let pairs = _mm256_maddubs_epi16(u, x(j));
                                let scale = _mm256_shuffle_epi8(scv, idx[j]);
                                iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(pairs, scale));
                            }
                        }
                        let scale = _mm256_set1_ps(d * dx);
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), scale, acc[r]);
                        macc[r] = min_sums(mn, sums, dmin * dx, macc[r]);
                    }
                }
                hsums(std::array::from_fn(|r| {
                    _mm256_sub_ps(acc[r], _mm256_zextps128_ps256(macc[r]))
                }))
            }

            /// Q6_K rows against activations per block of 32: 6-bit values offset by 32
            /// (taken off by the activations' sums of 16), each 32's products summed four
            /// to an i32 lane, the sixteen 16s' sums gathered, scaled by their signed 8-bit
            /// scales and paired into one vector's lanes, exactly ([`q6k_sub_block_sums`]);
            /// then one float multiply-add by the weights' and the activation blocks' scales
            /// a super-block.
            #[target_feature(enable = $features)]
            #[inline]
            fn q6k<const R: usize>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
                let (block, bytes) = QuantFormat::Q6K.block();
                let blocks = rows_of_blocks(&w, QuantFormat::Q6K, a);
                let xq: &[u8] = bytemuck::cast_slice(a.q);
                let mut acc = [_mm256_setzero_ps(); R];
                for n in 0..blocks {
                    let ab = n * block / QA;
                    let x = |j: usize| load32(&xq[QA * (ab + j)..]);
                    let da = load8f(&a.d[ab..]);
                    let halves = half_sums16(&a.sums[2 * ab..]);
                    for r in 0..R {
                        let blk = &w[r][bytes * n..bytes * (n + 1)];
                        let scales = load16(&blk[192..208]);
                        let offsets = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), halves);
                        let mut p = [_mm256_setzero_si256(); 8];
                        for h in 0..2 {
                            for (g, u) in q6k_half(blk, h).into_iter().enumerate() {
                                p[4 * h + g] = $dp(u, x(4 * h + g));
                            }
                        }
                        let exact = _mm256_sub_epi32(
                            q6k_sub_block_sums(p, scales),
                            _mm256_slli_epi32::<5>(offsets),
                        );
                        let scale = _mm256_mul_ps(da, _mm256_set1_ps(half_at(blk, 208)));
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
                    }
                }
                hsums(acc)
            }
        }
    };
}

/// Products of unsigned by signed bytes, four to a lane, by AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
fn dp_vnni(
    u: std::arch::x86_64::__m256i,
    s: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// As [`dp_vnni`] by AVX2: pairs into i16 (never saturating: every format's unsigned side
/// is at most 128, and 2 · 128 · 127 < 2^15), then pairs of those into i32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dp_avx2(
    u: std::arch::x86_64::__m256i,
    s: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// Weight rows per call of the SIMD kernels: the rows share their activation loads and
/// their final horizontal sums, and the call's fixed cost. On AVX2 (a Zen 3 EPYC), Q4_K_M
/// decode, 64 experts, alternated: one thread 1.32–1.40 against 1.54–1.64 ms a step with
/// two, two threads 0.84–0.86 against 0.91–1.17; on AVX-512 four measured equal to two.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 4;

/// Rows of at least this many bytes are read as [`ROWS`] long streams (row `j` with rows `j`
/// plus a [`ROWS`]th of the product further on), shorter ones [`ROWS`] adjacent rows at a
/// time with the bytes ahead prefetched. On the 1.25B-parameter shape's Q8_0 decode (rows of
/// 1,088 bytes) adjacent pairs took 8.3 ms a step with any prefetch distance, long streams
/// 5.6 and one row at a time 6.6; on its Q4_K_M (576 bytes) and the 64-expert shape's Q8_0
/// (544) adjacent pairs were the faster, 4.0 against 4.4 and 1.13 against 1.38.
#[cfg(target_arch = "x86_64")]
const STREAM_ROW_BYTES: usize = 1024;

/// Bytes ahead of a group of adjacent rows that [`in_groups`] asks the cache for while the
/// group's products run: adjacent rows read a few at a time are short interleaved streams the
/// hardware prefetcher does not follow. On the 64-expert Q8_0 decode (one thread), 2 KiB took
/// a step from 3.5 ms to 2.0; 4 to 16 KiB were no better.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 2048;

/// [`dot_rows`] by `group`, [`ROWS`] weight rows against one activation row a call (long
/// rows a [`ROWS`]th of the product apart, short ones adjacent: [`STREAM_ROW_BYTES`]), and
/// by `one` for the rows left over.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn in_groups(
    w: &[u8],
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    out: &mut [f32],
    group: impl Fn([&[u8]; ROWS], ActRow<'_>) -> [f32; ROWS],
    one: impl Fn([&[u8]; 1], ActRow<'_>) -> [f32; 1],
) {
    let row_bytes = w.len() / n.max(1);
    let row = |j: usize| &w[j * row_bytes..(j + 1) * row_bytes];
    let streams = row_bytes >= STREAM_ROW_BYTES;
    // Group g holds rows first(g) + i · apart.
    let (groups, apart) = if streams {
        (n / ROWS, n / ROWS)
    } else {
        (n / ROWS, 1)
    };
    let first = |g: usize| if streams { g } else { ROWS * g };
    if !streams {
        for at in (0..PREFETCH_AHEAD.min(w.len())).step_by(64) {
            prefetch(w, at);
        }
    }
    for g in 0..groups {
        let j = first(g);
        let rows = std::array::from_fn(|i| row(j + i * apart));
        if !streams {
            for at in (j * row_bytes..(j + ROWS) * row_bytes).step_by(64) {
                prefetch(w, at + PREFETCH_AHEAD);
            }
        }
        for r in 0..m {
            for (i, v) in group(rows, acts.row(r)).into_iter().enumerate() {
                out[r * n + j + i * apart] = v;
            }
        }
    }
    for j in ROWS * groups..n {
        for r in 0..m {
            out[r * n + j] = one([row(j)], acts.row(r))[0];
        }
    }
}

/// Asks the cache for the line holding byte `at` of `bytes` (past its end: nothing is read).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch(bytes: &[u8], at: usize) {
    // SAFETY: a prefetch is a hint: it reads nothing and never faults.
    #[allow(unsafe_code)]
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().wrapping_add(at).cast())
    };
}

/// The blocks of `format` in each of the rows `w`, which all hold as many values as `a`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn rows_of_blocks<const R: usize>(w: &[&[u8]; R], format: QuantFormat, a: ActRow<'_>) -> usize {
    let (values, bytes) = format.block();
    let blocks = weight_blocks(w, bytes);
    assert!(
        a.q.len() >= blocks * values && a.d.len() >= blocks * values / QA,
        "{format:?} products need activations per block of {QA}"
    );
    blocks
}

/// Thirty-two bytes from `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn load32(p: &[u8]) -> std::arch::x86_64::__m256i {
    assert!(p.len() >= 32);
    // SAFETY: 32 bytes are in bounds (checked above); unaligned load.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm256_loadu_si256(p.as_ptr().cast())
    }
}

/// Half `h` of the Q6_K super-block `blk`: the values of its sub-blocks `4 h..4 h + 4` of 32,
/// the low four bits from `ql` and the high two from `qh`, as unsigned bytes below 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_half(blk: &[u8], h: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let m4 = _mm256_set1_epi8(15);
    let ql0 = load32(&blk[64 * h..]);
    let ql1 = load32(&blk[64 * h + 32..]);
    let qh = load32(&blk[128 + 32 * h..]);
    [
        _mm256_or_si256(_mm256_and_si256(ql0, m4), q6k_high(qh)),
        _mm256_or_si256(
            _mm256_and_si256(ql1, m4),
            q6k_high(_mm256_srli_epi16::<2>(qh)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
            q6k_high(_mm256_srli_epi16::<4>(qh)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            q6k_high(_mm256_srli_epi16::<6>(qh)),
        ),
    ]
}

/// Lane `j`: a Q6_K super-block's sub-block `j` of 32 values, its integer products with
/// the activations (`p[j]`: lanes 0..4 the first 16 values', 4..8 the last 16's) times its
/// two signed scales (the super-block's 16 bytes of them, `scales`), exactly: pairwise adds
/// within each 128-bit half leave each 16's sum in a lane, which one multiply scales; then
/// the halves are added.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn q6k_sub_block_sums(
    p: [std::arch::x86_64::__m256i; 8],
    scales: std::arch::x86_64::__m128i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // Four vectors' sums of 16 values: lane g, 16 values 0..16 of vector g; lane 4 + g, 16..32.
    let quad = |v: &[__m256i]| {
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
    };
    // Scale 2 j + h goes with the sums of sub-block j's half h.
    let order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    let scales = _mm_shuffle_epi8(scales, order);
    let lo = _mm256_mullo_epi32(quad(&p[..4]), _mm256_cvtepi8_epi32(scales));
    let hi = _mm256_mullo_epi32(
        quad(&p[4..]),
        _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(scales)),
    );
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(lo, hi),
        _mm256_permute2x128_si256::<0x31>(lo, hi),
    )
}

/// The sixteen sums of halves of eight activation blocks (`sums`, from [`QuantizedRows`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn half_sums16(sums: &[i16]) -> std::arch::x86_64::__m256i {
    load32(bytemuck::cast_slice(&sums[..16]))
}

/// The low two bits of each byte of `v`, as bits 4 and 5.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn q6k_high(v: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_slli_epi16::<4>(_mm256_and_si256(v, _mm256_set1_epi8(3)))
}

/// For each Q4_K sub-block `j`, the shuffle that spreads scale byte `j` over sixteen i16 lanes
/// (high bytes zero).
#[cfg(target_arch = "x86_64")]
pub(super) const SCALE_SPREAD: [[u8; 32]; 8] = scale_spread();

/// [`SCALE_SPREAD`].
#[cfg(target_arch = "x86_64")]
const fn scale_spread() -> [[u8; 32]; 8] {
    let mut idx = [[0u8; 32]; 8];
    let mut j = 0;
    while j < 8 {
        let mut b = 0;
        while b < 32 {
            idx[j][b] = if b % 2 == 0 { j as u8 } else { 0x80 };
            b += 1;
        }
        j += 1;
    }
    idx
}

/// The blocks of `bytes` in each of the rows `w`, which all hold as many.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn weight_blocks<const R: usize>(w: &[&[u8]; R], bytes: usize) -> usize {
    let blocks = w[0].len() / bytes;
    assert!(
        w.iter().all(|w| w.len() == blocks * bytes),
        "quantized rows of different lengths"
    );
    blocks
}

/// The super-blocks in each of the rows `w` of `format`, whose products read `a` per
/// super-block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn super_block_rows<const R: usize>(format: QuantFormat, w: &[&[u8]; R], a: ActRow<'_>) -> usize {
    let blocks = weight_blocks(w, format.block().1);
    assert!(
        a.holds_super_blocks(blocks),
        "{format:?} products need activations per super-block"
    );
    blocks
}

/// Sixteen bytes from `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn load16(p: &[u8]) -> std::arch::x86_64::__m128i {
    assert!(p.len() >= 16);
    // SAFETY: 16 bytes are in bounds (checked above); unaligned load.
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_loadu_si128(p.as_ptr().cast())
    }
}

/// Eight i16 from `p`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn load8i16(p: &[i16]) -> std::arch::x86_64::__m128i {
    load16(bytemuck::cast_slice(&p[..8]))
}

/// `acc` plus `scale` times the four pair sums of a super-block's eight 6-bit mins (the bytes
/// of `mins`) times its activation sub-blocks' sums `sums`: the lanes sum to the mins' term.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn min_sums(
    mins: u64,
    sums: std::arch::x86_64::__m128i,
    scale: f32,
    acc: std::arch::x86_64::__m128,
) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let products = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mins as i64)), sums);
    _mm_fmadd_ps(_mm_cvtepi32_ps(products), _mm_set1_ps(scale), acc)
}

/// The sums of each vector's eight lanes, four vectors at a time by pairwise adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn hsums<const R: usize>(v: [std::arch::x86_64::__m256; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut out = [0.0f32; R];
    let mut quads = v.chunks_exact(4);
    for (q, o) in (&mut quads).zip(out.chunks_exact_mut(4)) {
        let (a, b) = (_mm256_hadd_ps(q[0], q[1]), _mm256_hadd_ps(q[2], q[3]));
        // Lane i of the two halves of c: vector i's first four lanes, and its last four.
        let c = _mm256_hadd_ps(a, b);
        let s = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c));
        o.copy_from_slice(&bytemuck::cast::<__m128, [f32; 4]>(s));
    }
    let done = R - quads.remainder().len();
    for (o, &v) in out[done..].iter_mut().zip(quads.remainder()) {
        *o = hsum(v);
    }
    out
}

/// Q4_K rows 512 bits wide, by AVX-512 BW and VNNI, against activations per super-block: a
/// super-block's 128 bytes of nibbles as two 64-byte loads, each two registers of 64 values
/// (sub-blocks 4h, 4h + 2 in the low nibbles, 4h + 1, 4h + 3 in the high), which the
/// activations are held in the order of; their products summed into pairs of i16, which
/// `vpdpwssd` multiplies by their sub-blocks' scales and sums into i32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
fn wide_q4k<const R: usize>(w: [&[u8]; R], a: ActRow<'_>) -> [f32; R] {
    use std::arch::x86_64::*;
    let bytes = QuantFormat::Q4K.block().1;
    let blocks = super_block_rows(QuantFormat::Q4K, &w, a);
    let load = |p: &[u8]| {
        assert!(p.len() >= 64);
        // SAFETY: 64 bytes are in bounds (checked above); unaligned load.
        #[allow(unsafe_code)]
        unsafe {
            _mm512_loadu_si512(p.as_ptr().cast())
        }
    };
    let xq: &[u8] = bytemuck::cast_slice(a.sq);
    let m4 = _mm512_set1_epi8(15);
    // Scale byte `lo` spread over the low 256 bits' sixteen i16 lanes, `hi` over the high
    // ones', high bytes zero.
    let spread = |lo: u8, hi: u8| {
        let idx: [u8; 64] = std::array::from_fn(|b| {
            if b % 2 == 1 {
                0x80
            } else if b < 32 {
                lo
            } else {
                hi
            }
        });
        load(&idx)
    };
    let idx = [[spread(0, 2), spread(1, 3)], [spread(4, 6), spread(5, 7)]];
    let (mut acc, mut macc) = ([_mm512_setzero_ps(); R], [_mm_setzero_ps(); R]);
    for n in 0..blocks {
        // Sub-blocks (0, 2), (1, 3), (4, 6), (5, 7).
        let x: [__m512i; 4] = std::array::from_fn(|i| load(&xq[QK * n + 64 * i..]));
        let dx = a.sd[n];
        let sums = load8i16(&a.ss[8 * n..]);
        for r in 0..R {
            let blk = &w[r][bytes * n..bytes * (n + 1)];
            let (d, dmin) = (half_at(blk, 0), half_at(blk, 2));
            let (sc, mn) = k_scales_mins(&blk[4..16]);
            let scv = _mm512_set1_epi64(sc as i64);
            let mut iacc = _mm512_setzero_si512();
            for h in 0..2 {
                let raw = load(&blk[16 + 64 * h..]);
                let lo = _mm512_and_si512(raw, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                for (u, x, idx) in [(lo, x[2 * h], idx[h][0]), (hi, x[2 * h + 1], idx[h][1])] {
                    let pairs = _mm512_maddubs_epi16(u, x);
                    iacc = _mm512_dpwssd_epi32(iacc, pairs, _mm512_shuffle_epi8(scv, idx));
                }
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(d * dx), acc[r]);
            macc[r] = min_sums(mn, sums, dmin * dx, macc[r]);
        }
    }
    hsums(std::array::from_fn(|r| {
        let v = acc[r];
        let halves = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        _mm256_sub_ps(halves, _mm256_zextps128_ps256(macc[r]))
    }))
}

#[cfg(target_arch = "x86_64")]
simd_dot!(avx2, "avx2,fma,f16c", dp_avx2, q4k);
#[cfg(target_arch = "x86_64")]
simd_dot!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
    dp_vnni,
    wide_q4k
);

#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;

    use super::*;

    const FORMATS: [QuantFormat; 6] = [
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q5_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
    ];

    /// The ISAs this CPU runs.
    fn isas() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                isas.push(Isa::Avx2);
            }
            if best_isa() == Isa::Vnni {
                isas.push(Isa::Vnni);
            }
        }
        isas
    }

    /// A xorshift generator from `seed`, for reproducible random inputs.
    pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut state = seed | 1;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// `blocks` random blocks of `format` whose f16 scales are finite and positive.
    pub(crate) fn random_blocks(
        format: QuantFormat,
        blocks: usize,
        next: &mut impl FnMut() -> u64,
    ) -> Vec<u8> {
        let bytes = format.block().1;
        let mut w: Vec<u8> = (0..blocks * bytes).map(|_| next() as u8).collect();
        let scale_at: &[usize] = match format {
            QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
            QuantFormat::Q6K => &[208],
            _ => &[0],
        };
        for blk in w.chunks_exact_mut(bytes) {
            for &at in scale_at {
                let v = 0.001 + (next() % 1000) as f32 * 1e-4;
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        w
    }

    /// Products over several activation rows at once equal, on every ISA, the scalar
    /// definition a row at a time.
    #[test]
    fn several_rows_at_once_equal_one_row_at_a_time() {
        let mut next = xorshift(11);
        // Rows of 512 values are read in adjacent groups, of 2,048 as long streams (every
        // format's row then at least STREAM_ROW_BYTES).
        let shapes = [(1, 3), (2, 9), (4, 4), (5, 13), (7, 6), (9, 1)].map(|(m, n)| (512, m, n));
        for (k, m, n) in shapes.into_iter().chain([(2048, 1, 7), (2048, 3, 4)]) {
            let x: Vec<f32> = (0..m * k)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .collect();
            let mut acts = QuantizedRows::default();
            acts.quantize(&x, m, k, ActBlocks::BOTH);
            for format in FORMATS {
                let w = random_blocks(format, n * k / format.block().0, &mut next);
                let want: Vec<f32> = (0..m * n)
                    .map(|i| {
                        let (r, j) = (i / n, i % n);
                        let row = format.bytes_of(k);
                        let mut out = [f32::NAN];
                        dot_rows(
                            Isa::Scalar,
                            format,
                            &w[j * row..(j + 1) * row],
                            1,
                            acts.rows_from(r),
                            1,
                            &mut out,
                        );
                        out[0]
                    })
                    .collect();
                for isa in isas() {
                    let mut got = vec![f32::NAN; m * n];
                    dot_rows(isa, format, &w, n, acts.rows_from(0), m, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{format:?} on {isa:?}, {m} rows of {k}: output {i} {g} against {w}"
                        );
                    }
                }
            }
        }
    }

    /// Products over formats of both kinds quantize the activations both ways; over one
    /// kind, that way only.
    #[test]
    fn activations_are_quantized_as_the_formats_read_them() {
        let of = |formats: &[QuantFormat]| {
            let per = ActBlocks::of(formats.iter().copied());
            (per.blocks, per.super_blocks)
        };
        assert_eq!(of(&[]), (false, false));
        assert_eq!(of(&[QuantFormat::Q4K]), (false, true));
        assert_eq!(of(&[QuantFormat::Q4K, QuantFormat::Q6K]), (true, true));
        assert_eq!(
            of(&[QuantFormat::Q8_0, QuantFormat::Q5K, QuantFormat::Q6K]),
            (true, false)
        );
        assert_eq!(of(&[QuantFormat::Q4K, QuantFormat::Q8_0]), (true, true));
        assert_eq!(of(&[QuantFormat::Q8_0, QuantFormat::Q4K]), (true, true));
    }

    /// The AVX2 half sums of an activation block are the scalar ones, extremes included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_half_sums_equal_the_scalar_ones() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut next = xorshift(7);
        let mut blocks: Vec<[i8; QA]> = (0..200)
            .map(|_| std::array::from_fn(|_| next() as i8))
            .collect();
        blocks.push([i8::MIN; QA]);
        blocks.push([i8::MAX; QA]);
        for q in &blocks {
            // SAFETY: the CPU has AVX2 (checked above).
            #[allow(unsafe_code)]
            let simd = unsafe { half_sums_avx2(q) };
            assert_eq!(simd, half_sums(q), "{q:?}");
        }
    }

    /// The word-wise scales and mins of a K-quant super-block are the format's, byte by byte,
    /// for every byte value in every position.
    #[test]
    fn k_scales_mins_unpack_as_the_format_defines() {
        for position in 0..12 {
            for value in 0..=255u8 {
                let mut packed = [0x5au8; 12];
                packed[position] = value;
                let (scales, mins) = k_scales_mins(&packed);
                for j in 0..8 {
                    let (sc, m) = k_scale_min(&packed, j);
                    assert_eq!(
                        (scales >> (8 * j)) as u8,
                        sc,
                        "scale {j}, byte {position} = {value}"
                    );
                    assert_eq!(
                        (mins >> (8 * j)) as u8,
                        m,
                        "min {j}, byte {position} = {value}"
                    );
                }
            }
        }
    }

    /// The SIMD quantization gives the scalar one's values and scale exactly, ties included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_quantization_equals_the_scalar_one() {
        if best_isa() == Isa::Scalar {
            return;
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..200 {
            let x: Vec<f32> = (0..QA)
                .map(|i| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let v = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    // Some blocks hold exact halves of a step (ties), one all zeros.
                    match case % 4 {
                        0 => (v * 20.0).round() / 2.0 * if i == 0 { 127.0 / 10.0 } else { 1.0 },
                        1 => 0.0,
                        _ => v * 10f32.powi(case % 7 - 3),
                    }
                })
                .collect();
            let mut scalar = [0i8; QA];
            let d = quantize_block(&x, &mut scalar);
            for isa in isas().into_iter().filter(|&isa| isa != Isa::Scalar) {
                let mut simd = [0i8; QA];
                let d_simd = block_amax(isa, &x) / 127.0;
                quantize_by(isa, &x, d_simd, &mut simd);
                assert_eq!((d, scalar), (d_simd, simd), "{isa:?}, case {case}: {x:?}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every ISA gives the scalar definition's dot product (up to float summation order),
        /// and that is the dot product of the decoded weights with the activations, within
        /// what quantizing the activations can move it: half a step of each block's scale
        /// for each value (of each super-block's scale, for formats whose products read
        /// activations per super-block).
        #[test]
        fn integer_dot_products_equal_the_decoded_weights_within_activation_rounding(
            superblocks in 1usize..4,
            // Blocks of 32 past the super-blocks, for formats with blocks of 32: kernels that
            // take blocks four at a time have some left over.
            extra in 0usize..4,
            seed in any::<u64>(),
            spread in 0u32..3,
        ) {
            let mut next = xorshift(seed);
            let k = 256 * superblocks + QA * extra;
            // Activations of very different magnitudes from block to block.
            let x: Vec<f32> = (0..k)
                .map(|i| {
                    let v = (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    v * 10f32.powi((i / QA) as i32 % (spread as i32 + 1) - 1)
                })
                .collect();
            for format in FORMATS {
                let k = if format.block().0 == QA { k } else { 256 * superblocks };
                let x: &[f32] = &x[..k];
                let mut acts = QuantizedRows::default();
                acts.quantize(x, 1, k, ActBlocks::of([format]));
                let w = random_blocks(format, k / format.block().0, &mut next);
                let mut decoded = vec![0.0f32; k];
                corral_backend::quant::dequantize(format, &w, &mut decoded);
                let exact: f64 = decoded.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                let magnitude: f64 = decoded.iter().zip(x).map(|(&a, &b)| f64::from((a * b).abs())).sum();
                // Activations are quantized per block of QA values, or per super-block.
                let act_block = if per_super_block(format) { QK } else { QA };
                let rounding: f64 = decoded
                    .chunks_exact(act_block)
                    .zip(x.chunks_exact(act_block))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        f64::from(amax / 127.0 / 2.0) * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
                    })
                    .sum();
                let one = |isa| {
                    let mut out = [f32::NAN];
                    dot_rows(isa, format, &w, 1, acts.rows_from(0), 1, &mut out);
                    out[0]
                };
                let reference = one(Isa::Scalar);
                prop_assert!(
                    (f64::from(reference) - exact).abs() <= rounding * 1.001 + 1e-5 * magnitude,
                    "{format:?}: integer dot {reference} against decoded {exact}, bound {rounding}"
                );
                for isa in isas() {
                    let got = one(isa);
                    prop_assert!(
                        (got - reference).abs() <= 1e-5 * (magnitude as f32 + 1e-6),
                        "{format:?} on {isa:?}: {got} against the scalar {reference}"
                    );
                }
            }
        }
    }
}
