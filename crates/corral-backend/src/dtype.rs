//! Element types a buffer can hold.

use std::fmt;

use crate::QuantFormat;

/// Element type of a [`crate::DeviceBuffer`] or of a checkpoint tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32: activations, KV cache, recurrent state.
    F32,
    /// bfloat16: weights.
    BF16,
    /// IEEE binary16: weights.
    F16,
    /// Unsigned 32-bit integers: token ids, positions, slot mappings, expert ids.
    U32,
    /// fp8 e4m3 bytes: a KV cache on the GPU, each slot's row followed by its heads' f32
    /// scales ([`kv_row_elems`]).
    F8E4M3,
    /// Block-quantized weights (ggml's formats), kept so in memory where a backend reads them
    /// directly; a buffer's length counts values.
    Quant(QuantFormat),
}

impl DType {
    /// Bytes per element; for a block format, of a block ([`DType::bytes_of`] counts values).
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
            DType::Quant(format) => format.block().1,
        }
    }

    /// Bytes of `len` values.
    pub const fn bytes_of(self, len: usize) -> usize {
        match self {
            DType::Quant(format) => format.bytes_of(len),
            _ => len * self.size_bytes(),
        }
    }

    /// Values a run of this type must start and end at a multiple of (a block format's block).
    pub const fn block_values(self) -> usize {
        match self {
            DType::Quant(format) => format.block().0,
            _ => 1,
        }
    }

    /// Whether a matmul weight may be stored in this type.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::U32 | DType::F8E4M3)
    }

    /// Appends the values of little-endian `bytes` of this type to `out`, for f32, bf16 and
    /// f16 (whole elements); false, appending nothing, for any other type.
    pub fn extend_f32(self, bytes: &[u8], out: &mut Vec<f32>) -> bool {
        let n = self.size_bytes();
        let chunks = bytes.chunks_exact(n);
        match self {
            DType::F32 => out.extend(chunks.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            DType::BF16 => {
                out.extend(chunks.map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()))
            }
            DType::F16 => {
                out.extend(chunks.map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()))
            }
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => return false,
        }
        true
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
            DType::F8E4M3 => "fp8",
            DType::Quant(format) => return write!(f, "{}", format.name().to_lowercase()),
        })
    }
}

/// Elements of one KV cache slot (one token's K, or V, of every KV head) in a cache of
/// `dtype`: the row itself, and for fp8 the heads' f32 scales right after it (head dims are
/// multiples of 4), the whole padded to 16 bytes so that every row starts 16-byte aligned
/// (attention.cu's fp8_row_bytes).
pub const fn kv_row_elems(dtype: DType, kv_heads: usize, head_dim: usize) -> usize {
    let kv_dim = kv_heads * head_dim;
    match dtype {
        DType::F8E4M3 => (kv_dim + 4 * kv_heads).div_ceil(16) * 16,
        _ => kv_dim,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_bytes_decode_to_their_values_and_other_types_to_nothing() {
        let values = [1.5f32, -0.25, 3.0];
        let f32_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f16_bytes: Vec<u8> = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        for (dtype, bytes) in [
            (DType::F32, &f32_bytes),
            (DType::BF16, &bf16_bytes),
            (DType::F16, &f16_bytes),
        ] {
            let mut out = vec![9.0];
            assert!(dtype.extend_f32(bytes, &mut out), "{dtype}");
            assert_eq!(out, [9.0, 1.5, -0.25, 3.0], "{dtype}");
        }
        let mut out = Vec::new();
        assert!(!DType::U32.extend_f32(&f32_bytes, &mut out));
        assert!(out.is_empty());
    }
}
