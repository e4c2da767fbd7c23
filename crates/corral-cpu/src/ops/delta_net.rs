//! Gated DeltaNet kernels: the short causal convolution with its state, the gates, the gated
//! delta rule (token-by-token recurrence on the fp32 state), and the gated RMSNorm.

use rayon::prelude::*;

use super::elementwise::silu;

/// One run of a ragged batch: `(first token, tokens, state slot, starts fresh)`, and the
/// first of the slots that keep its state after each token but the last, if any.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) slot: usize,
    pub(crate) fresh: bool,
    pub(crate) kept: Option<usize>,
}

/// Raw pointer to per-slot state, shared by work items that touch disjoint slots and heads.
#[derive(Clone, Copy)]
struct StatePtr(*mut f32);
// SAFETY: each work item reads and writes only its own (slot, channel or head) region, and
// the batch never holds two runs with one slot (the backend checks).
#[allow(unsafe_code)]
unsafe impl Send for StatePtr {}
#[allow(unsafe_code)]
unsafe impl Sync for StatePtr {}

impl StatePtr {
    /// `len` floats at `offset`.
    ///
    /// # Safety
    /// The range is in bounds of the state buffer and no other work item uses it meanwhile.
    #[allow(unsafe_code)]
    unsafe fn slice<'a>(self, offset: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: guaranteed by the caller, as documented.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// Output pointer and length for disjoint per-(token, channel) writes.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32, usize);
// SAFETY: work items write disjoint elements.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn write(self, index: usize, value: f32) {
        assert!(index < self.1, "delta-net output index out of bounds");
        // SAFETY: in bounds (checked above); the backend rejects overlapping runs, so each
        // index is written by exactly one work item.
        #[allow(unsafe_code)]
        unsafe {
            *self.0.add(index) = value;
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_conv1d(
    x: &[f32],
    weight: &[f32],
    channels: usize,
    kernel: usize,
    runs: &[Run],
    state: &mut [f32],
    out: &mut [f32],
) {
    let hist = kernel - 1;
    let state_ptr = StatePtr(state.as_mut_ptr());
    let out_ptr = OutPtr(out.as_mut_ptr(), out.len());
    (0..runs.len() * channels).into_par_iter().for_each(|item| {
        let (run, c) = (runs[item / channels], item % channels);
        // SAFETY: slot `run.slot`, channel `c` belongs to this work item alone.
        #[allow(unsafe_code)]
        let history = unsafe { state_ptr.slice((run.slot * channels + c) * hist, hist) };
        if run.fresh {
            history.fill(0.0);
        }
        let w = &weight[c * kernel..(c + 1) * kernel];
        // The window holds the previous `hist` inputs followed by the current one.
        let mut window = [0.0f32; 16];
        window[..hist].copy_from_slice(history);
        for (i, t) in (run.start..run.start + run.len).enumerate() {
            window[hist] = x[t * channels + c];
            let y: f32 = w.iter().zip(&window[..kernel]).map(|(a, b)| a * b).sum();
            out_ptr.write(t * channels + c, silu(y));
            window.copy_within(1..kernel, 0);
            if let Some(kept) = run.kept.filter(|_| i + 1 < run.len) {
                // SAFETY: kept slots are the run's own (the backend checks), channel `c` this
                // work item's.
                #[allow(unsafe_code)]
                let after = unsafe { state_ptr.slice(((kept + i) * channels + c) * hist, hist) };
                after.copy_from_slice(&window[..hist]);
            }
        }
        history.copy_from_slice(&window[..hist]);
    });
}

pub(crate) fn gates(
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    heads: usize,
    g: &mut [f32],
    beta: &mut [f32],
) {
    g.par_chunks_mut(heads)
        .zip(beta.par_chunks_mut(heads))
        .enumerate()
        .for_each(|(t, (g, beta))| {
            for j in 0..heads {
                let x = a[t * heads + j] + dt_bias[j];
                let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
                g[j] = -a_log[j].exp() * softplus;
                beta[j] = 1.0 / (1.0 + (-b[t * heads + j]).exp());
            }
        });
}

/// `v / sqrt(Σv² + 1e-6)` into `out`.
fn l2_normalise(v: &[f32], out: &mut [f32], scale: f32) {
    let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
    for (o, x) in out.iter_mut().zip(v) {
        *o = x * inv * scale;
    }
}

/// Tokens per block of the chunked form.
const CHUNK: usize = 64;

/// One value head's inputs for a run of tokens, normalised: rows of q (scaled), k, v, and
/// the per-token gate `g` and `beta`.
#[derive(Default)]
struct HeadInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

/// A work item's inputs, outputs and working room, reused by each thread.
#[derive(Default)]
struct HeadRoom {
    x: HeadInputs,
    out: Vec<f32>,
    work: Vec<f32>,
}

thread_local! {
    static HEAD_ROOM: std::cell::RefCell<HeadRoom> = std::cell::RefCell::default();
}

/// `v` cleared and `len` zeros long.
fn zeroed(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    v.clear();
    v.resize(len, 0.0);
    v
}

/// The gated delta rule, token by token over `tokens` of `x` (decode, and the ground truth);
/// `work` is room.
#[allow(clippy::too_many_arguments)]
fn recurrence(
    x: &HeadInputs,
    tokens: std::ops::Range<usize>,
    dk: usize,
    dv: usize,
    s: &mut [f32],
    out: &mut [f32],
    work: &mut Vec<f32>,
) {
    let p = zeroed(work, dv);
    for t in tokens {
        let (q, k, v) = (
            &x.q[t * dk..(t + 1) * dk],
            &x.k[t * dk..(t + 1) * dk],
            &x.v[t * dv..(t + 1) * dv],
        );
        let decay = x.g[t].exp();
        p.fill(0.0);
        for (a, srow) in s.chunks_exact_mut(dv).enumerate() {
            for (pv, sv) in p.iter_mut().zip(srow.iter_mut()) {
                *sv *= decay;
                *pv += k[a] * *sv;
            }
        }
        for (pv, vv) in p.iter_mut().zip(v) {
            *pv = x.beta[t] * (vv - *pv);
        }
        for e in 0..dv {
            let mut acc = 0.0f32;
            for a in 0..dk {
                let sv = &mut s[a * dv + e];
                *sv += k[a] * p[e];
                acc += q[a] * *sv;
            }
            out[t * dv + e] = acc;
        }
    }
}

/// The same function in the chunked form used for prefill: per block of up to 64 tokens,
/// with cumulative log-decay γ, `A = diag(β) K Kᵀ ⊙ exp(γ_i − γ_l)` (strictly lower),
/// `U = (I + A)⁻¹ diag(β) V`, `W = (I + A)⁻¹ diag(β e^γ) K` by forward substitution,
/// `V' = U − W S`, `O = (Q e^γ) S + ((Q Kᵀ) ⊙ D) V'` and `S ← e^{γ_n} S + (K e^{γ_n − γ})ᵀ V'`;
/// `work` is room.
#[allow(clippy::too_many_arguments)]
fn chunked(
    x: &HeadInputs,
    n: usize,
    dk: usize,
    dv: usize,
    s: &mut [f32],
    out: &mut [f32],
    work: &mut Vec<f32>,
) {
    let room = zeroed(work, CHUNK + CHUNK * CHUNK + CHUNK * dv + CHUNK * dk);
    let (gamma, room) = room.split_at_mut(CHUNK);
    let (a, room) = room.split_at_mut(CHUNK * CHUNK);
    let (u, w) = room.split_at_mut(CHUNK * dv);
    for c0 in (0..n).step_by(CHUNK) {
        let m = CHUNK.min(n - c0);
        // Row `i` of the block in a `[tokens, d]` matrix.
        let row = |i: usize, d: usize| (c0 + i) * d..(c0 + i + 1) * d;
        let mut acc = 0.0f32;
        for (gm, g) in gamma.iter_mut().zip(&x.g[c0..c0 + m]) {
            acc += g;
            *gm = acc;
        }
        // A (strictly lower) and the forward substitutions for U and W.
        for i in 0..m {
            let ki = &x.k[row(i, dk)];
            for l in 0..i {
                let kl = &x.k[row(l, dk)];
                let dot: f32 = ki.iter().zip(kl).map(|(p, q)| p * q).sum();
                a[i * CHUNK + l] = x.beta[c0 + i] * dot * (gamma[i] - gamma[l]).exp();
            }
            let (b, eg) = (x.beta[c0 + i], gamma[i].exp());
            for e in 0..dv {
                u[i * dv + e] = b * x.v[(c0 + i) * dv + e];
            }
            for d in 0..dk {
                w[i * dk + d] = b * eg * ki[d];
            }
            for l in 0..i {
                let coeff = a[i * CHUNK + l];
                for e in 0..dv {
                    u[i * dv + e] -= coeff * u[l * dv + e];
                }
                for d in 0..dk {
                    w[i * dk + d] -= coeff * w[l * dk + d];
                }
            }
        }
        // V' = U − W S, kept in u.
        for i in 0..m {
            for (d, wd) in w[i * dk..(i + 1) * dk].iter().enumerate() {
                for e in 0..dv {
                    u[i * dv + e] -= wd * s[d * dv + e];
                }
            }
        }
        // O = (Q e^γ) S + ((Q Kᵀ) ⊙ D) V'.
        for i in 0..m {
            let qi = &x.q[row(i, dk)];
            let o = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
            o.fill(0.0);
            let eg = gamma[i].exp();
            for (d, qd) in qi.iter().enumerate() {
                for e in 0..dv {
                    o[e] += qd * eg * s[d * dv + e];
                }
            }
            for l in 0..=i {
                let kl = &x.k[row(l, dk)];
                let qk: f32 = qi.iter().zip(kl).map(|(p, q)| p * q).sum();
                let coeff = qk * (gamma[i] - gamma[l]).exp();
                for e in 0..dv {
                    o[e] += coeff * u[l * dv + e];
                }
            }
        }
        // S ← e^{γ_m} S + Σ_l e^{γ_m − γ_l} k_l ⊗ v'_l.
        let last = gamma[m - 1];
        let decay = last.exp();
        s.iter_mut().for_each(|v| *v *= decay);
        for l in 0..m {
            let kl = &x.k[row(l, dk)];
            let scale = (last - gamma[l]).exp();
            for (d, kd) in kl.iter().enumerate() {
                let f = scale * kd;
                for e in 0..dv {
                    s[d * dv + e] += f * u[l * dv + e];
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_rule(
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    (nk, nv, dk, dv): (usize, usize, usize, usize),
    runs: &[Run],
    state: &mut [f32],
    out: &mut [f32],
) {
    let width = 2 * nk * dk + nv * dv;
    let group = nv / nk;
    let scale = 1.0 / (dk as f32).sqrt();
    let state_ptr = StatePtr(state.as_mut_ptr());
    let out_ptr = OutPtr(out.as_mut_ptr(), out.len());
    (0..runs.len() * nv).into_par_iter().for_each(|item| {
        let (run, j) = (runs[item / nv], item % nv);
        let kh = j / group;
        // SAFETY: slot `run.slot`, value head `j` belongs to this work item alone.
        #[allow(unsafe_code)]
        let s = unsafe { state_ptr.slice((run.slot * nv + j) * dk * dv, dk * dv) };
        if run.fresh {
            s.fill(0.0);
        }
        let n = run.len;
        super::with_reused(&HEAD_ROOM, |room| {
            let HeadRoom { x, out: o, work } = room;
            zeroed(&mut x.q, n * dk);
            zeroed(&mut x.k, n * dk);
            x.v.clear();
            x.g.clear();
            x.beta.clear();
            for (i, t) in (run.start..run.start + n).enumerate() {
                let row = &qkv[t * width..(t + 1) * width];
                l2_normalise(
                    &row[kh * dk..(kh + 1) * dk],
                    &mut x.q[i * dk..(i + 1) * dk],
                    scale,
                );
                l2_normalise(
                    &row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk],
                    &mut x.k[i * dk..(i + 1) * dk],
                    1.0,
                );
                x.v.extend_from_slice(&row[2 * nk * dk + j * dv..2 * nk * dk + (j + 1) * dv]);
                x.g.push(g[t * nv + j]);
                x.beta.push(beta[t * nv + j]);
            }
            let o = zeroed(o, n * dv);
            // As transformers: the recurrence for single tokens, the chunked form otherwise;
            // a run keeping its states goes token by token, its state copied after each.
            if let Some(kept) = run.kept {
                for i in 0..n {
                    recurrence(x, i..i + 1, dk, dv, s, o, work);
                    if i + 1 < n {
                        // SAFETY: kept slots are the run's own (the backend checks), value
                        // head `j` this work item's.
                        #[allow(unsafe_code)]
                        let after =
                            unsafe { state_ptr.slice(((kept + i) * nv + j) * dk * dv, dk * dv) };
                        after.copy_from_slice(s);
                    }
                }
            } else if n == 1 {
                recurrence(x, 0..n, dk, dv, s, o, work);
            } else {
                chunked(x, n, dk, dv, s, o, work);
            }
            for (i, t) in (run.start..run.start + n).enumerate() {
                for e in 0..dv {
                    out_ptr.write((t * nv + j) * dv + e, o[i * dv + e]);
                }
            }
        });
    });
}

pub(crate) fn gated_rms_norm(
    x: &[f32],
    z: &[f32],
    w: &[f32],
    dim: usize,
    eps: f32,
    out: &mut [f32],
) {
    out.par_chunks_mut(dim).enumerate().for_each(|(r, o)| {
        let xr = &x[r * dim..(r + 1) * dim];
        let zr = &z[r * dim..(r + 1) * dim];
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() / dim as f32 + eps).sqrt();
        for i in 0..dim {
            o[i] = w[i] * xr[i] * inv * silu(zr[i]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// The chunked form (prefill) and the recurrence (decode) compute the same outputs
        /// and final state, across chunk boundaries and with a non-zero incoming state.
        #[test]
        fn chunked_form_equals_recurrence(
            n in 1usize..150, dk in 1usize..12, dv in 1usize..12, seed in any::<u64>(),
            strong_decay in any::<bool>(),
        ) {
            let mut st = seed | 1;
            let mut next = || {
                st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((st >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            };
            let mut unit = |len: usize| -> Vec<f32> {
                let v: Vec<f32> = (0..len).map(|_| next()).collect();
                let mut out = vec![0.0; len];
                l2_normalise(&v, &mut out, 1.0);
                out
            };
            let mut x = HeadInputs { q: Vec::new(), k: Vec::new(), v: Vec::new(), g: Vec::new(), beta: Vec::new() };
            for _ in 0..n {
                x.q.extend(unit(dk).iter().map(|v| v / (dk as f32).sqrt()));
                x.k.extend(unit(dk));
            }
            let mut r = seed.rotate_left(17) | 1;
            let mut rnd = || {
                r = r.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (r >> 40) as f32 / (1u64 << 24) as f32
            };
            x.v = (0..n * dv).map(|_| rnd() - 0.5).collect();
            x.g = (0..n).map(|_| -rnd() * if strong_decay { 8.0 } else { 0.3 }).collect();
            x.beta = (0..n).map(|_| rnd()).collect();
            let s0: Vec<f32> = (0..dk * dv).map(|_| rnd() - 0.5).collect();
            let (mut s_rec, mut s_chunk) = (s0.clone(), s0);
            let (mut o_rec, mut o_chunk) = (vec![0.0; n * dv], vec![0.0; n * dv]);
            recurrence(&x, 0..n, dk, dv, &mut s_rec, &mut o_rec, &mut Vec::new());
            chunked(&x, n, dk, dv, &mut s_chunk, &mut o_chunk, &mut Vec::new());
            for (a, b) in o_rec.iter().zip(&o_chunk).chain(s_rec.iter().zip(&s_chunk)) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{} vs {}", a, b);
            }
        }
    }
}
