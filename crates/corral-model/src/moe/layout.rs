//! Binding expert weights from either checkpoint layout into one [`ExpertWeights`]: fused
//! (`experts.gate_up_proj` `[E, 2I, H]` with gate rows first, `experts.down_proj` `[E, H, I]`)
//! or per expert (`experts.{e}.{gate,up,down}_proj.weight`). Neither layout is copied.

use std::sync::Arc;

use corral_backend::{Backend, ExpertMatrices, ExpertWeights};

use crate::Result;
use crate::weights::WeightSource;

/// Binds the experts under `{prefix}experts.`.
pub(crate) fn load_experts(
    source: &dyn WeightSource,
    backend: &dyn Backend,
    prefix: &str,
    num_experts: usize,
    inter: usize,
    hidden: usize,
) -> Result<ExpertWeights> {
    let (e, i, h) = (num_experts, inter, hidden);
    let fused = format!("{prefix}experts.gate_up_proj");
    if source.contains(&fused) {
        let gate_up = Arc::new(source.weight(backend, &fused, &[e, 2 * i, h])?);
        let down =
            Arc::new(source.weight(backend, &format!("{prefix}experts.down_proj"), &[e, h, i])?);
        return Ok(ExpertWeights {
            gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h)?,
            up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h)?,
            down: ExpertMatrices::stacked(down, e, h, 0, h, i)?,
        });
    }
    let per_expert = |proj: &str, rows: usize, cols: usize| -> Result<ExpertMatrices> {
        let buffers = (0..e)
            .map(|x| {
                source.weight(
                    backend,
                    &format!("{prefix}experts.{x}.{proj}.weight"),
                    &[rows, cols],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertMatrices::per_expert(buffers, rows, cols)?)
    };
    Ok(ExpertWeights {
        gate: per_expert("gate_proj", i, h)?,
        up: per_expert("up_proj", i, h)?,
        down: per_expert("down_proj", h, i)?,
    })
}
