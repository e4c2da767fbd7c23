//! Causal GQA attention over a paged KV cache, one work item per (token, head).

use rayon::prelude::*;

use super::{dot, with_scratch};

/// Plain-slice view of the batch metadata.
pub(crate) struct PagedLayout<'a> {
    pub(crate) positions: &'a [u32],
    pub(crate) token_runs: &'a [u32],
    pub(crate) block_tables: &'a [u32],
    pub(crate) max_blocks_per_run: usize,
    pub(crate) block_size: usize,
}

impl PagedLayout<'_> {
    /// Cache slot of position `pos` of run `run`.
    fn slot(&self, run: usize, pos: usize) -> usize {
        let block = self.block_tables[run * self.max_blocks_per_run + pos / self.block_size];
        block as usize * self.block_size + pos % self.block_size
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    q: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    layout: &PagedLayout<'_>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let group = num_heads / num_kv_heads;
    let kv_dim = num_kv_heads * head_dim;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(item, o)| {
            let (t, h) = (item / num_heads, item % num_heads);
            let run = layout.token_runs[t] as usize;
            let len = layout.positions[t] as usize + 1;
            let kv_off = (h / group) * head_dim;
            let qh = &q[item * head_dim..(item + 1) * head_dim];
            with_scratch(len, |scores| {
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    let base = layout.slot(run, j) * kv_dim + kv_off;
                    *s = dot(qh, &cache_k[base..base + head_dim]) * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                o.fill(0.0);
                for (j, s) in scores.iter().enumerate() {
                    let p = s * inv;
                    let base = layout.slot(run, j) * kv_dim + kv_off;
                    for (o, v) in o.iter_mut().zip(&cache_v[base..base + head_dim]) {
                        *o += p * v;
                    }
                }
            });
        });
}

/// The head layout of a fused `[tokens, (heads + 2 kv_heads) · head_dim]` q/k/v projection.
#[derive(Clone, Copy)]
pub(crate) struct FusedQkv {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rotary_dim: usize,
    pub(crate) theta: f32,
    pub(crate) eps: f32,
}

/// From a fused q/k/v projection: q per-head normalised and rotated into `q_out`, k
/// normalised and rotated and v as they are into the cache at each token's slot.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_norm_rope_store(
    qkv: &[f32],
    q_weight: &[f32],
    k_weight: &[f32],
    positions: &[u32],
    slots: &[u32],
    shape: FusedQkv,
    q_out: &mut [f32],
    cache_k: &mut [f32],
    cache_v: &mut [f32],
) {
    let FusedQkv {
        heads,
        kv_heads,
        head_dim: hd,
        rotary_dim,
        theta,
        eps,
    } = shape;
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let width = q_dim + 2 * kv_dim;
    let inv_freq = super::rope::inverse_frequencies(rotary_dim, theta);
    q_out
        .par_chunks_mut(q_dim)
        .zip(qkv.par_chunks(width))
        .zip(positions.par_iter())
        .for_each(|((q, row), &pos)| {
            for (dst, src) in q.chunks_mut(hd).zip(row[..q_dim].chunks(hd)) {
                super::norm::norm_row(src, q_weight, eps, false, dst);
            }
            super::rope::rotate_heads(q, pos, hd, rotary_dim, &inv_freq);
        });
    for ((row, &pos), &slot) in qkv.chunks(width).zip(positions).zip(slots) {
        let dst = slot as usize * kv_dim;
        let k = &mut cache_k[dst..dst + kv_dim];
        for (kh, src) in k.chunks_mut(hd).zip(row[q_dim..q_dim + kv_dim].chunks(hd)) {
            super::norm::norm_row(src, k_weight, eps, false, kh);
        }
        super::rope::rotate_heads(k, pos, hd, rotary_dim, &inv_freq);
        cache_v[dst..dst + kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
    }
}

pub(crate) fn kv_store(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    kv_dim: usize,
    cache_k: &mut [f32],
    cache_v: &mut [f32],
) {
    for (t, &slot) in slots.iter().enumerate() {
        let dst = slot as usize * kv_dim;
        cache_k[dst..dst + kv_dim].copy_from_slice(&k[t * kv_dim..(t + 1) * kv_dim]);
        cache_v[dst..dst + kv_dim].copy_from_slice(&v[t * kv_dim..(t + 1) * kv_dim]);
    }
}
