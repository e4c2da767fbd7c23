//! Deterministic normal values for synthetic weights. Every backend makes the same streams:
//! element `g` lies in chunk `g >> 16`, whose splitmix64 stream starts at
//! `seed ^ (chunk * 0xD6E8_FEB8_6659_FD93)`; each pair of elements takes the stream's next
//! two outputs through Box–Muller. The CUDA kernel computes any output of a stream directly.
//! Block-format weights are random bits with scales set for the same spread.

use rayon::prelude::*;

use crate::QuantFormat;

/// Elements per stream.
pub const CHUNK: usize = 1 << 16;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` normal values with standard deviation `std`, from the streams of `seed`.
pub fn normal_values(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut values = vec![0.0f32; n];
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut state = seed ^ (c as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            for pair in chunk.chunks_mut(2) {
                // Box–Muller on two uniforms in (0, 1].
                let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                let r = (-2.0 * u1.ln()).sqrt();
                let theta = std::f64::consts::TAU * u2;
                pair[0] = (r * theta.cos()) as f32 * std;
                if let Some(second) = pair.get_mut(1) {
                    *second = (r * theta.sin()) as f32 * std;
                }
            }
        });
    values
}

/// Where a synthetic block's scale (and min, for formats with one) sit, in bytes from the
/// block's start, and their bits: chosen so that values of random quants spread about `std`
/// around zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockScales {
    /// Byte of the scale `d`, its bits (f16, or f32 for FP8 blocks) and its width in bytes.
    pub d: (usize, u32, usize),
    /// Byte of the min (`dmin`, or Q4_1/Q5_1's `m`), and its f16 bits.
    pub min: Option<(usize, u16)>,
}

/// The scale fields of synthetic blocks of `format`. With uniform random quants (and 6- or
/// 8-bit sub-block scales), a value's standard deviation is `d` times: 73.9 (Q8_0), 4.61
/// (4-bit), 9.23 (5-bit), 257 (Q4_K), 525 (Q5_K), 1367 (Q6_K), 107.2 (random e4m3 bytes,
/// NaN codes moved to ±448); the min cancels the mean.
pub fn block_scales(format: QuantFormat, std: f32) -> BlockScales {
    let bits = |v: f32| half::f16::from_f32(v).to_bits();
    let (d_at, spread, min) = match format {
        QuantFormat::Q8_0 => (0, 73.9, None),
        QuantFormat::Q4_0 => (0, 4.61, None),
        QuantFormat::Q5_0 => (0, 9.23, None),
        QuantFormat::Q4_1 => (0, 4.61, Some((2, -7.5))),
        QuantFormat::Q5_1 => (0, 9.23, Some((2, -15.5))),
        QuantFormat::Q4K => (0, 257.0, Some((2, 7.5))),
        QuantFormat::Q5K => (0, 525.0, Some((2, 15.5))),
        QuantFormat::Q6K => (208, 1367.0, None),
        QuantFormat::F8E4M3x128 => {
            return BlockScales {
                d: (0, (std / 107.2).to_bits(), 4),
                min: None,
            };
        }
    };
    let d = std / spread;
    BlockScales {
        d: (d_at, u32::from(bits(d)), 2),
        min: min.map(|(at, times): (usize, f32)| (at, bits(d * times))),
    }
}

/// `len` values (whole blocks) of block format `format` for a synthetic weight: byte `k` is
/// byte `k % 8` (little-endian) of the `k / 8 + 1`-th splitmix64 output from state `seed`,
/// except each block's scale fields, which [`block_scales`] sets (and FP8 blocks' NaN codes,
/// moved to ±448). The CUDA kernel
/// `synthetic_blocks` writes the same bytes.
pub fn quant_blocks(format: QuantFormat, seed: u64, len: usize, std: f32) -> Vec<u8> {
    let (values, block_bytes) = format.block();
    let mut bytes = vec![0u8; len.div_ceil(values) * block_bytes];
    bytes
        .par_chunks_mut(8 * 4096)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut state =
                seed.wrapping_add(((c * 4096) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for word in chunk.chunks_mut(8) {
                let z = splitmix(&mut state).to_le_bytes();
                word.copy_from_slice(&z[..word.len()]);
            }
        });
    let scales = block_scales(format, std);
    let (d_at, d_bits, d_bytes) = scales.d;
    for block in bytes.chunks_exact_mut(block_bytes) {
        if format == QuantFormat::F8E4M3x128 {
            // e4m3's NaN codes (0x7f, 0xff) become ±448.
            for b in block.iter_mut().filter(|b| **b & 0x7f == 0x7f) {
                *b &= 0xfe;
            }
        }
        block[d_at..d_at + d_bytes].copy_from_slice(&d_bits.to_le_bytes()[..d_bytes]);
        if let Some((at, m_bits)) = scales.min {
            block[at..at + 2].copy_from_slice(&m_bits.to_le_bytes());
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format's synthetic values spread about the asked deviation around zero, and a
    /// seed's blocks are the same in any length's prefix (one stream, read in order).
    #[test]
    fn synthetic_blocks_spread_as_asked() {
        use QuantFormat::*;
        for format in [Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4K, Q5K, Q6K, F8E4M3x128] {
            let len = 256 * 200;
            let blocks = quant_blocks(format, 9, len, 0.02);
            let mut values = vec![0.0; len];
            crate::quant::dequantize(format, &blocks, &mut values);
            let mean = values.iter().map(|v| *v as f64).sum::<f64>() / len as f64;
            let var = values
                .iter()
                .map(|v| (*v as f64 - mean).powi(2))
                .sum::<f64>()
                / len as f64;
            let std = var.sqrt();
            // Q4_0 and Q5_0 quants are centred half a step low.
            assert!(mean.abs() < 0.003, "{}: mean {mean}", format.name());
            assert!(
                (0.017..0.023).contains(&std),
                "{}: std {std}",
                format.name()
            );
            let shorter = quant_blocks(format, 9, len / 2, 0.02);
            assert_eq!(shorter[..], blocks[..shorter.len()], "{}", format.name());
        }
    }
}
