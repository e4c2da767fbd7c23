//! The ops: each family's host half here, its shaders beside it (`*.comp`). Every op is
//! one dispatch recorded into the stream; arguments come checked by `dyn Backend`'s entries.

mod attention;
mod copies;
mod matmul;
mod moe;
mod norms;
mod recurrent;
mod sampling;

use corral_backend::{BackendError, DType, QuantFormat, Result};

use crate::VulkanBackend;

/// Workgroups per dimension a dispatch may have (Vulkan guarantees 65535).
const MAX_GROUPS: usize = 65_535;

/// A dispatch of `groups` workgroups, laid out as `flat_group()` in `common.glsl` reads
/// them: `[min(groups, 65535), ceil(groups / 65535), 1]`.
pub(crate) fn grid(op: &'static str, groups: usize) -> Result<[u32; 3]> {
    let y = groups.div_ceil(MAX_GROUPS);
    if y > MAX_GROUPS {
        return Err(BackendError::BadArgument {
            op,
            detail: format!("{groups} workgroups are past what one dispatch covers"),
        });
    }
    Ok([groups.min(MAX_GROUPS) as u32, y as u32, 1])
}

/// Workgroups of 256 invocations covering `n` items, as [`grid`] lays them out.
pub(crate) fn grid_of(op: &'static str, n: usize) -> Result<[u32; 3]> {
    grid(op, n.div_ceil(256))
}

pub(crate) use recurrent::DELTA_SCRATCH_BYTES;

/// The block formats the shaders read (`blocks.glsl`): all of them, their type codes in
/// [`QuantFormat::ALL`]'s order.
pub(crate) const BLOCK_FORMATS: [QuantFormat; 9] = QuantFormat::ALL;

/// A weight type as `weight_at` in `common.glsl` takes it: the float types, then the block
/// formats from 3.
pub(crate) fn weight_type(op: &'static str, dtype: DType) -> Result<usize> {
    let block = match dtype {
        DType::F32 => return Ok(0),
        DType::BF16 => return Ok(1),
        DType::F16 => return Ok(2),
        DType::Quant(format) => BLOCK_FORMATS.iter().position(|&f| f == format),
        DType::U32 | DType::F8E4M3 => None,
    };
    block
        .map(|i| 3 + i)
        .ok_or_else(|| BackendError::BadArgument {
            op,
            detail: format!("weights of {dtype}"),
        })
}

impl VulkanBackend {
    /// Workgroups for `items` outputs of the kernels whose teams each compute one
    /// (`teams.glsl`: workgroups of 128 invocations, teams of the device's team size).
    pub(crate) fn teams(&self, op: &'static str, items: usize) -> Result<[u32; 3]> {
        let per_group = (128 / self.device.team_size()) as usize;
        grid(op, items.div_ceil(per_group))
    }
}
