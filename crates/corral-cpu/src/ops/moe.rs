//! Softmax top-k routing and the per-(token, expert) expert FFN.

use rayon::prelude::*;

use std::cell::RefCell;

use super::elementwise::silu;
use super::matmul::{
    OutPtr, bf16_in_place, gemm_min_rows, multiply_bf16, multiply_quantized, multiply_streaming,
    multiply_widened, panels, to_bf16_lane_order, with_bf16_lane_order,
};
use super::quant_dot::{self, ActBlocks, QA, QuantizedRows};
use super::{WeightRows, with_reused, with_scratch};

/// Output rows per work item of the expert matrix-vector products.
const ROW_TILE: usize = 64;

thread_local! {
    /// The per-token experts' activations, quantized once for every expert that reads them.
    static EXPERT_ACTS: RefCell<QuantizedRows> = RefCell::default();
    /// The grouped ops' work items.
    static GROUP_ITEMS: RefCell<Vec<GroupItem>> = const { RefCell::new(Vec::new()) };
    /// The grouped experts' input rows in sorted order, for quantizing them once.
    static GATHERED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `rows × k` values of `x` quantized for integer products when every expert of
/// `projs` has them ([`quant_dot::supports`]), else with `None`: the per-token products then
/// quantize each row once, not once per expert and tile.
fn with_expert_acts<R>(
    x: &[f32],
    (rows, k): (usize, usize),
    projs: &[&ExpertProj<'_>],
    f: impl FnOnce(Option<&QuantizedRows>) -> R,
) -> R {
    if !k.is_multiple_of(QA) || !integer_products(projs) {
        return f(None);
    }
    let format = |w: &WeightRows<'_>| match w {
        WeightRows::Quant(q, _) => Some(*q),
        _ => None,
    };
    let supers = ActBlocks::of(
        projs
            .iter()
            .flat_map(|p| p.all_rows().filter_map(|w| format(&w))),
    );
    with_reused(&EXPERT_ACTS, |acts| {
        acts.quantize(x, rows, k, supers);
        f(Some(acts))
    })
}

/// Whether every expert of `projs` has weights with integer dot products
/// ([`quant_dot::supports`]), whose activations are quantized once for all of them.
fn integer_products(projs: &[&ExpertProj<'_>]) -> bool {
    let integer =
        |w: &WeightRows<'_>| matches!(w, WeightRows::Quant(q, _) if quant_dot::supports(*q));
    projs.iter().all(|p| p.all_rows().all(|w| integer(&w)))
}

/// Softmax over each token's `num_experts` logits, then its `top_k` largest probabilities
/// (ties to the lower expert id), optionally renormalised to sum 1. With `shared_gate`, each
/// row holds one more logit, a shared expert's gate, and each token one more choice: expert
/// `num_experts` weighted sigmoid(that logit).
pub(crate) fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
    shared_gate: bool,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    let (row, choices) = (
        num_experts + shared_gate as usize,
        top_k + shared_gate as usize,
    );
    ids.par_chunks_mut(choices)
        .zip(weights.par_chunks_mut(choices))
        .zip(logits.par_chunks(row))
        .for_each(|((ids, weights), row)| {
            let l = &row[..num_experts];
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
                let total: f32 = weights[..top_k].iter().sum();
                weights[..top_k].iter_mut().for_each(|w| *w /= total);
            }
            if shared_gate {
                ids[top_k] = num_experts as u32;
                weights[top_k] = 1.0 / (1.0 + (-row[num_experts]).exp());
            }
        });
}

/// One projection of all experts: expert `e`'s weight store and element offset in it.
pub(crate) struct ExpertProj<'a> {
    matrices: &'a corral_backend::ExpertMatrices,
    op: &'static str,
}

impl<'a> ExpertProj<'a> {
    /// `matrices`, every expert's weights checked for `op`: a CPU buffer of a weight type,
    /// block formats whole blocks.
    pub(crate) fn new(
        op: &'static str,
        matrices: &'a corral_backend::ExpertMatrices,
    ) -> corral_backend::Result<Self> {
        for e in 0..matrices.num_experts() {
            super::super::weight_rows(op, matrices.view(e).buffer)?;
        }
        Ok(Self { matrices, op })
    }

    /// Expert `e`'s weights.
    pub(crate) fn rows(&self, e: usize) -> WeightRows<'a> {
        super::super::weight_rows(self.op, self.matrices.view(e).buffer)
            .expect("every expert's weights were checked by ExpertProj::new")
    }

    /// The offset of expert `e`'s first row in [`ExpertProj::rows`].
    pub(crate) fn offset(&self, e: usize) -> usize {
        self.matrices.view(e).offset
    }

    /// Every expert's weights.
    pub(crate) fn all_rows(&self) -> impl Iterator<Item = WeightRows<'a>> + '_ {
        (0..self.matrices.num_experts()).map(|e| self.rows(e))
    }
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
    let tokens = ids.len() / top_k.max(1);
    with_expert_acts(x, (tokens, hidden), &[gate, up], |acts| {
        act.par_chunks_mut(inter).enumerate().for_each(|(p, a)| {
            let (e, t) = (ids[p] as usize, p / top_k);
            let xt = &x[t * hidden..(t + 1) * hidden];
            a.par_chunks_mut(ROW_TILE)
                .enumerate()
                .for_each(|(tile, a)| {
                    with_scratch(hidden + 2 * ROW_TILE, |scratch| {
                        let (row, rest) = scratch.split_at_mut(hidden);
                        let (g, u) = rest.split_at_mut(ROW_TILE);
                        let (n, first) = (a.len(), tile * ROW_TILE * hidden);
                        let (g_out, u_out) = (OutPtr::new(g), OutPtr::new(u));
                        let (g_off, u_off) = (gate.offset(e) + first, up.offset(e) + first);
                        let (gw, uw) = (gate.rows(e), up.rows(e));
                        if let Some(acts) = acts {
                            let xq = acts.rows_from(t);
                            multiply_quantized(xq, 1, hidden, gw, g_off, n, g_out, n, row);
                            multiply_quantized(xq, 1, hidden, uw, u_off, n, u_out, n, row);
                        } else {
                            multiply_streaming(xt, 1, hidden, gw, g_off, n, g_out, n, row);
                            multiply_streaming(xt, 1, hidden, uw, u_off, n, u_out, n, row);
                        }
                        for (a, (g, u)) in a.iter_mut().zip(g.iter().zip(u.iter())) {
                            *a = silu(*g) * u;
                        }
                    });
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
    with_expert_acts(act, (ids.len(), inter), &[down], |acts| {
        out.par_chunks_mut(hidden).enumerate().for_each(|(t, o)| {
            o.par_chunks_mut(ROW_TILE)
                .enumerate()
                .for_each(|(tile, o)| {
                    with_scratch(inter + ROW_TILE, |scratch| {
                        let (row, y) = scratch.split_at_mut(inter);
                        let n = o.len();
                        o.fill(0.0);
                        for j in 0..top_k {
                            let p = t * top_k + j;
                            let e = ids[p] as usize;
                            let (w, y_out) = (down.rows(e), OutPtr::new(y));
                            let off = down.offset(e) + tile * ROW_TILE * inter;
                            if let Some(acts) = acts {
                                let aq = acts.rows_from(p);
                                multiply_quantized(aq, 1, inter, w, off, n, y_out, n, row);
                            } else {
                                let a = &act[p * inter..(p + 1) * inter];
                                multiply_streaming(a, 1, inter, w, off, n, y_out, n, row);
                            }
                            for (o, y) in o.iter_mut().zip(&y[..n]) {
                                *o += weights[p] * y;
                            }
                        }
                    });
                });
        });
    });
}

/// Counting sort of (token, slot) pairs by expert: `offsets[e]..offsets[e + 1]` are expert
/// `e`'s sorted positions, `sorted[s]` is the pair at position `s` (pairs of one expert in
/// token order), `positions[p]` the position of pair `p`.
pub(crate) fn sort_by_expert(
    ids: &[u32],
    offsets: &mut [u32],
    sorted: &mut [u32],
    positions: &mut [u32],
) {
    let num_experts = offsets.len() - 1;
    offsets.fill(0);
    for &e in ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        offsets[e + 1] += offsets[e];
    }
    // Use offsets[e] as expert e's write cursor, then shift the array back into place.
    for (p, &e) in ids.iter().enumerate() {
        let s = offsets[e as usize] as usize;
        offsets[e as usize] += 1;
        sorted[s] = p as u32;
        positions[p] = s as u32;
    }
    for e in (1..=num_experts).rev() {
        offsets[e] = offsets[e - 1];
    }
    offsets[0] = 0;
}

/// Rows of sorted pairs per grouped work item.
const GROUP_ROWS: usize = 64;
/// Weight rows per grouped work item.
const GROUP_COLS: usize = 64;

/// A grouped work item: an expert, its sorted pairs `r0..r1` and output columns `c0..c1`.
type GroupItem = (usize, (usize, usize), (usize, usize));

/// The work items of a grouped op over experts with pairs, `cols` output columns.
fn group_items(offsets: &[u32], cols: usize, items: &mut Vec<GroupItem>) {
    items.clear();
    for e in 0..offsets.len() - 1 {
        let (start, end) = (offsets[e] as usize, offsets[e + 1] as usize);
        for r0 in (start..end).step_by(GROUP_ROWS) {
            for c0 in (0..cols).step_by(GROUP_COLS) {
                let (r1, c1) = ((r0 + GROUP_ROWS).min(end), (c0 + GROUP_COLS).min(cols));
                items.push((e, (r0, r1), (c0, c1)));
            }
        }
    }
}

/// Experts with at least one pair.
pub(crate) fn experts_hit(offsets: &[u32]) -> usize {
    offsets.windows(2).filter(|w| w[1] > w[0]).count()
}

/// `hit[0]` = the number of experts with pairs, then their ids ascending (the rest is 0).
pub(crate) fn list_hit_experts(offsets: &[u32], hit: &mut [u32]) {
    hit.fill(0);
    let mut n = 0;
    for (e, w) in offsets.windows(2).enumerate() {
        if w[1] > w[0] {
            n += 1;
            hit[n] = e as u32;
        }
    }
    hit[0] = n as u32;
}

/// Grouped gate/up and activation over all experts at once:
/// `act[s] = silu(gate[e] x[t]) ⊙ up[e] x[t]` for each sorted position `s` of pair
/// `(t, j)` routed to expert `e`. Work items are (expert, pair tile, intermediate tile).
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_gate_up(
    x: &[f32],
    hidden: usize,
    top_k: usize,
    offsets: &[u32],
    sorted: &[u32],
    gate: &ExpertProj<'_>,
    up: &ExpertProj<'_>,
    inter: usize,
    act: &mut [f32],
) {
    let out = OutPtr::new(act);
    with_reused(&GROUP_ITEMS, |items| {
        group_items(offsets, inter, items);
        let items: &[GroupItem] = items;
        let pairs = offsets[offsets.len() - 1] as usize;
        // The work items, the pairs' rows quantized in sorted order (`acts`) or not.
        let run_items = |acts: Option<&QuantizedRows>| {
            items.par_iter().for_each(|&(e, (r0, r1), (c0, c1))| {
                let (rows, cols) = (r1 - r0, c1 - c0);
                let (gw, uw) = (gate.rows(e), up.rows(e));
                let streaming = rows < gemm_min_rows(gw);
                // bf16 gate and up read in place, the rows gathered in their lane order.
                let bf16 = bf16_in_place(gw).zip(bf16_in_place(uw));
                // Only weights decoded to f32 panels need room for them.
                let f32_panels = acts.is_none() && bf16.is_none() && !streaming;
                let weight_scratch = if f32_panels {
                    2 * cols * hidden
                } else {
                    hidden
                };
                with_scratch(
                    rows * hidden + weight_scratch + 2 * rows * cols,
                    |scratch| {
                        let (xs, rest) = scratch.split_at_mut(rows * hidden);
                        let (wbuf, rest) = rest.split_at_mut(weight_scratch);
                        let (g, u) = rest.split_at_mut(rows * cols);
                        for (i, s) in (r0..r1).enumerate().filter(|_| acts.is_none()) {
                            let t = sorted[s] as usize / top_k;
                            let (from, to) = (
                                &x[t * hidden..(t + 1) * hidden],
                                &mut xs[i * hidden..(i + 1) * hidden],
                            );
                            match bf16 {
                                Some(_) => to_bf16_lane_order(from, to),
                                None => to.copy_from_slice(from),
                            }
                        }
                        let (g_ptr, u_ptr) = (OutPtr::new(g), OutPtr::new(u));
                        let (g_off, u_off) =
                            (gate.offset(e) + c0 * hidden, up.offset(e) + c0 * hidden);
                        if let (None, Some((gb, ub))) = (acts, bf16) {
                            multiply_bf16(xs, rows, hidden, gb, g_off, cols, g_ptr, cols);
                            multiply_bf16(xs, rows, hidden, ub, u_off, cols, u_ptr, cols);
                        } else if let Some(acts) = acts {
                            let xq = acts.rows_from(r0);
                            multiply_quantized(
                                xq, rows, hidden, gw, g_off, cols, g_ptr, cols, wbuf,
                            );
                            multiply_quantized(
                                xq, rows, hidden, uw, u_off, cols, u_ptr, cols, wbuf,
                            );
                        } else if streaming {
                            multiply_streaming(
                                xs, rows, hidden, gw, g_off, cols, g_ptr, cols, wbuf,
                            );
                            multiply_streaming(
                                xs, rows, hidden, uw, u_off, cols, u_ptr, cols, wbuf,
                            );
                        } else {
                            let (wg, wu) = wbuf.split_at_mut(cols * hidden);
                            multiply_widened(xs, rows, hidden, gw, g_off, cols, g_ptr, cols, wg);
                            multiply_widened(xs, rows, hidden, uw, u_off, cols, u_ptr, cols, wu);
                        }
                        for i in 0..rows {
                            for j in 0..cols {
                                let v = silu(g[i * cols + j]) * u[i * cols + j];
                                // SAFETY: (r0 + i, c0 + j) lies in this item's own tile of `act`.
                                #[allow(unsafe_code)]
                                unsafe {
                                    *out.offset((r0 + i) * inter + c0 + j).as_ptr() = v;
                                }
                            }
                        }
                    },
                );
            });
        };
        if !integer_throughout(offsets, &[gate, up]) {
            return run_items(None);
        }
        // Every expert's products are integer ones: quantize the pairs' rows once (gathered in
        // sorted order), not once for each item's gate and up.
        let run = |gathered: &mut Vec<f32>| {
            gathered.clear();
            for &p in &sorted[..pairs] {
                let t = p as usize / top_k;
                gathered.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
            with_expert_acts(gathered, (pairs, hidden), &[gate, up], run_items)
        };
        with_reused(&GATHERED, run)
    })
}

/// Grouped down projection with the routing weight: `y[s] = w[p] · down[e] act[s]` for the
/// pair `p` at sorted position `s`. Work items are (expert, pair tile, hidden tile).
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_down(
    act: &[f32],
    inter: usize,
    weights: &[f32],
    offsets: &[u32],
    sorted: &[u32],
    down: &ExpertProj<'_>,
    hidden: usize,
    y: &mut [f32],
) {
    let out = OutPtr::new(y);
    with_reused(&GROUP_ITEMS, |items| {
        group_items(offsets, hidden, items);
        let items: &[GroupItem] = items;
        let pairs = offsets[offsets.len() - 1] as usize;
        // The work items: the act rows quantized (`acts`), or all in bf16 lane order
        // (`ordered`), or neither.
        let run_items = |acts: Option<&QuantizedRows>, ordered: Option<&[f32]>| {
            items.par_iter().for_each(|&(e, (r0, r1), (c0, c1))| {
                let (rows, cols) = (r1 - r0, c1 - c0);
                let tile = out.offset(r0 * hidden + c0);
                let a = &act[r0 * inter..r1 * inter];
                let (dw, d_off) = (down.rows(e), down.offset(e) + c0 * inter);
                if let Some(acts) = acts {
                    let aq = acts.rows_from(r0);
                    with_scratch(inter, |row| {
                        multiply_quantized(aq, rows, inter, dw, d_off, cols, tile, hidden, row)
                    });
                } else if let (Some(ap), Some(bits)) = (ordered, bf16_in_place(dw)) {
                    let ap = &ap[r0 * inter..r1 * inter];
                    multiply_bf16(ap, rows, inter, bits, d_off, cols, tile, hidden)
                } else if rows < gemm_min_rows(dw) {
                    with_scratch(inter, |row| {
                        multiply_streaming(a, rows, inter, dw, d_off, cols, tile, hidden, row)
                    });
                } else {
                    with_scratch(cols * inter, |wd| {
                        multiply_widened(a, rows, inter, dw, d_off, cols, tile, hidden, wd)
                    });
                }
                for s in r0..r1 {
                    let w = weights[sorted[s] as usize];
                    for c in c0..c1 {
                        // SAFETY: (s, c) lies in this item's own tile of `y`.
                        #[allow(unsafe_code)]
                        unsafe {
                            *out.offset(s * hidden + c).as_ptr() *= w;
                        }
                    }
                }
            });
        };
        // The act rows quantized, or put in bf16 lane order, once, not for each item.
        if integer_throughout(offsets, &[down]) {
            with_expert_acts(act, (pairs, inter), &[down], |acts| run_items(acts, None))
        } else if down.all_rows().all(|w| bf16_in_place(w).is_some()) {
            with_bf16_lane_order(act, pairs, inter, |ap| run_items(None, Some(ap)))
        } else {
            run_items(None, None)
        }
    })
}

/// Whether every expert with pairs multiplies `projs` by integer products: their weights have
/// them ([`quant_dot::supports`]), and each expert has fewer rows than its weights' panels take
/// ([`gemm_min_rows`]) or integer panels ([`panels`]). Their rows are then quantized once.
fn integer_throughout(offsets: &[u32], projs: &[&ExpertProj<'_>]) -> bool {
    integer_products(projs)
        && projs.iter().all(|proj| {
            offsets.windows(2).zip(proj.all_rows()).all(|(o, w)| {
                let rows = (o[1] - o[0]) as usize;
                rows < gemm_min_rows(w) || panels(w)
            })
        })
}

/// Back to token order: `out[t] = Σ_j y[positions[t * k + j]]`, summed in slot order.
pub(crate) fn combine(y: &[f32], positions: &[u32], top_k: usize, hidden: usize, out: &mut [f32]) {
    out.par_chunks_mut(hidden).enumerate().for_each(|(t, o)| {
        o.fill(0.0);
        for j in 0..top_k {
            let s = positions[t * top_k + j] as usize;
            for (o, v) in o.iter_mut().zip(&y[s * hidden..(s + 1) * hidden]) {
                *o += v;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_experts_lists_each_expert_with_pairs_once_in_order() {
        let ids = [5u32, 0, 5, 2, 0, 5];
        let (mut offsets, mut sorted, mut positions) = ([0u32; 8], [0u32; 6], [0u32; 6]);
        sort_by_expert(&ids, &mut offsets, &mut sorted, &mut positions);
        let mut hit = [9u32; 8];
        list_hit_experts(&offsets, &mut hit);
        assert_eq!(hit, [3, 0, 2, 5, 0, 0, 0, 0]);
    }
}
