//! The Vulkan backend as a device (its counters, graphs, memory) and as the keeper of its
//! buffers (the pool, weights, copies to and from the host, [`crate::transfer`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use corral_backend::{
    BackendError, BufferUsage, Buffers, Capabilities, DType, Device, DeviceBuffer, DeviceMemory,
    DispatchStats, Graph, KernelTime, MappedFile, Result, Storage, byte_range, fnv1a,
};

use crate::stream::Recorded;
use crate::{VulkanBackend, VulkanBuffer};

impl Device for VulkanBackend {
    fn device_name(&self) -> String {
        let info = self.device.info();
        format!(
            "vulkan:{} ({}, {}; {})",
            self.ordinal(),
            info.name,
            info.driver,
            self.device.memory_placement()
        )
    }

    fn kernels_id(&self) -> u64 {
        // The shaders' SPIR-V, the driver that compiles it and whether the tiles run on
        // cooperative matrices: a calibration measured on other kernels is not reused.
        let info = self.device.info();
        let tiles = u64::from(self.matrix_tiles().unwrap_or(0));
        crate::SHADERS
            .iter()
            .map(|(name, spirv)| fnv1a(name.as_bytes()) ^ fnv1a(spirv).rotate_left(3))
            .chain([
                fnv1a(info.name.as_bytes()),
                fnv1a(info.driver.as_bytes()),
                tiles,
            ])
            .fold(0, |h, x| h.rotate_left(7) ^ x)
    }

    fn stats(&self) -> DispatchStats {
        self.stats.snapshot()
    }

    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }

    fn device_memory(&self) -> Result<Option<DeviceMemory>> {
        Ok(Some(DeviceMemory {
            free: self.device.free_memory_bytes(),
            total: self.device.local_memory_bytes(),
            unified: self.device.info().unified,
            runtime: 0,
            allocation_granularity: 4096,
            fixed_buffers: crate::vulkan_fixed_buffer_bytes() as u64,
        }))
    }

    fn begin_capture(&self) -> Result<()> {
        self.stream.begin_capture()?;
        self.captured.store(0, Ordering::Relaxed);
        self.capturing.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn end_capture(&self) -> Result<Graph> {
        self.capturing.store(false, Ordering::Relaxed);
        let recorded = self
            .stream
            .end_capture()?
            .ok_or(BackendError::BadArgument {
                op: "end_capture",
                detail: "no graph is being recorded".to_string(),
            })?;
        let kernels = self.captured.swap(0, Ordering::Relaxed);
        Ok(Graph::new(Box::new(recorded), kernels, 0))
    }

    fn replay(&self, graph: &Graph) -> Result<()> {
        let recorded = graph.inner::<Recorded>().ok_or(BackendError::BadArgument {
            op: "replay",
            detail: "a graph another backend recorded".to_string(),
        })?;
        self.not_capturing("replay")?;
        self.stream.replay(recorded)?;
        self.stats.graph_replay(graph.kernels(), 0);
        Ok(())
    }

    fn set_profiling(&self, on: bool) {
        if self.capabilities.profiling {
            self.profiling.store(on, Ordering::Relaxed);
        }
    }

    fn kernel_profile(&self) -> Result<Vec<KernelTime>> {
        self.finish("kernel_profile")?;
        self.profiler
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_mut()
            .map_or(Ok(Vec::new()), crate::profile::Profiler::read)
    }

    fn synchronize(&self) -> Result<()> {
        self.finish("synchronize")?;
        self.stats.host_sync();
        Ok(())
    }
}

impl Buffers for VulkanBackend {
    fn take_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        let mut b = match self.pool.take(dtype, len, usage) {
            Some(b) => b,
            None => self.new_buffer(dtype, len, usage)?,
        };
        if self.capturing.load(Ordering::Relaxed) {
            b.hold_for_graphs();
        }
        Ok(b)
    }

    fn give_buffer(&self, buffer: DeviceBuffer) {
        if matches!(buffer.storage(), Storage::Device(_)) {
            if self.capturing.load(Ordering::Relaxed) {
                self.pool.give_keeping_all(buffer);
            } else {
                self.pool.give(buffer);
            }
        }
    }

    fn pool_bytes(&self) -> (usize, usize) {
        (self.pool.free_bytes(), self.pool.limit_bytes())
    }

    fn alloc_zeroed(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        // New memory is zeroed when it is made.
        self.new_buffer(dtype, len, usage)
    }

    fn weight_from_file_unchecked(
        &self,
        file: &Arc<MappedFile>,
        byte_offset: usize,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_file";
        let bytes = file.range(op, byte_offset, dtype.bytes_of(len))?;
        // An integrated GPU reads the mapped file where it is: no copy, no second copy in
        // memory. A device that refuses the import gets a copy, as a discrete GPU does.
        if self.imports_weights() {
            let owner: Arc<dyn std::any::Any + Send + Sync> = file.clone();
            match VulkanBuffer::import(&self.device.inner, bytes, owner) {
                Ok(Some(memory)) => return Ok(self.wrap(memory, dtype, len, BufferUsage::Weights)),
                Ok(None) => {}
                Err(e) => tracing::debug!("{op}: copying, the import failed: {e}"),
            }
        }
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        self.write_new(op, &b, bytes)?;
        self.stats.transfer(bytes.len());
        Ok(b)
    }

    fn weight_from_blocks_unchecked(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_blocks";
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        self.write_new(op, &b, &blocks)?;
        self.stats.transfer(blocks.len());
        Ok(b)
    }

    fn weight_from_f32_unchecked(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        let op = "weight_from_f32";
        let bytes: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            DType::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => {
                return Err(BackendError::BadArgument {
                    op,
                    detail: format!("weights of {dtype}"),
                });
            }
        };
        let b = self.new_buffer(dtype, values.len(), BufferUsage::Weights)?;
        self.write_new(op, &b, &bytes)?;
        self.stats.transfer(bytes.len());
        Ok(b)
    }

    fn upload_f32_unchecked(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        self.copy_in("upload_f32", bytemuck::cast_slice(src), dst, 0)
    }

    fn upload_u32_unchecked(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()> {
        self.copy_in("upload_u32", bytemuck::cast_slice(src), dst, 0)
    }

    fn download_f32_unchecked(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()> {
        self.copy_out("download_f32", src, 0, bytemuck::cast_slice_mut(dst))
    }

    fn download_u32_unchecked(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()> {
        self.copy_out("download_u32", src, 0, bytemuck::cast_slice_mut(dst))
    }

    fn read_bytes_unchecked(
        &self,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let op = "read_bytes";
        let (start, _) = byte_range(op, src, offset, out.len())?;
        self.copy_out(op, src, start, out)
    }

    fn write_bytes_unchecked(
        &self,
        bytes: &[u8],
        dst: &mut DeviceBuffer,
        offset: usize,
    ) -> Result<()> {
        let op = "write_bytes";
        let (start, _) = byte_range(op, dst, offset, bytes.len())?;
        self.copy_in(op, bytes, dst, start)
    }
}
