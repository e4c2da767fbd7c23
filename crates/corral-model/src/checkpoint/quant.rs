//! ggml's element and block types, and decoding them to f32 (block formats by the backend's
//! decoders, bit-identical to ggml's).

use corral_backend::QuantFormat;
use corral_backend::quant::QK_K;
use half::{bf16, f16};

/// A ggml tensor type: a plain element type or a block-quantized format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit floats.
    F32,
    /// IEEE half floats.
    F16,
    /// bfloat16.
    BF16,
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
    /// 2-bit k-quant super-blocks of 256 (not decoded).
    Q2K,
    /// 3-bit k-quant super-blocks of 256 (not decoded).
    Q3K,
    /// 4-bit k-quant super-blocks of 256, 6-bit scales and mins per 32.
    Q4K,
    /// 5-bit k-quant super-blocks of 256, 6-bit scales and mins per 32.
    Q5K,
    /// 6-bit k-quant super-blocks of 256, 8-bit scales per 16.
    Q6K,
    /// 8-bit k-quant super-blocks (activations in ggml; not decoded).
    Q8K,
}

impl GgmlType {
    /// The type of ggml type id `id`, or None for one Corral does not know.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// The name ggml gives it.
    pub fn name(self) -> &'static str {
        if let Some(format) = self.quant_format() {
            return format.name();
        }
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            // Q8_K; the block formats Corral reads were named above.
            _ => "Q8_K",
        }
    }

    /// (values, bytes) of one block; plain types are blocks of one value.
    pub fn block(self) -> (usize, usize) {
        if let Some(format) = self.quant_format() {
            return format.block();
        }
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q2K => (QK_K, 84),
            Self::Q3K => (QK_K, 110),
            // Q8_K; the block formats Corral reads were sized above.
            _ => (QK_K, 292),
        }
    }

    /// Whether Corral decodes this type.
    pub fn is_decodable(self) -> bool {
        !matches!(self, Self::Q2K | Self::Q3K | Self::Q8K)
    }

    /// The block format of a block-quantized type Corral decodes.
    pub fn quant_format(self) -> Option<QuantFormat> {
        Some(match self {
            Self::Q4_0 => QuantFormat::Q4_0,
            Self::Q4_1 => QuantFormat::Q4_1,
            Self::Q5_0 => QuantFormat::Q5_0,
            Self::Q5_1 => QuantFormat::Q5_1,
            Self::Q8_0 => QuantFormat::Q8_0,
            Self::Q4K => QuantFormat::Q4K,
            Self::Q5K => QuantFormat::Q5K,
            Self::Q6K => QuantFormat::Q6K,
            _ => return None,
        })
    }
}

/// Decodes `bytes` of type `ty` into `out` (one f32 per value). `bytes` must hold exactly
/// `out.len()` values, in whole blocks; the caller checks that (a tensor's size is checked
/// when its file is read). Returns false for a type Corral does not decode.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> bool {
    let plain: fn(&[u8]) -> f32 = match ty {
        GgmlType::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b| f16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::BF16 => |b| bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => match ty.quant_format() {
            Some(format) => {
                corral_backend::quant::dequantize(format, bytes, out);
                return true;
            }
            None => return false,
        },
    };
    let size = ty.block().1;
    for (b, o) in bytes.chunks_exact(size).zip(out.iter_mut()) {
        *o = plain(b);
    }
    true
}
