//! Copies (`fill_zero.comp`, `embedding.comp`, `gather_rows.comp`, `copy_blocks.comp`).

use corral_backend::{BackendError, CopyOps, DType, DeviceBuffer, Result, WeightView};

use super::{grid_of, weight_type};
use crate::VulkanBackend;
use crate::args::{Args, address};

/// The unit a copy moves: 32-bit words where every byte count is whole words, else 16-bit
/// halves (bf16 elements at odd offsets).
#[derive(Clone, Copy)]
struct Unit(usize);

impl Unit {
    /// The largest unit dividing the byte counts of every one of `elems` of `dtype`.
    fn of(op: &'static str, dtype: DType, elems: &[usize]) -> Result<Self> {
        let bytes = |e: &usize| dtype.bytes_of(*e);
        [4, 2]
            .into_iter()
            .find(|u| elems.iter().all(|e| bytes(e).is_multiple_of(*u)))
            .map(Self)
            .ok_or_else(|| BackendError::BadArgument {
                op,
                detail: format!(
                    "elements of {dtype} copied by bytes (this backend moves 16 or 32 bits)"
                ),
            })
    }

    /// Units in `elems` elements of `dtype`.
    fn count(self, dtype: DType, elems: usize) -> usize {
        dtype.bytes_of(elems) / self.0
    }
}

/// One side of a block copy: the address of its block 0, the ids of its blocks (block `b`
/// where none), and how many blocks it holds.
type Side<'a> = (u64, Option<&'a DeviceBuffer>, usize);

impl VulkanBackend {
    /// `count` blocks of `block_units` units from `src` to `dst`, ids checked against the
    /// blocks each side holds.
    fn copy_blocks(
        &self,
        op: &'static str,
        (src, src_ids, src_blocks): Side<'_>,
        (dst, dst_ids, dst_blocks): Side<'_>,
        count: usize,
        (unit, block_units): (Unit, usize),
    ) -> Result<()> {
        let ids = |b: Option<&DeviceBuffer>| b.map_or(Ok(0), |b| address(op, b));
        let len = count * block_units;
        let args = Args::new(op)
            .address(src)?
            .address(dst)?
            .address(ids(src_ids)?)?
            .address(ids(dst_ids)?)?
            .address(self.fault.address())?
            .count(len)?
            .count(block_units)?
            .count(src_blocks)?
            .count(dst_blocks)?
            .count(usize::from(unit.0 == 2))?;
        self.dispatch("copy_blocks", grid_of(op, len)?, &args)
    }
}

impl CopyOps for VulkanBackend {
    fn fill_zero(&self, buffer: &mut DeviceBuffer, len: usize) -> Result<()> {
        let op = "fill_zero";
        let len = Unit::of(op, buffer.dtype(), &[len])?.count(buffer.dtype(), len);
        let args = Args::new(op).buf(buffer)?.count(len)?;
        self.dispatch(op, grid_of(op, len)?, &args)
    }

    fn embedding(
        &self,
        table: WeightView<'_>,
        ids: &DeviceBuffer,
        tokens: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "embedding";
        let len = tokens * table.cols;
        let args = Args::new(op)
            .address(address(op, table.buffer)?)?
            .buf(ids)?
            .buf(out)?
            .address(self.fault.address())?
            .count(len)?
            .count(table.cols)?
            .count(table.rows)?
            .count(weight_type(op, table.buffer.dtype())?)?
            .count(table.offset)?;
        self.dispatch(op, grid_of(op, len)?, &args)
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
        let len = num_rows * dim;
        let args = Args::new(op)
            .buf(x)?
            .buf(row_ids)?
            .buf(out)?
            .address(self.fault.address())?
            .count(len)?
            .count(dim)?
            .count(x.len() / dim.max(1))?;
        self.dispatch(op, grid_of(op, len)?, &args)
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
        let unit = Unit::of(op, paged.dtype(), &[block_elems])?;
        self.copy_blocks(
            op,
            (
                address(op, paged)?,
                Some(ids),
                paged.len() / block_elems.max(1),
            ),
            (address(op, packed)?, None, count),
            count,
            (unit, unit.count(paged.dtype(), block_elems)),
        )
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
        let unit = Unit::of(op, paged.dtype(), &[block_elems])?;
        self.copy_blocks(
            op,
            (address(op, packed)?, None, count),
            (
                address(op, paged)?,
                Some(ids),
                paged.len() / block_elems.max(1),
            ),
            count,
            (unit, unit.count(paged.dtype(), block_elems)),
        )
    }

    fn copy_within(&self, x: &mut DeviceBuffer, src: usize, dst: usize, len: usize) -> Result<()> {
        let op = "copy_within";
        let dtype = x.dtype();
        let base = address(op, x)?;
        let unit = Unit::of(op, dtype, &[src, dst, len])?;
        let at = |elem| base + dtype.bytes_of(elem) as u64;
        self.copy_blocks(
            op,
            (at(src), None, 1),
            (at(dst), None, 1),
            1,
            (unit, unit.count(dtype, len)),
        )
    }
}
