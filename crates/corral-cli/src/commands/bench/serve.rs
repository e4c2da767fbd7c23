//! `corral bench serve`: a sweep of concurrency levels against a running server. At each level
//! C, C clients send short chat requests back to back (a share of them streamed) until the
//! level's request count is done; reported per level: aggregate generated tok/s, client-side
//! TTFT and inter-token latency percentiles (streamed requests), and errors.
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
    match text.split_once("\r\n\r\n") {
        Some((_, body)) => Ok(body.to_string()),
        None => bail!("GET {path}: malformed response"),
    }
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
    let mut chunk = [0u8; 8192];
    loop {
        while let Some(i) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..i + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                out.end = start.elapsed().as_secs_f64();
                return Ok(out);
            }
            let v: Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                bail!("stream error: {data}");
            }
            if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                out.usage = usage.clone();
            }
            // A token's chunk: content (maybe empty, its text held back), and not the
            // opening chunk that names the role.
            let delta = &v["choices"][0]["delta"];
            if let (Some(content), None) = (delta["content"].as_str(), delta.get("role")) {
                out.text.push_str(content);
                let now = Instant::now();
                match last {
                    None => out.ttft = Some((now - start).as_secs_f64()),
                    Some(prev) => out.gaps.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            bail!("stream ended without [DONE]");
        }
        pending.extend_from_slice(&chunk[..n]);
    }
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

async fn one_request(
    address: &str,
    api_key: Option<&str>,
    index: usize,
    max_tokens: usize,
    stream: bool,
) -> Outcome {
    let topics = [
        "rivers", "clocks", "bread", "comets", "maps", "owls", "glass", "tides",
    ];
    let body = json!({
        "messages": [{"role": "user", "content": format!("Tell me about {} in a few words.", topics[index % topics.len()])}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": index,
        "stream": stream,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let result: Result<Outcome> = async {
        let (status, mut conn, mut body_bytes) =
            post(address, "/v1/chat/completions", &body, api_key).await?;
        let mut outcome = Outcome::default();
        if !stream {
            conn.read_to_end(&mut body_bytes).await?;
            if status != 200 {
                bail!("HTTP {status}: {}", String::from_utf8_lossy(&body_bytes));
            }
            let v: Value = serde_json::from_slice(&body_bytes)?;
            outcome.completion_tokens =
                v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
            return Ok(outcome);
        }
        let streamed = read_stream(status, conn, body_bytes, start).await?;
        outcome.completion_tokens =
            streamed.usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
        outcome.ttft = streamed.ttft;
        outcome.gaps = streamed.gaps;
        Ok(outcome)
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

pub(crate) fn run(args: ServeBenchArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&args.stream_fraction) {
        bail!("--stream-fraction must be between 0 and 1");
    }
    if args.concurrency.contains(&0) || args.requests == 0 || args.max_tokens == 0 {
        bail!("--concurrency, --requests and --max-tokens must be positive");
    }
    let address = authority(&args.url)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    println!(
        "{:>4} {:>9} {:>7} {:>12} {:>10} {:>10} {:>10} {:>10}",
        "C", "requests", "errors", "agg tok/s", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90"
    );
    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        runtime.block_on(async {
            let mut workers = Vec::new();
            for _ in 0..c {
                let (outcomes, next, address) =
                    (Arc::clone(&outcomes), Arc::clone(&next), address.clone());
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
                        let outcome =
                            one_request(&address, key.as_deref(), i, max_tokens, stream).await;
                        outcomes.lock().await.push(outcome);
                    }
                }));
            }
            for w in workers {
                let _ = w.await;
            }
        });
        let wall = start.elapsed().max(Duration::from_micros(1)).as_secs_f64();
        let outcomes = runtime.block_on(async { std::mem::take(&mut *outcomes.lock().await) });
        let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.error.as_ref()).collect();
        let tokens: usize = outcomes.iter().map(|o| o.completion_tokens).sum();
        let ttfts: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft).collect();
        let gaps: Vec<f64> = outcomes
            .iter()
            .flat_map(|o| o.gaps.iter().copied())
            .collect();
        let tok_s = tokens as f64 / wall;
        let ms = |v: f64| v * 1e3;
        println!(
            "{c:>4} {:>9} {:>7} {tok_s:>12.1} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>8.2}ms",
            outcomes.len(),
            errors.len(),
            ms(percentile(&ttfts, 50.0)),
            ms(percentile(&ttfts, 90.0)),
            ms(percentile(&gaps, 50.0)),
            ms(percentile(&gaps, 90.0)),
        );
        if let Some(first) = errors.first() {
            eprintln!("  first error at C={c}: {first}");
        }
        levels.push(json!({
            "concurrency": c,
            "requests": outcomes.len(),
            "errors": errors.len(),
            "generated_tokens": tokens,
            "wall_seconds": wall,
            "aggregate_tok_s": tok_s,
            "ttft_ms_p50": ms(percentile(&ttfts, 50.0)),
            "ttft_ms_p90": ms(percentile(&ttfts, 90.0)),
            "itl_ms_p50": ms(percentile(&gaps, 50.0)),
            "itl_ms_p90": ms(percentile(&gaps, 90.0)),
            "ttft_ms_median": ms(median(&ttfts)),
        }));
    }
    if let Some(path) = &args.json {
        let doc = json!({"url": args.url, "max_tokens": args.max_tokens, "stream_fraction": args.stream_fraction, "levels": levels});
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
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
}
