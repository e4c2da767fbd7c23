//! `corral bench decode`: steady-state decode steps of `batch` sequences at `context` tokens
//! of history, per MoE strategy: ms per step, aggregate tok/s, and per step the launches,
//! host syncs, allocations and weight bytes read. `--draft-tokens K` makes each step a
//! speculative verify step (1 + K tokens a sequence, every row's logits read back, as serving
//! reads them) and reports its cost against the one-token step. The history's KV blocks are allocated and
//! read in full by attention but not computed (a decode step's cost does not depend on their
//! values), so an 8k context costs no 8k-token prefill per sequence.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_backend::DispatchStats;
use corral_backend::sampling::Filter;
use corral_engine::{BLOCK_SIZE, argmax};
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache,
    SampledStep, SeqId, SlotId, TokenId,
};
use serde_json::json;

use super::summary::{median, relative_spread};
use crate::loading::{ModelArgs, load_model};

/// Arguments of `corral bench decode`.
#[derive(Debug, Args)]
pub(crate) struct DecodeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Sequences decoded together.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Tokens of history each sequence has when the measured steps start.
    #[arg(long, value_delimiter = ',', default_value = "512,8192")]
    context: Vec<usize>,
    /// MoE strategies to compare.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    strategies: Vec<String>,
    /// Measured steps per cell.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Unmeasured steps per cell first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Decode with recorded graphs (`on`), eagerly (`off`), or both in one run.
    #[arg(long, value_delimiter = ',', default_value = "on")]
    graphs: Vec<String>,
    /// After each cell, time one more step kernel by kernel (launched eagerly).
    #[arg(long)]
    profile: bool,
    /// Pick each greedy token where the logits are (`device`: the reduction serving runs),
    /// or read every row back and pick on the host (`host`), or both in one run.
    #[arg(long, value_delimiter = ',', default_value = "device")]
    sampling: Vec<String>,
    /// Draft tokens each sequence's step verifies besides its own (0: plain decode). Verify
    /// steps read every row's logits back (the sampling column says `host`).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    draft_tokens: Vec<usize>,
}

struct Cell {
    strategy: String,
    graphs: bool,
    on_device: bool,
    /// Draft tokens verified a sequence.
    drafts: usize,
    batch: usize,
    context: usize,
    step_ms: Vec<f64>,
    stats: DispatchStats,
}

fn run_cell(
    model: &mut Model,
    (batch_size, context, drafts): (usize, usize, usize),
    steps: usize,
    profile_last: bool,
    on_device: bool,
    logits: &mut Vec<f32>,
) -> Result<(Vec<f64>, DispatchStats)> {
    let greedy = Filter::GREEDY;
    let mut sampled = SampledStep::default();
    sampled.rows = vec![(greedy, greedy.draw(0)); batch_size];
    let config = model.config().clone();
    let backend = Arc::clone(model.backend());
    let run_len = 1 + drafts;
    let per_seq = (context + (steps + 1) * run_len).div_ceil(BLOCK_SIZE);
    let mut cache = PagedKvCache::new(backend.as_ref(), &config, batch_size * per_seq, BLOCK_SIZE)
        .context("allocating the KV cache")?;
    let mut state = RecurrentStateCache::new(backend.as_ref(), &config, batch_size)?;
    let tables: Vec<BlockTable> = (0..batch_size)
        .map(|s| BlockTable {
            blocks: (0..per_seq)
                .map(|b| BlockId((s * per_seq + b) as u32))
                .collect(),
        })
        .collect();
    let mut next: Vec<u32> = (0..batch_size)
        .map(|s| (s as u32 * 7919 + 13) % config.vocab_size as u32)
        .collect();
    let (mut times, mut stats) = (Vec::new(), DispatchStats::default());
    for step in 0..steps + profile_last as usize {
        if step == steps {
            // A replayed graph launches nothing to time: the profiled step runs eagerly.
            model.set_graphs(false);
            model.backend().set_profiling(true);
        }
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        for (s, table) in tables.iter().enumerate() {
            let seq = SeqId(s as u64);
            // The draft: the next token again (a verify step's cost does not depend on it).
            let run = vec![TokenId(next[s]); run_len];
            let wanted = if drafts == 0 {
                LogitsWanted::Last
            } else {
                LogitsWanted::All
            };
            batch.push_run(seq, &run, context + step * run_len, table, wanted)?;
            batch.set_state_slot(seq, SlotId(s as u32))?;
        }
        let start = Instant::now();
        let hybrid = model.is_hybrid();
        let report = if on_device {
            let state = hybrid.then_some(&mut state);
            let report = model.forward_sampled(&batch, &mut cache, state, &mut sampled)?;
            for (token, c) in next.iter_mut().zip(&sampled.candidates) {
                *token = c.top.first().map_or(0, |&(id, _)| id);
            }
            report
        } else {
            let report = if hybrid {
                model.forward_with_state(&batch, &mut cache, &mut state, logits)?
            } else {
                model.forward(&batch, &mut cache, logits)?
            };
            let vocab = config.vocab_size;
            for (s, token) in next.iter_mut().enumerate() {
                let row = (s + 1) * run_len - 1;
                *token = argmax(&logits[row * vocab..(row + 1) * vocab]);
            }
            report
        };
        if step < steps {
            times.push(start.elapsed().as_secs_f64() * 1e3);
            stats = report.stats;
        }
    }
    Ok((times, stats))
}

/// Each of `values` as true (`names[0]`) or false (`names[1]`), for the error naming `flag`.
fn two_way(flag: &str, values: &[String], names: [&str; 2]) -> Result<Vec<bool>> {
    values
        .iter()
        .map(|v| match v.as_str() {
            v if v == names[0] => Ok(true),
            v if v == names[1] => Ok(false),
            other => bail!("{flag}: `{other}` is neither {} nor {}", names[0], names[1]),
        })
        .collect()
}

pub(crate) fn run(args: DecodeArgs) -> Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) {
        bail!("--batch needs positive sizes");
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if let Some(k) = args.draft_tokens.iter().find(|&&k| k > 7) {
        bail!("--draft-tokens {k}: at most 7 (a step verifies up to 8 tokens a sequence)");
    }
    let mut model = load_model(&args.model)?;
    let strategies = super::named_strategies(&args.strategies, &model)?;
    // Contexts the model cannot hold (with the steps after them) are skipped, saying so; none
    // left is an error.
    let max_position = model.config().max_context();
    let most_tokens =
        (args.steps + args.warmup + 1) * (1 + args.draft_tokens.iter().max().unwrap_or(&0));
    let fits = |c: usize| c + most_tokens <= max_position;
    for &c in args.context.iter().filter(|&&c| !fits(c)) {
        eprintln!(
            "skipping --context {c}: with {most_tokens} tokens of steps it exceeds the model's {max_position} positions"
        );
    }
    let contexts: Vec<usize> = args.context.iter().copied().filter(|&c| fits(c)).collect();
    if contexts.is_empty() {
        bail!("no --context fits the model's {max_position} positions with the steps after it");
    }
    let graph_modes = two_way("--graphs", &args.graphs, ["on", "off"])?;
    let sampling_modes = two_way("--sampling", &args.sampling, ["device", "host"])?;
    let mut cells = Vec::new();
    let mut logits = Vec::new();
    for &context in &contexts {
        for &batch in &args.batch {
            for ((((name, strategy), &graphs), &on_device), &drafts) in strategies
                .iter()
                .flat_map(|s| graph_modes.iter().map(move |g| (s, g)))
                .flat_map(|c| sampling_modes.iter().map(move |d| (c, d)))
                .flat_map(|c| args.draft_tokens.iter().map(move |k| (c, k)))
            {
                // Verify steps read their rows back whole, as serving does.
                let on_device = on_device && drafts == 0;
                model.set_moe_strategy(*strategy);
                model.set_graphs(graphs);
                let steps = args.warmup + args.steps;
                let (times, stats) = run_cell(
                    &mut model,
                    (batch, context, drafts),
                    steps,
                    args.profile,
                    on_device,
                    &mut logits,
                )
                .with_context(|| format!("batch {batch} at context {context}"))?;
                if args.profile {
                    let title =
                        format!("{name}, batch {batch}, context {context}, {drafts} drafts");
                    super::print_kernel_profile(&title, &model)?;
                    model.backend().set_profiling(false);
                }
                cells.push(Cell {
                    strategy: name.clone(),
                    graphs,
                    on_device,
                    drafts,
                    batch,
                    context,
                    step_ms: times[args.warmup..].to_vec(),
                    stats,
                });
            }
        }
    }
    let device = model.backend().device_name();
    println!(
        "model {}  device {device}  {} steps (after {} warm-up)",
        args.model.describe(),
        args.steps,
        args.warmup
    );
    println!(
        "{:<11} {:>6} {:>8} {:>6} {:>8} {:>6} {:>9} {:>7} {:>9} {:>10} {:>9} {:>7} {:>6} {:>7} {:>12}",
        "strategy",
        "graphs",
        "sampling",
        "batch",
        "context",
        "drafts",
        "ms/step",
        "noise",
        "vs 1-tok",
        "tok/s",
        "launches",
        "replays",
        "syncs",
        "allocs",
        "MiB weights"
    );
    let mut rows = Vec::new();
    // A verify step's cost against the one-token step of the same cell (the first such:
    // device sampling where both ran).
    let one_token = |c: &Cell| {
        cells
            .iter()
            .find(|o| {
                o.drafts == 0
                    && (&o.strategy, o.graphs, o.batch, o.context)
                        == (&c.strategy, c.graphs, c.batch, c.context)
            })
            .map(|o| median(&c.step_ms) / median(&o.step_ms))
    };
    for c in &cells {
        let ms = median(&c.step_ms);
        // Tokens a step is sure to yield: one a sequence (drafts add what they are accepted).
        let tok_s = c.batch as f64 / (ms / 1e3);
        let verify_cost = one_token(c);
        println!(
            "{:<11} {:>6} {:>8} {:>6} {:>8} {:>6} {:>9.3} {:>6.1}% {:>9} {:>10.1} {:>9} {:>7} {:>6} {:>7} {:>12.1}",
            c.strategy,
            if c.graphs { "on" } else { "off" },
            if c.on_device { "device" } else { "host" },
            c.batch,
            c.context,
            c.drafts,
            ms,
            relative_spread(&c.step_ms) * 100.0,
            verify_cost.map_or("-".to_string(), |r| format!("{r:.2}x")),
            tok_s,
            c.stats.dispatches,
            c.stats.graph_replays,
            c.stats.host_syncs,
            c.stats.allocations,
            c.stats.weight_bytes_read as f64 / (1 << 20) as f64,
        );
        rows.push(json!({
            "strategy": c.strategy,
            "graphs": c.graphs,
            "sampling": if c.on_device { "device" } else { "host" },
            "batch": c.batch,
            "context": c.context,
            "draft_tokens": c.drafts,
            "ms_per_step_median": ms,
            "vs_one_token_step": verify_cost,
            "tok_s": tok_s,
            "launches_per_step": c.stats.dispatches,
            "graph_replays_per_step": c.stats.graph_replays,
            "host_syncs_per_step": c.stats.host_syncs,
            "allocations_per_step": c.stats.allocations,
            "weight_bytes_per_step": c.stats.weight_bytes_read,
            "bytes_transferred_per_step": c.stats.bytes_transferred,
        }));
    }
    if let Some(path) = &args.json {
        let doc = json!({"model": args.model.describe(), "device": device, "rows": rows});
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
