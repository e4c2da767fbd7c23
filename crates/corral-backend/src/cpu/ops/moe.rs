//! Softmax top-k routing and the per-(token, expert) expert FFN.

use rayon::prelude::*;

use super::elementwise::silu;
use super::{WeightRows, dot, with_scratch};

/// Output rows per work item of the expert matrix-vector products.
const ROW_TILE: usize = 64;

/// Softmax over each token's `num_experts` logits, then its `top_k` largest probabilities
/// (ties to the lower expert id), optionally renormalised to sum 1.
pub(crate) fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    ids.par_chunks_mut(top_k)
        .zip(weights.par_chunks_mut(top_k))
        .zip(logits.par_chunks(num_experts))
        .for_each(|((ids, weights), l)| {
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = l.iter().map(|v| (v - max).exp()).sum();
            for j in 0..top_k {
                let mut best = usize::MAX;
                for (e, &v) in l.iter().enumerate() {
                    let better = best == usize::MAX || v > l[best];
                    if better && !ids[..j].contains(&(e as u32)) {
                        best = e;
                    }
                }
                ids[j] = best as u32;
                weights[j] = (l[best] - max).exp() / sum;
            }
            if renormalize {
                let total: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= total);
            }
        });
}

/// One projection of all experts: a weight store plus expert `e`'s element offset.
pub(crate) struct ExpertProj<'a> {
    pub(crate) offsets: &'a [usize],
    pub(crate) rows: &'a [WeightRows<'a>],
}

/// `act[p] = silu(gate[e] x[t]) ⊙ up[e] x[t]` for every (token t, slot j) pair p = t*k + j.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gate_up(
    x: &[f32],
    hidden: usize,
    ids: &[u32],
    top_k: usize,
    gate: &ExpertProj<'_>,
    up: &ExpertProj<'_>,
    inter: usize,
    act: &mut [f32],
) {
    act.par_chunks_mut(inter).enumerate().for_each(|(p, a)| {
        let e = ids[p] as usize;
        let xt = &x[(p / top_k) * hidden..(p / top_k + 1) * hidden];
        a.par_chunks_mut(ROW_TILE)
            .enumerate()
            .for_each(|(tile, a)| {
                with_scratch(hidden, |row| {
                    for (i, a) in a.iter_mut().enumerate() {
                        let r = tile * ROW_TILE + i;
                        gate.rows[e].to_f32(gate.offsets[e] + r * hidden, row);
                        let g = dot(xt, row);
                        up.rows[e].to_f32(up.offsets[e] + r * hidden, row);
                        let u = dot(xt, row);
                        *a = silu(g) * u;
                    }
                });
            });
    });
}

/// `out[t] = Σ_j w[t,j] · down[e] act[t*k + j]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn down_combine(
    act: &[f32],
    inter: usize,
    ids: &[u32],
    weights: &[f32],
    top_k: usize,
    down: &ExpertProj<'_>,
    hidden: usize,
    out: &mut [f32],
) {
    out.par_chunks_mut(hidden).enumerate().for_each(|(t, o)| {
        o.par_chunks_mut(ROW_TILE)
            .enumerate()
            .for_each(|(tile, o)| {
                with_scratch(inter, |row| {
                    o.fill(0.0);
                    for j in 0..top_k {
                        let p = t * top_k + j;
                        let e = ids[p] as usize;
                        let a = &act[p * inter..(p + 1) * inter];
                        for (i, o) in o.iter_mut().enumerate() {
                            let r = tile * ROW_TILE + i;
                            down.rows[e].to_f32(down.offsets[e] + r * inter, row);
                            *o += weights[p] * dot(a, row);
                        }
                    }
                });
            });
    });
}
