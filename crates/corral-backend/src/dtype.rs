//! Element types a buffer can hold.

use std::fmt;

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
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Whether a matmul weight may be stored in this type.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
        })
    }
}
