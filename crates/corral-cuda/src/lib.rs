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
mod kernels;
mod quant;

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use device::DeviceMem;
pub use kernels::KernelCacheReport;

use blas::Blas;
use compile::KernelCache;
use corral_backend::Storage;
use corral_backend::sampling::{CANDIDATE_ROW_WORDS, DRAW_WORDS, MAX_REDUCED_VOCAB};
use corral_backend::{
    AttentionMeta, AttentionShape, Backend, BackendError, BufferPool, BufferUsage, Buffers,
    Capabilities, DType, DeltaNetShape, Device, DeviceBuffer, DispatchStats, ExpertMatrices,
    ExpertWeights, MappedFile, MoeRouting, MoeSorted, Ops, QkShape, QuantFormat, RecurrentRuns,
    Result, RopeParams, StatsCounter, WeightView, byte_range, kv_row_elems,
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
    let block = dtype.block_values();
    if !w.offset.is_multiple_of(block) || !w.cols.is_multiple_of(block) {
        return Err(bad(
            op,
            format!("{dtype} weights viewed across blocks of {block} values"),
        ));
    }
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
        buf(
            op,
            "expert_offsets",
            sorted.expert_offsets,
            DType::U32,
            num_experts + 1,
        )?,
        buf(
            op,
            "hit_experts",
            sorted.hit_experts,
            DType::U32,
            num_experts + 1,
        )?,
        buf(op, "sorted_pairs", sorted.sorted_pairs, DType::U32, pairs)?,
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
        let kv_dtype = options.kv_dtype.unwrap_or(DType::BF16);
        if !matches!(kv_dtype, DType::BF16 | DType::F32 | DType::F8E4M3) {
            return Err(bad(
                "cuda backend",
                format!("KV cache type {kv_dtype} unsupported"),
            ));
        }
        let capabilities = Capabilities {
            graphs: true,
            profiling: true,
            // FP8 blocks where the hardware converts e4m3 (sm_89 and newer).
            weight_formats: GPU_QUANT_FORMATS
                .into_iter()
                .filter(|&f| f != QuantFormat::F8E4M3x128 || gpu.compute_capability >= (8, 9))
                .collect(),
            kv_dtypes: vec![DType::BF16, DType::F32, DType::F8E4M3],
            bf16_norm_outputs: true,
        };
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
            buf(op, "ids", ids, DType::U32, count)?,
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

    /// Expert `m`'s device pointer table, its element type and whether 16-byte loads hold.
    fn experts(&self, op: &'static str, m: &ExpertMatrices) -> Result<(Arg, DType, bool)> {
        let dtype = m
            .dtype()
            .ok_or_else(|| bad(op, "a projection without experts".to_string()))?;
        let (table, vec) = m.device_table(|m| {
            let mut addrs = Vec::with_capacity(m.num_experts());
            let mut vec = m.cols().is_multiple_of(8);
            for (b, offset) in m.locations() {
                if b.dtype() != dtype {
                    return Err(bad(op, "experts stored in different types".to_string()));
                }
                if !offset.is_multiple_of(dtype.block_values()) {
                    return Err(bad(op, format!("{dtype} experts across blocks")));
                }
                let addr = ptr_of(op, b)? + dtype.bytes_of(offset) as u64;
                vec &= addr.is_multiple_of(16) && !matches!(dtype, DType::Quant(_));
                addrs.push(addr);
            }
            let words: Vec<u32> = addrs
                .iter()
                .flat_map(|a| [*a as u32, (*a >> 32) as u32])
                .collect();
            let mut table = self.new_buffer(DType::U32, words.len(), BufferUsage::Weights)?;
            self.gpu.upload(&words, ptr_of(op, &table)?)?;
            self.stats.transfer(words.len() * 4);
            table.set_usage(BufferUsage::Weights);
            Ok((table, vec))
        })?;
        Ok((Arg::Ptr(ptr_of(op, table)?), dtype, *vec))
    }

    /// The streamed few-row expert kernels, where they run: sm_90+, 16-bit weights, K (of
    /// 16-byte rows, which the few-row path already requires) that a stage holds, and
    /// at most STREAM_MAX_TOKENS tokens.
    fn streamed_experts<'k>(
        &self,
        kernels: &'k WeightKernels,
        k: usize,
        tokens: usize,
    ) -> Option<&'k [Kernel; 2]> {
        kernels.grouped_stream.as_ref().filter(|_| {
            !self.unstreamed_experts && k <= STREAM_MAX_K && tokens <= STREAM_MAX_TOKENS
        })
    }

    /// A streamed block per SM: each takes the units of weight rows in turn.
    fn stream_grid(&self, op: &'static str) -> Result<(u32, u32, u32)> {
        Ok((grid_of(op, self.gpu.multiprocessors.max(1) as usize)?, 1, 1))
    }

    /// The 128-row expert tiles, where they run for enough rows: bf16 experts whose three
    /// projections have 16-byte rows. Gate/up and down decide alike (and so pick few-row
    /// products alike), for the first leaves `act` in the bf16 layout the second reads.
    fn big_tiles<'k>(
        &self,
        op: &'static str,
        kernels: &'k WeightKernels,
        experts: &ExpertWeights,
    ) -> Result<Option<&'k BigTileKernels>> {
        let Some(big) = &kernels.grouped_big else {
            return Ok(None);
        };
        for m in [&experts.gate, &experts.up, &experts.down] {
            let (_, dtype, vec) = self.experts(op, m)?;
            if dtype != DType::BF16 || !vec {
                return Ok(None);
            }
        }
        Ok(Some(big))
    }

    /// The split-operand tiles, where the options choose them.
    fn split_tiles<'k>(&self, big: &'k BigTileKernels) -> Option<&'k [Kernel; 2]> {
        self.precise_experts.then_some(&big.split)
    }

    /// `len` values of `dtype` in a pooled buffer, filled by `convert` (given its address)
    /// and then read by `use_copy`; the buffer goes back to the pool at once (later users
    /// queue behind `use_copy`'s work on the one stream).
    fn with_converted_copy(
        &self,
        op: &'static str,
        (dtype, len): (DType, usize),
        convert: impl FnOnce(u64) -> Result<()>,
        use_copy: impl FnOnce(&DeviceBuffer) -> Result<()>,
    ) -> Result<()> {
        let copy = self.take_buffer(dtype, len, BufferUsage::Activations)?;
        let queued = ptr_of(op, &copy)
            .and_then(convert)
            .and_then(|()| use_copy(&copy));
        self.give_buffer(copy);
        queued
    }

    /// Rounds `len` f32 values at `x` to bf16 in a pooled buffer (its weight-byte count
    /// `weight_bytes`), then queues `use_copy` on that buffer's address.
    fn with_bf16_copy(
        &self,
        op: &'static str,
        x: Arg,
        len: usize,
        weight_bytes: u64,
        use_copy: impl FnOnce(u64) -> Result<()>,
    ) -> Result<()> {
        let convert = |x16_ptr| {
            let args = [
                x,
                Arg::U64(len as u64),
                Arg::Ptr(x16_ptr),
                Arg::U64(weight_bytes),
                self.diag(),
            ];
            let grid = Self::elementwise_grid(op, len.div_ceil(4))?;
            self.launch(&self.kernels.to_bf16, grid, 256, &args)
        };
        self.with_converted_copy(op, (DType::BF16, len), convert, |x16| {
            use_copy(ptr_of(op, x16)?)
        })
    }

    /// Projections of x `[rows, cols]` by cuBLAS GEMMs: x as a norm left it in bf16, or
    /// rounded to bf16 once here. `targets` are (weight address, output features, output
    /// address); `weight_bytes` goes to the step's counter, with the rounding or (for bf16 x)
    /// on the host.
    fn blas_projections(
        &self,
        blas: &Blas,
        x: &DeviceBuffer,
        (rows, cols): (usize, usize),
        targets: &[(u64, usize, u64)],
        weight_bytes: u64,
    ) -> Result<()> {
        let op = "matmul";
        let gemms = |x16_ptr: u64| {
            targets.iter().try_for_each(|&(w_addr, n, out_addr)| {
                self.counted("cublas_gemm_bf16", || {
                    blas.gemm_bf16(x16_ptr, rows, w_addr, n, cols, out_addr)
                })
            })
        };
        if x.dtype() == DType::BF16 {
            buf(op, "x", x, DType::BF16, rows * cols)?;
            self.stats.weight_read(weight_bytes as usize);
            return gemms(ptr_of(op, x)?);
        }
        let x_arg = buf(op, "x", x, DType::F32, rows * cols)?;
        self.with_bf16_copy(op, x_arg, rows * cols, weight_bytes, gemms)
    }

    /// The grouped down projection into `y`: f32, or bf16 where `bf16_y` allows and the
    /// prefill tiles run (half the bytes written and combined); returns y's type.
    fn grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        bf16_y: bool,
    ) -> Result<DType> {
        let op = "moe_grouped_down";
        let (num_experts, hidden, inter) = (
            experts.down.num_experts(),
            experts.down.rows(),
            experts.down.cols(),
        );
        let pairs = routing.tokens * routing.top_k;
        if pairs == 0 || hidden == 0 {
            return Ok(DType::F32);
        }
        let (down, dtype, vec) = self.experts(op, &experts.down)?;
        if quant::quant_format(dtype).is_some() {
            return self.with_decoded_experts(op, experts, sorted, [false, false, true], |d| {
                self.grouped_down(act, routing, sorted, d, y, bf16_y)
            });
        }
        let [offsets, hit, sorted_pairs, pairs_a, experts_a] =
            sorted_args(op, sorted, num_experts, pairs)?;
        let args = [
            buf(op, "act", act, DType::F32, pairs * inter)?,
            u32_of(op, inter)?,
            buf(
                op,
                "expert_weights",
                routing.expert_weights,
                DType::F32,
                pairs,
            )?,
            offsets,
            hit,
            sorted_pairs,
            pairs_a,
            experts_a,
            down,
            u32_of(op, hidden)?,
            Arg::U32(vec as u32),
            buf(op, "y", y, DType::F32, pairs * hidden)?,
            self.diag(),
        ];
        let kernels = self.kernels.for_weights(op, dtype)?;
        let big = self.big_tiles(op, kernels, experts)?;
        if let (Some(mvm), true, Some(variant)) = (
            &kernels.grouped_mvm,
            vec,
            few_rows_variant(pairs, num_experts, big.is_some()),
        ) {
            if let Some(stream) = self.streamed_experts(kernels, inter, routing.tokens) {
                return self
                    .launch(&stream[1], self.stream_grid(op)?, STREAM_THREADS, &args)
                    .map(|()| DType::F32);
            }
            // A block row per expert that can have rows: at most one per routed pair; a
            // block per DOWN_MVM_FEATURES features.
            let grid = (
                grid_of(op, hidden.div_ceil(DOWN_MVM_FEATURES))?,
                grid_of(op, num_experts.min(pairs))?,
                1,
            );
            return self
                .launch(&mvm[1][variant], grid, MVM_THREADS, &args)
                .map(|()| DType::F32);
        }
        if let Some(big) = big {
            let tiles = pairs.div_ceil(BIG_TILE_ROWS) + num_experts.min(pairs);
            let grid = (grid_of(op, tiles)?, grid_of(op, hidden.div_ceil(128))?, 1);
            let (kernel, y_dtype) = match (self.split_tiles(big), bf16_y) {
                (Some(split), _) => (&split[1], DType::F32),
                (None, true) => (&big.bf16[2], DType::BF16),
                (None, false) => (&big.bf16[1], DType::F32),
            };
            return self
                .launch(kernel, grid, BIG_TILE_THREADS, &args)
                .map(|()| y_dtype);
        }
        let tiles = pairs.div_ceil(64) + num_experts.min(pairs);
        let grid = (grid_of(op, tiles)?, grid_of(op, hidden.div_ceil(64))?, 1);
        self.launch(&kernels.grouped_down, grid, 128, &args)
            .map(|()| DType::F32)
    }

    /// `out[t] = Σ_j y[pair (t, j)]` from y of `y_dtype` (f32, or bf16 from the tiles).
    fn combine(
        &self,
        y: &DeviceBuffer,
        y_dtype: DType,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_combine";
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        let pairs = tokens * top_k;
        if tokens == 0 || hidden == 0 {
            return Ok(());
        }
        let args = [
            // A bf16 y lies in the first half of the f32 scratch.
            buf(
                op,
                "y",
                y,
                DType::F32,
                (pairs * hidden * y_dtype.size_bytes()).div_ceil(4),
            )?,
            buf(
                op,
                "pair_positions",
                sorted.pair_positions,
                DType::U32,
                pairs,
            )?,
            u32_of(op, tokens)?,
            u32_of(op, top_k)?,
            u32_of(op, hidden)?,
            u32_of(op, pairs)?,
            buf(op, "out", out, DType::F32, tokens * hidden)?,
            self.diag(),
        ];
        // Four features a thread when the rows allow (as the kernel decides).
        let per = if hidden.is_multiple_of(4) { 4 } else { 1 };
        let grid = Self::elementwise_grid(op, (tokens * hidden).div_ceil(per))?;
        let kernel = match y_dtype {
            DType::BF16 => &self.kernels.moe_combine_y16,
            _ => &self.kernels.moe_combine,
        };
        self.launch(kernel, grid, 256, &args)
    }

    /// Widens bf16 `x` (`len` values) to f32 in a pooled buffer and runs `use_copy` on it, for
    /// an op without a bf16-input form.
    fn with_f32_copy(
        &self,
        op: &'static str,
        x: &DeviceBuffer,
        len: usize,
        use_copy: impl FnOnce(&DeviceBuffer) -> Result<()>,
    ) -> Result<()> {
        let x_arg = buf(op, "x", x, DType::BF16, len)?;
        let convert = |x32_ptr| {
            let args = [x_arg, Arg::U64(len as u64), Arg::Ptr(x32_ptr)];
            let grid = Self::elementwise_grid(op, len.div_ceil(4))?;
            self.launch(&self.kernels.to_f32, grid, 256, &args)
        };
        self.with_converted_copy(op, (DType::F32, len), convert, use_copy)
    }

    /// The chunked gated delta rule (delta_net.cu's gdr_chunk_prepare and gdr_chunk_scan) over
    /// at most `chunks` chunks, in launch pairs of `per_wave`: `args` are
    /// [`Ops::gated_delta_rule`](corral_backend::Ops::gated_delta_rule)'s kernel arguments.
    fn chunked_delta_rule(
        &self,
        args: [Arg; 13],
        chunks: usize,
        (nv, dv): (usize, usize),
        num_runs: usize,
        per_wave: usize,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let [
            qkv,
            g,
            beta,
            nk_a,
            nv_a,
            dk_a,
            dv_a,
            runs,
            tokens_a,
            slots,
            state,
            out,
            diag,
        ] = args;
        let scratch = Arg::Ptr(ptr_of(op, &self.op_scratch)?);
        for first in (0..chunks).step_by(per_wave) {
            let wave = per_wave.min(chunks - first);
            let (first_a, num_runs_a) = (u32_of(op, first)?, u32_of(op, num_runs)?);
            let prepare = [
                qkv, g, beta, nk_a, nv_a, dk_a, dv_a, runs, num_runs_a, tokens_a, slots, first_a,
                scratch, diag,
            ];
            self.launch(
                &self.kernels.gdr_chunk_prepare,
                (grid_of(op, wave)?, grid_of(op, nv)?, 1),
                GDR_THREADS,
                &prepare,
            )?;
            let scan = [
                nv_a,
                dk_a,
                dv_a,
                runs,
                num_runs_a,
                tokens_a,
                slots,
                first_a,
                u32_of(op, wave)?,
                u32_of(op, chunks)?,
                scratch,
                state,
                out,
                diag,
            ];
            let grid = (
                grid_of(op, num_runs)?,
                grid_of(op, nv)?,
                grid_of(op, dv.div_ceil(GDR_SLICE))?,
            );
            self.launch(&self.kernels.gdr_chunk_scan, grid, GDR_THREADS, &scan)?;
        }
        Ok(())
    }

    fn elementwise_grid(op: &'static str, len: usize) -> Result<(u32, u32, u32)> {
        Ok((grid_of(op, len.div_ceil(256))?, 1, 1))
    }

    /// The kernels' common arguments for the batch's tokens `range`: the query and token
    /// arrays start at its first token, the output at token `out_first` of `out` (run
    /// indices and block tables stay whole).
    fn attention_args(
        &self,
        a: &Attention<'_>,
        range: &std::ops::Range<usize>,
        (out, out_dtype, out_first): (&DeviceBuffer, DType, usize),
    ) -> Result<Vec<Arg>> {
        let op = "paged_attention";
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        } = a.shape;
        let meta = a.meta;
        let (first, count) = (range.start, range.len());
        let row = num_heads * head_dim;
        let dtype = a.cache_k.dtype();
        let kv_row = kv_row_elems(dtype, num_kv_heads, head_dim);
        let slots = a.cache_k.len().min(a.cache_v.len()) / kv_row;
        let runs = meta.block_tables.len() / meta.max_blocks_per_run.max(1);
        Ok(vec![
            buf_range(op, "q", a.q, DType::F32, first * row, count * row)?,
            buf(op, "cache_k", a.cache_k, dtype, kv_row)?,
            buf(op, "cache_v", a.cache_v, dtype, kv_row)?,
            buf_range(op, "positions", meta.positions, DType::U32, first, count)?,
            buf_range(op, "token_runs", meta.token_runs, DType::U32, first, count)?,
            u32_of(op, runs)?,
            buf(
                op,
                "block_tables",
                meta.block_tables,
                DType::U32,
                runs * meta.max_blocks_per_run,
            )?,
            u32_of(op, meta.max_blocks_per_run)?,
            u32_of(op, meta.block_size)?,
            u32_of(op, slots / meta.block_size.max(1))?,
            u32_of(op, count)?,
            u32_of(op, num_heads)?,
            u32_of(op, num_kv_heads)?,
            u32_of(op, head_dim)?,
            Arg::F32(scale),
            buf_range(op, "out", out, out_dtype, out_first * row, count * row)?,
            self.diag(),
        ])
    }

    /// Prefill-shaped attention for the batch's tokens `range`: 64-token tiles on tensor
    /// cores, writing f32 or bf16; the keys split over blocks where the tiles are too few to
    /// fill the GPU, and a merge joins the splits.
    fn flash_attention(
        &self,
        kernels: &FlashKernels,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "paged_attention";
        let out_dtype = match out.dtype() {
            DType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        let variant = usize::from(out_dtype == DType::BF16);
        let tiles = if a.cache_k.dtype() == DType::F8E4M3 {
            &kernels.tiles_fp8
        } else {
            &kernels.tiles
        };
        let mut args = self.attention_args(a, &range, (out, out_dtype, range.start))?;
        // Every argument but head_dim (the kernel's template parameter).
        args.remove(13);
        let (num_heads, head_dim) = (a.shape.num_heads, a.shape.head_dim);
        let tile_count = range.len().div_ceil(64);
        let max_context = a.meta.max_blocks_per_run * a.meta.block_size;
        let items = range.len() * num_heads;
        let split_keys = flash_split_keys(
            tile_count * num_heads,
            range.len(),
            max_context,
            tiles[variant].blocks_per_sm * self.gpu.multiprocessors.max(1) as usize,
            OP_SCRATCH_FLOATS / (items * (head_dim + 2)).max(1),
        );
        let splits = max_context.div_ceil(split_keys).max(1);
        let out_arg = args[14];
        args.splice(
            14..14,
            [
                u32_of(op, split_keys)?,
                Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            ],
        );
        // Heads along x, so that the heaviest tiles (the last) start first.
        let grid = (
            grid_of(op, num_heads)?,
            grid_of(op, tile_count)?,
            grid_of(op, splits)?,
        );
        self.launch(&tiles[variant].kernel, grid, FLASH_THREADS, &args)?;
        if splits == 1 {
            return Ok(());
        }
        let merge_args = [
            Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            u32_of(op, splits)?,
            u32_of(op, items)?,
            out_arg,
        ];
        let grid = (grid_of(op, items.div_ceil(8))?, 1, 1);
        self.launch(&kernels.merge[variant], grid, 256, &merge_args)
    }

    /// Decode-shaped attention for the batch's tokens `range`: tensor cores over a bf16
    /// cache for groups of up to 8 heads of 64, 128 or 256 dims, otherwise lanes owning D
    /// consecutive dims of a head; the keys split as far as the scratch allows. A bf16
    /// output is written f32 into a pooled copy and rounded after.
    fn decode_attention(
        &self,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.decode_attention_into(a, range.clone(), out, range.start)
    }

    /// [`Self::decode_attention`] writing from token `out_first` of `out`.
    fn decode_attention_into(
        &self,
        a: &Attention<'_>,
        range: std::ops::Range<usize>,
        out: &mut DeviceBuffer,
        out_first: usize,
    ) -> Result<()> {
        let op = "paged_attention";
        let AttentionShape {
            num_heads,
            num_kv_heads,
            head_dim,
            ..
        } = a.shape;
        let meta = a.meta;
        let count = range.len();
        let row = num_heads * head_dim;
        if out.dtype() == DType::BF16 {
            let out_len = count * row;
            let mut out32 = self.take_buffer(DType::F32, out_len, BufferUsage::Activations)?;
            let queued = self
                .decode_attention_into(a, range.clone(), &mut out32, 0)
                .and_then(|()| {
                    let args = [
                        buf(op, "out", &out32, DType::F32, out_len)?,
                        Arg::U64(out_len as u64),
                        buf_range(op, "out", out, DType::BF16, out_first * row, out_len)?,
                        Arg::U64(0),
                        self.diag(),
                    ];
                    let grid = Self::elementwise_grid(op, out_len.div_ceil(4))?;
                    self.launch(&self.kernels.to_bf16, grid, 256, &args)
                });
            self.give_buffer(out32);
            return queued;
        }
        let dtype = a.cache_k.dtype();
        let group = num_heads / num_kv_heads;
        let mma_index = match head_dim {
            64 => Some(0),
            128 => Some(1),
            256 => Some(2),
            _ => None,
        }
        .filter(|_| group <= DECODE_MMA_MAX_GROUP);
        let mma = match (dtype, mma_index) {
            (DType::BF16, Some(i)) => Some(&self.kernels.decode_attention_mma[i]),
            (DType::F8E4M3, Some(i)) => Some(&self.kernels.decode_attention_mma_fp8[i]),
            _ => None,
        };
        let on_tensor_cores = mma.is_some();
        let lane_dims = head_dim.div_ceil(32).next_power_of_two();
        let variant = lane_dims.trailing_zeros() as usize;
        let kernel = match (dtype, mma) {
            (_, Some(mma)) => mma,
            (DType::BF16, None) => &self.kernels.paged_attention_bf16[variant],
            (DType::F32, None) => &self.kernels.paged_attention_f32[variant],
            (DType::F8E4M3, None) => &self.kernels.paged_attention_fp8[variant],
            (other, None) => return Err(bad(op, format!("KV cache of {other}"))),
        };
        let args = self.attention_args(a, &range, (out, DType::F32, out_first))?;
        // Split the keys, as far as the fixed scratch and one merge's shared memory allow.
        let items = count * num_heads;
        let blocks = count * num_kv_heads;
        let max_context = (meta.max_blocks_per_run * meta.block_size).max(1);
        let fit = OP_SCRATCH_FLOATS / (items * (head_dim + 2)).max(1);
        let splits = attention_splits(blocks, max_context)
            .min(fit)
            .min(ATTENTION_MERGE_SLOTS / group.max(1))
            .max(1);
        // The last split of each block row merges them, counting on one ticket per row.
        let splits = if blocks > ATTENTION_COUNTERS {
            1
        } else {
            splits
        };
        // Whole chunks of 16 keys (the tensor-core kernel's warp step) per split.
        let split_keys = max_context.div_ceil(splits).div_ceil(16) * 16;
        let splits = max_context.div_ceil(split_keys);
        let (out_arg, diag) = (args[15], args[16]);
        let mut all = args;
        all.truncate(15);
        all.push(u32_of(op, split_keys)?);
        if on_tensor_cores {
            // Whether every run is one token: the kernel then reads a token's earlier keys
            // before waiting for the kernel that stores its own.
            all.push(Arg::U32(u32::from(meta.max_run_tokens == 1)));
        }
        all.extend([
            Arg::Ptr(ptr_of(op, &self.op_scratch)?),
            Arg::Ptr(ptr_of(op, &self.attention_counters)?),
            out_arg,
            diag,
        ]);
        let grid = (grid_of(op, blocks)?, grid_of(op, splits)?, 1);
        self.launch(kernel, grid, ATTENTION_THREADS, &all)
    }
}

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

    fn weight_from_file(
        &self,
        file: &Arc<MappedFile>,
        byte_offset: usize,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_file";
        if !dtype.is_float() {
            return Err(bad(op, "weights must be float".to_string()));
        }
        let byte_len = dtype.bytes_of(len);
        if let Some(format) = quant::quant_format(dtype)
            && (!self.reads_format(format) || !len.is_multiple_of(format.block().0))
        {
            return Err(bad(op, format!("{len} values of {dtype} on the GPU")));
        }
        let bytes = file
            .bytes()
            .get(byte_offset..byte_offset + byte_len)
            .ok_or_else(|| {
                bad(
                    op,
                    format!("{}: tensor data out of range", file.path().display()),
                )
            })?;
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        self.gpu.upload(bytes, ptr_of(op, &b)?)?;
        self.stats.transfer(byte_len);
        Ok(b)
    }

    fn weight_from_f32(&self, values: &[f32], dtype: DType) -> Result<DeviceBuffer> {
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

    fn weight_from_blocks(
        &self,
        blocks: Vec<u8>,
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        self.upload_blocks(&blocks, dtype, len)
    }

    fn weight_synthetic_blocks(
        &self,
        format: corral_backend::QuantFormat,
        len: usize,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        self.synthetic_blocks(format, len, seed, std)
    }

    fn weight_normal(&self, len: usize, dtype: DType, seed: u64, std: f32) -> Result<DeviceBuffer> {
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

    fn upload_f32(&self, src: &[f32], dst: &mut DeviceBuffer) -> Result<()> {
        self.not_capturing("upload_f32")?;
        let Arg::Ptr(p) = buf("upload_f32", "dst", dst, DType::F32, src.len())? else {
            unreachable!()
        };
        self.gpu.upload(src, p)?;
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn upload_u32(&self, src: &[u32], dst: &mut DeviceBuffer) -> Result<()> {
        self.not_capturing("upload_u32")?;
        let Arg::Ptr(p) = buf("upload_u32", "dst", dst, DType::U32, src.len())? else {
            unreachable!()
        };
        self.gpu.upload(src, p)?;
        self.stats.transfer(std::mem::size_of_val(src));
        Ok(())
    }

    fn download_f32(&self, src: &DeviceBuffer, dst: &mut [f32]) -> Result<()> {
        let Arg::Ptr(p) = buf("download_f32", "src", src, DType::F32, dst.len())? else {
            unreachable!()
        };
        self.read_back(p, dst)
    }

    fn download_u32(&self, src: &DeviceBuffer, dst: &mut [u32]) -> Result<()> {
        let Arg::Ptr(p) = buf("download_u32", "src", src, DType::U32, dst.len())? else {
            unreachable!()
        };
        self.read_back(p, dst)
    }

    fn read_bytes(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
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

    fn write_bytes(&self, bytes: &[u8], dst: &mut DeviceBuffer, offset: usize) -> Result<()> {
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

impl Ops for CudaBackend {
    fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()> {
        let p = ptr_of("fill_zero", buffer)?;
        self.stats.dispatch(1);
        self.gpu.memset_zero(p, len * 4)
    }

    fn embedding(
        &self,
        table: WeightView<'_>,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "embedding";
        let (w, dtype, _) = weight(op, table)?;
        if let Some(format) = quant::quant_format(dtype) {
            return self.quant_embedding(table, format, ids, tokens, out);
        }
        let w = Arg::Ptr(w);
        let hidden = table.cols;
        let args = [
            w,
            addr(op, ids)?,
            u32_of(op, tokens)?,
            u32_of(op, hidden)?,
            u32_of(op, table.rows)?,
            addr(op, out)?,
            self.diag(),
        ];
        if tokens == 0 {
            return Ok(());
        }
        let k = &self.kernels.for_weights(op, dtype)?.embedding;
        self.launch(k, (grid_of(op, tokens)?, 1, 1), 256, &args)
    }

    fn gather_rows(
        &self,
        x: &DeviceBuffer,
        row_ids: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "gather_rows";
        if num_rows == 0 || dim == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, row_ids)?,
            u32_of(op, num_rows)?,
            u32_of(op, dim)?,
            u32_of(op, x.len() / dim)?,
            addr(op, out)?,
            self.diag(),
        ];
        self.launch(
            &self.kernels.gather_rows,
            (grid_of(op, num_rows)?, 1, 1),
            256,
            &args,
        )
    }

    fn gather_blocks(
        &self,
        paged: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        packed: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "gather_blocks";
        let blocks = paged.len() / block_elems;
        self.copy_blocks(op, paged, ids, count, block_elems, blocks, packed, true)
    }

    fn scatter_blocks(
        &self,
        packed: &DeviceBuffer,
        ids: &DeviceBuffer,
        count: usize,
        block_elems: usize,
        paged: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "scatter_blocks";
        let blocks = paged.len() / block_elems;
        self.copy_blocks(op, packed, ids, count, block_elems, blocks, paged, false)
    }

    fn copy_within(&self, x: &mut DeviceBuffer, src: usize, dst: usize, len: usize) -> Result<()> {
        let op = "copy_within";
        if len == 0 {
            return Ok(());
        }
        self.not_capturing(op)?;
        let base = ptr_of(op, x)?;
        let size = x.dtype().size_bytes();
        let (from, to) = (base + (size * src) as u64, base + (size * dst) as u64);
        self.counted(op, || self.gpu.copy_device(from, to, size * len))
    }

    fn rms_norm(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "rms_norm";
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            Arg::U32(offset_one as u32),
            addr(op, out)?,
        ];
        let block = norm_block(dim);
        let kernel = match out.dtype() {
            DType::BF16 => &self.kernels.rms_norm_bf16,
            _ => &self.kernels.rms_norm,
        };
        self.launch(kernel, (grid_of(op, rows)?, 1, 1), block, &args)
    }

    fn matmul(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "matmul";
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        let (w_addr, dtype, vec) = weight(op, w)?;
        if let Some(format) = quant::quant_format(dtype) {
            return self.quant_matmul(x, rows, w, format, out);
        }
        let out_addr = ptr_of(op, out)?;
        let blas = self
            .blas
            .as_ref()
            .filter(|_| dtype == DType::BF16 && vec && rows > MATVEC_MAX_ROWS);
        if x.dtype() == DType::BF16 {
            buf(op, "out", out, DType::F32, rows * w.rows)?;
            return match blas {
                Some(blas) => {
                    let weight_bytes = (w.rows * w.cols * dtype.size_bytes()) as u64;
                    let target = [(w_addr, w.rows, out_addr)];
                    self.blas_projections(blas, x, (rows, w.cols), &target, weight_bytes)
                }
                None => {
                    self.with_f32_copy(op, x, rows * w.cols, |x32| self.matmul(x32, rows, w, out))
                }
            };
        }
        let args = [
            buf(op, "x", x, DType::F32, rows * w.cols)?,
            u32_of(op, rows)?,
            Arg::Ptr(w_addr),
            u32_of(op, w.rows)?,
            u32_of(op, w.cols)?,
            Arg::U32(vec as u32),
            buf(op, "out", out, DType::F32, rows * w.rows)?,
            self.diag(),
        ];
        let kernels = self.kernels.for_weights(op, dtype)?;
        let multiprocessors = self.gpu.multiprocessors.max(1) as usize;
        if let Some(stream) = kernels.matvec_stream.as_ref().filter(|_| {
            vec && !self.unstreamed_projections
                && STREAM_PROJECTION_ROWS.contains(&rows)
                && w.cols <= STREAM_MAX_K
                && w.rows.div_ceil(16) >= STREAM_PROJECTION_UNITS_PER_SM * multiprocessors
        }) {
            // A block per SM, each streaming its range of 16- or 32-feature units.
            let stream_args = [
                args[0], args[1], args[2], args[3], args[4], args[6], args[7],
            ];
            return self.launch(
                stream,
                (grid_of(op, multiprocessors)?, 1, 1),
                STREAM_THREADS,
                &stream_args,
            );
        }
        if let (Some(mma), true, true) = (
            &kernels.matvec_mma,
            vec,
            (2..=MATVEC_MAX_ROWS).contains(&rows),
        ) {
            // Tensor cores for the next power of two of 8-row tiles; 16 features a block,
            // K split over blocks where the tiles alone would leave SMs idle.
            let variant = rows.div_ceil(8).next_power_of_two().trailing_zeros() as usize;
            let tiles = w.rows.div_ceil(16);
            if let Some(split_k) = projection_split_k(tiles, w.cols, multiprocessors) {
                let splits = w.cols.div_ceil(split_k);
                // Each (tile, split) leaves 4 sums of each 8-row tile in each of 32 lanes.
                let partial_floats = tiles * splits * (4 << variant) * 32;
                if partial_floats <= OP_SCRATCH_FLOATS {
                    let split_args = [
                        args[0],
                        args[1],
                        args[2],
                        args[3],
                        args[4],
                        u32_of(op, split_k)?,
                        Arg::Ptr(ptr_of(op, &self.op_scratch)?),
                        Arg::Ptr(ptr_of(op, &self.projection_counters)?),
                        args[6],
                        args[7],
                    ];
                    let grid = (grid_of(op, tiles)?, grid_of(op, splits)?, 1);
                    return self.launch(&mma[1][variant], grid, MVM_THREADS, &split_args);
                }
            }
            let mma_args = [
                args[0], args[1], args[2], args[3], args[4], args[6], args[7],
            ];
            let grid = (grid_of(op, tiles)?, 1, 1);
            return self.launch(&mma[0][variant], grid, MVM_THREADS, &mma_args);
        }
        if let Some(blas) = blas {
            // cuBLAS on x rounded to bf16 (the tiles round it the same way).
            let weight_bytes = (w.rows * w.cols * dtype.size_bytes()) as u64;
            return self.blas_projections(
                blas,
                x,
                (rows, w.cols),
                &[(w_addr, w.rows, out_addr)],
                weight_bytes,
            );
        }
        if rows <= MATVEC_MAX_ROWS {
            // The variant for the next power of two of rows; 8 output features a block.
            let variant = rows.next_power_of_two().trailing_zeros() as usize;
            let grid = (grid_of(op, w.rows.div_ceil(8))?, 1, 1);
            self.launch(&kernels.matvec[variant], grid, 128, &args)
        } else {
            let grid = (
                grid_of(op, rows.div_ceil(64))?,
                grid_of(op, w.rows.div_ceil(64))?,
                1,
            );
            self.launch(&kernels.matmul_tiled, grid, 128, &args)
        }
    }

    fn matmul_columns(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
        out_cols: usize,
        col0: usize,
    ) -> Result<()> {
        self.matmul_into_columns(x, rows, w, out, (out_cols, col0))
    }

    fn matmul_parts(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        parts: (&[(DeviceBuffer, usize)], usize),
        out: &mut DeviceBuffer,
        out_cols: usize,
    ) -> Result<()> {
        self.matmul_parts_into(x, rows, parts, out, out_cols)
    }

    fn matmuls(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        weights: &[WeightView<'_>],
        outs: &mut [&mut DeviceBuffer],
    ) -> Result<()> {
        let op = "matmul";
        corral_backend::matmuls_arity(weights.len(), outs.len())?;
        let cols = weights.first().map_or(0, |w| w.cols);
        let all_blas = rows > MATVEC_MAX_ROWS
            && self.blas.is_some()
            && weights.iter().all(|w| {
                w.cols == cols && w.rows > 0 && matches!(weight(op, *w), Ok((_, DType::BF16, true)))
            });
        let Some(blas) = self.blas.as_ref().filter(|_| all_blas && weights.len() > 1) else {
            for (w, out) in weights.iter().zip(outs.iter_mut()) {
                self.matmul(x, rows, *w, out)?;
            }
            return Ok(());
        };
        // x rounded to bf16 once (unless a norm left it so), then one cuBLAS GEMM per
        // projection.
        let mut targets = Vec::with_capacity(weights.len());
        for (w, out) in weights.iter().zip(outs.iter()) {
            let (w_addr, _, _) = weight(op, *w)?;
            buf(op, "out", out, DType::F32, rows * w.rows)?;
            targets.push((w_addr, w.rows, ptr_of(op, out)?));
        }
        let weight_bytes: usize = weights.iter().map(|w| w.rows * w.cols * 2).sum();
        self.blas_projections(blas, x, (rows, cols), &targets, weight_bytes as u64)
    }

    fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        let op = "add_in_place";
        if len == 0 {
            return Ok(());
        }
        let args = [addr(op, acc)?, addr(op, x)?, Arg::U64(len as u64)];
        self.launch(
            &self.kernels.add_in_place,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn add_rms_norm(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "add_rms_norm";
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, acc)?,
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            Arg::U32(offset_one as u32),
            addr(op, out)?,
        ];
        let block = norm_block(dim);
        let kernel = match out.dtype() {
            DType::BF16 => &self.kernels.add_rms_norm_bf16,
            _ => &self.kernels.add_rms_norm,
        };
        self.launch(kernel, (grid_of(op, rows)?, 1, 1), block, &args)
    }

    fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "silu_mul";
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, gate)?,
            addr(op, up)?,
            Arg::U64(len as u64),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.silu_mul,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn rope(
        &self,
        x: &mut DeviceBuffer,
        positions: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        rope: RopeParams,
    ) -> Result<()> {
        let op = "rope";
        let items = tokens * heads * (rotary_dim / 2);
        if items == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, positions)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            u32_of(op, head_dim)?,
            u32_of(op, rotary_dim)?,
        ];
        let args = [&args[..], &rope_args(rope, rotary_dim)].concat();
        self.launch(
            &self.kernels.rope,
            Self::elementwise_grid(op, items)?,
            256,
            &args,
        )
    }

    fn kv_store(
        &self,
        k: &DeviceBuffer,
        v: &DeviceBuffer,
        slots: &DeviceBuffer,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "kv_store";
        let kv_dim = kv_heads * head_dim;
        if tokens == 0 || kv_dim == 0 {
            return Ok(());
        }
        let dtype = cache_k.dtype();
        let row = kv_row_elems(dtype, kv_heads, head_dim);
        let cache_slots = cache_k.len().min(cache_v.len()) / row;
        let mut args = vec![
            addr(op, k)?,
            addr(op, v)?,
            addr(op, slots)?,
            u32_of(op, tokens)?,
        ];
        if dtype == DType::F8E4M3 {
            args.extend([u32_of(op, kv_heads)?, u32_of(op, head_dim)?]);
        } else {
            args.push(u32_of(op, kv_dim)?);
        }
        args.extend([
            Arg::U64(cache_slots as u64),
            addr(op, cache_k)?,
            addr(op, cache_v)?,
            self.diag(),
        ]);
        let kernel = match dtype {
            DType::BF16 => &self.kernels.kv_store_bf16,
            DType::F32 => &self.kernels.kv_store_f32,
            DType::F8E4M3 => &self.kernels.kv_store_fp8,
            other => return Err(bad(op, format!("KV cache of {other}"))),
        };
        self.launch(kernel, (grid_of(op, tokens)?, 1, 1), 128, &args)
    }

    fn qkv_norm_rope_store(
        &self,
        qkv: &DeviceBuffer,
        q_weight: &DeviceBuffer,
        k_weight: &DeviceBuffer,
        positions: &DeviceBuffer,
        slots: &DeviceBuffer,
        shape: QkShape,
        q_out: &mut DeviceBuffer,
        cache_k: &mut DeviceBuffer,
        cache_v: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "qkv_norm_rope_store";
        let QkShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
            rope,
            eps,
        } = shape;
        if tokens == 0 {
            return Ok(());
        }
        let dtype = cache_k.dtype();
        let row = kv_row_elems(dtype, kv_heads, head_dim);
        let cache_slots = cache_k.len().min(cache_v.len()) / row.max(1);
        let per_token = heads + 2 * kv_heads;
        let args = [
            addr(op, qkv)?,
            addr(op, q_weight)?,
            addr(op, k_weight)?,
            addr(op, positions)?,
            addr(op, slots)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            u32_of(op, kv_heads)?,
            u32_of(op, head_dim)?,
            u32_of(op, rotary_dim)?,
        ];
        let rest = [
            Arg::F32(eps),
            Arg::U64(cache_slots as u64),
            addr(op, q_out)?,
            addr(op, cache_k)?,
            addr(op, cache_v)?,
            self.diag(),
        ];
        let args = [&args[..], &rope_args(rope, rotary_dim), &rest].concat();
        let kernels = match dtype {
            DType::BF16 => &self.kernels.qkv_norm_rope_store_bf16,
            DType::F32 => &self.kernels.qkv_norm_rope_store_f32,
            DType::F8E4M3 => &self.kernels.qkv_norm_rope_store_fp8,
            other => return Err(bad(op, format!("KV cache of {other}"))),
        };
        // A block per (token, eight warps' heads): one head a warp for a few tokens, five
        // for prefill (a block a token of up to 40 heads, every load in flight at once).
        let heads_per_warp = if tokens >= QKV_WIDE_MIN_TOKENS { 5 } else { 1 };
        let kernel = &kernels[2 * usize::from(head_dim > 128) + usize::from(heads_per_warp == 5)];
        let grid = (
            grid_of(op, tokens)?,
            grid_of(op, per_token.div_ceil(8 * heads_per_warp))?,
            1,
        );
        self.launch(kernel, grid, 256, &args)
    }

    fn paged_attention(
        &self,
        q: &DeviceBuffer,
        cache_k: &DeviceBuffer,
        cache_v: &DeviceBuffer,
        meta: &AttentionMeta<'_>,
        shape: AttentionShape,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "paged_attention";
        let head_dim = shape.head_dim;
        let tokens = meta.tokens;
        if tokens == 0 {
            return Ok(());
        }
        if meta.block_tables.len() / meta.max_blocks_per_run.max(1) == 0 {
            return Err(bad(op, "no block table for the batch's tokens".to_string()));
        }
        // Prefill chunks of 64 or more tokens: tensor-core tiles (head dims 64, 128 and 256,
        // bf16), writing f32 or bf16.
        let flash = match head_dim {
            64 => Some(&self.kernels.flash_attention_hd64),
            128 => Some(&self.kernels.flash_attention_hd128),
            256 => Some(&self.kernels.flash_attention_hd256),
            _ => None,
        }
        .filter(|_| {
            matches!(cache_k.dtype(), DType::BF16 | DType::F8E4M3)
                && meta.max_run_tokens >= FLASH_MIN_RUN
        });
        let attention = Attention {
            q,
            cache_k,
            cache_v,
            meta,
            shape,
        };
        let Some(kernels) = flash else {
            return self.decode_attention(&attention, 0..tokens, out);
        };
        // Decode rows ahead of the prefill runs take the decode kernel, split over their
        // keys: in a prefill tile a decode row's whole context would be one block's walk.
        let lead = meta.leading_decode_tokens.min(tokens);
        if lead > 0 && lead < tokens {
            self.decode_attention(&attention, 0..lead, out)?;
        } else if lead == tokens {
            return self.decode_attention(&attention, 0..tokens, out);
        }
        self.flash_attention(kernels, &attention, lead..tokens, out)
    }

    fn moe_route(
        &self,
        logits: &DeviceBuffer,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
        renormalize: bool,
        shared_gate: bool,
        expert_ids: &mut DeviceBuffer,
        expert_weights: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_route";
        if tokens == 0 {
            return Ok(());
        }
        let args = [
            addr(op, logits)?,
            u32_of(op, tokens)?,
            u32_of(op, num_experts)?,
            u32_of(op, top_k)?,
            Arg::U32(renormalize as u32),
            Arg::U32(shared_gate as u32),
            addr(op, expert_ids)?,
            addr(op, expert_weights)?,
        ];
        // A block per token ranking its experts in one pass (a thread an expert, up to 256)
        // for a few tokens, or up to 128 experts; else a warp per token, eight to a block
        // (ranking costs experts² a token: at 256 experts and 2,048 tokens the warps are
        // faster, at 128 ranking is).
        if (tokens <= RANKED_ROUTE_MAX_TOKENS || num_experts <= RANKED_ROUTE_ALWAYS_EXPERTS)
            && num_experts <= RANKED_ROUTE_MAX_EXPERTS
            && top_k <= RANKED_ROUTE_MAX_CHOICES
        {
            let grid = (grid_of(op, tokens)?, 1, 1);
            let threads = num_experts.next_multiple_of(32).clamp(64, 256) as u32;
            return self.launch(&self.kernels.moe_route_ranked, grid, threads, &args);
        }
        let grid = (grid_of(op, tokens.div_ceil(8))?, 1, 1);
        self.launch(&self.kernels.moe_route, grid, 256, &args)
    }

    fn scale_scatter_add(
        &self,
        y: &DeviceBuffer,
        rows: &DeviceBuffer,
        scales: &DeviceBuffer,
        num_rows: usize,
        dim: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "scale_scatter_add";
        if num_rows == 0 || dim == 0 {
            return Ok(());
        }
        let args = [
            addr(op, y)?,
            addr(op, rows)?,
            addr(op, scales)?,
            u32_of(op, num_rows)?,
            u32_of(op, dim)?,
            u32_of(op, out.len() / dim)?,
            addr(op, out)?,
            self.diag(),
        ];
        self.launch(
            &self.kernels.scale_scatter_add,
            (grid_of(op, num_rows)?, 1, 1),
            256,
            &args,
        )
    }

    fn moe_sort(
        &self,
        routing: MoeRouting<'_>,
        num_experts: usize,
        expert_offsets: &mut DeviceBuffer,
        hit_experts: &mut DeviceBuffer,
        sorted_pairs: &mut DeviceBuffer,
        pair_positions: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_sort";
        if num_experts == 0 || num_experts > 4096 {
            return Err(bad(
                op,
                format!("{num_experts} experts (1 to 4096 supported)"),
            ));
        }
        let pairs = routing.tokens * routing.top_k;
        let args = [
            buf(op, "expert_ids", routing.expert_ids, DType::U32, pairs)?,
            u32_of(op, pairs)?,
            u32_of(op, num_experts)?,
            buf(
                op,
                "expert_offsets",
                expert_offsets,
                DType::U32,
                num_experts + 1,
            )?,
            buf(op, "hit_experts", hit_experts, DType::U32, num_experts + 1)?,
            buf(op, "sorted_pairs", sorted_pairs, DType::U32, pairs)?,
            buf(op, "pair_positions", pair_positions, DType::U32, pairs)?,
            self.diag(),
        ];
        // Past one chunk: a block per chunk (at most SORT_MAX_BLOCKS), each counting every
        // pair and placing its own, rather than one block placing them all.
        if pairs > SORT_CHUNK && num_experts <= SORT_CHUNKED_MAX_EXPERTS {
            let chunk = SORT_CHUNK.max(pairs.div_ceil(SORT_MAX_BLOCKS));
            let mut chunked = args.to_vec();
            chunked.insert(3, u32_of(op, chunk)?);
            let grid = (grid_of(op, pairs.div_ceil(chunk))?, 1, 1);
            return self.launch(&self.kernels.moe_sort_chunked, grid, 1024, &chunked);
        }
        self.launch(&self.kernels.moe_sort, (1, 1, 1), 1024, &args)
    }

    fn moe_grouped_gate_up(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_grouped_gate_up";
        let (num_experts, inter, hidden) = (
            experts.gate.num_experts(),
            experts.gate.rows(),
            experts.gate.cols(),
        );
        if experts.up.rows() != inter || experts.up.cols() != hidden {
            return Err(bad(
                op,
                "gate and up projections differ in shape".to_string(),
            ));
        }
        let pairs = routing.tokens * routing.top_k;
        if pairs == 0 || inter == 0 {
            return Ok(());
        }
        let (gate, gate_dtype, gate_vec) = self.experts(op, &experts.gate)?;
        let (up, up_dtype, up_vec) = self.experts(op, &experts.up)?;
        if gate_dtype != up_dtype {
            return Err(bad(op, "gate and up stored in different types".to_string()));
        }
        if quant::quant_format(gate_dtype).is_some() {
            return self.with_decoded_experts(op, experts, sorted, [true, true, false], |d| {
                self.moe_grouped_gate_up(x, routing, sorted, d, act)
            });
        }
        let kernels = self.kernels.for_weights(op, gate_dtype)?;
        let big = self.big_tiles(op, kernels, experts)?;
        let few_rows = kernels
            .grouped_mvm
            .as_ref()
            .filter(|_| gate_vec && up_vec)
            .zip(few_rows_variant(pairs, num_experts, big.is_some()));
        let x_len = routing.tokens * hidden;
        let x_arg = match x.dtype() {
            // Only the bf16 tiles read x as a norm left it in bf16.
            DType::BF16
                if few_rows.is_some() || big.is_none_or(|b| self.split_tiles(b).is_some()) =>
            {
                return self.with_f32_copy(op, x, x_len, |x32| {
                    self.moe_grouped_gate_up(x32, routing, sorted, experts, act)
                });
            }
            DType::BF16 => buf(op, "x", x, DType::BF16, x_len)?,
            _ => buf(op, "x", x, DType::F32, x_len)?,
        };
        let [offsets, hit, sorted_pairs, pairs_a, experts_a] =
            sorted_args(op, sorted, num_experts, pairs)?;
        let args = [
            x_arg,
            u32_of(op, hidden)?,
            u32_of(op, routing.top_k)?,
            offsets,
            hit,
            sorted_pairs,
            pairs_a,
            experts_a,
            gate,
            up,
            u32_of(op, inter)?,
            Arg::U32((gate_vec && up_vec) as u32),
            buf(op, "act", act, DType::F32, pairs * inter)?,
            self.diag(),
        ];
        if let Some((mvm, variant)) = few_rows {
            if let Some(stream) = self.streamed_experts(kernels, hidden, routing.tokens) {
                return self.launch(&stream[0], self.stream_grid(op)?, STREAM_THREADS, &args);
            }
            // A block row per expert that can have rows: at most one per routed pair; a
            // block per 8 features of gate and up.
            let grid = (
                grid_of(op, inter.div_ceil(8))?,
                grid_of(op, num_experts.min(pairs))?,
                1,
            );
            return self.launch(&mvm[0][variant], grid, MVM_THREADS, &args);
        }
        if let Some(big) = big {
            let tiles = pairs.div_ceil(BIG_TILE_ROWS) + num_experts.min(pairs);
            let grid = (grid_of(op, tiles)?, grid_of(op, inter.div_ceil(64))?, 1);
            if let Some(split) = self.split_tiles(big) {
                // x as split pairs once, both planes in one pooled buffer.
                let convert = |x2_ptr| {
                    let args = [args[0], Arg::U64(x_len as u64), Arg::Ptr(x2_ptr)];
                    let grid = Self::elementwise_grid(op, x_len.div_ceil(4))?;
                    self.launch(&self.kernels.to_bf16_split, grid, 256, &args)
                };
                return self.with_converted_copy(op, (DType::BF16, 2 * x_len), convert, |x2| {
                    let mut big_args = args;
                    big_args[0] = Arg::Ptr(ptr_of(op, x2)?);
                    self.launch(&split[0], grid, BIG_TILE_THREADS, &big_args)
                });
            }
            // x rounded to bf16 once (the tiles would round it the same way as they stage it).
            if x.dtype() == DType::BF16 {
                return self.launch(&big.bf16[0], grid, BIG_TILE_THREADS, &args);
            }
            return self.with_bf16_copy(op, args[0], x_len, 0, |x16_ptr| {
                let mut big_args = args;
                big_args[0] = Arg::Ptr(x16_ptr);
                self.launch(&big.bf16[0], grid, BIG_TILE_THREADS, &big_args)
            });
        }
        let tiles = pairs.div_ceil(64) + num_experts.min(pairs);
        let grid = (grid_of(op, tiles)?, grid_of(op, inter.div_ceil(64))?, 1);
        self.launch(&kernels.grouped_gate_up, grid, 128, &args)
    }

    fn moe_grouped_down(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
    ) -> Result<()> {
        self.grouped_down(act, routing, sorted, experts, y, false)
            .map(|_| ())
    }

    fn moe_grouped_down_combine(
        &self,
        act: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        experts: &ExpertWeights,
        y: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let y_dtype = self.grouped_down(act, routing, sorted, experts, y, true)?;
        self.combine(y, y_dtype, routing, sorted, experts.down.rows(), out)
    }

    fn moe_combine(
        &self,
        y: &DeviceBuffer,
        routing: MoeRouting<'_>,
        sorted: MoeSorted<'_>,
        hidden: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.combine(y, DType::F32, routing, sorted, hidden, out)
    }

    fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "sigmoid_mul";
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, gate)?,
            Arg::U64(len as u64),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.sigmoid_mul,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn add_sigmoid_gated(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        let op = "add_sigmoid_gated";
        if rows * dim == 0 {
            return Ok(());
        }
        let args = [
            addr(op, acc)?,
            addr(op, x)?,
            addr(op, gate)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
        ];
        let grid = Self::elementwise_grid(op, rows * dim)?;
        self.launch(&self.kernels.add_sigmoid_gated, grid, 256, &args)
    }

    fn causal_conv1d(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        channels: usize,
        kernel: usize,
        runs: RecurrentRuns<'_>,
        conv_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "causal_conv1d";
        if runs.num_runs == 0 || channels == 0 {
            return Ok(());
        }
        let tokens = x.len() / channels;
        let slots = conv_state.len() / (channels * (kernel - 1));
        let args = [
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, channels)?,
            u32_of(op, kernel)?,
            addr(op, runs.runs)?,
            u32_of(op, tokens)?,
            u32_of(op, slots)?,
            addr(op, conv_state)?,
            addr(op, out)?,
            kept_arg(op, runs)?,
            self.diag(),
        ];
        // Tiles of CONV_TILE tokens (delta_net.cu) of the longest run.
        let grid = (
            grid_of(op, channels.div_ceil(32))?,
            grid_of(op, runs.max_run_tokens.div_ceil(64).max(1))?,
            grid_of(op, runs.num_runs)?,
        );
        self.launch(&self.kernels.causal_conv1d, grid, 256, &args)
    }

    fn delta_net_gates(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        a_log: &DeviceBuffer,
        dt_bias: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        g: &mut DeviceBuffer,
        beta: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "delta_net_gates";
        let len = tokens * heads;
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, a)?,
            addr(op, b)?,
            addr(op, a_log)?,
            addr(op, dt_bias)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            addr(op, g)?,
            addr(op, beta)?,
        ];
        self.launch(
            &self.kernels.delta_net_gates,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn gated_delta_rule(
        &self,
        qkv: &DeviceBuffer,
        g: &DeviceBuffer,
        beta: &DeviceBuffer,
        shape: DeltaNetShape,
        runs: RecurrentRuns<'_>,
        recurrent_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        } = shape;
        if runs.num_runs == 0 {
            return Ok(());
        }
        let width = 2 * nk * dk + nv * dv;
        let tokens = qkv.len() / width;
        let slots = recurrent_state.len() / (nv * dk * dv);
        let args = [
            addr(op, qkv)?,
            addr(op, g)?,
            addr(op, beta)?,
            u32_of(op, nk)?,
            u32_of(op, nv)?,
            u32_of(op, dk)?,
            u32_of(op, dv)?,
            addr(op, runs.runs)?,
            u32_of(op, tokens)?,
            u32_of(op, slots)?,
            addr(op, recurrent_state)?,
            addr(op, out)?,
            self.diag(),
        ];
        // Runs keeping their states go token by token (a verify's few tokens).
        if runs.max_run_tokens >= CHUNKED_DELTA_MIN_RUN
            && !self.recurrent_delta_rule
            && runs.kept.is_none()
        {
            let per_wave = OP_SCRATCH_FLOATS * 4 / (nv * gdr_chunk_bytes(dk, dv));
            if per_wave > 0 {
                // Every run has at most one partial chunk.
                let chunks = (tokens.div_ceil(GDR_CHUNK) + runs.num_runs)
                    .min(runs.num_runs * runs.max_run_tokens.div_ceil(GDR_CHUNK));
                return self.chunked_delta_rule(args, chunks, (nv, dv), runs.num_runs, per_wave);
            }
        }
        // Two threads per state column, and at least one per key dim, in whole warps.
        let threads = (2 * dv).max(dk).div_ceil(32) * 32;
        let grid = (grid_of(op, runs.num_runs)?, grid_of(op, nv)?, 1);
        let kernel = if threads <= 256 {
            &self.kernels.gated_delta_rule_256
        } else {
            &self.kernels.gated_delta_rule
        };
        let [head @ .., diag] = args;
        let mut with_kept = [Arg::Ptr(0); 14];
        with_kept[..12].copy_from_slice(&head);
        with_kept[12] = kept_arg(op, runs)?;
        with_kept[13] = diag;
        self.launch(kernel, grid, threads as u32, &with_kept)
    }

    fn gated_rms_norm(
        &self,
        x: &DeviceBuffer,
        z: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "gated_rms_norm";
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, z)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.gated_rms_norm,
            (grid_of(op, rows.div_ceil(8))?, 1, 1),
            256,
            &args,
        )
    }

    fn logit_penalties(
        &self,
        logits: &mut DeviceBuffer,
        len: usize,
        entries: &DeviceBuffer,
        n: usize,
    ) -> Result<()> {
        let op = "logit_penalties";
        if n == 0 {
            return Ok(());
        }
        let args = [
            addr(op, logits)?,
            u32_of(op, len)?,
            addr(op, entries)?,
            u32_of(op, n)?,
            self.diag(),
        ];
        self.launch(
            &self.kernels.logit_penalties,
            (grid_of(op, n.div_ceil(256))?, 1, 1),
            256,
            &args,
        )
    }

    fn top_candidates(
        &self,
        logits_buf: &DeviceBuffer,
        rows: usize,
        vocab: usize,
        draws: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "top_candidates";
        if rows == 0 {
            return Ok(());
        }
        let parts = vocab.div_ceil(SAMPLE_CHUNK);
        let logits = ptr_of(op, logits_buf)?;
        let draws_at = ptr_of(op, draws)?;
        let out_at = ptr_of(op, out)?;
        // Rows in launches of at most SAMPLE_MAX_ROWS, the scratch's and tickets' rows.
        for first in (0..rows).step_by(SAMPLE_MAX_ROWS) {
            let n = (rows - first).min(SAMPLE_MAX_ROWS);
            let args = [
                Arg::Ptr(logits + (first * vocab * 4) as u64),
                u32_of(op, vocab)?,
                Arg::Ptr(draws_at + (first * DRAW_WORDS * 4) as u64),
                Arg::Ptr(ptr_of(op, &self.sampling_scratch)?),
                Arg::Ptr(ptr_of(op, &self.sampling_tickets)?),
                Arg::Ptr(out_at + (first * CANDIDATE_ROW_WORDS * 4) as u64),
            ];
            self.launch(
                &self.kernels.top_candidates,
                (grid_of(op, parts)?, grid_of(op, n)?, 1),
                SAMPLE_THREADS,
                &args,
            )?;
        }
        Ok(())
    }

    fn moe_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: MoeRouting<'_>,
        experts: &ExpertWeights,
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_experts_per_token";
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        let (num_experts, inter, hidden) = (
            experts.gate.num_experts(),
            experts.gate.rows(),
            experts.gate.cols(),
        );
        let pairs = tokens * top_k;
        if pairs == 0 {
            return Ok(());
        }
        if experts.up.rows() != inter
            || experts.up.cols() != hidden
            || experts.down.rows() != hidden
            || experts.down.cols() != inter
        {
            return Err(bad(
                op,
                "expert projections of mismatched shapes".to_string(),
            ));
        }
        let (gate, dtype, gate_vec) = self.experts(op, &experts.gate)?;
        let (up, up_dtype, up_vec) = self.experts(op, &experts.up)?;
        let (down, down_dtype, down_vec) = self.experts(op, &experts.down)?;
        if let (Some(g), Some(d)) = (quant::quant_format(dtype), quant::quant_format(down_dtype))
            && up_dtype == dtype
        {
            // Block formats may differ between gate/up and down (Q4_K_M's Q6_K down).
            let tables = [gate, up, down];
            let shape = (num_experts, inter, hidden);
            return self.quant_experts_per_token(x, routing, (g, d), tables, shape, act, out);
        }
        if up_dtype != dtype || down_dtype != dtype {
            return Err(bad(
                op,
                "expert projections stored in different types".to_string(),
            ));
        }
        let kernels = self.kernels.for_weights(op, dtype)?;
        let (gate_up_kernel, down_kernel) = (&kernels.per_token_gate_up, &kernels.per_token_down);
        let ids = buf(op, "expert_ids", routing.expert_ids, DType::U32, pairs)?;
        let act_arg = buf(op, "act", act, DType::F32, pairs * inter)?;
        let first = [
            buf(op, "x", x, DType::F32, tokens * hidden)?,
            u32_of(op, hidden)?,
            ids,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            gate,
            up,
            u32_of(op, inter)?,
            Arg::U32((gate_vec && up_vec) as u32),
            act_arg,
            self.diag(),
        ];
        let grid = (grid_of(op, inter.div_ceil(8) * pairs)?, 1, 1);
        self.launch(gate_up_kernel, grid, 256, &first)?;
        let second = [
            act_arg,
            u32_of(op, inter)?,
            ids,
            buf(
                op,
                "expert_weights",
                routing.expert_weights,
                DType::F32,
                pairs,
            )?,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            down,
            u32_of(op, hidden)?,
            Arg::U32(down_vec as u32),
            buf(op, "out", out, DType::F32, tokens * hidden)?,
            self.diag(),
        ];
        let grid = (grid_of(op, hidden.div_ceil(8) * tokens)?, 1, 1);
        self.launch(down_kernel, grid, 256, &second)
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
