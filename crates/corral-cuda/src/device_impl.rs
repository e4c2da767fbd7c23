//! The CUDA backend as a device (its counters, graphs and profiling) and as the keeper of
//! its buffers (the pool, weights, copies to and from the host).

use corral_backend::{Buffers, Device};

use crate::*;

impl Device for CudaBackend {
    fn device_name(&self) -> String {
        let (major, minor) = self.gpu.compute_capability;
        format!(
            "cuda:{} ({}, sm_{major}{minor}, {} SMs, {:.1} GiB, {}, {})",
            self.ordinal,
            self.gpu.name,
            self.gpu.multiprocessors,
            self.gpu.total_memory as f64 / (1u64 << 30) as f64,
            if self.blas.is_some() {
                "cuBLAS"
            } else {
                "no cuBLAS"
            },
            if self.gpu.overlap_launches {
                "overlapped launches"
            } else {
                "serial launches"
            }
        )
    }

    fn kernels_id(&self) -> u64 {
        self.kernels_id
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

    fn gemm_input_dtype(&self, rows: usize, weights: DType) -> DType {
        // Where projections run on cuBLAS and the grouped experts on bf16 tiles: both round
        // their input to bf16 first (but precise experts split it, from f32).
        let rounded = weights == DType::BF16 && rows > MATVEC_MAX_ROWS && self.blas.is_some();
        if rounded && !self.f32_gemm_inputs && !self.precise_experts {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn device_memory(&self) -> Result<Option<corral_backend::DeviceMemory>> {
        let memory = self.gpu.memory()?;
        Ok(Some(corral_backend::DeviceMemory {
            runtime: self.runtime_bytes,
            ..memory
        }))
    }

    fn begin_capture(&self) -> Result<()> {
        self.gpu.bind()?;
        // Relaxed: a pooled buffer that a step of this shape needs and the pool lacks now may
        // be allocated while recording (take_buffer); everything else that must not happen
        // while recording is refused by the backend itself (not_capturing).
        self.gpu
            .stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| device::driver_err("beginning a graph capture", e))?;
        let now = self.stats.snapshot();
        self.capture_start.store(now.dispatches, Ordering::Relaxed);
        self.capture_start_bytes
            .store(now.weight_bytes_read, Ordering::Relaxed);
        self.capturing.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn end_capture(&self) -> Result<corral_backend::Graph> {
        if !self.capturing.swap(false, Ordering::Relaxed) {
            return Err(bad("end_capture", "no graph is being recorded".to_string()));
        }
        let now = self.stats.snapshot();
        let kernels = now.dispatches - self.capture_start.load(Ordering::Relaxed);
        let host_weight_bytes =
            now.weight_bytes_read - self.capture_start_bytes.load(Ordering::Relaxed);
        self.stats.uncount_dispatches(kernels);
        self.stats.uncount_weight_bytes(host_weight_bytes);
        let graph = self
            .gpu
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(|e| device::driver_err("ending a graph capture", e))?
            .ok_or_else(|| bad("end_capture", "the capture recorded nothing".to_string()))?;
        Ok(corral_backend::Graph::new(
            Box::new(CapturedGraph(graph)),
            kernels,
            host_weight_bytes,
        ))
    }

    fn replay(&self, graph: &corral_backend::Graph) -> Result<()> {
        self.not_capturing("replay")?;
        graph
            .inner::<CapturedGraph>()
            .ok_or_else(|| {
                bad(
                    "replay",
                    "the graph was recorded by another backend".to_string(),
                )
            })?
            .0
            .launch()
            .map_err(|e| device::driver_err("replaying a graph", e))?;
        self.stats
            .graph_replay(graph.kernels(), graph.host_weight_bytes());
        Ok(())
    }

    fn set_profiling(&self, on: bool) {
        *self.profile.lock().unwrap_or_else(|e| e.into_inner()) = on.then(Vec::new);
        self.profiling.store(on, Ordering::Relaxed);
    }

    fn kernel_profile(&self) -> Result<Vec<corral_backend::KernelTime>> {
        let events = match self
            .profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            Some(events) => std::mem::take(events),
            None => return Ok(Vec::new()),
        };
        self.gpu.sync()?;
        let mut times: Vec<corral_backend::KernelTime> = Vec::new();
        for (name, start, end) in events {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| device::driver_err("reading a profile event", e))?
                as f64;
            match times.iter_mut().find(|t| t.name == name) {
                Some(t) => {
                    t.launches += 1;
                    t.ms += ms;
                }
                None => times.push(corral_backend::KernelTime {
                    name,
                    launches: 1,
                    ms,
                }),
            }
        }
        times.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Ok(times)
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.sync()?;
        self.stats.host_sync();
        Ok(())
    }
}

impl Buffers for CudaBackend {
    fn take_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        let mut b = match self.pool.take(dtype, len, usage) {
            Some(b) => b,
            // While a graph is recorded (in relaxed mode) the allocation is made at once,
            // outside the graph, which then reads and writes it on every replay.
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
        let b = self.new_buffer(dtype, len, usage)?;
        self.gpu
            .memset_zero(ptr_of("alloc_zeroed", &b)?, len * dtype.size_bytes())?;
        Ok(b)
    }

    fn weight_from_file_unchecked(
        &self,
        file: &Arc<MappedFile>,
        byte_offset: usize,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_file";
        let byte_len = dtype.bytes_of(len);
        let bytes = file.range(op, byte_offset, byte_len)?;
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        self.gpu.upload(bytes, ptr_of(op, &b)?)?;
        self.stats.transfer(byte_len);
        Ok(b)
    }

    fn weight_from_f32_unchecked(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        let op = "weight_from_f32";
        let b = self.new_buffer(dtype, values.len(), BufferUsage::Weights)?;
        let dst = ptr_of(op, &b)?;
        match dtype {
            DType::F32 => self.gpu.upload(values, dst)?,
            DType::BF16 => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect();
                self.gpu.upload(&bits, dst)?;
            }
            DType::F16 => {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|v| half::f16::from_f32(*v).to_bits())
                    .collect();
                self.gpu.upload(&bits, dst)?;
            }
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => {
                return Err(bad(op, format!("weights of {dtype}")));
            }
        }
        self.stats.transfer(values.len() * dtype.size_bytes());
        Ok(b)
    }

    fn weight_from_blocks_unchecked(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        self.upload_blocks(&blocks, dtype, len)
    }

    fn weight_synthetic_blocks_unchecked(
        &self,
        format: corral_backend::QuantFormat,
        len: usize,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        self.synthetic_blocks(format, len, seed, std)
    }

    fn weight_normal_unchecked(
        &self,
        len: usize,
        dtype: DType,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        let op = "weight_normal";
        let kernel = match dtype {
            DType::BF16 => &self.kernels.normal_fill_bf16,
            DType::F16 => &self.kernels.normal_fill_f16,
            DType::F32 => &self.kernels.normal_fill_f32,
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => {
                return Err(bad(op, format!("weights of {dtype}")));
            }
        };
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        if len > 0 {
            let p = Arg::Ptr(ptr_of(op, &b)?);
            let pairs = len.div_ceil(2);
            let grid = (grid_of(op, pairs.div_ceil(256))?, 1, 1);
            let args = [p, p, Arg::U64(len as u64), Arg::U64(seed), Arg::F32(std)];
            self.launch(kernel, grid, 256, &args)?;
        }
        Ok(b)
    }

    fn upload_f32_unchecked(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        self.not_capturing("upload_f32")?;
        let p = ptr_of("upload_f32", dst)?;
        self.gpu.upload(src, p)?;
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn upload_u32_unchecked(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()> {
        self.not_capturing("upload_u32")?;
        let p = ptr_of("upload_u32", dst)?;
        self.gpu.upload(src, p)?;
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn download_f32_unchecked(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()> {
        let p = ptr_of("download_f32", src)?;
        self.read_back(p, dst)
    }

    fn download_u32_unchecked(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()> {
        let p = ptr_of("download_u32", src)?;
        self.read_back(p, dst)
    }

    fn read_bytes_unchecked(
        &self,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let op = "read_bytes";
        let (start, _) = byte_range(op, src, offset, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let at = ptr_of(op, src)? + start as u64;
        if out.len() >= STAGED_COPY_BYTES {
            self.read_back_staged(at, out)
        } else {
            self.read_back(at, out)
        }
    }

    fn write_bytes_unchecked(
        &self,
        bytes: &[u8],
        dst: &mut DeviceBuffer,
        offset: usize,
    ) -> Result<()> {
        let op = "write_bytes";
        let (start, len) = byte_range(op, dst, offset, bytes.len())?;
        if len == 0 {
            return Ok(());
        }
        self.not_capturing(op)?;
        let at = ptr_of(op, dst)? + start as u64;
        if len >= STAGED_COPY_BYTES {
            for _ in 0..self.gpu.upload_staged(bytes, at)? {
                self.stats.host_sync();
            }
        } else {
            self.gpu.upload(bytes, at)?;
        }
        self.stats.transfer(len);
        Ok(())
    }
}
