//! Norms and elementwise ops. The CPU backend's entries: the computations in `ops/` on
//! arguments `dyn Backend`'s entries have checked.

use corral_backend::NormOps;

use crate::*;
impl NormOps for CpuBackend {
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
        let x = read_f32(op, x, rows * dim)?;
        let weight = read_f32(op, weight, dim)?;
        let out = write_f32(op, out, rows * dim)?;
        self.stats.dispatch(1);
        ops::norm::rms_norm(x, weight, dim, eps, offset_one, out);
        Ok(())
    }

    fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        let op = "add_in_place";
        let x = read_f32(op, x, len)?;
        let acc = write_f32(op, acc, len)?;
        self.stats.dispatch(1);
        ops::elementwise::add_in_place(acc, x);
        Ok(())
    }

    fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "silu_mul";
        let gate = read_f32(op, gate, len)?;
        let up = read_f32(op, up, len)?;
        let out = write_f32(op, out, len)?;
        self.stats.dispatch(1);
        ops::elementwise::silu_mul(gate, up, out);
        Ok(())
    }

    fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "sigmoid_mul";
        let x = read_f32(op, x, len)?;
        let gate = read_f32(op, gate, len)?;
        let out = write_f32(op, out, len)?;
        self.stats.dispatch(1);
        ops::elementwise::sigmoid_mul(x, gate, out);
        Ok(())
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
        let x = read_f32(op, x, rows * dim)?;
        let gate = read_f32(op, gate, rows)?;
        let acc = write_f32(op, acc, rows * dim)?;
        self.stats.dispatch(1);
        ops::elementwise::add_sigmoid_gated(acc, x, gate, dim);
        Ok(())
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
        let x = read_f32(op, x, rows * dim)?;
        let z = read_f32(op, z, rows * dim)?;
        let weight = read_f32(op, weight, dim)?;
        let out = write_f32(op, out, rows * dim)?;
        self.stats.dispatch(1);
        ops::delta_net::gated_rms_norm(x, z, weight, dim, eps, out);
        Ok(())
    }
}
