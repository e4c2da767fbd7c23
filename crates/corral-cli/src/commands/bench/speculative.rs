//! `corral bench speculative`: greedy decoding of prompts cut from a text, with each
//! `--speculative` variant in turn through the engine `serve` runs (one sequence, or
//! `--concurrency` levels of several at once): draft tokens verified and accepted (by position
//! in the draft), tokens a decode step, decode tok/s and its ratio to `off`, and how many
//! prompts' tokens equal `off`'s (all, with f32 weights on the CPU). The levels show the batch
//! from which speculation stops paying. `--echo` makes it an edit replay: each prompt ends
//! with its own first tokens again, so the model re-emits text it has seen, as an agent
//! re-emits a file it edits. Without `--text` the prompts are random tokens (a synthetic model
//! has no tokenizer), and `--forced-acceptance` times speculation at a stated acceptance where
//! drafts mean nothing: each draft token is taken with that probability, so the tokens are not
//! the model's.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_engine::{
    EngineConfig, EngineHandle, EngineRequest, Event, SamplingParams, spawn_engine_drafting,
};
use corral_model::Model;
use serde_json::json;

use crate::loading::{ModelArgs, load_model};
use crate::speculative::Speculative;

/// Arguments of `corral bench speculative`.
#[derive(Debug, Args)]
pub(crate) struct SpeculativeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text the prompts are cut from (consecutive windows); without it, random tokens.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Prompts cut from the text.
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Tokens of each prompt.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Tokens generated for each prompt (end-of-sequence tokens ignored).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// An edit replay: each prompt followed by its own first N tokens again.
    #[arg(long, default_value_t = 0)]
    echo: usize,
    /// The variants, in the order each repetition runs them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "off,mtp:1,mtp:2,mtp:3,lookup:4"
    )]
    speculative: Vec<Speculative>,
    /// Sequences decoding at once, one level after another: the prompts run in groups of
    /// that many, submitted together (a step's prefill budget holds them all), and a level's
    /// tok/s is its groups' tokens over their slowest members' decode time.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Repetitions of the whole set of variants (interleaved).
    #[arg(long, default_value_t = 1)]
    reps: usize,
    /// Take each draft token with this probability whatever the model samples (timing only:
    /// the output is not the model's).
    #[arg(long, value_parser = parse_rate)]
    forced_acceptance: Option<f64>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One variant's totals over its prompts and repetitions.
#[derive(Default)]
struct Totals {
    generated: usize,
    decode_steps: usize,
    decode_ms: f64,
    /// Each group's slowest member's decode milliseconds, summed: the wall time of decoding.
    wall_ms: f64,
    drafted: u64,
    accepted: u64,
    /// Drafts verified (steps of a sequence with draft tokens).
    drafts: u64,
    by_position: Vec<u64>,
    /// Steps that only decoded, and their microseconds planning (drafting included), in the
    /// forward pass and taking the outputs (the engine's own clock).
    decode_only_steps: u64,
    phase_micros: [u64; 3],
    /// Each prompt's tokens, from the first repetition.
    outputs: Vec<Vec<u32>>,
}

/// A probability, for `--forced-acceptance`.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a probability between 0 and 1")),
    }
}

/// The prompts: windows of `--text`, or random tokens of the model's vocabulary.
fn prompts(args: &SpeculativeArgs, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let ids = match &args.text {
        Some(path) => {
            let dir = args.model.dir().context(
                "prompts cut from --text need --model (a checkpoint or GGUF file with its tokenizer)",
            )?;
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {} as UTF-8 text", path.display()))?;
            let (tokenizer, _) = args.model.vocabulary(dir)?;
            tokenizer
                .encode(&text)
                .with_context(|| format!("tokenizing {}", path.display()))?
        }
        None => super::prefill::prompt(args.prompts * args.prompt_tokens, vocab)
            .into_iter()
            .map(|t| t.0)
            .collect(),
    };
    let prompts: Vec<Vec<u32>> = ids
        .chunks_exact(args.prompt_tokens)
        .take(args.prompts)
        .map(|w| {
            let mut p = w.to_vec();
            p.extend_from_slice(&w[..args.echo.min(w.len())]);
            p
        })
        .collect();
    if prompts.len() < args.prompts {
        bail!(
            "the text holds {} tokens: fewer than {} prompts of {}",
            ids.len(),
            args.prompts,
            args.prompt_tokens
        );
    }
    Ok(prompts)
}

pub(crate) fn run(args: SpeculativeArgs) -> Result<()> {
    if args.prompts == 0
        || args.prompt_tokens == 0
        || args.max_tokens == 0
        || args.reps == 0
        || args.concurrency.contains(&0)
    {
        bail!(
            "--prompts, --prompt-tokens, --max-tokens, --reps and --concurrency must be at least 1"
        );
    }
    let mut model = load_model(&args.model)?;
    let prompts = prompts(&args, model.config().vocab_size)?;
    let device = model.backend().device_name();
    let total = args.prompt_tokens + args.echo + args.max_tokens;
    let mut levels: Vec<Vec<Totals>> = args
        .concurrency
        .iter()
        .map(|_| args.speculative.iter().map(|_| Totals::default()).collect())
        .collect();
    for rep in 0..args.reps {
        for (&concurrency, totals) in args.concurrency.iter().zip(&mut levels) {
            for (variant, sums) in args.speculative.iter().zip(totals.iter_mut()) {
                let config = engine_at(concurrency, total, &args);
                model = run_variant(model, config, variant, &prompts, &args, sums, rep == 0)?;
            }
        }
    }
    for (&concurrency, totals) in args.concurrency.iter().zip(&levels) {
        report(&args, &device, &prompts, concurrency, totals);
    }
    write_json(&args, &device, &prompts, &levels)
}

/// The engine for `concurrency` sequences of `total` tokens each, with a prefill budget that
/// holds a group's prompts.
fn engine_at(concurrency: usize, total: usize, args: &SpeculativeArgs) -> EngineConfig {
    let mut config = crate::commands::run::one_sequence_engine(total, 512);
    config.max_batch = concurrency;
    config.max_queue = concurrency;
    config.kv_blocks *= concurrency;
    config.max_prefill_tokens = config
        .max_prefill_tokens
        .max(concurrency * (args.prompt_tokens + args.echo));
    config
}

/// One variant over every prompt, `config.max_batch` of them at once, its counts added to
/// `sums` (each prompt's tokens too where `keep_outputs`); the model comes back from the
/// engine.
fn run_variant(
    model: Model,
    config: EngineConfig,
    variant: &Speculative,
    prompts: &[Vec<u32>],
    args: &SpeculativeArgs,
    sums: &mut Totals,
    keep_outputs: bool,
) -> Result<Model> {
    let (total, concurrency) = (config.max_context, config.max_batch);
    let head = variant.head(&args.model, &model)?;
    let drafter = variant.drafter(head, (config.kv_blocks, config.block_size, concurrency))?;
    let speculation = drafter.map(|(s, _)| match args.forced_acceptance {
        Some(rate) => s.forcing_acceptance(rate),
        None => s,
    });
    let (engine, thread) = spawn_engine_drafting(model, config, speculation)?;
    let generated = generate(&engine, prompts, args, total, concurrency);
    let m = engine.metrics();
    sums.drafted += m.draft_tokens.load(Ordering::Relaxed);
    sums.accepted += m.accepted_draft_tokens.load(Ordering::Relaxed);
    sums.drafts += m.drafts.load(Ordering::Relaxed);
    sums.decode_only_steps += m.decode_steps.load(Ordering::Relaxed);
    for (sum, micros) in sums.phase_micros.iter_mut().zip(&m.decode_step_micros) {
        *sum += micros.load(Ordering::Relaxed);
    }
    let by_position: Vec<u64> = m
        .accepted_by_position
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .collect();
    sums.by_position.resize(by_position.len(), 0);
    for (sum, n) in sums.by_position.iter_mut().zip(by_position) {
        *sum += n;
    }
    engine.shutdown();
    let model = thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    for group in generated? {
        let slowest = group.iter().map(|g| g.2).fold(0.0, f64::max);
        sums.wall_ms += slowest;
        for (tokens, steps, ms) in group {
            sums.generated += tokens.len();
            sums.decode_steps += steps;
            sums.decode_ms += ms;
            if keep_outputs {
                sums.outputs.push(tokens);
            }
        }
    }
    Ok(model)
}

/// A prompt's tokens, decode steps and decode milliseconds.
type Generated = (Vec<u32>, usize, f64);

/// Each group of `concurrency` prompts' outcomes: a group submitted together, the next once it
/// has finished.
fn generate(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    args: &SpeculativeArgs,
    total: usize,
    concurrency: usize,
) -> Result<Vec<Vec<Generated>>> {
    let mut out = Vec::new();
    for group in prompts.chunks(concurrency) {
        let mut receivers = Vec::new();
        for prompt in group {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            engine
                .submit(EngineRequest {
                    prompt: prompt.clone(),
                    params: SamplingParams::default(),
                    max_tokens: args.max_tokens,
                    max_context: total,
                    stop_token_ids: Vec::new(),
                    top_logprobs: None,
                    events: tx,
                    session: None,
                    constraint: None,
                })
                .context("starting generation")?;
            receivers.push(rx);
        }
        let mut outcomes = Vec::new();
        for mut rx in receivers {
            let mut tokens = Vec::new();
            let finished = loop {
                match rx.blocking_recv() {
                    Some(Event::Tokens(t)) => tokens.extend(t.iter().map(|t| t.id)),
                    Some(Event::Finished(f)) => break f,
                    Some(Event::Failed(e)) => bail!("generation failed: {e}"),
                    None => bail!("the engine stopped"),
                }
            };
            outcomes.push((tokens, finished.decode_steps, finished.decode_ms));
        }
        out.push(outcomes);
    }
    Ok(out)
}

/// A variant's figures at one level, against `off` at the same level where it ran.
struct Row {
    tokens_per_step: f64,
    step_ms: f64,
    step_vs_off: Option<f64>,
    tok_s: f64,
    vs_off: Option<f64>,
    /// Prompts whose tokens are plain decoding's (not with forced acceptance).
    same: Option<usize>,
    /// A decode step's milliseconds planning, in the forward pass and taking the outputs.
    phases: [f64; 3],
}

impl Row {
    fn of(t: &Totals, level: &[Totals], args: &SpeculativeArgs, prompts: usize) -> Self {
        let off = args.speculative.iter().position(|s| *s == Speculative::Off);
        // The first token of each prompt comes with its prefill; a group's sequences decode
        // at once.
        let decoded = |t: &Totals| t.generated.saturating_sub(prompts * args.reps) as f64;
        let tok_s = |t: &Totals| decoded(t) / (t.wall_ms / 1e3).max(1e-9);
        let step_ms = |t: &Totals| t.decode_ms / t.decode_steps.max(1) as f64;
        Self {
            tokens_per_step: decoded(t) / t.decode_steps.max(1) as f64,
            step_ms: step_ms(t),
            step_vs_off: off.map(|i| step_ms(t) / step_ms(&level[i])),
            tok_s: tok_s(t),
            vs_off: off.map(|i| tok_s(t) / tok_s(&level[i])),
            same: off.filter(|_| args.forced_acceptance.is_none()).map(|i| {
                let pairs = level[i].outputs.iter().zip(&t.outputs);
                pairs.filter(|(a, b)| a == b).count()
            }),
            phases: t
                .phase_micros
                .map(|us| us as f64 / 1e3 / t.decode_only_steps.max(1) as f64),
        }
    }
}

/// A level's table: each variant's row, compared with `off` at the same level.
fn report(
    args: &SpeculativeArgs,
    device: &str,
    prompts: &[Vec<u32>],
    concurrency: usize,
    totals: &[Totals],
) {
    let off = args.speculative.iter().position(|s| *s == Speculative::Off);
    let forced = args.forced_acceptance;
    if let Some(rate) = forced {
        println!(
            "FORCED ACCEPTANCE {rate}: each draft token taken with this probability whatever \
             the model samples; the tokens are not the model's"
        );
    }
    println!(
        "device {device}  {} prompts of {} tokens{}  {} generated each  {} reps  {concurrency} at once",
        prompts.len(),
        args.prompt_tokens,
        if args.echo > 0 {
            format!(" + {} echoed", args.echo)
        } else {
            String::new()
        },
        args.max_tokens,
        args.reps
    );
    println!(
        "{:<18} {:>9} {:>10} {:>22} {:>9} {:>8} {:>10} {:>9} {:>8} {:>6}  {:>17}",
        "variant",
        "drafted",
        "accepted",
        "by position %",
        "tok/step",
        "ms/step",
        "step/off",
        "tok/s",
        "vs off",
        "same",
        "plan/fwd/out ms"
    );
    for (variant, t) in args.speculative.iter().zip(totals) {
        let row = Row::of(t, totals, args, prompts.len());
        let positions: Vec<String> = t
            .by_position
            .iter()
            .take_while(|&&n| n > 0)
            .map(|&n| format!("{:.0}", 100.0 * n as f64 / (t.drafts.max(1) as f64)))
            .collect();
        let acceptance = t.accepted as f64 / t.drafted.max(1) as f64;
        let [plan, forward, output] = row.phases;
        println!(
            "{:<18} {:>9} {:>9.1}% {:>22} {:>9.2} {:>8.3} {:>10} {:>9.1} {:>8} {:>6}  {plan:>5.2}/{forward:.2}/{output:.2}",
            variant.to_string(),
            t.drafted,
            100.0 * acceptance,
            positions.join("/"),
            row.tokens_per_step,
            row.step_ms,
            row.step_vs_off
                .map_or("-".to_string(), |r| format!("{r:.2}x")),
            row.tok_s,
            row.vs_off.map_or("-".to_string(), |r| format!("{r:.2}x")),
            row.same
                .map_or("-".to_string(), |k| if k == t.outputs.len() {
                    "yes".to_string()
                } else {
                    format!("{k}/{}", t.outputs.len())
                }),
        );
    }
    if let Some(i) = off
        && forced.is_none()
        && totals.iter().any(|t| t.outputs != totals[i].outputs)
    {
        eprintln!(
            "note: some prompts' tokens differ from plain decoding's: a verify step's products \
             of several rows round differently from a decode step's one (bf16 on the GPU, \
             block formats); with f32 weights on the CPU they must not"
        );
    }
}

/// Every level's rows as JSON, to `--json`.
fn write_json(
    args: &SpeculativeArgs,
    device: &str,
    prompts: &[Vec<u32>],
    levels: &[Vec<Totals>],
) -> Result<()> {
    let Some(path) = &args.json else {
        return Ok(());
    };
    let mut rows = Vec::new();
    for (&concurrency, totals) in args.concurrency.iter().zip(levels) {
        for (variant, t) in args.speculative.iter().zip(totals) {
            let row = Row::of(t, totals, args, prompts.len());
            let [plan, forward, output] = row.phases;
            rows.push(json!({
                "variant": variant.to_string(),
                "concurrency": concurrency,
                "drafted": t.drafted,
                "accepted": t.accepted,
                "drafts": t.drafts,
                "accepted_by_position": t.by_position,
                "tokens_per_step": row.tokens_per_step,
                "ms_per_step": row.step_ms,
                "engine_decode_steps": t.decode_only_steps,
                "decode_step_phase_ms": {"plan": plan, "forward": forward, "output": output},
                "step_vs_off": row.step_vs_off,
                "decode_tok_s": row.tok_s,
                "vs_off": row.vs_off,
                "same_tokens_as_off": row.same.map(|k| k == t.outputs.len()),
                "prompts_as_off": row.same,
            }));
        }
    }
    let value = json!({
        "device": device,
        "text": args.text,
        "prompts": prompts.len(),
        "prompt_tokens": args.prompt_tokens,
        "echo": args.echo,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "forced_acceptance": args.forced_acceptance,
        "variants": rows,
    });
    std::fs::write(path, serde_json::to_string_pretty(&value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}
