//! The CUDA backend: NVRTC-compiled kernels on one NVIDIA GPU, with the driver, NVRTC and
//! cuBLAS opened at run time (one binary runs with or without a GPU).
//!
//! Activations are f32 in device memory; weights stay in their stored type (bf16, f16, f32)
//! and are converted inside the kernels that read them. Projections run on 16-bit tensor
//! cores with f32 accumulation (bf16, or f16 for f16/f32 weights): cuBLAS for more than 32
//! rows of bf16 weights, 64x64 tiles for other many-row cases, and few-row kernels that read
//! each weight once for 2 to 32 rows; one row, or f32 weights, run as f32 matrix-vector
//! products. Attention runs on tensor cores over the bf16 cache (flash tiles for prefill
//! chunks, mma decode kernels split over the keys otherwise). Norms, softmax and routing are
//! f32; the KV cache is bf16. Decode steps are recorded as CUDA graphs by the model and
//! replayed; on sm_90+ kernels launch overlapped (each waits for its predecessor in
//! `begin_kernel()`). Every op is queued on one stream and
//! goes through [`CudaBackend::launch`] (or, for cuBLAS, the same counting), which counts
//! it. Nothing waits for the device except the read-backs, and each read-back also returns
//! the kernels' error flag and the weight bytes they read.
mod blas;
mod compile;
mod device;
mod device_impl;
mod kernels;
mod nccl;
mod ops;
use ops::quant;

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use device::DeviceMem;
pub use kernels::KernelCacheReport;
pub use nccl::{Nccl, NcclCollective, nccl_group};

use blas::Blas;
use compile::KernelCache;
use corral_backend::Storage;
use corral_backend::sampling::{CANDIDATE_ROW_WORDS, DRAW_WORDS, MAX_REDUCED_VOCAB};
use corral_backend::{
    AttentionMeta, AttentionShape, Backend, BackendError, BufferPool, BufferUsage, Buffers,
    Capabilities, DType, DeltaNetShape, DeviceBuffer, DispatchStats, ExpertMatrices, ExpertWeights,
    MappedFile, MoeRouting, MoeSorted, Ops, QkShape, QuantFormat, RecurrentRuns, Result,
    RopeParams, StatsCounter, WeightView, byte_range, kv_row_elems,
};
use cudarc::driver::CudaEvent;
use device::{Gpu, Kernel};
use kernels::{BigTileKernels, FlashKernels, GPU_QUANT_FORMATS, Kernels, WeightKernels};

/// How to open the CUDA backend.
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// Device ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Folder of the compiled-kernel cache (default: `$CORRAL_KERNEL_CACHE`, else
    /// `$XDG_CACHE_HOME/corral/kernels`, else `~/.cache/corral/kernels`).
    pub kernel_cache: Option<PathBuf>,
    /// KV cache element type: bf16 (default) or f32.
    pub kv_dtype: Option<DType>,
    /// Run every projection on Corral's own kernels even where cuBLAS is installed.
    pub without_cublas: bool,
    /// Launch kernels strictly one after another, without programmatic dependent launch
    /// (which lets a kernel be scheduled while the one before it finishes, on sm_90+).
    pub serial_launches: bool,
    /// Run the gated delta rule token by token for prefill too, not in the chunked form (to
    /// measure what the chunked form saves).
    pub recurrent_delta_rule: bool,
    /// Keep every projection's input in f32, rounded to bf16 by a conversion before each
    /// cuBLAS GEMM, instead of in bf16 from the norm (to measure what that saves).
    pub f32_gemm_inputs: bool,
    /// Run the few-row grouped experts on blocks that read their weights straight from
    /// global memory, not streamed through shared memory by bulk copies (sm_90+), to measure
    /// what streaming saves.
    pub unstreamed_experts: bool,
    /// Run few-row dense projections on blocks that read their weights straight from global
    /// memory, not streamed (sm_90+), to measure what streaming saves.
    pub unstreamed_projections: bool,
    /// Prefill's 128-row expert tiles take their activations (x from the norm, and the
    /// SwiGLU output) as split bf16 pairs, about 16 significant bits, instead of rounding them
    /// to bf16: products near f32's at about twice the tiles' tensor-core work.
    pub precise_experts: bool,
}

impl CudaOptions {
    /// The switches that turn one optimisation off to measure what it saves, read from the
    /// environment: `CORRAL_SERIAL_LAUNCHES`, `CORRAL_RECURRENT_DELTA_RULE`,
    /// `CORRAL_F32_GEMM_INPUTS`, `CORRAL_UNSTREAMED_EXPERTS` and
    /// `CORRAL_UNSTREAMED_PROJECTIONS`, each on when `1`.
    pub fn with_switches_from_env(self) -> Self {
        let on = |name: &str| std::env::var(name).is_ok_and(|v| v == "1");
        Self {
            serial_launches: on("CORRAL_SERIAL_LAUNCHES"),
            recurrent_delta_rule: on("CORRAL_RECURRENT_DELTA_RULE"),
            f32_gemm_inputs: on("CORRAL_F32_GEMM_INPUTS"),
            unstreamed_experts: on("CORRAL_UNSTREAMED_EXPERTS"),
            unstreamed_projections: on("CORRAL_UNSTREAMED_PROJECTIONS"),
            ..self
        }
    }
}

/// The number of usable CUDA devices, or why there are none (no driver, no device).
pub fn cuda_available() -> std::result::Result<usize, String> {
    if !device::driver_present() {
        return Err("libcuda.so could not be opened (no NVIDIA driver)".to_string());
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("the CUDA driver reports no device".to_string()),
        Err(e) => Err(format!("the CUDA driver could not start: {e:?}")),
    }
}

/// Runs ops on an NVIDIA GPU.
#[derive(Debug)]
pub struct CudaBackend {
    /// cuBLAS when installed (first field: dropped before the stream it is bound to).
    blas: Option<Blas>,
    gpu: Gpu,
    kernels: Kernels,
    ordinal: usize,
    pool: BufferPool,
    stats: StatsCounter,
    /// Device bytes in use once the context and kernels were loaded, before any buffer.
    runtime_bytes: u64,
    /// Error flag (u32) and weight-byte counter (u64) written by kernels.
    diag: DeviceMem,
    kv_dtype: DType,
    cache_report: KernelCacheReport,
    /// Whether a graph is being recorded, and the dispatch count when it began.
    capturing: AtomicBool,
    capture_start: AtomicU64,
    /// Weight bytes counted when the recording began.
    capture_start_bytes: AtomicU64,
    /// Workspace of single ops, fixed size (allocated once): the partial results of attention
    /// split over the keys, and the chunked delta rule's per-chunk matrices. Ops run one
    /// after another on the stream, so they share it.
    op_scratch: DeviceBuffer,
    /// [`CudaOptions::recurrent_delta_rule`].
    recurrent_delta_rule: bool,
    /// [`CudaOptions::f32_gemm_inputs`].
    f32_gemm_inputs: bool,
    /// [`CudaOptions::unstreamed_experts`].
    unstreamed_experts: bool,
    /// [`CudaOptions::unstreamed_projections`].
    unstreamed_projections: bool,
    /// [`CudaOptions::precise_experts`].
    precise_experts: bool,
    /// Zeroed tickets, one per (token, KV head) block row of a split attention launch.
    attention_counters: DeviceBuffer,
    /// Tickets of the few-row projections that split K (zero between launches).
    projection_counters: DeviceBuffer,
    /// Per-block partial results of the sampling reduction (fixed size: allocated once),
    /// and its zeroed tickets, one per row of a launch.
    sampling_scratch: DeviceBuffer,
    sampling_tickets: DeviceBuffer,
    /// What [`Device::kernels_id`](corral_backend::Device::kernels_id) reports: the kernel sources' hash, and whether cuBLAS runs.
    kernels_id: u64,
    /// Event pairs around each launch while profiling.
    profile: Mutex<Option<Vec<TimedLaunch>>>,
    /// Whether `profile` is on: launches check this before taking the lock.
    profiling: AtomicBool,
    /// Bf16 copies of a block-format MoE layer's experts for the grouped tiles.
    decoded_experts: Mutex<Option<quant::DecodedExperts>>,
    capabilities: Capabilities,
}

/// An instantiated CUDA graph.
struct CapturedGraph(cudarc::driver::CudaGraph);

// SAFETY: the graph is only launched on the backend's stream, and callers serialise their
// use of it (the model keeps graphs behind a mutex); cudarc marks it !Send only because
// the driver does not synchronise concurrent calls on one graph.
#[allow(unsafe_code)]
unsafe impl Send for CapturedGraph {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for CapturedGraph {}

/// A launch's kernel name and the events recorded around it.
type TimedLaunch = (&'static str, CudaEvent, CudaEvent);

/// A kernel argument, passed to the driver as a pointer to its bits.
#[derive(Clone, Copy, Debug)]
enum Arg {
    Ptr(u64),
    U32(u32),
    U64(u64),
    F32(f32),
}

impl Arg {
    fn bits(self) -> u64 {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => v,
            Arg::U32(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

const MAX_ARGS: usize = 24;

/// Byte copies to or from the host of at least this many bytes go through page-locked
/// staging.
const STAGED_COPY_BYTES: usize = 1 << 20;

/// Rows up to which projections stream weights through matrix-vector products rather than
/// 64x64 tensor-core tiles.
const MATVEC_MAX_ROWS: usize = 32;

/// Tokens per chunk of the chunked delta rule (delta_net.cu's GDR_CHUNK).
const GDR_CHUNK: usize = 64;
/// State columns per scan block of the chunked delta rule (GDR_SLICE), and its blocks' threads
/// (GDR_THREADS).
const GDR_SLICE: usize = 32;
const GDR_THREADS: u32 = 256;

/// Bytes of the chunked delta rule's workspace per (chunk, value head) (delta_net.cu's
/// gdr_chunk_bytes): −W, q̂ and k̂ (bf16 [64][dk rounded up to 16]) and M's two halves (bf16
/// [64][64]), then 132 tail floats and U (f32 [64][dv]).
fn gdr_chunk_bytes(dk: usize, dv: usize) -> usize {
    2 * (3 * GDR_CHUNK * dk.next_multiple_of(16) + 2 * GDR_CHUNK * GDR_CHUNK)
        + 4 * (132 + GDR_CHUNK * dv)
}
/// Runs from which the delta rule takes the chunked form rather than the token-by-token
/// recurrence.
const CHUNKED_DELTA_MIN_RUN: usize = 16;

/// Floats of the op scratch (128 MiB): bounds how far attention splits, and how many chunks
/// one launch pair of the chunked delta rule takes.
const OP_SCRATCH_FLOATS: usize = 32 << 20;
/// Block rows (tokens × KV heads) up to which decode attention may split over the keys.
const ATTENTION_COUNTERS: usize = 1 << 16;
/// Output features per block of the few-row grouped down projection (moe.cu's
/// DOWN_MVM_GROUPS groups of 16).
const DOWN_MVM_FEATURES: usize = 64;
/// The most query heads per KV head of the tensor-core decode attention (attention.cu).
const DECODE_MMA_MAX_GROUP: usize = 8;
/// The longest run from which attention runs on tensor cores (flash_attention.cu).
const FLASH_MIN_RUN: usize = 64;
/// Tokens from which the q/k norm and rotation takes five heads a warp (a block a token).
const QKV_WIDE_MIN_TOKENS: usize = 256;

/// (head, split) pairs one merge of decode attention's splits holds (attention.cu's
/// ATTN_MERGE_SLOTS): a group of heads splits at most this many over its heads.
const ATTENTION_MERGE_SLOTS: usize = 1024;
/// Fewest keys per split of decode attention, and most splits (attention.cu's
/// ATTN_MAX_SPLITS); threads of its blocks (ATTN_WARPS warps).
const ATTENTION_MIN_SPLIT_KEYS: usize = 64;
const ATTENTION_MAX_SPLITS: usize = 64;
/// Blocks decode attention aims for over all its (token, KV head) rows, and the most keys a
/// split takes beyond that aim: more and smaller splits cost more to merge than their
/// parallelism gains (measured on the H200, Qwen3-30B-A3B, batch 1 to 32, context 512 and
/// 8192: against splits filling 8 blocks an SM, the same or faster everywhere, batch 8 at
/// context 8192 by 10%).
const ATTENTION_TARGET_BLOCKS: usize = 128;
const ATTENTION_SPLIT_MAX_KEYS: usize = 1024;
const ATTENTION_THREADS: u32 = 128;

/// Logits one block of the sampling reduction covers, most blocks a row, and rows a launch
/// (sampling.cu's SAMPLE_CHUNK, SAMPLE_MAX_PARTS; the scratch's and tickets' rows).
const SAMPLE_CHUNK: usize = 1024 * 16;
const SAMPLE_MAX_PARTS: usize = 32;
const _: () = assert!(SAMPLE_CHUNK * SAMPLE_MAX_PARTS == MAX_REDUCED_VOCAB);
const SAMPLE_MAX_ROWS: usize = 256;
const SAMPLE_THREADS: u32 = 1024;

/// Routed pairs a block of the expert sort places when there are more than that, the most
/// blocks, and the most experts of that sort (moe.cu's SORT_OUTSIDE_EXPERTS).
const SORT_CHUNK: usize = 1024;
const SORT_MAX_BLOCKS: usize = 64;
const SORT_CHUNKED_MAX_EXPERTS: usize = 1024;
/// Tokens up to which routing ranks each token's experts in a block of its own, and the
/// experts and choices that kernel holds (moe.cu's RANKED_MAX_EXPERTS, RANKED_MAX_CHOICES).
const RANKED_ROUTE_MAX_TOKENS: usize = 64;
/// Experts up to which routing ranks them for any number of tokens.
const RANKED_ROUTE_ALWAYS_EXPERTS: usize = 128;
const RANKED_ROUTE_MAX_EXPERTS: usize = 1024;
const RANKED_ROUTE_MAX_CHOICES: usize = 64;

/// The block formats the CUDA backend reads as stored (its `Capabilities::weight_formats`,
/// known without a device: `corral plan` counts the others decoded).
pub fn cuda_weight_formats() -> &'static [corral_backend::QuantFormat] {
    &GPU_QUANT_FORMATS
}

/// Bytes of the device buffers the CUDA backend allocates once at start, whatever the model:
/// its op scratch, cuBLAS workspace and sampling scratch (not the CUDA context or the loaded
/// kernels), for memory plans.
pub fn cuda_fixed_buffer_bytes() -> usize {
    OP_SCRATCH_FLOATS * 4
        + blas::WORKSPACE_BYTES
        + SAMPLE_MAX_ROWS * SAMPLE_MAX_PARTS * CANDIDATE_ROW_WORDS * 4
}

/// Threads of the few-row tensor-core kernels (mma_vec.cuh's MVM_WARPS warps).
const MVM_THREADS: u32 = 256;
/// Blocks an SM from which a few-row projection reads whole rows of K in each block; with
/// fewer 16-feature tiles than that, K is split over blocks (matvec_mma_split).
const MVM_SPLIT_BLOCKS_PER_SM: usize = 4;
/// The least of K a split takes: a span of 32 for each of the block's 8 warps.
const MVM_SPLIT_MIN_K: usize = 256;
/// Tiles up to which a projection may split K: the tickets of their last blocks.
const PROJECTION_COUNTERS: usize = 4096;

/// The elements of K each block of a few-row projection of `tiles` 16-feature tiles takes,
/// where splitting K fills more of `multiprocessors`; `None`: whole rows in each block.
fn projection_split_k(tiles: usize, k: usize, multiprocessors: usize) -> Option<usize> {
    let target = MVM_SPLIT_BLOCKS_PER_SM * multiprocessors;
    if tiles == 0 || tiles >= target || tiles > PROJECTION_COUNTERS {
        return None;
    }
    let split_k = k.div_ceil(target.div_ceil(tiles)).div_ceil(MVM_SPLIT_MIN_K) * MVM_SPLIT_MIN_K;
    (split_k < k).then_some(split_k)
}

/// Threads of the streamed few-row products (streamed_mvm.cuh's STREAM_THREADS: 8 consumer
/// warps and a producer) and the longest K their stages hold (STREAM_MAX_K).
const STREAM_THREADS: u32 = 288;
const STREAM_MAX_K: usize = 2048;
/// Tokens up to which grouped experts stream: no expert has more than 8 rows then, one mma
/// column block, so every unit costs the same and a block's contiguous range of units is
/// balanced. (With more, an expert hit by many rows, such as a shared expert, costs its
/// few blocks a pass per 8 rows of every unit: Qwen3.5-35B-A3B at batch 32 measured 50.0 ms
/// a step against 20.2 unstreamed.)
const STREAM_MAX_TOKENS: usize = 8;
/// Rows of x of the streamed dense projections (one row stays on CUDA cores in f32, as
/// unstreamed), and the 16-feature units an SM they need at least: with fewer, the ramp and
/// tail of one pass cost more than streaming saves (Qwen3-30B-A3B's output projection, 128
/// units of K = 4096, and router, 8 units, measured slower streamed).
const STREAM_PROJECTION_ROWS: std::ops::RangeInclusive<usize> = 2..=8;
const STREAM_PROJECTION_UNITS_PER_SM: usize = 2;

/// Rows per expert on average up to which grouped experts run as few-row products (each
/// hit expert read once) rather than 64-row tiles, or rather than 128-row tiles where those
/// run (bf16 experts with 16-byte rows).
const GROUPED_FEW_ROWS: usize = 24;
const FEW_ROWS_BEFORE_BIG_TILES: usize = 2;
/// Sorted rows per tile, and threads per block, of the prefill-sized expert tiles.
const BIG_TILE_ROWS: usize = 128;
const BIG_TILE_THREADS: u32 = 256;

/// Splits of the keys for decode attention over `blocks` (token, KV head) rows of up to
/// `max_context` keys: about ATTENTION_TARGET_BLOCKS blocks in all, splits of at most
/// ATTENTION_SPLIT_MAX_KEYS keys and at least ATTENTION_MIN_SPLIT_KEYS, at most
/// ATTENTION_MAX_SPLITS of them.
fn attention_splits(blocks: usize, max_context: usize) -> usize {
    ATTENTION_TARGET_BLOCKS
        .div_ceil(blocks.max(1))
        .max(max_context.div_ceil(ATTENTION_SPLIT_MAX_KEYS))
        .min(max_context.div_ceil(ATTENTION_MIN_SPLIT_KEYS))
        .clamp(1, ATTENTION_MAX_SPLITS)
}

/// The few-row grouped-expert kernel for `pairs` routed rows over `experts`: 8 rows at a
/// time (index 0) or 32 (index 1); `None`: enough rows for tiles (128-row ones when
/// `big_tiles`).
fn few_rows_variant(pairs: usize, experts: usize, big_tiles: bool) -> Option<usize> {
    let average = pairs.div_ceil(experts.max(1));
    let last = if big_tiles {
        FEW_ROWS_BEFORE_BIG_TILES
    } else {
        GROUPED_FEW_ROWS
    };
    match average {
        _ if average > last => None,
        0..=8 => Some(0),
        _ => Some(1),
    }
}

/// Threads of a prefill attention tile (flash_attention.cu's FA_THREADS).
pub(crate) const FLASH_THREADS: u32 = 128;

/// Fewest keys a split of prefill attention takes: fewer cost more to merge than they gain.
const FLASH_MIN_SPLIT_KEYS: usize = 512;

/// Keys a split of prefill attention takes (a multiple of 64), for its `blocks` (head, tile)
/// pairs of `tokens` over up to `max_context` keys, on a GPU holding `resident` of its blocks
/// at once, splitting at most `fit` times (what the scratch holds): `max_context` (one split)
/// unless the history outweighs the new tokens. Then the blocks cost about the same, and a last
/// wave that is mostly empty leaves SMs idle, so the fewest splits whose waves are 90% full,
/// else the fullest. (A prompt's own causal tiles differ in cost, and heaviest first they
/// balance without.)
fn flash_split_keys(
    blocks: usize,
    tokens: usize,
    max_context: usize,
    resident: usize,
    fit: usize,
) -> usize {
    let whole = max_context.max(1).next_multiple_of(64);
    if max_context < 2 * tokens || blocks == 0 || resident == 0 {
        return whole;
    }
    let most = (max_context / FLASH_MIN_SPLIT_KEYS).min(fit).max(1);
    // Keys a split takes when aiming at `splits`, and the splits that launches.
    let keys = |splits: usize| max_context.div_ceil(splits).next_multiple_of(64);
    let launched = |splits: usize| max_context.div_ceil(keys(splits));
    // Per mille of the waves' slots the launched splits fill.
    let fill = |splits: usize| {
        let total = blocks * launched(splits);
        total * 1000 / (total.div_ceil(resident) * resident)
    };
    let best = (1..=most)
        .find(|&s| fill(s) >= 900)
        .unwrap_or_else(|| (1..=most).rev().max_by_key(|&s| fill(s)).unwrap_or(1));
    keys(best)
}

/// `len` u32 tickets on the device, zero: a split kernel's last block takes its row's and
/// leaves it zero again for the next launch.
fn zeroed_tickets(gpu: &Gpu, len: usize) -> Result<DeviceBuffer> {
    let mem = gpu.alloc(len * 4)?;
    gpu.memset_zero(mem.ptr(), len * 4)?;
    gpu.sync()?;
    Ok(DeviceBuffer::new(
        DType::U32,
        len,
        BufferUsage::Metadata,
        mem.into_storage(),
    ))
}

fn bad(op: &'static str, detail: String) -> BackendError {
    BackendError::BadArgument { op, detail }
}

fn u32_of(op: &'static str, v: usize) -> Result<Arg> {
    u32::try_from(v)
        .map(Arg::U32)
        .map_err(|_| bad(op, format!("{v} does not fit the kernel's 32-bit size")))
}

fn grid_of(op: &'static str, v: usize) -> Result<u32> {
    match u32::try_from(v) {
        Ok(n) if n > 0 && n < (1 << 31) => Ok(n),
        _ => Err(bad(op, format!("grid of {v} blocks is out of range"))),
    }
}

/// The device address of a CUDA buffer.
fn ptr_of(op: &'static str, b: &DeviceBuffer) -> Result<u64> {
    match b.storage() {
        Storage::Device(mem) if mem.owner::<DeviceMem>().is_some() => Ok(mem.address()),
        _ => Err(BackendError::ForeignBuffer { op }),
    }
}

/// A buffer's address as a kernel argument, its type and length checked by the caller
/// (`dyn Backend`'s entry point of the op).
fn addr(op: &'static str, b: &DeviceBuffer) -> Result<Arg> {
    Ok(Arg::Ptr(ptr_of(op, b)?))
}

/// The address of a buffer of `dtype` with at least `needed` elements.
fn buf(
    op: &'static str,
    what: &'static str,
    b: &DeviceBuffer,
    dtype: DType,
    needed: usize,
) -> Result<Arg> {
    if b.dtype() != dtype {
        return Err(BackendError::WrongDType {
            op,
            expected: dtype,
            got: b.dtype(),
        });
    }
    if b.len() < needed {
        return Err(BackendError::TooSmall {
            op,
            what,
            len: b.len(),
            needed,
        });
    }
    Ok(Arg::Ptr(ptr_of(op, b)?))
}

/// [`RecurrentRuns::kept`] as a kernel argument: its buffer, or null.
fn kept_arg(op: &'static str, runs: RecurrentRuns<'_>) -> Result<Arg> {
    match runs.kept {
        Some(kept) => addr(op, kept),
        None => Ok(Arg::Ptr(0)),
    }
}

/// The address of element `first` of a buffer of `dtype` with at least `first + count`
/// elements: a kernel's view of a range of the batch's tokens.
fn buf_range(
    op: &'static str,
    what: &'static str,
    b: &DeviceBuffer,
    dtype: DType,
    first: usize,
    count: usize,
) -> Result<Arg> {
    match buf(op, what, b, dtype, first + count)? {
        Arg::Ptr(p) => Ok(Arg::Ptr(p + (first * dtype.size_bytes()) as u64)),
        other => Ok(other),
    }
}

/// The operands of one paged attention, shared by the launches of its ranges of tokens.
struct Attention<'a> {
    q: &'a DeviceBuffer,
    cache_k: &'a DeviceBuffer,
    cache_v: &'a DeviceBuffer,
    meta: &'a AttentionMeta<'a>,
    shape: AttentionShape,
}

/// A weight view's address, type and whether its rows allow 16-byte loads.
fn weight(op: &'static str, w: WeightView<'_>) -> Result<(u64, DType, bool)> {
    let dtype = w.buffer.dtype();
    let addr = ptr_of(op, w.buffer)? + dtype.bytes_of(w.offset) as u64;
    let quant = matches!(dtype, DType::Quant(_));
    let vec = !quant && addr.is_multiple_of(16) && w.cols.is_multiple_of(8);
    Ok((addr, dtype, vec))
}

/// The kernels' RoPE arguments: theta, YaRN's factor (0: plain), the blend's first pair and
/// width, and the factor on cos and sin.
fn rope_args(rope: RopeParams, rotary_dim: usize) -> [Arg; 5] {
    let a = rope.args(rotary_dim);
    [
        Arg::F32(a.theta),
        Arg::F32(a.factor),
        Arg::F32(a.ramp_low),
        Arg::F32(a.ramp_width),
        Arg::F32(a.attention_factor),
    ]
}

/// The grouped expert kernels' view of the sort: offsets, hit experts, sorted pairs, and the
/// pair and expert counts.
fn sorted_args(
    op: &'static str,
    sorted: MoeSorted<'_>,
    num_experts: usize,
    pairs: usize,
) -> Result<[Arg; 5]> {
    Ok([
        addr(op, sorted.expert_offsets)?,
        addr(op, sorted.hit_experts)?,
        addr(op, sorted.sorted_pairs)?,
        u32_of(op, pairs)?,
        u32_of(op, num_experts)?,
    ])
}

/// Threads of a block that normalises one row of `dim`.
fn norm_block(dim: usize) -> u32 {
    if dim <= 256 { 128 } else { 256 }
}

fn index_error(code: u32) -> &'static str {
    match code {
        1 => "embedding: token id",
        2 => "row index (gather, scatter or MoE combine)",
        3 => "kv_store: cache slot",
        4 => "paged_attention: block table entry",
        5 => "MoE: expert id",
        6 => "paged_attention: position beyond the block table",
        7 => {
            "tensor-core projection: an activation beyond f16's range (|x| > 65504) with f16/f32 weights"
        }
        8 => "Gated DeltaNet: a run beyond the batch or a state slot beyond the pool",
        9 => "Gated DeltaNet: a run longer than the batch's promised longest run",
        10 => "an FP8 kernel on a GPU older than sm_89 (no e4m3 conversion)",
        _ => "unknown device error",
    }
}

impl CudaBackend {
    /// Opens the device, then compiles (or reads from the cache) and loads every kernel.
    pub fn new(options: CudaOptions) -> Result<Self> {
        let gpu = Gpu::open(options.ordinal, !options.serial_launches)?;
        let cache = KernelCache::new(options.kernel_cache.clone());
        let (kernels, cache_report) = Kernels::load(&gpu, &cache)?;
        let at_start = gpu.memory()?;
        let runtime_bytes = at_start.total.saturating_sub(at_start.free);
        let diag = gpu.alloc(16)?;
        gpu.memset_zero(diag.ptr(), 16)?;
        gpu.sync()?;
        let scratch_mem = gpu.alloc(OP_SCRATCH_FLOATS * 4)?;
        let op_scratch = DeviceBuffer::new(
            DType::F32,
            OP_SCRATCH_FLOATS,
            BufferUsage::Activations,
            scratch_mem.into_storage(),
        );
        let attention_counters = zeroed_tickets(&gpu, ATTENTION_COUNTERS)?;
        let projection_counters = zeroed_tickets(&gpu, PROJECTION_COUNTERS)?;
        let sample_words = SAMPLE_MAX_ROWS * SAMPLE_MAX_PARTS * CANDIDATE_ROW_WORDS;
        let sampling_scratch = DeviceBuffer::new(
            DType::U32,
            sample_words,
            BufferUsage::Metadata,
            gpu.alloc(sample_words * 4)?.into_storage(),
        );
        let sampling_tickets = zeroed_tickets(&gpu, SAMPLE_MAX_ROWS)?;
        let capabilities = Capabilities {
            graphs: true,
            profiling: true,
            // FP8 blocks where the hardware converts e4m3 (sm_89 and newer).
            weight_formats: GPU_QUANT_FORMATS
                .into_iter()
                .filter(|&f| f != QuantFormat::F8E4M3x128 || gpu.compute_capability >= (8, 9))
                .collect(),
            kv_dtypes: vec![DType::BF16, DType::F32, DType::F8E4M3],
            bf16_projection_inputs: true,
        };
        let kv_dtype = options.kv_dtype.unwrap_or(DType::BF16);
        if !capabilities.kv_dtypes.contains(&kv_dtype) {
            return Err(bad(
                "cuda backend",
                format!("KV cache type {kv_dtype} unsupported"),
            ));
        }
        let blas = if options.without_cublas {
            None
        } else {
            Blas::open(&gpu)?
        };
        let blas_present = blas.is_some();
        Ok(Self {
            blas,
            gpu,
            kernels,
            ordinal: options.ordinal,
            pool: BufferPool::default(),
            stats: StatsCounter::default(),
            runtime_bytes,
            diag,
            kv_dtype,
            cache_report,
            profile: Mutex::new(None),
            profiling: AtomicBool::new(false),
            decoded_experts: Mutex::new(None),
            capturing: AtomicBool::new(false),
            capture_start: AtomicU64::new(0),
            capture_start_bytes: AtomicU64::new(0),
            op_scratch,
            recurrent_delta_rule: options.recurrent_delta_rule,
            f32_gemm_inputs: options.f32_gemm_inputs,
            unstreamed_experts: options.unstreamed_experts,
            unstreamed_projections: options.unstreamed_projections,
            precise_experts: options.precise_experts,
            attention_counters,
            projection_counters,
            sampling_scratch,
            sampling_tickets,
            kernels_id: compile::sources_id() ^ blas_present as u64,
            capabilities,
        })
    }

    /// How the kernels were obtained at start-up.
    pub fn kernel_cache_report(&self) -> &KernelCacheReport {
        &self.cache_report
    }

    /// The one place a kernel is launched: counts it, then queues it.
    fn launch(&self, k: &Kernel, grid: (u32, u32, u32), block: u32, args: &[Arg]) -> Result<()> {
        self.launch_sized(k, (grid, block, k.2), args)
    }

    /// As [`Self::launch`], with `smem` bytes of dynamic shared memory (at most the kernel's).
    fn launch_sized(
        &self,
        k: &Kernel,
        sized: ((u32, u32, u32), u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        self.launch_parts(k, sized, [args, &[]])
    }

    /// As [`Self::launch_sized`], the arguments given in two parts (a head before a shared
    /// tail), joined without allocating.
    fn launch_parts(
        &self,
        k: &Kernel,
        (grid, block, smem): ((u32, u32, u32), u32, u32),
        [head, tail]: [&[Arg]; 2],
    ) -> Result<()> {
        let count = head.len() + tail.len();
        if smem > k.2 {
            return Err(bad(
                k.1,
                format!("{smem} bytes of shared memory, past the kernel's {}", k.2),
            ));
        }
        if count > MAX_ARGS {
            return Err(bad(k.1, "too many kernel arguments".to_string()));
        }
        let mut slots = [0u64; MAX_ARGS];
        for (slot, arg) in slots.iter_mut().zip(head.iter().chain(tail)) {
            *slot = arg.bits();
        }
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, slot) in params.iter_mut().zip(slots.iter_mut()) {
            *p = (slot as *mut u64).cast::<c_void>();
        }
        self.counted(k.1, || {
            self.gpu
                .launch(k, (grid, block, smem), &mut params[..count])
        })
    }

    /// Counts one dispatch named `name` and queues it with `queue` (a kernel launch, or a
    /// library call such as cuBLAS's), between profiling events when profiling.
    fn counted(&self, name: &'static str, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        self.gpu.bind()?;
        self.stats.dispatch(1);
        if !self.profiling.load(Ordering::Relaxed) || self.capturing.load(Ordering::Relaxed) {
            return queue();
        }
        let mut profile = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        let Some(events) = profile.as_mut() else {
            drop(profile);
            return queue();
        };
        let start = self.gpu.record_event()?;
        queue()?;
        events.push((name, start, self.gpu.record_event()?));
        Ok(())
    }

    /// Launches copy_blocks from `src` to `dst` (checked by check_block_copy): `gather` from
    /// the paged `src`, else into the paged `dst`.
    #[allow(clippy::too_many_arguments)]
    fn copy_blocks(
        &self,
        op: &'static str,
        src: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        paged_blocks: usize,
        dst: &mut DeviceBuffer,
        gather: bool,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        self.not_capturing(op)?;
        let block_bytes = block_elems * src.dtype().size_bytes();
        if block_bytes.div_ceil(4096) > 65_535 {
            return Err(bad(op, format!("blocks of {block_bytes} bytes")));
        }
        let args = [
            Arg::Ptr(ptr_of(op, src)?),
            Arg::Ptr(ptr_of(op, dst)?),
            addr(op, ids)?,
            u32_of(op, count)?,
            Arg::U64(block_bytes as u64),
            u32_of(op, paged_blocks)?,
            Arg::U32(u32::from(gather)),
            self.diag(),
        ];
        let grid = (
            grid_of(op, count)?,
            grid_of(op, block_bytes.div_ceil(4096))?,
            1,
        );
        self.launch(&self.kernels.copy_blocks, grid, 256, &args)
    }

    fn not_capturing(&self, op: &'static str) -> Result<()> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(bad(
                op,
                "no copies while a graph is being recorded".to_string(),
            ));
        }
        Ok(())
    }

    fn diag(&self) -> Arg {
        Arg::Ptr(self.diag.ptr())
    }

    fn new_buffer(&self, dtype: DType, len: usize, usage: BufferUsage) -> Result<DeviceBuffer> {
        self.stats.allocation();
        let mem = self.gpu.alloc(dtype.bytes_of(len))?;
        Ok(DeviceBuffer::new(dtype, len, usage, mem.into_storage()))
    }

    /// A read-back: copies `dst.len()` elements from `src`, with the diagnostics block, and
    /// waits. One host sync; a raised error flag turns into an error.
    fn read_back<T>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        self.not_capturing("read-back")?;
        self.gpu.download(src, dst)?;
        self.finish_read_back(std::mem::size_of_val(dst))
    }

    /// As read_back, for bytes through page-locked staging (a session's KV: hundreds of MB).
    fn read_back_staged(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.not_capturing("read-back")?;
        let syncs = self.gpu.download_staged(src, dst)?;
        for _ in 0..syncs {
            self.stats.host_sync();
        }
        self.finish_read_back(dst.len())
    }

    /// The diagnostics of a read-back queued before: waits, counts `bytes` moved, and turns a
    /// raised error flag into an error.
    fn finish_read_back(&self, bytes: usize) -> Result<()> {
        let mut diag = [0u64; 2];
        self.gpu.download(self.diag.ptr(), &mut diag)?;
        self.gpu.memset_zero(self.diag.ptr(), 16)?;
        self.gpu.sync()?;
        self.stats.host_sync();
        self.stats.transfer(bytes);
        self.stats.weight_read(diag[1] as usize);
        let code = (diag[0] & 0xffff_ffff) as u32;
        if code != 0 {
            return Err(BackendError::DeviceIndex {
                what: index_error(code),
            });
        }
        Ok(())
    }

    fn elementwise_grid(op: &'static str, len: usize) -> Result<(u32, u32, u32)> {
        Ok((grid_of(op, len.div_ceil(256))?, 1, 1))
    }
}

impl Backend for CudaBackend {
    fn ops(&self) -> &dyn Ops {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::compile::{SOURCES, compile, nvrtc_present};

    /// Every kernel file compiles for Ampere and Hopper when NVRTC is present (no GPU needed),
    /// so a syntax error never costs GPU time. Skips, saying so, without NVRTC.
    #[test]
    fn every_kernel_file_compiles_with_nvrtc() {
        if !nvrtc_present() {
            eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to check kernels)");
            return;
        }
        // Machine code for Ampere (the oldest the backend opens) and Hopper, so that inline
        // PTX an architecture lacks fails here (PTX alone passes it through unchecked).
        for arch in ["sm_80", "sm_90"] {
            for source in &SOURCES {
                let image = compile(source, arch)
                    .unwrap_or_else(|e| panic!("{} for {arch}: {e}", source.name));
                assert!(image.len() > 100, "{} for {arch}: empty image", source.name);
            }
        }
    }

    /// Kernels are launched with programmatic dependent launch, so every kernel must wait
    /// for its predecessor before it reads or writes anything: its first statement is
    /// `begin_kernel();`, `begin_small_kernel();` or `begin_deferred_kernel();` (the last
    /// reads only what no kernel of the step writes before it waits; a kernel without any of
    /// them could read a buffer still being written).
    #[test]
    fn every_kernel_begins_by_waiting_for_the_one_before() {
        let mut kernels = 0;
        for source in &SOURCES {
            let body = source.body;
            for (at, _) in body.match_indices("__global__") {
                let open = at + body[at..].find('{').expect("a kernel body");
                let first =
                    body[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                assert!(
                    first.starts_with("begin_kernel();")
                        || first.starts_with("begin_small_kernel();")
                        || first.starts_with("begin_deferred_kernel();"),
                    "{}:{}: the kernel does not begin with begin_kernel(), begin_small_kernel() \
                     or begin_deferred_kernel()",
                    source.name,
                    body[..at].lines().count()
                );
                kernels += 1;
            }
        }
        assert!(kernels >= 30, "only {kernels} kernels found");
    }

    /// Prefill attention splits its keys only after a history longer than its tokens, as
    /// few times as fill an H200's waves (132 SMs, two head-dim-256 blocks each) to 90%,
    /// counting the splits that 64-key multiples launch.
    #[test]
    fn prefill_attention_splits_only_after_long_histories() {
        let (resident, fit) = (2 * 132, usize::MAX);
        let splits = |blocks, tokens, context, fit| {
            let keys = super::flash_split_keys(blocks, tokens, context, resident, fit);
            assert_eq!(keys % 64, 0);
            usize::div_ceil(context, keys)
        };
        assert_eq!(splits(32 * 16, 2048, 2048, fit), 1, "2,048 new tokens");
        assert_eq!(splits(10 * 16, 600, 600, fit), 1, "600, no history");
        assert_eq!(splits(10 * 16, 600, 6_800, fit), 3, "600 after 6,200: 91%");
        assert_eq!(splits(11 * 16, 700, 6_800, fit), 3, "700 after 6,100: 100%");
        assert_eq!(
            splits(16, 64, 6_800, fit),
            12,
            "64 after 6,700: the fullest launched"
        );
        assert_eq!(
            splits(128 * 16, 8192, 40_000, fit),
            1,
            "a long prompt's chunk"
        );
        assert_eq!(
            splits(25 * 4, 1600, 6_800, 2),
            2,
            "as far as the scratch holds"
        );
        assert_eq!(
            splits(10 * 16, 600, 6_800, 2),
            1,
            "two fill no more than one"
        );
        assert_eq!(
            super::flash_split_keys(16, 64, 0, resident, fit),
            64,
            "no keys"
        );
    }

    /// Decode attention's splits for Qwen3-30B-A3B's 4 KV heads: as many as fill 128 blocks,
    /// no split under 64 keys or over 1,024, at most 64.
    #[test]
    fn decode_attention_splits_aim_at_128_blocks() {
        use super::attention_splits as splits;
        assert_eq!(splits(4, 512), 8, "batch 1, context 512: 64-key splits");
        assert_eq!(splits(32, 512), 4, "batch 8, context 512");
        assert_eq!(splits(128, 512), 1, "batch 32, context 512");
        assert_eq!(splits(4, 8192), 32, "batch 1, context 8192");
        assert_eq!(
            splits(32, 8192),
            8,
            "batch 8, context 8192: 1,024-key splits"
        );
        assert_eq!(splits(4, 131_072), 64, "at most 64");
        assert_eq!(splits(1, 16), 1);
    }

    /// Projections of few tiles split K into whole multiples of 256 until the blocks reach
    /// four an SM; enough tiles, or a K of one split, read whole rows.
    #[test]
    fn few_tile_projections_split_k_to_fill_the_device() {
        use super::projection_split_k as split;
        // Qwen3-30B-A3B on 132 SMs: q/k/v (320 tiles), output (128), router (8), LM head.
        assert_eq!(split(320, 2048, 132), Some(1024));
        assert_eq!(split(128, 4096, 132), Some(1024));
        assert_eq!(split(8, 2048, 132), Some(256));
        assert_eq!(split(9496, 2048, 132), None);
        assert_eq!(split(528, 2048, 132), None);
        assert_eq!(split(8, 256, 132), None);
        assert_eq!(split(8, 300, 132), Some(256));
        for (tiles, k) in [(1, 4104), (40, 777), (127, 4096), (300, 8192)] {
            let split_k = split(tiles, k, 132).expect("a split");
            assert_eq!(split_k % 256, 0);
            assert!(split_k < k && tiles * k.div_ceil(split_k) <= 2 * 4 * 132);
        }
    }
}
