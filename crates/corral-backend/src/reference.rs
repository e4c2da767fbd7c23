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
