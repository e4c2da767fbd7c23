//! Norms and elementwise ops. The CUDA backend's host halves: launches of the kernels beside
//! them, on arguments `dyn Backend`'s entries have checked.

use corral_backend::NormOps;

use crate::*;
impl NormOps for CudaBackend {
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
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            Arg::U32(offset_one as u32),
            addr(op, out)?,
        ];
        let kernels = [&self.kernels.rms_norm, &self.kernels.rms_norm_bf16];
        self.launch_norm(op, kernels, out.dtype(), (rows, dim), &args)
    }

    fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        let op = "add_in_place";
        if len == 0 {
            return Ok(());
        }
        let args = [addr(op, acc)?, addr(op, x)?, Arg::U64(len as u64)];
        self.launch(
            &self.kernels.add_in_place,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn add_rms_norm(
        &self,
        acc: &mut DeviceBuffer,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        rows: usize,
        dim: usize,
        eps: f32,
        offset_one: bool,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "add_rms_norm";
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, acc)?,
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            Arg::U32(offset_one as u32),
            addr(op, out)?,
        ];
        let kernels = [&self.kernels.add_rms_norm, &self.kernels.add_rms_norm_bf16];
        self.launch_norm(op, kernels, out.dtype(), (rows, dim), &args)
    }

    fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "silu_mul";
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, gate)?,
            addr(op, up)?,
            Arg::U64(len as u64),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.silu_mul,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
    }

    fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "sigmoid_mul";
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, gate)?,
            Arg::U64(len as u64),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.sigmoid_mul,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
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
        if rows * dim == 0 {
            return Ok(());
        }
        let args = [
            addr(op, acc)?,
            addr(op, x)?,
            addr(op, gate)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
        ];
        let grid = Self::elementwise_grid(op, rows * dim)?;
        self.launch(&self.kernels.add_sigmoid_gated, grid, 256, &args)
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
        if rows == 0 {
            return Ok(());
        }
        let args = [
            addr(op, x)?,
            addr(op, z)?,
            addr(op, weight)?,
            u32_of(op, rows)?,
            u32_of(op, dim)?,
            Arg::F32(eps),
            addr(op, out)?,
        ];
        self.launch(
            &self.kernels.gated_rms_norm,
            (grid_of(op, rows.div_ceil(8))?, 1, 1),
            256,
            &args,
        )
    }
}

impl CudaBackend {
    /// A row norm's launch: a block a row, its kernel by the output's type (`[f32, bf16]`).
    fn launch_norm(
        &self,
        op: &'static str,
        [f32_out, bf16_out]: [&Kernel; 2],
        out: DType,
        (rows, dim): (usize, usize),
        args: &[Arg],
    ) -> Result<()> {
        let kernel = if out == DType::BF16 {
            bf16_out
        } else {
            f32_out
        };
        self.launch(kernel, (grid_of(op, rows)?, 1, 1), norm_block(dim), args)
    }
}
