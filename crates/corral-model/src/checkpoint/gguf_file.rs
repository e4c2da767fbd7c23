//! Reading a GGUF file's header: its metadata and the index of its tensors, every count,
//! length, type and offset checked against the file before anything is trusted, so that a
//! truncated or corrupt file is an error naming what is wrong, never a panic or a wild read.

use std::collections::HashMap;
use std::fmt;

use crate::checkpoint::quant::GgmlType;

/// The magic at the start of every GGUF file ("GGUF", little-endian).
const MAGIC: u32 = 0x4655_4747;
/// Data alignment when the file names none (`general.alignment`).
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Nesting of arrays a header may use (the format allows arrays of arrays).
const MAX_ARRAY_DEPTH: usize = 4;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// An unsigned 8-bit integer.
    U8(u8),
    /// A signed 8-bit integer.
    I8(i8),
    /// An unsigned 16-bit integer.
    U16(u16),
    /// A signed 16-bit integer.
    I16(i16),
    /// An unsigned 32-bit integer.
    U32(u32),
    /// A signed 32-bit integer.
    I32(i32),
    /// An unsigned 64-bit integer.
    U64(u64),
    /// A signed 64-bit integer.
    I64(i64),
    /// A 32-bit float.
    F32(f32),
    /// A 64-bit float.
    F64(f64),
    /// A bool (one byte, 0 or 1).
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values of one type.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Self::I8(v) => Some(v.into()),
                Self::I16(v) => Some(v.into()),
                Self::I32(v) => Some(v.into()),
                Self::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::I8(_) => "i8",
            Self::U16(_) => "u16",
            Self::I16(_) => "i16",
            Self::U32(_) => "u32",
            Self::I32(_) => "i32",
            Self::U64(_) => "u64",
            Self::I64(_) => "i64",
            Self::F32(_) => "f32",
            Self::F64(_) => "f64",
            Self::Bool(_) => "bool",
            Self::String(_) => "string",
            Self::Array(_) => "array",
        }
    }
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::String(s) => write!(f, "{s:?}"),
            Self::Array(v) => write!(f, "[{} values]", v.len()),
            Self::F32(v) => write!(f, "{v}"),
            Self::F64(v) => write!(f, "{v}"),
            Self::Bool(v) => write!(f, "{v}"),
            Self::I8(v) => write!(f, "{v}"),
            Self::I16(v) => write!(f, "{v}"),
            Self::I32(v) => write!(f, "{v}"),
            Self::I64(v) => write!(f, "{v}"),
            Self::U8(v) => write!(f, "{v}"),
            Self::U16(v) => write!(f, "{v}"),
            Self::U32(v) => write!(f, "{v}"),
            Self::U64(v) => write!(f, "{v}"),
        }
    }
}

/// One tensor of a GGUF file: where its bytes are and what they hold.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensor {
    /// Tensor name.
    pub name: String,
    /// Dimensions in ggml's order: `dims[0]` is the row length (the innermost).
    pub dims: Vec<u64>,
    /// Element or block type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the file.
    pub byte_offset: usize,
    /// Bytes of data.
    pub byte_len: usize,
}

impl GgufTensor {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major order (the outermost first), as safetensors and PyTorch give it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header: format version, metadata and tensor index.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
    /// Offset of the data section from the start of the file.
    pub data_offset: usize,
    /// Alignment of the data section and of each tensor's data.
    pub alignment: u64,
    by_key: HashMap<String, usize>,
}

impl GgufHeader {
    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.by_key.get(key).map(|&i| &self.metadata[i].1)
    }
}

/// What is wrong with a GGUF file, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufError(pub String);

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

type Parsed<T> = std::result::Result<T, GgufError>;

/// A little-endian reader over the file's bytes that fails, naming what it was reading, when
/// the bytes run out.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &dyn fmt::Display) -> Parsed<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                GgufError(format!(
                    "truncated: {what} needs {n} bytes at offset {}, the file has {}",
                    self.at,
                    self.bytes.len()
                ))
            })?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &dyn fmt::Display) -> Parsed<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn fmt::Display) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn fmt::Display) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// A count of items each at least `min_bytes` long, refused when the rest of the file
    /// could not hold that many (a corrupt count never becomes a huge allocation).
    fn count(&mut self, min_bytes: usize, what: &dyn fmt::Display) -> Parsed<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(min_bytes.max(1)) <= self.remaining());
        fits.ok_or_else(|| {
            GgufError(format!(
                "truncated or corrupt: {what} is {n}, more than the {} bytes left in the file \
                 can hold",
                self.remaining()
            ))
        })
    }

    fn string(&mut self, what: &dyn fmt::Display) -> Parsed<String> {
        let len = self.count(1, &format_args!("the length of {what}"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| GgufError(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, type_id: u32, what: &dyn fmt::Display, depth: usize) -> Parsed<GgufValue> {
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(GgufError(format!(
                        "{what}: bool byte {b} is neither 0 nor 1"
                    )));
                }
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError(format!(
                        "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem = self.u32(&format_args!("the element type of {what}"))?;
                let min = value_min_bytes(elem)
                    .ok_or_else(|| GgufError(format!("{what}: unknown element type {elem}")))?;
                let n = self.count(min, &format_args!("the length of {what}"))?;
                // Grown as items are read: a value takes more memory than its bytes.
                let mut items = Vec::with_capacity(n.min(1 << 16));
                for i in 0..n {
                    items.push(self.value(elem, &format_args!("{what}[{i}]"), depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(GgufError(format!("{what}: unknown value type {other}"))),
        })
    }
}

/// The fewest bytes a value of type `type_id` takes, or None for an unknown type.
fn value_min_bytes(type_id: u32) -> Option<usize> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Parses the header of a GGUF file held in `bytes` (the whole file, memory-mapped), checking
/// every tensor's type, shape, size and place against the file.
pub fn parse_header(bytes: &[u8]) -> Parsed<GgufHeader> {
    let mut r = Reader { bytes, at: 0 };
    let magic = r.u32(&"the magic")?;
    if magic != MAGIC {
        return Err(GgufError(format!(
            "not a GGUF file: the magic is {:?}, not \"GGUF\"",
            String::from_utf8_lossy(&magic.to_le_bytes())
        )));
    }
    let version = r.u32(&"the version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError(format!(
            "GGUF version {version} (versions 2 and 3 are read)"
        )));
    }
    // A tensor's info takes at least 8 + 4 + 4 + 8 bytes, a metadata pair 8 + 4 + 1.
    let tensor_count = r.count(24, &"the tensor count")?;
    let kv_count = r.count(13, &"the metadata count")?;
    let mut metadata = Vec::with_capacity(kv_count.min(1 << 16));
    let mut by_key = HashMap::with_capacity(kv_count.min(1 << 16));
    for i in 0..kv_count {
        let key = r.string(&format_args!("metadata key {i}"))?;
        let type_id = r.u32(&format_args!("the type of `{key}`"))?;
        let value = r.value(type_id, &format_args!("`{key}`"), 0)?;
        if by_key.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError(format!("metadata key `{key}` appears twice")));
        }
        metadata.push((key, value));
    }
    let alignment = match by_key.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(other) => {
            return Err(GgufError(format!(
                "`general.alignment` is {other} ({}), not a power of two as u32",
                other.type_name()
            )));
        }
    };
    let mut infos = Vec::with_capacity(tensor_count.min(1 << 16));
    for i in 0..tensor_count {
        let name = r.string(&format_args!("the name of tensor {i}"))?;
        let n_dims = r.u32(&format_args!("the dimension count of `{name}`"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError(format!(
                "tensor `{name}` has {n_dims} dimensions (1 to {MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let n = r.u64(&format_args!("dimension {d} of `{name}`"))?;
            if n == 0 {
                return Err(GgufError(format!("tensor `{name}` has dimension {d} of 0")));
            }
            dims.push(n);
        }
        let type_id = r.u32(&format_args!("the type of `{name}`"))?;
        let ggml_type = GgmlType::from_id(type_id)
            .ok_or_else(|| GgufError(format!("tensor `{name}` has unknown ggml type {type_id}")))?;
        let offset = r.u64(&format_args!("the data offset of `{name}`"))?;
        infos.push((name, dims, ggml_type, offset));
    }
    let data_offset = (r.at as u64).next_multiple_of(alignment);
    let data_offset = usize::try_from(data_offset)
        .ok()
        .filter(|&o| o <= bytes.len())
        .ok_or_else(|| {
            GgufError(format!(
                "truncated: the data section would start at {data_offset}, the file has {} bytes",
                bytes.len()
            ))
        })?;
    let mut tensors = Vec::with_capacity(infos.len());
    let mut names = HashMap::with_capacity(infos.len());
    for (name, dims, ggml_type, offset) in infos {
        let byte_len = tensor_bytes(&name, &dims, ggml_type)?;
        if !offset.is_multiple_of(alignment) {
            return Err(GgufError(format!(
                "tensor `{name}`: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let start = (data_offset as u64).checked_add(offset);
        let end = start.and_then(|s| s.checked_add(byte_len as u64));
        let byte_offset = match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() as u64 => s as usize,
            _ => {
                return Err(GgufError(format!(
                    "truncated: tensor `{name}` ({byte_len} bytes of {}) at data offset {offset} \
                     runs past the end of the file ({} bytes, data from {data_offset})",
                    ggml_type.name(),
                    bytes.len()
                )));
            }
        };
        if names.insert(name.clone(), ()).is_some() {
            return Err(GgufError(format!("tensor `{name}` appears twice")));
        }
        tensors.push(GgufTensor {
            name,
            dims,
            ggml_type,
            byte_offset,
            byte_len,
        });
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        data_offset,
        alignment,
        by_key,
    })
}

/// Bytes of a tensor of `dims` in `ty`: rows must be whole blocks.
fn tensor_bytes(name: &str, dims: &[u64], ty: GgmlType) -> Parsed<usize> {
    let (block, block_bytes) = ty.block();
    let row = dims[0];
    if !row.is_multiple_of(block as u64) {
        return Err(GgufError(format!(
            "tensor `{name}`: rows of {row} values are not whole {} blocks of {block}",
            ty.name()
        )));
    }
    let numel = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| GgufError(format!("tensor `{name}`: dimensions {dims:?} overflow")))?;
    (numel / block as u64)
        .checked_mul(block_bytes as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| GgufError(format!("tensor `{name}`: dimensions {dims:?} overflow")))
}
