//! [`Model`]: a loaded model of any supported family, and its forward pass over a ragged batch.

use std::path::Path;
use std::sync::Arc;

use corral_backend::{Backend, DType, DispatchStats};

use crate::batch::RaggedBatch;
use crate::checkpoint::Checkpoint;
use crate::families::qwen3::Qwen3Model;
use crate::families::qwen3_next::HybridModel;
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::layers::Workspace;
use crate::moe::MoeStrategy;
use crate::weights::{SyntheticWeights, WeightSource};
use crate::{Family, ModelConfig, ModelError, Result};

#[derive(Debug)]
enum FamilyModel {
    Qwen3(Qwen3Model),
    Hybrid(HybridModel),
}

/// A model whose weights live on a backend.
#[derive(Debug)]
pub struct Model {
    inner: FamilyModel,
    backend: Arc<dyn Backend>,
    num_parameters: usize,
    weight_bytes: usize,
    moe_strategy: MoeStrategy,
}

/// What one forward pass cost.
#[derive(Clone, Copy, Debug, Default)]
#[must_use]
pub struct ForwardReport {
    /// Tokens in the batch.
    pub tokens: usize,
    /// Dispatches, host syncs, allocations and bytes of this forward.
    pub stats: DispatchStats,
    /// The part of `stats` spent in MoE blocks (router included).
    pub moe_stats: DispatchStats,
    /// MoE blocks run.
    pub moe_layers: usize,
}

impl Model {
    /// Loads the checkpoint in `dir` (config.json + safetensors) onto `backend`.
    /// `progress(done, total)` is called as layers are bound.
    pub fn load(
        dir: &Path,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let (elements, bytes) = (ckpt.total_elements(), ckpt.total_bytes());
        Self::bind(&ckpt, config, backend, progress, elements, bytes)
    }

    /// Builds a model of `config` with deterministic random weights (normal, std 0.02; norms
    /// at 1) made directly in the backend's memory, stored as the config's dtype (bf16 unless
    /// it says float32 or float16).
    pub fn synthetic(
        config: ModelConfig,
        backend: Arc<dyn Backend>,
        seed: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let dtype = match config.dtype.as_deref() {
            Some("float32") => DType::F32,
            Some("float16") => DType::F16,
            _ => DType::BF16,
        };
        let source = SyntheticWeights { dtype, seed };
        let elements = config.num_parameters();
        Self::bind(
            &source,
            config,
            backend,
            progress,
            elements,
            elements * dtype.size_bytes(),
        )
    }

    fn bind(
        source: &dyn WeightSource,
        config: ModelConfig,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
        num_parameters: usize,
        weight_bytes: usize,
    ) -> Result<Self> {
        let inner = match config.family {
            Family::Qwen3Moe | Family::Qwen3 => FamilyModel::Qwen3(Qwen3Model::load(
                source,
                backend.as_ref(),
                config,
                progress,
            )?),
            Family::Qwen3Next | Family::Qwen35Moe | Family::Qwen35 => FamilyModel::Hybrid(
                HybridModel::load(source, backend.as_ref(), config, progress)?,
            ),
        };
        Ok(Self {
            inner,
            backend,
            num_parameters,
            weight_bytes,
            moe_strategy: MoeStrategy::default(),
        })
    }

    /// The MoE strategy forwards use.
    pub fn moe_strategy(&self) -> MoeStrategy {
        self.moe_strategy
    }

    /// Sets the MoE strategy forwards use.
    pub fn set_moe_strategy(&mut self, strategy: MoeStrategy) {
        self.moe_strategy = strategy;
    }

    /// Sparse MoE layers.
    pub fn num_sparse_layers(&self) -> usize {
        match &self.inner {
            FamilyModel::Qwen3(m) => m.num_sparse_layers(),
            FamilyModel::Hybrid(m) => m.num_sparse_layers(),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match &self.inner {
            FamilyModel::Qwen3(m) => m.config(),
            FamilyModel::Hybrid(m) => m.config(),
        }
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Parameters in the checkpoint.
    pub fn num_parameters(&self) -> usize {
        self.num_parameters
    }

    /// Bytes of weights as stored.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Whether the model has recurrent (Gated DeltaNet) layers and so needs
    /// [`Model::forward_with_state`].
    pub fn is_hybrid(&self) -> bool {
        matches!(self.inner, FamilyModel::Hybrid(_))
    }

    /// Runs `batch` through the model, reading and extending `cache`, and writes the logits
    /// of the rows [`RaggedBatch::logit_rows`] names, `[rows, vocab]` row-major, to `logits`.
    /// Hybrid models need [`Model::forward_with_state`].
    pub fn forward(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        logits: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        self.run(batch, cache, None, logits)
    }

    /// [`Model::forward`] for models with recurrent layers: every run of `batch` has a state
    /// slot in `state`, which the run continues (or starts afresh at position 0).
    pub fn forward_with_state(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        state: &mut RecurrentStateCache,
        logits: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        self.run(batch, cache, Some(state), logits)
    }

    fn run(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        logits: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        let backend = self.backend.as_ref();
        let before = backend.stats();
        if batch.is_empty() {
            return Err(ModelError::InvalidBatch("no tokens".to_string()));
        }
        if batch.block_size() != cache.block_size {
            return Err(ModelError::InvalidBatch(format!(
                "batch block size {} differs from the cache's {}",
                batch.block_size(),
                cache.block_size
            )));
        }
        let config = self.config();
        if let Some(&t) = batch
            .tokens()
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(ModelError::InvalidBatch(format!(
                "token id {t} is outside the vocabulary of {}",
                config.vocab_size
            )));
        }
        if let Some(run) = batch.runs().iter().find(|r| {
            r.block_table
                .blocks
                .iter()
                .any(|b| b.0 as usize >= cache.num_blocks)
        }) {
            return Err(ModelError::InvalidBatch(format!(
                "sequence {} uses a block beyond the cache's {}",
                run.seq_id.0, cache.num_blocks
            )));
        }
        let recurrent_runs = match (&self.inner, state.as_deref()) {
            (FamilyModel::Hybrid(_), None) => {
                return Err(ModelError::InvalidBatch(
                    "a hybrid model needs recurrent state: use forward_with_state".to_string(),
                ));
            }
            (FamilyModel::Hybrid(_), Some(state)) => {
                let runs = batch.recurrent_runs().ok_or_else(|| {
                    ModelError::InvalidBatch(
                        "every run of a hybrid model needs a state slot".to_string(),
                    )
                })?;
                if runs
                    .chunks_exact(4)
                    .any(|r| r[2] as usize >= state.num_slots)
                    || state.conv.len() != config.num_linear_layers()
                {
                    return Err(ModelError::InvalidBatch(format!(
                        "state slots beyond the cache's {} or a cache made for another model",
                        state.num_slots
                    )));
                }
                runs
            }
            (FamilyModel::Qwen3(_), _) => Vec::new(),
        };
        let rows = batch.logit_rows();
        let (tables, width) = batch.padded_block_tables();
        let tokens = batch.num_tokens();
        let mut ws = Workspace::take(
            backend,
            config,
            tokens,
            batch.runs().len(),
            width,
            rows.len(),
        )?;
        let mut moe_stats = DispatchStats::default();
        let result = (|| {
            backend.upload_u32(batch.tokens(), &mut ws.batch.ids)?;
            backend.upload_u32(batch.positions(), &mut ws.batch.positions)?;
            backend.upload_u32(&batch.token_runs(), &mut ws.batch.token_runs)?;
            backend.upload_u32(&batch.slots(), &mut ws.batch.slots)?;
            backend.upload_u32(&tables, &mut ws.batch.block_tables)?;
            backend.upload_u32(&rows, &mut ws.batch.logit_rows)?;
            if !recurrent_runs.is_empty() {
                backend.upload_u32(&recurrent_runs, &mut ws.batch.recurrent_runs)?;
            }
            match &self.inner {
                FamilyModel::Qwen3(m) => m.forward(
                    backend,
                    batch,
                    cache,
                    &mut ws,
                    self.moe_strategy,
                    &mut moe_stats,
                )?,
                FamilyModel::Hybrid(m) => {
                    let state = state.as_deref_mut().ok_or_else(|| {
                        ModelError::InvalidBatch("a hybrid model needs recurrent state".to_string())
                    })?;
                    m.forward(
                        backend,
                        batch,
                        cache,
                        state,
                        &mut ws,
                        self.moe_strategy,
                        &mut moe_stats,
                    )?
                }
            }
            logits.resize(rows.len() * config.vocab_size, 0.0);
            if !rows.is_empty() {
                backend.download_f32(&ws.logits, logits)?;
            }
            Ok(())
        })();
        ws.give(backend);
        result.map(|()| ForwardReport {
            tokens,
            stats: backend.stats() - before,
            moe_stats,
            moe_layers: self.num_sparse_layers(),
        })
    }
}
