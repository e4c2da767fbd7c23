//! Rotate-half (GPT-NeoX) rotary embedding on the first `rotary_dim` dims of each head.

use rayon::prelude::*;

use corral_backend::RopeParams;

/// Largest supported rotary dimension (head dims in these families are at most 256).
pub(crate) const MAX_ROTARY_DIM: usize = 512;

pub(crate) fn rope(
    x: &mut [f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    params: RopeParams,
) {
    let freqs = Frequencies::new(params, rotary_dim);
    x.par_chunks_mut(heads * head_dim)
        .zip(positions.par_iter())
        .for_each(|(row, &pos)| rotate_heads(row, pos, head_dim, rotary_dim, &freqs));
}

/// RoPE's inverse frequencies for `rotary_dim` (the first half of the array) and the factor
/// on cos and sin (YaRN's attention factor; 1 otherwise).
pub(crate) struct Frequencies {
    inv_freq: [f32; MAX_ROTARY_DIM / 2],
    scale: f32,
}

impl Frequencies {
    pub(crate) fn new(params: RopeParams, rotary_dim: usize) -> Self {
        // YaRN's blend bounds once for the layer, not once a pair.
        let args = params.args(rotary_dim);
        let mut inv_freq = [0.0f32; MAX_ROTARY_DIM / 2];
        for (i, f) in inv_freq.iter_mut().take(rotary_dim / 2).enumerate() {
            *f = args.inverse_frequency(i, rotary_dim);
        }
        Self {
            inv_freq,
            scale: params.attention_factor(),
        }
    }
}

/// Rotates every head of `row` (heads of `head_dim`) at position `pos`.
pub(crate) fn rotate_heads(
    row: &mut [f32],
    pos: u32,
    head_dim: usize,
    rotary_dim: usize,
    freqs: &Frequencies,
) {
    let half = rotary_dim / 2;
    let mut cos = [0.0f32; MAX_ROTARY_DIM / 2];
    let mut sin = [0.0f32; MAX_ROTARY_DIM / 2];
    for i in 0..half {
        let angle = pos as f32 * freqs.inv_freq[i];
        cos[i] = angle.cos() * freqs.scale;
        sin[i] = angle.sin() * freqs.scale;
    }
    for head in row.chunks_mut(head_dim) {
        let (x1, rest) = head.split_at_mut(half);
        let x2 = &mut rest[..half];
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}
