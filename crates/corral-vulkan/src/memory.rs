//! Buffers: device memory reached by shaders through its device address; mapped for the
//! host where the device's memory allows it (an integrated GPU, lavapipe, a discrete GPU
//! behind a resizable BAR), else copied to and from through staging buffers.

use std::sync::Arc;

use ash::vk;
use corral_backend::{BackendError, Result};

use crate::device::DeviceInner;
use crate::{VulkanDevice, vk_err};

/// Where a buffer's memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// The backend's buffers: the device's largest local heap, mapped if the plan says so.
    Device,
    /// Host-visible, coherent memory, always mapped: staging copies and polled words.
    Host,
}

/// A buffer of `bytes` bytes with its device address, mapped for the host or not.
pub struct VulkanBuffer {
    device: Arc<DeviceInner>,
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    mapped: Option<*mut u8>,
    bytes: usize,
    /// Bytes of the plan's device memory it holds (0 in host memory).
    device_bytes: u64,
    /// Host memory imported as it is (a mapped weight file): never written.
    read_only: bool,
    /// What owns imported host memory, held as long as the device may read it.
    _imported: Option<Arc<dyn std::any::Any + Send + Sync>>,
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
            "VulkanBuffer({} bytes at {:#x}{})",
            self.bytes,
            self.address,
            if self.mapped.is_some() {
                ", mapped"
            } else {
                ""
            }
        )
    }
}

impl VulkanBuffer {
    /// A zeroed buffer of `bytes` bytes on `device`, in host-visible memory.
    pub fn new(device: &VulkanDevice, bytes: usize) -> Result<Self> {
        Self::make(&device.inner, bytes, Placement::Host)
    }

    /// A buffer of `bytes` bytes placed as `placement` says; zeroed if it is mapped (the
    /// backend zeroes the others on the queue).
    pub(crate) fn make(
        inner: &Arc<DeviceInner>,
        bytes: usize,
        placement: Placement,
    ) -> Result<Self> {
        let (kind, map) = match placement {
            Placement::Device => (inner.plan.device_type, inner.plan.mapped),
            Placement::Host => (inner.plan.host_type, true),
        };
        // Whole words, so that fills and inline writes reach every byte.
        let size = bytes.max(4).next_multiple_of(4) as u64;
        let info = vk::BufferCreateInfo::default().size(size).usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST,
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
            if need.memory_type_bits & (1 << kind) == 0 {
                d.destroy_buffer(buffer, None);
                return Err(BackendError::Device {
                    what: "allocating a buffer".to_string(),
                    detail: format!("memory type {kind} cannot hold a storage buffer"),
                });
            }
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
                    return Err(vk_err(&format!("allocating a buffer of {size} bytes"), e));
                }
            };
            let bound = d.bind_buffer_memory(buffer, memory, 0).and_then(|()| {
                if map {
                    d.map_memory(memory, 0, need.size, vk::MemoryMapFlags::empty())
                        .map(|p| Some(p.cast::<u8>()))
                } else {
                    Ok(None)
                }
            });
            let mapped = match bound {
                Ok(p) => p,
                Err(e) => {
                    d.destroy_buffer(buffer, None);
                    d.free_memory(memory, None);
                    return Err(vk_err("mapping a buffer", e));
                }
            };
            if let Some(p) = mapped {
                std::ptr::write_bytes(p, 0, size as usize);
            }
            let address =
                d.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buffer));
            let device_bytes = if placement == Placement::Device {
                need.size
            } else {
                0
            };
            inner
                .allocated
                .fetch_add(device_bytes, std::sync::atomic::Ordering::Relaxed);
            Ok(Self {
                device: Arc::clone(inner),
                buffer,
                memory,
                mapped,
                bytes,
                device_bytes,
                read_only: false,
                _imported: None,
                address,
            })
        }
    }

    /// The device's view of `bytes`, host memory that `owner` keeps alive and unchanged (a
    /// mapped weight file), imported as it is (`VK_EXT_external_memory_host`): the pages
    /// around it, aligned as the device asks, become device memory and no byte is copied.
    /// The buffer is read-only. `None` where the device imports no host memory.
    pub(crate) fn import(
        inner: &Arc<DeviceInner>,
        bytes: &[u8],
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Option<Self>> {
        // An alignment past a page could reach past the owner's mapping.
        let Some(host) = inner.host_import.as_ref().filter(|h| h.alignment <= 4096) else {
            return Ok(None);
        };
        let align = host.alignment as usize;
        let first = bytes.as_ptr() as usize / align * align;
        let delta = bytes.as_ptr() as usize - first;
        let size = (delta + bytes.len().max(1)).next_multiple_of(align) as u64;
        let pointer = first as *mut std::ffi::c_void;
        let kind = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;
        // SAFETY: the device is live; the pages from `first` to `first + size` lie in the
        // owner's mapping (mappings are whole pages, and the alignment is at most a page),
        // which `owner` keeps mapped while the buffer lives; each
        // handle made here is destroyed on the error paths below or by `Drop`.
        #[allow(unsafe_code)]
        unsafe {
            let d = &inner.device;
            let mut allowed = vk::MemoryHostPointerPropertiesEXT::default();
            (host.functions.fp().get_memory_host_pointer_properties_ext)(
                d.handle(),
                kind,
                pointer,
                &mut allowed,
            )
            .result()
            .map_err(|e| vk_err("importing host memory", e))?;
            let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(kind);
            let info = vk::BufferCreateInfo::default()
                .size(size)
                .usage(
                    vk::BufferUsageFlags::STORAGE_BUFFER
                        | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
                        | vk::BufferUsageFlags::TRANSFER_SRC,
                )
                .push_next(&mut external);
            let buffer = d
                .create_buffer(&info, None)
                .map_err(|e| vk_err("creating a buffer over host memory", e))?;
            let need = d.get_buffer_memory_requirements(buffer);
            let types = need.memory_type_bits & allowed.memory_type_bits;
            // The plan's own type where the import allows it, else any it allows.
            let plan = inner.plan.device_type;
            let Some(index) = (types & (1 << plan) != 0)
                .then_some(plan)
                .or_else(|| (0..32).find(|i| types & (1 << i) != 0))
            else {
                d.destroy_buffer(buffer, None);
                return Ok(None);
            };
            let mut import = vk::ImportMemoryHostPointerInfoEXT::default()
                .handle_type(kind)
                .host_pointer(pointer);
            let mut addressed = vk::MemoryAllocateFlagsInfo::default()
                .flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
            let allocate = vk::MemoryAllocateInfo::default()
                .allocation_size(size)
                .memory_type_index(index)
                .push_next(&mut import)
                .push_next(&mut addressed);
            let memory = match d.allocate_memory(&allocate, None) {
                Ok(m) => m,
                Err(e) => {
                    d.destroy_buffer(buffer, None);
                    return Err(vk_err("importing host memory", e));
                }
            };
            if let Err(e) = d.bind_buffer_memory(buffer, memory, 0) {
                d.destroy_buffer(buffer, None);
                d.free_memory(memory, None);
                return Err(vk_err("importing host memory", e));
            }
            let base =
                d.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buffer));
            inner
                .allocated
                .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
            Ok(Some(Self {
                device: Arc::clone(inner),
                buffer,
                memory,
                mapped: Some(bytes.as_ptr().cast_mut()),
                bytes: bytes.len(),
                device_bytes: size,
                read_only: true,
                _imported: Some(owner),
                address: base + delta as u64,
            }))
        }
    }

    /// Whether the buffer is host memory imported as it is, which nothing may write.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The buffer's device address, as shaders take it.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Bytes the buffer holds.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the host may [`read`](Self::read) and [`write`](Self::write) it directly.
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// The Vulkan handle, for copies on the queue.
    pub(crate) fn handle(&self) -> vk::Buffer {
        self.buffer
    }

    /// Copies `out.len()` bytes from byte `offset` to the host (after the work that wrote
    /// them has completed).
    ///
    /// # Panics
    /// If the range runs past the buffer or the buffer is not mapped: callers check first.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.bytes, "read past the buffer");
        let mapped = self.mapped.expect("read of a buffer the host does not map");
        // SAFETY: the range lies within the mapping, which lives as long as `self`; no
        // reference to the mapped memory outlives the copy.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(mapped.add(offset), out.as_mut_ptr(), out.len());
        }
    }

    /// Copies `bytes` into the buffer from byte `offset` (while no queued work reads or
    /// writes them).
    ///
    /// # Panics
    /// If the range runs past the buffer, the buffer is not mapped or is read-only: callers
    /// check first.
    pub fn write(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.bytes, "write past the buffer");
        assert!(!self.read_only, "write to imported host memory");
        let mapped = self
            .mapped
            .expect("write to a buffer the host does not map");
        // SAFETY: as `read`; the mapping is device memory the host writes by copies only.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), mapped.add(offset), bytes.len());
        }
    }
}

impl Drop for VulkanBuffer {
    fn drop(&mut self) {
        self.device
            .retire(self.buffer, self.memory, self.device_bytes);
    }
}
