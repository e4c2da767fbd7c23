//! Where a family's weights come from: a [`Checkpoint`] on disk, or [`SyntheticWeights`]
//! made from a config alone (deterministic normal values with std 0.02 as transformers
//! initialises, norms at 1), for measuring full-size shapes without weight files.

use corral_backend::{Backend, DType, DeviceBuffer};
use rayon::prelude::*;

use crate::Result;
use crate::checkpoint::Checkpoint;

/// Weights by checkpoint name.
pub(crate) trait WeightSource {
    /// Whether `name` exists (layout detection).
    fn contains(&self, name: &str) -> bool;
    /// `name` with shape `shape` as a weight buffer, in its stored type.
    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer>;
    /// `name` with shape `shape` converted to f32 (norm weights).
    fn weight_f32(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer>;
}

impl WeightSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }

    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer> {
        Checkpoint::weight(self, backend, name, shape)
    }

    fn weight_f32(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer> {
        Checkpoint::weight_f32(self, backend, name, shape)
    }
}

/// Deterministic random weights: every tensor's values depend only on the seed and its name.
#[derive(Debug)]
pub struct SyntheticWeights {
    /// Type the matrices are stored in.
    pub dtype: DType,
    /// Seed mixed into every tensor's stream.
    pub seed: u64,
}

/// Standard deviation of synthetic matrices (transformers' `initializer_range` default).
const STD: f32 = 0.02;
/// Elements generated per parallel work item, each from its own stream.
const CHUNK: usize = 1 << 16;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl SyntheticWeights {
    /// `n` normal values with std 0.02 for tensor `name`.
    pub(crate) fn normal(&self, name: &str, n: usize) -> Vec<f32> {
        let base = self.seed ^ name_hash(name);
        let mut values = vec![0.0f32; n];
        values
            .par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut state = base ^ (c as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
                for pair in chunk.chunks_mut(2) {
                    // Box–Muller on two uniforms in (0, 1].
                    let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                    let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
                    let r = (-2.0 * u1.ln()).sqrt();
                    let theta = std::f64::consts::TAU * u2;
                    pair[0] = (r * theta.cos()) as f32 * STD;
                    if let Some(second) = pair.get_mut(1) {
                        *second = (r * theta.sin()) as f32 * STD;
                    }
                }
            });
        values
    }
}

impl WeightSource for SyntheticWeights {
    /// Experts are made in the fused layout; every other name exists when asked for.
    fn contains(&self, name: &str) -> bool {
        !name.contains(".experts.")
            || name.ends_with("experts.gate_up_proj")
            || name.ends_with("experts.down_proj")
    }

    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer> {
        let values = self.normal(name, shape.iter().product());
        Ok(backend.weight_from_f32(&values, self.dtype)?)
    }

    fn weight_f32(
        &self,
        backend: &dyn Backend,
        _name: &str,
        shape: &[usize],
    ) -> Result<DeviceBuffer> {
        let ones = vec![1.0f32; shape.iter().product()];
        Ok(backend.weight_from_f32(&ones, DType::F32)?)
    }
}
