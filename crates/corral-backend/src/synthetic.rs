//! Deterministic normal values for synthetic weights. Every backend makes the same streams:
//! element `g` lies in chunk `g >> 16`, whose splitmix64 stream starts at
//! `seed ^ (chunk * 0xD6E8_FEB8_6659_FD93)`; each pair of elements takes the stream's next
//! two outputs through Box–Muller. The CUDA kernel computes any output of a stream directly.

use rayon::prelude::*;

/// Elements per stream.
pub const CHUNK: usize = 1 << 16;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` normal values with standard deviation `std`, from the streams of `seed`.
pub fn normal_values(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut values = vec![0.0f32; n];
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut state = seed ^ (c as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            for pair in chunk.chunks_mut(2) {
                // Box–Muller on two uniforms in (0, 1].
                let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                let r = (-2.0 * u1.ln()).sqrt();
                let theta = std::f64::consts::TAU * u2;
                pair[0] = (r * theta.cos()) as f32 * std;
                if let Some(second) = pair.get_mut(1) {
                    *second = (r * theta.sin()) as f32 * std;
                }
            }
        });
    values
}
