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
