//! Element-wise kernels: residual add, SwiGLU activation, row gathers, embedding lookup.

use rayon::prelude::*;

use super::WeightRows;

/// Elements per work item of element-wise kernels.
const CHUNK: usize = 4096;

pub(crate) fn add_in_place(acc: &mut [f32], x: &[f32]) {
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

pub(crate) fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(*g) * u;
            }
        });
}

pub(crate) fn gather_rows(x: &[f32], rows: &[u32], dim: usize, out: &mut [f32]) {
    out.par_chunks_mut(dim)
        .zip(rows.par_iter())
        .for_each(|(o, &r)| o.copy_from_slice(&x[r as usize * dim..(r as usize + 1) * dim]));
}

pub(crate) fn embedding(
    table: WeightRows<'_>,
    offset: usize,
    ids: &[u32],
    dim: usize,
    out: &mut [f32],
) {
    out.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .for_each(|(o, &id)| table.to_f32(offset + id as usize * dim, o));
}

pub(crate) fn sigmoid_mul(x: &[f32], gate: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(gate.par_chunks(CHUNK)))
        .for_each(|(o, (x, g))| {
            for ((o, x), g) in o.iter_mut().zip(x).zip(g) {
                *o = x / (1.0 + (-g).exp());
            }
        });
}

pub(crate) fn add_sigmoid_gated(acc: &mut [f32], x: &[f32], gate: &[f32], dim: usize) {
    acc.par_chunks_mut(dim).enumerate().for_each(|(t, a)| {
        let s = 1.0 / (1.0 + (-gate[t]).exp());
        for (a, x) in a.iter_mut().zip(&x[t * dim..(t + 1) * dim]) {
            *a += s * x;
        }
    });
}
