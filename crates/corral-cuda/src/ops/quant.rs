//! Block-format weights (GGUF's) on the GPU: few-row products and the per-token experts
//! decode the blocks in registers (quant.cu); many rows and the grouped experts decode to
//! bf16 first and take the tensor-core paths.

use std::sync::Arc;

use crate::kernels::{F8_SMEM_BYTES, QuantKernels};
use crate::{Arg, CudaBackend, MVM_THREADS, addr, buf, grid_of, ptr_of, u32_of, weight};
use corral_backend::{
    BackendError, BufferUsage, Buffers, DType, Device, DeviceBuffer, ExpertMatrices, ExpertWeights,
    MatmulOps, MoeSorted, QuantFormat, Result, WeightView, synthetic,
};

/// Rows of x up to which a block-format product reads the blocks directly (quant.cu's
/// matvec variants: 1, 2, 4 and 8 rows).
pub(crate) const QUANT_MATVEC_MAX_ROWS: usize = 8;

/// Output features of a block of quant.cu's few-row products (QMV_WARPS, a warp each).
const QMV_WARPS: usize = 8;

/// Bf16 copies of one MoE layer's block-format experts, which the grouped tiles read: made
/// once (again only for a layer of another shape), filled before each grouped product.
#[derive(Debug)]
pub(crate) struct DecodedExperts {
    shape: (usize, usize, usize),
    weights: ExpertWeights,
}

/// Threads of the FP8 per-token down kernel's wide blocks (quant.cu's F8_DOWN_WARPS), which it
/// runs when its grid is one wave of single blocks: a token's units of a 16-feature tile all
/// in flight at once. Larger grids take MVM_THREADS (two blocks an SM).
const F8_DOWN_WIDE_THREADS: u32 = 16 * 32;

/// Shared memory an FP8 kernel stages x in for `items` (row, 128-value block) pairs: quant.cu's
/// F8Staged, 128 f16 values and an f32 scale per item.
fn f8_staged_bytes(items: usize) -> usize {
    260 * items
}

fn u32_of_usize(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| bad(op, format!("{v} past u32")))
}

fn bad(op: &'static str, detail: String) -> BackendError {
    BackendError::BadArgument { op, detail }
}

/// The block format of a weight type, if it is one.
pub(crate) fn quant_format(dtype: DType) -> Option<QuantFormat> {
    match dtype {
        DType::Quant(format) => Some(format),
        _ => None,
    }
}

impl CudaBackend {
    /// Whether the GPU reads `format` as stored: FP8 blocks where the hardware converts e4m3
    /// (sm_89 and newer).
    pub(crate) fn reads_format(&self, format: QuantFormat) -> bool {
        self.capabilities().reads(format)
    }

    /// A block-format weight buffer holding `blocks` as they are (checked by
    /// `dyn Backend::weight_from_blocks`).
    pub(crate) fn upload_blocks(
        &self,
        blocks: &[u8],
        dtype: DType,
        len: usize,
    ) -> Result<DeviceBuffer> {
        let op = "weight_from_blocks";
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        self.gpu.upload(blocks, ptr_of(op, &b)?)?;
        self.stats.transfer(blocks.len());
        Ok(b)
    }

    /// Synthetic blocks made on the device: [`synthetic::quant_blocks`], byte for byte (checked
    /// by `dyn Backend::weight_synthetic_blocks`).
    pub(crate) fn synthetic_blocks(
        &self,
        format: QuantFormat,
        len: usize,
        seed: u64,
        std: f32,
    ) -> Result<DeviceBuffer> {
        let op = "weight_synthetic_blocks";
        let dtype = DType::Quant(format);
        let b = self.new_buffer(dtype, len, BufferUsage::Weights)?;
        let bytes = dtype.bytes_of(len);
        if bytes > 0 {
            let scales = synthetic::block_scales(format, std);
            let (d_at, d_bits, d_bytes) = scales.d;
            let (m_at, m_bits) = scales.min.unwrap_or((u32::MAX as usize, 0));
            let args = [
                Arg::Ptr(ptr_of(op, &b)?),
                Arg::U64(bytes as u64),
                u32_of(op, format.block().1)?,
                Arg::U64(seed),
                u32_of(op, d_at)?,
                Arg::U32(d_bits),
                u32_of(op, d_bytes)?,
                u32_of(op, m_at)?,
                Arg::U32(u32::from(m_bits)),
                Arg::U32(u32::from(format == QuantFormat::F8E4M3x128)),
            ];
            let grid = Self::elementwise_grid(op, bytes.div_ceil(8))?;
            self.launch(&self.kernels.synthetic_blocks, grid, 256, &args)?;
        }
        Ok(b)
    }

    /// `out = x · wᵀ` over a block-format weight: up to [`QUANT_MATVEC_MAX_ROWS`] rows read
    /// the blocks once; more decode the matrix into a pooled bf16 copy and run the bf16 path.
    pub(crate) fn quant_matmul(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        format: QuantFormat,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "matmul";
        if rows <= QUANT_MATVEC_MAX_ROWS {
            return self.quant_matvec(x, rows, w, format, out, (w.rows, 0));
        }
        let (w_addr, _, _) = weight(op, w)?;
        let len = w.rows * w.cols;
        let decode =
            |dst: u64| self.dequantize_into(op, format, (w_addr, w.cols, len), Arg::Ptr(dst), 1);
        self.with_converted_copy(op, (DType::BF16, len), decode, |w16| {
            self.matmul(x, rows, WeightView::new(w16, w.rows, w.cols)?, out)
        })
    }

    /// At most [`QUANT_MATVEC_MAX_ROWS`] rows of `x · wᵀ` from the blocks, into columns
    /// `col0..col0 + w.rows` of `out`'s rows of `out_cols`.
    pub(crate) fn quant_matvec(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        format: QuantFormat,
        out: &mut DeviceBuffer,
        (out_cols, col0): (usize, usize),
    ) -> Result<()> {
        let op = "matmul";
        let (w_addr, _, _) = weight(op, w)?;
        let kernels = self.kernels.for_quant(op, format)?;
        if x.dtype() == DType::BF16 {
            return self.with_f32_copy(op, x, rows * w.cols, |x32| {
                self.quant_matvec(x32, rows, w, format, out, (out_cols, col0))
            });
        }
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        if rows > QUANT_MATVEC_MAX_ROWS || col0 + w.rows > out_cols {
            return Err(bad(
                op,
                format!("{rows} rows into columns {col0}.. of {out_cols}"),
            ));
        }
        let Arg::Ptr(out_addr) = addr(op, out)? else {
            return Err(bad(op, "output address".to_string()));
        };
        let x_arg = addr(op, x)?;
        let out_arg = Arg::Ptr(out_addr + (col0 * 4) as u64);
        if format == QuantFormat::F8E4M3x128 {
            let Arg::Ptr(x_addr) = x_arg else {
                return Err(bad(op, "x address".to_string()));
            };
            let out = out_addr + (col0 * 4) as u64;
            return self.f8_matvec(x_addr, rows, (w_addr, w.rows, w.cols), out, out_cols);
        }
        self.with_quantized_acts(op, x_arg, (rows, w.cols), format, |acts| {
            self.quant_matvec_launch(
                acts,
                rows,
                (w_addr, w.rows, w.cols),
                (kernels, out_arg),
                out_cols,
            )
        })
    }

    /// The integer few-row product of quantized activations `acts` (with_quantized_acts') and
    /// the blocks at `w`, `n` rows of `k`, into `out` (rows `out_cols` apart).
    fn quant_matvec_launch(
        &self,
        [xq, xd, xs]: [Arg; 3],
        rows: usize,
        (w, n, k): (u64, usize, usize),
        (kernels, out): (&QuantKernels, Arg),
        out_cols: usize,
    ) -> Result<()> {
        let op = "matmul";
        let args = [
            xq,
            xd,
            xs,
            u32_of(op, rows)?,
            Arg::Ptr(w),
            u32_of(op, n)?,
            u32_of(op, k)?,
            out,
            u32_of(op, out_cols)?,
            self.diag(),
        ];
        let variant = rows.next_power_of_two().trailing_zeros() as usize;
        let grid = (grid_of(op, n.div_ceil(QMV_WARPS))?, 1, 1);
        self.launch(
            &kernels.matvec[variant],
            grid,
            (QMV_WARPS * 32) as u32,
            &args,
        )
    }

    /// A projection's parts stored apart, side by side in `out`'s rows of `out_cols`: few rows
    /// against integer block formats quantize x once for every part; anything else goes part
    /// by part.
    pub(crate) fn matmul_parts_into(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        (parts, cols): (&[(DeviceBuffer, usize)], usize),
        out: &mut DeviceBuffer,
        out_cols: usize,
    ) -> Result<()> {
        let op = "matmul_parts";
        let integer = |b: &DeviceBuffer| {
            quant_format(b.dtype())
                .is_some_and(|f| f != QuantFormat::F8E4M3x128 && self.reads_format(f))
        };
        let total: usize = parts.iter().map(|(_, n)| n).sum();
        if rows == 0
            || rows > QUANT_MATVEC_MAX_ROWS
            || x.dtype() != DType::F32
            || !parts.iter().all(|(b, _)| integer(b))
        {
            return corral_backend::matmul_parts_by_columns(
                self,
                x,
                rows,
                (parts, cols),
                out,
                out_cols,
            );
        }
        if total > out_cols {
            return Err(bad(
                op,
                format!("parts of {total} rows into {out_cols} columns"),
            ));
        }
        let Arg::Ptr(out_addr) = addr(op, out)? else {
            return Err(bad(op, "output address".to_string()));
        };
        let x_arg = addr(op, x)?;
        // x quantized once for each way the parts' formats read it (a Q4_K_M file's q, k and
        // v projections: Q4_K per super-block, Q6_K per 32 values).
        let formats = parts.iter().filter_map(|(b, _)| quant_format(b.dtype()));
        let (supers, blocks): (Vec<_>, Vec<_>) =
            formats.partition(|&f| corral_backend::quant::per_super_block(f));
        let run = |per_super: Option<[Arg; 3]>, per_block: Option<[Arg; 3]>| {
            let mut col0 = 0;
            for (b, n) in parts {
                let (w, dtype, _) = weight(op, WeightView::new(b, *n, cols)?)?;
                let format = quant_format(dtype)
                    .ok_or_else(|| bad(op, format!("weights of {dtype} are not blocks")))?;
                let acts = if corral_backend::quant::per_super_block(format) {
                    per_super
                } else {
                    per_block
                };
                let acts = acts.ok_or_else(|| bad(op, format!("no activations for {format:?}")))?;
                let kernels = self.kernels.for_quant(op, format)?;
                let out_arg = Arg::Ptr(out_addr + (col0 * 4) as u64);
                self.quant_matvec_launch(acts, rows, (w, *n, cols), (kernels, out_arg), out_cols)?;
                col0 += n;
            }
            Ok(())
        };
        let shape = (rows, cols);
        match (supers.first(), blocks.first()) {
            (Some(&s), Some(&b)) => self.with_quantized_acts(op, x_arg, shape, s, |sa| {
                self.with_quantized_acts(op, x_arg, shape, b, |ba| run(Some(sa), Some(ba)))
            }),
            (Some(&s), None) => {
                self.with_quantized_acts(op, x_arg, shape, s, |sa| run(Some(sa), None))
            }
            (None, Some(&b)) => {
                self.with_quantized_acts(op, x_arg, shape, b, |ba| run(None, Some(ba)))
            }
            (None, None) => Err(bad(op, "parts of no block format".to_string())),
        }
    }

    /// `out = x · wᵀ` for FP8 blocks on tensor cores (quant.cu's matvec_f8): a block per 16
    /// features stages x as scaled f16 in its shared memory, so rows go in groups whose staging
    /// fits; out's rows are `ld` apart.
    fn f8_matvec(
        &self,
        x: u64,
        rows: usize,
        (w, n, k): (u64, usize, usize),
        out: u64,
        ld: usize,
    ) -> Result<()> {
        let op = "matmul";
        let kernels = self.kernels.for_quant(op, QuantFormat::F8E4M3x128)?;
        let blocks = k / 128;
        let per_launch = F8_SMEM_BYTES as usize / f8_staged_bytes(blocks.max(1));
        if per_launch == 0 {
            return Err(bad(op, format!("FP8 rows of {k} values")));
        }
        // Variants: 2 or 4 of K's blocks in flight a warp (8 warps).
        let deep = usize::from(blocks > 2 * 8);
        let grid = (grid_of(op, n.div_ceil(16))?, 1, 1);
        for r0 in (0..rows).step_by(per_launch.min(QUANT_MATVEC_MAX_ROWS)) {
            let group = (rows - r0).min(per_launch);
            let args = [
                Arg::Ptr(x + (r0 * k * 4) as u64),
                u32_of(op, group)?,
                Arg::Ptr(w),
                u32_of(op, n)?,
                u32_of(op, k)?,
                Arg::Ptr(out + (r0 * ld * 4) as u64),
                u32_of(op, ld)?,
                self.diag(),
            ];
            let kernel = &kernels.matvec[deep];
            let smem = u32_of_usize(op, f8_staged_bytes(group * blocks))?;
            self.launch_sized(kernel, (grid, MVM_THREADS, smem), &args)?;
        }
        Ok(())
    }

    /// `rows × k` f32 activations at `x` quantized as products with `format` read them (per
    /// 32 values, or per super-block: quant.cu's quantize_q8, as the CPU quantizes them) into
    /// a pooled buffer, whose int8 values, half sums and scales `use_acts` then reads; the
    /// buffer goes back to the pool at once (later users queue behind `use_acts`'s work on the
    /// one stream).
    pub(super) fn with_quantized_acts(
        &self,
        op: &'static str,
        x: Arg,
        (rows, k): (usize, usize),
        format: QuantFormat,
        use_acts: impl FnOnce([Arg; 3]) -> Result<()>,
    ) -> Result<()> {
        let supers = corral_backend::quant::per_super_block(format);
        if !k.is_multiple_of(if supers { 256 } else { 32 }) {
            return Err(bad(op, format!("activations of {k} values a row")));
        }
        let blocks = rows * k / 32;
        // int8 values, then two i32 half sums and an f32 scale per 32 values.
        let words = rows * k / 4 + 3 * blocks;
        let acts = self.take_buffer(DType::U32, words.max(1), BufferUsage::Activations)?;
        let queued = ptr_of(op, &acts).and_then(|q| {
            let sums = q + (rows * k) as u64;
            let d = sums + 8 * blocks as u64;
            let args = [
                x,
                Arg::U64(blocks as u64),
                Arg::Ptr(q),
                Arg::Ptr(d),
                Arg::Ptr(sums),
                Arg::U32(u32::from(supers)),
            ];
            let grid = (grid_of(op, blocks.div_ceil(8))?, 1, 1);
            self.launch(&self.kernels.quantize_q8, grid, 256, &args)?;
            use_acts([Arg::Ptr(q), Arg::Ptr(d), Arg::Ptr(sums)])
        });
        self.give_buffer(acts);
        queued
    }

    /// Routed experts in block formats, one product per (token, expert) pair on integer
    /// units: x quantized once for gate/up (`formats.0`), the pairs' activations once for
    /// down (`formats.1`). `tables` are the gate, up and down pointer tables; `act` is
    /// `[pairs, intermediate]` scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quant_experts_per_token(
        &self,
        x: &DeviceBuffer,
        routing: corral_backend::MoeRouting<'_>,
        (gate_up_format, down_format): (QuantFormat, QuantFormat),
        [gate, up, down]: [Arg; 3],
        (num_experts, inter, hidden): (usize, usize, usize),
        act: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "moe_experts_per_token";
        let (tokens, top_k) = (routing.tokens, routing.top_k);
        let pairs = tokens * top_k;
        if !hidden.is_multiple_of(gate_up_format.block().0)
            || !inter.is_multiple_of(down_format.block().0)
        {
            return Err(bad(op, "expert rows of partial blocks".to_string()));
        }
        let ids = addr(op, routing.expert_ids)?;
        let weights = addr(op, routing.expert_weights)?;
        let act_arg = addr(op, act)?;
        let out_arg = addr(op, out)?;
        let x_arg = addr(op, x)?;
        let (gate_up_kernel, down_kernel) = (
            &self
                .kernels
                .for_quant(op, gate_up_format)?
                .per_token_gate_up,
            &self.kernels.for_quant(op, down_format)?.per_token_down,
        );
        // The kernels' arguments after their activations: x as it is (FP8) or quantized.
        let gate_up_tail = [
            u32_of(op, hidden)?,
            ids,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            gate,
            up,
            u32_of(op, inter)?,
            act_arg,
            self.diag(),
        ];
        let down_tail = [
            u32_of(op, inter)?,
            ids,
            weights,
            u32_of(op, top_k)?,
            u32_of(op, num_experts)?,
            down,
            u32_of(op, hidden)?,
            out_arg,
            self.diag(),
        ];
        let fp8 = [gate_up_format, down_format].map(|f| f == QuantFormat::F8E4M3x128);
        if fp8 == [true, true] {
            // Tensor cores, a block per 16 rows, staging its x (a token's row; a token's act
            // rows) as scaled f16 in shared memory.
            let smem = [hidden / 128, top_k * (inter / 128)].map(f8_staged_bytes);
            if smem.iter().any(|&b| b > F8_SMEM_BYTES as usize) {
                return Err(bad(
                    op,
                    format!("FP8 experts of {hidden} × {inter} at top {top_k}"),
                ));
            }
            let grid = (grid_of(op, inter.div_ceil(16) * pairs)?, 1, 1);
            let sized = (grid, MVM_THREADS, u32_of_usize(op, smem[0])?);
            self.launch_parts(gate_up_kernel, sized, [&[x_arg], &gate_up_tail])?;
            let blocks = hidden.div_ceil(16) * tokens;
            let wide = blocks <= self.gpu.multiprocessors.max(1) as usize;
            let threads = if wide {
                F8_DOWN_WIDE_THREADS
            } else {
                MVM_THREADS
            };
            let sized = (
                (grid_of(op, blocks)?, 1, 1),
                threads,
                u32_of_usize(op, smem[1])?,
            );
            return self.launch_parts(down_kernel, sized, [&[act_arg], &down_tail]);
        }
        if fp8 != [false, false] {
            return Err(bad(op, "FP8 experts beside block-format ones".to_string()));
        }
        self.with_quantized_acts(op, x_arg, (tokens, hidden), gate_up_format, |acts| {
            let grid = (grid_of(op, inter.div_ceil(8) * pairs)?, 1, 1);
            self.launch_parts(gate_up_kernel, (grid, 256, 0), [&acts, &gate_up_tail])
        })?;
        self.with_quantized_acts(op, act_arg, (pairs, inter), down_format, |acts| {
            let grid = (grid_of(op, hidden.div_ceil(8) * tokens)?, 1, 1);
            self.launch_parts(down_kernel, (grid, 256, 0), [&acts, &down_tail])
        })
    }

    /// `x · wᵀ` (any weight type) into columns `col0..col0 + w.rows` of `out`'s rows of
    /// `out_cols`: block-format few-row products write there directly; others go through a
    /// pooled copy.
    pub(crate) fn matmul_into_columns(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
        (out_cols, col0): (usize, usize),
    ) -> Result<()> {
        let op = "matmul_columns";
        if rows == 0 || w.rows == 0 {
            return Ok(());
        }
        if col0 + w.rows > out_cols {
            return Err(bad(
                op,
                format!("columns {col0}..{} of {out_cols}", col0 + w.rows),
            ));
        }
        if let Some(format) = quant_format(w.buffer.dtype())
            && rows <= QUANT_MATVEC_MAX_ROWS
        {
            return self.quant_matvec(x, rows, w, format, out, (out_cols, col0));
        }
        let dst = addr(op, out)?;
        let len = rows * w.rows;
        let mut part = self.take_buffer(DType::F32, len, BufferUsage::Activations)?;
        let queued = self.matmul(x, rows, w, &mut part).and_then(|()| {
            let args = [
                Arg::Ptr(ptr_of(op, &part)?),
                u32_of(op, rows)?,
                u32_of(op, w.rows)?,
                dst,
                u32_of(op, out_cols)?,
                u32_of(op, col0)?,
            ];
            self.launch(
                &self.kernels.copy_columns,
                Self::elementwise_grid(op, len)?,
                256,
                &args,
            )
        });
        self.give_buffer(part);
        queued
    }

    /// Rows `ids` of a block-format embedding table, decoded.
    pub(crate) fn quant_embedding(
        &self,
        table: WeightView<'_>,
        format: QuantFormat,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "embedding";
        let (w, _, _) = weight(op, table)?;
        let args = [
            Arg::Ptr(w),
            addr(op, ids)?,
            u32_of(op, tokens)?,
            u32_of(op, table.cols)?,
            u32_of(op, table.rows)?,
            addr(op, out)?,
            self.diag(),
        ];
        if tokens == 0 {
            return Ok(());
        }
        let k = &self.kernels.for_quant(op, format)?.embedding;
        self.launch(k, (grid_of(op, tokens)?, 1, 1), 128, &args)
    }

    /// Every value of a block-format matrix decoded into f32 `out` (what the GPU's products
    /// read, for tests against the CPU's decoder).
    pub fn dequantize_on_device(&self, w: WeightView<'_>, out: &mut DeviceBuffer) -> Result<()> {
        let op = "dequantize";
        corral_backend::whole_blocks(op, w)?;
        let (w_addr, dtype, _) = weight(op, w)?;
        let format = quant_format(dtype)
            .ok_or_else(|| bad(op, format!("weights of {dtype} are not blocks")))?;
        let len = w.rows * w.cols;
        let dst = buf(op, "out", out, DType::F32, len)?;
        self.dequantize_into(op, format, (w_addr, w.cols, len), dst, 0)
    }

    /// Queues the decode of the `len` values (rows of `cols`) of a block-format matrix at `w`
    /// into `dst`: f32 (`to` 0) or bf16 (1).
    fn dequantize_into(
        &self,
        op: &'static str,
        format: QuantFormat,
        (w, cols, len): (u64, usize, usize),
        dst: Arg,
        to: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let args = [
            Arg::Ptr(w),
            u32_of(op, cols)?,
            Arg::U64((len / 32) as u64),
            dst,
        ];
        let k = &self.kernels.for_quant(op, format)?.dequantize[to];
        self.launch(k, Self::elementwise_grid(op, len / 32)?, 256, &args)
    }

    /// Runs `f` on bf16 copies of `experts` whose projections `decode` (gate, up, down) hold
    /// the layer's experts that have sorted rows, decoded just before.
    pub(crate) fn with_decoded_experts<T>(
        &self,
        op: &'static str,
        experts: &ExpertWeights,
        sorted: MoeSorted<'_>,
        decode: [bool; 3],
        f: impl FnOnce(&ExpertWeights) -> Result<T>,
    ) -> Result<T> {
        let (num_experts, inter, hidden) = (
            experts.gate.num_experts(),
            experts.gate.rows(),
            experts.gate.cols(),
        );
        let shape = (num_experts, inter, hidden);
        let mut slot = self
            .decoded_experts
            .lock()
            .map_err(|_| bad(op, "the decoded experts' lock is poisoned".to_string()))?;
        if slot.as_ref().is_none_or(|d| d.shape != shape) {
            *slot = None;
            let matrices = |rows: usize, cols: usize| -> Result<ExpertMatrices> {
                let len = num_experts * rows * cols;
                let b = self.new_buffer(DType::BF16, len, BufferUsage::Weights)?;
                ExpertMatrices::stacked(Arc::new(b), num_experts, rows, 0, rows, cols)
            };
            *slot = Some(DecodedExperts {
                shape,
                weights: ExpertWeights {
                    gate: matrices(inter, hidden)?,
                    up: matrices(inter, hidden)?,
                    down: matrices(hidden, inter)?,
                },
            });
        }
        let decoded = slot
            .as_ref()
            .ok_or_else(|| bad(op, "no decoded experts".to_string()))?;
        let offsets = addr(op, sorted.expert_offsets)?;
        let pairs = [
            (&experts.gate, &decoded.weights.gate),
            (&experts.up, &decoded.weights.up),
            (&experts.down, &decoded.weights.down),
        ];
        for ((from, to), wanted) in pairs.into_iter().zip(decode) {
            if !wanted {
                continue;
            }
            let (table, dtype, _) = self.experts(op, from)?;
            let format = quant_format(dtype)
                .ok_or_else(|| bad(op, format!("experts of {dtype} are not blocks")))?;
            if from.rows() != to.rows() || from.cols() != to.cols() {
                return Err(bad(
                    op,
                    "expert projections of mismatched shapes".to_string(),
                ));
            }
            if !from.cols().is_multiple_of(format.block().0) {
                return Err(bad(op, format!("{dtype} rows of {} values", from.cols())));
            }
            let pieces = from.rows() * from.cols() / 32;
            let dst = to.view(0);
            let args = [
                table,
                offsets,
                u32_of(op, from.cols())?,
                Arg::U64(pieces as u64),
                Arg::Ptr(ptr_of(op, dst.buffer)?),
            ];
            let grid = (
                grid_of(op, pieces.div_ceil(256))?,
                grid_of(op, num_experts)?,
                1,
            );
            let k = &self.kernels.for_quant(op, format)?.dequantize_experts;
            self.launch(k, grid, 256, &args)?;
        }
        f(&decoded.weights)
    }
}
