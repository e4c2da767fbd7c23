//! [`Model`]: a loaded model of any supported family, and its forward pass over a ragged batch.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use corral_backend::sampling::{
    CANDIDATE_ROW_WORDS, DRAW_WORDS, Filter, Penalty, RowCandidates, RowDraw,
};
use corral_backend::{Backend, BufferUsage, DType, DispatchStats, Graph};

use crate::batch::RaggedBatch;
use crate::checkpoint::{Checkpoint, GgufCheckpoint};
use crate::families::qwen3::Qwen3Model;
use crate::families::qwen3_next::HybridModel;
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::layers::Workspace;
use crate::moe::MoeStrategy;
use crate::weights::{SyntheticMix, SyntheticWeights, WeightSource};
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
    /// Whether decode steps replay recorded graphs (on backends that record them).
    graphs_enabled: bool,
    /// Recorded decode-step graphs and the workspaces they are bound to, by shape.
    graphs: Mutex<HashMap<GraphKey, GraphEntry>>,
    /// The batch metadata a step uploads, in vectors reused from step to step.
    step_rows: Mutex<StepRows>,
}

/// A batch's metadata as a step uploads it ([`RaggedBatch`]'s `*_into` methods).
#[derive(Debug, Default)]
struct StepRows {
    token_runs: Vec<u32>,
    slots: Vec<u32>,
    tables: Vec<u32>,
    logit_rows: Vec<u32>,
    recurrent_runs: Vec<u32>,
}

/// Blocks by which decode graphs pad the block-table width, so that one graph serves a
/// sequence for `GRAPH_WIDTH_STEP × block_size` tokens of growth.
const GRAPH_WIDTH_STEP: usize = 64;
/// Shapes kept recorded at once, and the workspace bytes they may hold; past either the
/// graph cache starts afresh.
const MAX_GRAPHS: usize = 64;
const MAX_GRAPH_BYTES: usize = 2 << 30;

/// What a recorded decode step depends on besides buffer contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    tokens: usize,
    runs: usize,
    width: usize,
    logit_rows: usize,
    strategy: MoeStrategy,
    cache: u64,
    /// The recurrent-state cache's id (hybrids), else 0.
    state: u64,
}

/// A decode shape's workspace and, once recorded, its graph.
struct GraphEntry {
    ws: Workspace,
    graph: Option<Graph>,
    runs: u64,
    moe_stats: DispatchStats,
}

impl std::fmt::Debug for GraphEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphEntry({:?}, {} runs)", self.graph, self.runs)
    }
}

/// An open graph recording, ended when dropped if [`Capture::end`] was not called.
struct Capture<'a> {
    backend: &'a dyn Backend,
    open: bool,
}

impl<'a> Capture<'a> {
    fn new(backend: &'a dyn Backend) -> Self {
        Self {
            backend,
            open: true,
        }
    }

    fn end(&mut self) -> corral_backend::Result<Graph> {
        self.open = false;
        self.backend.end_capture()
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.backend.end_capture();
        }
    }
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
        let bytes = gguf.loaded_bytes(&|format| backend.reads_quantized(format));
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
            graphs_enabled: true,
            graphs: Mutex::new(HashMap::new()),
            step_rows: Mutex::default(),
        })
    }

    /// Whether decode steps replay recorded graphs where the backend records them (default
    /// on); off runs every step eagerly.
    pub fn set_graphs(&mut self, enabled: bool) {
        self.graphs_enabled = enabled;
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
        let moes = match &self.inner {
            FamilyModel::Qwen3(m) => m.moe_blocks(),
            FamilyModel::Hybrid(m) => m.moe_blocks(),
        };
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
        match &self.inner {
            FamilyModel::Qwen3(m) => m.num_sparse_layers(),
            FamilyModel::Hybrid(m) => m.num_sparse_layers(),
        }
    }

    /// The element type of the norms' outputs (`ws.h`) in a forward of `tokens`: what the
    /// backend's projections take best, where every reader of `ws.h` takes it (the grouped
    /// experts do; the per-expert baselines' gathers and the per-token products read f32).
    fn norm_out_dtype(&self, tokens: usize) -> DType {
        let weights = match &self.inner {
            FamilyModel::Qwen3(m) => m.weight_dtype(),
            FamilyModel::Hybrid(m) => m.weight_dtype(),
        };
        let experts_take_it = self.num_sparse_layers() == 0
            || self.moe_strategy.resolve(tokens) == MoeStrategy::Grouped;
        if experts_take_it {
            self.backend.gemm_input_dtype(tokens, weights)
        } else {
            DType::F32
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

    /// One step, run where the backend runs steps best ([`Backend::run_step`]).
    fn run(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        out: &mut StepOutput<'_>,
    ) -> Result<ForwardReport> {
        let mut result = None;
        self.backend.run_step(&mut || {
            result = Some(self.run_here(batch, cache, state.take(), out));
        });
        result.unwrap_or_else(|| Err(ModelError::InvalidBatch("the step did not run".to_string())))
    }

    fn run_here(
        &self,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        out: &mut StepOutput<'_>,
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
        let mut step_rows = self.step_rows.lock().unwrap_or_else(|e| e.into_inner());
        let StepRows {
            token_runs,
            slots,
            tables,
            logit_rows: rows,
            recurrent_runs,
        } = &mut *step_rows;
        match (&self.inner, state.as_deref()) {
            (FamilyModel::Hybrid(_), None) => {
                return Err(ModelError::InvalidBatch(
                    "a hybrid model needs recurrent state: use forward_with_state".to_string(),
                ));
            }
            (FamilyModel::Hybrid(_), Some(state)) => {
                if !batch.recurrent_runs_into(recurrent_runs) {
                    return Err(ModelError::InvalidBatch(
                        "every run of a hybrid model needs a state slot".to_string(),
                    ));
                }
                if recurrent_runs
                    .chunks_exact(4)
                    .any(|r| r[2] as usize >= state.num_slots)
                    || state.conv.len() != config.num_linear_layers()
                {
                    return Err(ModelError::InvalidBatch(format!(
                        "state slots beyond the cache's {} or a cache made for another model",
                        state.num_slots
                    )));
                }
            }
            (FamilyModel::Qwen3(_), _) => recurrent_runs.clear(),
        }
        batch.logit_rows_into(rows);
        batch.token_runs_into(token_runs);
        batch.slots_into(slots);
        let tokens = batch.num_tokens();
        let max_run_tokens = batch.runs().iter().map(|r| r.len).max().unwrap_or(1);
        // Decode steps (every run one token) replay a recorded graph per shape; the table
        // width is padded so that a graph lasts GRAPH_WIDTH_STEP blocks. (Padded also with
        // graphs off, so that eager steps run the very same kernels.)
        let decode_shaped = backend.records_graphs()
            && max_run_tokens == 1
            && !self.moe_strategy.syncs_host(tokens);
        let graphable = decode_shaped && self.graphs_enabled;
        let mut width = batch.table_width();
        if decode_shaped {
            width = width.div_ceil(GRAPH_WIDTH_STEP) * GRAPH_WIDTH_STEP;
        }
        batch.block_tables_into(width, tables);
        let mut moe_stats = DispatchStats::default();
        let upload = |ws: &mut Workspace| -> Result<()> {
            backend.upload_u32(batch.tokens(), &mut ws.batch.ids)?;
            backend.upload_u32(batch.positions(), &mut ws.batch.positions)?;
            backend.upload_u32(token_runs, &mut ws.batch.token_runs)?;
            backend.upload_u32(slots, &mut ws.batch.slots)?;
            backend.upload_u32(tables, &mut ws.batch.block_tables)?;
            backend.upload_u32(rows, &mut ws.batch.logit_rows)?;
            if !recurrent_runs.is_empty() {
                backend.upload_u32(recurrent_runs, &mut ws.batch.recurrent_runs)?;
            }
            Ok(())
        };
        let forward = |ws: &mut Workspace,
                       cache: &mut PagedKvCache,
                       state: Option<&mut RecurrentStateCache>,
                       moe_stats: &mut DispatchStats|
         -> Result<()> {
            match &self.inner {
                FamilyModel::Qwen3(m) => {
                    m.forward(backend, batch, cache, ws, self.moe_strategy, moe_stats)
                }
                FamilyModel::Hybrid(m) => {
                    let state = state.ok_or_else(|| {
                        ModelError::InvalidBatch("a hybrid model needs recurrent state".to_string())
                    })?;
                    m.forward(
                        backend,
                        batch,
                        cache,
                        state,
                        ws,
                        self.moe_strategy,
                        moe_stats,
                    )
                }
            }
        };
        let result = if graphable {
            let key = GraphKey {
                tokens,
                runs: batch.runs().len(),
                width,
                logit_rows: rows.len(),
                strategy: self.moe_strategy,
                cache: cache.id(),
                state: state.as_deref().map_or(0, RecurrentStateCache::id),
            };
            let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            // Graphs of another cache are dead (each is bound to its caches' memory); past the
            // count or byte bound the cache starts afresh.
            if !graphs.contains_key(&key)
                && (graphs
                    .keys()
                    .any(|k| k.cache != key.cache || k.state != key.state)
                    || graphs.len() >= MAX_GRAPHS
                    || graphs.values().map(|e| e.ws.size_bytes()).sum::<usize>() >= MAX_GRAPH_BYTES)
            {
                for (_, entry) in graphs.drain() {
                    entry.ws.give(backend);
                }
            }
            let entry = match graphs.entry(key) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let mut ws = Workspace::take(
                        backend,
                        config,
                        (tokens, self.norm_out_dtype(tokens)),
                        key.runs,
                        width,
                        rows.len(),
                    )?;
                    ws.max_run_tokens = 1;
                    ws.leading_decode_tokens = tokens;
                    e.insert(GraphEntry {
                        ws,
                        graph: None,
                        runs: 0,
                        moe_stats: DispatchStats::default(),
                    })
                }
            };
            (|| {
                upload(&mut entry.ws)?;
                entry.runs += 1;
                // The first step of a shape runs eagerly (warming everything up); the second
                // records the graph, which then runs this step and every later one.
                if entry.graph.is_none() && entry.runs >= 2 {
                    backend.begin_capture()?;
                    // Ends the recording even if the forward unwinds.
                    let mut capture = Capture::new(backend);
                    let mut recorded = DispatchStats::default();
                    let ran = forward(&mut entry.ws, cache, state.as_deref_mut(), &mut recorded);
                    let graph = capture.end();
                    ran?;
                    entry.graph = Some(graph?);
                    entry.moe_stats = recorded;
                }
                match &entry.graph {
                    Some(graph) => {
                        backend.replay(graph)?;
                        moe_stats = entry.moe_stats;
                    }
                    None => forward(&mut entry.ws, cache, state.as_deref_mut(), &mut moe_stats)?,
                }
                read_out(backend, &mut entry.ws, rows.len(), config.vocab_size, out)
            })()
        } else {
            let mut ws = Workspace::take(
                backend,
                config,
                (tokens, self.norm_out_dtype(tokens)),
                batch.runs().len(),
                width,
                rows.len(),
            )?;
            ws.max_run_tokens = max_run_tokens;
            ws.leading_decode_tokens = batch.runs().iter().take_while(|r| r.len == 1).count();
            let result = (|| {
                upload(&mut ws)?;
                forward(&mut ws, cache, state.as_deref_mut(), &mut moe_stats)?;
                read_out(backend, &mut ws, rows.len(), config.vocab_size, out)
            })();
            ws.give(backend);
            result
        };
        result.map(|()| ForwardReport {
            tokens,
            stats: backend.stats() - before,
            moe_stats,
            moe_layers: self.num_sparse_layers(),
        })
    }
}

/// What a forward pass reads back.
enum StepOutput<'a> {
    /// Every wanted row's logits, `[rows, vocab]`.
    Logits(&'a mut Vec<f32>),
    /// Every wanted row reduced on the device.
    Sampled(&'a mut SampledStep),
}

/// A step's sampling on the device: penalties applied to the logits where they are, each row
/// reduced to its candidates ([`RowCandidates`]), and only the rows whose filters those do
/// not decide read back whole.
#[derive(Debug, Default)]
pub struct SampledStep {
    /// In: per logits row (in [`RaggedBatch::logit_rows`] order), its filters and draw.
    pub rows: Vec<(Filter, RowDraw)>,
    /// In: penalties, indexed into `[rows, vocab]`.
    pub penalties: Vec<Penalty>,
    /// In: the rows that report log-probabilities (read whole if their reduction is
    /// truncated; missing entries count as false).
    pub logprobs: Vec<bool>,
    /// Out: per row, its candidates.
    pub candidates: Vec<RowCandidates>,
    /// Out: per row, its whole penalised logits when the candidates do not decide its pick
    /// (or are truncated and it reports log-probabilities).
    pub full_rows: Vec<Option<Vec<f32>>>,
    words: Vec<u32>,
}

/// Entries of a penalty buffer: powers of two from this, so that steady steps reuse buffers.
const MIN_PENALTY_ENTRIES: usize = 1024;

fn read_out(
    backend: &dyn Backend,
    ws: &mut Workspace,
    rows: usize,
    vocab: usize,
    out: &mut StepOutput<'_>,
) -> Result<()> {
    let step = match out {
        StepOutput::Logits(logits) => {
            logits.resize(rows * vocab, 0.0);
            if rows > 0 {
                backend.download_f32(&ws.logits, logits)?;
            }
            return Ok(());
        }
        StepOutput::Sampled(step) => step,
    };
    if step.rows.len() != rows {
        return Err(ModelError::InvalidBatch(format!(
            "sampling asks for {} rows, the batch has {rows}",
            step.rows.len()
        )));
    }
    // Rows' candidates are read into those of the last step (no allocation once warm).
    step.candidates.truncate(rows);
    step.candidates.resize_with(rows, RowCandidates::default);
    step.full_rows.clear();
    if rows == 0 {
        return Ok(());
    }
    if !step.penalties.is_empty() {
        let n = step.penalties.len();
        let mut entries = backend.take_buffer(
            DType::U32,
            (n * DRAW_WORDS)
                .next_power_of_two()
                .max(MIN_PENALTY_ENTRIES * DRAW_WORDS),
            BufferUsage::Metadata,
        )?;
        step.words.clear();
        step.words
            .extend(step.penalties.iter().flat_map(Penalty::words));
        let applied = backend
            .upload_u32(&step.words, &mut entries)
            .and_then(|()| backend.logit_penalties(&mut ws.logits, rows * vocab, &entries, n));
        backend.give_buffer(entries);
        applied?;
    }
    step.words.clear();
    step.words
        .extend(step.rows.iter().flat_map(|(_, draw)| draw.words()));
    backend.upload_u32(&step.words, &mut ws.draws)?;
    backend.top_candidates(&ws.logits, rows, vocab, &ws.draws, &mut ws.candidates)?;
    step.words.resize(rows * CANDIDATE_ROW_WORDS, 0);
    backend.download_u32(&ws.candidates, &mut step.words)?;
    let rows_read = step.words.chunks_exact(CANDIDATE_ROW_WORDS);
    for (i, (words, candidates)) in rows_read.zip(&mut step.candidates).enumerate() {
        candidates.read_words(words);
        // A truncated row's later candidates (and so its top log-probabilities) are not exact.
        let wants_top = step.logprobs.get(i).copied().unwrap_or(false);
        let full = if candidates.decides(&step.rows[i].0) && !(candidates.truncated && wants_top) {
            None
        } else {
            let mut bytes = vec![0u8; vocab * 4];
            backend.read_bytes(&ws.logits, i * vocab, &mut bytes)?;
            Some(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            )
        };
        step.full_rows.push(full);
    }
    Ok(())
}
