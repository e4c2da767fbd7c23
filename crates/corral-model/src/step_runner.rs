//! The step runner: one forward pass of a model over a ragged batch, from the checks of the
//! batch against the caches, through the upload of its metadata, to the output read back —
//! run eagerly, or replayed from a graph recorded for its shape (steps whose runs all take
//! the same few tokens: decode and the verify steps of speculative decoding), with the
//! graphs' workspaces kept by shape.

use std::collections::HashMap;
use std::sync::Mutex;

use corral_backend::sampling::{
    CANDIDATE_ROW_WORDS, DRAW_WORDS, Filter, Penalty, RowCandidates, RowDraw,
};
use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer, DispatchStats, Graph};

use crate::batch::RaggedBatch;
use crate::families::{FamilyModel, StepCtx};
use crate::kv_cache::{PagedKvCache, RecurrentStateCache};
use crate::layers::Workspace;
use crate::moe::MoeStrategy;
use crate::{ModelError, Result};

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

/// The model as a step sees it.
pub(crate) struct StepModel<'a> {
    pub(crate) family: &'a dyn FamilyModel,
    pub(crate) backend: &'a dyn Backend,
    pub(crate) strategy: MoeStrategy,
    /// Its sparse MoE layers.
    pub(crate) sparse_layers: usize,
}

impl StepModel<'_> {
    /// The element type of the norms' outputs (`ws.h`) in a forward of `tokens`: what the
    /// backend's projections take best, where every reader of `ws.h` takes it (the grouped
    /// experts do; the per-expert baselines' gathers and the per-token products read f32).
    fn norm_out_dtype(&self, tokens: usize) -> DType {
        let experts_take_it =
            self.sparse_layers == 0 || self.strategy.resolve(tokens) == MoeStrategy::Grouped;
        if experts_take_it {
            self.backend
                .gemm_input_dtype(tokens, self.family.weight_dtype())
        } else {
            DType::F32
        }
    }
}

/// Runs steps: the batch metadata's host vectors and the recorded graphs, reused from step
/// to step.
#[derive(Debug)]
pub(crate) struct StepRunner {
    /// Whether steps of a graph shape replay recorded graphs (on backends that record them).
    pub(crate) graphs_enabled: bool,
    /// Recorded graphs and the workspaces they are bound to, by shape.
    graphs: Mutex<HashMap<GraphKey, GraphEntry>>,
    /// The batch metadata a step uploads.
    rows: Mutex<StepRows>,
}

impl Default for StepRunner {
    fn default() -> Self {
        Self {
            graphs_enabled: true,
            graphs: Mutex::default(),
            rows: Mutex::default(),
        }
    }
}

/// A batch's metadata as a step uploads it ([`RaggedBatch`]'s `*_into` methods).
#[derive(Debug, Default)]
struct StepRows {
    token_runs: Vec<u32>,
    slots: Vec<u32>,
    tables: Vec<u32>,
    logit_rows: Vec<u32>,
    recurrent_runs: Vec<u32>,
    kept_states: Vec<u32>,
}

/// Blocks by which graphed steps pad the block-table width, so that one graph serves a
/// sequence for `GRAPH_WIDTH_STEP × block_size` tokens of growth.
const GRAPH_WIDTH_STEP: usize = 64;
/// Shapes kept recorded at once, and the workspace bytes they may hold; past either the
/// graph cache starts afresh.
const MAX_GRAPHS: usize = 64;
const MAX_GRAPH_BYTES: usize = 2 << 30;

/// Tokens per run up to which a step whose runs are all of one length is recorded as a graph:
/// decode (1) and speculative decoding's verify steps (1 + drafts).
const MAX_GRAPH_RUN_TOKENS: usize = 8;

/// What a recorded step depends on besides buffer contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    tokens: usize,
    /// Tokens of every run.
    run_tokens: usize,
    runs: usize,
    width: usize,
    logit_rows: usize,
    strategy: MoeStrategy,
    cache: u64,
    /// The recurrent-state cache's id (hybrids), else 0.
    state: u64,
    /// Whether every token's final hidden state is written for reading back.
    all_hidden: bool,
    /// Whether runs keep their recurrent states after each token.
    keeps_states: bool,
    /// Whether the step takes an MTP head's hidden-state input.
    mtp_input: bool,
}

/// A step shape's workspace and, once recorded, its graph.
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

impl StepRunner {
    /// Runs one step of `model` over `batch` here (on the thread the backend runs steps
    /// on): checks the batch against the caches, uploads its metadata, and runs the forward
    /// eagerly or from a recorded graph of its shape; the output read as `out` asks.
    pub(crate) fn run(
        &self,
        model: &StepModel<'_>,
        batch: &RaggedBatch,
        cache: &mut PagedKvCache,
        mut state: Option<&mut RecurrentStateCache>,
        hidden: Option<&[f32]>,
        out: &mut StepOutput<'_>,
    ) -> Result<ForwardReport> {
        let backend = model.backend;
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
        let config = model.family.config();
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
        let mut step_rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let StepRows {
            token_runs,
            slots,
            tables,
            logit_rows: rows,
            recurrent_runs,
            kept_states,
        } = &mut *step_rows;
        let mut keeps_states = false;
        match (model.family.recurrent(), state.as_deref()) {
            (true, None) => {
                return Err(ModelError::InvalidBatch(
                    "a hybrid model needs recurrent state: use forward_with_state".to_string(),
                ));
            }
            (true, Some(state)) => {
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
                keeps_states = batch.kept_states_into(kept_states);
                if let Some(run) = batch.runs().iter().find(|r| {
                    r.kept_states.is_some_and(|k| {
                        let kept = k.0 as usize..k.0 as usize + r.len.saturating_sub(1);
                        kept.end > state.num_slots
                            || r.state_slot.is_some_and(|s| kept.contains(&(s.0 as usize)))
                    })
                }) {
                    return Err(ModelError::InvalidBatch(format!(
                        "sequence {} keeps its states in slots beyond the cache's {} or its own",
                        run.seq_id.0, state.num_slots
                    )));
                }
            }
            (false, _) => recurrent_runs.clear(),
        }
        batch.logit_rows_into(rows);
        batch.token_runs_into(token_runs);
        batch.slots_into(slots);
        let tokens = batch.num_tokens();
        let max_run_tokens = batch.runs().iter().map(|r| r.len).max().unwrap_or(1);
        // Steps whose runs all take the same few tokens (decode, and the verify steps of
        // speculative decoding) replay a recorded graph per shape; the table width is padded
        // so that a graph lasts GRAPH_WIDTH_STEP blocks. (Padded also with graphs off, so
        // that eager steps run the very same kernels.)
        let uniform = batch.runs().iter().all(|r| r.len == max_run_tokens);
        let all_hidden = matches!(
            out,
            StepOutput::LogitsAndAllHidden(..) | StepOutput::SampledAndAllHidden(..)
        );
        let graph_shaped = backend.capabilities().graphs
            && uniform
            && max_run_tokens <= MAX_GRAPH_RUN_TOKENS
            && !model.strategy.syncs_host(tokens);
        let graphable = graph_shaped && self.graphs_enabled;
        let mut width = batch.table_width();
        if graph_shaped {
            width = width.div_ceil(GRAPH_WIDTH_STEP) * GRAPH_WIDTH_STEP;
        }
        let leading_decode_tokens = batch.runs().iter().take_while(|r| r.len == 1).count();
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
            ws.keeps_states = keeps_states;
            if keeps_states {
                backend.upload_u32(kept_states, &mut ws.batch.kept_states)?;
            }
            if let (Some(hidden), Some(input)) = (hidden, ws.mtp_input.as_mut()) {
                backend.upload_f32(hidden, input)?;
            }
            Ok(())
        };
        let mtp_input = |ws: &mut Workspace| -> Result<()> {
            if let Some(hidden) = hidden {
                ws.mtp_input = Some(backend.take_buffer(
                    DType::F32,
                    hidden.len(),
                    BufferUsage::Activations,
                )?);
            }
            Ok(())
        };
        let forward = |ws: &mut Workspace,
                       cache: &mut PagedKvCache,
                       state: Option<&mut RecurrentStateCache>,
                       moe_stats: &mut DispatchStats|
         -> Result<()> {
            // The head's input is the workspace's own buffer, lent to the forward.
            let input = ws.mtp_input.take();
            let ran = model.family.forward(StepCtx {
                backend,
                batch,
                cache,
                state,
                ws,
                strategy: model.strategy,
                moe_stats,
                hidden: input.as_ref(),
            });
            ws.mtp_input = input;
            ran
        };
        let result = if graphable {
            let key = GraphKey {
                tokens,
                run_tokens: max_run_tokens,
                runs: batch.runs().len(),
                width,
                logit_rows: rows.len(),
                strategy: model.strategy,
                cache: cache.id(),
                state: state.as_deref().map_or(0, RecurrentStateCache::id),
                all_hidden,
                keeps_states,
                mtp_input: hidden.is_some(),
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
                        (tokens, model.norm_out_dtype(tokens)),
                        key.runs,
                        width,
                        rows.len(),
                    )?;
                    ws.max_run_tokens = max_run_tokens;
                    ws.leading_decode_tokens = leading_decode_tokens;
                    if all_hidden {
                        ws.all_hidden = Some(all_hidden_buffer(backend, tokens, config)?);
                    }
                    mtp_input(&mut ws)?;
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
                read_out(
                    backend,
                    &mut entry.ws,
                    rows.len(),
                    (config.vocab_size, config.hidden_size),
                    out,
                )
            })()
        } else {
            let mut ws = Workspace::take(
                backend,
                config,
                (tokens, model.norm_out_dtype(tokens)),
                batch.runs().len(),
                width,
                rows.len(),
            )?;
            if all_hidden {
                ws.all_hidden = Some(all_hidden_buffer(backend, tokens, config)?);
            }
            if let Err(e) = mtp_input(&mut ws) {
                ws.give(backend);
                return Err(e);
            }
            ws.max_run_tokens = max_run_tokens;
            ws.leading_decode_tokens = leading_decode_tokens;
            let result = (|| {
                upload(&mut ws)?;
                forward(&mut ws, cache, state.as_deref_mut(), &mut moe_stats)?;
                read_out(
                    backend,
                    &mut ws,
                    rows.len(),
                    (config.vocab_size, config.hidden_size),
                    out,
                )
            })();
            ws.give(backend);
            result
        };
        result.map(|()| ForwardReport {
            tokens,
            stats: backend.stats() - before,
            moe_stats,
            moe_layers: model.sparse_layers,
        })
    }
}

/// The buffer every one of `tokens` tokens' final hidden state is written to, f32.
fn all_hidden_buffer(
    backend: &dyn Backend,
    tokens: usize,
    config: &crate::ModelConfig,
) -> Result<DeviceBuffer> {
    let len = tokens * config.hidden_size;
    Ok(backend.take_buffer(DType::F32, len, BufferUsage::Activations)?)
}

/// What a forward pass reads back.
pub(crate) enum StepOutput<'a> {
    /// Every wanted row's logits, `[rows, vocab]`.
    Logits(&'a mut Vec<f32>),
    /// Every wanted row's logits and its final hidden state after the final norm, `[rows,
    /// hidden]`.
    LogitsAndHidden(&'a mut Vec<f32>, &'a mut Vec<f32>),
    /// Every wanted row's logits and every token's final hidden state after the final norm,
    /// `[tokens, hidden]`.
    LogitsAndAllHidden(&'a mut Vec<f32>, &'a mut Vec<f32>),
    /// Every wanted row reduced on the device.
    Sampled(&'a mut SampledStep),
    /// Every wanted row reduced on the device, and every token's final hidden state after
    /// the final norm, `[tokens, hidden]`.
    SampledAndAllHidden(&'a mut SampledStep, &'a mut Vec<f32>),
    /// Every wanted row reduced on the device, and its final hidden state after the final
    /// norm, `[rows, hidden]` (an MTP head's draft and its next pass's input).
    SampledAndHidden(&'a mut SampledStep, &'a mut Vec<f32>),
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

/// Every token's final hidden state, as the step kept it, into `hidden`.
fn download_all_hidden(backend: &dyn Backend, ws: &Workspace, hidden: &mut Vec<f32>) -> Result<()> {
    let all = ws
        .all_hidden
        .as_ref()
        .ok_or_else(|| ModelError::Unsupported("the step kept no hidden states".to_string()))?;
    hidden.resize(all.len(), 0.0);
    backend.download_f32(all, hidden)?;
    Ok(())
}

fn read_out(
    backend: &dyn Backend,
    ws: &mut Workspace,
    rows: usize,
    (vocab, width): (usize, usize),
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
        StepOutput::LogitsAndHidden(logits, hidden) => {
            logits.resize(rows * vocab, 0.0);
            hidden.resize(rows * width, 0.0);
            if rows > 0 {
                backend.download_f32(&ws.logits, logits)?;
                backend.download_f32(&ws.rows_normed, hidden)?;
            }
            return Ok(());
        }
        StepOutput::LogitsAndAllHidden(logits, hidden) => {
            logits.resize(rows * vocab, 0.0);
            if rows > 0 {
                backend.download_f32(&ws.logits, logits)?;
            }
            download_all_hidden(backend, ws, hidden)?;
            return Ok(());
        }
        StepOutput::Sampled(step) => step,
        StepOutput::SampledAndAllHidden(step, hidden) => {
            download_all_hidden(backend, ws, hidden)?;
            step
        }
        StepOutput::SampledAndHidden(step, hidden) => {
            hidden.resize(rows * width, 0.0);
            if rows > 0 {
                backend.download_f32(&ws.rows_normed, hidden)?;
            }
            step
        }
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
