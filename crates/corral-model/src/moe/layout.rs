//! Binding expert weights from either checkpoint layout into one [`ExpertWeights`]: fused
//! (`experts.gate_up_proj` `[E, 2I, H]` with gate rows first, `experts.down_proj` `[E, H, I]`)
//! or per expert (`experts.{e}.{gate,up,down}_proj.weight`). Neither layout is copied.

use std::sync::Arc;

use corral_backend::{Backend, DType, ExpertMatrices, ExpertWeights};

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
    let per_expert = |proj: &str, rows: usize, cols: usize, decoded: bool| {
        let buffers = (0..e)
            .map(|x| {
                let name = format!("{prefix}experts.{x}.{proj}.weight");
                if decoded {
                    let values = source.read_f32(&name, &[rows, cols])?;
                    Ok(backend.weight_from_f32(&values, DType::F32)?)
                } else {
                    source.weight(backend, &name, &[rows, cols])
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok::<_, crate::ModelError>(ExpertMatrices::per_expert(buffers, rows, cols)?)
    };
    let load = |decoded: bool| -> Result<ExpertWeights> {
        Ok(ExpertWeights {
            gate: per_expert("gate_proj", i, h, decoded)?,
            up: per_expert("up_proj", i, h, decoded)?,
            down: per_expert("down_proj", h, i, decoded)?,
        })
    };
    let weights = load(false)?;
    // The experts' kernels take block formats (which may differ between gate/up and down) or
    // one plain type. A projection the backend decodes beside ones it keeps as blocks (the
    // GPU decodes Q4_1 and Q5_1, which llama-quantize writes for widths no multiple of 256)
    // has all three decoded.
    let blocks = [&weights.gate, &weights.up, &weights.down]
        .map(|m| matches!(m.dtype(), Some(DType::Quant(_))));
    if blocks.contains(&true) && blocks.contains(&false) {
        tracing::info!(
            prefix,
            "experts partly in block formats this backend decodes: all three projections decoded to f32"
        );
        return load(true);
    }
    Ok(weights)
}
