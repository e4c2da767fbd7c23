//! Copies: zeroing, gathers, the embedding lookup, KV blocks. The CUDA backend's host halves:
//! launches of the kernels beside them, on arguments `dyn Backend`'s entries have checked.

use corral_backend::CopyOps;

use crate::*;
impl CopyOps for CudaBackend {
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
}
