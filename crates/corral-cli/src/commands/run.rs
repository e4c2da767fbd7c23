//! `corral run`: generate from a prompt through the engine `serve` runs (one sequence),
//! streaming text to stdout, then report prompt tokens, time to first token, prefill and
//! decode rates, and dispatches, host syncs and allocations per token on stderr.

use std::io::Write;

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_backend::DispatchStats;
use corral_engine::{
    BLOCK_SIZE, ChatTemplate, EngineConfig, EngineRequest, Event, Finished, IncrementalDecoder,
    SamplingParams, TokenizerConfig, spawn_engine_drafting,
};
use serde_json::{Map, Value, json};

use crate::loading::{ModelArgs, load_model};
use crate::speculative::Speculative;

/// Arguments of `corral run`.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (needs the model's tokenizer: tokenizer.json, or a GGUF file's own).
    #[arg(
        long,
        conflicts_with = "token_ids",
        required_unless_present = "token_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (works without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user turn with the checkpoint's chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Pass enable_thinking to the chat template.
    #[arg(long, requires = "chat")]
    enable_thinking: Option<bool>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below this fraction of the top probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on tokens already present (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Most prompt tokens per prefill forward.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Draft tokens for each decoding step to verify: off, mtp[:K] (the checkpoint's MTP
    /// head), lookup[:K] (prompt lookup), mtp+lookup[:K] (lookup where it matches, else the
    /// head), or auto (on the CPU mtp+lookup where the checkpoint has a head, else lookup;
    /// off on the GPU). The output is plain decoding's (sampled: its distribution), to the
    /// rounding that batching changes too on block-quantized weights.
    #[arg(long, default_value = "auto")]
    speculative: Speculative,
}

/// The engine that `serve` runs, with room for one sequence of `total` tokens, prefilled
/// `prefill_chunk` tokens a step.
pub(crate) fn one_sequence_engine(total: usize, prefill_chunk: usize) -> EngineConfig {
    EngineConfig {
        max_batch: 1,
        max_prefill_tokens: prefill_chunk.max(1),
        max_queue: 1,
        kv_blocks: total.div_ceil(BLOCK_SIZE),
        block_size: BLOCK_SIZE,
        max_context: total,
        // One request: nothing to share.
        prefix_cache: false,
        state_checkpoints: 0,
        ..EngineConfig::default()
    }
}

pub(crate) fn run(args: RunArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: args.seed,
    };
    params.validate()?;
    let model = load_model(&args.model)?;
    let dir = args.model.dir();
    let vocabulary = match (&args.prompt, dir) {
        (Some(_), Some(dir)) => Some(
            args.model
                .vocabulary(dir)
                .context("--prompt needs the tokenizer")?,
        ),
        (Some(_), None) => {
            bail!("--prompt needs a tokenizer: use --model DIR or FILE.gguf, or --token-ids")
        }
        (None, _) => None,
    };
    let prompt_ids = match (&args.prompt, &args.token_ids, &vocabulary) {
        (Some(text), _, Some((tok, template_config))) => {
            let text = if args.chat {
                render_chat(
                    template_config,
                    text,
                    args.system.as_deref(),
                    args.enable_thinking,
                )?
            } else {
                text.clone()
            };
            tok.encode(&text)?
        }
        (None, Some(ids), _) => ids.clone(),
        _ => bail!("give --prompt or --token-ids"),
    };
    let tokenizer = vocabulary.map(|(tok, _)| tok);
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let vocab = model.config().vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    let stop = match (args.ignore_eos, dir) {
        (true, _) => Vec::new(),
        (false, Some(dir)) => args.model.stop_ids(dir, &model.config().eos_token_ids)?,
        (false, None) => model.config().eos_token_ids.clone(),
    };
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let context = model.config().max_context();
    let total = prompt_ids.len().saturating_add(args.max_tokens);
    if total > context {
        bail!(
            "the prompt ({} tokens) plus --max-tokens ({}) exceeds the model's context of {context}",
            prompt_ids.len(),
            args.max_tokens
        );
    }
    let device = model.backend().device_name();
    let strategy = model.moe_strategy();
    let config = one_sequence_engine(total, args.prefill_chunk);
    let head = args.speculative.head(&args.model, &model)?;
    let drafter = args
        .speculative
        .drafter(head, (config.kv_blocks, config.block_size, 1))?;
    let speculation = drafter.as_ref().map(|d| d.1.clone());
    let (engine, thread) = spawn_engine_drafting(model, config, drafter.map(|(s, _)| s))?;
    let metrics = std::sync::Arc::clone(engine.metrics());
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let prompt_tokens = prompt_ids.len();
    engine
        .submit(EngineRequest {
            prompt: prompt_ids,
            params,
            max_tokens: args.max_tokens,
            max_context: total,
            stop_token_ids: stop,
            top_logprobs: None,
            events: events_tx,
            session: None,
            constraint: None,
        })
        .context("starting generation")?;
    let mut stdout = std::io::stdout().lock();
    let mut decoder = IncrementalDecoder::default();
    let mut generated = 0;
    let outcome: Result<Finished> = loop {
        match events.blocking_recv() {
            Some(Event::Tokens(tokens)) => {
                generated += tokens.len();
                let mut text = String::new();
                let pieces = tokens.iter().try_for_each(|token| {
                    let piece = match &tokenizer {
                        Some(tok) => decoder.push(tok, token.id).map_err(anyhow::Error::from)?,
                        None => Some(format!("{} ", token.id)),
                    };
                    text.extend(piece);
                    Ok::<_, anyhow::Error>(())
                });
                let written = pieces.and_then(|()| {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                    Ok(())
                });
                if let Err(e) = written {
                    break Err(e.context("writing to stdout"));
                }
            }
            Some(Event::Finished(finished)) => break Ok(finished),
            Some(Event::Failed(e)) => break Err(anyhow::anyhow!("generation failed: {e}")),
            None => break Err(anyhow::anyhow!("the engine stopped")),
        }
    };
    // Dropping the stream cancels the request if it is still running.
    drop(events);
    engine.shutdown();
    let _ = thread.join();
    let report = outcome?;
    if let Some(tok) = &tokenizer
        && let Some(rest) = decoder.finish(tok)?
    {
        stdout.write_all(rest.as_bytes())?;
    }
    writeln!(stdout)?;
    drop(stdout);

    let ttft = report.prompt_ms / 1e3;
    let decode_s = report.decode_ms / 1e3;
    let per_token = |s: DispatchStats, n: usize| {
        let n = n.max(1) as f64;
        format!(
            "{:.1} dispatches, {:.2} host syncs, {:.2} allocations",
            s.dispatches as f64 / n,
            s.host_syncs as f64 / n,
            s.allocations as f64 / n
        )
    };
    eprintln!("--");
    eprintln!("device           {device}");
    eprintln!("moe strategy     {strategy}");
    eprintln!("prompt tokens    {prompt_tokens}");
    eprintln!("generated tokens {generated} (finish: {:?})", report.reason);
    eprintln!("TTFT             {:.1} ms", ttft * 1e3);
    eprintln!("prefill          {:.1} tok/s", prompt_tokens as f64 / ttft);
    if report.decode_steps > 0 {
        // Tokens after the first came from the decode steps (several a step where drafts
        // were accepted).
        eprintln!(
            "decode           {:.1} tok/s ({} steps)",
            generated.saturating_sub(1) as f64 / decode_s,
            report.decode_steps
        );
    }
    if let Some(speculation) = speculation {
        let drafted = metrics
            .draft_tokens
            .load(std::sync::atomic::Ordering::Relaxed);
        let accepted = metrics
            .accepted_draft_tokens
            .load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "speculation      {speculation}: {accepted} of {drafted} accepted ({:.0}%)",
            100.0 * accepted as f64 / drafted.max(1) as f64
        );
    }
    eprintln!(
        "prefill per tok  {}",
        per_token(report.prefill_stats, prompt_tokens)
    );
    if report.decode_steps > 0 {
        eprintln!(
            "decode per tok   {}",
            per_token(report.decode_stats, report.decode_steps)
        );
    }
    Ok(())
}

fn render_chat(
    config: &TokenizerConfig,
    prompt: &str,
    system: Option<&str>,
    enable_thinking: Option<bool>,
) -> Result<String> {
    let template = ChatTemplate::new(config)?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.push(json!({"role": "user", "content": prompt}));
    let mut extra = Map::new();
    if let Some(on) = enable_thinking {
        extra.insert("enable_thinking".to_string(), Value::Bool(on));
    }
    Ok(template.render(&messages, None, true, &extra)?)
}
