//! Where a family's weights come from: a [`Checkpoint`] on disk, or [`SyntheticWeights`]
//! made from a config alone (deterministic normal values with std 0.02 as transformers
//! initialises, norms at 1), for measuring full-size shapes without weight files.

use corral_backend::{Backend, DType, DeviceBuffer, WeightView};

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
    ) -> Result<DeviceBuffer> {
        Ok(backend.weight_from_f32(&self.read_f32(name, shape)?, DType::F32)?)
    }

    /// `name`'s values on the host, as f32.
    fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;

    /// The type `name` is stored in.
    fn stored_dtype(&self, name: &str) -> Result<DType>;

    /// The matrices `parts` (name, shape) stacked along their rows into one weight, in their
    /// stored type (which they must share): one projection where the checkpoint has several.
    fn weight_stacked(
        &self,
        backend: &dyn Backend,
        parts: &[(&str, &[usize])],
    ) -> Result<DeviceBuffer> {
        stacked_values(self, backend, parts)
    }

    /// The matrices `parts` as one projection: stacked ([`WeightSource::weight_stacked`]), or
    /// apart where the source keeps each in a stored type they do not share.
    fn projection(&self, backend: &dyn Backend, parts: &[(&str, &[usize])]) -> Result<Projection> {
        Ok(Projection::Stacked(self.weight_stacked(backend, parts)?))
    }

    /// Rows `rows` (in that order) of the matrix `name` (first axis rows, the rest columns),
    /// as a weight in its stored type: for layouts that interleave what Corral keeps apart.
    fn weight_rows(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        rows: &[usize],
    ) -> Result<DeviceBuffer> {
        let values = self.read_f32(name, shape)?;
        let cols: usize = shape[1..].iter().product();
        let mut picked = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            picked.extend_from_slice(&values[r * cols..(r + 1) * cols]);
        }
        Ok(backend.weight_from_f32(&picked, self.stored_dtype(name)?)?)
    }
}

/// A projection of several matrices (q, k and v) whose outputs sit side by side in one row.
#[derive(Debug)]
pub(crate) enum Projection {
    /// The matrices stacked along their rows into one weight.
    Stacked(DeviceBuffer),
    /// Each matrix and its rows, in order.
    Parts(Vec<(DeviceBuffer, usize)>),
}

impl Projection {
    /// `out = x · wᵀ` for `tokens` rows of `x` (`cols` wide) and the projection's `rows`.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        x: &DeviceBuffer,
        tokens: usize,
        (rows, cols): (usize, usize),
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        match self {
            Projection::Stacked(w) => {
                backend.matmul(x, tokens, WeightView::new(w, rows, cols)?, out)?;
            }
            Projection::Parts(parts) => {
                let mut first = 0;
                for (w, part_rows) in parts {
                    let view = WeightView::new(w, *part_rows, cols)?;
                    backend.matmul_columns(x, tokens, view, out, rows, first)?;
                    first += part_rows;
                }
            }
        }
        Ok(())
    }
}

/// [`WeightSource::weight_stacked`] through the parts' values: decoded, stacked, and stored
/// again in their shared stored type.
pub(crate) fn stacked_values<S: WeightSource + ?Sized>(
    source: &S,
    backend: &dyn Backend,
    parts: &[(&str, &[usize])],
) -> Result<DeviceBuffer> {
    let first = first_part(parts)?;
    let dtype = source.stored_dtype(first)?;
    let mut values = Vec::new();
    for &(name, shape) in parts {
        let stored = source.stored_dtype(name)?;
        if stored != dtype {
            return Err(crate::ModelError::Unsupported(format!(
                "{name} is stored as {stored}, {first} as {dtype}: they cannot share one projection"
            )));
        }
        values.extend(source.read_f32(name, shape)?);
    }
    Ok(backend.weight_from_f32(&values, dtype)?)
}

/// The name of the first of the matrices to stack (there must be one).
fn first_part<'a>(parts: &[(&'a str, &[usize])]) -> Result<&'a str> {
    parts
        .first()
        .map(|&(name, _)| name)
        .ok_or_else(|| crate::ModelError::Unsupported("stacking no matrices".to_string()))
}

impl WeightSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }

    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer> {
        Checkpoint::weight(self, backend, name, shape)
    }

    fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Checkpoint::read_f32(self, name, shape)
    }

    fn stored_dtype(&self, name: &str) -> Result<DType> {
        let entry = self.entry(name)?;
        entry
            .dtype
            .ok_or_else(|| crate::ModelError::UnsupportedDType {
                name: name.to_string(),
                dtype: entry.dtype_name.clone(),
            })
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

/// FNV-1a of a tensor name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl SyntheticWeights {
    /// The stream seed of tensor `name`.
    fn tensor_seed(&self, name: &str) -> u64 {
        self.seed ^ name_hash(name)
    }

    /// `n` normal values with std 0.02 for tensor `name`.
    pub(crate) fn normal(&self, name: &str, n: usize) -> Vec<f32> {
        corral_backend::synthetic::normal_values(self.tensor_seed(name), n, STD)
    }
}

impl WeightSource for SyntheticWeights {
    /// Experts are made in the fused layout; every other name exists when asked for.
    /// Synthetic hybrids use the Qwen3.5 projection layout (never Qwen3-Next's fused one).
    fn contains(&self, name: &str) -> bool {
        if name.contains("in_proj_qkvz") || name.contains("in_proj_ba") {
            return false;
        }
        !name.contains(".experts.")
            || name.ends_with("experts.gate_up_proj")
            || name.ends_with("experts.down_proj")
    }

    fn weight(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Result<DeviceBuffer> {
        let n = shape.iter().product();
        Ok(backend.weight_normal(n, self.dtype, self.tensor_seed(name), STD)?)
    }

    /// Norm weights and dt_bias are 1 and A_log 0 (decay rate 1); matrices normal.
    fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let n = shape.iter().product();
        Ok(
            if name.ends_with("norm.weight") || name.ends_with("dt_bias") {
                vec![1.0; n]
            } else if name.ends_with("A_log") {
                vec![0.0; n]
            } else {
                self.normal(name, n)
            },
        )
    }

    fn stored_dtype(&self, _name: &str) -> Result<DType> {
        Ok(self.dtype)
    }

    /// One stream for the stacked matrix, seeded by its first part's name (made on the
    /// device, like every synthetic matrix).
    fn weight_stacked(
        &self,
        backend: &dyn Backend,
        parts: &[(&str, &[usize])],
    ) -> Result<DeviceBuffer> {
        let first = first_part(parts)?;
        let n = parts.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        Ok(backend.weight_normal(n, self.dtype, self.tensor_seed(first), STD)?)
    }
}
