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
