//! Copies between the host and the backend's buffers. Mapped buffers are copied as memory
//! once the device's work is done; the others on the queue, in order with the dispatches:
//! small writes inline in the command buffer, larger ones and read-backs through buffers of
//! host memory.

use std::sync::atomic::Ordering;

use ash::vk;
use corral_backend::{BackendError, DeviceBuffer, Result};

use crate::VulkanBackend;
use crate::backend::memory;
use crate::memory::{Placement, VulkanBuffer};

/// Bytes a write may carry inline in the command buffer (`vkCmdUpdateBuffer`'s limit).
const INLINE_BYTES: usize = 65_536;

/// Bytes of one staging buffer: larger writes are cut into pieces of this.
const STAGING_BYTES: usize = 64 << 20;

/// Bytes staged without waiting for the device: past this the stream drains, so that a
/// model's upload never holds a second copy of its weights in host memory.
const STAGED_LIMIT: usize = 256 << 20;

impl VulkanBackend {
    /// Host bytes to byte `offset` of `dst`, once the device's work is done (one wait if the
    /// buffer is mapped; on the queue, in order, if not).
    pub(crate) fn copy_in(
        &self,
        op: &'static str,
        bytes: &[u8],
        dst: &DeviceBuffer,
        offset: usize,
    ) -> Result<()> {
        let dst = memory(op, dst)?;
        if dst.is_read_only() {
            return Err(BackendError::BadArgument {
                op,
                detail: "weights imported from a mapped file are read-only".to_string(),
            });
        }
        if dst.is_mapped() {
            self.finish(op)?;
            dst.write(offset, bytes);
        } else {
            self.not_capturing(op)?;
            self.stage_in(bytes, dst, offset)?;
        }
        self.stats.transfer(bytes.len());
        Ok(())
    }

    /// Host bytes to the start of `dst`, a buffer just made that no queued work uses: no
    /// wait, and allowed while a graph is recorded (the copy is queued before the graph).
    pub(crate) fn write_new(
        &self,
        op: &'static str,
        dst: &DeviceBuffer,
        bytes: &[u8],
    ) -> Result<()> {
        let dst = memory(op, dst)?;
        if dst.is_mapped() {
            dst.write(0, bytes);
            Ok(())
        } else {
            self.stage_in(bytes, dst, 0)
        }
    }

    /// `out.len()` bytes from byte `offset` of `src` to the host: one host sync.
    pub(crate) fn copy_out(
        &self,
        op: &'static str,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let src = memory(op, src)?;
        if src.is_mapped() {
            self.finish_read_back(op, out.len())?;
            src.read(offset, out);
            return Ok(());
        }
        self.not_capturing(op)?;
        let mut read_back = self
            .read_back
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let staging = match &mut *read_back {
            Some(b) if b.len_bytes() >= out.len() => b,
            // The old one is freed once the queued work is done.
            slot => slot.insert(VulkanBuffer::make(
                &self.device.inner,
                out.len(),
                Placement::Host,
            )?),
        };
        if !out.is_empty() {
            let region = [vk::BufferCopy::default()
                .src_offset(offset as u64)
                .size(out.len() as u64)];
            let (from, to) = (src.handle(), staging.handle());
            // SAFETY: both buffers are live until the copy is done (a dropped buffer is
            // freed only after the queued work), and the region lies within both.
            #[allow(unsafe_code)]
            self.stream
                .transfer(|d, c| unsafe { d.cmd_copy_buffer(c, from, to, &region) })?;
        }
        self.finish_read_back(op, out.len())?;
        staging.read(0, out);
        Ok(())
    }

    /// Zeroes `buffer` on the queue, before any work recorded after.
    pub(crate) fn zero_on_queue(&self, buffer: &VulkanBuffer) -> Result<()> {
        let handle = buffer.handle();
        // SAFETY: the buffer is live until the fill is done, and its size is a multiple of
        // four bytes (as `VulkanBuffer::make` rounds it).
        #[allow(unsafe_code)]
        self.stream
            .transfer(|d, c| unsafe { d.cmd_fill_buffer(c, handle, 0, vk::WHOLE_SIZE, 0) })
    }

    /// `bytes` to byte `offset` of the unmapped `dst` on the queue: inline when small and
    /// aligned, else through staging buffers (freed once the copies are done).
    fn stage_in(&self, bytes: &[u8], dst: &VulkanBuffer, offset: usize) -> Result<()> {
        let to = dst.handle();
        for (i, piece) in bytes.chunks(STAGING_BYTES).enumerate() {
            let at = (offset + i * STAGING_BYTES) as u64;
            if piece.len() <= INLINE_BYTES && piece.len().is_multiple_of(4) && at.is_multiple_of(4)
            {
                // SAFETY: the buffer is live until the copy is done; the data is copied into
                // the command buffer as it is recorded.
                #[allow(unsafe_code)]
                self.stream
                    .transfer(|d, c| unsafe { d.cmd_update_buffer(c, to, at, piece) })?;
                continue;
            }
            let staging = VulkanBuffer::make(&self.device.inner, piece.len(), Placement::Host)?;
            staging.write(0, piece);
            let region = [vk::BufferCopy::default()
                .dst_offset(at)
                .size(piece.len() as u64)];
            let from = staging.handle();
            // SAFETY: the staging buffer, dropped below while the copy is queued, is freed
            // only once the queued work is done; the region lies within both buffers.
            #[allow(unsafe_code)]
            self.stream
                .transfer(|d, c| unsafe { d.cmd_copy_buffer(c, from, to, &region) })?;
            drop(staging);
            let staged = self.staged_bytes.fetch_add(piece.len(), Ordering::Relaxed) + piece.len();
            if staged > STAGED_LIMIT {
                self.stream.finish()?;
                self.staged_bytes.store(0, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}
