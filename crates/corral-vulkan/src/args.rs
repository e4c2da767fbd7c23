//! A dispatch's arguments as push constants, laid out as the shaders' `std430` push-constant
//! blocks read them: buffer addresses 8-byte aligned, 32-bit values 4-byte aligned, in the
//! order of the block's fields.

use corral_backend::{BackendError, DeviceBuffer, Result, Storage};

use crate::kernel::PUSH_BYTES;

/// Push-constant bytes, built field by field without allocating.
pub(crate) struct Args {
    bytes: [u8; PUSH_BYTES as usize],
    len: usize,
    op: &'static str,
}

impl Args {
    /// Arguments of `op`'s dispatch.
    pub(crate) fn new(op: &'static str) -> Self {
        Self {
            bytes: [0; PUSH_BYTES as usize],
            len: 0,
            op,
        }
    }

    fn put(mut self, align: usize, value: &[u8]) -> Result<Self> {
        let at = self.len.next_multiple_of(align);
        let end = at + value.len();
        let slot = self
            .bytes
            .get_mut(at..end)
            .ok_or_else(|| BackendError::BadArgument {
                op: self.op,
                detail: format!("arguments past {PUSH_BYTES} bytes"),
            })?;
        slot.copy_from_slice(value);
        self.len = end;
        Ok(self)
    }

    /// The device address of `buffer` (a `buffer_reference` field).
    pub(crate) fn buf(self, buffer: &DeviceBuffer) -> Result<Self> {
        let address = address(self.op, buffer)?;
        self.put(8, &address.to_le_bytes())
    }

    /// A raw device address.
    pub(crate) fn address(self, address: u64) -> Result<Self> {
        self.put(8, &address.to_le_bytes())
    }

    /// A `uint` field; counts past `u32::MAX` are refused.
    pub(crate) fn count(self, value: usize) -> Result<Self> {
        let v = u32::try_from(value).map_err(|_| BackendError::BadArgument {
            op: self.op,
            detail: format!("{value} is past what a dispatch counts (u32)"),
        })?;
        self.put(4, &v.to_le_bytes())
    }

    /// A `float` field.
    pub(crate) fn float(self, value: f32) -> Result<Self> {
        self.put(4, &value.to_le_bytes())
    }

    /// The bytes laid out so far.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The device address of a buffer this backend made.
pub(crate) fn address(op: &'static str, buffer: &DeviceBuffer) -> Result<u64> {
    match buffer.storage() {
        Storage::Device(a) if a.owner::<crate::VulkanBuffer>().is_some() => Ok(a.address()),
        _ => Err(BackendError::ForeignBuffer { op }),
    }
}
