//! The ops: each family's host half here, its shaders beside it (`*.comp`). Every op is
//! one dispatch recorded into the stream; arguments come checked by `dyn Backend`'s entries.

mod attention;
mod copies;
mod matmul;
mod moe;
mod norms;
mod recurrent;
mod sampling;

use corral_backend::{BackendError, DType, Result};

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

/// A float weight type as `weight_at` in `common.glsl` takes it.
pub(crate) fn weight_type(op: &'static str, dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        other => Err(BackendError::BadArgument {
            op,
            detail: format!("weights of {other} (this backend reads f32, bf16 and f16 yet)"),
        }),
    }
}
