//! Projections: few rows (`matmul_rows.comp`) reading each weight once for them all, more
//! in tiles (`matmul.comp`); weights of any float type or block format.

use corral_backend::{DeviceBuffer, MatmulOps, Result, WeightView};

use super::{grid, weight_type};
use crate::VulkanBackend;
use crate::args::{Args, address};

/// Rows of x up to which a product reads each weight once for all of them
/// (`matmul_rows.comp`, its `ROWS`); more take the tiles of `matmul.comp`.
const MATMUL_ROWS_MAX: usize = 8;

impl MatmulOps for VulkanBackend {
    fn matmul(
        &self,
        x: &DeviceBuffer,
        rows: usize,
        w: WeightView<'_>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        self.matmul_columns(x, rows, w, out, w.rows, 0)
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
        let op = "matmul";
        let args = Args::new(op)
            .buf(x)?
            .address(address(op, w.buffer)?)?
            .buf(out)?
            .count(w.rows)?
            .count(w.cols)?
            .count(out_cols)?
            .count(col0)?
            .count(weight_type(op, w.buffer.dtype())?)?
            .count(w.offset)?
            .count(rows)?;
        if rows <= MATMUL_ROWS_MAX {
            return self.dispatch("matmul_rows", self.teams(op, w.rows)?, &args);
        }
        // Tiles of 64 rows by 64 outputs (`TILE` of tiles.glsl).
        let tiles = rows.div_ceil(64) * w.rows.div_ceil(64);
        self.dispatch(op, grid(op, tiles)?, &args)
    }
}
