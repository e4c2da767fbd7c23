//! Qwen3 and Qwen3-MoE (`qwen3`, `qwen3_moe`): pre-norm decoder layers of GQA attention with
//! q/k norms, then a dense SwiGLU MLP or a sparse MoE block; plain-weight RMSNorms throughout.

use corral_backend::{Backend, DType, DeviceBuffer, DispatchStats, WeightView};

use crate::batch::RaggedBatch;
use crate::kv_cache::PagedKvCache;
use crate::layers::attention::Attention;
use crate::layers::mlp::Mlp;
use crate::layers::output_head::OutputHead;
use crate::layers::{Workspace, residual_and_next_norm};
use crate::moe::{MoeStrategy, SparseMoe};
use crate::weights::WeightSource;
use crate::{ModelConfig, ModelError, Result};

/// The feed-forward half of a decoder layer.
#[derive(Debug)]
enum FeedForward {
    Dense(Mlp),
    Sparse(Box<SparseMoe>),
}

#[derive(Debug)]
struct DecoderLayer {
    input_layernorm: DeviceBuffer,
    self_attn: Attention,
    post_attention_layernorm: DeviceBuffer,
    mlp: FeedForward,
}

/// A loaded Qwen3 / Qwen3-MoE model.
#[derive(Debug)]
pub(crate) struct Qwen3Model {
    config: ModelConfig,
    embed_tokens: DeviceBuffer,
    layers: Vec<DecoderLayer>,
    head: OutputHead,
}

impl Qwen3Model {
    /// Binds every tensor of `ckpt`, checking names and shapes against `config`.
    pub(crate) fn load(
        ckpt: &dyn WeightSource,
        backend: &dyn Backend,
        config: ModelConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let (h, v) = (config.hidden_size, config.vocab_size);
        let embed_tokens = ckpt.weight(backend, "model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            progress(i, config.num_layers);
            let p = format!("model.layers.{i}.");
            let mlp = if config.is_sparse_layer(i) {
                let moe = config.moe.as_ref().ok_or_else(|| {
                    ModelError::InvalidBatch("sparse layer without MoE config".to_string())
                })?;
                FeedForward::Sparse(Box::new(SparseMoe::load(
                    ckpt,
                    backend,
                    &format!("{p}mlp."),
                    h,
                    moe,
                )?))
            } else {
                FeedForward::Dense(Mlp::load(
                    ckpt,
                    backend,
                    &format!("{p}mlp."),
                    h,
                    config.intermediate_size,
                )?)
            };
            layers.push(DecoderLayer {
                input_layernorm: ckpt.weight_f32(
                    backend,
                    &format!("{p}input_layernorm.weight"),
                    &[h],
                )?,
                self_attn: Attention::load(ckpt, backend, &config, &p)?,
                post_attention_layernorm: ckpt.weight_f32(
                    backend,
                    &format!("{p}post_attention_layernorm.weight"),
                    &[h],
                )?,
                mlp,
            });
        }
        progress(config.num_layers, config.num_layers);
        let head = OutputHead::load(ckpt, backend, &config, "model.norm.weight")?;
        Ok(Self {
            config,
            embed_tokens,
            layers,
            head,
        })
    }

    /// Runs the layers over `batch`, writing `[logit rows, vocab]` into `ws.logits`.
    fn forward_layers(
        &self,
        backend: &dyn Backend,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        ws: &mut Workspace,
        strategy: MoeStrategy,
        moe_stats: &mut DispatchStats,
    ) -> Result<()> {
        let cfg = &self.config;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let tokens = batch.num_tokens();
        let embed = WeightView::new(&self.embed_tokens, v, h)?;
        backend.embedding(embed, &ws.batch.ids, tokens, &mut ws.x)?;
        if self.layers.len() != cache.layers.len() {
            return Err(ModelError::InvalidBatch(format!(
                "the KV cache has {} attention layers, the model {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        let eps = cfg.rms_norm_eps;
        if let Some(first) = self.layers.first() {
            backend.rms_norm(
                &ws.x,
                &first.input_layernorm,
                tokens,
                h,
                eps,
                false,
                &mut ws.h,
            )?;
        }
        for (i, (layer, kv)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            layer
                .self_attn
                .forward(backend, ws, tokens, cache.block_size, kv)?;
            backend.add_rms_norm(
                &mut ws.x,
                &ws.out,
                &layer.post_attention_layernorm,
                tokens,
                h,
                eps,
                false,
                &mut ws.h,
            )?;
            match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.forward(backend, ws, tokens)?,
                FeedForward::Sparse(moe) => {
                    let before = backend.stats();
                    moe.forward(backend, ws, tokens, strategy)?;
                    *moe_stats = *moe_stats + (backend.stats() - before);
                }
            }
            let next_norm = self.layers.get(i + 1).map(|next| &next.input_layernorm);
            residual_and_next_norm(backend, ws, next_norm, tokens, h, eps, false)?;
        }
        self.head.forward(backend, cfg, ws, &self.embed_tokens)
    }
}

impl super::FamilyModel for Qwen3Model {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The type the weights are stored in (the embedding's, as the projections').
    fn weight_dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    fn moe_blocks(&self) -> Vec<&SparseMoe> {
        self.layers
            .iter()
            .filter_map(|l| match &l.mlp {
                FeedForward::Sparse(moe) => Some(moe.as_ref()),
                FeedForward::Dense(_) => None,
            })
            .collect()
    }

    fn recurrent(&self) -> bool {
        false
    }

    fn forward(&self, step: super::StepCtx<'_>) -> Result<()> {
        let super::StepCtx {
            backend,
            batch,
            cache,
            ws,
            strategy,
            moe_stats,
            ..
        } = step;
        self.forward_layers(backend, batch, cache, ws, strategy, moe_stats)
    }
}
