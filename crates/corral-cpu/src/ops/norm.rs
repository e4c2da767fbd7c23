//! RMSNorm over rows, with a plain or a zero-centred `(1 + w)` weight.

use rayon::prelude::*;

pub(crate) fn rms_norm(
    x: &[f32],
    weight: &[f32],
    dim: usize,
    eps: f32,
    offset_one: bool,
    out: &mut [f32],
) {
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(dim))
        .for_each(|(o, xr)| norm_row(xr, weight, eps, offset_one, o));
}

/// One row of [`rms_norm`].
pub(crate) fn norm_row(x: &[f32], weight: &[f32], eps: f32, offset_one: bool, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        let w = if offset_one { 1.0 + w } else { *w };
        *o = v * inv * w;
    }
}
