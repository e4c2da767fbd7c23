//! Projections. The CPU backend's entries: the computations in `ops/` on arguments `dyn
//! Backend`'s entries have checked.

use corral_backend::MatmulOps;

use crate::*;
impl MatmulOps for CpuBackend {
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
        let op = "matmul_columns";
        let x = read_f32(op, x, rows * w.cols)?;
        let out = write_f32(op, out, rows * out_cols)?;
        let weights = weight_rows(op, w.buffer)?.slice(w.offset, w.rows * w.cols);
        self.stats.dispatch(1);
        self.stats
            .weight_read(w.buffer.dtype().bytes_of(w.rows * w.cols));
        let columns = ops::matmul::Columns {
            ld: out_cols,
            first: col0,
        };
        ops::matmul::matmul(x, rows, w.cols, weights, w.rows, out, columns, self.threads);
        Ok(())
    }
}
