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

/// Consecutive tokens of one run that one work item of [`paged_attention`] takes, with all
/// the query heads of a KV head: each K and V row is read once for all of them.
const TILE_TOKENS: usize = 8;

/// Causal GQA attention over the paged cache. A work item is (up to [`TILE_TOKENS`] tokens
/// of one run, one KV head): every key row it reads meets each of its tokens' query heads of
/// that group, then every value row each of their outputs. Per (token, head) the arithmetic
/// is the plain loop's, in the same order: scores by one dot product each, softmax, values
/// summed in key order.
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
    let tokens = layout
        .positions
        .len()
        .min(out.len() / (num_heads * head_dim).max(1));
    let mut tiles = Vec::new();
    let mut t0 = 0;
    while t0 < tokens {
        let run = layout.token_runs[t0];
        let mut t1 = t0 + 1;
        while t1 < tokens && t1 - t0 < TILE_TOKENS && layout.token_runs[t1] == run {
            t1 += 1;
        }
        tiles.push((t0, t1));
        t0 = t1;
    }
    let items: Vec<(usize, usize, usize)> = tiles
        .iter()
        .flat_map(|&(t0, t1)| (0..num_kv_heads).map(move |kvh| (t0, t1, kvh)))
        .collect();
    let avx2 = has_avx2();
    let results: Vec<Vec<f32>> = items
        .par_iter()
        .map(|&(t0, t1, kvh)| {
            let tile = Tile {
                t0,
                t1,
                kvh,
                group,
                num_heads,
                head_dim,
                kv_dim,
                scale,
            };
            let longest = (t0..t1)
                .map(|t| layout.positions[t] as usize + 1)
                .max()
                .unwrap_or(0);
            with_scratch((t1 - t0) * group * longest, |scores| {
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU has AVX2 (has_avx2 checked it).
                    #[allow(unsafe_code)]
                    return unsafe { attend_tile_avx2(&tile, q, cache_k, cache_v, layout, scores) };
                }
                attend_tile(&tile, q, cache_k, cache_v, layout, scores)
            })
        })
        .collect();
    for (&(t0, t1, kvh), o) in items.iter().zip(&results) {
        for r in 0..(t1 - t0) * group {
            let item = (t0 + r / group) * num_heads + kvh * group + r % group;
            out[item * head_dim..(item + 1) * head_dim]
                .copy_from_slice(&o[r * head_dim..(r + 1) * head_dim]);
        }
    }
}

/// One work item of [`paged_attention`]: tokens `t0..t1` of one run, KV head `kvh`.
struct Tile {
    t0: usize,
    t1: usize,
    kvh: usize,
    group: usize,
    num_heads: usize,
    head_dim: usize,
    kv_dim: usize,
    scale: f32,
}

/// Whether the CPU runs AVX2 (the attention loops are compiled for it too, and picked at run
/// time: the build targets the baseline x86-64).
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`attend_tile`] compiled for AVX2: the same operations in the same order, eight lanes
/// wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_tile_avx2(
    tile: &Tile,
    q: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    layout: &PagedLayout<'_>,
    scores: &mut [f32],
) -> Vec<f32> {
    attend_tile(tile, q, cache_k, cache_v, layout, scores)
}

/// The outputs of a tile's query rows (row r: token t0 + r / group, head kvh · group + r %
/// group), with `scores` as room for each row's scores over the tile's longest run.
#[inline(always)]
fn attend_tile(
    tile: &Tile,
    q: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    layout: &PagedLayout<'_>,
    scores: &mut [f32],
) -> Vec<f32> {
    let &Tile {
        t0,
        t1,
        kvh,
        group,
        num_heads,
        head_dim,
        kv_dim,
        scale,
    } = tile;
    let run = layout.token_runs[t0] as usize;
    let rows = (t1 - t0) * group;
    let longest = scores.len() / rows.max(1);
    let kv_off = kvh * head_dim;
    let len = |r: usize| layout.positions[t0 + r / group] as usize + 1;
    let q_at = |r: usize| ((t0 + r / group) * num_heads + kvh * group + r % group) * head_dim;
    let mut o = vec![0.0f32; rows * head_dim];
    for j in 0..longest {
        let base = layout.slot(run, j) * kv_dim + kv_off;
        let k = &cache_k[base..base + head_dim];
        for r in 0..rows {
            if j < len(r) {
                scores[r * longest + j] = dot(&q[q_at(r)..q_at(r) + head_dim], k) * scale;
            }
        }
    }
    let mut inv = vec![0.0f32; rows];
    for (r, inv) in inv.iter_mut().enumerate() {
        let s = &mut scores[r * longest..r * longest + len(r)];
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        *inv = 1.0 / sum;
    }
    for j in 0..longest {
        let base = layout.slot(run, j) * kv_dim + kv_off;
        let v = &cache_v[base..base + head_dim];
        for r in 0..rows {
            if j < len(r) {
                let p = scores[r * longest + j] * inv[r];
                for (o, v) in o[r * head_dim..(r + 1) * head_dim].iter_mut().zip(v) {
                    *o += p * v;
                }
            }
        }
    }
    o
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
