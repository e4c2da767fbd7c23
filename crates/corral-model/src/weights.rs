//! Where a family's weights come from: a [`Checkpoint`] on disk, or [`SyntheticWeights`]
//! made from a config alone (deterministic normal values with std 0.02 as transformers
//! initialises, norms at 1), for measuring full-size shapes without weight files.

use corral_backend::{Backend, DType, DeviceBuffer, QuantFormat, WeightView};

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
        rows_from_values(self, backend, name, shape, rows)
    }
}

/// [`WeightSource::weight_rows`] through the matrix's values: decoded, picked, and stored
/// again in its stored type.
pub(crate) fn rows_from_values<S: WeightSource + ?Sized>(
    source: &S,
    backend: &dyn Backend,
    name: &str,
    shape: &[usize],
    rows: &[usize],
) -> Result<DeviceBuffer> {
    let values = source.read_f32(name, shape)?;
    let cols: usize = shape[1..].iter().product();
    let mut picked = Vec::with_capacity(rows.len() * cols);
    for &r in rows {
        picked.extend_from_slice(&values[r * cols..(r + 1) * cols]);
    }
    Ok(backend.weight_from_f32(&picked, source.stored_dtype(name)?)?)
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
                backend.matmul_parts(x, tokens, (parts, cols), out, rows)?;
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

    /// FP8 parts stack as their row blocks (each row carries its scales); others through
    /// their values.
    fn weight_stacked(
        &self,
        backend: &dyn Backend,
        parts: &[(&str, &[usize])],
    ) -> Result<DeviceBuffer> {
        if !parts.iter().all(|(name, _)| self.is_fp8(name)) {
            return stacked_values(self, backend, parts);
        }
        let mut blocks = Vec::new();
        for &(name, shape) in parts {
            blocks.extend(self.fp8_blocks(name, shape)?);
        }
        let len = parts.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        crate::checkpoint::fp8_weight(backend, blocks, len)
    }
}

/// Deterministic random weights: every tensor's values depend only on the seed and its name.
#[derive(Debug)]
pub struct SyntheticWeights {
    /// Type the matrices are stored in, where `mix` gives no block format.
    pub dtype: DType,
    /// Seed mixed into every tensor's stream.
    pub seed: u64,
    /// Which matrices are stored in block formats.
    pub mix: SyntheticMix,
    /// Layers of the model (the Q4_K_M mix gives some layers more bits).
    pub num_layers: usize,
}

/// How a synthetic model stores its matrices: as floats, or in block formats as llama.cpp's
/// quantization presets choose them (random blocks with the floats' spread,
/// [`corral_backend::synthetic::quant_blocks`]). Norms, the router and recurrent gates stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyntheticMix {
    /// The config's float type.
    #[default]
    Float,
    /// Every matrix Q8_0.
    Q8_0,
    /// Q4_K, with Q6_K for the LM head and for the v and down projections of the layers that
    /// llama.cpp's Q4_K_M gives more bits (the first and last eighth, every third between).
    Q4KM,
    /// Qwen's FP8 checkpoints: every projection e4m3 with a scale per 128×128 block (as
    /// [`QuantFormat::F8E4M3x128`] rows); the embedding and the LM head stay floats.
    Fp8,
}

impl SyntheticMix {
    /// The block format of matrix `name` (`cols` values a row) in a model of `layers`
    /// layers, or `None` for the float type: rows that a format's blocks do not divide fall
    /// back to Q8_0, then to floats (llama-quantize goes Q4_K → Q5_0, Q6_K → Q8_0, then F16).
    /// The v projections' extra bits go by layer index; llama.cpp counts attention layers
    /// only, which differs for the hybrids.
    pub fn format_of(self, name: &str, cols: usize, layers: usize) -> Option<QuantFormat> {
        let matrix = name.ends_with("_proj.weight")
            || name.contains(".in_proj_")
            || name.ends_with("experts.gate_up_proj")
            || name.ends_with("experts.down_proj")
            || name.ends_with("embed_tokens.weight")
            || name.ends_with("lm_head.weight");
        if !matrix {
            return None;
        }
        let wanted = match self {
            Self::Float => return None,
            Self::Fp8 => {
                let head =
                    name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight");
                let format = QuantFormat::F8E4M3x128;
                return (!head && cols.is_multiple_of(format.block().0)).then_some(format);
            }
            Self::Q8_0 => QuantFormat::Q8_0,
            Self::Q4KM => {
                let layer = name
                    .strip_prefix("model.layers.")
                    .and_then(|rest| rest.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok());
                // llama.cpp's use_more_bits.
                let more_bits =
                    |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
                let more = name.ends_with("v_proj.weight") || name.contains("down_proj");
                if name.ends_with("lm_head.weight") || (more && layer.is_some_and(more_bits)) {
                    QuantFormat::Q6K
                } else {
                    QuantFormat::Q4K
                }
            }
        };
        [wanted, QuantFormat::Q8_0]
            .into_iter()
            .find(|f| cols.is_multiple_of(f.block().0))
    }
}

/// Standard deviation of synthetic matrices (transformers' `initializer_range` default).
const STD: f32 = 0.02;

/// FNV-1a of a tensor name.
fn name_hash(name: &str) -> u64 {
    corral_backend::fnv1a(name.as_bytes())
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

    /// The block format `name` is made in on `backend` (one it reads as stored), if any.
    fn format_on(&self, backend: &dyn Backend, name: &str, shape: &[usize]) -> Option<QuantFormat> {
        let cols = shape.last().copied().unwrap_or(0);
        self.mix
            .format_of(name, cols, self.num_layers)
            .filter(|f| backend.capabilities().reads(*f))
    }

    /// `n` values of tensor `name` in its format on `backend`.
    fn made(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        n: usize,
    ) -> Result<DeviceBuffer> {
        let seed = self.tensor_seed(name);
        Ok(match self.format_on(backend, name, shape) {
            Some(format) => backend.weight_synthetic_blocks(format, n, seed, STD)?,
            None => backend.weight_normal(n, self.dtype, seed, STD)?,
        })
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
        self.made(backend, name, shape, shape.iter().product())
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

    fn stored_dtype(&self, name: &str) -> Result<DType> {
        // Without the shape, the format the full-width mix gives (stacking checks shapes).
        Ok(match self.mix.format_of(name, 0, self.num_layers) {
            Some(format) => DType::Quant(format),
            None => self.dtype,
        })
    }

    /// One stream for the stacked matrix, seeded by its first part's name (made on the
    /// device, like every synthetic matrix).
    fn weight_stacked(
        &self,
        backend: &dyn Backend,
        parts: &[(&str, &[usize])],
    ) -> Result<DeviceBuffer> {
        let (first, shape) = *parts
            .first()
            .ok_or_else(|| crate::ModelError::Unsupported("stacking no matrices".to_string()))?;
        let n = parts.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        self.made(backend, first, shape, n)
    }

    /// Rows in a block format are fresh random blocks made on the device (a block format
    /// cannot be re-encoded from picked values); float rows are picked from the matrix's.
    fn weight_rows(
        &self,
        backend: &dyn Backend,
        name: &str,
        shape: &[usize],
        rows: &[usize],
    ) -> Result<DeviceBuffer> {
        let cols: usize = shape[1..].iter().product();
        match self.format_on(backend, name, shape) {
            Some(format) => {
                let first = rows.first().copied().unwrap_or(0) as u64;
                let seed = self.tensor_seed(name) ^ first.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                Ok(backend.weight_synthetic_blocks(format, rows.len() * cols, seed, STD)?)
            }
            None => rows_from_values(self, backend, name, shape, rows),
        }
    }

    /// Stacked where every part takes the same format, else apart (Q4_K_M's Q6_K v).
    fn projection(&self, backend: &dyn Backend, parts: &[(&str, &[usize])]) -> Result<Projection> {
        let formats: Vec<_> = parts
            .iter()
            .map(|(name, shape)| self.format_on(backend, name, shape))
            .collect();
        if formats.windows(2).all(|w| w[0] == w[1]) {
            return Ok(Projection::Stacked(self.weight_stacked(backend, parts)?));
        }
        let apart = parts
            .iter()
            .map(|(name, shape)| Ok((self.weight(backend, name, shape)?, shape[0])))
            .collect::<Result<_>>()?;
        Ok(Projection::Parts(apart))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q4_K_M's choices as llama.cpp's use_more_bits makes them for 48 layers, and the
    /// fall-backs for rows that blocks of 256 (then 32) do not divide.
    #[test]
    fn synthetic_mixes_choose_formats_as_llama_cpp_does() {
        let of = |mix: SyntheticMix, name: &str, cols| mix.format_of(name, cols, 48);
        let v = |i: usize| format!("model.layers.{i}.self_attn.v_proj.weight");
        let q4km = SyntheticMix::Q4KM;
        let more: Vec<usize> = (0..48)
            .filter(|&i| of(q4km, &v(i), 2048) == Some(QuantFormat::Q6K))
            .collect();
        assert_eq!(
            more,
            [
                0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45,
                46, 47
            ]
        );
        let down = "model.layers.8.mlp.experts.down_proj";
        assert_eq!(of(q4km, down, 768), Some(QuantFormat::Q6K));
        let dense_down = "model.layers.8.mlp.shared_expert.down_proj.weight";
        assert_eq!(of(q4km, dense_down, 512), Some(QuantFormat::Q6K));
        assert_eq!(
            of(q4km, "model.layers.7.mlp.experts.down_proj", 768),
            Some(QuantFormat::Q4K)
        );
        assert_eq!(
            of(q4km, "model.layers.7.self_attn.q_proj.weight", 2048),
            Some(QuantFormat::Q4K)
        );
        assert_eq!(of(q4km, "lm_head.weight", 2048), Some(QuantFormat::Q6K));
        assert_eq!(
            of(q4km, "model.embed_tokens.weight", 2048),
            Some(QuantFormat::Q4K)
        );
        assert_eq!(
            of(q4km, "model.layers.7.self_attn.q_proj.weight", 96),
            Some(QuantFormat::Q8_0)
        );
        assert_eq!(of(q4km, "model.layers.7.self_attn.q_proj.weight", 20), None);
        assert_eq!(of(q4km, "model.layers.7.mlp.gate.weight", 2048), None);
        assert_eq!(
            of(q4km, "model.layers.7.input_layernorm.weight", 2048),
            None
        );
        assert_eq!(of(SyntheticMix::Q8_0, down, 768), Some(QuantFormat::Q8_0));
        assert_eq!(of(SyntheticMix::Float, down, 768), None);
        let fp8 = SyntheticMix::Fp8;
        assert_eq!(of(fp8, down, 768), Some(QuantFormat::F8E4M3x128));
        assert_eq!(of(fp8, "model.layers.7.self_attn.q_proj.weight", 96), None);
        assert_eq!(of(fp8, "lm_head.weight", 2048), None);
        assert_eq!(of(fp8, "model.layers.7.mlp.gate.weight", 2048), None);
    }
}
