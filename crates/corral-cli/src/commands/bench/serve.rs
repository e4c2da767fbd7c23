//! `corral bench serve`: a sweep of concurrency levels against a running server. At each level
//! C, C clients send chat requests back to back (a share of them streamed) until the level's
//! request count is done; reported per level: aggregate generated tok/s, client-side TTFT and
//! inter-token latency percentiles (streamed requests), errors, and the KV blocks and state
//! slots the server still holds once the level is over (all should be free). With
//! `--prompt-tokens`, each request's prompt is that many tokens of its own filler text; with
//! `--hangups`, clients that leave mid-stream follow the sweep, and the server must free what
//! they held.
//!
//! The client speaks plain HTTP/1.0 over TCP, so response bodies arrive unchunked and end at
//! connection close; that keeps it dependency-free and lets it time each streamed event.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use super::summary::median;

/// Arguments of `corral bench serve`.
#[derive(Debug, Args)]
pub(crate) struct ServeBenchArgs {
    /// Base URL of the server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// Concurrency levels to sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    concurrency: Vec<usize>,
    /// Requests per level.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Share of requests that stream (0 to 1).
    #[arg(long, default_value_t = 0.5)]
    stream_fraction: f64,
    /// Prompt tokens of each request (filler text of its own, sized with the server's
    /// /tokenize); without it, a short question.
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// After the sweep, this many streamed requests whose clients hang up at their first
    /// token; the server must then hold no KV block or state slot.
    #[arg(long, default_value_t = 0)]
    hangups: usize,
    /// Bearer token, if the server needs one.
    #[arg(long, env = "CORRAL_API_KEY")]
    api_key: Option<String>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// What one request measured.
#[derive(Debug, Default)]
struct Outcome {
    prompt_tokens: usize,
    completion_tokens: usize,
    ttft: Option<f64>,
    gaps: Vec<f64>,
    error: Option<String>,
}

/// Host and port of an `http://host:port` URL.
pub(super) fn authority(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .context("--url must start with http://")?;
    let host = rest.trim_end_matches('/');
    if host.contains('/') {
        bail!("--url must be the server's base URL, like http://127.0.0.1:8080");
    }
    Ok(if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    })
}

/// Sends one request and reads the status line and headers; returns the status, the open
/// connection and the body bytes read so far.
async fn post(
    address: &str,
    path: &str,
    body: &Value,
    api_key: Option<&str>,
) -> Result<(u16, TcpStream, Vec<u8>)> {
    let mut stream = TcpStream::connect(address)
        .await
        .with_context(|| format!("connecting to {address}"))?;
    let payload = body.to_string();
    let auth = api_key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "POST {path} HTTP/1.0\r\nHost: {address}\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n",
        payload.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(payload.as_bytes()).await?;
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    let header_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("connection closed before the response headers");
        }
        buffer.extend_from_slice(&chunk[..n]);
        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let status_line = String::from_utf8_lossy(&buffer[..header_end]);
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("malformed status line")?;
    Ok((status, stream, buffer[header_end..].to_vec()))
}

/// `GET path` on the server; the body as text (`/metrics`).
pub(super) async fn get_text(address: &str, path: &str) -> Result<String> {
    let mut stream = TcpStream::connect(address)
        .await
        .with_context(|| format!("connecting to {address}"))?;
    let head = format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).await?;
    let text = String::from_utf8_lossy(&bytes);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("GET {path}: malformed response");
    };
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        bail!("GET {path}: HTTP {status}: {body}");
    }
    Ok(body.to_string())
}

/// What a streamed chat completion returned.
#[derive(Debug, Default)]
pub(super) struct Streamed {
    /// The generated text.
    pub(super) text: String,
    /// Seconds from `start` to the first token's event (its text may be held back).
    pub(super) ttft: Option<f64>,
    /// Seconds between later tokens' events.
    pub(super) gaps: Vec<f64>,
    /// Seconds from `start` to the end of the stream.
    pub(super) end: f64,
    /// The final usage object (`null` if none came).
    pub(super) usage: Value,
}

/// The `data:` payloads of a server-sent event stream, read off its connection.
struct SseReader {
    conn: TcpStream,
    pending: Vec<u8>,
}

impl SseReader {
    /// The next event's data; `None` when the connection closes first.
    async fn next_data(&mut self) -> Result<Option<String>> {
        let mut chunk = [0u8; 8192];
        loop {
            while let Some(i) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..i + 2).collect();
                let text = String::from_utf8_lossy(&event);
                if let Some(data) = text.trim().strip_prefix("data: ") {
                    return Ok(Some(data.to_string()));
                }
            }
            let n = self.conn.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            self.pending.extend_from_slice(&chunk[..n]);
        }
    }
}

/// A token's text in a chat-completion chunk: its content (maybe empty, the text held
/// back), and not the opening chunk that names the role.
fn token_text(chunk: &Value) -> Option<&str> {
    let delta = &chunk["choices"][0]["delta"];
    match (delta["content"].as_str(), delta.get("role")) {
        (Some(content), None) => Some(content),
        _ => None,
    }
}

/// Reads an SSE chat-completion stream to `[DONE]`, timing its token events from `start`.
async fn read_stream(
    status: u16,
    mut conn: TcpStream,
    mut pending: Vec<u8>,
    start: Instant,
) -> Result<Streamed> {
    if status != 200 {
        conn.read_to_end(&mut pending).await?;
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&pending));
    }
    let mut out = Streamed::default();
    let mut last: Option<Instant> = None;
    let mut events = SseReader { conn, pending };
    while let Some(data) = events.next_data().await? {
        if data == "[DONE]" {
            out.end = start.elapsed().as_secs_f64();
            return Ok(out);
        }
        let v: Value = serde_json::from_str(&data)?;
        if v.get("error").is_some() {
            bail!("stream error: {data}");
        }
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            out.usage = usage.clone();
        }
        if let Some(content) = token_text(&v) {
            out.text.push_str(content);
            let now = Instant::now();
            match last {
                None => out.ttft = Some((now - start).as_secs_f64()),
                Some(prev) => out.gaps.push((now - prev).as_secs_f64()),
            }
            last = Some(now);
        }
    }
    bail!("stream ended without [DONE]")
}

/// Streams the chat completion `body` (which asks for streaming with usage) and reads it.
pub(super) async fn stream_chat(
    address: &str,
    api_key: Option<&str>,
    body: &Value,
) -> Result<Streamed> {
    let start = Instant::now();
    let (status, conn, bytes) = post(address, "/v1/chat/completions", body, api_key).await?;
    read_stream(status, conn, bytes, start).await
}

/// The short question of request `index` when no prompt size is asked for.
fn question(index: usize) -> String {
    let topics = [
        "rivers", "clocks", "bread", "comets", "maps", "owls", "glass", "tides",
    ];
    format!(
        "Tell me about {} in a few words.",
        topics[index % topics.len()]
    )
}

/// `POST path` with a JSON body; the JSON answer of a 200, else an error with the body.
async fn post_json(
    address: &str,
    path: &str,
    body: &Value,
    api_key: Option<&str>,
) -> Result<Value> {
    let (status, mut conn, mut bytes) = post(address, path, body, api_key).await?;
    conn.read_to_end(&mut bytes).await?;
    if status != 200 {
        bail!("{path}: HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// Tokens of the chat prompt of one user message `text`, as the server renders it.
async fn prompt_tokens(address: &str, api_key: Option<&str>, text: &str) -> Result<usize> {
    let body = json!({"messages": [{"role": "user", "content": text}]});
    let v = post_json(address, "/tokenize", &body, api_key).await?;
    v["count"]
        .as_u64()
        .map(|n| n as usize)
        .context("/tokenize answered without a count")
}

/// A user message of filler words (its own for each `seed`) whose chat prompt is `tokens`
/// tokens, or as near as whole words come in a few tries.
async fn sized_message(
    address: &str,
    api_key: Option<&str>,
    tokens: usize,
    seed: u64,
) -> Result<String> {
    let mut n = tokens.max(1);
    let mut best: Option<(usize, String)> = None;
    for _ in 0..8 {
        let text = super::sessions::words(n, seed);
        let count = prompt_tokens(address, api_key, &text).await?;
        let off = count.abs_diff(tokens);
        if best.as_ref().is_none_or(|(b, _)| off < *b) {
            best = Some((off, text));
        }
        if off == 0 {
            break;
        }
        // Scale by the words per token seen so far.
        let next = (n as f64 + (tokens as f64 - count as f64) * n as f64 / count.max(1) as f64)
            .round()
            .max(1.0) as usize;
        if next == n {
            break;
        }
        n = next;
    }
    Ok(best.map(|(_, t)| t).unwrap_or_default())
}

async fn one_request(
    address: &str,
    api_key: Option<&str>,
    index: usize,
    message: &str,
    max_tokens: usize,
    stream: bool,
) -> Outcome {
    let body = json!({
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": index,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    let count = |usage: &Value, field: &str| usage[field].as_u64().unwrap_or(0) as usize;
    let result: Result<Outcome> = async {
        if !stream {
            let v = post_json(address, "/v1/chat/completions", &body, api_key).await?;
            return Ok(Outcome {
                prompt_tokens: count(&v["usage"], "prompt_tokens"),
                completion_tokens: count(&v["usage"], "completion_tokens"),
                ..Outcome::default()
            });
        }
        let streamed = stream_chat(address, api_key, &body).await?;
        Ok(Outcome {
            prompt_tokens: count(&streamed.usage, "prompt_tokens"),
            completion_tokens: count(&streamed.usage, "completion_tokens"),
            ttft: streamed.ttft,
            gaps: streamed.gaps,
            error: None,
        })
    }
    .await;
    result.unwrap_or_else(|e| Outcome {
        error: Some(e.to_string()),
        ..Outcome::default()
    })
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

/// An unlabelled metric's value in Prometheus text (0 if absent).
pub(super) fn metric(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Waits (up to 30 s) until the server runs and queues nothing, then reads the KV blocks and
/// state slots it still holds.
async fn held_after(address: &str) -> Result<(u64, u64)> {
    let start = Instant::now();
    loop {
        let m = get_text(address, "/metrics").await?;
        if !m.contains("corral_state_slots_used") {
            bail!(
                "the server's /metrics has no corral_state_slots_used: is it Corral, and this version?"
            );
        }
        let busy = metric(&m, "corral_running_sequences") + metric(&m, "corral_queue_depth");
        if busy == 0 {
            return Ok((
                metric(&m, "corral_kv_blocks_used"),
                metric(&m, "corral_state_slots_used"),
            ));
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!(
                "the server still runs or queues {busy} requests 30 s after its clients finished"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Streams `message` and closes the connection at the first token's event.
async fn hang_up_after_first_token(
    address: &str,
    api_key: Option<&str>,
    message: &str,
    max_tokens: usize,
) -> Result<()> {
    let body = json!({
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens, "temperature": 0.7, "stream": true,
    });
    let (status, mut conn, mut pending) =
        post(address, "/v1/chat/completions", &body, api_key).await?;
    if status != 200 {
        conn.read_to_end(&mut pending).await?;
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&pending));
    }
    let mut events = SseReader { conn, pending };
    while let Some(data) = events.next_data().await? {
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        if token_text(&v).is_some() {
            // Dropping the reader closes the connection.
            return Ok(());
        }
    }
    bail!("the stream ended before its first token")
}

/// The user messages of one level's requests (seeds distinct per level, so that no level
/// finds another's prompts in a prefix cache).
async fn level_messages(args: &ServeBenchArgs, address: &str, level: usize) -> Result<Vec<String>> {
    let mut out = Vec::with_capacity(args.requests);
    for i in 0..args.requests {
        out.push(match args.prompt_tokens {
            Some(tokens) => {
                let seed = 1_000_003 * (level as u64 + 1) + i as u64;
                sized_message(address, args.api_key.as_deref(), tokens, seed).await?
            }
            None => question(i),
        });
    }
    Ok(out)
}

pub(crate) fn run(args: ServeBenchArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&args.stream_fraction) {
        bail!("--stream-fraction must be between 0 and 1");
    }
    if args.concurrency.contains(&0)
        || args.requests == 0
        || args.max_tokens == 0
        || args.prompt_tokens == Some(0)
    {
        bail!("--concurrency, --requests, --max-tokens and --prompt-tokens must be positive");
    }
    let address = authority(&args.url)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    println!(
        "{:>4} {:>9} {:>7} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "C",
        "requests",
        "errors",
        "prompt",
        "agg tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "KV/slots"
    );
    let mut levels = Vec::new();
    let mut held_total = 0;
    for (level, &c) in args.concurrency.iter().enumerate() {
        let messages = Arc::new(runtime.block_on(level_messages(&args, &address, level))?);
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        runtime.block_on(async {
            let mut workers = Vec::new();
            for _ in 0..c {
                let (outcomes, next, address, messages) = (
                    Arc::clone(&outcomes),
                    Arc::clone(&next),
                    address.clone(),
                    Arc::clone(&messages),
                );
                let key = args.api_key.clone();
                let (total, max_tokens, share) =
                    (args.requests, args.max_tokens, args.stream_fraction);
                workers.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= total {
                            break;
                        }
                        // Every request i streams when the running share of streamed ones is behind.
                        let stream = ((i + 1) as f64 * share).floor() > (i as f64 * share).floor();
                        let outcome = one_request(
                            &address,
                            key.as_deref(),
                            i,
                            &messages[i],
                            max_tokens,
                            stream,
                        )
                        .await;
                        outcomes.lock().await.push(outcome);
                    }
                }));
            }
            for w in workers {
                let _ = w.await;
            }
        });
        let wall = start.elapsed().max(Duration::from_micros(1)).as_secs_f64();
        let (kv_left, slots_left) = runtime.block_on(held_after(&address))?;
        held_total += kv_left + slots_left;
        let outcomes = runtime.block_on(async { std::mem::take(&mut *outcomes.lock().await) });
        let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.error.as_ref()).collect();
        let tokens: usize = outcomes.iter().map(|o| o.completion_tokens).sum();
        let answered = outcomes.iter().filter(|o| o.error.is_none()).count().max(1);
        let prompt =
            outcomes.iter().map(|o| o.prompt_tokens).sum::<usize>() as f64 / answered as f64;
        let ttfts: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft).collect();
        let gaps: Vec<f64> = outcomes
            .iter()
            .flat_map(|o| o.gaps.iter().copied())
            .collect();
        let tok_s = tokens as f64 / wall;
        let ms = |v: f64| v * 1e3;
        println!(
            "{c:>4} {:>9} {:>7} {prompt:>8.0} {tok_s:>12.1} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>8.2}ms {:>9}",
            outcomes.len(),
            errors.len(),
            ms(percentile(&ttfts, 50.0)),
            ms(percentile(&ttfts, 99.0)),
            ms(percentile(&gaps, 50.0)),
            ms(percentile(&gaps, 99.0)),
            format!("{kv_left}/{slots_left}"),
        );
        if let Some(first) = errors.first() {
            eprintln!("  first error at C={c}: {first}");
        }
        levels.push(json!({
            "concurrency": c,
            "requests": outcomes.len(),
            "errors": errors.len(),
            "mean_prompt_tokens": prompt,
            "generated_tokens": tokens,
            "wall_seconds": wall,
            "aggregate_tok_s": tok_s,
            "ttft_ms_p50": ms(percentile(&ttfts, 50.0)),
            "ttft_ms_p90": ms(percentile(&ttfts, 90.0)),
            "ttft_ms_p99": ms(percentile(&ttfts, 99.0)),
            "itl_ms_p50": ms(percentile(&gaps, 50.0)),
            "itl_ms_p90": ms(percentile(&gaps, 90.0)),
            "itl_ms_p99": ms(percentile(&gaps, 99.0)),
            "ttft_ms_median": ms(median(&ttfts)),
            "kv_blocks_held_after": kv_left,
            "state_slots_held_after": slots_left,
        }));
    }
    let mut hangup = Value::Null;
    if args.hangups > 0 {
        let messages = runtime.block_on(level_messages(&args, &address, args.concurrency.len()))?;
        let failed = runtime.block_on(async {
            let mut clients = Vec::new();
            for i in 0..args.hangups {
                let (address, key) = (address.clone(), args.api_key.clone());
                let message = messages[i % messages.len()].clone();
                let max_tokens = args.max_tokens;
                clients.push(tokio::spawn(async move {
                    hang_up_after_first_token(&address, key.as_deref(), &message, max_tokens).await
                }));
            }
            let mut failed = 0;
            for c in clients {
                if !matches!(c.await, Ok(Ok(()))) {
                    failed += 1;
                }
            }
            failed
        });
        let (kv_left, slots_left) = runtime.block_on(held_after(&address))?;
        held_total += kv_left + slots_left;
        println!(
            "after {} clients hung up at their first token ({failed} failed before it): {kv_left} KV blocks and {slots_left} state slots held",
            args.hangups
        );
        if failed == args.hangups {
            bail!("none of the {failed} hang-up clients got a first token: nothing was tested");
        }
        hangup = json!({
            "clients": args.hangups, "failed_before_first_token": failed,
            "kv_blocks_held_after": kv_left, "state_slots_held_after": slots_left,
        });
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "url": args.url, "max_tokens": args.max_tokens, "stream_fraction": args.stream_fraction,
            "prompt_tokens": args.prompt_tokens, "levels": levels, "hangups": hangup,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if held_total > 0 {
        bail!("the server still held KV blocks or state slots after a level or the hang-ups");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_percentiles() {
        assert_eq!(
            authority("http://127.0.0.1:8080/").unwrap(),
            "127.0.0.1:8080"
        );
        assert_eq!(authority("http://localhost").unwrap(), "localhost:80");
        assert!(authority("https://x").is_err());
        assert!(authority("http://x/v1").is_err());
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 50.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 90.0), 5.0);
    }

    #[test]
    fn metrics_and_token_chunks_are_read() {
        let text = "# TYPE corral_kv_blocks_used gauge\ncorral_kv_blocks_used_total 9\ncorral_kv_blocks_used 3\nvllm:x{a=\"b\"} 4\n";
        assert_eq!(metric(text, "corral_kv_blocks_used"), 3);
        assert_eq!(metric(text, "corral_state_slots_used"), 0);
        let chunk = |delta: Value| json!({"choices": [{"delta": delta}]});
        assert_eq!(token_text(&chunk(json!({"content": "hi"}))), Some("hi"));
        assert_eq!(token_text(&chunk(json!({"content": ""}))), Some(""));
        assert_eq!(
            token_text(&chunk(json!({"role": "assistant", "content": ""}))),
            None
        );
        assert_eq!(token_text(&chunk(json!({"tool_calls": []}))), None);
    }
}
