//! The buffers' entry points on `dyn Backend`: each copy's and each weight's arguments
//! checked once for every backend (element types and lengths, byte ranges, weight types the
//! device reads, whole blocks, file ranges) before the backend's [`Buffers`] copy, so that a
//! backend only moves bytes. Called on a concrete backend, the [`Buffers`] methods are the
//! backend's own, unchecked.

use std::sync::Arc;

use crate::checked::holds;
use crate::{Backend, BackendError, Buffers, DType, DeviceBuffer, MappedFile, QuantFormat, Result};

impl<'b> dyn Backend + 'b {
    /// [`Buffers::upload_f32`].
    pub fn upload_f32(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        holds("upload_f32", "dst", dst, DType::F32, src.len())?;
        Buffers::upload_f32_unchecked(self, src, dst)
    }

    /// [`Buffers::upload_u32`].
    pub fn upload_u32(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()> {
        holds("upload_u32", "dst", dst, DType::U32, src.len())?;
        Buffers::upload_u32_unchecked(self, src, dst)
    }

    /// [`Buffers::download_f32`].
    pub fn download_f32(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()> {
        holds("download_f32", "src", src, DType::F32, dst.len())?;
        Buffers::download_f32_unchecked(self, src, dst)
    }

    /// [`Buffers::download_u32`].
    pub fn download_u32(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()> {
        holds("download_u32", "src", src, DType::U32, dst.len())?;
        Buffers::download_u32_unchecked(self, src, dst)
    }

    /// [`Buffers::read_bytes`].
    pub fn read_bytes(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        crate::byte_range("read_bytes", src, offset, out.len())?;
        Buffers::read_bytes_unchecked(self, src, offset, out)
    }

    /// [`Buffers::write_bytes`].
    pub fn write_bytes(&self, bytes: &[u8], dst: &mut DeviceBuffer, offset: usize) -> Result<()> {
        crate::byte_range("write_bytes", dst, offset, bytes.len())?;
        Buffers::write_bytes_unchecked(self, bytes, dst, offset)
    }

    /// [`Buffers::weight_from_file`].
    pub fn weight_from_file(
        &self,
        file: &Arc<MappedFile>,
        byte_offset: usize,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_file";
        self.weight_type(op, dtype)?;
        whole_values(op, dtype, len)?;
        file.range(op, byte_offset, dtype.bytes_of(len))?;
        Buffers::weight_from_file_unchecked(self, file, byte_offset, dtype, len)
    }

    /// [`Buffers::weight_from_blocks`].
    pub fn weight_from_blocks(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_blocks";
        let DType::Quant(format) = dtype else {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("blocks of {dtype}, not a block format"),
            });
        };
        self.weight_format(op, format)?;
        whole_values(op, dtype, len)?;
        if blocks.len() != dtype.bytes_of(len) {
            return Err(BackendError::BadArgument {
                op,
                detail: format!("{} bytes as {len} values of {dtype}", blocks.len()),
            });
        }
        Buffers::weight_from_blocks_unchecked(self, blocks, dtype, len)
    }

    /// [`Buffers::weight_from_f32`].
    pub fn weight_from_f32(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        float_weights("weight_from_f32", dtype)?;
        Buffers::weight_from_f32_unchecked(self, values, dtype)
    }

    /// [`Buffers::weight_normal`].
    pub fn weight_normal(
        &self,
        len: usize,
        dtype: DType,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        float_weights("weight_normal", dtype)?;
        Buffers::weight_normal_unchecked(self, len, dtype, seed, std)
    }

    /// [`Buffers::weight_synthetic_blocks`].
    pub fn weight_synthetic_blocks(
        &self,
        format: QuantFormat,
        len: usize,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        let op = "weight_synthetic_blocks";
        self.weight_format(op, format)?;
        whole_values(op, DType::Quant(format), len)?;
        Buffers::weight_synthetic_blocks_unchecked(self, format, len, seed, std)
    }

    /// Checks that the device reads weights of block format `format` as stored.
    fn weight_format(&self, op: &'static str, format: QuantFormat) -> Result<()> {
        self.weight_type(op, DType::Quant(format))
    }
}

/// Checks that weights made from f32 values are of a float type.
fn float_weights(op: &'static str, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Ok(());
    }
    Err(BackendError::BadArgument {
        op,
        detail: format!("weights of {dtype} from f32 values"),
    })
}

/// Checks that `len` values of `dtype` are whole blocks of its format.
fn whole_values(op: &'static str, dtype: DType, len: usize) -> Result<()> {
    let block = dtype.block_values();
    if len.is_multiple_of(block) {
        return Ok(());
    }
    Err(BackendError::BadArgument {
        op,
        detail: format!("{len} values of {dtype}, not whole blocks of {block}"),
    })
}
