//! Kernels: a compute pipeline a shader, made once, its arguments pushed as constants (buffer
//! addresses and sizes); dispatches recorded into a command buffer that can be replayed.

use std::sync::Arc;

use ash::vk;
use corral_backend::{BackendError, Result};

use crate::device::DeviceInner;
use crate::{SHADERS, VulkanDevice, vk_err};

/// Bytes of push constants every kernel may take (Vulkan guarantees 128).
pub(crate) const PUSH_BYTES: u32 = 128;

/// One shader's compute pipeline.
pub struct Kernel {
    device: Arc<DeviceInner>,
    name: &'static str,
    module: vk::ShaderModule,
    layout: vk::PipelineLayout,
    pipeline: vk::Pipeline,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({})", self.name)
    }
}

impl Kernel {
    /// The shader's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The pipeline of the shader `name` (`src/shaders/<name>.comp`).
    pub fn new(device: &VulkanDevice, name: &str) -> Result<Self> {
        let &(name, spirv) =
            SHADERS
                .iter()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| BackendError::Device {
                    what: "vulkan".to_string(),
                    detail: format!("no shader named {name}"),
                })?;
        let words: Vec<u32> = spirv
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        let inner = Arc::clone(&device.inner);
        let d = &inner.device;
        // SAFETY: the device is live; each handle made here is destroyed on the error paths
        // below or by `Drop`.
        #[allow(unsafe_code)]
        unsafe {
            let module = d
                .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
                .map_err(|e| vk_err(name, e))?;
            let push = [vk::PushConstantRange::default()
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
                .size(PUSH_BYTES)];
            let layout = match d.create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().push_constant_ranges(&push),
                None,
            ) {
                Ok(l) => l,
                Err(e) => {
                    d.destroy_shader_module(module, None);
                    return Err(vk_err(name, e));
                }
            };
            // Specialization constants (shaders without one ignore it): 0, the team size of
            // teams.glsl; 1, the side of the cooperative-matrix products of tiles.glsl.
            let side = device.info().cooperative_matrix.unwrap_or(16);
            let mut constants = [0u8; 8];
            constants[..4].copy_from_slice(&device.team_size().to_le_bytes());
            constants[4..].copy_from_slice(&side.to_le_bytes());
            let entries = [0, 1].map(|id| {
                vk::SpecializationMapEntry::default()
                    .constant_id(id)
                    .offset(4 * id)
                    .size(4)
            });
            let specialization = vk::SpecializationInfo::default()
                .map_entries(&entries)
                .data(&constants);
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(c"main")
                .specialization_info(&specialization);
            let create = [vk::ComputePipelineCreateInfo::default()
                .stage(stage)
                .layout(layout)];
            let pipeline =
                match d.create_compute_pipelines(vk::PipelineCache::null(), &create, None) {
                    Ok(p) => p[0],
                    Err((_, e)) => {
                        d.destroy_pipeline_layout(layout, None);
                        d.destroy_shader_module(module, None);
                        return Err(vk_err(name, e));
                    }
                };
            Ok(Self {
                device: Arc::clone(&inner),
                name,
                module,
                layout,
                pipeline,
            })
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: the handles are this kernel's; no queued work uses them.
        #[allow(unsafe_code)]
        unsafe {
            let d = &self.device.device;
            d.destroy_pipeline(self.pipeline, None);
            d.destroy_pipeline_layout(self.layout, None);
            d.destroy_shader_module(self.module, None);
        }
    }
}

/// Records one dispatch into `commands`, after a barrier that makes every shader, copy and
/// host write recorded or submitted before it visible to it (the first in a command buffer
/// also orders it after earlier submissions to the queue); `timed`, a pair of timestamp
/// queries written around it.
pub(crate) fn record(
    d: &ash::Device,
    commands: vk::CommandBuffer,
    kernel: &Kernel,
    (groups, args): ([u32; 3], &[u8]),
    timed: Option<(vk::QueryPool, u32)>,
) {
    memory_barrier(
        d,
        commands,
        (WRITERS, WRITES),
        (
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE,
        ),
    );
    // SAFETY: `commands` is in the recording state, and the kernel's handles are live.
    #[allow(unsafe_code)]
    unsafe {
        if let Some((pool, query)) = timed {
            d.cmd_reset_query_pool(commands, pool, query, 2);
            d.cmd_write_timestamp(
                commands,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                pool,
                query,
            );
        }
        d.cmd_bind_pipeline(commands, vk::PipelineBindPoint::COMPUTE, kernel.pipeline);
        d.cmd_push_constants(
            commands,
            kernel.layout,
            vk::ShaderStageFlags::COMPUTE,
            0,
            args,
        );
        d.cmd_dispatch(commands, groups[0], groups[1], groups[2]);
        if let Some((pool, query)) = timed {
            d.cmd_write_timestamp(
                commands,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                pool,
                query + 1,
            );
        }
    }
}

/// The stages that write buffers: shaders, copies and the host.
const WRITERS: vk::PipelineStageFlags = vk::PipelineStageFlags::from_raw(
    vk::PipelineStageFlags::COMPUTE_SHADER.as_raw()
        | vk::PipelineStageFlags::TRANSFER.as_raw()
        | vk::PipelineStageFlags::HOST.as_raw(),
);

/// Their writes.
const WRITES: vk::AccessFlags = vk::AccessFlags::from_raw(
    vk::AccessFlags::SHADER_WRITE.as_raw()
        | vk::AccessFlags::TRANSFER_WRITE.as_raw()
        | vk::AccessFlags::HOST_WRITE.as_raw(),
);

/// Records a barrier: the `from` stages' accesses before it complete, and are visible to
/// the `to` stages' accesses after it.
fn memory_barrier(
    d: &ash::Device,
    commands: vk::CommandBuffer,
    from: (vk::PipelineStageFlags, vk::AccessFlags),
    to: (vk::PipelineStageFlags, vk::AccessFlags),
) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(from.1)
        .dst_access_mask(to.1)];
    // SAFETY: `commands` is in the recording state (the callers' contract).
    #[allow(unsafe_code)]
    unsafe {
        d.cmd_pipeline_barrier(
            commands,
            from.0,
            to.0,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        );
    }
}

/// Records a barrier before copies: every write and read before it completes first.
pub(crate) fn record_transfer_barrier(d: &ash::Device, commands: vk::CommandBuffer) {
    let to = vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE;
    memory_barrier(
        d,
        commands,
        (WRITERS, WRITES),
        (vk::PipelineStageFlags::TRANSFER, to),
    );
}

/// Records a barrier that makes every shader and copy write before it visible to the host
/// once the submission's fence signals: the last command of every submitted command buffer.
pub(crate) fn record_host_barrier(d: &ash::Device, commands: vk::CommandBuffer) {
    memory_barrier(
        d,
        commands,
        (
            vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
            vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE,
        ),
        (vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ),
    );
}
