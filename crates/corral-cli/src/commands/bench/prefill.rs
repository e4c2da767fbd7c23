//! `corral bench prefill`: for each prompt length × MoE strategy, after warm-up, the median
//! time to first token (one prefill forward plus picking the token), prefill rate, dispatches
//! per request and per MoE layer, host syncs, allocations and CPU seconds; then, per strategy,
//! a least-squares line of TTFT over prompt length: its intercept is the fixed cost per
//! request, its slope the marginal prefill rate. Variants are interleaved rep by rep, and the
//! order of strategies rotates from one rep to the next.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_backend::{DispatchStats, process_cpu_time};
use corral_engine::{BLOCK_SIZE, argmax};
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache,
    SeqId, SlotId, TokenId,
};
use serde_json::json;

use super::plot::Series;
use super::summary::{linear_fit, median, relative_spread};
use crate::loading::{ModelArgs, load_model};

/// Arguments of `corral bench prefill`.
#[derive(Debug, Args)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to measure.
    #[arg(long, value_delimiter = ',', default_value = "10,32,300,2048")]
    prompt_lens: Vec<usize>,
    /// MoE strategies to compare (per-expert, per-token, grouped, auto).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "grouped,per-expert,per-token"
    )]
    strategies: Vec<String>,
    /// Measured repetitions per cell (after warm-up).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Unmeasured repetitions per cell first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw TTFT against prompt length here (.svg or .png).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// After the measured runs, time one more run of each cell kernel by kernel.
    #[arg(long)]
    profile: bool,
    /// Seconds to watch the idle process's CPU use after the runs (0: skip).
    #[arg(long, default_value_t = 2.0)]
    idle_seconds: f64,
    /// Tokens per forward: a longer prompt is prefilled in chunks of this many, as the
    /// server does (0: the whole prompt in one forward).
    #[arg(long, default_value_t = 0)]
    chunk: usize,
}

/// One measured request.
struct Sample {
    ttft: Duration,
    cpu: Duration,
    stats: DispatchStats,
    moe_stats: DispatchStats,
    moe_layers: usize,
}

/// Measurements of one (strategy, prompt length) cell.
struct Cell {
    strategy: String,
    prompt_tokens: usize,
    samples: Vec<Sample>,
}

impl Cell {
    fn ttft_ms(&self) -> Vec<f64> {
        self.samples
            .iter()
            .map(|s| s.ttft.as_secs_f64() * 1e3)
            .collect()
    }
}

/// `len` pseudo-random tokens of a `vocab`-token vocabulary, the same every run.
pub(super) fn prompt(len: usize, vocab: usize) -> Vec<TokenId> {
    let mut state = 0x5eed_u64;
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            TokenId(((state >> 33) % vocab as u64) as u32)
        })
        .collect()
}

/// One request: the prompt's prefill, in forwards of `chunk` tokens (0: one), and the first
/// token.
fn measure(
    model: &Model,
    (cache, state): (&mut PagedKvCache, &mut RecurrentStateCache),
    tokens: &[TokenId],
    chunk: usize,
    logits: &mut Vec<f32>,
) -> Result<Sample> {
    let table = BlockTable {
        blocks: (0..tokens.len().div_ceil(BLOCK_SIZE) as u32)
            .map(BlockId)
            .collect(),
    };
    let chunk = if chunk == 0 { tokens.len() } else { chunk };
    let cpu_start = process_cpu_time();
    let start = Instant::now();
    let (mut stats, mut moe_stats, mut moe_layers) = Default::default();
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= tokens.len();
        let wanted = if last {
            LogitsWanted::Last
        } else {
            LogitsWanted::None
        };
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        batch.push_run(SeqId(0), piece, i * chunk, &table, wanted)?;
        batch.set_state_slot(SeqId(0), SlotId(0))?;
        let report = model.forward_with_state(&batch, cache, state, logits)?;
        stats = stats + report.stats;
        moe_stats = moe_stats + report.moe_stats;
        moe_layers = report.moe_layers;
    }
    let _first = argmax(logits);
    let ttft = start.elapsed();
    Ok(Sample {
        ttft,
        cpu: process_cpu_time().saturating_sub(cpu_start),
        stats,
        moe_stats,
        moe_layers,
    })
}

pub(crate) fn run(args: PrefillArgs) -> Result<()> {
    if args.prompt_lens.is_empty() || args.prompt_lens.contains(&0) {
        bail!("--prompt-lens needs positive lengths");
    }
    if args.reps == 0 {
        bail!("--reps must be at least 1");
    }
    if !(0.0..=3600.0).contains(&args.idle_seconds) {
        bail!("--idle-seconds must be between 0 and 3600");
    }
    if let Some(path) = &args.plot {
        super::plot::check_path(path)?;
    }
    let mut model = load_model(&args.model)?;
    let strategies = super::named_strategies(&args.strategies, &model)?;
    let config = model.config().clone();
    let max_len = *args.prompt_lens.iter().max().unwrap_or(&1);
    let mut cache = PagedKvCache::new(
        model.backend().as_ref(),
        &config,
        max_len.div_ceil(BLOCK_SIZE),
        BLOCK_SIZE,
    )?;
    let mut state = RecurrentStateCache::new(model.backend().as_ref(), &config, 1)?;
    let prompts: Vec<Vec<TokenId>> = args
        .prompt_lens
        .iter()
        .map(|&l| prompt(l, config.vocab_size))
        .collect();
    let mut cells: Vec<Cell> = Vec::new();
    for (name, _) in &strategies {
        for &len in &args.prompt_lens {
            cells.push(Cell {
                strategy: name.clone(),
                prompt_tokens: len,
                samples: Vec::new(),
            });
        }
    }
    let mut logits = Vec::new();
    let total = (args.warmup + args.reps) * cells.len();
    let bar = indicatif::ProgressBar::new(total as u64);
    for rep in 0..args.warmup + args.reps {
        // Rotate which strategy goes first, so no variant always follows the heaviest one.
        for si in (0..strategies.len()).map(|i| (i + rep) % strategies.len()) {
            model.set_moe_strategy(strategies[si].1);
            for (li, tokens) in prompts.iter().enumerate() {
                let sample = measure(
                    &model,
                    (&mut cache, &mut state),
                    tokens,
                    args.chunk,
                    &mut logits,
                )?;
                if rep >= args.warmup {
                    cells[si * prompts.len() + li].samples.push(sample);
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();

    let threads = rayon::current_num_threads();
    let device = model.backend().device_name();
    println!(
        "model {}  device {device}  reps {} (after {} warm-up)",
        args.model.describe(),
        args.reps,
        args.warmup
    );
    println!(
        "{:<11} {:>7} {:>11} {:>7} {:>11} {:>10} {:>9} {:>6} {:>6} {:>8} {:>13}",
        "strategy",
        "prompt",
        "TTFT ms",
        "noise",
        "prefill t/s",
        "dispatches",
        "disp/MoE",
        "syncs",
        "allocs",
        "CPU s",
        "MiB weights"
    );
    let mut rows = Vec::new();
    for cell in &cells {
        let ttft = median(&cell.ttft_ms());
        let cpu = median(
            &cell
                .samples
                .iter()
                .map(|s| s.cpu.as_secs_f64())
                .collect::<Vec<_>>(),
        );
        let last = cell.samples.last().context("no samples")?;
        let per_moe = last.moe_stats.dispatches as f64 / last.moe_layers.max(1) as f64;
        let tok_s = cell.prompt_tokens as f64 / (ttft / 1e3);
        println!(
            "{:<11} {:>7} {:>11.2} {:>6.1}% {:>11.0} {:>10} {:>9.1} {:>6} {:>6} {:>8.3} {:>13.1}",
            cell.strategy,
            cell.prompt_tokens,
            ttft,
            relative_spread(&cell.ttft_ms()) * 100.0,
            tok_s,
            last.stats.dispatches,
            per_moe,
            last.stats.host_syncs,
            last.stats.allocations,
            cpu,
            last.stats.weight_bytes_read as f64 / (1 << 20) as f64,
        );
        rows.push(json!({
            "strategy": cell.strategy,
            "prompt_tokens": cell.prompt_tokens,
            "ttft_ms_median": ttft,
            "prefill_tok_s": tok_s,
            "dispatches": last.stats.dispatches,
            "dispatches_per_moe_layer": per_moe,
            "host_syncs": last.stats.host_syncs,
            "allocations": last.stats.allocations,
            "cpu_seconds": cpu,
        }));
    }
    println!();
    println!(
        "{:<11} {:>12} {:>16}",
        "strategy", "fixed ms", "marginal tok/s"
    );
    let mut fits = Vec::new();
    let mut series = Vec::new();
    for (name, _) in &strategies {
        let points: Vec<(f64, f64)> = cells
            .iter()
            .filter(|c| &c.strategy == name)
            .map(|c| (c.prompt_tokens as f64, median(&c.ttft_ms())))
            .collect();
        if let Some((intercept, slope)) = linear_fit(&points) {
            let marginal = if slope > 0.0 {
                1e3 / slope
            } else {
                f64::INFINITY
            };
            println!("{name:<11} {intercept:>12.2} {marginal:>16.0}");
            fits.push(json!({"strategy": name, "fixed_ms": intercept, "marginal_tok_s": marginal}));
        }
        series.push(Series {
            name: name.clone(),
            points,
        });
    }
    if args.profile {
        for (name, strategy) in &strategies {
            model.set_moe_strategy(*strategy);
            for tokens in &prompts {
                model.backend().set_profiling(true);
                measure(
                    &model,
                    (&mut cache, &mut state),
                    tokens,
                    args.chunk,
                    &mut logits,
                )?;
                let title = format!("{name}, {} prompt tokens", tokens.len());
                super::print_kernel_profile(&title, &model)?;
                model.backend().set_profiling(false);
            }
        }
    }
    if args.idle_seconds > 0.0 {
        let start = process_cpu_time();
        std::thread::sleep(Duration::from_secs_f64(args.idle_seconds));
        let used = process_cpu_time().saturating_sub(start).as_secs_f64();
        println!();
        println!(
            "idle: {used:.4} CPU s over {:.1} s ({:.2}% of one core)",
            args.idle_seconds,
            used / args.idle_seconds * 100.0
        );
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "model": args.model.describe(),
            "device": device,
            "threads": threads,
            "rows": rows,
            "fit": fits,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let title = format!("TTFT vs prompt length: {}", args.model.describe());
        super::plot::write(path, &title, &series)?;
    }
    Ok(())
}
