//! Causal GQA attention over a paged KV cache, one work item per (tile of tokens, KV head).

use rayon::prelude::*;

use super::matmul::OutPtr;
use super::{dot, with_reused, with_scratch};

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

/// A layer's paged K or V cache as the CPU keeps it: f32, or bf16 bit patterns.
#[derive(Clone, Copy)]
pub(crate) enum KvRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl KvRows<'_> {
    /// Elements `base..base + dst.len()` as f32.
    fn read(&self, base: usize, dst: &mut [f32]) {
        match self {
            KvRows::F32(v) => dst.copy_from_slice(&v[base..base + dst.len()]),
            KvRows::Bf16(v) => {
                let len = dst.len();
                for (d, &b) in dst.iter_mut().zip(&v[base..base + len]) {
                    *d = f32::from_bits((b as u32) << 16);
                }
            }
        }
    }
}

/// A layer's paged K or V cache, to be written.
pub(crate) enum KvRowsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl KvRowsMut<'_> {
    /// `src` into elements `base..base + src.len()` (bf16 rounded to nearest, ties to even).
    fn write(&mut self, base: usize, src: &[f32]) {
        match self {
            KvRowsMut::F32(v) => v[base..base + src.len()].copy_from_slice(src),
            KvRowsMut::Bf16(v) => {
                for (d, &x) in v[base..base + src.len()].iter_mut().zip(src) {
                    *d = half::bf16::from_f32(x).to_bits();
                }
            }
        }
    }
}

/// Consecutive tokens of one run that one work item of [`paged_attention`] takes at least,
/// with all the query heads of a KV head: each K and V row is read once for all of them.
const TILE_TOKENS: usize = 8;

/// Most tokens of one run a work item takes: a tile gathers every key block of its run, so
/// fewer, larger tiles of a long run gather less and call larger GEMMs.
const MAX_TILE_TOKENS: usize = 64;

/// Tokens of a run of `run_tokens` that each of its work items takes: as many as still
/// leave two items for each of `threads` (over `num_kv_heads` heads), within
/// [`TILE_TOKENS`]..=[`MAX_TILE_TOKENS`].
fn tile_tokens(run_tokens: usize, num_kv_heads: usize, threads: usize) -> usize {
    (run_tokens * num_kv_heads / (2 * threads).max(1)).clamp(TILE_TOKENS, MAX_TILE_TOKENS)
}

/// Query rows of a tile from which its scores and outputs are GEMM calls over blocks of keys
/// (below it, the FMA loops, which read each key once without packing it: decode rows).
const GEMM_MIN_QUERY_ROWS: usize = 16;

/// Keys a GEMM tile takes at once (its online softmax rescales between blocks): K and V of
/// 256 keys at head dim 128 stay in L2.
const KEY_BLOCK: usize = 256;

/// Which loops [`attention_with`] runs.
#[derive(Clone, Copy, Debug)]
struct Loops {
    /// AVX2 and FMA where the CPU has them.
    simd: bool,
    /// Tiles of at least this many query rows take the GEMM path.
    gemm_min_rows: usize,
    /// Keys per block of the GEMM path.
    key_block: usize,
    /// Tokens of a run per work item; `None`: [`tile_tokens`]'s choice.
    tile_tokens: Option<usize>,
    /// A bf16 cache's GEMM-sized tiles take AVX-512 BF16 dot products (where the CPU has
    /// them, at head dims of a multiple of 32).
    bf16_dot: bool,
}

/// Causal GQA attention over the paged cache. A work item is (up to [`TILE_TOKENS`] tokens
/// of one run, one KV head): every key row it reads meets each of its tokens' query heads of
/// that group, then every value row each of their outputs. A tile of a few rows (decode)
/// runs loops of one dot product per score, softmax, and values summed in key order, on AVX2
/// and FMA where the CPU has them; a larger one (prefill) runs GEMM calls over blocks of
/// keys with an online softmax. A bf16 cache's rows are widened to f32 as they are read
/// (without AVX2, every tile takes the GEMM calls).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    q: &[f32],
    cache_k: KvRows<'_>,
    cache_v: KvRows<'_>,
    layout: &PagedLayout<'_>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    let shape = (num_heads, num_kv_heads, head_dim, scale);
    let loops = Loops {
        simd: has_avx2_fma(),
        gemm_min_rows: GEMM_MIN_QUERY_ROWS,
        key_block: KEY_BLOCK,
        tile_tokens: None,
        bf16_dot: true,
    };
    attention_with(loops, q, cache_k, cache_v, layout, shape, out);
}

/// [`paged_attention`] with the given loops.
fn attention_with(
    loops: Loops,
    q: &[f32],
    cache_k: KvRows<'_>,
    cache_v: KvRows<'_>,
    layout: &PagedLayout<'_>,
    (num_heads, num_kv_heads, head_dim, scale): (usize, usize, usize, f32),
    out: &mut [f32],
) {
    let tokens = layout
        .positions
        .len()
        .min(out.len() / (num_heads * head_dim).max(1));
    let threads = rayon::current_num_threads();
    with_reused(&ITEMS, |items| {
        items.clear();
        let mut t0 = 0;
        while t0 < tokens {
            let run = layout.token_runs[t0];
            let mut end = t0 + 1;
            while end < tokens && layout.token_runs[end] == run {
                end += 1;
            }
            let per = loops
                .tile_tokens
                .unwrap_or_else(|| tile_tokens(end - t0, num_kv_heads, threads))
                .max(1);
            while t0 < end {
                let t1 = (t0 + per).min(end);
                items.extend((0..num_kv_heads).map(|kvh| (t0, t1, kvh)));
                t0 = t1;
            }
        }
        let shape = (num_heads, num_kv_heads, head_dim, scale);
        attend_items(loops, q, (cache_k, cache_v), layout, shape, items, out);
    });
}

thread_local! {
    /// The work items of an attention op, reused.
    static ITEMS: std::cell::RefCell<Vec<(usize, usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A work item's buffers, reused.
    static TILE_BUFFERS: std::cell::RefCell<TileBuffers> = std::cell::RefCell::default();
}

/// The (tokens `t0..t1`, KV head) work items of [`attention_with`], each tile's outputs
/// written into `out` at its rows.
fn attend_items(
    loops: Loops,
    q: &[f32],
    (cache_k, cache_v): (KvRows<'_>, KvRows<'_>),
    layout: &PagedLayout<'_>,
    (num_heads, num_kv_heads, head_dim, scale): (usize, usize, usize, f32),
    items: &[(usize, usize, usize)],
    out: &mut [f32],
) {
    let group = num_heads / num_kv_heads;
    let kv_dim = num_kv_heads * head_dim;
    let out_rows = out.len() / head_dim.max(1);
    let out_ptr = OutPtr::new(out);
    let simd = loops.simd && has_avx2_fma();
    #[cfg(target_arch = "x86_64")]
    let bf16_dot =
        loops.bf16_dot && head_dim.is_multiple_of(32) && super::attention_bf16::available();
    items.par_iter().for_each(|&(t0, t1, kvh)| {
        with_reused(&TILE_BUFFERS, |bufs| {
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
            let rows = (t1 - t0) * group;
            let few_rows = rows < loops.gemm_min_rows;
            // The FMA loops need AVX2 and FMA (has_avx2_fma checked them) and whole lanes.
            let fma = simd && head_dim.is_multiple_of(8);
            match (cache_k, cache_v) {
                #[cfg(target_arch = "x86_64")]
                (KvRows::Bf16(k), KvRows::Bf16(v)) if few_rows && fma => {
                    // SAFETY: `fma` holds.
                    #[allow(unsafe_code)]
                    unsafe {
                        attend_tile_simd(&tile, q, k, v, layout, rows * longest, bufs)
                    }
                }
                #[cfg(target_arch = "x86_64")]
                (KvRows::F32(k), KvRows::F32(v)) if few_rows && fma => {
                    // SAFETY: `fma` holds.
                    #[allow(unsafe_code)]
                    unsafe {
                        attend_tile_simd(&tile, q, k, v, layout, rows * longest, bufs)
                    }
                }
                #[cfg(target_arch = "x86_64")]
                (KvRows::Bf16(k), KvRows::Bf16(v)) if !few_rows && bf16_dot => {
                    // SAFETY: `bf16_dot` holds: the CPU has AVX-512 BF16, the head dim is a
                    // multiple of 32.
                    #[allow(unsafe_code)]
                    unsafe {
                        super::attention_bf16::attend_tile(
                            &tile,
                            q,
                            k,
                            v,
                            layout,
                            longest,
                            loops.key_block,
                            bufs,
                        )
                    }
                }
                (KvRows::F32(k), KvRows::F32(v)) if few_rows => {
                    with_scratch(rows * longest, |scores| {
                        attend_tile(&tile, q, k, v, layout, scores, bufs)
                    })
                }
                _ => attend_tile_gemm(
                    &tile,
                    q,
                    cache_k,
                    cache_v,
                    layout,
                    longest,
                    loops.key_block,
                    simd,
                    bufs,
                ),
            }
            for r in 0..rows {
                let item = (t0 + r / group) * num_heads + kvh * group + r % group;
                assert!(item < out_rows, "attention outputs past their buffer");
                let from = &bufs.o[r * head_dim..(r + 1) * head_dim];
                // SAFETY: row `item` (a token and head) is in bounds (checked above) and
                // this item's alone: items cover disjoint tokens or KV heads.
                #[allow(unsafe_code)]
                unsafe {
                    let to = out_ptr.offset(item * head_dim).as_ptr();
                    std::ptr::copy_nonoverlapping(from.as_ptr(), to, head_dim);
                }
            }
        })
    });
}

/// A work item's buffers (each thread's, reused): its query rows' outputs, each row's
/// running max and sum (or inverse sum) of its softmax, its keys' offsets in the cache, and a
/// query row's room.
#[derive(Debug, Default)]
pub(super) struct TileBuffers {
    pub(super) o: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
    pub(super) bases: Vec<usize>,
    pub(super) row: Vec<f32>,
}

impl TileBuffers {
    /// Ready for `tile`'s query rows over the first `keys` keys of its run `run`: outputs
    /// and sums zero, maxima −∞, the keys' offsets found (a slot is a division by the block
    /// size), a query row of zeros.
    pub(super) fn prepare(
        &mut self,
        tile: &Tile,
        layout: &PagedLayout<'_>,
        run: usize,
        keys: usize,
    ) {
        let rows = (tile.t1 - tile.t0) * tile.group;
        let refill = |v: &mut Vec<f32>, len: usize, value: f32| {
            v.clear();
            v.resize(len, value);
        };
        refill(&mut self.o, rows * tile.head_dim, 0.0);
        refill(&mut self.max, rows, f32::NEG_INFINITY);
        refill(&mut self.sum, rows, 0.0);
        refill(&mut self.row, tile.head_dim, 0.0);
        let kv_off = tile.kvh * tile.head_dim;
        self.bases.clear();
        self.bases
            .extend((0..keys).map(|j| layout.slot(run, j) * tile.kv_dim + kv_off));
    }
}

/// One work item of [`paged_attention`]: tokens `t0..t1` of one run, KV head `kvh`.
pub(super) struct Tile {
    pub(super) t0: usize,
    pub(super) t1: usize,
    pub(super) kvh: usize,
    pub(super) group: usize,
    pub(super) num_heads: usize,
    pub(super) head_dim: usize,
    pub(super) kv_dim: usize,
    pub(super) scale: f32,
}

impl Tile {
    /// The tile's run, query rows, and keys (its longest row's) given `scores` of room.
    fn shape(&self, layout: &PagedLayout<'_>, scores: &[f32]) -> (usize, usize, usize) {
        let rows = (self.t1 - self.t0) * self.group;
        (
            layout.token_runs[self.t0] as usize,
            rows,
            scores.len() / rows.max(1),
        )
    }

    /// Keys query row `r` attends to.
    pub(super) fn len(&self, layout: &PagedLayout<'_>, r: usize) -> usize {
        layout.positions[self.t0 + r / self.group] as usize + 1
    }

    /// Where query row `r` starts in `q`.
    pub(super) fn q_at(&self, r: usize) -> usize {
        let t = self.t0 + r / self.group;
        (t * self.num_heads + self.kvh * self.group + r % self.group) * self.head_dim
    }
}

/// `o[r] += Σ_j p[r * n + j] · v[j]` for `rows` rows of `hd` outputs, `n` value rows of `hd`:
/// four value rows a pass over each output row; eight lanes at a time where `simd`.
fn add_weighted_rows(
    o: &mut [f32],
    rows: usize,
    hd: usize,
    p: &[f32],
    n: usize,
    v: &[f32],
    simd: bool,
) {
    assert!(
        o.len() >= rows * hd && p.len() >= rows * n && v.len() >= n * hd,
        "attention's weighted values shorter than their shapes"
    );
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is set only when the CPU has AVX2 and FMA.
        #[allow(unsafe_code)]
        return unsafe { add_weighted_rows_fma(o, rows, hd, p, n, v) };
    }
    let _ = simd;
    add_weighted_rows_plain(o, rows, hd, p, n, v);
}

/// [`add_weighted_rows`] compiled for AVX2, which its loops vectorise to.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn add_weighted_rows_fma(o: &mut [f32], rows: usize, hd: usize, p: &[f32], n: usize, v: &[f32]) {
    add_weighted_rows_plain(o, rows, hd, p, n, v);
}

/// [`add_weighted_rows`] in plain loops.
#[inline(always)]
fn add_weighted_rows_plain(o: &mut [f32], rows: usize, hd: usize, p: &[f32], n: usize, v: &[f32]) {
    let whole = n / 4 * 4;
    for (orow, prow) in o.chunks_exact_mut(hd).zip(p.chunks_exact(n)).take(rows) {
        for j in (0..whole).step_by(4) {
            let (p0, p1, p2, p3) = (prow[j], prow[j + 1], prow[j + 2], prow[j + 3]);
            let vs = &v[j * hd..(j + 4) * hd];
            let (v0, rest) = vs.split_at(hd);
            let (v1, rest) = rest.split_at(hd);
            let (v2, v3) = rest.split_at(hd);
            for ((((x, a), b), c), d) in orow.iter_mut().zip(v0).zip(v1).zip(v2).zip(v3) {
                *x += a * p0 + b * p1 + c * p2 + d * p3;
            }
        }
        for j in whole..n {
            let pj = prow[j];
            for (x, a) in orow.iter_mut().zip(&v[j * hd..(j + 1) * hd]) {
                *x += a * pj;
            }
        }
    }
}

/// The outputs of a tile's query rows into `bufs.o` (as [`attend_tile`]) by products: per block of
/// `key_block` keys (gathered from their pages), `S = (scale · Q) Kᵀ`, each row's scores
/// past its own length dropped, an online softmax (the running max and sum, the outputs
/// rescaled when the max grows), and `O += P V`; the outputs divided by the sums at the end.
#[allow(clippy::too_many_arguments)]
fn attend_tile_gemm(
    tile: &Tile,
    q: &[f32],
    cache_k: KvRows<'_>,
    cache_v: KvRows<'_>,
    layout: &PagedLayout<'_>,
    longest: usize,
    key_block: usize,
    simd: bool,
    bufs: &mut TileBuffers,
) {
    let &Tile {
        head_dim: hd,
        scale,
        ..
    } = tile;
    let run = layout.token_runs[tile.t0] as usize;
    let rows = (tile.t1 - tile.t0) * tile.group;
    let block = key_block.clamp(1, longest.max(1));
    bufs.prepare(tile, layout, run, longest);
    let TileBuffers {
        o, max, sum, bases, ..
    } = bufs;
    with_scratch(rows * hd + 2 * block * hd + rows * block, |scratch| {
        let (qs, rest) = scratch.split_at_mut(rows * hd);
        let (kb, rest) = rest.split_at_mut(block * hd);
        let (vb, s) = rest.split_at_mut(block * hd);
        for (r, qr) in qs.chunks_exact_mut(hd).enumerate() {
            let at = tile.q_at(r);
            for (d, x) in qr.iter_mut().zip(&q[at..at + hd]) {
                *d = x * scale;
            }
        }
        for j0 in (0..longest).step_by(block) {
            let n = block.min(longest - j0);
            for (j, &base) in bases[j0..j0 + n].iter().enumerate() {
                cache_k.read(base, &mut kb[j * hd..(j + 1) * hd]);
                cache_v.read(base, &mut vb[j * hd..(j + 1) * hd]);
            }
            super::matmul::multiply_f32_rows(qs, rows, hd, kb, n, OutPtr::new(s), n);
            for r in 0..rows {
                let valid = tile.len(layout, r).saturating_sub(j0).min(n);
                let row = &mut s[r * n..(r + 1) * n];
                let (kept, past) = row.split_at_mut(valid);
                past.fill(0.0);
                let out = &mut o[r * hd..(r + 1) * hd];
                online_softmax_step(kept, (&mut max[r], &mut sum[r]), out, simd);
            }
            add_weighted_rows(o, rows, hd, s, n, vb, simd);
        }
    });
    for (orow, total) in o.chunks_exact_mut(hd).zip(sum.iter()) {
        let inv = 1.0 / total;
        orow.iter_mut().for_each(|x| *x *= inv);
    }
}

/// One row's online-softmax step over a block's `kept` scores (none past the row's length):
/// they become `exp(s - max)` against the running max, which grows to theirs, the running
/// sum is rescaled and added to, and so is the row's output so far.
pub(super) fn online_softmax_step(
    kept: &mut [f32],
    (max, sum): (&mut f32, &mut f32),
    out: &mut [f32],
    simd: bool,
) {
    if kept.is_empty() {
        return;
    }
    let new_max = kept.iter().copied().fold(*max, f32::max);
    let rescale = (*max - new_max).exp();
    *sum = *sum * rescale + exp_shifted(kept, new_max, simd);
    if rescale != 1.0 {
        out.iter_mut().for_each(|x| *x *= rescale);
    }
    *max = new_max;
}

/// `s = exp(s - shift)` in place, returning their sum; eight lanes at a time where `simd`.
fn exp_shifted(s: &mut [f32], shift: f32, simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is set only when the CPU has AVX2 and FMA.
        #[allow(unsafe_code)]
        return unsafe { exp_shifted_fma(s, shift) };
    }
    let _ = simd;
    let mut total = 0.0;
    for x in s.iter_mut() {
        *x = (*x - shift).exp();
        total += *x;
    }
    total
}

/// Whether the CPU runs AVX2 and FMA (the attention loops have a version for them, picked at
/// run time: the build targets the baseline x86-64).
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`attend_tile_fma`] with its scores in the thread's scratch of `scratch_len` floats.
///
/// # Safety
/// The CPU has AVX2 and FMA, and the head dim is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
unsafe fn attend_tile_simd<E: KvElem>(
    tile: &Tile,
    q: &[f32],
    cache_k: &[E],
    cache_v: &[E],
    layout: &PagedLayout<'_>,
    scratch_len: usize,
    bufs: &mut TileBuffers,
) {
    with_scratch(scratch_len, |scores| {
        // SAFETY: this function's contract.
        unsafe { attend_tile_fma(tile, q, cache_k, cache_v, layout, scores, bufs) }
    })
}

/// [`attend_tile`] with AVX2 and FMA, for head dims of a multiple of 8: each score a fused
/// dot product over eight lanes summed in a fixed order, four query rows against two keys;
/// the outputs accumulated in registers, two rows and up to 32 dims at a time, over the keys
/// in order. A row's arithmetic does not depend on the rows beside it (a row shorter than
/// its neighbour adds zero-weighted values, which leaves its sums as they are).
///
/// # Safety
/// The CPU has AVX2 and FMA, and `tile.head_dim` is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn attend_tile_fma<E: KvElem>(
    tile: &Tile,
    q: &[f32],
    cache_k: &[E],
    cache_v: &[E],
    layout: &PagedLayout<'_>,
    scores: &mut [f32],
    bufs: &mut TileBuffers,
) {
    let &Tile {
        head_dim, scale, ..
    } = tile;
    let (run, rows, longest) = tile.shape(layout, scores);
    let chunks = head_dim / 8;
    bufs.prepare(tile, layout, run, longest);
    // The sums' room holds their inverses.
    let TileBuffers {
        o, sum: inv, bases, ..
    } = bufs;
    let len = |r: usize| tile.len(layout, r);
    let q_row = |r: usize| &q[tile.q_at(r)..tile.q_at(r) + head_dim];
    let key = |cache: &[E], j: usize| cache[bases[j]..bases[j] + head_dim].as_ptr();
    // Two keys at a time (the second the first again past the end, its scores dropped).
    for j in (0..longest).step_by(2) {
        let pair = (j + 1 < longest) as usize + 1;
        let ks = [key(cache_k, j), key(cache_k, (j + 1).min(longest - 1))];
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(4);
            let mut dots = [[0.0f32; 2]; 4];
            // SAFETY: both keys and every q row hold head_dim = 8 · chunks floats.
            unsafe {
                match n {
                    4 => {
                        dots = score_block::<4, E>(
                            &[q_row(r), q_row(r + 1), q_row(r + 2), q_row(r + 3)],
                            ks,
                            chunks,
                        )
                    }
                    3 => dots[..3].copy_from_slice(&score_block::<3, E>(
                        &[q_row(r), q_row(r + 1), q_row(r + 2)],
                        ks,
                        chunks,
                    )),
                    2 => dots[..2].copy_from_slice(&score_block::<2, E>(
                        &[q_row(r), q_row(r + 1)],
                        ks,
                        chunks,
                    )),
                    _ => dots[..1].copy_from_slice(&score_block::<1, E>(&[q_row(r)], ks, chunks)),
                }
            }
            for (i, d) in dots[..n].iter().enumerate() {
                let row = &mut scores[(r + i) * longest + j..];
                for (s, d) in row[..pair].iter_mut().zip(d) {
                    *s = d * scale;
                }
            }
            r += n;
        }
    }
    for (r, inv) in inv.iter_mut().enumerate() {
        // SAFETY: AVX2 and FMA (this function's contract).
        *inv = 1.0 / unsafe { exp_in_place(&mut scores[r * longest..r * longest + len(r)]) };
    }
    // Probabilities in place, zero past each row's own length.
    for r in 0..rows {
        let row = &mut scores[r * longest..(r + 1) * longest];
        let (kept, past) = row.split_at_mut(len(r).min(longest));
        kept.iter_mut().for_each(|p| *p *= inv[r]);
        past.fill(0.0);
    }
    for c0 in (0..chunks).step_by(4) {
        let nc = (chunks - c0).min(4);
        let mut r = 0;
        while r < rows {
            let nr = (rows - r).min(2);
            let keys = (r..r + nr).map(len).max().unwrap_or(0).min(longest);
            let probs = [&scores[r * longest..], &scores[(r + nr - 1) * longest..]];
            let out = &mut o[r * head_dim + 8 * c0..];
            let v_at = |j: usize| key(cache_v, j).wrapping_add(8 * c0);
            // SAFETY: each value row holds head_dim floats from 8 · c0 on, nc chunks of them
            // in range; probs rows hold `keys` floats; out holds the rows' chunks.
            unsafe {
                match (nr, nc) {
                    (2, 4) => sum_values::<2, 4, E, _>(probs, &v_at, keys, head_dim, out),
                    (2, 3) => sum_values::<2, 3, E, _>(probs, &v_at, keys, head_dim, out),
                    (2, 2) => sum_values::<2, 2, E, _>(probs, &v_at, keys, head_dim, out),
                    (2, _) => sum_values::<2, 1, E, _>(probs, &v_at, keys, head_dim, out),
                    (_, 4) => sum_values::<1, 4, E, _>(probs, &v_at, keys, head_dim, out),
                    (_, 3) => sum_values::<1, 3, E, _>(probs, &v_at, keys, head_dim, out),
                    (_, 2) => sum_values::<1, 2, E, _>(probs, &v_at, keys, head_dim, out),
                    _ => sum_values::<1, 1, E, _>(probs, &v_at, keys, head_dim, out),
                }
            }
            r += nr;
        }
    }
}

/// `s = exp(s - max(s))` in place, eight lanes at a time; returns their sum.
///
/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(unsafe_code)]
unsafe fn exp_in_place(s: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let (body, tail) = s.split_at(s.len() / 8 * 8);
    let mut lanes = _mm256_set1_ps(f32::NEG_INFINITY);
    for chunk in body.chunks_exact(8) {
        // SAFETY: chunk holds 8 floats.
        lanes = _mm256_max_ps(lanes, unsafe { _mm256_loadu_ps(chunk.as_ptr()) });
    }
    let mut l8 = [0.0f32; 8];
    // SAFETY: l8 holds 8 floats.
    unsafe { _mm256_storeu_ps(l8.as_mut_ptr(), lanes) };
    let max = l8
        .iter()
        .chain(tail.iter())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    // SAFETY: AVX2 and FMA (this function's contract).
    unsafe { exp_shifted_fma(s, max) }
}

/// `s = exp(s - shift)` in place for `s <= shift`, eight lanes at a time (a degree-6
/// polynomial after range reduction, within 2 ulp of `expf`; the last `len % 8` by `expf`);
/// returns their sum.
///
/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(unsafe_code)]
unsafe fn exp_shifted_fma(s: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (body, tail) = s.split_at_mut(s.len() / 8 * 8);
    let m = _mm256_set1_ps(shift);
    let mut acc = _mm256_setzero_ps();
    for chunk in body.chunks_exact_mut(8) {
        // SAFETY: chunk holds 8 floats.
        let x = _mm256_sub_ps(unsafe { _mm256_loadu_ps(chunk.as_ptr()) }, m);
        let e = exp8(x);
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), e) };
        acc = _mm256_add_ps(acc, e);
    }
    let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let mut l = [0.0f32; 4];
    // SAFETY: l holds 4 floats.
    unsafe { _mm_storeu_ps(l.as_mut_ptr(), half) };
    let mut sum = (l[0] + l[1]) + (l[2] + l[3]);
    for x in tail {
        *x = (*x - shift).exp();
        sum += *x;
    }
    sum
}

/// `e^x` for eight lanes of `x <= 0` (larger ones are clamped to 88): `x = n ln 2 + r`, the
/// Cephes polynomial for `e^r`, times `2^n` built in the exponent bits (below -87 the
/// result is clamped to about 1e-38).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_fmadd_ps(
        p,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

/// An element of a cached K or V row, widened to f32 eight at a time.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
trait KvElem: Copy {
    /// Eight elements from `p` as f32 lanes.
    ///
    /// # Safety
    /// AVX2; `p` points at eight elements.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

#[cfg(target_arch = "x86_64")]
impl KvElem for f32 {
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

/// bf16 bit patterns: each the high half of its f32.
#[cfg(target_arch = "x86_64")]
impl KvElem for u16 {
    #[inline(always)]
    #[allow(unsafe_code)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (eight u16 are 16 bytes; AVX2 for the widening).
        unsafe {
            let halves = _mm_loadu_si128(p.cast::<__m128i>());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
        }
    }
}

/// `q_r · k_c` for N rows and two keys: eight lanes of fused multiply-adds over `chunks` of
/// 8, then the lanes summed as (0+4)+(1+5)+((2+6)+(3+7)).
///
/// # Safety
/// AVX2 and FMA; both keys and each row hold `8 · chunks` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(unsafe_code, clippy::needless_range_loop)]
unsafe fn score_block<const N: usize, E: KvElem>(
    q: &[&[f32]; N],
    k: [*const E; 2],
    chunks: usize,
) -> [[f32; 2]; N] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for c in 0..chunks {
        // SAFETY: c < chunks, so 8 floats from 8 c are in each row and key.
        unsafe {
            let k0 = E::load8(k[0].add(8 * c));
            let k1 = E::load8(k[1].add(8 * c));
            for i in 0..N {
                let qv = _mm256_loadu_ps(q[i].as_ptr().add(8 * c));
                acc[i][0] = _mm256_fmadd_ps(qv, k0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(qv, k1, acc[i][1]);
            }
        }
    }
    let mut out = [[0.0f32; 2]; N];
    for i in 0..N {
        for c in 0..2 {
            let a = acc[i][c];
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let mut l = [0.0f32; 4];
            // SAFETY: l holds 4 floats.
            unsafe { _mm_storeu_ps(l.as_mut_ptr(), s) };
            out[i][c] = (l[0] + l[1]) + (l[2] + l[3]);
        }
    }
    out
}

/// `out[i] = Σ_j probs[i][j] · v_j` over `keys` keys in order, for NR rows (`head_dim`
/// apart in `out`) and NC chunks of 8 dims, in registers.
///
/// # Safety
/// AVX2 and FMA; `v_at(j)` points at NC · 8 floats for every j < keys; each probs row holds
/// `keys` floats; `out` holds `(NR - 1) · head_dim + 8 · NC` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(unsafe_code, clippy::needless_range_loop)]
unsafe fn sum_values<const NR: usize, const NC: usize, E: KvElem, V: Fn(usize) -> *const E>(
    probs: [&[f32]; 2],
    v_at: &V,
    keys: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); NC]; NR];
    for j in 0..keys {
        let v = v_at(j);
        for i in 0..NR {
            let p = _mm256_set1_ps(probs[i][j]);
            for c in 0..NC {
                // SAFETY: v points at NC · 8 floats (the caller's contract).
                acc[i][c] = _mm256_fmadd_ps(p, unsafe { E::load8(v.add(8 * c)) }, acc[i][c]);
            }
        }
    }
    for i in 0..NR {
        for c in 0..NC {
            let dst = &mut out[i * head_dim + 8 * c..i * head_dim + 8 * c + 8];
            // SAFETY: dst holds 8 floats.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), acc[i][c]) };
        }
    }
}

/// The outputs of a tile's query rows (row r: token t0 + r / group, head kvh · group + r %
/// group) into `bufs.o`, with `scores` as room for each row's scores over the tile's longest
/// run.
#[inline(always)]
fn attend_tile(
    tile: &Tile,
    q: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    layout: &PagedLayout<'_>,
    scores: &mut [f32],
    bufs: &mut TileBuffers,
) {
    let &Tile {
        head_dim, scale, ..
    } = tile;
    let (run, rows, longest) = tile.shape(layout, scores);
    let len = |r: usize| tile.len(layout, r);
    let q_at = |r: usize| tile.q_at(r);
    bufs.prepare(tile, layout, run, longest);
    // The sums' room holds their inverses.
    let TileBuffers {
        o, sum: inv, bases, ..
    } = bufs;
    for (j, &base) in bases.iter().enumerate() {
        let k = &cache_k[base..base + head_dim];
        for r in 0..rows {
            if j < len(r) {
                scores[r * longest + j] = dot(&q[q_at(r)..q_at(r) + head_dim], k) * scale;
            }
        }
    }
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
    for (j, &base) in bases.iter().enumerate() {
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
}

/// The head layout of a fused `[tokens, (heads + 2 kv_heads) · head_dim]` q/k/v projection.
#[derive(Clone, Copy)]
pub(crate) struct FusedQkv {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rotary_dim: usize,
    pub(crate) rope: corral_backend::RopeParams,
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
    mut cache_k: KvRowsMut<'_>,
    mut cache_v: KvRowsMut<'_>,
) {
    let FusedQkv {
        heads,
        kv_heads,
        head_dim: hd,
        rotary_dim,
        rope,
        eps,
    } = shape;
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let width = q_dim + 2 * kv_dim;
    let freqs = super::rope::Frequencies::new(rope, rotary_dim);
    q_out
        .par_chunks_mut(q_dim)
        .zip(qkv.par_chunks(width))
        .zip(positions.par_iter())
        .for_each(|((q, row), &pos)| {
            for (dst, src) in q.chunks_mut(hd).zip(row[..q_dim].chunks(hd)) {
                super::norm::norm_row(src, q_weight, eps, false, dst);
            }
            super::rope::rotate_heads(q, pos, hd, rotary_dim, &freqs);
        });
    super::with_scratch(kv_dim, |k| {
        for ((row, &pos), &slot) in qkv.chunks(width).zip(positions).zip(slots) {
            let dst = slot as usize * kv_dim;
            for (kh, src) in k.chunks_mut(hd).zip(row[q_dim..q_dim + kv_dim].chunks(hd)) {
                super::norm::norm_row(src, k_weight, eps, false, kh);
            }
            super::rope::rotate_heads(k, pos, hd, rotary_dim, &freqs);
            cache_k.write(dst, k);
            cache_v.write(dst, &row[q_dim + kv_dim..]);
        }
    });
}

pub(crate) fn kv_store(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    kv_dim: usize,
    mut cache_k: KvRowsMut<'_>,
    mut cache_v: KvRowsMut<'_>,
) {
    for (t, &slot) in slots.iter().enumerate() {
        let dst = slot as usize * kv_dim;
        cache_k.write(dst, &k[t * kv_dim..(t + 1) * kv_dim]);
        cache_v.write(dst, &v[t * kv_dim..(t + 1) * kv_dim]);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Plain softmax attention in f64 for token t of `runs` (tokens laid out run by run).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        layout: &PagedLayout<'_>,
        heads: usize,
        kv_heads: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let tokens = layout.positions.len();
        let group = heads / kv_heads;
        let kv_dim = kv_heads * hd;
        let mut out = vec![0.0f32; tokens * heads * hd];
        for t in 0..tokens {
            let run = layout.token_runs[t] as usize;
            let len = layout.positions[t] as usize + 1;
            for h in 0..heads {
                let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
                let at = |j: usize| layout.slot(run, j) * kv_dim + (h / group) * hd;
                let s: Vec<f64> = (0..len)
                    .map(|j| {
                        let kj = &k[at(j)..at(j) + hd];
                        qh.iter()
                            .zip(kj)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let o: f64 = (0..len).map(|j| w[j] * f64::from(v[at(j) + d])).sum();
                    out[(t * heads + h) * hd + d] = (o / z) as f32;
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Every path (the dot-product loops and the GEMM tiles of 8, 13, 64 or the chosen
        /// number of tokens, on AVX2/FMA where the CPU has them and plain) matches plain f64
        /// attention over runs of several tokens with histories, shuffled block tables and
        /// any head dim.
        #[test]
        fn attention_matches_plain_softmax_attention(
            hd in prop_oneof![Just(8usize), Just(16), Just(24), Just(40), Just(64), Just(128), Just(256), Just(12)],
            kv_heads in 1usize..3,
            group in prop_oneof![Just(1usize), Just(2), Just(3), Just(4), Just(8)],
            block_size in prop_oneof![Just(4usize), Just(16)],
            runs in proptest::collection::vec((0usize..60, 1usize..40), 1..4),
            seed in any::<u64>(),
        ) {
            let heads = kv_heads * group;
            let kv_dim = kv_heads * hd;
            let width = runs.iter().map(|(p, n)| (p + n).div_ceil(block_size)).max().unwrap_or(1);
            let blocks = runs.len() * width;
            let mut order: Vec<u32> = (0..blocks as u32).collect();
            let mut x = seed | 1;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for i in (1..order.len()).rev() {
                order.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let (mut positions, mut token_runs) = (vec![], vec![]);
            for (r, &(past, n)) in runs.iter().enumerate() {
                for p in past..past + n {
                    positions.push(p as u32);
                    token_runs.push(r as u32);
                }
            }
            let mut values = |n: usize| -> Vec<f32> {
                (0..n).map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0).collect()
            };
            // K and V exactly representable in bf16, so that a bf16 cache holds the same values.
            let mut bf16_values = |n: usize| -> Vec<f32> {
                values(n).iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
            };
            let k = bf16_values(blocks * block_size * kv_dim);
            let v = bf16_values(blocks * block_size * kv_dim);
            let bits = |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect() };
            let (k16, v16) = (bits(&k), bits(&v));
            let q = values(positions.len() * heads * hd);
            let layout = PagedLayout {
                positions: &positions,
                token_runs: &token_runs,
                block_tables: &order,
                max_blocks_per_run: width,
                block_size,
            };
            let scale = 1.0 / (hd as f32).sqrt();
            let expected = reference(&q, &k, &v, &layout, heads, kv_heads, hd, scale);
            // The dot-product loops, and the GEMM path over whole and over small key blocks
            // (the online softmax's rescaling between blocks), each with and without SIMD.
            for simd in [true, false] {
                for (gemm_min_rows, key_block, tile_tokens) in [
                    (usize::MAX, KEY_BLOCK, Some(TILE_TOKENS)),
                    (1, KEY_BLOCK, Some(TILE_TOKENS)),
                    (1, 7, Some(TILE_TOKENS)),
                    (1, KEY_BLOCK, Some(MAX_TILE_TOKENS)),
                    (1, 7, Some(13)),
                    (GEMM_MIN_QUERY_ROWS, KEY_BLOCK, None),
                ] {
                    let loops = Loops { simd, gemm_min_rows, key_block, tile_tokens, bf16_dot: false };
                    // Each with an f32 and a bf16 cache (the latter always on the GEMM path).
                    for (cache, ck, cv) in [
                        ("f32", KvRows::F32(&k), KvRows::F32(&v)),
                        ("bf16", KvRows::Bf16(&k16), KvRows::Bf16(&v16)),
                    ] {
                        let mut out = vec![f32::NAN; expected.len()];
                        attention_with(loops, &q, ck, cv, &layout, (heads, kv_heads, hd, scale), &mut out);
                        for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
                            prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{loops:?} {cache}: {i}: {a} against {b}");
                        }
                    }
                }
            }
            // The bf16 cache's tiles on AVX-512 BF16 dot products (where the CPU has them):
            // the queries and probabilities rounded to bf16, so within 2e-2, not 1e-5.
            for (key_block, tile_tokens) in [(KEY_BLOCK, Some(TILE_TOKENS)), (7, Some(13)), (KEY_BLOCK, None)] {
                let loops = Loops { simd: true, gemm_min_rows: 1, key_block, tile_tokens, bf16_dot: true };
                let mut out = vec![f32::NAN; expected.len()];
                attention_with(loops, &q, KvRows::Bf16(&k16), KvRows::Bf16(&v16), &layout, (heads, kv_heads, hd, scale), &mut out);
                for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
                    prop_assert!((a - b).abs() <= 2e-2 * (1.0 + b.abs()), "{loops:?}: {i}: {a} against {b}");
                }
            }
        }
    }
}
