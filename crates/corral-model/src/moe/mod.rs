//! The sparse MoE block and its execution strategies.
//!
//! [`SparseMoe`] holds the router and the experts (bound from either checkpoint layout by
//! `layout.rs`). Its forward computes router logits and top-k routing on the device, then
//! hands the same canonical weights and routing buffers to the strategy that
//! [`MoeStrategy::resolve`] picks: `per_expert.rs` (the host-looping baseline),
//! `per_token.rs` or `grouped.rs`. The block does not own activations: they come with the
//! forward's workspace.

mod calibrate;
mod grouped;
mod layout;
mod per_expert;
mod per_token;
mod strategy;

use corral_backend::{Backend, DeviceBuffer, ExpertWeights, MoeRouting, WeightView};

use crate::layers::Workspace;
use crate::weights::WeightSource;
use crate::{MoeConfig, Result};
pub(crate) use calibrate::calibrate;
pub use calibrate::{CALIBRATION_TOKENS, MoeCalibration, crossover};
pub use strategy::{DEFAULT_GROUPED_MIN_TOKENS, MoeStrategy, UnknownStrategy};

/// Weights of one sparse MoE block.
#[derive(Debug)]
pub(crate) struct SparseMoe {
    /// `[num_experts (+ 1 with a shared expert: its gate), hidden]`.
    router: DeviceBuffer,
    /// The routed experts, and the shared expert as one more when `shared`.
    experts: ExpertWeights,
    hidden: usize,
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
    /// A shared expert folded in: every token also goes to expert `num_experts`, weighted
    /// sigmoid(its gate logit), through the same ops as the routed experts.
    shared: bool,
}

impl SparseMoe {
    /// The experts' stored types, gate/up then down (calibration keys on them; a Q4_K_M
    /// model's layers differ in their down type, and the first layer's stands for all).
    pub(crate) fn expert_dtypes(&self) -> String {
        format!(
            "{:?}/{:?}",
            self.experts.gate.dtype(),
            self.experts.down.dtype()
        )
    }

    /// Binds `{prefix}gate.weight` and the experts under `{prefix}experts.`.
    pub(crate) fn load(
        source: &dyn WeightSource,
        backend: &dyn Backend,
        prefix: &str,
        hidden: usize,
        moe: &MoeConfig,
    ) -> Result<Self> {
        let (e, i) = (moe.num_experts, moe.moe_intermediate_size);
        let router = source.weight(backend, &format!("{prefix}gate.weight"), &[e, hidden])?;
        let experts = layout::load_experts(source, backend, prefix, e, i, hidden)?;
        Ok(Self::new(router, experts, hidden, moe, false))
    }

    fn new(
        router: DeviceBuffer,
        experts: ExpertWeights,
        hidden: usize,
        moe: &MoeConfig,
        shared: bool,
    ) -> Self {
        Self {
            router,
            experts,
            hidden,
            num_experts: moe.num_experts,
            top_k: moe.top_k,
            renormalize: moe.norm_topk_prob,
            shared,
        }
    }

    /// As [`SparseMoe::load`], with the shared expert `{prefix}shared_expert.` (of the routed
    /// experts' intermediate size and type) and its gate `{prefix}shared_expert_gate.weight`
    /// folded in: the gate becomes the router's last row and the expert the last expert.
    pub(crate) fn load_with_shared(
        source: &dyn WeightSource,
        backend: &dyn Backend,
        prefix: &str,
        hidden: usize,
        moe: &MoeConfig,
    ) -> Result<Self> {
        let (e, i, h) = (moe.num_experts, moe.moe_intermediate_size, hidden);
        let router = source.weight_stacked(
            backend,
            &[
                (&format!("{prefix}gate.weight"), &[e, h]),
                (&format!("{prefix}shared_expert_gate.weight"), &[1, h]),
            ],
        )?;
        let experts = layout::load_experts(source, backend, prefix, e, i, h)?;
        let shared = |name: &str, shape: &[usize]| {
            source.weight(
                backend,
                &format!("{prefix}shared_expert.{name}.weight"),
                shape,
            )
        };
        let experts = ExpertWeights {
            gate: experts.gate.with_extra(shared("gate_proj", &[i, h])?)?,
            up: experts.up.with_extra(shared("up_proj", &[i, h])?)?,
            down: experts.down.with_extra(shared("down_proj", &[h, i])?)?,
        };
        Ok(Self::new(router, experts, hidden, moe, true))
    }

    /// `ws.out = moe(ws.h)` for `tokens` tokens, run with `strategy`.
    pub(crate) fn forward(
        &self,
        backend: &dyn Backend,
        ws: &mut Workspace,
        tokens: usize,
        strategy: MoeStrategy,
    ) -> Result<()> {
        let shared = self.shared as usize;
        let router = WeightView::new(&self.router, self.num_experts + shared, self.hidden)?;
        backend.matmul(&ws.h, tokens, router, &mut ws.router_logits)?;
        backend.moe_route(
            &ws.router_logits,
            tokens,
            self.num_experts,
            self.top_k,
            self.renormalize,
            self.shared,
            &mut ws.expert_ids,
            &mut ws.expert_weights,
        )?;
        let routing = MoeRouting {
            expert_ids: &ws.expert_ids,
            expert_weights: &ws.expert_weights,
            tokens,
            top_k: self.top_k + shared,
        };
        match strategy.resolve(tokens) {
            MoeStrategy::PerExpert => {
                per_expert::forward(backend, &ws.h, routing, &self.experts, &mut ws.out)
            }
            MoeStrategy::PerExpertOneSync => {
                per_expert::forward_one_sync(backend, &ws.h, routing, &self.experts, &mut ws.out)
            }
            MoeStrategy::PerToken => per_token::forward(
                backend,
                &ws.h,
                routing,
                &self.experts,
                &mut ws.moe.act,
                &mut ws.out,
            ),
            _ => grouped::forward(
                backend,
                &ws.h,
                routing,
                &self.experts,
                &mut ws.moe,
                &mut ws.out,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use corral_backend::{Backend, BufferUsage, DType, ExpertMatrices};
    use corral_cpu::CpuBackend;
    use proptest::prelude::*;

    use super::*;
    use crate::layers::workspace::MoeScratch;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn f32_buffer(b: &dyn Backend, v: &[f32]) -> DeviceBuffer {
        let mut buf = b
            .take_buffer(DType::F32, v.len(), BufferUsage::Activations)
            .unwrap();
        b.upload_f32(v, &mut buf).unwrap();
        buf
    }

    fn experts(
        b: &dyn Backend,
        e: usize,
        i: usize,
        h: usize,
        fused: bool,
        dtype: DType,
        seed: u64,
    ) -> ExpertWeights {
        if fused {
            let gate_up = Arc::new(
                b.weight_from_f32(&values(e * 2 * i * h, seed), dtype)
                    .unwrap(),
            );
            let down = Arc::new(
                b.weight_from_f32(&values(e * h * i, seed + 1), dtype)
                    .unwrap(),
            );
            ExpertWeights {
                gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h).unwrap(),
                up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h).unwrap(),
                down: ExpertMatrices::stacked(down, e, h, 0, h, i).unwrap(),
            }
        } else {
            let per = |rows: usize, cols: usize, s: u64| {
                let bufs = (0..e)
                    .map(|x| {
                        b.weight_from_f32(&values(rows * cols, s + x as u64 * 7), dtype)
                            .unwrap()
                    })
                    .collect();
                ExpertMatrices::per_expert(bufs, rows, cols).unwrap()
            };
            ExpertWeights {
                gate: per(i, h, seed),
                up: per(i, h, seed + 100),
                down: per(h, i, seed + 200),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Per-expert, per-token and grouped compute the same function on random shapes and
        /// routings, including router scores with many exact ties.
        #[test]
        fn strategies_agree(
            tokens in 1usize..80, num_experts in 1usize..12, top_k in 1usize..5,
            hidden in 1usize..48, inter in 1usize..72, tie_levels in 1u32..5,
            renormalize in any::<bool>(), fused in any::<bool>(), seed in any::<u64>(),
            dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        ) {
            let top_k = top_k.min(num_experts);
            let b: &dyn Backend = &CpuBackend::new();
            let x = f32_buffer(b, &values(tokens * hidden, seed));
            // Router logits drawn from a few levels, so that ties are common.
            let logits: Vec<f32> = values(tokens * num_experts, seed ^ 5)
                .iter()
                .map(|v| ((v + 0.5) * tie_levels as f32).floor())
                .collect();
            let logits = f32_buffer(b, &logits);
            let mut ids = b.take_buffer(DType::U32, tokens * top_k, BufferUsage::Metadata).unwrap();
            let mut weights = b.take_buffer(DType::F32, tokens * top_k, BufferUsage::Activations).unwrap();
            b.moe_route(&logits, tokens, num_experts, top_k, renormalize, false, &mut ids, &mut weights).unwrap();
            let routing = MoeRouting { expert_ids: &ids, expert_weights: &weights, tokens, top_k };
            let experts = experts(b, num_experts, inter, hidden, fused, dtype, seed ^ 9);
            let pairs = tokens * top_k;
            let take = |dtype, n| b.take_buffer(dtype, n, BufferUsage::Activations).unwrap();
            let mut scratch = MoeScratch {
                expert_offsets: take(DType::U32, num_experts + 1),
                hit_experts: take(DType::U32, num_experts + 1),
                sorted_pairs: take(DType::U32, pairs),
                pair_positions: take(DType::U32, pairs),
                act: take(DType::F32, pairs * inter),
                y: take(DType::F32, pairs * hidden),
            };
            let mut outs = Vec::new();
            for strategy in [MoeStrategy::PerExpert, MoeStrategy::PerExpertOneSync, MoeStrategy::PerToken, MoeStrategy::Grouped] {
                let mut out = take(DType::F32, tokens * hidden);
                let before = b.stats();
                match strategy {
                    MoeStrategy::PerExpert => per_expert::forward(b, &x, routing, &experts, &mut out),
                    MoeStrategy::PerExpertOneSync => per_expert::forward_one_sync(b, &x, routing, &experts, &mut out),
                    MoeStrategy::PerToken => per_token::forward(b, &x, routing, &experts, &mut scratch.act, &mut out),
                    _ => grouped::forward(b, &x, routing, &experts, &mut scratch, &mut out),
                }
                .unwrap();
                let spent = b.stats() - before;
                if strategy == MoeStrategy::PerExpertOneSync {
                    prop_assert_eq!(spent.host_syncs, 1);
                }
                if !strategy.syncs_host(tokens) {
                    let expected = if strategy == MoeStrategy::Grouped { 4 } else { 2 };
                    prop_assert_eq!(spent.dispatches, expected);
                    prop_assert_eq!(spent.host_syncs, 0);
                    prop_assert_eq!(spent.allocations, 0);
                }
                let mut host = vec![0.0; tokens * hidden];
                b.download_f32(&out, &mut host).unwrap();
                outs.push(host);
            }
            let scale = outs[0].iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            for (name, other) in ["per-expert-one-sync", "per-token", "grouped"].iter().zip(&outs[1..]) {
                let diff = outs[0].iter().zip(other).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                prop_assert!(diff / scale <= 1e-5, "{} differs from per-expert by {}", name, diff / scale);
            }
        }
    }
}
