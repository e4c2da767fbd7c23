//! `corral serve`: the OpenAI-compatible server. Loads the model, starts the engine thread
//! with a KV cache sized from `--kv-memory`, and serves HTTP until SIGINT or SIGTERM.

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use corral_engine::{
    BLOCK_SIZE, ChatTemplate, EngineConfig, sampling_defaults, spawn_engine_drafting,
};
use corral_server::{AppState, RequestCounts, ServerConfig};

use super::serve_plan;
use crate::loading::{ModelArgs, load_model};

/// Most recurrent-state checkpoints the prefix cache keeps, whatever memory they are given.
const MAX_STATE_CHECKPOINTS: usize = 256;

/// Arguments of `corral serve`.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind.
    #[arg(long, env = "CORRAL_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 picks a free one).
    #[arg(long, env = "CORRAL_PORT", default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long, env = "CORRAL_API_KEY")]
    api_key: Option<String>,
    /// Most sequences generated at once.
    #[arg(long, env = "CORRAL_MAX_BATCH", default_value_t = 16)]
    max_batch: usize,
    /// Most tokens a step computes, decode rows included (which always run).
    #[arg(long, env = "CORRAL_MAX_PREFILL_TOKENS", default_value_t = 512)]
    max_prefill_tokens: usize,
    /// Draft tokens for each decoding step to verify: off, mtp[:K] (the checkpoint's MTP
    /// head), lookup[:K] (prompt lookup), mtp+lookup[:K] (lookup where it matches, else the
    /// head), or auto (on the CPU mtp+lookup where the checkpoint has a head, else lookup;
    /// off on the GPU). The output is plain decoding's (sampled: its distribution), to the
    /// rounding that batching changes too on block-quantized weights.
    #[arg(long, env = "CORRAL_SPECULATIVE", default_value = "auto")]
    speculative: crate::speculative::Speculative,
    /// Most requests waiting; more get 429.
    #[arg(long, env = "CORRAL_MAX_QUEUE", default_value_t = 256)]
    max_queue: usize,
    /// Memory the server may use in all (weights, workspace, KV cache, recurrent states), in
    /// bytes or with a K/M/G suffix; the KV cache gets what the plan leaves. Default: a
    /// discrete GPU's free memory after loading less 5% (at least 1 GiB), else 90% of
    /// MemAvailable read before loading.
    #[arg(long, env = "CORRAL_MEMORY", value_parser = parse_bytes)]
    memory: Option<usize>,
    /// The KV cache's memory exactly, in bytes or with a K/M/G suffix (instead of the plan's).
    #[arg(long, env = "CORRAL_KV_MEMORY", value_parser = parse_bytes, conflicts_with = "memory")]
    kv_memory: Option<usize>,
    /// Longest sequence, prompt plus output (default: the model's, within the KV cache).
    #[arg(long, env = "CORRAL_MAX_CONTEXT")]
    max_context: Option<usize>,
    /// Model names clients use, comma-separated: the first is named in responses, the others
    /// are aliases (default: the checkpoint directory's name).
    #[arg(long, env = "CORRAL_SERVED_MODEL_NAME", value_delimiter = ',')]
    served_model_name: Vec<String>,
    /// Folder with tokenizer.json and tokenizer_config.json (default: the model's); needed
    /// with `--synthetic`.
    #[arg(long, env = "CORRAL_TOKENIZER")]
    tokenizer: Option<std::path::PathBuf>,
    /// Largest request body in bytes.
    #[arg(long, env = "CORRAL_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Browser origins allowed to call the API (CORS), comma-separated; `*` for any.
    #[arg(long, env = "CORRAL_ALLOWED_ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// A Jinja chat template file to use instead of the model's.
    #[arg(long, env = "CORRAL_CHAT_TEMPLATE")]
    chat_template: Option<std::path::PathBuf>,
    /// Chat template variables for requests that leave them out, as a JSON object (vLLM's
    /// `--default-chat-template-kwargs`): `{"enable_thinking": false}` turns Qwen3's and
    /// Qwen3.5's reasoning off unless a request turns it on.
    #[arg(long, env = "CORRAL_DEFAULT_CHAT_TEMPLATE_KWARGS")]
    default_chat_template_kwargs: Option<String>,
    /// How the model writes reasoning and tool calls (`qwen3`: JSON calls, `qwen3-coder`:
    /// XML calls, as Qwen3.5 and Qwen3-Coder write them); by default chosen from the chat
    /// template (vLLM's `--tool-call-parser` and `--reasoning-parser` in one).
    #[arg(long, env = "CORRAL_OUTPUT_SYNTAX")]
    output_syntax: Option<String>,
    /// Sampling values for the fields a request leaves out, over the model's
    /// generation_config.json: `temperature=0.7,top_p=0.8,top_k=20,min_p=0,repetition_penalty=1`.
    #[arg(long, env = "CORRAL_SAMPLING_DEFAULTS")]
    sampling_defaults: Option<String>,
    /// Keep computed KV blocks (and, for hybrid models, recurrent-state checkpoints) so that a
    /// request re-sending a history skips that prefix.
    #[arg(long, env = "CORRAL_PREFIX_CACHE", default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    prefix_cache: bool,
    /// Memory for recurrent-state checkpoints of the prefix cache (hybrid models), in bytes
    /// or with a K/M/G suffix.
    #[arg(long, env = "CORRAL_STATE_CACHE_BYTES", default_value = "2G", value_parser = parse_bytes)]
    state_cache_bytes: usize,
    /// Write prefixes the cache evicts to this folder and read them back for requests that
    /// extend them, across restarts (with the prefix cache).
    #[arg(long, env = "CORRAL_SESSION_DIR")]
    session_dir: Option<std::path::PathBuf>,
    /// Most bytes of session files in `--session-dir` (least recently used deleted first),
    /// in bytes or with a K/M/G suffix.
    #[arg(long, env = "CORRAL_SESSION_DIR_BYTES", default_value = "16G", value_parser = parse_bytes)]
    session_dir_bytes: usize,
    /// Seconds a request's session id (an `X-Session-Id` header, or the `user` field) keeps
    /// the prefix its turn leaves from eviction, unless nothing else is left to evict; 0
    /// turns pinning off.
    #[arg(long, env = "CORRAL_SESSION_PIN_SECONDS", default_value_t = 600)]
    session_pin_seconds: u64,
}

/// `on` or `off`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, got `{s}`")),
    }
}

/// A byte count: `1073741824`, or a number with a unit `K`, `M`, `G` or `T`, each binary and
/// each also spelled with `iB` or `B` (`512M`, `96GiB`, `96GB`, `1.5G`; case ignored).
pub(crate) fn parse_bytes(s: &str) -> Result<usize, String> {
    let text = s.trim();
    let bad = || format!("`{text}` is not a byte count like 1073741824, 512M, 8G or 96GiB");
    let lower = text.to_ascii_lowercase();
    let body = lower.strip_suffix('b').unwrap_or(&lower);
    let (body, spelled_i) = body.strip_suffix('i').map_or((body, false), |b| (b, true));
    let shift = match body.chars().last() {
        Some('k') => 10,
        Some('m') => 20,
        Some('g') => 30,
        Some('t') => 40,
        _ if spelled_i => return Err(bad()),
        _ => 0,
    };
    let number = body[..body.len() - usize::from(shift > 0)].trim();
    // Digits, with one decimal point where a unit makes a fraction of it whole bytes.
    let digits = number.bytes().filter(u8::is_ascii_digit).count();
    let points = number.len() - digits;
    if digits == 0 || points > usize::from(shift > 0) || (points == 1 && !number.contains('.')) {
        return Err(bad());
    }
    let too_large = || format!("`{text}` is too large");
    if points == 0 {
        let n: usize = number.parse().map_err(|_| too_large())?;
        return n.checked_mul(1 << shift).ok_or_else(too_large);
    }
    let bytes = number.parse::<f64>().map_err(|_| bad())? * (1u64 << shift) as f64;
    if bytes >= usize::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes.round() as usize)
}

pub(crate) fn run(args: ServeArgs) -> Result<()> {
    let Some(dir) = args
        .tokenizer
        .clone()
        .or_else(|| args.model.dir().map(std::path::Path::to_path_buf))
    else {
        bail!(
            "serve needs --model DIR (with tokenizer.json) or FILE.gguf, or --tokenizer DIR with --synthetic"
        );
    };
    let (tokenizer, mut template_config) = args.model.vocabulary(&dir)?;
    if let Some(path) = &args.chat_template {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("reading the chat template {}", path.display()))?;
        template_config.chat_template = Some(source);
    }
    let chat_template_kwargs = match &args.default_chat_template_kwargs {
        None => serde_json::Map::new(),
        Some(text) => match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(map)) => map,
            Ok(other) => {
                bail!("--default-chat-template-kwargs: expected a JSON object, got {other}")
            }
            Err(e) => bail!("--default-chat-template-kwargs: not valid JSON: {e}"),
        },
    };
    let syntax = match &args.output_syntax {
        Some(name) => corral_server::syntax::by_name(name)
            .map_err(|e| anyhow::anyhow!("--output-syntax: {e}"))?,
        None => corral_server::syntax::for_template(template_config.chat_template.as_deref()),
    };
    let chat_template = match ChatTemplate::new(&template_config) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) if args.chat_template.is_some() => bail!("--chat-template: {e}"),
        Err(e) => {
            tracing::warn!("{e}: /v1/chat/completions is unavailable");
            None
        }
    };
    let host_before_load = corral_engine::mem_available();
    let model = load_model(&args.model)?;
    let config = model.config().clone();
    // An MTP head drafting beside the model: its weights, and its one layer's KV for every
    // token the model's cache holds, count in the plan.
    let head = args.speculative.head(&args.model, &model)?;
    let head_kv = head.as_ref().map_or(0, |h| {
        h.config().kv_bytes_per_token(model.backend().kv_dtype())
    });
    let per_block = (config.kv_bytes_per_token(model.backend().kv_dtype()) + head_kv) * BLOCK_SIZE;
    let state_bytes = corral_model::RecurrentStateCache::bytes_per_slot(&config);
    let state_checkpoints = args
        .state_cache_bytes
        .checked_div(state_bytes)
        .map_or(0, |n| n.min(MAX_STATE_CHECKPOINTS));
    let context = args
        .max_context
        .unwrap_or(config.max_context())
        .min(config.max_context());
    // More blocks than every batch row at the full context could use are waste (and a model
    // without attention layers needs no KV memory at all).
    let useful = args.max_batch.max(1) * context.div_ceil(BLOCK_SIZE);
    let kv_blocks = match args.kv_memory {
        Some(bytes) => bytes.checked_div(per_block).unwrap_or(useful),
        None => {
            let shape = serve_plan::ServeShape {
                memory: args.memory.map(|m| m as u64),
                max_batch: args.max_batch,
                context,
                checkpoints: state_checkpoints,
                // The most tokens a step computes: the budget, or a step of decode rows only.
                prefill_tokens: args.max_prefill_tokens.max(args.max_batch).max(1),
                session_dir_bytes: args
                    .session_dir
                    .as_ref()
                    .map(|_| args.session_dir_bytes as u64),
                drafter_head: head
                    .as_ref()
                    .map(|h| (h.weight_bytes() as u64, head_kv as u64)),
                kept_states: args
                    .speculative
                    .kept_state_slots((model.is_hybrid(), head.is_some()), args.max_batch),
            };
            let sized =
                serve_plan::plan_serving(&model, &args.model.describe(), &shape, host_before_load)?;
            let p = &sized.plan;
            tracing::info!(
                budget = p.request.budget,
                weights = p.needs.weights,
                workspace = p.needs.workspace,
                "memory budget: {}",
                sized.source
            );
            if per_block == 0 { useful } else { p.kv_blocks }
        }
    }
    .min(useful);
    if kv_blocks == 0 {
        bail!("the KV cache holds no block ({per_block} bytes each)");
    }
    let capacity = kv_blocks * BLOCK_SIZE;
    let max_context = context.min(capacity);
    if max_context < 2 {
        bail!("the context ({max_context} tokens) is too short to serve");
    }
    let batch = args.max_batch.max(1);
    let at_batch = (kv_blocks / batch * BLOCK_SIZE).min(max_context);
    tracing::info!(
        "KV {capacity} tokens in {kv_blocks} blocks, {batch} state slots, {state_checkpoints} state checkpoints; max context {max_context} at C=1, {at_batch} at C={batch}"
    );
    serve_plan::warn_short(max_context, capacity, args.max_context);
    let segment_cache = tokenizer.fit_segment_cache(capacity);
    tracing::info!(
        bytes = segment_cache,
        "the tokenizer keeps the segments of about as many prompt tokens as the KV pool holds"
    );
    let stop_ids = args.model.stop_ids(&dir, &config.eos_token_ids)?;
    let shipped = sampling_defaults(&dir)?;
    let sampling = match &args.sampling_defaults {
        Some(text) => shipped
            .parse_over(text)
            .map_err(|e| anyhow::anyhow!("--sampling-defaults: {e}"))?,
        None => shipped,
    };
    tracing::info!(
        defaults = %sampling.describe(),
        "sampling defaults for fields a request leaves out (generation_config.json, then --sampling-defaults)"
    );
    let mut names = args
        .served_model_name
        .iter()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty());
    let served_model_name = names.next().unwrap_or_else(|| {
        dir.file_name()
            .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned())
    });
    let model_aliases: Vec<String> = names.collect();
    let drafter = args
        .speculative
        .drafter(head, (kv_blocks, BLOCK_SIZE, args.max_batch.max(1)))?;
    match &drafter {
        Some((_, what)) => tracing::info!("speculative decoding: {what}"),
        None => tracing::info!("speculative decoding off"),
    }
    let (engine, engine_thread) = spawn_engine_drafting(
        model,
        EngineConfig {
            max_batch: args.max_batch.max(1),
            max_prefill_tokens: args.max_prefill_tokens.max(1),
            max_queue: args.max_queue,
            kv_blocks,
            block_size: BLOCK_SIZE,
            max_context,
            prefix_cache: args.prefix_cache,
            state_checkpoints,
            session_dir: args.session_dir.clone(),
            session_dir_bytes: args.session_dir_bytes as u64,
            // Only session files carry it.
            model_identity: args
                .session_dir
                .as_ref()
                .map_or_else(String::new, |_| model_identity(&args.model)),
            session_pin: std::time::Duration::from_secs(args.session_pin_seconds),
            throughput_log_interval: std::time::Duration::from_secs(10),
        },
        drafter.map(|(s, _)| s),
    )?;
    let grammars = tokenizer.grammar_compiler(&stop_ids).map_err(|e| {
        tracing::warn!(error = %e, "constrained decoding (response_format, tool_choice) is unavailable");
        e.to_string()
    });
    let state = AppState {
        engine: engine.clone(),
        grammars,
        tokenizer: Arc::new(tokenizer),
        chat_template,
        syntax,
        config: Arc::new(ServerConfig {
            served_model_name: served_model_name.clone(),
            model_aliases,
            api_key: args.api_key.clone(),
            max_body_bytes: args.max_body_bytes,
            max_context,
            vocab_size: config.vocab_size,
            stop_token_ids: stop_ids,
            sampling_defaults: sampling,
            allowed_origins: args.allowed_origins.clone(),
            chat_template_kwargs,
        }),
        requests: Arc::new(RequestCounts::default()),
        responses: Default::default(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let address = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("binding {address}"))?;
        let local = listener.local_addr().context("reading the bound address")?;
        let state_bytes = state_bytes * (args.max_batch.max(1) + state_checkpoints);
        tracing::info!(
            model = %served_model_name, kv_blocks, max_context, state_bytes, state_checkpoints,
            "listening on http://{local}"
        );
        // On a signal, stop the engine first: live sequences end, so streams close and the
        // graceful shutdown does not wait for them to run to completion.
        let stopping = engine.clone();
        let shutdown = async move {
            shutdown_signal().await;
            tracing::info!("shutting down");
            stopping.shutdown();
        };
        corral_server::serve(listener, state, shutdown)
            .await
            .context("serving")
    })?;
    engine.shutdown();
    let _ = engine_thread.join();
    Ok(())
}

async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {},
        () = terminate => {},
    }
}

/// What the weights are, for session files' fingerprint: a checkpoint's weight files (names,
/// sizes, modification times) or a synthetic model's config (its weights follow from it).
fn model_identity(model: &ModelArgs) -> String {
    let describe = |path: &std::path::Path| {
        let meta = std::fs::metadata(path).ok();
        let modified = meta
            .as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        format!(
            "{}:{}:{modified}",
            path.display(),
            meta.map_or(0, |m| m.len())
        )
    };
    if let Some(config) = &model.synthetic {
        let text = std::fs::read_to_string(config).unwrap_or_default();
        return format!("synthetic {text}");
    }
    let Some(dir) = &model.model else {
        return String::new();
    };
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("safetensors"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let weights = files
        .iter()
        .map(|f| describe(f))
        .collect::<Vec<_>>()
        .join(";");
    // The config too: RoPE scaling (YaRN) added to config.json changes what a saved KV means.
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap_or_default();
    format!("{weights};config {config}")
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("2K"), Ok(2048));
        assert_eq!(parse_bytes("512m"), Ok(512 << 20));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("96GiB"), Ok(96 << 30));
        assert_eq!(parse_bytes("96gb"), Ok(96 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1T"), Ok(1 << 40));
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert_eq!(parse_bytes("100B"), Ok(100));
        assert_eq!(parse_bytes(" 2 K "), Ok(2048));
        for bad in [
            "lots",
            "",
            "G",
            "GiB",
            "iB",
            "-1G",
            "1e3G",
            "NaNG",
            "inf",
            "8X",
            "1.5",
            "99999999999999999999T",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} parsed");
        }
    }
}
