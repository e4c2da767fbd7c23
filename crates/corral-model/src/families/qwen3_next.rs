//! The hybrid families: Qwen3-Next (`qwen3_next`), Qwen3.5/3.6 MoE (`qwen3_5_moe`) and dense
//! (`qwen3_5`). Decoder layers alternate Gated DeltaNet (linear attention with a recurrent
//! state) and gated full attention (output gate, partial RoPE); the feed-forward half is MoE
//! with a shared expert, or a dense MLP. Layer, final and q/k norms are zero-centred
//! `(1 + w)`; the DeltaNet output norm is gated with a plain weight.
//!
//! Layouts: Qwen3.5 Hub checkpoints keep the language model under `model.language_model.`
//! (vision tower and MTP tensors are never read); text-only ones under `model.`. Qwen3-Next's
//! fused projections and the gated attention's interleaved `q_proj` are read through
//! `checkpoint::hybrid_layout`, so one set of kernels serves all three.

use corral_backend::{
    Backend, DType, DeltaNetShape, DeviceBuffer, DispatchStats, RecurrentRuns, WeightView,
};

use crate::batch::RaggedBatch;
use crate::checkpoint::hybrid_layout::{self, DeltaNetHeads};
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::layers::attention::paged_attention;
use crate::layers::mlp::Mlp;
use crate::layers::output_head::OutputHead;
use crate::layers::{Workspace, residual_and_next_norm};
use crate::moe::{MoeStrategy, SparseMoe};
use crate::weights::WeightSource;
use crate::{HybridConfig, LayerKind, ModelConfig, ModelError, Result};

/// Gated full attention.
#[derive(Debug)]
struct GatedAttention {
    q_proj: DeviceBuffer,
    gate_proj: DeviceBuffer,
    k_proj: DeviceBuffer,
    v_proj: DeviceBuffer,
    o_proj: DeviceBuffer,
    q_norm: DeviceBuffer,
    k_norm: DeviceBuffer,
}

/// Gated DeltaNet, in the Qwen3.5 projection layout.
#[derive(Debug)]
struct GatedDeltaNet {
    in_proj_qkv: DeviceBuffer,
    in_proj_z: DeviceBuffer,
    in_proj_b: DeviceBuffer,
    in_proj_a: DeviceBuffer,
    /// `[channels, kernel]`, f32.
    conv1d: DeviceBuffer,
    a_log: DeviceBuffer,
    dt_bias: DeviceBuffer,
    norm: DeviceBuffer,
    out_proj: DeviceBuffer,
}

#[derive(Debug)]
enum Mixer {
    /// With the layer's index among linear layers.
    Linear(GatedDeltaNet, usize),
    /// With the layer's index among attention layers.
    Full(GatedAttention, usize),
}

#[derive(Debug)]
enum FeedForward {
    Dense(Mlp),
    Sparse {
        moe: Box<SparseMoe>,
        /// The shared expert and its `[1, H]` gate.
        shared: Option<(Mlp, DeviceBuffer)>,
    },
}

#[derive(Debug)]
struct Layer {
    input_layernorm: DeviceBuffer,
    mixer: Mixer,
    post_attention_layernorm: DeviceBuffer,
    ffn: FeedForward,
}

/// The input of Qwen's MTP head: `fc([norm_e(embed(x_{t+1})); norm_h(h_t)])`, `fc` kept as
/// its two halves, one over each part.
#[derive(Debug)]
struct MtpInput {
    norm_embedding: DeviceBuffer,
    norm_hidden: DeviceBuffer,
    /// `fc[:, ..H]` and `fc[:, H..]`, `[H, H]` each.
    fc_embedding: DeviceBuffer,
    fc_hidden: DeviceBuffer,
}

/// A loaded hybrid model, or its MTP head (one full-attention layer after [`MtpInput`],
/// the embedding and LM head the model's).
#[derive(Debug)]
pub(crate) struct HybridModel {
    config: ModelConfig,
    embed_tokens: DeviceBuffer,
    mtp_input: Option<MtpInput>,
    layers: Vec<Layer>,
    head: OutputHead,
}

impl MtpInput {
    fn load(src: &dyn WeightSource, backend: &dyn Backend, h: usize) -> Result<Self> {
        let fc = src.read_f32("mtp.fc.weight", &[h, 2 * h])?;
        let dtype = src.stored_dtype("mtp.fc.weight")?;
        let half = |part: usize| -> Vec<f32> {
            fc.chunks_exact(2 * h)
                .flat_map(|row| &row[part * h..(part + 1) * h])
                .copied()
                .collect()
        };
        // Kept in its stored float type; a block format's values go to bf16.
        let dtype = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => dtype,
            _ => DType::BF16,
        };
        Ok(Self {
            norm_embedding: src.weight_f32(backend, "mtp.pre_fc_norm_embedding.weight", &[h])?,
            norm_hidden: src.weight_f32(backend, "mtp.pre_fc_norm_hidden.weight", &[h])?,
            fc_embedding: backend.weight_from_f32(&half(0), dtype)?,
            fc_hidden: backend.weight_from_f32(&half(1), dtype)?,
        })
    }

    /// `ws.x = fc_e · norm_e(ws.x) + fc_h · norm_h(hidden)`, ws.x holding the embeddings.
    fn forward(
        &self,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        ws: &mut Workspace,
        tokens: usize,
        hidden: &DeviceBuffer,
    ) -> Result<()> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        backend.rms_norm(&ws.x, &self.norm_embedding, tokens, h, eps, true, &mut ws.h)?;
        backend.matmul(
            &ws.h,
            tokens,
            WeightView::new(&self.fc_embedding, h, h)?,
            &mut ws.out,
        )?;
        backend.rms_norm(hidden, &self.norm_hidden, tokens, h, eps, true, &mut ws.h)?;
        backend.matmul(
            &ws.h,
            tokens,
            WeightView::new(&self.fc_hidden, h, h)?,
            &mut ws.x,
        )?;
        backend.add_in_place(&mut ws.x, &ws.out, tokens * h)?;
        Ok(())
    }
}

impl GatedAttention {
    fn load(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        p: &str,
    ) -> Result<Self> {
        let (h, hd, nh) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads);
        let kv = cfg.kv_dim();
        let (q_proj, gate_proj) = hybrid_layout::query_and_gate(
            src,
            backend,
            &format!("{p}self_attn.q_proj.weight"),
            (nh, hd, h),
        )?;
        Ok(Self {
            q_proj,
            gate_proj,
            k_proj: src.weight(backend, &format!("{p}self_attn.k_proj.weight"), &[kv, h])?,
            v_proj: src.weight(backend, &format!("{p}self_attn.v_proj.weight"), &[kv, h])?,
            o_proj: src.weight(
                backend,
                &format!("{p}self_attn.o_proj.weight"),
                &[h, nh * hd],
            )?,
            q_norm: src.weight_f32(backend, &format!("{p}self_attn.q_norm.weight"), &[hd])?,
            k_norm: src.weight_f32(backend, &format!("{p}self_attn.k_norm.weight"), &[hd])?,
        })
    }

    fn forward(
        &self,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        ws: &mut Workspace,
        tokens: usize,
        kv: &mut crate::LayerKv,
        block_size: usize,
    ) -> Result<()> {
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
        );
        let (eps, rot) = (cfg.rms_norm_eps, cfg.rotary_dim());
        backend.matmuls(
            &ws.h,
            tokens,
            &[
                WeightView::new(&self.q_proj, nh * hd, h)?,
                WeightView::new(&self.gate_proj, nh * hd, h)?,
                WeightView::new(&self.k_proj, nkv * hd, h)?,
                WeightView::new(&self.v_proj, nkv * hd, h)?,
            ],
            &mut [&mut ws.q, &mut ws.hybrid.attn_gate, &mut ws.k, &mut ws.v],
        )?;
        backend.rms_norm(
            &ws.q,
            &self.q_norm,
            tokens * nh,
            hd,
            eps,
            true,
            &mut ws.q_normed,
        )?;
        backend.rms_norm(
            &ws.k,
            &self.k_norm,
            tokens * nkv,
            hd,
            eps,
            true,
            &mut ws.k_normed,
        )?;
        let b = &ws.batch;
        backend.rope(
            &mut ws.q_normed,
            &b.positions,
            tokens,
            nh,
            hd,
            rot,
            cfg.rope,
        )?;
        backend.rope(
            &mut ws.k_normed,
            &b.positions,
            tokens,
            nkv,
            hd,
            rot,
            cfg.rope,
        )?;
        backend.kv_store(
            &ws.k_normed,
            &ws.v,
            &b.slots,
            tokens,
            nkv,
            hd,
            &mut kv.k,
            &mut kv.v,
        )?;
        paged_attention(backend, ws, tokens, block_size, (nh, nkv, hd), kv)?;
        backend.sigmoid_mul(
            &ws.attn,
            &ws.hybrid.attn_gate,
            tokens * nh * hd,
            &mut ws.hybrid.attn_gated,
        )?;
        backend.matmul(
            &ws.hybrid.attn_gated,
            tokens,
            WeightView::new(&self.o_proj, h, nh * hd)?,
            &mut ws.out,
        )?;
        Ok(())
    }
}

impl GatedDeltaNet {
    fn load(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        hy: &HybridConfig,
        p: &str,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let l = hy.linear;
        let (nk, nv, dk, dv) = (
            l.num_key_heads,
            l.num_value_heads,
            l.key_head_dim,
            l.value_head_dim,
        );
        let (c, k) = (l.conv_channels(), l.conv_kernel);
        let p = format!("{p}linear_attn.");
        let (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) =
            if hybrid_layout::fused_delta_net(src, &p) {
                let heads = DeltaNetHeads {
                    key_heads: nk,
                    value_heads: nv,
                    key_dim: dk,
                    value_dim: dv,
                    hidden: h,
                };
                hybrid_layout::unfused_delta_net(src, backend, &p, heads)?
            } else {
                (
                    src.weight(backend, &format!("{p}in_proj_qkv.weight"), &[c, h])?,
                    src.weight(backend, &format!("{p}in_proj_z.weight"), &[nv * dv, h])?,
                    src.weight(backend, &format!("{p}in_proj_b.weight"), &[nv, h])?,
                    src.weight(backend, &format!("{p}in_proj_a.weight"), &[nv, h])?,
                )
            };
        Ok(Self {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
            conv1d: src.weight_f32(backend, &format!("{p}conv1d.weight"), &[c, 1, k])?,
            a_log: src.weight_f32(backend, &format!("{p}A_log"), &[nv])?,
            dt_bias: src.weight_f32(backend, &format!("{p}dt_bias"), &[nv])?,
            norm: src.weight_f32(backend, &format!("{p}norm.weight"), &[dv])?,
            out_proj: src.weight(backend, &format!("{p}out_proj.weight"), &[h, nv * dv])?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        backend: &dyn Backend,
        cfg: &ModelConfig,
        hy: &HybridConfig,
        ws: &mut Workspace,
        tokens: usize,
        num_runs: usize,
        state: &mut RecurrentStateCache,
        index: usize,
    ) -> Result<()> {
        let h = cfg.hidden_size;
        let l = hy.linear;
        let (nv, dv) = (l.num_value_heads, l.value_head_dim);
        let c = l.conv_channels();
        let s = &mut ws.hybrid;
        backend.matmuls(
            &ws.h,
            tokens,
            &[
                WeightView::new(&self.in_proj_qkv, c, h)?,
                WeightView::new(&self.in_proj_z, nv * dv, h)?,
                WeightView::new(&self.in_proj_b, nv, h)?,
                WeightView::new(&self.in_proj_a, nv, h)?,
            ],
            &mut [&mut s.qkv, &mut s.z, &mut s.b, &mut s.a],
        )?;
        let runs = RecurrentRuns {
            runs: &ws.batch.recurrent_runs,
            num_runs,
            max_run_tokens: ws.max_run_tokens,
            kept: ws.keeps_states.then_some(&ws.batch.kept_states),
        };
        let (conv_state, recurrent_state) =
            match (state.conv.get_mut(index), state.recurrent.get_mut(index)) {
                (Some(c), Some(r)) => (c, r),
                _ => {
                    return Err(ModelError::InvalidBatch(
                        "the recurrent state cache has too few layers".to_string(),
                    ));
                }
            };
        backend.causal_conv1d(
            &s.qkv,
            &self.conv1d,
            c,
            l.conv_kernel,
            runs,
            conv_state,
            &mut s.conv,
        )?;
        backend.delta_net_gates(
            &s.a,
            &s.b,
            &self.a_log,
            &self.dt_bias,
            tokens,
            nv,
            &mut s.g,
            &mut s.beta,
        )?;
        let shape = DeltaNetShape {
            num_key_heads: l.num_key_heads,
            num_value_heads: nv,
            key_dim: l.key_head_dim,
            value_dim: dv,
        };
        backend.gated_delta_rule(
            &s.conv,
            &s.g,
            &s.beta,
            shape,
            runs,
            recurrent_state,
            &mut s.core,
        )?;
        backend.gated_rms_norm(
            &s.core,
            &s.z,
            &self.norm,
            tokens * nv,
            dv,
            cfg.rms_norm_eps,
            &mut s.normed,
        )?;
        backend.matmul(
            &s.normed,
            tokens,
            WeightView::new(&self.out_proj, h, nv * dv)?,
            &mut ws.out,
        )?;
        Ok(())
    }
}

impl HybridModel {
    /// Binds every tensor the language model needs, checking names and shapes.
    pub(crate) fn load(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        config: ModelConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let prefix = Self::prefix(src);
        let embed_tokens = Self::load_embedding(src, backend, &config)?;
        let layers =
            Self::load_layers(src, backend, &config, &format!("{prefix}layers."), progress)?;
        let head = OutputHead::load(src, backend, &config, &format!("{prefix}norm.weight"))?;
        Ok(Self {
            config,
            embed_tokens,
            mtp_input: None,
            layers,
            head,
        })
    }

    /// Binds the checkpoint's MTP head (`mtp.*`) as a model of its own: `config` is the
    /// model's, and the head's configuration ([`ModelConfig::mtp`]) is derived from it.
    pub(crate) fn load_mtp(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        config: &ModelConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = config.mtp()?;
        if !src.contains("mtp.fc.weight") {
            return Err(ModelError::Unsupported(
                "the checkpoint has no MTP head (no mtp.* tensors)".to_string(),
            ));
        }
        let embed_tokens = Self::load_embedding(src, backend, &config)?;
        let mtp_input = MtpInput::load(src, backend, config.hidden_size)?;
        let layers = Self::load_layers(src, backend, &config, "mtp.layers.", progress)?;
        let head = OutputHead::load(src, backend, &config, "mtp.norm.weight")?;
        Ok(Self {
            config,
            embed_tokens,
            mtp_input: Some(mtp_input),
            layers,
            head,
        })
    }

    /// Where the language model's tensors are: under `model.language_model.` in Qwen3.5's
    /// Hub checkpoints, else under `model.`.
    fn prefix(src: &dyn WeightSource) -> &'static str {
        if src.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        }
    }

    fn load_embedding(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        config: &ModelConfig,
    ) -> Result<DeviceBuffer> {
        let (h, v) = (config.hidden_size, config.vocab_size);
        let prefix = Self::prefix(src);
        src.weight(backend, &format!("{prefix}embed_tokens.weight"), &[v, h])
    }

    /// The decoder layers `config` describes, layer i's tensors under `{layers}{i}.`.
    fn load_layers(
        src: &dyn WeightSource,
        backend: &dyn Backend,
        config: &ModelConfig,
        layers_prefix: &str,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Layer>> {
        let hy = config.hybrid.clone().ok_or_else(|| {
            ModelError::Unsupported("a hybrid family without hybrid settings".to_string())
        })?;
        let h = config.hidden_size;
        let (mut linear_index, mut full_index) = (0, 0);
        let mut layers = Vec::with_capacity(config.num_layers);
        for (i, kind) in hy.layer_types.iter().enumerate() {
            progress(i, config.num_layers);
            let p = format!("{layers_prefix}{i}.");
            let mixer = match kind {
                LayerKind::Linear => {
                    linear_index += 1;
                    Mixer::Linear(
                        GatedDeltaNet::load(src, backend, config, &hy, &p)?,
                        linear_index - 1,
                    )
                }
                LayerKind::Full => {
                    full_index += 1;
                    Mixer::Full(
                        GatedAttention::load(src, backend, config, &p)?,
                        full_index - 1,
                    )
                }
            };
            let ffn = match &config.moe {
                Some(moe) if config.is_sparse_layer(i) && config.folds_shared_expert() => {
                    FeedForward::Sparse {
                        moe: Box::new(SparseMoe::load_with_shared(
                            src,
                            backend,
                            &format!("{p}mlp."),
                            h,
                            moe,
                        )?),
                        shared: None,
                    }
                }
                Some(moe) if config.is_sparse_layer(i) => {
                    let shared = match hy.shared_expert_intermediate_size {
                        Some(si) if si > 0 => Some((
                            Mlp::load(src, backend, &format!("{p}mlp.shared_expert."), h, si)?,
                            src.weight(
                                backend,
                                &format!("{p}mlp.shared_expert_gate.weight"),
                                &[1, h],
                            )?,
                        )),
                        _ => None,
                    };
                    FeedForward::Sparse {
                        moe: Box::new(SparseMoe::load(src, backend, &format!("{p}mlp."), h, moe)?),
                        shared,
                    }
                }
                _ => FeedForward::Dense(Mlp::load(
                    src,
                    backend,
                    &format!("{p}mlp."),
                    h,
                    config.intermediate_size,
                )?),
            };
            layers.push(Layer {
                input_layernorm: src.weight_f32(
                    backend,
                    &format!("{p}input_layernorm.weight"),
                    &[h],
                )?,
                mixer,
                post_attention_layernorm: src.weight_f32(
                    backend,
                    &format!("{p}post_attention_layernorm.weight"),
                    &[h],
                )?,
                ffn,
            });
        }
        progress(config.num_layers, config.num_layers);
        Ok(layers)
    }

    /// Runs the layers over `batch`, writing `[logit rows, vocab]` into `ws.logits`.
    #[allow(clippy::too_many_arguments)]
    fn forward_layers(
        &self,
        backend: &dyn Backend,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        ws: &mut Workspace,
        strategy: MoeStrategy,
        moe_stats: &mut DispatchStats,
        hidden: Option<&DeviceBuffer>,
    ) -> Result<()> {
        let cfg = &self.config;
        let hy = cfg.hybrid.as_ref().ok_or_else(|| {
            ModelError::Unsupported("a hybrid family without hybrid settings".to_string())
        })?;
        let (h, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
        let tokens = batch.num_tokens();
        let num_runs = batch.runs().len();
        backend.embedding(
            WeightView::new(&self.embed_tokens, v, h)?,
            &ws.batch.ids,
            tokens,
            &mut ws.x,
        )?;
        if let Some(mtp) = &self.mtp_input {
            let hidden = hidden.ok_or_else(|| {
                ModelError::InvalidBatch("an MTP head needs the model's hidden states".to_string())
            })?;
            mtp.forward(backend, cfg, ws, tokens, hidden)?;
        }
        if let Some(first) = self.layers.first() {
            backend.rms_norm(
                &ws.x,
                &first.input_layernorm,
                tokens,
                h,
                eps,
                true,
                &mut ws.h,
            )?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Linear(net, i) => {
                    let state = state.as_deref_mut().ok_or_else(|| {
                        ModelError::InvalidBatch("a hybrid model needs recurrent state".to_string())
                    })?;
                    net.forward(backend, cfg, hy, ws, tokens, num_runs, state, *i)?
                }
                Mixer::Full(attn, i) => {
                    let kv = cache.layers.get_mut(*i).ok_or_else(|| {
                        ModelError::InvalidBatch("the KV cache has too few layers".to_string())
                    })?;
                    attn.forward(backend, cfg, ws, tokens, kv, cache.block_size)?;
                }
            }
            backend.add_rms_norm(
                &mut ws.x,
                &ws.out,
                &layer.post_attention_layernorm,
                tokens,
                h,
                eps,
                true,
                &mut ws.h,
            )?;
            match &layer.ffn {
                FeedForward::Dense(mlp) => mlp.forward(backend, ws, tokens)?,
                FeedForward::Sparse { moe, shared } => {
                    let before = backend.stats();
                    moe.forward(backend, ws, tokens, strategy)?;
                    if let Some((mlp, gate)) = shared {
                        mlp.forward_into(backend, ws, tokens, true)?;
                        backend.matmul(
                            &ws.h,
                            tokens,
                            WeightView::new(gate, 1, h)?,
                            &mut ws.hybrid.shared_gate,
                        )?;
                        backend.add_sigmoid_gated(
                            &mut ws.out,
                            &ws.shared_out,
                            &ws.hybrid.shared_gate,
                            tokens,
                            h,
                        )?;
                    }
                    *moe_stats = *moe_stats + (backend.stats() - before);
                }
            }
            let next_norm = self.layers.get(i + 1).map(|next| &next.input_layernorm);
            residual_and_next_norm(backend, ws, next_norm, tokens, h, eps, true)?;
        }
        self.head.forward(backend, cfg, ws, &self.embed_tokens)
    }
}

impl super::FamilyModel for HybridModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The type the weights are stored in (the embedding's, as the projections').
    fn weight_dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    fn lm_head_to_q8_0(&mut self, backend: &dyn Backend) -> Result<bool> {
        let shape = (self.config.vocab_size, self.config.hidden_size);
        self.head.store_as_q8_0(backend, &self.embed_tokens, shape)
    }

    fn moe_blocks(&self) -> Vec<&SparseMoe> {
        self.layers
            .iter()
            .filter_map(|l| match &l.ffn {
                FeedForward::Sparse { moe, .. } => Some(moe.as_ref()),
                _ => None,
            })
            .collect()
    }

    fn recurrent(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Linear(..)))
    }

    fn forward(&self, step: super::StepCtx<'_>) -> Result<()> {
        let super::StepCtx {
            backend,
            batch,
            cache,
            state,
            ws,
            strategy,
            moe_stats,
            hidden,
        } = step;
        self.forward_layers(
            backend, batch, cache, state, ws, strategy, moe_stats, hidden,
        )
    }
}
