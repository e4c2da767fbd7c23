//! Projections. The CPU backend's entries: checked arguments to the computations in `ops/`.

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
        if col0 + w.rows > out_cols {
            return Err(bad(
                op,
                format!("columns {col0}..{} of rows {out_cols} wide", col0 + w.rows),
            ));
        }
        let x = f32s(op, "x", x, rows * w.cols)?;
        let out = f32s_mut(op, "out", out, rows * out_cols)?;
        check_blocks(op, w.buffer.dtype(), w.offset, w.cols)?;
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
