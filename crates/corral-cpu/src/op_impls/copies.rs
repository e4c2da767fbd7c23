//! Copies: zeroing, gathers, the embedding lookup, KV blocks. The CPU backend's entries: the
//! computations in `ops/` on arguments `dyn Backend`'s entries have checked.

use corral_backend::CopyOps;

use crate::*;
impl CopyOps for CpuBackend {
    fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()> {
        write_f32("fill_zero", buffer, len)?.fill(0.0);
        self.stats.dispatch(1);
        Ok(())
    }

    fn embedding(
        &self,
        table: WeightView<'_>,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "embedding";
        let ids = read_u32(op, ids, tokens)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(bad(
                op,
                format!("token id {id} is out of range for {} rows", table.rows),
            ));
        }
        let out = write_f32(op, out, tokens * table.cols)?;
        let rows = weight_rows(op, table.buffer)?;
        self.stats.dispatch(1);
        ops::elementwise::embedding(rows, table.offset, ids, table.cols, out);
        Ok(())
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
        let rows = read_u32(op, row_ids, num_rows)?;
        let available = x.len() / dim.max(1);
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= available) {
            return Err(bad(
                op,
                format!("row {r} is out of range for {available} rows"),
            ));
        }
        let x = read_f32(op, x, available * dim)?;
        let out = write_f32(op, out, num_rows * dim)?;
        self.stats.dispatch(1);
        ops::elementwise::gather_rows(x, rows, dim, out);
        Ok(())
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
        let ids = block_ids(op, ids, count, blocks)?;
        copy_blocks(op, paged, packed, &ids, block_elems, true)?;
        self.stats.dispatch(1);
        Ok(())
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
        let ids = block_ids(op, ids, count, blocks)?;
        copy_blocks(op, packed, paged, &ids, block_elems, false)?;
        self.stats.dispatch(1);
        Ok(())
    }

    fn copy_within(&self, x: &mut DeviceBuffer, src: usize, dst: usize, len: usize) -> Result<()> {
        let op = "copy_within";
        match x.storage_mut() {
            Storage::F32(v) => v.copy_within(src..src + len, dst),
            Storage::U32(v) => v.copy_within(src..src + len, dst),
            Storage::Half(v) => v.copy_within(src..src + len, dst),
            _ => return Err(bad(op, "`x` is not writable".to_string())),
        }
        self.stats.dispatch(1);
        Ok(())
    }
}
