//! Gated DeltaNet kernels: the short causal convolution with its state, the gates, the gated
//! delta rule (token-by-token recurrence on the fp32 state), and the gated RMSNorm.

use rayon::prelude::*;

use super::elementwise::silu;

/// One run of a ragged batch: `(first token, tokens, state slot, starts fresh)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) slot: usize,
    pub(crate) fresh: bool,
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

/// Output pointer for disjoint per-(token, channel) writes.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: work items write disjoint elements.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn write(self, index: usize, value: f32) {
        // SAFETY: callers write each in-bounds index from exactly one work item.
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
    let out_ptr = OutPtr(out.as_mut_ptr());
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
        for t in run.start..run.start + run.len {
            window[hist] = x[t * channels + c];
            let y: f32 = w.iter().zip(&window[..kernel]).map(|(a, b)| a * b).sum();
            out_ptr.write(t * channels + c, silu(y));
            window.copy_within(1..kernel, 0);
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
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..runs.len() * nv).into_par_iter().for_each(|item| {
        let (run, j) = (runs[item / nv], item % nv);
        let kh = j / group;
        // SAFETY: slot `run.slot`, value head `j` belongs to this work item alone.
        #[allow(unsafe_code)]
        let s = unsafe { state_ptr.slice((run.slot * nv + j) * dk * dv, dk * dv) };
        if run.fresh {
            s.fill(0.0);
        }
        let mut q = vec![0.0f32; dk];
        let mut k = vec![0.0f32; dk];
        let mut p = vec![0.0f32; dv];
        for t in run.start..run.start + run.len {
            let row = &qkv[t * width..(t + 1) * width];
            l2_normalise(&row[kh * dk..(kh + 1) * dk], &mut q, scale);
            l2_normalise(
                &row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk],
                &mut k,
                1.0,
            );
            let v = &row[2 * nk * dk + j * dv..2 * nk * dk + (j + 1) * dv];
            let decay = g[t * nv + j].exp();
            let b = beta[t * nv + j];
            p.fill(0.0);
            for (a, srow) in s.chunks_exact_mut(dv).enumerate() {
                for (pv, sv) in p.iter_mut().zip(srow.iter_mut()) {
                    *sv *= decay;
                    *pv += k[a] * *sv;
                }
            }
            for (pv, vv) in p.iter_mut().zip(v) {
                *pv = b * (vv - *pv);
            }
            for e in 0..dv {
                let mut acc = 0.0f32;
                for a in 0..dk {
                    let sv = &mut s[a * dv + e];
                    *sv += k[a] * p[e];
                    acc += q[a] * *sv;
                }
                out_ptr.write((t * nv + j) * dv + e, acc);
            }
        }
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
