//! Projections. The CUDA backend's host halves: launches of the kernels beside them, on
//! arguments `dyn Backend`'s entries have checked.

use corral_backend::MatmulOps;

use crate::*;
impl MatmulOps for CudaBackend {
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
            addr(op, x)?,
            u32_of(op, rows)?,
            Arg::Ptr(w_addr),
            u32_of(op, w.rows)?,
            u32_of(op, w.cols)?,
            Arg::U32(vec as u32),
            addr(op, out)?,
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
            targets.push((w_addr, w.rows, ptr_of(op, out)?));
        }
        let weight_bytes: usize = weights.iter().map(|w| w.rows * w.cols * 2).sum();
        self.blas_projections(blas, x, (rows, cols), &targets, weight_bytes as u64)
    }
}

impl CudaBackend {
    /// `len` values of `dtype` in a pooled buffer, filled by `convert` (given its address)
    /// and then read by `use_copy`; the buffer goes back to the pool at once (later users
    /// queue behind `use_copy`'s work on the one stream).
    pub(crate) fn with_converted_copy(
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
    pub(crate) fn with_bf16_copy(
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
    pub(crate) fn blas_projections(
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
            addr(op, x)?;
            self.stats.weight_read(weight_bytes as usize);
            return gemms(ptr_of(op, x)?);
        }
        let x_arg = addr(op, x)?;
        self.with_bf16_copy(op, x_arg, rows * cols, weight_bytes, gemms)
    }

    /// Widens bf16 `x` (`len` values) to f32 in a pooled buffer and runs `use_copy` on it, for
    /// an op without a bf16-input form.
    pub(crate) fn with_f32_copy(
        &self,
        op: &'static str,
        x: &DeviceBuffer,
        len: usize,
        use_copy: impl FnOnce(&DeviceBuffer) -> Result<()>,
    ) -> Result<()> {
        let x_arg = addr(op, x)?;
        let convert = |x32_ptr| {
            let args = [x_arg, Arg::U64(len as u64), Arg::Ptr(x32_ptr)];
            let grid = Self::elementwise_grid(op, len.div_ceil(4))?;
            self.launch(&self.kernels.to_f32, grid, 256, &args)
        };
        self.with_converted_copy(op, (DType::F32, len), convert, use_copy)
    }
}
