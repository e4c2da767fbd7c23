//! `corral bench sessions`: interleaved multi-turn agent sessions against a running server.
//! Every session shares a system prompt (tool definitions); each turn re-sends the whole
//! conversation, as agents do, with the previous reply and a tool result appended. Per turn:
//! the TTFT of the whole prompt, the prompt tokens the server took from its prefix cache, and
//! the TTFT of a request holding only the turn's new text (measured right after, not
//! estimated), so that a revisit's cost can be compared with its new tokens alone; both are
//! medians of a few repeats, this machine's noise being larger than what is compared. Run it
//! against servers started with `--prefix-cache on` and `off` to compare the two.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use super::plot::Series;
use super::serve::{authority, get_text, metric, stream_chat};
use super::summary::median;

/// Arguments of `corral bench sessions`.
#[derive(Debug, Args)]
pub(crate) struct SessionsArgs {
    /// Base URL of the server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// Sessions, visited in turn.
    #[arg(long, default_value_t = 3)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Words of the shared system prompt (tool definitions).
    #[arg(long, default_value_t = 400)]
    system_words: usize,
    /// Words of each tool result appended after a reply.
    #[arg(long, default_value_t = 60)]
    tool_words: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 24)]
    reply_tokens: usize,
    /// Visit the sessions in a seeded random order instead of round-robin.
    #[arg(long)]
    random_order: bool,
    /// Sessions of other words (tasks, tool results, the visiting order) behind the same
    /// system prompt: a soak's passes, each a new set of sessions.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Times each revisit and each turn's new text alone are measured, the medians compared:
    /// a revisit as the session goes on, then again with its reply opened by other words (the
    /// same cached history, as many new tokens); the new text alone each time opened by its
    /// own two words, so that none finds more than a few tokens of another in the cache.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Bearer token, if the server needs one.
    #[arg(long, env = "CORRAL_API_KEY")]
    api_key: Option<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// This run's name in the JSON and the plot (default: whether it hit the prefix cache).
    #[arg(long)]
    label: Option<String>,
    /// An earlier run's JSON (e.g. against a server with `--prefix-cache off`) to plot beside
    /// this one.
    #[arg(long)]
    compare: Option<PathBuf>,
    /// Plot every turn's TTFT against its prompt length (this run, its new text alone, and
    /// the compared run) as SVG, or PNG for a `.png` name.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also time, for prompts of about these many tokens, a cold prefill against its restore
    /// from the server's `--session-dir` (other prompts of the same size are sent until the
    /// server spills the first, then the first comes back as a history with a reply and a
    /// new message).
    #[arg(long, value_delimiter = ',')]
    restore_tokens: Vec<usize>,
    /// Milliseconds between the last other prompt and the restored turn (an agent's tool
    /// call or a user's reading): a server idle that long writes cached sessions to disk
    /// ahead of the eviction that needs their blocks.
    #[arg(long, default_value_t = 0)]
    restore_pause_ms: u64,
}

/// The filler text's words.
const VOCAB: [&str; 16] = [
    "file", "search", "result", "path", "line", "error", "test", "build", "value", "config",
    "output", "module", "function", "query", "status", "table",
];

/// How far apart two `--seed`s put their filler's seeds (past every seed one run uses).
const SEED_STRIDE: u64 = 1 << 32;

/// `n` words of deterministic filler text, different for each `seed`.
pub(super) fn words(n: usize, seed: u64) -> String {
    let mut s = seed.wrapping_mul(6364136223846793005) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            VOCAB[(s >> 60) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The words that open the `n`-th new-text-alone prompt of a run: two of the filler
/// vocabulary, so that one prompt shares at most the chat template's opening and a word with
/// any other in the server's cache.
fn alone_opening(n: usize) -> String {
    format!(
        "{} {}:",
        VOCAB[n % VOCAB.len()],
        VOCAB[n / VOCAB.len() % VOCAB.len()]
    )
}

/// One measured turn.
#[derive(Debug)]
struct Turn {
    session: usize,
    turn: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// The median of `ttft_samples_ms`.
    ttft_ms: f64,
    /// The turn's TTFT as the session goes on, then its repeats (revisits only).
    ttft_samples_ms: Vec<f64>,
    /// The median of `new_alone_samples_ms`.
    new_alone_ttft_ms: f64,
    new_alone_samples_ms: Vec<f64>,
    /// The most prompt tokens any repeat of the new text alone found cached.
    new_alone_cached_tokens: u64,
}

pub(crate) fn run(args: SessionsArgs) -> Result<()> {
    if args.reply_tokens == 0
        || args.repeats == 0
        || (args.restore_tokens.is_empty() && (args.sessions == 0 || args.turns == 0))
    {
        bail!(
            "--sessions, --turns, --reply-tokens and --repeats must be positive (sessions may be 0 with --restore-tokens)"
        );
    }
    if let Some(path) = &args.plot {
        super::plot::check_path(path)?;
    }
    let address = authority(&args.url)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let system = format!("You can call these tools: {}", words(args.system_words, 1));
    let mut conversations: Vec<Vec<Value>> = (0..args.sessions)
        .map(|i| {
            vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": format!("Task {i}: {}", words(30, 100 + i as u64 + args.seed * SEED_STRIDE))}),
            ]
        })
        .collect();
    let mut visits: Vec<usize> = (0..args.turns).flat_map(|_| 0..args.sessions).collect();
    if args.random_order {
        let mut s: u64 = 7 + args.seed;
        for i in (1..visits.len()).rev() {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            visits.swap(i, (s >> 33) as usize % (i + 1));
        }
    }
    let mut turns_done = vec![0usize; args.sessions];
    let mut new_text = vec![String::new(); args.sessions];
    let request = |messages: &[Value], max_tokens: usize| {
        json!({
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    println!(
        "{:>7} {:>4} {:>8} {:>8} {:>10} {:>12} {:>7}",
        "session", "turn", "prompt", "cached", "TTFT ms", "new alone ms", "ratio"
    );
    let mut rows = Vec::new();
    let mut alone_sent = 0;
    for &i in &visits {
        let turn = turns_done[i];
        turns_done[i] += 1;
        let key = args.api_key.as_deref();
        let whole = runtime
            .block_on(stream_chat(
                &address,
                key,
                &request(&conversations[i], args.reply_tokens),
            ))
            .with_context(|| format!("session {i} turn {turn}"))?;
        // The turn's new text alone (the first turn's is its task), as a prompt of its own.
        let fresh = if turn == 0 {
            conversations[i][1]["content"]
                .as_str()
                .unwrap_or("")
                .to_string()
        } else {
            new_text[i].clone()
        };
        // A revisit again: the same history, its reply opened by other words.
        let mut ttft_ms = vec![whole.ttft.unwrap_or(whole.end) * 1e3];
        let reply_at = conversations[i].len().saturating_sub(2);
        for _ in (1..args.repeats).filter(|_| turn > 0) {
            let mut again = conversations[i].clone();
            let reply = again[reply_at]["content"]
                .as_str()
                .unwrap_or("")
                .to_string();
            again[reply_at]["content"] = json!(format!("{} {reply}", alone_opening(alone_sent)));
            alone_sent += 1;
            let repeat = runtime
                .block_on(stream_chat(&address, key, &request(&again, 1)))
                .with_context(|| format!("session {i} turn {turn}, repeated"))?;
            ttft_ms.push(repeat.ttft.unwrap_or(repeat.end) * 1e3);
        }
        let mut alone_ms = Vec::with_capacity(args.repeats);
        let mut alone_cached = 0;
        for _ in 0..args.repeats {
            let content = format!("{} {fresh}", alone_opening(alone_sent));
            alone_sent += 1;
            let alone = runtime
                .block_on(stream_chat(
                    &address,
                    key,
                    &request(&[json!({"role": "user", "content": content})], 1),
                ))
                .with_context(|| format!("session {i} turn {turn}, new text alone"))?;
            alone_ms.push(alone.ttft.unwrap_or(alone.end) * 1e3);
            alone_cached = alone_cached.max(cached_tokens(&alone.usage));
        }
        let row = Turn {
            session: i,
            turn,
            prompt_tokens: whole.usage["prompt_tokens"].as_u64().unwrap_or(0),
            cached_tokens: cached_tokens(&whole.usage),
            // A reply with no text (a stop token first) counts to the end of its stream.
            ttft_ms: median(&ttft_ms),
            ttft_samples_ms: ttft_ms,
            new_alone_ttft_ms: median(&alone_ms),
            new_alone_samples_ms: alone_ms,
            new_alone_cached_tokens: alone_cached,
        };
        println!(
            "{:>7} {:>4} {:>8} {:>8} {:>10.2} {:>12.2} {:>7.2}",
            row.session,
            row.turn,
            row.prompt_tokens,
            row.cached_tokens,
            row.ttft_ms,
            row.new_alone_ttft_ms,
            row.ttft_ms / row.new_alone_ttft_ms.max(1e-9)
        );
        // The reply goes back into the history, then a tool result: the next turn's new text.
        let tool = format!(
            "Tool result: {}",
            words(
                args.tool_words,
                (i * 1000 + turn) as u64 + args.seed * SEED_STRIDE
            )
        );
        conversations[i].push(json!({"role": "assistant", "content": whole.text}));
        conversations[i].push(json!({"role": "user", "content": tool}));
        new_text[i] = format!("{}\n{}", whole.text, tool);
        rows.push(row);
    }
    let restores = args
        .restore_tokens
        .iter()
        .map(|&n| {
            runtime.block_on(restore_from_disk(
                &address,
                args.api_key.as_deref(),
                n,
                args.restore_pause_ms,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let revisits: Vec<f64> = rows
        .iter()
        .filter(|r| r.turn > 0)
        .map(|r| r.ttft_ms / r.new_alone_ttft_ms.max(1e-9))
        .collect();
    let first_revisits: Vec<f64> = rows
        .iter()
        .filter(|r| r.turn > 0)
        .map(|r| r.ttft_samples_ms[0] / r.new_alone_ttft_ms.max(1e-9))
        .collect();
    if !revisits.is_empty() {
        let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        println!(
            "revisits: TTFT / TTFT of the new text alone (medians of {}), median {:.2}, worst {:.2}; \
             the first sample of each revisit: median {:.2}, worst {:.2}",
            args.repeats,
            median(&revisits),
            worst(&revisits),
            median(&first_revisits),
            worst(&first_revisits)
        );
    }
    let label = args.label.clone().unwrap_or_else(|| {
        if rows.iter().any(|r| r.cached_tokens > 0) {
            "prefix cache hits".to_string()
        } else {
            "no prefix cache hits".to_string()
        }
    });
    if let Some(path) = &args.plot {
        let mut series = vec![
            Series {
                name: label.clone(),
                points: rows
                    .iter()
                    .map(|r| (r.prompt_tokens as f64, r.ttft_ms))
                    .collect(),
            },
            Series {
                name: "new text alone".to_string(),
                points: rows
                    .iter()
                    .map(|r| (r.prompt_tokens as f64, r.new_alone_ttft_ms))
                    .collect(),
            },
        ];
        if let Some(other) = &args.compare {
            series.push(compared_series(other)?);
        }
        let title = format!(
            "TTFT per turn: {} sessions against {}",
            args.sessions, args.url
        );
        super::plot::write(path, &title, &series)?;
    }
    if let Some(path) = &args.json {
        let turns: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "session": r.session,
                    "turn": r.turn,
                    "prompt_tokens": r.prompt_tokens,
                    "cached_tokens": r.cached_tokens,
                    "ttft_ms": r.ttft_ms,
                    "ttft_samples_ms": r.ttft_samples_ms,
                    "new_alone_ttft_ms": r.new_alone_ttft_ms,
                    "new_alone_samples_ms": r.new_alone_samples_ms,
                    "new_alone_cached_tokens": r.new_alone_cached_tokens,
                })
            })
            .collect();
        let doc = json!({
            "url": args.url, "sessions": args.sessions, "label": label, "turns": turns,
            "restores": restores,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The prompt tokens a response's usage says came from the prefix cache.
fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The TTFT per turn of an earlier run's JSON, under its label.
fn compared_series(path: &std::path::Path) -> Result<Series> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let doc: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let Some(turns) = doc["turns"].as_array() else {
        bail!(
            "{}: no \"turns\" array (not a bench sessions JSON)",
            path.display()
        );
    };
    let points = turns
        .iter()
        .map(
            |t| match (t["prompt_tokens"].as_f64(), t["ttft_ms"].as_f64()) {
                (Some(x), Some(y)) => Ok((x, y)),
                _ => bail!(
                    "{}: a turn without prompt_tokens and ttft_ms",
                    path.display()
                ),
            },
        )
        .collect::<Result<Vec<_>>>()?;
    let name = doc["label"].as_str().unwrap_or("compared run").to_string();
    Ok(Series { name, points })
}

/// A counter's value in the server's `/metrics` (0 if absent).
async fn counter(address: &str, name: &str) -> Result<u64> {
    Ok(metric(&get_text(address, "/metrics").await?, name))
}

/// Cold prefill of a prompt of about `tokens` tokens against its restore from disk: other
/// prompts of that size until the server reports a spill, then the prompt again as the
/// history of a next turn.
async fn restore_from_disk(
    address: &str,
    key: Option<&str>,
    tokens: usize,
    pause_ms: u64,
) -> Result<Value> {
    let chat = |messages: Value| {
        json!({
            "messages": messages,
            "max_tokens": 1, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    let one = |text: String| chat(json!([{"role": "user", "content": text}]));
    // The tokenizer decides how many words make `tokens`: measure once and scale.
    let probe = stream_chat(address, key, &one(words(tokens / 2, 9_000))).await?;
    let per_word =
        probe.usage["prompt_tokens"].as_f64().unwrap_or(1.0) / (tokens / 2).max(1) as f64;
    let n_words = ((tokens as f64 / per_word.max(1e-3)) as usize).max(1);
    let text = words(n_words, 9_001 + tokens as u64);
    let cold = stream_chat(address, key, &one(text.clone())).await?;
    let spills = counter(address, "corral_session_spills_total").await?;
    let mut fillers = 0;
    while counter(address, "corral_session_spills_total").await? == spills {
        if fillers == 8 {
            bail!(
                "no spill after 8 other prompts of {tokens} tokens: is --session-dir set and the KV cache smaller?"
            );
        }
        stream_chat(address, key, &one(words(n_words, 9_100 + fillers))).await?;
        fillers += 1;
    }
    tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
    // The session's file on disk before its next turn: the background writes of the spills
    // finished (a turn sent sooner waits for its file's).
    let waited = std::time::Instant::now();
    loop {
        let m = get_text(address, "/metrics").await?;
        let written = "corral_session_spill_writes_total";
        // A server that does not count its writes is not waited for.
        if !m.contains(written) || metric(&m, written) >= metric(&m, "corral_session_spills_total")
        {
            break;
        }
        if waited.elapsed().as_secs() >= 120 {
            bail!("the server's session files were not written within 120 s");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let writes_ms = waited.elapsed().as_secs_f64() * 1e3;
    let restores = counter(address, "corral_session_restores_total").await?;
    // The next turn, as an agent sends it: the history, a reply and a new message.
    let next = chat(json!([
        {"role": "user", "content": text},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": words(20, 9_999)},
    ]));
    let again = stream_chat(address, key, &next).await?;
    let restored = counter(address, "corral_session_restores_total").await? > restores;
    let ms = |s: &super::serve::Streamed| s.ttft.unwrap_or(s.end) * 1e3;
    let prompt = cold.usage["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = again.usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    println!(
        "restore: {prompt} tokens cold {:.1} ms; after {fillers} other prompts, a pause of {pause_ms} ms and {writes_ms:.0} ms for the files' writes, the next turn ({cached} cached{}) {:.1} ms: {:.1}x",
        ms(&cold),
        if restored {
            ", from disk"
        } else {
            ", not from disk"
        },
        ms(&again),
        ms(&cold) / ms(&again).max(1e-9)
    );
    Ok(json!({
        "prompt_tokens": prompt, "cold_ttft_ms": ms(&cold), "restored_ttft_ms": ms(&again),
        "cached_tokens": cached, "from_disk": restored, "fillers": fillers,
        "waited_for_writes_ms": writes_ms, "pause_ms": pause_ms,
    }))
}
