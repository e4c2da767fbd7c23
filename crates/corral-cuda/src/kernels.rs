//! The loaded kernels: every function of every module, resolved once at start-up.

use std::sync::Arc;

use cudarc::driver::CudaModule;
use cudarc::nvrtc::Ptx;

use super::FLASH_THREADS;
use super::compile::{KernelCache, SOURCES};
use super::device::{Gpu, Kernel, driver_err};
use corral_backend::{BackendError, DType, QuantFormat, Result};

/// Kernels instantiated per weight type (bf16, f16, f32).
#[derive(Debug)]
pub(crate) struct WeightKernels {
    pub(crate) embedding: Kernel,
    /// Matrix-vector products for at most 1, 2, 4, 8, 16 and 32 rows.
    pub(crate) matvec: [Kernel; 6],
    /// Tensor-core matrix-vector products for at most 8, 16 and 32 rows (16-bit weights):
    /// `[whole K, K split over blocks]`.
    pub(crate) matvec_mma: Option<[[Kernel; 3]; 2]>,
    /// Few-row products streamed through shared memory by bulk copies (16-bit weights,
    /// sm_90 and newer).
    pub(crate) matvec_stream: Option<Kernel>,
    pub(crate) matmul_tiled: Kernel,
    pub(crate) grouped_gate_up: Kernel,
    pub(crate) grouped_down: Kernel,
    /// Grouped experts for few tokens, 8 and 32 rows at a time (16-bit weights):
    /// `[gate_up, down]`.
    pub(crate) grouped_mvm: Option<[[Kernel; 2]; 2]>,
    /// The same streamed through shared memory by bulk copies (16-bit weights, sm_90 and
    /// newer): `[gate_up, down]`.
    pub(crate) grouped_stream: Option<[Kernel; 2]>,
    /// Grouped experts in 128-row tiles for prefill-sized groups (bf16 weights).
    pub(crate) grouped_big: Option<BigTileKernels>,
    pub(crate) per_token_gate_up: Kernel,
    pub(crate) per_token_down: Kernel,
}

/// The 128-row expert tiles (mma_big_tile.cuh).
#[derive(Debug)]
pub(crate) struct BigTileKernels {
    /// bf16 activations: gate/up, down into f32 y, down into bf16 y (for the combine that
    /// reads it so).
    pub(crate) bf16: [Kernel; 3],
    /// Split-pair activations ([`crate::CudaOptions::precise_experts`]): `[gate_up, down]`,
    /// down into f32 y.
    pub(crate) split: [Kernel; 2],
}

/// Block formats the GPU reads as stored, in the order of [`Kernels::quant`] (quant.cu's
/// instantiations).
pub(crate) const GPU_QUANT_FORMATS: [QuantFormat; 7] = [
    QuantFormat::Q8_0,
    QuantFormat::Q4_0,
    QuantFormat::Q5_0,
    QuantFormat::Q4K,
    QuantFormat::Q5K,
    QuantFormat::Q6K,
    QuantFormat::F8E4M3x128,
];

/// Kernels instantiated per block format, each decoding 32 values at a time in registers.
#[derive(Debug)]
pub(crate) struct QuantKernels {
    /// Matrix-vector products for at most 1, 2, 4 and 8 rows (FP8 blocks: up to 8 rows with
    /// 2, then 4, of K's blocks in flight a warp, slots 2 and 3 repeating them).
    pub(crate) matvec: [Kernel; 4],
    pub(crate) per_token_gate_up: Kernel,
    pub(crate) per_token_down: Kernel,
    /// Whole rows decoded into f32, then bf16.
    pub(crate) dequantize: [Kernel; 2],
    /// The experts that have rows decoded into bf16.
    pub(crate) dequantize_experts: Kernel,
    pub(crate) embedding: Kernel,
}

/// Dynamic shared memory the FP8 kernels may take (quant.cu's F8Staged: x staged for the
/// products, 260 bytes a row's 128 values); a launch asks for what its x needs.
pub(crate) const F8_SMEM_BYTES: u32 = 96 * 1024;

/// Dynamic shared memory of the 128-row expert tiles (mma_big_tile.cuh): `stages` of 128
/// rows of each activation plane (one, or two split) and 128 weight rows, 72 bf16 values each.
const fn big_tile_smem_bytes(stages: u32, planes: u32) -> u32 {
    stages * (planes * 128 + 128) * 72 * 2
}

/// Dynamic shared memory of the streamed few-row products: STREAM_SMEM_BYTES of
/// streamed_mvm.cuh (the stages' pool, three units of 16 rows of 2,048 16-bit values; two
/// reduction buffers of 8 × 2 × 4 × 32 floats; two barriers and a 16-byte unit record for
/// each of up to six stages).
const STREAM_SMEM_BYTES: u32 = 3 * 16 * 2048 * 2 + 2 * 8 * 2 * 4 * 32 * 4 + 6 * (2 * 8 + 16);

/// Dynamic shared memory of prefill attention for `head_dim`: FA_SMEM_BYTES of
/// flash_attention.cu (FaStages stages, two at head dims 64 and 128 and one at 256, of 64 keys
/// of K and V, rows of head_dim + 8 bf16 values).
const fn flash_attention_smem_bytes(head_dim: u32) -> u32 {
    let stages = if head_dim == 256 { 1 } else { 2 };
    stages * 2 * 64 * (head_dim + 8) * 2
}

/// The same over an fp8 cache: FA_FP8_SMEM_BYTES (one f16 tile of K and of V, their raw
/// bytes, and a scale for each 16-byte piece).
const fn flash_attention_fp8_smem_bytes(head_dim: u32) -> u32 {
    2 * 64 * (head_dim + 8) * 2 + 2 * 64 * head_dim + 2 * 64 * head_dim / 16 * 4
}

/// Prefill attention at one head dim: its tensor-core tiles over a bf16 cache and over an
/// fp8 one, and the merge of their partial states where the keys split over blocks; each
/// writing f32, then bf16.
#[derive(Debug)]
pub(crate) struct FlashKernels {
    pub(crate) tiles: [FlashTiles; 2],
    pub(crate) tiles_fp8: [FlashTiles; 2],
    pub(crate) merge: [Kernel; 2],
}

/// A prefill attention tile kernel and how many of its blocks an SM holds (which sizes its
/// key splits).
#[derive(Debug)]
pub(crate) struct FlashTiles {
    pub(crate) kernel: Kernel,
    pub(crate) blocks_per_sm: usize,
}

/// Dynamic shared memory of the chunked delta rule's kernels (delta_net.cu's
/// GDR_PREP_SMEM_BYTES and GDR_SCAN_SMEM_BYTES): the prepare kernel's q̂ and k̂ rows (16-bit,
/// stride 136) and A and T (f32 [64][65]); the scan's two stages of −W, q̂ and k̂ rows (bf16,
/// stride 136), M's two halves (bf16, stride 72) and 132 tail floats, then the state slice's
/// halves (32 rows of 136) and two copies of V' in halves (32 rows of 72).
const GDR_PREP_SMEM_BYTES: u32 = 2 * 64 * 136 * 2 + 2 * 64 * 65 * 4;
const GDR_SCAN_SMEM_BYTES: u32 =
    2 * (3 * 64 * 136 * 2 + 2 * 64 * 72 * 2 + 132 * 4) + 2 * 32 * 136 * 2 + 4 * 32 * 72 * 2;

include!(concat!(env!("OUT_DIR"), "/plain_kernels.rs"));

/// The dynamic shared memory of the plain kernels that take more than the static.
const PLAIN_DYNAMIC_SMEM: [(&str, u32); 4] = [
    ("gdr_chunk_prepare", GDR_PREP_SMEM_BYTES),
    ("gdr_chunk_scan", GDR_SCAN_SMEM_BYTES),
    ("moe_per_token_gate_up_f8", F8_SMEM_BYTES),
    ("moe_per_token_down_f8", F8_SMEM_BYTES),
];

impl std::ops::Deref for Kernels {
    type Target = PlainKernels;

    fn deref(&self) -> &PlainKernels {
        &self.plain
    }
}

/// Every kernel Corral launches: the plain ones, derived from the sources, and the
/// families a macro instantiates, gathered here.
#[derive(Debug)]
pub(crate) struct Kernels {
    /// The kernels defined once in the sources, each by its name (also reached through
    /// `Deref`, as `kernels.rope`).
    pub(crate) plain: PlainKernels,
    pub(crate) bf16: WeightKernels,
    pub(crate) f16: WeightKernels,
    pub(crate) f32: WeightKernels,
    /// By [`GPU_QUANT_FORMATS`].
    pub(crate) quant: [QuantKernels; 7],
    pub(crate) normal_fill_bf16: Kernel,
    pub(crate) normal_fill_f16: Kernel,
    pub(crate) normal_fill_f32: Kernel,
    pub(crate) rms_norm: Kernel,
    pub(crate) rms_norm_bf16: Kernel,
    pub(crate) add_rms_norm: Kernel,
    pub(crate) add_rms_norm_bf16: Kernel,
    pub(crate) kv_store_bf16: Kernel,
    pub(crate) kv_store_f32: Kernel,
    /// By cache type: head dims up to 128 and up to 512, each one head a warp (few tokens)
    /// and five (prefill).
    pub(crate) qkv_norm_rope_store_bf16: [Kernel; 4],
    pub(crate) qkv_norm_rope_store_f32: [Kernel; 4],
    pub(crate) qkv_norm_rope_store_fp8: [Kernel; 4],
    /// Indexed by log2 of the head dims each lane owns (1, 2, 4, 8, 16).
    pub(crate) paged_attention_bf16: [Kernel; 5],
    pub(crate) paged_attention_f32: [Kernel; 5],
    pub(crate) paged_attention_fp8: [Kernel; 5],
    /// Tensor-core decode attention over a bf16 cache, head dims 64, 128 and 256.
    pub(crate) decode_attention_mma: [Kernel; 3],
    /// The same over an fp8 cache (f16 operands).
    pub(crate) decode_attention_mma_fp8: [Kernel; 3],
    /// Tensor-core prefill attention over a bf16 or fp8 cache, head dims 64, 128 and 256.
    pub(crate) flash_attention_hd64: FlashKernels,
    pub(crate) flash_attention_hd128: FlashKernels,
    pub(crate) flash_attention_hd256: FlashKernels,
    pub(crate) moe_combine: Kernel,
    pub(crate) moe_combine_y16: Kernel,
    /// The delta rule for blocks of up to 256 threads (value dims up to 128), and any.
    pub(crate) gated_delta_rule_256: Kernel,
    pub(crate) gated_delta_rule: Kernel,
    _modules: Vec<Arc<CudaModule>>,
}

/// How start-up got its kernels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelCacheReport {
    /// Files compiled by NVRTC in this start.
    pub compiled: usize,
    /// Files read from the on-disk cache.
    pub cached: usize,
    /// The cache folder, if any.
    pub cache_dir: Option<std::path::PathBuf>,
    /// Seconds spent compiling and loading.
    pub seconds: f64,
}

impl Kernels {
    /// Compiles (or reads from `cache`) and loads every kernel file for the device's arch.
    pub(crate) fn load(gpu: &Gpu, cache: &KernelCache) -> Result<(Self, KernelCacheReport)> {
        let start = std::time::Instant::now();
        let (major, minor) = gpu.compute_capability;
        if major < 8 {
            return Err(BackendError::Device {
                what: gpu.name.clone(),
                detail: format!(
                    "compute capability {major}.{minor}; Corral's kernels need 8.0 or newer \
                     (bf16 tensor cores)"
                ),
            });
        }
        let arch = format!("sm_{major}{minor}");
        let mut report = KernelCacheReport {
            cache_dir: cache.dir().map(|d| d.to_path_buf()),
            ..Default::default()
        };
        let mut modules = Vec::new();
        for source in &SOURCES {
            let (image, compiled) = cache.load_or_compile(source, &arch)?;
            if compiled {
                report.compiled += 1;
            } else {
                report.cached += 1;
            }
            gpu.bind()?;
            let module = gpu
                .ctx
                .load_module(Ptx::from_binary(image))
                .map_err(|e| driver_err(&format!("loading {}", source.name), e))?;
            modules.push(module);
        }
        let find = |name: &'static str| -> Result<Kernel> {
            for m in &modules {
                if let Ok(f) = m.load_function(name) {
                    return Ok(Kernel(f.cu_function(), name, 0));
                }
            }
            Err(BackendError::Device {
                what: "loading kernels".to_string(),
                detail: format!("no kernel named {name}"),
            })
        };
        // The tile, fp8 tile and merge kernels of head dim `$hd`, each with f32 and f16 output.
        macro_rules! flash_names {
            ($hd:literal) => {
                [
                    concat!("flash_attention_bf16_hd", $hd),
                    concat!("flash_attention_bf16_hd", $hd, "_o16"),
                    concat!("flash_attention_fp8_hd", $hd),
                    concat!("flash_attention_fp8_hd", $hd, "_o16"),
                    concat!("flash_merge_hd", $hd),
                    concat!("flash_merge_hd", $hd, "_o16"),
                ]
            };
        }
        let flash = |hd: u32| -> Result<FlashKernels> {
            let names: [&'static str; 6] = match hd {
                64 => flash_names!(64),
                128 => flash_names!(128),
                _ => flash_names!(256),
            };
            let tiles = |name, smem| -> Result<FlashTiles> {
                let kernel = find(name)?
                    .with_dynamic_smem(smem)?
                    .preferring_shared_memory()?;
                let blocks_per_sm = kernel.blocks_per_sm(FLASH_THREADS)?;
                let (registers, local_bytes) = kernel.resources()?;
                tracing::debug!(
                    name,
                    registers,
                    local_bytes,
                    blocks_per_sm,
                    "prefill tile kernel"
                );
                Ok(FlashTiles {
                    kernel,
                    blocks_per_sm,
                })
            };
            let (bf16, fp8) = (
                flash_attention_smem_bytes(hd),
                flash_attention_fp8_smem_bytes(hd),
            );
            Ok(FlashKernels {
                tiles: [tiles(names[0], bf16)?, tiles(names[1], bf16)?],
                tiles_fp8: [tiles(names[2], fp8)?, tiles(names[3], fp8)?],
                merge: [find(names[4])?, find(names[5])?],
            })
        };
        let grouped_mvm = |s: &'static str| -> Result<Option<[[Kernel; 2]; 2]>> {
            let names: [&'static str; 4] = match s {
                "bf16" => [
                    "moe_grouped_gate_up_mvm_bf16_n1",
                    "moe_grouped_gate_up_mvm_bf16_n4",
                    "moe_grouped_down_mvm_bf16_n1",
                    "moe_grouped_down_mvm_bf16_n4",
                ],
                "f16" => [
                    "moe_grouped_gate_up_mvm_f16_n1",
                    "moe_grouped_gate_up_mvm_f16_n4",
                    "moe_grouped_down_mvm_f16_n1",
                    "moe_grouped_down_mvm_f16_n4",
                ],
                _ => return Ok(None),
            };
            Ok(Some([
                [find(names[0])?, find(names[1])?],
                [find(names[2])?, find(names[3])?],
            ]))
        };
        let grouped_big = |s: &'static str| -> Result<Option<BigTileKernels>> {
            if s != "bf16" {
                return Ok(None);
            }
            let tile = |name, stages, planes| {
                find(name)?.with_dynamic_smem(big_tile_smem_bytes(stages, planes))
            };
            Ok(Some(BigTileKernels {
                bf16: [
                    tile("moe_grouped_gate_up_big_bf16", 3, 1)?,
                    tile("moe_grouped_down_big_bf16", 3, 1)?,
                    tile("moe_grouped_down_big_bf16_y16", 3, 1)?,
                ],
                // Two stages: the second activation plane takes the third stage's room.
                split: [
                    tile("moe_grouped_gate_up_big_split", 2, 2)?,
                    tile("moe_grouped_down_big_split", 2, 2)?,
                ],
            }))
        };
        let grouped_stream = |s: &'static str| -> Result<Option<[Kernel; 2]>> {
            let names = match s {
                _ if gpu.compute_capability.0 < 9 => return Ok(None),
                "bf16" => ["moe_stream_gate_up_bf16", "moe_stream_down_bf16"],
                "f16" => ["moe_stream_gate_up_f16", "moe_stream_down_f16"],
                _ => return Ok(None),
            };
            Ok(Some([
                find(names[0])?.with_dynamic_smem(STREAM_SMEM_BYTES)?,
                find(names[1])?.with_dynamic_smem(STREAM_SMEM_BYTES)?,
            ]))
        };
        let matvec_stream = |s: &'static str| -> Result<Option<Kernel>> {
            let name = match s {
                _ if gpu.compute_capability.0 < 9 => return Ok(None),
                "bf16" => "matvec_stream_bf16",
                "f16" => "matvec_stream_f16",
                _ => return Ok(None),
            };
            Ok(Some(find(name)?.with_dynamic_smem(STREAM_SMEM_BYTES)?))
        };
        let mma = |s: &'static str| -> Result<Option<[[Kernel; 3]; 2]>> {
            let names: [[&'static str; 3]; 2] = match s {
                "bf16" => [
                    [
                        "matvec_mma_bf16_n1",
                        "matvec_mma_bf16_n2",
                        "matvec_mma_bf16_n4",
                    ],
                    [
                        "matvec_mma_split_bf16_n1",
                        "matvec_mma_split_bf16_n2",
                        "matvec_mma_split_bf16_n4",
                    ],
                ],
                "f16" => [
                    [
                        "matvec_mma_f16_n1",
                        "matvec_mma_f16_n2",
                        "matvec_mma_f16_n4",
                    ],
                    [
                        "matvec_mma_split_f16_n1",
                        "matvec_mma_split_f16_n2",
                        "matvec_mma_split_f16_n4",
                    ],
                ],
                _ => return Ok(None),
            };
            let three = |n: [&'static str; 3]| -> Result<[Kernel; 3]> {
                Ok([find(n[0])?, find(n[1])?, find(n[2])?])
            };
            Ok(Some([three(names[0])?, three(names[1])?]))
        };
        macro_rules! weight_kernels {
            ($s:literal) => {
                WeightKernels {
                    embedding: find(concat!("embedding_", $s))?,
                    matvec: [
                        find(concat!("matvec_", $s, "_r1"))?,
                        find(concat!("matvec_", $s, "_r2"))?,
                        find(concat!("matvec_", $s, "_r4"))?,
                        find(concat!("matvec_", $s, "_r8"))?,
                        find(concat!("matvec_", $s, "_r16"))?,
                        find(concat!("matvec_", $s, "_r32"))?,
                    ],
                    matvec_mma: mma($s)?,
                    matvec_stream: matvec_stream($s)?,
                    matmul_tiled: find(concat!("matmul_tiled_", $s))?,
                    grouped_gate_up: find(concat!("moe_grouped_gate_up_", $s))?,
                    grouped_down: find(concat!("moe_grouped_down_", $s))?,
                    grouped_mvm: grouped_mvm($s)?,
                    grouped_stream: grouped_stream($s)?,
                    grouped_big: grouped_big($s)?,
                    per_token_gate_up: find(concat!("moe_per_token_gate_up_", $s))?,
                    per_token_down: find(concat!("moe_per_token_down_", $s))?,
                }
            };
        }
        macro_rules! quant_kernels {
            ($s:literal) => {
                QuantKernels {
                    matvec: [
                        find(concat!("matvec_", $s, "_r1"))?,
                        find(concat!("matvec_", $s, "_r2"))?,
                        find(concat!("matvec_", $s, "_r4"))?,
                        find(concat!("matvec_", $s, "_r8"))?,
                    ],
                    per_token_gate_up: find(concat!("moe_per_token_gate_up_", $s))?,
                    per_token_down: find(concat!("moe_per_token_down_", $s))?,
                    dequantize: [
                        find(concat!("dequantize_", $s, "_f32"))?,
                        find(concat!("dequantize_", $s, "_bf16"))?,
                    ],
                    dequantize_experts: find(concat!("dequantize_experts_", $s))?,
                    embedding: find(concat!("embedding_", $s))?,
                }
            };
        }
        let plain = PlainKernels::find_all(&|name| {
            let kernel = find(name)?;
            match PLAIN_DYNAMIC_SMEM.iter().find(|(n, _)| *n == name) {
                Some(&(_, bytes)) => kernel.with_dynamic_smem(bytes),
                None => Ok(kernel),
            }
        })?;
        let kernels = Self {
            plain,
            bf16: weight_kernels!("bf16"),
            f16: weight_kernels!("f16"),
            f32: weight_kernels!("f32"),
            quant: [
                quant_kernels!("q8_0"),
                quant_kernels!("q4_0"),
                quant_kernels!("q5_0"),
                quant_kernels!("q4_k"),
                quant_kernels!("q5_k"),
                quant_kernels!("q6_k"),
                QuantKernels {
                    matvec: [
                        find("matvec_f8_u2")?.with_dynamic_smem(F8_SMEM_BYTES)?,
                        find("matvec_f8_u4")?.with_dynamic_smem(F8_SMEM_BYTES)?,
                        find("matvec_f8_u2")?.with_dynamic_smem(F8_SMEM_BYTES)?,
                        find("matvec_f8_u4")?.with_dynamic_smem(F8_SMEM_BYTES)?,
                    ],
                    per_token_gate_up: find("moe_per_token_gate_up_f8")?
                        .with_dynamic_smem(F8_SMEM_BYTES)?,
                    per_token_down: find("moe_per_token_down_f8")?
                        .with_dynamic_smem(F8_SMEM_BYTES)?,
                    dequantize: [find("dequantize_f8_f32")?, find("dequantize_f8_bf16")?],
                    dequantize_experts: find("dequantize_experts_f8")?,
                    embedding: find("embedding_f8")?,
                },
            ],
            normal_fill_bf16: find("normal_fill_bf16")?,
            normal_fill_f16: find("normal_fill_f16")?,
            normal_fill_f32: find("normal_fill_f32")?,
            rms_norm: find("rms_norm")?,
            rms_norm_bf16: find("rms_norm_bf16")?,
            add_rms_norm: find("add_rms_norm")?,
            add_rms_norm_bf16: find("add_rms_norm_bf16")?,
            kv_store_bf16: find("kv_store_bf16")?,
            kv_store_f32: find("kv_store_f32")?,
            qkv_norm_rope_store_bf16: [
                find("qkv_norm_rope_store_bf16_d4_h1")?,
                find("qkv_norm_rope_store_bf16_d4_h5")?,
                find("qkv_norm_rope_store_bf16_d16_h1")?,
                find("qkv_norm_rope_store_bf16_d16_h5")?,
            ],
            qkv_norm_rope_store_f32: [
                find("qkv_norm_rope_store_f32_d4_h1")?,
                find("qkv_norm_rope_store_f32_d4_h5")?,
                find("qkv_norm_rope_store_f32_d16_h1")?,
                find("qkv_norm_rope_store_f32_d16_h5")?,
            ],
            qkv_norm_rope_store_fp8: [
                find("qkv_norm_rope_store_fp8_d4_h1")?,
                find("qkv_norm_rope_store_fp8_d4_h5")?,
                find("qkv_norm_rope_store_fp8_d16_h1")?,
                find("qkv_norm_rope_store_fp8_d16_h5")?,
            ],
            paged_attention_bf16: [
                find("paged_attention_bf16_d1")?,
                find("paged_attention_bf16_d2")?,
                find("paged_attention_bf16_d4")?,
                find("paged_attention_bf16_d8")?,
                find("paged_attention_bf16_d16")?,
            ],
            paged_attention_f32: [
                find("paged_attention_f32_d1")?,
                find("paged_attention_f32_d2")?,
                find("paged_attention_f32_d4")?,
                find("paged_attention_f32_d8")?,
                find("paged_attention_f32_d16")?,
            ],
            paged_attention_fp8: [
                find("paged_attention_fp8_d1")?,
                find("paged_attention_fp8_d2")?,
                find("paged_attention_fp8_d4")?,
                find("paged_attention_fp8_d8")?,
                find("paged_attention_fp8_d16")?,
            ],
            decode_attention_mma: [
                find("decode_attention_mma_hd64")?,
                find("decode_attention_mma_hd128")?,
                find("decode_attention_mma_hd256")?,
            ],
            decode_attention_mma_fp8: [
                find("decode_attention_mma_fp8_hd64")?,
                find("decode_attention_mma_fp8_hd128")?,
                find("decode_attention_mma_fp8_hd256")?,
            ],
            flash_attention_hd64: flash(64)?,
            flash_attention_hd128: flash(128)?,
            flash_attention_hd256: flash(256)?,
            moe_combine: find("moe_combine")?,
            moe_combine_y16: find("moe_combine_y16")?,
            gated_delta_rule_256: find("gated_delta_rule_256")?,
            gated_delta_rule: find("gated_delta_rule")?,
            _modules: modules,
        };
        report.seconds = start.elapsed().as_secs_f64();
        Ok((kernels, report))
    }

    /// The kernels for weights of block format `format`.
    pub(crate) fn for_quant(&self, op: &'static str, format: QuantFormat) -> Result<&QuantKernels> {
        GPU_QUANT_FORMATS
            .iter()
            .position(|f| *f == format)
            .map(|i| &self.quant[i])
            .ok_or_else(|| BackendError::BadArgument {
                op,
                detail: format!("weights of {} on the GPU", format.name()),
            })
    }

    /// The kernels for weights of `dtype`.
    pub(crate) fn for_weights(&self, op: &'static str, dtype: DType) -> Result<&WeightKernels> {
        match dtype {
            DType::BF16 => Ok(&self.bf16),
            DType::F16 => Ok(&self.f16),
            DType::F32 => Ok(&self.f32),
            DType::U32 | DType::F8E4M3 | DType::Quant(_) => Err(BackendError::BadArgument {
                op,
                detail: format!("weights of {dtype}"),
            }),
        }
    }
}
