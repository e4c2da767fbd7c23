//! The CPU backend: host memory, a process-wide rayon pool, the GEMM crate for dense matmuls.
//!
//! Each op is one parallel region, counted as one dispatch. Reading a buffer back is a plain
//! copy here, but it is still counted as a host sync so that CPU and GPU runs report alike.

mod op_impls;
pub(crate) mod ops;

use std::sync::Arc;

use rayon::prelude::*;

use corral_backend::Storage;
use corral_backend::sampling::{self, CANDIDATE_ROW_WORDS, DRAW_WORDS, Penalty};
use corral_backend::{
    AttentionMeta, AttentionShape, Backend, BackendError, BufferPool, BufferUsage, Buffers,
    Capabilities, DType, DeltaNetShape, Device, DeviceBuffer, DispatchStats, ExpertWeights,
    MappedFile, MoeRouting, MoeSorted, Ops, QkShape, QuantFormat, RecurrentRuns, Result,
    RopeParams, StatsCounter, WeightView, byte_range,
};
use ops::WeightRows;

/// Runs ops on the host CPU.
#[derive(Debug)]
pub struct CpuBackend {
    threads: usize,
    pool: BufferPool,
    stats: StatsCounter,
    kv_dtype: DType,
    capabilities: Capabilities,
}

impl CpuBackend {
    /// A backend using the process-wide rayon pool, keeping the KV cache in f32 (the
    /// conformance tests' exact path). The binary sizes that pool once, from `--threads`,
    /// before creating the backend.
    pub fn new() -> Self {
        Self {
            threads: rayon::current_num_threads(),
            pool: BufferPool::default(),
            stats: StatsCounter::default(),
            kv_dtype: DType::F32,
            // Every GGUF format; FP8 blocks are decoded at load (no CPU kernel reads them
            // faster than their bf16 values).
            capabilities: Capabilities {
                graphs: false,
                profiling: false,
                weight_formats: QuantFormat::ALL
                    .into_iter()
                    .filter(|&f| f != QuantFormat::F8E4M3x128)
                    .collect(),
                kv_dtypes: vec![DType::F32, DType::BF16],
                bf16_projection_inputs: false,
            },
        }
    }

    /// As [`CpuBackend::new`], keeping the KV cache in `kv_dtype`: F32, or BF16 (half the
    /// memory; rows widened to f32 as attention reads them).
    pub fn with_kv_dtype(kv_dtype: DType) -> Result<Self> {
        let backend = Self::new();
        if !backend.capabilities.kv_dtypes.contains(&kv_dtype) {
            return Err(bad(
                "CpuBackend",
                format!("a KV cache of {kv_dtype} (f32 or bf16 on the CPU)"),
            ));
        }
        Ok(Self {
            kv_dtype,
            ..backend
        })
    }

    fn new_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> DeviceBuffer {
        self.stats.allocation();
        let storage = match dtype {
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::U32 => Storage::U32(vec![0; len]),
            DType::BF16 | DType::F16 => Storage::Half(vec![0; len]),
            // Bytes held in words: nothing on the CPU computes on fp8 (its KV cache refuses it).
            DType::F8E4M3 => Storage::U32(vec![0; len.div_ceil(4)]),
            DType::Quant(format) => Storage::Bytes(vec![0; format.bytes_of(len)]),
        };
        DeviceBuffer::new(dtype, len, usage, storage)
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

fn bad(op: &'static str, detail: String) -> BackendError {
    BackendError::BadArgument { op, detail }
}

/// The first `n` elements of a host f32 buffer, its type and length checked by the caller
/// (`dyn Backend`'s entry point of the op).
fn read_f32<'a>(op: &'static str, b: &'a DeviceBuffer, n: usize) -> Result<&'a [f32]> {
    let v: &[f32] = match b.storage() {
        Storage::F32(v) => v,
        Storage::Mapped {
            file,
            byte_offset,
            byte_len,
        } => bytemuck::cast_slice(&file.bytes()[*byte_offset..*byte_offset + *byte_len]),
        _ => return Err(BackendError::ForeignBuffer { op }),
    };
    first(op, v, n)
}

/// As [`read_f32`], to be written.
fn write_f32<'a>(op: &'static str, b: &'a mut DeviceBuffer, n: usize) -> Result<&'a mut [f32]> {
    let len = b.len();
    match b.storage_mut() {
        Storage::F32(v) => v.get_mut(..n).ok_or_else(|| short(op, len, n)),
        _ => Err(BackendError::ForeignBuffer { op }),
    }
}

/// As [`write_f32`], of a u32 buffer.
fn write_u32<'a>(op: &'static str, b: &'a mut DeviceBuffer, n: usize) -> Result<&'a mut [u32]> {
    let len = b.len();
    match b.storage_mut() {
        Storage::U32(v) => v.get_mut(..n).ok_or_else(|| short(op, len, n)),
        _ => Err(BackendError::ForeignBuffer { op }),
    }
}

/// As [`read_f32`], of a u32 buffer.
fn read_u32<'a>(op: &'static str, b: &'a DeviceBuffer, n: usize) -> Result<&'a [u32]> {
    match b.storage() {
        Storage::U32(v) => first(op, v, n),
        _ => Err(BackendError::ForeignBuffer { op }),
    }
}

/// The first `n` of `v`.
fn first<'a, T>(op: &'static str, v: &'a [T], n: usize) -> Result<&'a [T]> {
    v.get(..n).ok_or_else(|| short(op, v.len(), n))
}

/// A buffer shorter than its caller checked: a backend's own misuse, named rather than a panic.
fn short(op: &'static str, len: usize, needed: usize) -> BackendError {
    BackendError::TooSmall {
        op,
        what: "buffer",
        len,
        needed,
    }
}

/// All elements of a float weight buffer in their stored type.
fn weight_rows<'a>(op: &'static str, b: &'a DeviceBuffer) -> Result<WeightRows<'a>> {
    let len = b.len();
    let half_bits: &'a [u16] = match b.storage() {
        Storage::F32(v) => return Ok(WeightRows::F32(&v[..len])),
        Storage::Half(v) => &v[..len],
        Storage::Mapped {
            file,
            byte_offset,
            byte_len,
        } => {
            let bytes = &file.bytes()[*byte_offset..*byte_offset + *byte_len];
            match b.dtype() {
                DType::F32 => return Ok(WeightRows::F32(bytemuck::cast_slice(bytes))),
                DType::Quant(format) => return Ok(WeightRows::Quant(format, bytes)),
                _ => bytemuck::cast_slice(bytes),
            }
        }
        Storage::Bytes(v) => match b.dtype() {
            DType::Quant(format) => {
                return Ok(WeightRows::Quant(format, &v[..format.bytes_of(len)]));
            }
            other => {
                return Err(bad(op, format!("weights of {other} held as bytes")));
            }
        },
        Storage::U32(_) => {
            return Err(bad(op, "weights must be a float buffer".to_string()));
        }
        Storage::Device(_) => return Err(BackendError::ForeignBuffer { op }),
    };
    match b.dtype() {
        DType::BF16 => Ok(WeightRows::Bf16(bytemuck::cast_slice(half_bits))),
        DType::F16 => Ok(WeightRows::F16(bytemuck::cast_slice(half_bits))),
        other => Err(BackendError::WrongDType {
            op,
            expected: DType::BF16,
            got: other,
        }),
    }
}

/// A KV cache buffer's first `needed` elements, f32 or bf16.
fn kv_rows<'a>(
    op: &'static str,
    what: &'static str,
    b: &'a DeviceBuffer,
    needed: usize,
) -> Result<ops::attention::KvRows<'a>> {
    match (b.dtype(), b.storage()) {
        (DType::F32, Storage::F32(v)) => Ok(ops::attention::KvRows::F32(first(op, v, needed)?)),
        (DType::BF16, Storage::Half(v)) => Ok(ops::attention::KvRows::Bf16(first(op, v, needed)?)),
        (dtype, _) => Err(bad(
            op,
            format!("`{what}` is a cache of {dtype} (f32 or bf16)"),
        )),
    }
}

/// As [`kv_rows`], to be written.
fn kv_rows_mut<'a>(
    op: &'static str,
    what: &'static str,
    b: &'a mut DeviceBuffer,
    needed: usize,
) -> Result<ops::attention::KvRowsMut<'a>> {
    let (dtype, len) = (b.dtype(), b.len());
    match (dtype, b.storage_mut()) {
        (DType::F32, Storage::F32(v)) => v
            .get_mut(..needed)
            .map(ops::attention::KvRowsMut::F32)
            .ok_or_else(|| short(op, len, needed)),
        (DType::BF16, Storage::Half(v)) => v
            .get_mut(..needed)
            .map(ops::attention::KvRowsMut::Bf16)
            .ok_or_else(|| short(op, len, needed)),
        _ => Err(bad(
            op,
            format!("`{what}` is a cache of {dtype} (f32 or bf16)"),
        )),
    }
}

/// The offsets and permutation of a sorting, their values checked to be consistent with
/// `pairs` (their buffers are checked by the caller).
fn checked_sorting<'a>(
    op: &'static str,
    sorted: MoeSorted<'a>,
    num_experts: usize,
    pairs: usize,
) -> Result<(&'a [u32], &'a [u32])> {
    let offsets = read_u32(op, sorted.expert_offsets, num_experts + 1)?;
    let order = read_u32(op, sorted.sorted_pairs, pairs)?;
    let monotone = offsets.windows(2).all(|w| w[0] <= w[1]);
    if offsets[0] != 0 || offsets[num_experts] as usize != pairs || !monotone {
        return Err(bad(
            op,
            "expert offsets do not partition the pairs".to_string(),
        ));
    }
    if let Some(&p) = order.iter().find(|&&p| p as usize >= pairs) {
        return Err(bad(
            op,
            format!("pair {p} is out of range for {pairs} pairs"),
        ));
    }
    Ok((offsets, order))
}

/// The runs of a recurrent op, checked against the token count and the state capacity; no
/// slot may appear twice.
/// RoPE's rotary dims must be even, within the head and within the kernel's tables.
/// The runs of a recurrent op, checked, into `out`.
fn recurrent_runs(
    op: &'static str,
    runs: RecurrentRuns<'_>,
    tokens: usize,
    slots: usize,
    out: &mut Vec<ops::delta_net::Run>,
) -> Result<()> {
    let raw = read_u32(op, runs.runs, runs.num_runs * 4)?;
    let kept = match runs.kept {
        Some(kept) => Some(read_u32(op, kept, runs.num_runs)?),
        None => None,
    };
    out.clear();
    for (i, r) in raw.chunks_exact(4).enumerate() {
        let run = ops::delta_net::Run {
            start: r[0] as usize,
            len: r[1] as usize,
            slot: r[2] as usize,
            fresh: r[3] != 0,
            kept: kept
                .map(|k| k[i])
                .filter(|&k| k != corral_backend::NO_KEPT_STATES)
                .map(|k| k as usize),
        };
        if run.start + run.len > tokens || run.slot >= slots {
            return Err(bad(
                op,
                format!(
                    "run at token {} (+{}) in slot {} exceeds the batch or the {slots} slots",
                    run.start, run.len, run.slot
                ),
            ));
        }
        // Kept states go to slots of their own, past no other run's.
        let kept_slots =
            |r: &ops::delta_net::Run| r.kept.map_or(0..0, |k| k..k + r.len.saturating_sub(1));
        let mine = kept_slots(&run);
        if mine.end > slots || mine.contains(&run.slot) {
            return Err(bad(
                op,
                format!(
                    "run at token {} keeps states in slots {mine:?}: beyond the {slots} slots or its own",
                    run.start
                ),
            ));
        }
        if run.len > runs.max_run_tokens {
            return Err(bad(
                op,
                format!(
                    "a run of {} tokens, beyond the batch's promised longest run of {}",
                    run.len, runs.max_run_tokens
                ),
            ));
        }
        // Work items write per run and slot: runs must not share either.
        let overlaps = |o: &ops::delta_net::Run| {
            let theirs = kept_slots(o);
            o.slot == run.slot
                || (run.start < o.start + o.len && o.start < run.start + run.len)
                || theirs.contains(&run.slot)
                || mine.contains(&o.slot)
                || (mine.start < theirs.end && theirs.start < mine.end)
        };
        if out.iter().any(overlaps) {
            return Err(bad(
                op,
                format!(
                    "run at token {} shares a slot or tokens with another run",
                    run.start
                ),
            ));
        }
        out.push(run);
    }
    Ok(())
}

thread_local! {
    /// A row's candidate keys while its top candidates are found, reused.
    static CANDIDATE_KEYS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A recurrent op's runs, reused.
    static RECURRENT_RUNS: std::cell::RefCell<Vec<ops::delta_net::Run>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Device for CpuBackend {
    fn device_name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn stats(&self) -> DispatchStats {
        self.stats.snapshot()
    }

    /// The step runs on a thread of the pool, and every other thread of the pool runs
    /// [`keep_busy`] until it ends.
    fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        let done = std::sync::atomic::AtomicBool::new(false);
        // In the pool (a step run from outside it would send each parallel region there
        // and wait); a scope with nothing spawned allocates nothing.
        rayon::scope(|_| with_busy_threads(rayon::current_num_threads() - 1, &done, step));
    }

    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn synchronize(&self) -> Result<()> {
        self.stats.host_sync();
        Ok(())
    }

    fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }
}

impl Buffers for CpuBackend {
    fn take_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        Ok(match self.pool.take(dtype, len, usage) {
            Some(b) => b,
            None => self.new_buffer(dtype, len, usage),
        })
    }

    fn give_buffer(&self, buffer: DeviceBuffer) {
        self.pool.give(buffer);
    }

    fn pool_bytes(&self) -> (usize, usize) {
        (self.pool.free_bytes(), self.pool.limit_bytes())
    }

    fn alloc_zeroed(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        Ok(self.new_buffer(dtype, len, usage))
    }

    fn weight_from_blocks_unchecked(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        self.stats.allocation();
        Ok(DeviceBuffer::new(
            dtype,
            len,
            BufferUsage::Weights,
            Storage::Bytes(blocks),
        ))
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
        // Block formats are read a byte at a time.
        let aligned = matches!(dtype, DType::Quant(_))
            || (bytes.as_ptr() as usize).is_multiple_of(dtype.size_bytes());
        let storage = match (aligned, dtype) {
            (true, DType::F32 | DType::BF16 | DType::F16 | DType::Quant(_)) => Storage::Mapped {
                file: Arc::clone(file),
                byte_offset,
                byte_len,
            },
            (false, DType::F32) => {
                self.stats.allocation();
                Storage::F32(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
            }
            (false, DType::BF16 | DType::F16) => {
                self.stats.allocation();
                Storage::Half(
                    bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
            }
            (false, DType::Quant(_)) | (_, DType::U32 | DType::F8E4M3) => {
                return Err(bad(op, format!("weights of {dtype}")));
            }
        };
        Ok(DeviceBuffer::new(dtype, len, BufferUsage::Weights, storage))
    }

    fn weight_from_f32_unchecked(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer> {
        self.stats.allocation();
        let storage = match dtype {
            DType::F32 => Storage::F32(values.to_vec()),
            DType::BF16 => Storage::Half(
                values
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect(),
            ),
            DType::F16 => Storage::Half(
                values
                    .iter()
                    .map(|v| half::f16::from_f32(*v).to_bits())
                    .collect(),
            ),
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => {
                return Err(bad("weight_from_f32", format!("weights of {dtype}")));
            }
        };
        Ok(DeviceBuffer::new(
            dtype,
            values.len(),
            BufferUsage::Weights,
            storage,
        ))
    }

    fn upload_f32_unchecked(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        write_f32("upload_f32", dst, src.len())?.copy_from_slice(src);
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn upload_u32_unchecked(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()> {
        write_u32("upload_u32", dst, src.len())?.copy_from_slice(src);
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn download_f32_unchecked(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()> {
        dst.copy_from_slice(read_f32("download_f32", src, dst.len())?);
        self.stats.host_sync();
        self.stats.transfer(std::mem::size_of_val(dst));
        Ok(())
    }

    fn download_u32_unchecked(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()> {
        dst.copy_from_slice(read_u32("download_u32", src, dst.len())?);
        self.stats.host_sync();
        self.stats.transfer(std::mem::size_of_val(dst));
        Ok(())
    }

    fn read_bytes_unchecked(
        &self,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let op = "read_bytes";
        let (start, len) = byte_range(op, src, offset, out.len())?;
        let elem = src.dtype().size_bytes();
        let first = start / elem;
        match src.storage() {
            Storage::F32(v) => put_le(&v[first..first + len / 4], out, f32::to_le_bytes),
            Storage::U32(v) => put_le(&v[first..first + len / 4], out, u32::to_le_bytes),
            Storage::Half(v) => put_le(&v[first..first + len / 2], out, u16::to_le_bytes),
            Storage::Mapped {
                file, byte_offset, ..
            } => out.copy_from_slice(&file.bytes()[byte_offset + start..byte_offset + start + len]),
            _ => return Err(BackendError::ForeignBuffer { op }),
        }
        self.stats.host_sync();
        self.stats.transfer(len);
        Ok(())
    }

    fn write_bytes_unchecked(
        &self,
        bytes: &[u8],
        dst: &mut DeviceBuffer,
        offset: usize,
    ) -> Result<()> {
        let op = "write_bytes";
        let (start, len) = byte_range(op, dst, offset, bytes.len())?;
        let elem = dst.dtype().size_bytes();
        let first = start / elem;
        match dst.storage_mut() {
            Storage::F32(v) => take_le(bytes, &mut v[first..first + len / 4], f32::from_le_bytes),
            Storage::U32(v) => take_le(bytes, &mut v[first..first + len / 4], u32::from_le_bytes),
            Storage::Half(v) => take_le(bytes, &mut v[first..first + len / 2], u16::from_le_bytes),
            _ => {
                return Err(bad(
                    op,
                    "the buffer is read-only or not the CPU's".to_string(),
                ));
            }
        }
        self.stats.transfer(len);
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn ops(&self) -> &dyn Ops {
        self
    }
}

/// Elements to little-endian bytes.
fn put_le<T: Copy, const N: usize>(v: &[T], out: &mut [u8], f: fn(T) -> [u8; N]) {
    for (chunk, &x) in out.chunks_exact_mut(N).zip(v) {
        chunk.copy_from_slice(&f(x));
    }
}

/// Little-endian bytes to elements.
fn take_le<T, const N: usize>(bytes: &[u8], v: &mut [T], f: fn([u8; N]) -> T) {
    for (x, chunk) in v.iter_mut().zip(bytes.chunks_exact(N)) {
        let mut b = [0u8; N];
        b.copy_from_slice(chunk);
        *x = f(b);
    }
}

/// The first `count` block ids of `ids`, each checked below `blocks`.
fn block_ids(
    op: &'static str,
    ids: &DeviceBuffer,
    count: usize,
    blocks: usize,
) -> Result<Vec<usize>> {
    let Storage::U32(v) = ids.storage() else {
        return Err(bad(op, "block ids are not a CPU U32 buffer".to_string()));
    };
    let ids = v.get(..count).ok_or_else(|| {
        bad(
            op,
            format!("{count} block ids from a buffer of {}", v.len()),
        )
    })?;
    ids.iter()
        .map(|&id| {
            let id = id as usize;
            (id < blocks)
                .then_some(id)
                .ok_or_else(|| bad(op, format!("block {id} of a buffer of {blocks} blocks")))
        })
        .collect()
}

/// Block `ids[i]` of `src` to block `i` of `dst` (`gather`), or block `i` of `src` to block
/// `ids[i]` of `dst`; blocks of `n` elements of one stored type (checked by the caller).
fn copy_blocks(
    op: &'static str,
    src: &DeviceBuffer,
    dst: &mut DeviceBuffer,
    ids: &[usize],
    n: usize,
    gather: bool,
) -> Result<()> {
    fn each<T: Copy>(src: &[T], dst: &mut [T], ids: &[usize], n: usize, gather: bool) {
        for (i, &id) in ids.iter().enumerate() {
            let (from, to) = if gather {
                (id * n, i * n)
            } else {
                (i * n, id * n)
            };
            dst[to..to + n].copy_from_slice(&src[from..from + n]);
        }
    }
    match (src.storage(), dst.storage_mut()) {
        (Storage::F32(s), Storage::F32(d)) => each(s, d, ids, n, gather),
        (Storage::U32(s), Storage::U32(d)) => each(s, d, ids, n, gather),
        (Storage::Half(s), Storage::Half(d)) => each(s, d, ids, n, gather),
        _ => return Err(bad(op, "buffers not the CPU's, or read-only".to_string())),
    }
    Ok(())
}

/// Runs `step`, then sets `done`, with [`keep_busy`] offered to `threads` other threads of
/// the pool. Each is the second half of a join, a job on this thread's stack (spawned, each
/// was an allocation a step), all on this thread's queue ahead of the step's own jobs: a
/// thread steals the oldest job first, so this thread, waiting on a stolen part of the step,
/// never finds one of them left to run itself.
fn with_busy_threads(
    threads: usize,
    done: &std::sync::atomic::AtomicBool,
    step: &mut (dyn FnMut() + Send),
) {
    if threads == 0 {
        step();
        done.store(true, std::sync::atomic::Ordering::Release);
    } else {
        rayon::join(
            || with_busy_threads(threads - 1, done, step),
            || keep_busy(done),
        );
    }
}

/// Until `done`, runs the pool's jobs as its other threads split them off rather than going
/// to sleep between one op's parallel region and the next: a step's ops are tens of
/// microseconds each, and a sleeping thread woken for each took a tenth of a decode step in
/// the kernel's scheduler.
fn keep_busy(done: &std::sync::atomic::AtomicBool) {
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
}
