//! The hybrid families' checkpoint layouts normalised at load, so that one set of kernels
//! serves all three: Qwen3-Next's fused, key-head-grouped projections (`in_proj_qkvz`,
//! `in_proj_ba`) read as Qwen3.5's separate `in_proj_qkv`, `in_proj_z`, `in_proj_b` and
//! `in_proj_a`, and the per-head interleaved query/gate rows of the gated attention's
//! `q_proj` split in two.

use corral_backend::{Backend, DeviceBuffer};

use crate::Result;
use crate::weights::WeightSource;

/// `at..at + len` of each of `groups` groups of `stride` rows.
fn grouped_rows(groups: usize, stride: usize, at: usize, len: usize) -> Vec<usize> {
    (0..groups)
        .flat_map(|g| (0..len).map(move |i| g * stride + at + i))
        .collect()
}

/// The gated attention's query and gate projections from `q_proj` (`name`), whose rows
/// interleave per head `[query | gate]`, `head_dim` each, over `hidden` columns.
pub(crate) fn query_and_gate(
    src: &dyn WeightSource,
    backend: &dyn Backend,
    name: &str,
    (heads, head_dim, hidden): (usize, usize, usize),
) -> Result<(DeviceBuffer, DeviceBuffer)> {
    let shape = [heads * 2 * head_dim, hidden];
    Ok((
        src.weight_rows(
            backend,
            name,
            &shape,
            &grouped_rows(heads, 2 * head_dim, 0, head_dim),
        )?,
        src.weight_rows(
            backend,
            name,
            &shape,
            &grouped_rows(heads, 2 * head_dim, head_dim, head_dim),
        )?,
    ))
}

/// The shape of a Gated DeltaNet's input projections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeltaNetHeads {
    pub(crate) key_heads: usize,
    pub(crate) value_heads: usize,
    pub(crate) key_dim: usize,
    pub(crate) value_dim: usize,
    pub(crate) hidden: usize,
}

/// Whether the Gated DeltaNet under `prefix` (ending in `linear_attn.`) is stored fused, in
/// Qwen3-Next's layout.
pub(crate) fn fused_delta_net(src: &dyn WeightSource, prefix: &str) -> bool {
    src.contains(&format!("{prefix}in_proj_qkvz.weight"))
}

/// Qwen3-Next's fused input projections under `prefix` as Qwen3.5's: `(qkv, z, b, a)`. Per
/// key head g the fused rows are `[q_g | k_g | v_g | z_g]` and `[b_g | a_g]`.
pub(crate) fn unfused_delta_net(
    src: &dyn WeightSource,
    backend: &dyn Backend,
    prefix: &str,
    s: DeltaNetHeads,
) -> Result<(DeviceBuffer, DeviceBuffer, DeviceBuffer, DeviceBuffer)> {
    let (nk, dk, dv) = (s.key_heads, s.key_dim, s.value_dim);
    let r = s.value_heads / nk.max(1);
    let width = 2 * dk + 2 * r * dv;
    let qkvz = format!("{prefix}in_proj_qkvz.weight");
    let qkvz_shape = [nk * width, s.hidden];
    let mut qkv_rows = grouped_rows(nk, width, 0, dk);
    qkv_rows.extend(grouped_rows(nk, width, dk, dk));
    qkv_rows.extend(grouped_rows(nk, width, 2 * dk, r * dv));
    let z_rows = grouped_rows(nk, width, 2 * dk + r * dv, r * dv);
    let ba = format!("{prefix}in_proj_ba.weight");
    let ba_shape = [2 * s.value_heads, s.hidden];
    Ok((
        src.weight_rows(backend, &qkvz, &qkvz_shape, &qkv_rows)?,
        src.weight_rows(backend, &qkvz, &qkvz_shape, &z_rows)?,
        src.weight_rows(backend, &ba, &ba_shape, &grouped_rows(nk, 2 * r, 0, r))?,
        src.weight_rows(backend, &ba, &ba_shape, &grouped_rows(nk, 2 * r, r, r))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_rows_take_each_groups_slice() {
        assert_eq!(grouped_rows(3, 4, 1, 2), [1, 2, 5, 6, 9, 10]);
        assert!(grouped_rows(0, 4, 1, 2).is_empty());
    }
}
