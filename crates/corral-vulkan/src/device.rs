//! The Vulkan device: the loader, one physical device and its compute queue, and what the
//! device can do, read once at start-up.

use std::ffi::CStr;
use std::sync::Arc;

use ash::vk;
use corral_backend::{BackendError, Result};

use crate::vk_err;

/// What a Vulkan device is and can do, as the backend chooses its kernels by.
#[derive(Clone, Debug, PartialEq)]
pub struct VulkanInfo {
    /// The device's name (`llvmpipe (LLVM 15.0.6, 256 bits)`, `AMD Radeon 8060S (RADV ...)`).
    pub name: String,
    /// The driver's name and version, as it reports them.
    pub driver: String,
    /// The device shares the host's memory (an integrated GPU, or the CPU itself).
    pub unified: bool,
    /// Lanes of a subgroup.
    pub subgroup_size: u32,
    /// Bytes of shared memory a workgroup may hold.
    pub shared_memory_bytes: u32,
    /// Bytes one storage-buffer binding may span (buffers reached by address are not bound).
    pub max_storage_buffer_range: u32,
    /// Bytes of the largest buffer.
    pub max_buffer_bytes: u64,
    /// 16-bit floats in shaders and 16-bit storage.
    pub float16: bool,
    /// 8-bit integers in shaders and 8-bit storage.
    pub int8: bool,
    /// 16-bit integers in shaders.
    pub int16: bool,
    /// 64-bit integers in shaders (buffer addresses are 64-bit: the backend needs them).
    pub int64: bool,
    /// Doubles in shaders: RoPE forms its sines and cosines in double, as the references do.
    pub float64: bool,
    /// Nanoseconds a timestamp tick, where the compute queue writes timestamps (profiling).
    pub timestamp_period: Option<f32>,
    /// The side of the square f16 × f16 → f32 subgroup products of `VK_KHR_cooperative_matrix`
    /// (the matrix units: AMD's WMMA, NVIDIA's tensor cores) that the tile kernels' variants
    /// use, where the device has them: 16, or 8 (Mesa's lavapipe).
    pub cooperative_matrix: Option<u32>,
    /// `VK_EXT_external_memory_host`: host memory (a mapped weight file) imported as is.
    pub host_memory_import: bool,
}

/// The opened device; buffers and kernels hold it until they are freed.
pub(crate) struct DeviceInner {
    _entry: ash::Entry,
    instance: ash::Instance,
    pub(crate) device: ash::Device,
    pub(crate) queue: vk::Queue,
    /// Held while the queue is used: Vulkan leaves a queue's synchronisation to its users.
    pub(crate) queue_lock: std::sync::Mutex<()>,
    pub(crate) queue_family: u32,
    /// The memory types the backend's buffers and its staging copies are made in.
    pub(crate) plan: MemoryPlan,
    /// `VK_EXT_external_memory_host`, where the device has it.
    pub(crate) host_import: Option<HostImport>,
    /// Buffers dropped while queued work may still read them, and whether any may: they
    /// are freed once the work is done ([`DeviceInner::retire`]).
    pub(crate) retired: std::sync::Mutex<Retired>,
    /// Bytes of the plan's device memory allocated and not yet freed: what the device has
    /// free is its heap less these (the backend is its heap's one user that counts).
    pub(crate) allocated: std::sync::atomic::AtomicU64,
}

/// Host memory import: its functions, and the alignment of imported pointers and sizes.
pub(crate) struct HostImport {
    pub(crate) functions: ash::ext::external_memory_host::Device,
    pub(crate) alignment: u64,
}

/// Where buffers live, chosen once from the device's memory types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MemoryPlan {
    /// The memory type of the backend's buffers.
    pub(crate) device_type: u32,
    /// Whether buffers of `device_type` are mapped for the host (an integrated GPU's or
    /// lavapipe's memory, a discrete GPU's behind a resizable BAR): host copies are then
    /// plain memory copies; otherwise they go through staging buffers on the queue.
    pub(crate) mapped: bool,
    /// Whether `device_type` is device-local.
    pub(crate) device_local: bool,
    /// A host-visible, coherent memory type: staging copies and the words the host polls.
    pub(crate) host_type: u32,
    /// Bytes of `device_type`'s heap.
    pub(crate) device_heap_bytes: u64,
}

impl MemoryPlan {
    /// The plan for `memory`. A `unified` device's (an integrated GPU's) memory is the host's:
    /// its largest host-visible heap, whether the firmware's carve-out or the kernel's GTT
    /// (device-local preferred where as large), mapped. A discrete GPU's largest local heap:
    /// mapped where a host-visible type spans (nearly) all of it (a resizable BAR), else
    /// unmapped, with host staging. `force_staging` takes the unmapped path on any device.
    pub(crate) fn choose(
        memory: &vk::PhysicalDeviceMemoryProperties,
        unified: bool,
        force_staging: bool,
    ) -> Option<Self> {
        let types = &memory.memory_types[..memory.memory_type_count as usize];
        let heaps = &memory.memory_heaps[..memory.memory_heap_count as usize];
        let heap_bytes = |i: usize| {
            heaps
                .get(types[i].heap_index as usize)
                .map_or(0, |h| h.size)
        };
        let has = |i: usize, f: vk::MemoryPropertyFlags| types[i].property_flags.contains(f);
        let local = vk::MemoryPropertyFlags::DEVICE_LOCAL;
        let host = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let cached = vk::MemoryPropertyFlags::HOST_CACHED;
        // Host staging: cached where possible (read-backs), outside a small BAR window.
        let host_type = (0..types.len())
            .filter(|&i| has(i, host))
            .max_by_key(|&i| (has(i, cached), !has(i, local), heap_bytes(i)))?;
        let device_type = if unified {
            (0..types.len())
                .filter(|&i| has(i, host))
                .max_by_key(|&i| (heap_bytes(i), has(i, local), !has(i, cached)))?
        } else {
            match (0..types.len())
                .filter(|&i| has(i, local))
                .map(heap_bytes)
                .max()
            {
                // No device-local memory at all: everything lives in host memory.
                None => host_type,
                Some(largest) => {
                    let spans = |i: usize| heap_bytes(i) >= largest / 10 * 9;
                    let mapped_type = (0..types.len()).find(|&i| has(i, local | host) && spans(i));
                    match mapped_type {
                        Some(i) if !force_staging => i,
                        _ => (0..types.len())
                            .filter(|&i| has(i, local) && spans(i))
                            .min_by_key(|&i| has(i, vk::MemoryPropertyFlags::HOST_VISIBLE))?,
                    }
                }
            }
        };
        Some(Self {
            device_type: device_type as u32,
            mapped: !force_staging && has(device_type, host),
            device_local: has(device_type, local),
            host_type: host_type as u32,
            device_heap_bytes: heap_bytes(device_type),
        })
    }

    /// Where the buffers live, in words for the log and the device's name.
    pub(crate) fn describe(&self) -> String {
        let gib = self.device_heap_bytes as f64 / (1u64 << 30) as f64;
        match (self.mapped, self.device_local) {
            (true, true) => format!("buffers in device-local memory the host maps, {gib:.1} GiB"),
            (true, false) => format!("buffers in host memory the device reads, {gib:.1} GiB"),
            (false, _) => {
                format!("buffers in device memory copied through host staging, {gib:.1} GiB")
            }
        }
    }
}

/// Buffers whose freeing waits for the device's queued work.
#[derive(Default)]
pub(crate) struct Retired {
    /// Work is recorded or submitted that has not been waited for.
    pub(crate) busy: bool,
    pub(crate) buffers: Vec<(vk::Buffer, vk::DeviceMemory, u64)>,
}

impl DeviceInner {
    /// Submits `commands` to the queue under its lock, signalling `fence` (or none), and
    /// with `wait` waits for the queue to drain before letting go of it.
    ///
    /// # Safety
    /// The command buffers are this device's, recorded, and not pending; `fence` is
    /// unsignalled and not in use.
    #[allow(unsafe_code)]
    pub(crate) unsafe fn submit(
        &self,
        commands: &[vk::CommandBuffer],
        fence: vk::Fence,
        wait: bool,
    ) -> Result<()> {
        let _queue = self
            .queue_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // SAFETY: the caller's contract; the queue's lock is held.
        unsafe {
            self.device
                .queue_submit(
                    self.queue,
                    &[vk::SubmitInfo::default().command_buffers(commands)],
                    fence,
                )
                .and_then(|()| {
                    if wait {
                        self.device.queue_wait_idle(self.queue)
                    } else {
                        Ok(())
                    }
                })
                .map_err(|e| vk_err("submitting work", e))
        }
    }

    /// Frees `buffer` and its memory (`device_bytes` of them counted in
    /// [`DeviceInner::allocated`]) now, or once queued work is done if any is.
    pub(crate) fn retire(&self, buffer: vk::Buffer, memory: vk::DeviceMemory, device_bytes: u64) {
        let mut retired = self
            .retired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if retired.busy {
            retired.buffers.push((buffer, memory, device_bytes));
        } else {
            // SAFETY: no queued work can use the buffer.
            #[allow(unsafe_code)]
            unsafe {
                self.free(buffer, memory, device_bytes);
            }
        }
    }

    /// Destroys `buffer` and frees its memory, uncounting `device_bytes`.
    ///
    /// # Safety
    /// No queued work uses the buffer.
    #[allow(unsafe_code)]
    unsafe fn free(&self, buffer: vk::Buffer, memory: vk::DeviceMemory, device_bytes: u64) {
        // SAFETY: the caller's contract.
        unsafe {
            self.device.destroy_buffer(buffer, None);
            self.device.free_memory(memory, None);
        }
        self.allocated
            .fetch_sub(device_bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Marks work as queued (`true`), or as all done (`false`), which frees the buffers
    /// retired meanwhile.
    pub(crate) fn set_busy(&self, busy: bool) {
        let mut retired = self
            .retired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        retired.busy = busy;
        if !busy {
            for (buffer, memory, bytes) in retired.buffers.drain(..) {
                // SAFETY: the work that could use them is done.
                #[allow(unsafe_code)]
                unsafe {
                    self.free(buffer, memory, bytes);
                }
            }
        }
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        self.set_busy(false);
        // SAFETY: every buffer, kernel and command pool holds an `Arc` of this and is gone
        // by now; nothing is queued (the stream waits for its work when it drops).
        #[allow(unsafe_code)]
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// One Vulkan device (`vulkan:N`), its compute queue, and what it can do.
pub struct VulkanDevice {
    pub(crate) inner: Arc<DeviceInner>,
    info: VulkanInfo,
}

impl std::fmt::Debug for VulkanDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VulkanDevice({})", self.info.name)
    }
}

/// The devices the Vulkan loader reports, by name, or why there are none (no loader, no
/// driver).
pub fn vulkan_available() -> Result<Vec<String>> {
    Ok(physical_devices()?
        .into_iter()
        .map(|(name, _)| name)
        .collect())
}

/// The ordinal of the first Vulkan device that is a GPU (integrated, discrete or virtual),
/// not an implementation on the CPU such as lavapipe: what `auto` runs on when there is no
/// CUDA device. `None` if every device is a CPU; an error if there is no loader or driver.
pub fn first_vulkan_gpu() -> Result<Option<usize>> {
    Ok(physical_devices()?
        .iter()
        .position(|(_, kind)| *kind != vk::PhysicalDeviceType::CPU))
}

/// Every device the loader reports: its name and type.
fn physical_devices() -> Result<Vec<(String, vk::PhysicalDeviceType)>> {
    let entry = load()?;
    let instance = create_instance(&entry)?;
    // SAFETY: the instance is live, and destroyed right after.
    #[allow(unsafe_code)]
    let devices = unsafe {
        let devices = instance
            .enumerate_physical_devices()
            .map_err(|e| vk_err("enumerating Vulkan devices", e))
            .map(|devices| {
                devices
                    .iter()
                    .map(|&d| {
                        let props = instance.get_physical_device_properties(d);
                        (device_name(&props), props.device_type)
                    })
                    .collect()
            });
        instance.destroy_instance(None);
        devices
    }?;
    Ok(devices)
}

impl VulkanDevice {
    /// Opens Vulkan device `ordinal` with its first compute queue, buffer device addresses
    /// and, where the device has them, 16-bit and 8-bit storage and arithmetic.
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::open_with(ordinal, false)
    }

    /// [`VulkanDevice::open`], with `force_staging` keeping buffers unmapped and copying
    /// through staging buffers even where the device's memory is mapped (a discrete GPU's
    /// path, on any device).
    pub fn open_with(ordinal: usize, force_staging: bool) -> Result<Self> {
        if !crate::SHADERS_BUILT {
            return Err(BackendError::Device {
                what: "vulkan".to_string(),
                detail: "this build has no shaders (glslc was not found when it was built; \
                         Debian: apt install glslc)"
                    .to_string(),
            });
        }
        let entry = load()?;
        let instance = create_instance(&entry)?;
        // SAFETY: `instance` is live; on an error before the device is made it is destroyed
        // here, after that by `DeviceInner`'s drop.
        #[allow(unsafe_code)]
        unsafe {
            match Self::open_on(entry, instance.clone(), ordinal, force_staging) {
                Ok(device) => Ok(device),
                Err(e) => {
                    instance.destroy_instance(None);
                    Err(e)
                }
            }
        }
    }

    /// [`VulkanDevice::open`] on a live instance.
    #[allow(unsafe_code)]
    unsafe fn open_on(
        entry: ash::Entry,
        instance: ash::Instance,
        ordinal: usize,
        force_staging: bool,
    ) -> Result<Self> {
        // SAFETY: the instance is live for every call below (the caller's contract).
        unsafe {
            let devices = instance
                .enumerate_physical_devices()
                .map_err(|e| vk_err("enumerating Vulkan devices", e))?;
            let &physical = devices.get(ordinal).ok_or_else(|| BackendError::Device {
                what: format!("vulkan:{ordinal}"),
                detail: format!("{} Vulkan device(s) present", devices.len()),
            })?;
            let queue_family = instance
                .get_physical_device_queue_family_properties(physical)
                .iter()
                .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
                .ok_or_else(|| BackendError::Device {
                    what: format!("vulkan:{ordinal}"),
                    detail: "no compute queue".to_string(),
                })? as u32;
            let mut info = read_info(&entry, &instance, physical);
            let families = instance.get_physical_device_queue_family_properties(physical);
            if families
                .get(queue_family as usize)
                .is_none_or(|f| f.timestamp_valid_bits == 0)
            {
                info.timestamp_period = None;
            }
            let priorities = [1.0f32];
            let queues = [vk::DeviceQueueCreateInfo::default()
                .queue_family_index(queue_family)
                .queue_priorities(&priorities)];
            let mut v11 = vk::PhysicalDeviceVulkan11Features::default()
                .storage_buffer16_bit_access(info.float16);
            let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
                .buffer_device_address(true)
                .shader_float16(info.float16)
                .shader_int8(info.int8)
                .storage_buffer8_bit_access(info.int8)
                .vulkan_memory_model(info.cooperative_matrix.is_some());
            let mut coopmat =
                vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
            if !info.int64 {
                return Err(BackendError::Device {
                    what: format!("vulkan:{ordinal}"),
                    detail: "no 64-bit integers in shaders (shaderInt64)".to_string(),
                });
            }
            let core = vk::PhysicalDeviceFeatures::default()
                .shader_int64(true)
                .shader_int16(info.int16)
                .shader_float64(info.float64);
            // Host memory import where the device has it (an integrated GPU reads weights in
            // the mapped file), and the alignment it asks of imported pointers.
            let import_alignment = if info.host_memory_import {
                let mut host = vk::PhysicalDeviceExternalMemoryHostPropertiesEXT::default();
                let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut host);
                instance.get_physical_device_properties2(physical, &mut props);
                Some(host.min_imported_host_pointer_alignment.max(1))
            } else {
                None
            };
            let mut enabled = Vec::new();
            if import_alignment.is_some() {
                enabled.push(ash::ext::external_memory_host::NAME.as_ptr());
            }
            if info.cooperative_matrix.is_some() {
                enabled.push(ash::khr::cooperative_matrix::NAME.as_ptr());
            }
            let mut create = vk::DeviceCreateInfo::default()
                .queue_create_infos(&queues)
                .enabled_features(&core)
                .enabled_extension_names(&enabled)
                .push_next(&mut v11)
                .push_next(&mut v12);
            if info.cooperative_matrix.is_some() {
                create = create.push_next(&mut coopmat);
            }
            let memory = instance.get_physical_device_memory_properties(physical);
            let plan =
                MemoryPlan::choose(&memory, info.unified, force_staging).ok_or_else(|| {
                    BackendError::Device {
                        what: format!("vulkan:{ordinal}"),
                        detail: "no host-visible, coherent memory type".to_string(),
                    }
                })?;
            let device = instance
                .create_device(physical, &create, None)
                .map_err(|e| vk_err("creating the Vulkan device", e))?;
            let queue = device.get_device_queue(queue_family, 0);
            let host_import = import_alignment.map(|alignment| HostImport {
                functions: ash::ext::external_memory_host::Device::new(&instance, &device),
                alignment,
            });
            let inner = Arc::new(DeviceInner {
                _entry: entry,
                host_import,
                instance,
                device,
                queue,
                queue_lock: std::sync::Mutex::new(()),
                retired: std::sync::Mutex::default(),
                allocated: std::sync::atomic::AtomicU64::new(0),
                queue_family,
                plan,
            });
            Ok(Self { inner, info })
        }
    }

    /// What the device is and can do.
    pub fn info(&self) -> &VulkanInfo {
        &self.info
    }

    /// Bytes of the memory heap the backend's buffers live in (all memory, on lavapipe and
    /// most integrated GPUs).
    pub fn local_memory_bytes(&self) -> u64 {
        self.inner.plan.device_heap_bytes
    }

    /// Invocations that share one output's dot product in the team kernels (`teams.glsl`):
    /// the device's subgroup, within 4 to 32 (a CPU's narrow vectors waste no lanes, a GPU
    /// reads 512 columns a pass).
    pub fn team_size(&self) -> u32 {
        let subgroup = self.info.subgroup_size;
        if subgroup.is_power_of_two() {
            subgroup.clamp(4, 32)
        } else {
            32
        }
    }

    /// Bytes of [`VulkanDevice::local_memory_bytes`] not allocated by this device's buffers.
    pub fn free_memory_bytes(&self) -> u64 {
        let allocated = self
            .inner
            .allocated
            .load(std::sync::atomic::Ordering::Relaxed);
        self.local_memory_bytes().saturating_sub(allocated)
    }

    /// Where the backend's buffers live, in words.
    pub fn memory_placement(&self) -> String {
        self.inner.plan.describe()
    }

    /// Whether the backend's buffers are mapped for the host (else copies are staged).
    pub fn buffers_mapped(&self) -> bool {
        self.inner.plan.mapped
    }
}

/// The Vulkan loader, opened at run time.
fn load() -> Result<ash::Entry> {
    // SAFETY: loading the system's Vulkan loader library; its initialisation is the loader's.
    #[allow(unsafe_code)]
    unsafe { ash::Entry::load() }.map_err(|e| BackendError::Device {
        what: "vulkan".to_string(),
        detail: format!("no Vulkan loader ({e}; Debian: apt install libvulkan1)"),
    })
}

/// An instance of Vulkan 1.3.
fn create_instance(entry: &ash::Entry) -> Result<ash::Instance> {
    let app = vk::ApplicationInfo::default()
        .application_name(c"corral")
        .api_version(vk::API_VERSION_1_3);
    let create = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: the create info and what it points to live through the call.
    #[allow(unsafe_code)]
    unsafe { entry.create_instance(&create, None) }
        .map_err(|e| vk_err("creating a Vulkan instance", e))
}

/// A device's name from its properties.
fn device_name(props: &vk::PhysicalDeviceProperties) -> String {
    // SAFETY: Vulkan fills the name as a NUL-terminated string within the array.
    #[allow(unsafe_code)]
    let name = unsafe { CStr::from_ptr(props.device_name.as_ptr()) };
    name.to_string_lossy().into_owned()
}

/// What `physical` is and can do.
#[allow(unsafe_code)]
unsafe fn read_info(
    entry: &ash::Entry,
    instance: &ash::Instance,
    physical: vk::PhysicalDevice,
) -> VulkanInfo {
    let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
    let mut v13 = vk::PhysicalDeviceVulkan13Properties::default();
    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut props = vk::PhysicalDeviceProperties2::default()
        .push_next(&mut subgroup)
        .push_next(&mut v13)
        .push_next(&mut driver);
    let mut v11 = vk::PhysicalDeviceVulkan11Features::default();
    let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut features = vk::PhysicalDeviceFeatures2::default()
        .push_next(&mut v11)
        .push_next(&mut v12);
    // SAFETY: `physical` belongs to `instance`; the chains above outlive the calls.
    let extensions = unsafe {
        instance.get_physical_device_properties2(physical, &mut props);
        instance.get_physical_device_features2(physical, &mut features);
        instance
            .enumerate_device_extension_properties(physical)
            .unwrap_or_default()
    };
    let has = |name: &CStr| {
        extensions
            .iter()
            .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == name))
    };
    let core = features.features;
    let p = props.properties;
    let float16 = v12.shader_float16 == vk::TRUE && v11.storage_buffer16_bit_access == vk::TRUE;
    let cooperative_matrix = if has(c"VK_KHR_cooperative_matrix")
        && float16
        && v12.vulkan_memory_model == vk::TRUE
        && crate::COOPMAT_BUILT
    {
        let functions = ash::khr::cooperative_matrix::Instance::new(entry, instance);
        // SAFETY: the device has the extension, and `physical` belongs to `instance`.
        let sizes = unsafe {
            functions
                .get_physical_device_cooperative_matrix_properties(physical)
                .unwrap_or_default()
        };
        coopmat_side(&sizes, v13.max_subgroup_size.max(subgroup.subgroup_size))
    } else {
        None
    };
    let driver_name = driver
        .driver_name_as_c_str()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let driver_info = driver
        .driver_info_as_c_str()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    VulkanInfo {
        name: device_name(&p),
        driver: format!("{driver_name} {driver_info}").trim().to_string(),
        unified: matches!(
            p.device_type,
            vk::PhysicalDeviceType::INTEGRATED_GPU | vk::PhysicalDeviceType::CPU
        ),
        subgroup_size: subgroup.subgroup_size,
        shared_memory_bytes: p.limits.max_compute_shared_memory_size,
        max_storage_buffer_range: p.limits.max_storage_buffer_range,
        max_buffer_bytes: v13.max_buffer_size,
        float16,
        int8: v12.shader_int8 == vk::TRUE && v12.storage_buffer8_bit_access == vk::TRUE,
        int16: core.shader_int16 == vk::TRUE,
        int64: core.shader_int64 == vk::TRUE,
        float64: core.shader_float64 == vk::TRUE,
        timestamp_period: Some(p.limits.timestamp_period),
        cooperative_matrix,
        host_memory_import: has(c"VK_EXT_external_memory_host"),
    }
}

/// Sub-tiles of a 64 by 64 tile a subgroup may own in the tile kernels (`MAX_OWN` in
/// tiles.glsl), whose workgroups are 256 invocations.
const COOPMAT_MAX_OWN: u32 = 4;

/// The side, 16 or else 8, of a square f16 × f16 → f32 subgroup product among `sizes` that the
/// tile kernels can use with subgroups of up to `subgroup` lanes: the 64 by 64 tile's
/// sub-tiles shared among the workgroup's subgroups, at most [`COOPMAT_MAX_OWN`] each.
fn coopmat_side(sizes: &[vk::CooperativeMatrixPropertiesKHR<'_>], subgroup: u32) -> Option<u32> {
    let f16 = vk::ComponentTypeKHR::FLOAT16;
    let f32 = vk::ComponentTypeKHR::FLOAT32;
    [16, 8].into_iter().find(|&side| {
        let subgroups = 256 / subgroup.max(1);
        let fits = (64 / side) * (64 / side) <= COOPMAT_MAX_OWN * subgroups;
        fits && sizes.iter().any(|p| {
            p.m_size == side
                && p.n_size == side
                && p.k_size == side
                && (p.a_type, p.b_type, p.c_type, p.result_type) == (f16, f16, f32, f32)
                && p.saturating_accumulation == vk::FALSE
                && p.scope == vk::ScopeKHR::SUBGROUP
        })
    })
}

#[cfg(test)]
mod tests {
    use ash::vk;

    use super::{MemoryPlan, coopmat_side};

    /// A square product of side `n` over `a` operands with `c` accumulators, on subgroups.
    fn product(
        n: u32,
        a: vk::ComponentTypeKHR,
        c: vk::ComponentTypeKHR,
    ) -> vk::CooperativeMatrixPropertiesKHR<'static> {
        vk::CooperativeMatrixPropertiesKHR {
            m_size: n,
            n_size: n,
            k_size: n,
            a_type: a,
            b_type: a,
            c_type: c,
            result_type: c,
            scope: vk::ScopeKHR::SUBGROUP,
            ..Default::default()
        }
    }

    /// The tile kernels take 16 by 16 f16 products with f32 sums (a GPU's), else 8 by 8 on
    /// subgroups small enough that each owns at most four of a tile's 64; nothing else.
    #[test]
    fn cooperative_matrices_are_chosen_by_side_types_and_subgroup() {
        use vk::ComponentTypeKHR as T;
        let gpu = [
            product(16, T::FLOAT16, T::FLOAT16),
            product(16, T::FLOAT16, T::FLOAT32),
            product(16, T::SINT8, T::SINT32),
        ];
        assert_eq!(coopmat_side(&gpu, 32), Some(16));
        assert_eq!(coopmat_side(&gpu, 64), Some(16));
        let eights = [product(8, T::FLOAT16, T::FLOAT32)];
        assert_eq!(coopmat_side(&eights, 8), Some(8));
        assert_eq!(coopmat_side(&eights, 32), None);
        assert_eq!(coopmat_side(&gpu[..1], 32), None);
        assert_eq!(
            coopmat_side(&[product(16, T::FLOAT32, T::FLOAT32)], 32),
            None
        );
        let mut workgroup_scope = product(16, T::FLOAT16, T::FLOAT32);
        workgroup_scope.scope = vk::ScopeKHR::WORKGROUP;
        assert_eq!(coopmat_side(&[workgroup_scope], 32), None);
        assert_eq!(coopmat_side(&[], 32), None);
    }

    const GIB: u64 = 1 << 30;
    const LOCAL: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::DEVICE_LOCAL;
    const HOST: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(
        vk::MemoryPropertyFlags::HOST_VISIBLE.as_raw()
            | vk::MemoryPropertyFlags::HOST_COHERENT.as_raw(),
    );
    const CACHED: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::HOST_CACHED;

    /// Memory properties of `heaps` (bytes, device-local) and `types` (flags, heap).
    fn memory(
        heaps: &[(u64, bool)],
        types: &[(vk::MemoryPropertyFlags, u32)],
    ) -> vk::PhysicalDeviceMemoryProperties {
        let mut m = vk::PhysicalDeviceMemoryProperties {
            memory_heap_count: heaps.len() as u32,
            memory_type_count: types.len() as u32,
            ..Default::default()
        };
        for (i, &(size, local)) in heaps.iter().enumerate() {
            m.memory_heaps[i] = vk::MemoryHeap {
                size,
                flags: if local {
                    vk::MemoryHeapFlags::DEVICE_LOCAL
                } else {
                    vk::MemoryHeapFlags::empty()
                },
            };
        }
        for (i, &(property_flags, heap_index)) in types.iter().enumerate() {
            m.memory_types[i] = vk::MemoryType {
                property_flags,
                heap_index,
            };
        }
        m
    }

    /// (device type, mapped, host type, heap bytes) of a plan.
    fn chosen(
        m: &vk::PhysicalDeviceMemoryProperties,
        unified: bool,
        staged: bool,
    ) -> (u32, bool, u32, u64) {
        let p = MemoryPlan::choose(m, unified, staged).expect("a plan");
        (p.device_type, p.mapped, p.host_type, p.device_heap_bytes)
    }

    /// Discrete GPUs: the large local heap, unmapped behind a 256 MiB BAR window (host
    /// staging in cached host memory), mapped behind a resizable BAR; lavapipe's one heap
    /// mapped; integrated GPUs: the larger of the firmware's carve-out and the GTT, mapped.
    #[test]
    fn buffers_live_in_the_largest_heap_the_device_reads_well() {
        let discrete = memory(
            &[(80 * GIB, true), (64 * GIB, false), (GIB / 4, true)],
            &[(LOCAL, 0), (HOST, 1), (HOST | CACHED, 1), (LOCAL | HOST, 2)],
        );
        assert_eq!(chosen(&discrete, false, false), (0, false, 2, 80 * GIB));
        let resizable_bar = memory(
            &[(80 * GIB, true), (64 * GIB, false)],
            &[(LOCAL, 0), (HOST, 1), (HOST | CACHED, 1), (LOCAL | HOST, 0)],
        );
        assert_eq!(chosen(&resizable_bar, false, false), (3, true, 2, 80 * GIB));
        assert_eq!(chosen(&resizable_bar, false, true), (0, false, 2, 80 * GIB));
        let lavapipe = memory(&[(24 * GIB, true)], &[(LOCAL | HOST | CACHED, 0)]);
        assert_eq!(chosen(&lavapipe, false, false), (0, true, 0, 24 * GIB));
        assert_eq!(chosen(&lavapipe, false, true), (0, false, 0, 24 * GIB));
        // A Strix Halo with a small carve-out and a large GTT, then the other way round.
        let small_carve_out = memory(
            &[(GIB / 2, true), (96 * GIB, false)],
            &[(LOCAL, 0), (HOST, 1), (HOST | CACHED, 1), (LOCAL | HOST, 0)],
        );
        assert_eq!(
            chosen(&small_carve_out, true, false),
            (1, true, 2, 96 * GIB)
        );
        let large_carve_out = memory(
            &[(96 * GIB, true), (16 * GIB, false)],
            &[(LOCAL, 0), (HOST, 1), (HOST | CACHED, 1), (LOCAL | HOST, 0)],
        );
        assert_eq!(
            chosen(&large_carve_out, true, false),
            (3, true, 2, 96 * GIB)
        );
        // No host-visible memory: no plan.
        assert!(MemoryPlan::choose(&memory(&[(GIB, true)], &[(LOCAL, 0)]), false, false).is_none());
    }
}
