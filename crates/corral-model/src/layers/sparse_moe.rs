//! The Qwen3 sparse MoE block: softmax router, top-k, optional renormalisation, routed experts.
//! Experts are bound from either checkpoint layout into one [`ExpertWeights`].

use std::sync::Arc;

use corral_backend::{
    Backend, DeviceBuffer, ExpertMatrices, ExpertWeights, MoeRouting, WeightView,
};

use super::Workspace;
use crate::checkpoint::Checkpoint;
use crate::{MoeConfig, Result};

/// Weights of one sparse MoE block.
#[derive(Debug)]
pub(crate) struct SparseMoe {
    router: DeviceBuffer,
    experts: ExpertWeights,
    hidden: usize,
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
}

impl SparseMoe {
    /// Binds `{prefix}gate.weight` and the experts under `{prefix}experts.`, fused
    /// (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`) or per expert.
    pub(crate) fn load(
        ckpt: &Checkpoint,
        backend: &dyn Backend,
        prefix: &str,
        hidden: usize,
        moe: &MoeConfig,
    ) -> Result<Self> {
        let (e, i, h) = (moe.num_experts, moe.moe_intermediate_size, hidden);
        let router = ckpt.weight(backend, &format!("{prefix}gate.weight"), &[e, h])?;
        let fused = format!("{prefix}experts.gate_up_proj");
        let experts = if ckpt.contains(&fused) {
            let gate_up = Arc::new(ckpt.weight(backend, &fused, &[e, 2 * i, h])?);
            let down = Arc::new(ckpt.weight(
                backend,
                &format!("{prefix}experts.down_proj"),
                &[e, h, i],
            )?);
            ExpertWeights {
                gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h)?,
                up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h)?,
                down: ExpertMatrices::stacked(down, e, h, 0, h, i)?,
            }
        } else {
            let per_expert = |proj: &str, rows: usize, cols: usize| -> Result<ExpertMatrices> {
                let buffers = (0..e)
                    .map(|x| {
                        ckpt.weight(
                            backend,
                            &format!("{prefix}experts.{x}.{proj}.weight"),
                            &[rows, cols],
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(ExpertMatrices::per_expert(buffers, rows, cols)?)
            };
            ExpertWeights {
                gate: per_expert("gate_proj", i, h)?,
                up: per_expert("up_proj", i, h)?,
                down: per_expert("down_proj", h, i)?,
            }
        };
        Ok(Self {
            router,
            experts,
            hidden,
            num_experts: e,
            top_k: moe.top_k,
            renormalize: moe.norm_topk_prob,
        })
    }

    /// `ws.out = moe(ws.h)`.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        ws: &mut Workspace,
        tokens: usize,
    ) -> Result<()> {
        let router = WeightView::new(&self.router, self.num_experts, self.hidden)?;
        backend.matmul(&ws.h, tokens, router, &mut ws.router_logits)?;
        backend.moe_route(
            &ws.router_logits,
            tokens,
            self.num_experts,
            self.top_k,
            self.renormalize,
            &mut ws.expert_ids,
            &mut ws.expert_weights,
        )?;
        let routing = MoeRouting {
            expert_ids: &ws.expert_ids,
            expert_weights: &ws.expert_weights,
            tokens,
            top_k: self.top_k,
        };
        backend.moe_experts_per_token(&ws.h, routing, &self.experts, &mut ws.out)?;
        Ok(())
    }
}
