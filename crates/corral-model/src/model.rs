//! [`Model`]: a loaded model of any supported family, and its forward pass over a ragged batch.

use std::path::Path;
use std::sync::Arc;

use corral_backend::{Backend, DType};

use crate::batch::RaggedBatch;
use crate::checkpoint::{Checkpoint, GgufCheckpoint};
use crate::families::FamilyModel;
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::moe::MoeStrategy;
use crate::step_runner::{ForwardReport, SampledStep, StepModel, StepOutput, StepRunner};
use crate::weights::{SyntheticMix, SyntheticWeights, WeightSource};
use crate::{ModelConfig, ModelError, Result};

/// A model whose weights live on a backend.
#[derive(Debug)]
pub struct Model {
    family: Box<dyn FamilyModel>,
    backend: Arc<dyn Backend>,
    num_parameters: usize,
    weight_bytes: usize,
    sparse_layers: usize,
    moe_strategy: MoeStrategy,
    runner: StepRunner,
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

    /// Loads the MTP head of the checkpoint in `dir` (Qwen's `mtp.*` tensors: the two
    /// pre-fc norms, `fc`, one decoder layer, the final norm; the embedding and LM head are
    /// the model's) as a model of its own: [`Model::forward_mtp`] runs it, with a KV cache
    /// of its one attention layer ([`ModelConfig::mtp`]) and no recurrent state.
    pub fn load_mtp(
        dir: &Path,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        Self::bind_mtp(&ckpt, &config, backend, progress, ckpt.mtp_size())
    }

    /// [`Model::load_mtp`] from a GGUF file that carries the head (llama.cpp's "-MTP"
    /// conversions: `blk.{L}.*` and `blk.{L}.nextn.*`, read under the `mtp.*` names).
    pub fn mtp_from_gguf(
        gguf: &GgufCheckpoint,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = gguf.config()?;
        Self::bind_mtp(gguf, &config, backend, progress, gguf.mtp_size())
    }

    /// The MTP head of a model of `config` from `source`; `(parameters, bytes)` its own
    /// tensors' size. Its weight bytes also count the embedding and LM head it loads again
    /// (in the config's type: copies where the backend does not map the file), so that a
    /// memory plan holds room for them.
    fn bind_mtp(
        source: &dyn WeightSource,
        config: &ModelConfig,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
        (num_parameters, weight_bytes): (usize, usize),
    ) -> Result<Self> {
        let family = crate::families::load_mtp(source, backend.as_ref(), config, progress)?;
        Ok(Self::of_family(
            family,
            backend,
            num_parameters,
            weight_bytes + Self::mtp_copied_bytes(config),
        ))
    }

    /// Bytes of the embedding and LM head an MTP head of `config` loads again beside the
    /// model's, as speculation keeps them: the embedding in the config's type, the LM head
    /// as Q8_0 where its rows divide into blocks ([`Model::use_q8_0_lm_head`]).
    pub fn mtp_copied_bytes(config: &ModelConfig) -> usize {
        let values = config.vocab_size * config.hidden_size;
        let float = values * Self::synthetic_dtype(config).size_bytes();
        let q8_0 = corral_backend::QuantFormat::Q8_0;
        let lm_head = if config.hidden_size.is_multiple_of(q8_0.block().0) {
            q8_0.bytes_of(values)
        } else if config.tie_word_embeddings {
            0
        } else {
            float
        };
        float + lm_head
    }

    /// Loads a GGUF file (llama.cpp's converter's names and metadata) onto `backend`:
    /// plain tensors mapped, block-quantized ones decoded to f32.
    pub fn load_gguf(
        path: &Path,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::from_gguf(&GgufCheckpoint::open(path)?, backend, progress)
    }

    /// [`Model::load_gguf`] from a file already opened (its header read once for the model,
    /// the vocabulary and the stop ids).
    pub fn from_gguf(
        gguf: &GgufCheckpoint,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let config = gguf.config()?;
        let elements = gguf.tensors().map(|t| t.numel() as usize).sum();
        let bytes = gguf.loaded_bytes(&|format| backend.capabilities().reads(format));
        Self::bind(gguf, config, backend, progress, elements, bytes)
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
        Self::synthetic_mixed(config, SyntheticMix::Float, backend, seed, progress)
    }

    /// As [`Model::synthetic`], with the matrices that `mix` names in block formats (random
    /// blocks of the same spread), where the backend reads them as stored.
    pub fn synthetic_mixed(
        config: ModelConfig,
        mix: SyntheticMix,
        backend: Arc<dyn Backend>,
        seed: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let dtype = Self::synthetic_dtype(&config);
        let source = SyntheticWeights {
            dtype,
            seed,
            mix,
            num_layers: config.num_layers,
        };
        let elements = config.num_parameters();
        let bytes = Self::synthetic_weight_bytes(&config);
        Self::bind(&source, config, backend, progress, elements, bytes)
    }

    /// An MTP head for [`Model::synthetic_mixed`]'s model of the same `config`, `mix` and
    /// `seed` (its embedding and LM head the same random tensors): random drafts, for timing
    /// speculation at full size (with a forced acceptance, since they mean nothing).
    pub fn synthetic_mtp(
        config: &ModelConfig,
        mix: SyntheticMix,
        backend: Arc<dyn Backend>,
        seed: u64,
    ) -> Result<Self> {
        let head = config.mtp()?;
        let h = config.hidden_size;
        // The head's decoder layer (its config's parameters less the embedding, final norm
        // and LM head), three norms and `fc`; the embedding and LM head are the model's.
        let untied = if head.tie_word_embeddings { 0 } else { 1 };
        let layer = head.num_parameters() - (1 + untied) * head.vocab_size * h - h;
        let parameters = layer + 3 * h + 2 * h * h;
        let source = SyntheticWeights {
            dtype: Self::synthetic_dtype(config),
            seed,
            mix,
            num_layers: config.num_layers,
        };
        let bytes = parameters * Self::synthetic_dtype(config).size_bytes();
        Self::bind_mtp(
            &source,
            config,
            backend,
            &mut |_, _| {},
            (parameters, bytes),
        )
    }

    /// Stores the LM head again as Q8_0 (a copy of its own, untied from the embedding) where
    /// it is a float matrix and the backend reads Q8_0: for an MTP head, whose drafts only
    /// propose what the model then verifies, about half the bytes each pass reads (bf16's 2
    /// bytes a weight against 34 bytes a block of 32). Before any forward; false where left
    /// as it was (a block format already, or a family without one).
    pub fn use_q8_0_lm_head(&mut self) -> Result<bool> {
        let changed = self.family.lm_head_to_q8_0(self.backend.as_ref())?;
        if changed {
            // Recorded graphs would read the old matrix.
            let graphs = self.runner.graphs_enabled;
            self.runner = StepRunner::default();
            self.runner.graphs_enabled = graphs;
        }
        Ok(changed)
    }

    /// The type synthetic weights of `config` are stored as: bf16 unless it says float32 or
    /// float16.
    pub fn synthetic_dtype(config: &ModelConfig) -> DType {
        match config.dtype.as_deref() {
            Some("float32") => DType::F32,
            Some("float16") => DType::F16,
            _ => DType::BF16,
        }
    }

    /// The weight bytes of a synthetic model of `config`, without making it.
    pub fn synthetic_weight_bytes(config: &ModelConfig) -> usize {
        config.num_parameters() * Self::synthetic_dtype(config).size_bytes()
    }

    fn bind(
        source: &dyn WeightSource,
        config: ModelConfig,
        backend: Arc<dyn Backend>,
        progress: &mut dyn FnMut(usize, usize),
        num_parameters: usize,
        weight_bytes: usize,
    ) -> Result<Self> {
        let family = crate::families::load(source, backend.as_ref(), config, progress)?;
        Ok(Self::of_family(
            family,
            backend,
            num_parameters,
            weight_bytes,
        ))
    }

    fn of_family(
        family: Box<dyn FamilyModel>,
        backend: Arc<dyn Backend>,
        num_parameters: usize,
        weight_bytes: usize,
    ) -> Self {
        Self {
            sparse_layers: family.moe_blocks().len(),
            family,
            backend,
            num_parameters,
            weight_bytes,
            moe_strategy: MoeStrategy::default(),
            runner: StepRunner::default(),
        }
    }

    /// Whether decode and verify steps replay recorded graphs where the backend records them
    /// (default on); off runs every step eagerly.
    pub fn set_graphs(&mut self, enabled: bool) {
        self.runner.graphs_enabled = enabled;
    }

    /// The MoE strategy forwards use.
    pub fn moe_strategy(&self) -> MoeStrategy {
        self.moe_strategy
    }

    /// Sets the MoE strategy forwards use.
    pub fn set_moe_strategy(&mut self, strategy: MoeStrategy) {
        self.moe_strategy = strategy;
    }

    /// Measures (or reads from the calibration cache) the token count from which the grouped
    /// strategy beats per-token for this model on its backend, running the model's own MoE
    /// blocks in turn; `None` without MoE layers.
    pub fn calibrate_moe_threshold(&self, reps: usize) -> Result<Option<crate::MoeCalibration>> {
        let moes = self.family.moe_blocks();
        if moes.is_empty() {
            return Ok(None);
        }
        Ok(Some(crate::moe::calibrate(
            self.backend.as_ref(),
            self.config(),
            &moes,
            reps.max(1),
        )?))
    }

    /// Sparse MoE layers.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.family.config()
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
        self.family.recurrent()
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
        self.run(batch, cache, None, &mut StepOutput::Logits(logits))
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
        self.run(batch, cache, Some(state), &mut StepOutput::Logits(logits))
    }

    /// A forward pass whose logits rows are reduced for sampling where they are
    /// ([`SampledStep`]) instead of read back whole; `state` as [`Model::forward_with_state`]
    /// asks (`None` for models without recurrent layers).
    pub fn forward_sampled(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        state: Option<&mut RecurrentStateCache>,
        step: &mut SampledStep,
    ) -> Result<ForwardReport> {
        self.run(batch, cache, state, &mut StepOutput::Sampled(step))
    }

    /// [`Model::forward_sampled`], also reading back every token's final hidden state after
    /// the final norm, `[tokens, hidden]` (an MTP drafter's input).
    pub fn forward_sampled_with_all_hidden(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        state: Option<&mut RecurrentStateCache>,
        step: &mut SampledStep,
        hidden: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        self.run(
            batch,
            cache,
            state,
            &mut StepOutput::SampledAndAllHidden(step, hidden),
        )
    }

    /// [`Model::forward_with_state`] (`state` `None` for models without recurrent layers),
    /// also reading back every token's final hidden state after the final norm, `[tokens,
    /// hidden]`: what an MTP head takes, for every position a step computes.
    pub fn forward_with_all_hidden(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        state: Option<&mut RecurrentStateCache>,
        logits: &mut Vec<f32>,
        hidden: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        self.run(
            batch,
            cache,
            state,
            &mut StepOutput::LogitsAndAllHidden(logits, hidden),
        )
    }

    /// Runs an MTP head ([`Model::load_mtp`]) over `batch`: row i of `hidden` (`[tokens,
    /// hidden]`) is the model's final hidden state (after its final norm) at the position
    /// before batch token i, which is the token after it. Writes the logits of the rows
    /// [`RaggedBatch::logit_rows`] names, each predicting the token after its own, and the
    /// head's own hidden states of those rows to `hidden_out` (the next draft's input).
    /// Row t may sit at position t: attention under RoPE sees only differences of positions.
    pub fn forward_mtp(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        hidden: &[f32],
        logits: &mut Vec<f32>,
        hidden_out: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        let out = &mut StepOutput::LogitsAndHidden(logits, hidden_out);
        self.run_mtp(batch, cache, hidden, out)
    }

    /// [`Model::forward_mtp`] with the logits rows reduced where they are ([`SampledStep`])
    /// instead of read back whole: a drafter's greedy pick costs a few words a row.
    pub fn forward_mtp_sampled(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        hidden: &[f32],
        step: &mut SampledStep,
        hidden_out: &mut Vec<f32>,
    ) -> Result<ForwardReport> {
        let out = &mut StepOutput::SampledAndHidden(step, hidden_out);
        self.run_mtp(batch, cache, hidden, out)
    }

    /// An MTP head's step over `batch` on the model's `hidden` states, a row of the model's
    /// width for every token, read as `out` asks.
    fn run_mtp(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        hidden: &[f32],
        out: &mut StepOutput<'_>,
    ) -> Result<ForwardReport> {
        let len = batch.num_tokens() * self.config().hidden_size;
        if hidden.len() != len {
            return Err(ModelError::InvalidBatch(format!(
                "{} hidden values for {} tokens of width {}",
                hidden.len(),
                batch.num_tokens(),
                self.config().hidden_size
            )));
        }
        self.run_with(batch, cache, None, Some(hidden), out)
    }

    /// One step, run where the backend runs steps best ([`Device::run_step`](corral_backend::Device::run_step)).
    fn run(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        state: Option<&mut RecurrentStateCache>,
        out: &mut StepOutput<'_>,
    ) -> Result<ForwardReport> {
        self.run_with(batch, cache, state, None, out)
    }

    /// [`Model::run`], with an MTP head's hidden-state input.
    fn run_with(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        hidden: Option<&[f32]>,
        out: &mut StepOutput<'_>,
    ) -> Result<ForwardReport> {
        let model = StepModel {
            family: self.family.as_ref(),
            backend: self.backend.as_ref(),
            strategy: self.moe_strategy,
            sparse_layers: self.sparse_layers,
        };
        let mut result = None;
        self.backend.run_step(&mut || {
            result = Some(
                self.runner
                    .run(&model, batch, cache, state.take(), hidden, out),
            );
        });
        result.unwrap_or_else(|| Err(ModelError::InvalidBatch("the step did not run".to_string())))
    }
}
