//! Buffers: device memory the host can map (all of it on an integrated GPU or lavapipe; a
//! discrete GPU's host-visible window for now), reached by shaders through its device address.

use std::sync::Arc;

use ash::vk;
use corral_backend::{BackendError, Result};

use crate::device::DeviceInner;
use crate::{VulkanDevice, vk_err};

/// A buffer of `bytes` bytes, mapped for the host, with its device address.
pub struct VulkanBuffer {
    device: Arc<DeviceInner>,
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    mapped: *mut u8,
    bytes: usize,
    address: u64,
}

// SAFETY: the mapping is memory the buffer owns, which the host reaches only by copies
// (`read`, `write`); Vulkan's handles may move between threads.
#[allow(unsafe_code)]
unsafe impl Send for VulkanBuffer {}
// SAFETY: as above: the backend orders copies against the device's work.
#[allow(unsafe_code)]
unsafe impl Sync for VulkanBuffer {}

impl std::fmt::Debug for VulkanBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VulkanBuffer({} bytes at {:#x})",
            self.bytes, self.address
        )
    }
}

impl VulkanBuffer {
    /// A zeroed buffer of `bytes` bytes on `device`.
    pub fn new(device: &VulkanDevice, bytes: usize) -> Result<Self> {
        let inner = Arc::clone(&device.inner);
        let size = bytes.max(4) as u64;
        let info = vk::BufferCreateInfo::default().size(size).usage(
            vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS,
        );
        // SAFETY: the device is live (held by `inner`); each handle made here is destroyed on
        // the error paths below or by `Drop`.
        #[allow(unsafe_code)]
        unsafe {
            let d = &inner.device;
            let buffer = d
                .create_buffer(&info, None)
                .map_err(|e| vk_err("creating a buffer", e))?;
            let need = d.get_buffer_memory_requirements(buffer);
            let wanted =
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            let Some(kind) = (0..inner.memory.memory_type_count).find(|&i| {
                need.memory_type_bits & (1 << i) != 0
                    && inner.memory.memory_types[i as usize]
                        .property_flags
                        .contains(wanted)
            }) else {
                d.destroy_buffer(buffer, None);
                return Err(BackendError::Device {
                    what: "allocating a buffer".to_string(),
                    detail: "no host-visible memory for it".to_string(),
                });
            };
            let mut addressed = vk::MemoryAllocateFlagsInfo::default()
                .flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
            let allocate = vk::MemoryAllocateInfo::default()
                .allocation_size(need.size)
                .memory_type_index(kind)
                .push_next(&mut addressed);
            let memory = match d.allocate_memory(&allocate, None) {
                Ok(m) => m,
                Err(e) => {
                    d.destroy_buffer(buffer, None);
                    return Err(vk_err("allocating a buffer", e));
                }
            };
            let mapped = d
                .bind_buffer_memory(buffer, memory, 0)
                .and_then(|()| d.map_memory(memory, 0, need.size, vk::MemoryMapFlags::empty()));
            let mapped = match mapped {
                Ok(p) => p.cast::<u8>(),
                Err(e) => {
                    d.destroy_buffer(buffer, None);
                    d.free_memory(memory, None);
                    return Err(vk_err("mapping a buffer", e));
                }
            };
            std::ptr::write_bytes(mapped, 0, size as usize);
            let address =
                d.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buffer));
            Ok(Self {
                device: inner,
                buffer,
                memory,
                mapped,
                bytes,
                address,
            })
        }
    }

    /// The buffer's device address, as shaders take it.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Bytes the buffer holds.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `out.len()` bytes from byte `offset` to the host (after the work that wrote
    /// them has completed).
    ///
    /// # Panics
    /// If the range runs past the buffer: callers check ranges first.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.bytes, "read past the buffer");
        // SAFETY: the range lies within the mapping, which lives as long as `self`; no
        // reference to the mapped memory outlives the copy.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(self.mapped.add(offset), out.as_mut_ptr(), out.len());
        }
    }

    /// Copies `bytes` into the buffer from byte `offset` (while no queued work reads or
    /// writes them).
    ///
    /// # Panics
    /// If the range runs past the buffer: callers check ranges first.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.bytes, "write past the buffer");
        // SAFETY: as `read`; the mapping is device memory the host writes by copies only.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.mapped.add(offset), bytes.len());
        }
    }
}

impl Drop for VulkanBuffer {
    fn drop(&mut self) {
        self.device.retire(self.buffer, self.memory);
    }
}
