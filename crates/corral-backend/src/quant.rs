//! Block-quantized weight formats (ggml's): their block shapes, and decoding blocks to f32
//! exactly as each format defines them (the same operations in the same order as ggml's
//! reference decoder, so that every value is bit-identical).

use half::f16;

/// Values in a k-quant super-block.
pub const QK_K: usize = 256;

/// A block-quantized format weights may be stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// Blocks of 32 4-bit values and an f16 scale.
    Q4_0,
    /// Blocks of 32 4-bit values, an f16 scale and min.
    Q4_1,
    /// Blocks of 32 5-bit values and an f16 scale.
    Q5_0,
    /// Blocks of 32 5-bit values, an f16 scale and min.
    Q5_1,
    /// Blocks of 32 8-bit values and an f16 scale.
    Q8_0,
    /// 4-bit k-quant super-blocks of 256, 6-bit scales and mins per 32.
    Q4K,
    /// 5-bit k-quant super-blocks of 256, 6-bit scales and mins per 32.
    Q5K,
    /// 6-bit k-quant super-blocks of 256, 8-bit scales per 16.
    Q6K,
    /// FP8 checkpoints' weights (e4m3) as row blocks of 128 values, each an f32 scale and
    /// 128 e4m3 bytes: a row of Qwen's 128×128 blocks, the block's scale with every row.
    F8E4M3x128,
}

impl QuantFormat {
    /// Every format.
    pub const ALL: [QuantFormat; 9] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::F8E4M3x128,
    ];

    /// (values, bytes) of one block.
    pub const fn block(self) -> (usize, usize) {
        match self {
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (QK_K, 144),
            Self::Q5K => (QK_K, 176),
            Self::Q6K => (QK_K, 210),
            Self::F8E4M3x128 => (128, 132),
        }
    }

    /// The name ggml gives it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::F8E4M3x128 => "F8_E4M3x128",
        }
    }

    /// Bytes of `len` values (whole blocks; a partial block counts whole).
    pub const fn bytes_of(self, len: usize) -> usize {
        let (values, bytes) = self.block();
        len.div_ceil(values) * bytes
    }
}

/// Encodes `values` (a multiple of 32) as Q8_0 blocks: per 32 values the scale
/// `d = max|x| / 127` (f16) and each `round(x / d)` as a signed byte.
pub fn encode_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(QuantFormat::Q8_0.bytes_of(values.len()));
    for block in values.chunks(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(amax / 127.0);
        let inv = if d.to_f32() > 0.0 {
            1.0 / d.to_f32()
        } else {
            0.0
        };
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend(
            block
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
}

/// Decodes `bytes` of `format` into `out` (one f32 per value): whole blocks, as many as
/// `out` holds.
pub fn dequantize(format: QuantFormat, bytes: &[u8], out: &mut [f32]) {
    let (block, block_bytes) = format.block();
    debug_assert_eq!(bytes.len() / block_bytes * block, out.len());
    let at = (block, block_bytes);
    match format {
        QuantFormat::Q4_0 => each_block(bytes, out, at, decode_q4_0),
        QuantFormat::Q4_1 => each_block(bytes, out, at, decode_q4_1),
        QuantFormat::Q5_0 => each_block(bytes, out, at, decode_q5_0),
        QuantFormat::Q5_1 => each_block(bytes, out, at, decode_q5_1),
        QuantFormat::Q8_0 => each_block(bytes, out, at, decode_q8_0),
        QuantFormat::Q4K => each_block(bytes, out, at, decode_q4_k),
        QuantFormat::Q5K => each_block(bytes, out, at, decode_q5_k),
        QuantFormat::Q6K => each_block(bytes, out, at, decode_q6_k),
        QuantFormat::F8E4M3x128 => each_block(bytes, out, at, decode_f8_x128),
    }
}

/// `decode` over each block of `block_bytes` bytes into `block` values: one loop per format,
/// the block's decoding inlined into it (not called through a pointer a block) so that the
/// compiler vectorizes it.
#[inline(always)]
fn each_block(
    bytes: &[u8],
    out: &mut [f32],
    (block, block_bytes): (usize, usize),
    decode: impl Fn(&[u8], &mut [f32]),
) {
    let pairs = bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block));
    pairs.for_each(|(b, o)| decode(b, o));
}

/// Whether integer products with weights of `format` read activations quantized per
/// super-block of 256 values (llama.cpp's Q8_K), on the CPU and the GPU alike, rather than per
/// 32: Q4_K's, whose 4-bit weights' error the coarser activations hide. Q6_K's read them per
/// 32 as Q5_K's do: one scale per 256 values costs its 6-bit weights more than their own
/// rounding (docs/performance-log.md, "Why Q6_K").
pub fn per_super_block(format: QuantFormat) -> bool {
    format == QuantFormat::Q4K
}

/// The f16 at byte `at` of a block, as f32.
pub fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_0: scale d, then 16 bytes whose low nibbles are values 0..16 and high nibbles 16..32,
/// each (q - 8) · d.
fn decode_q4_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: scale d and min m, then nibbles as Q4_0, each q · d + m.
fn decode_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0x0f) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of Q5_0/Q5_1's 32 values: bit j of the little-endian u32 for value j.
fn q5_high(qh: u32, j: usize) -> (u8, u8) {
    let lo = (((qh >> j) << 4) & 0x10) as u8;
    let hi = ((qh >> (j + 12)) & 0x10) as u8;
    (lo, hi)
}

/// Q5_0: scale d, the fifth bits, then nibbles as Q4_0; each (q - 16) · d.
fn decode_q5_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let (lo, hi) = q5_high(qh, j);
        out[j] = (((qs[j] & 0x0f) | lo) as i32 - 16) as f32 * d;
        out[j + 16] = (((qs[j] >> 4) | hi) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: scale d and min m, the fifth bits, then nibbles; each q · d + m.
fn decode_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let (lo, hi) = q5_high(qh, j);
        out[j] = ((qs[j] & 0x0f) | lo) as f32 * d + m;
        out[j + 16] = ((qs[j] >> 4) | hi) as f32 * d + m;
    }
}

/// Q8_0: scale d, then 32 signed bytes; each q · d.
fn decode_q8_0(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// Scale and min of sub-block j (0..8) of a Q4_K/Q5_K super-block, from its 12 packed bytes
/// of 6-bit values: j < 4 in the low six bits of bytes j and j + 4; j >= 4 from byte j + 4's
/// nibbles and the top two bits of bytes j - 4 and j.
pub fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// The scales and mins of sub-blocks 2i and 2i + 1 (the i-th 64 values) of a Q4_K/Q5_K
/// super-block: d·scale and dmin·min of each.
fn k_pair_scales(d: f32, dmin: f32, scales: &[u8], i: usize) -> [f32; 4] {
    let (sc1, m1) = k_scale_min(scales, 2 * i);
    let (sc2, m2) = k_scale_min(scales, 2 * i + 1);
    [
        d * sc1 as f32,
        dmin * m1 as f32,
        d * sc2 as f32,
        dmin * m2 as f32,
    ]
}

/// Q4_K: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles. Each 64 values: the low
/// nibbles of 32 bytes (sub-block 2i), then their high nibbles (2i + 1); each
/// d·scale · q - dmin·min.
fn decode_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for i in 0..4 {
        let q = &qs[32 * i..32 * i + 32];
        let [d1, min1, d2, min2] = k_pair_scales(d, dmin, scales, i);
        let o = &mut out[64 * i..64 * i + 64];
        for l in 0..32 {
            o[l] = d1 * (q[l] & 0x0f) as f32 - min1;
            o[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

/// Q5_K: as Q4_K with a fifth bit per value: bit 2i (low nibbles) and 2i + 1 (high nibbles)
/// of the 32 `qh` bytes, for the i-th 64 values.
fn decode_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for i in 0..4 {
        let q = &qs[32 * i..32 * i + 32];
        let [d1, min1, d2, min2] = k_pair_scales(d, dmin, scales, i);
        let (u1, u2) = (1u8 << (2 * i), 2u8 << (2 * i));
        let o = &mut out[64 * i..64 * i + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - min1;
            o[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - min2;
        }
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of two-bit highs, 16 signed scales, d. Each half
/// of 128 values: 32 lanes l, four values each (l, l + 32, l + 64, l + 96) from low nibbles of
/// ql[l], ql[l + 32], then their high nibbles, with bits 0-1, 2-3, 4-5, 6-7 of qh[l]; each
/// d · scale · (q - 32), scale 16 values at a time.
fn decode_q6_k(b: &[u8], out: &mut [f32]) {
    let d = half_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let o = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let scale = |k: usize| d * (sc[is + k] as i8) as f32;
            o[l] = scale(0) * q1 as f32;
            o[l + 32] = scale(2) * q2 as f32;
            o[l + 64] = scale(4) * q3 as f32;
            o[l + 96] = scale(6) * q4 as f32;
        }
    }
}

/// The value of an e4m3 byte (fn: no infinities; 0x7f and 0xff are NaN): 4 exponent bits
/// of bias 7, 3 mantissa bits, subnormals below 2^-6.
pub fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 15, b & 7);
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    let magnitude = if e == 0 {
        f32::from(m) / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + f32::from(m) / 8.0) * 2f32.powi(i32::from(e) - 7)
    };
    sign * magnitude
}

/// F8_E4M3x128: the f32 scale, then 128 e4m3 bytes; each e4m3 value · scale.
fn decode_f8_x128(b: &[u8], out: &mut [f32]) {
    let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in out.iter_mut().zip(&b[4..132]) {
        *o = e4m3_value(q) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0 blocks decode to their values within half a step of each block's scale, a
    /// block's largest value exactly (up to the f16 scale), and zeros to zeros.
    #[test]
    fn q8_0_encoding_decodes_within_half_a_step() {
        let values: Vec<f32> = (0..256)
            .map(|i| ((i * 7919 % 263) as f32 - 131.0) / 37.0 * if i < 64 { 0.01 } else { 1.0 })
            .chain(std::iter::repeat_n(0.0, 32))
            .collect();
        let blocks = encode_q8_0(&values);
        assert_eq!(blocks.len(), QuantFormat::Q8_0.bytes_of(values.len()));
        let mut back = vec![0.0; values.len()];
        dequantize(QuantFormat::Q8_0, &blocks, &mut back);
        for (block, decoded) in values.chunks(32).zip(back.chunks(32)) {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 127.0;
            for (v, d) in block.iter().zip(decoded) {
                assert!((v - d).abs() <= 0.5 * step + 1e-3 * amax, "{v} vs {d}");
            }
        }
        assert!(back[256..].iter().all(|&v| v == 0.0));
    }

    /// e4m3 (fn) values at its landmarks: zero, the smallest subnormal, the smallest normal,
    /// one, the largest finite value, signs, and the NaN codes.
    #[test]
    fn e4m3_bytes_decode_to_their_values() {
        assert_eq!(e4m3_value(0x00), 0.0);
        assert_eq!(e4m3_value(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_value(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_value(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_value(0x38), 1.0);
        assert_eq!(e4m3_value(0x3c), 1.5);
        assert_eq!(e4m3_value(0x7e), 448.0);
        assert_eq!(e4m3_value(0xb8), -1.0);
        assert!(e4m3_value(0x7f).is_nan() && e4m3_value(0xff).is_nan());
        // A block: the scale times each value.
        let mut block = vec![0u8; 132];
        block[..4].copy_from_slice(&0.5f32.to_le_bytes());
        block[4] = 0x38;
        block[131] = 0xc0;
        let mut out = vec![0.0; 128];
        dequantize(QuantFormat::F8E4M3x128, &block, &mut out);
        assert_eq!((out[0], out[1], out[127]), (0.5, 0.0, -1.0));
    }
}
