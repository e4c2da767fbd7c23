//! Plain reference implementations of the ops, written for clarity rather than speed.
//! Tests check every backend against these.

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`, one dot product at a time in f64.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|l| x[i * k + l] as f64 * w[j * k + l] as f64)
                .sum();
            out[i * n + j] = s as f32;
        }
    }
    out
}

/// RMSNorm of each `dim`-wide row.
pub fn rms_norm(x: &[f32], w: &[f32], dim: usize, eps: f32, offset_one: bool) -> Vec<f32> {
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter().zip(w).map(move |(v, w)| {
                let w = if offset_one {
                    1.0 + *w as f64
                } else {
                    *w as f64
                };
                (*v as f64 * inv * w) as f32
            })
        })
        .collect()
}

/// `silu(gate) ⊙ up`.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = g as f64;
            (g / (1.0 + (-g).exp()) * u as f64) as f32
        })
        .collect()
}

/// `x ⊙ σ(gate)`.
pub fn sigmoid_mul(x: &[f32], gate: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(gate)
        .map(|(&x, &g)| (x as f64 / (1.0 + (-(g as f64)).exp())) as f32)
        .collect()
}

/// `acc[t] + σ(gate[t]) · x[t]` per row of `dim`.
pub fn add_sigmoid_gated(acc: &[f32], x: &[f32], gate: &[f32], dim: usize) -> Vec<f32> {
    acc.iter()
        .zip(x)
        .enumerate()
        .map(|(i, (&a, &x))| {
            let s = 1.0 / (1.0 + (-(gate[i / dim] as f64)).exp());
            (a as f64 + s * x as f64) as f32
        })
        .collect()
}

/// Gated RMSNorm of each row of `dim`: `(w ⊙ rmsnorm(x)) ⊙ silu(z)`.
pub fn gated_rms_norm(x: &[f32], z: &[f32], w: &[f32], dim: usize, eps: f32) -> Vec<f32> {
    let normed = rms_norm(x, w, dim, eps, false);
    normed
        .iter()
        .zip(z)
        .map(|(&n, &z)| {
            let z = z as f64;
            (n as f64 * z / (1.0 + (-z).exp())) as f32
        })
        .collect()
}

/// Rows `ids[i]` of `table` (rows `dim` wide), in order: an embedding lookup or a gather.
pub fn gather_rows(table: &[f32], ids: &[u32], dim: usize) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            table[id as usize * dim..(id as usize + 1) * dim]
                .iter()
                .copied()
        })
        .collect()
}

/// Rotate-half (GPT-NeoX) RoPE of the first `rotary_dim` dims of each head of `x` (rows of
/// `heads` heads of `head_dim`, one row a position). The angle is formed in f32, as
/// transformers forms it from its f32 inverse frequencies; the rotation in f64.
pub fn rope(
    x: &[f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    params: crate::RopeParams,
) -> Vec<f32> {
    let half = rotary_dim / 2;
    let scale = params.attention_factor() as f64;
    let mut out = x.to_vec();
    for (row, &pos) in out.chunks_mut(heads * head_dim).zip(positions) {
        for head in row.chunks_mut(head_dim) {
            for i in 0..half {
                let angle = (pos as f32 * params.inverse_frequency(i, rotary_dim)) as f64;
                let (sin, cos) = angle.sin_cos();
                let (a, b) = (head[i] as f64, head[i + half] as f64);
                head[i] = ((a * cos - b * sin) * scale) as f32;
                head[i + half] = ((b * cos + a * sin) * scale) as f32;
            }
        }
    }
    out
}

/// `out[rows[i]] += scales[i] · y[i]` over rows of `dim`, onto `base`.
pub fn scale_scatter_add(
    base: &[f32],
    y: &[f32],
    rows: &[u32],
    scales: &[f32],
    dim: usize,
) -> Vec<f32> {
    let mut out = base.to_vec();
    for (i, &r) in rows.iter().enumerate() {
        for c in 0..dim {
            let at = r as usize * dim + c;
            out[at] = (out[at] as f64 + scales[i] as f64 * y[i * dim + c] as f64) as f32;
        }
    }
    out
}

/// The softmax router: each token's `top_k` experts by logit (ties to the lower id) and their
/// softmax weights, renormalised to sum 1 where `renormalize`; with `shared_gate`, each row
/// has one more logit and each token one more choice, expert `num_experts` weighted by its
/// sigmoid. Ids and weights `[tokens, top_k (+ 1)]`.
pub fn moe_route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
    shared_gate: bool,
) -> (Vec<u32>, Vec<f32>) {
    let row = num_experts + usize::from(shared_gate);
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for l in logits.chunks(row) {
        let max = l[..num_experts]
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let sum: f64 = l[..num_experts]
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum();
        let mut order: Vec<usize> = (0..num_experts).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let p: Vec<f64> = chosen
            .iter()
            .map(|&e| (l[e] as f64 - max).exp() / sum)
            .collect();
        let total: f64 = if renormalize { p.iter().sum() } else { 1.0 };
        ids.extend(chosen.iter().map(|&e| e as u32));
        weights.extend(p.iter().map(|w| (w / total) as f32));
        if shared_gate {
            ids.push(num_experts as u32);
            weights.push((1.0 / (1.0 + (-(l[num_experts] as f64)).exp())) as f32);
        }
    }
    (ids, weights)
}

/// Each routed pair's place when the pairs (`ids`, a token's choices in turn) are sorted by
/// expert, pairs of one expert in pair order: expert `e`'s pairs at positions
/// `offsets[e]..offsets[e + 1]`, the pair at each position, and each pair's position.
pub struct SortedPairs {
    /// `[experts + 1]` prefix counts.
    pub offsets: Vec<u32>,
    /// The experts that have pairs, in ascending order.
    pub hit: Vec<u32>,
    /// The pair at each sorted position.
    pub sorted_pairs: Vec<u32>,
    /// The sorted position of each pair.
    pub positions: Vec<u32>,
}

/// The routed pairs `ids` sorted by expert (of `num_experts`), stably.
pub fn moe_sort(ids: &[u32], num_experts: usize) -> SortedPairs {
    let mut sorted_pairs: Vec<u32> = (0..ids.len() as u32).collect();
    sorted_pairs.sort_by_key(|&p| ids[p as usize]);
    let mut positions = vec![0; ids.len()];
    for (s, &p) in sorted_pairs.iter().enumerate() {
        positions[p as usize] = s as u32;
    }
    let offsets = (0..=num_experts)
        .map(|e| ids.iter().filter(|&&id| (id as usize) < e).count() as u32)
        .collect();
    let mut hit: Vec<u32> = ids.to_vec();
    hit.sort_unstable();
    hit.dedup();
    SortedPairs {
        offsets,
        hit,
        sorted_pairs,
        positions,
    }
}

/// The routed experts' output per token: `out[t] = Σ_j w[t, j] · down[e](silu(gate[e] x[t]) ⊙
/// up[e] x[t])` with `e = ids[t, j]`, experts' matrices stacked (`gate`, `up`:
/// `[experts, inter, hidden]`, `down`: `[experts, hidden, inter]`), in f64.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    [gate, up, down]: [&[f32]; 3],
    inter: usize,
    hidden: usize,
) -> Vec<f32> {
    let tokens = ids.len() / top_k.max(1);
    let mut out = vec![0.0; tokens * hidden];
    let dot = |a: &[f32], b: &[f64]| a.iter().zip(b).map(|(&a, b)| a as f64 * b).sum::<f64>();
    for t in 0..tokens {
        let xt: Vec<f64> = x[t * hidden..(t + 1) * hidden]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mut acc = vec![0.0f64; hidden];
        for j in 0..top_k {
            let (e, w) = (ids[t * top_k + j] as usize, weights[t * top_k + j] as f64);
            let act: Vec<f64> = (0..inter)
                .map(|r| {
                    let row = (e * inter + r) * hidden;
                    let g = dot(&gate[row..row + hidden], &xt);
                    let u = dot(&up[row..row + hidden], &xt);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for (c, a) in acc.iter_mut().enumerate() {
                let row = (e * hidden + c) * inter;
                *a += w * dot(&down[row..row + inter], &act);
            }
        }
        for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(acc) {
            *o = a as f32;
        }
    }
    out
}

/// A run of a recurrent op: its first token in the batch, its tokens, its state slot, and
/// whether it starts from a zero state.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    /// First token in the batch.
    pub start: usize,
    /// Tokens.
    pub len: usize,
    /// State slot.
    pub slot: usize,
    /// Starts from a zero state rather than the slot's.
    pub fresh: bool,
}

/// The depthwise causal convolution with SiLU over `[tokens, channels]` (kernel `[channels,
/// kernel]`, the last tap on the current token), each run continuing from its slot's last
/// `kernel - 1` inputs (`state`: `[slots, channels, kernel - 1]`, oldest first), which it then
/// updates. Tokens outside the runs are 0.
pub fn causal_conv1d(
    x: &[f32],
    w: &[f32],
    channels: usize,
    kernel: usize,
    runs: &[Run],
    state: &mut [f32],
) -> Vec<f32> {
    let hist = kernel - 1;
    let mut out = vec![0.0; x.len()];
    for run in runs {
        for c in 0..channels {
            let at = (run.slot * channels + c) * hist;
            let mut inputs: Vec<f64> = if run.fresh {
                vec![0.0; hist]
            } else {
                state[at..at + hist].iter().map(|&v| v as f64).collect()
            };
            for t in run.start..run.start + run.len {
                inputs.push(x[t * channels + c] as f64);
                let window = &inputs[inputs.len() - kernel..];
                let y: f64 = (0..kernel)
                    .map(|j| w[c * kernel + j] as f64 * window[j])
                    .sum();
                out[t * channels + c] = (y / (1.0 + (-y).exp())) as f32;
            }
            let last = &inputs[inputs.len() - hist..];
            for (s, &v) in state[at..at + hist].iter_mut().zip(last) {
                *s = v as f32;
            }
        }
    }
    out
}

/// The gated delta rule token by token (model-spec §4.4) for `nk` key heads of `dk` and `nv`
/// value heads of `dv`: `qkv` rows are `[q | k | v]`; `g` and `beta` are `[tokens, nv]`; the
/// state of value head `h` in slot `s` is `state[s][h]`, `[dk, dv]`. Returns `[tokens, nv,
/// dv]` (0 outside the runs) and updates each run's slot.
pub fn gated_delta_rule(
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    (nk, nv, dk, dv): (usize, usize, usize, usize),
    runs: &[Run],
    state: &mut [f32],
) -> Vec<f32> {
    let width = 2 * nk * dk + nv * dv;
    let tokens = qkv.len() / width;
    let mut out = vec![0.0; tokens * nv * dv];
    let l2 = |v: &[f32]| -> Vec<f64> {
        let n = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() + 1e-6).sqrt();
        v.iter().map(|&x| x as f64 / n).collect()
    };
    for run in runs {
        for h in 0..nv {
            let kh = h / (nv / nk);
            let at = (run.slot * nv + h) * dk * dv;
            let mut s: Vec<f64> = if run.fresh {
                vec![0.0; dk * dv]
            } else {
                state[at..at + dk * dv].iter().map(|&v| v as f64).collect()
            };
            for t in run.start..run.start + run.len {
                let row = &qkv[t * width..(t + 1) * width];
                let q: Vec<f64> = l2(&row[kh * dk..(kh + 1) * dk])
                    .into_iter()
                    .map(|v| v / (dk as f64).sqrt())
                    .collect();
                let k = l2(&row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk]);
                let v = &row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv];
                let decay = (g[t * nv + h] as f64).exp();
                s.iter_mut().for_each(|x| *x *= decay);
                for j in 0..dv {
                    let p: f64 = (0..dk).map(|i| k[i] * s[i * dv + j]).sum();
                    let delta = beta[t * nv + h] as f64 * (v[j] as f64 - p);
                    for i in 0..dk {
                        s[i * dv + j] += k[i] * delta;
                    }
                    out[(t * nv + h) * dv + j] =
                        (0..dk).map(|i| q[i] * s[i * dv + j]).sum::<f64>() as f32;
                }
            }
            for (dst, &v) in state[at..at + dk * dv].iter_mut().zip(&s) {
                *dst = v as f32;
            }
        }
    }
    out
}

/// The Gated DeltaNet's gates per token and value head: `g = -exp(a_log) · softplus(a +
/// dt_bias)` and `beta = σ(b)`, as `(g, beta)`.
pub fn delta_net_gates(
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let heads = a_log.len();
    let g = a
        .iter()
        .enumerate()
        .map(|(i, &a)| {
            let x = a as f64 + dt_bias[i % heads] as f64;
            let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
            (-(a_log[i % heads] as f64).exp() * softplus) as f32
        })
        .collect();
    let beta = b
        .iter()
        .map(|&b| (1.0 / (1.0 + (-(b as f64)).exp())) as f32)
        .collect();
    (g, beta)
}

/// Causal attention over a paged KV cache, one query row at a time in f64: token `t` of run
/// `runs[t]` at position `positions[t]` attends to its run's keys at positions `0..=` its
/// own, key `p` of run `r` in cache row `tables[r][p / block] * block + p % block` (rows of
/// `kv_heads` heads of `head_dim`); query head `h` reads KV head `h / (heads / kv_heads)`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    cache_k: &[f32],
    cache_v: &[f32],
    (positions, runs): (&[u32], &[u32]),
    (tables, blocks_per_run, block): (&[u32], usize, usize),
    (heads, kv_heads, head_dim): (usize, usize, usize),
    scale: f32,
) -> Vec<f32> {
    let kv_dim = kv_heads * head_dim;
    let mut out = vec![0.0; q.len()];
    for (t, (&pos, &run)) in positions.iter().zip(runs).enumerate() {
        let row = |p: usize| {
            let b = tables[run as usize * blocks_per_run + p / block] as usize;
            b * block + p % block
        };
        for h in 0..heads {
            let kh = h / (heads / kv_heads);
            let qh = &q[(t * heads + h) * head_dim..(t * heads + h + 1) * head_dim];
            let scores: Vec<f64> = (0..=pos as usize)
                .map(|p| {
                    let k = &cache_k[row(p) * kv_dim + kh * head_dim..][..head_dim];
                    scale as f64
                        * qh.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let total: f64 = weights.iter().sum();
            for d in 0..head_dim {
                let v: f64 = (0..=pos as usize)
                    .map(|p| weights[p] * cache_v[row(p) * kv_dim + kh * head_dim + d] as f64)
                    .sum();
                out[(t * heads + h) * head_dim + d] = (v / total) as f32;
            }
        }
    }
    out
}

/// Each penalty applied to its logit of the flattened `[rows, vocab]` logits.
pub fn logit_penalties(logits: &[f32], penalties: &[crate::sampling::Penalty]) -> Vec<f32> {
    let mut out = logits.to_vec();
    for p in penalties {
        out[p.index as usize] = p.apply(out[p.index as usize]);
    }
    out
}

/// One row's reduction as [`Ops::top_candidates`](crate::Ops::top_candidates) defines it,
/// over the finite logits only: the best [`TOP_CANDIDATES`](crate::sampling::TOP_CANDIDATES)
/// (larger logit first, ties to the lower id), the largest logit, `ln Σ exp(l)` and
/// `ln Σ exp(l / T)` (in f64), and the Gumbel-max draw `argmax(l / T + G)` (the first id of
/// the largest score).
pub fn top_candidates_row(
    row: &[f32],
    draw: crate::sampling::RowDraw,
) -> crate::sampling::RowCandidates {
    let finite: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let mut top = finite.clone();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(crate::sampling::TOP_CANDIDATES);
    let max = finite.iter().fold(f32::NEG_INFINITY, |m, &(_, l)| m.max(l));
    let lse = |scale: f64| {
        if finite.is_empty() {
            return f32::NEG_INFINITY;
        }
        let m = f64::from(max) * scale;
        let s: f64 = finite
            .iter()
            .map(|&(_, l)| (f64::from(l) * scale - m).exp())
            .sum();
        (m + s.ln()) as f32
    };
    let gumbel = draw.gumbel_key.and_then(|key| {
        let mut best: Option<(f32, u32, f32)> = None;
        for &(id, l) in &finite {
            let score = l * draw.inv_temperature + crate::sampling::gumbel_noise(key, id);
            if best.is_none_or(|(s, _, _)| score > s) {
                best = Some((score, id, l));
            }
        }
        best.map(|(_, id, l)| (id, l))
    });
    crate::sampling::RowCandidates {
        top,
        max,
        log_sum_exp: lse(1.0),
        tempered_log_sum_exp: lse(f64::from(draw.inv_temperature)),
        gumbel,
        truncated: false,
    }
}

/// Each `vocab`-wide row's first id of its largest finite logit, or
/// [`NO_FINITE_LOGIT`](crate::sampling::NO_FINITE_LOGIT).
pub fn argmax(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|row| {
            let mut best: Option<(u32, f32)> = None;
            for (id, &l) in row.iter().enumerate() {
                if l.is_finite() && best.is_none_or(|(_, b)| l > b) {
                    best = Some((id as u32, l));
                }
            }
            best.map_or(crate::sampling::NO_FINITE_LOGIT, |(id, _)| id)
        })
        .collect()
}

/// `x` rounded to the nearest fp8 e4m3 value (ties to even), saturating at ±448.
pub fn e4m3(x: f32) -> f32 {
    let a = x.abs().min(448.0);
    let r = if a < 2f32.powi(-6) {
        (a * 512.0).round_ties_even() / 512.0
    } else {
        let step = 2f32.powf(a.log2().floor() - 3.0);
        (a / step).round_ties_even() * step
    };
    r.copysign(x)
}

/// The values an fp8 KV cache holds for rows of heads of `head_dim`: each head scaled so
/// that its largest magnitude is 448, rounded to e4m3, and scaled back.
pub fn fp8_kv_rounded(values: &[f32], head_dim: usize) -> Vec<f32> {
    values
        .chunks(head_dim)
        .flat_map(|head| {
            let amax = head.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            let inv = 1.0 / scale;
            head.iter().map(move |&v| e4m3(v * inv) * scale)
        })
        .collect()
}

/// The value of the fp8 e4m3 code `b` (its NaN codes aside).
pub fn e4m3_value(b: u8) -> f32 {
    let (exp, mant) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    let magnitude = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// The values of an fp8 KV cache's rows as stored (per row, `kv_heads * head_dim` e4m3
/// codes, then each head's f32 scale, as [`kv_row_elems`](crate::kv_row_elems) lays them out).
pub fn fp8_kv_values(bytes: &[u8], kv_heads: usize, head_dim: usize) -> Vec<f32> {
    let kv_dim = kv_heads * head_dim;
    let row = crate::kv_row_elems(crate::DType::F8E4M3, kv_heads, head_dim);
    bytes
        .chunks_exact(row)
        .flat_map(|r| {
            (0..kv_heads).flat_map(move |h| {
                let at = kv_dim + 4 * h;
                let scale = f32::from_le_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]]);
                r[h * head_dim..(h + 1) * head_dim]
                    .iter()
                    .map(move |&b| e4m3_value(b) * scale)
            })
        })
        .collect()
}
