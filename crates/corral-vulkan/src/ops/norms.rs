//! Norms and elementwise ops (`rms_norm.comp`, `add_rms_norm.comp`, `gated_rms_norm.comp`,
//! `add_in_place.comp`, `silu_mul.comp`, `sigmoid_mul.comp`, `add_sigmoid_gated.comp`).

use corral_backend::{DeviceBuffer, NormOps, Result};

use super::{grid, grid_of};
use crate::VulkanBackend;
use crate::args::Args;

/// The arguments the RMSNorm shaders share after their inputs: the weight, the output, the
/// row width, epsilon, whether the weight is offset by one, and the rows.
fn norm_args(
    args: Args,
    weight: &DeviceBuffer,
    out: &DeviceBuffer,
    (rows, dim): (usize, usize),
    eps: f32,
    offset_one: bool,
) -> Result<Args> {
    args.buf(weight)?
        .buf(out)?
        .count(dim)?
        .float(eps)?
        .count(usize::from(offset_one))?
        .count(rows)
}

impl NormOps for VulkanBackend {
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
        let args = Args::new(op).buf(x)?;
        let args = norm_args(args, weight, out, (rows, dim), eps, offset_one)?;
        self.dispatch(op, grid(op, rows)?, &args)
    }

    fn add_in_place(&self, acc: &mut DeviceBuffer, x: &DeviceBuffer, len: usize) -> Result<()> {
        let op = "add_in_place";
        let args = Args::new(op).buf(acc)?.buf(x)?.count(len)?;
        self.dispatch(op, grid_of(op, len)?, &args)
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
        let args = Args::new(op).buf(acc)?.buf(x)?;
        let args = norm_args(args, weight, out, (rows, dim), eps, offset_one)?;
        self.dispatch(op, grid(op, rows)?, &args)
    }

    fn silu_mul(
        &self,
        gate: &DeviceBuffer,
        up: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "silu_mul";
        let args = Args::new(op).buf(gate)?.buf(up)?.buf(out)?.count(len)?;
        self.dispatch(op, grid_of(op, len)?, &args)
    }

    fn sigmoid_mul(
        &self,
        x: &DeviceBuffer,
        gate: &DeviceBuffer,
        len: usize,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "sigmoid_mul";
        let args = Args::new(op).buf(x)?.buf(gate)?.buf(out)?.count(len)?;
        self.dispatch(op, grid_of(op, len)?, &args)
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
        let args = Args::new(op)
            .buf(acc)?
            .buf(x)?
            .buf(gate)?
            .count(rows * dim)?
            .count(dim)?;
        self.dispatch(op, grid_of(op, rows * dim)?, &args)
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
        let args = Args::new(op)
            .buf(x)?
            .buf(z)?
            .buf(weight)?
            .buf(out)?
            .count(dim)?
            .float(eps)?
            .count(rows)?;
        self.dispatch(op, grid(op, rows)?, &args)
    }
}
