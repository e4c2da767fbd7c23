//! `GET /metrics`: Prometheus text exposition of request counts, token counts, latency
//! histograms, queue depth, running sequences, KV blocks and dispatches per token, under
//! Corral's names and (the ones routers and dashboards read) under vLLM's.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use corral_engine::metrics::Histogram;

use crate::state::AppState;

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    labelled_histogram(out, name, help, h, "");
}

/// A histogram whose series carry `labels` (`key="value",...`, or empty) beside `le`.
fn labelled_histogram(out: &mut String, name: &str, help: &str, h: &Histogram, labels: &str) {
    let (buckets, sum, count) = h.snapshot();
    let (sep, set) = if labels.is_empty() {
        ("", String::new())
    } else {
        (",", format!("{{{labels}}}"))
    };
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (bound, n) in buckets {
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"{sep}{labels}}} {n}");
    }
    let _ = writeln!(
        out,
        "{name}_bucket{{le=\"+Inf\"{sep}{labels}}} {count}\n{name}_sum{set} {sum}\n{name}_count{set} {count}"
    );
}

/// A gauge or counter whose one series carries `labels`.
fn labelled(out: &mut String, name: &str, kind: &str, help: &str, labels: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}"
    );
}

/// A Prometheus label value: backslashes, quotes and newlines escaped.
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The metrics under vLLM's names and `model_name` label, which dashboards and the routers
/// that balance vLLM fleets read (the Gateway API Inference Extension's model-server
/// protocol: queued and running requests, KV-cache utilisation, the cache's block size and
/// size).
fn vllm_compatible(out: &mut String, state: &AppState) {
    let m = state.engine.metrics();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let model = format!(
        "model_name=\"{}\"",
        label_value(&state.config.served_model_name)
    );
    let total = load(&m.kv_blocks_total);
    let usage = if total > 0.0 {
        load(&m.kv_blocks_used) / total
    } else {
        0.0
    };
    let gauges: [(&str, &str, f64); 3] = [
        (
            "vllm:num_requests_running",
            "Requests being generated.",
            load(&m.running),
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting for admission.",
            load(&m.queue_depth),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "Fraction of KV cache blocks held by requests (1 = full).",
            usage,
        ),
    ];
    for (name, help, value) in gauges {
        labelled(out, name, "gauge", help, &model, value);
    }
    labelled(
        out,
        "vllm:cache_config_info",
        "gauge",
        "The KV cache's block size and number of blocks.",
        &format!(
            "{model},block_size=\"{}\",num_gpu_blocks=\"{}\"",
            state.engine.config().block_size,
            total
        ),
        1.0,
    );
    let counters: [(&str, &str, f64); 7] = [
        (
            "vllm:prompt_tokens_total",
            "Prompt tokens prefilled.",
            load(&m.prompt_tokens),
        ),
        (
            "vllm:generation_tokens_total",
            "Tokens generated.",
            load(&m.generated_tokens),
        ),
        (
            "vllm:num_preemptions_total",
            "Requests preempted for KV blocks.",
            load(&m.preemptions),
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prompt tokens of finished requests looked up in the prefix cache.",
            load(&m.finished_prompt_tokens),
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prompt tokens of finished requests found in the prefix cache.",
            load(&m.cached_prompt_tokens),
        ),
        (
            "vllm:spec_decode_num_draft_tokens_total",
            "Draft tokens verified.",
            load(&m.draft_tokens),
        ),
        (
            "vllm:spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted.",
            load(&m.accepted_draft_tokens),
        ),
    ];
    for (name, help, value) in counters {
        labelled(out, name, "counter", help, &model, value);
    }
    let name = "vllm:spec_decode_num_drafts_total";
    labelled(
        out,
        name,
        "counter",
        "Drafts verified.",
        &model,
        load(&m.drafts),
    );
    let name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
    let _ = writeln!(
        out,
        "# HELP {name} Draft tokens accepted, by position in the draft.\n# TYPE {name} counter"
    );
    for (position, n) in m.accepted_by_position.iter().enumerate() {
        let _ = writeln!(out, "{name}{{{model},position=\"{position}\"}} {}", load(n));
    }
    let name = "vllm:request_success_total";
    let _ = writeln!(
        out,
        "# HELP {name} Finished requests by finish reason.\n# TYPE {name} counter"
    );
    for (reason, n) in [
        ("stop", &m.finished_stop),
        ("length", &m.finished_length),
        ("abort", &m.finished_abort),
    ] {
        let _ = writeln!(
            out,
            "{name}{{{model},finished_reason=\"{reason}\"}} {}",
            load(n)
        );
    }
    for (name, help, h) in [
        (
            "vllm:time_to_first_token_seconds",
            "Time from arrival to first token.",
            &m.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Time between tokens of a request.",
            &m.inter_token,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            &m.e2e,
        ),
    ] {
        labelled_histogram(out, name, help, h, &model);
    }
}

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// The handler.
pub(crate) async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let m = state.engine.metrics();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP corral_requests_total HTTP responses by endpoint and status.\n# TYPE corral_requests_total counter"
    );
    for (endpoint, status, n) in state.requests.snapshot() {
        let _ = writeln!(
            out,
            "corral_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
        );
    }
    scalar(
        &mut out,
        "corral_prompt_tokens_total",
        "counter",
        "Prompt tokens prefilled.",
        load(&m.prompt_tokens),
    );
    scalar(
        &mut out,
        "corral_prompt_tokens_cached_total",
        "counter",
        "Prompt tokens of finished requests taken from the prefix cache.",
        load(&m.cached_prompt_tokens),
    );
    scalar(
        &mut out,
        "corral_prefix_cache_hits_total",
        "counter",
        "Finished requests that took prompt tokens from the prefix cache.",
        load(&m.prefix_cache_hits),
    );
    scalar(
        &mut out,
        "corral_state_checkpoints_taken_total",
        "counter",
        "Recurrent-state checkpoints taken (hybrid models).",
        load(&m.state_checkpoints_taken),
    );
    scalar(
        &mut out,
        "corral_session_pins",
        "gauge",
        "Clients' session ids (X-Session-Id or user) whose cached prefix eviction passes by.",
        load(&m.session_pins),
    );
    scalar(
        &mut out,
        "corral_state_checkpoints_cached",
        "gauge",
        "Recurrent-state checkpoints the prefix cache holds.",
        load(&m.state_checkpoints_cached),
    );
    scalar(
        &mut out,
        "corral_kv_block_copies_total",
        "counter",
        "Cached KV blocks copied into a sequence's own block (a prefix ending inside a block).",
        load(&m.kv_block_copies),
    );
    scalar(
        &mut out,
        "corral_state_restores_total",
        "counter",
        "Sequences that resumed from a recurrent-state checkpoint.",
        load(&m.state_restores),
    );
    scalar(
        &mut out,
        "corral_state_restored_tokens_total",
        "counter",
        "Tokens those sequences did not recompute.",
        load(&m.state_restored_tokens),
    );
    scalar(
        &mut out,
        "corral_session_spills_total",
        "counter",
        "Cached prefixes written to the session folder.",
        load(&m.session_spills),
    );
    scalar(
        &mut out,
        "corral_session_spill_bytes_total",
        "counter",
        "Bytes of those session files.",
        load(&m.session_spill_bytes),
    );
    scalar(
        &mut out,
        "corral_session_spill_writes_total",
        "counter",
        "Those session files whose background write has finished.",
        load(&m.session_spill_writes),
    );
    scalar(
        &mut out,
        "corral_session_restores_total",
        "counter",
        "Sequences that started from a session file.",
        load(&m.session_restores),
    );
    scalar(
        &mut out,
        "corral_session_restored_tokens_total",
        "counter",
        "Tokens read from session files instead of computed.",
        load(&m.session_restored_tokens),
    );
    scalar(
        &mut out,
        "corral_session_restored_bytes_total",
        "counter",
        "KV and state bytes copied from session files into the cache.",
        load(&m.session_restored_bytes),
    );
    let restored = load(&m.session_restored_bytes);
    scalar(
        &mut out,
        "corral_session_spill_bytes_per_restored_byte",
        "gauge",
        "Bytes written to the session folder per byte restored from it (0 before a restore).",
        if restored == 0.0 {
            0.0
        } else {
            load(&m.session_spill_bytes) / restored
        },
    );
    scalar(
        &mut out,
        "corral_buffer_pool_free_bytes",
        "gauge",
        "Bytes of free activation buffers the backend's pool keeps for reuse.",
        load(&m.buffer_pool_free_bytes),
    );
    scalar(
        &mut out,
        "corral_tokenizer_segment_cache_bytes",
        "gauge",
        "Bytes the tokenizer keeps of earlier prompts' segments (bounded at 64 MiB).",
        state.tokenizer.segment_cache_bytes() as f64,
    );
    scalar(
        &mut out,
        "corral_session_dir_bytes",
        "gauge",
        "Bytes in the session folder.",
        load(&m.session_dir_bytes),
    );
    scalar(
        &mut out,
        "corral_session_index_blocks",
        "gauge",
        "KV blocks the session folder's index holds in memory.",
        load(&m.session_index_blocks),
    );
    scalar(
        &mut out,
        "corral_session_restore_failures_total",
        "counter",
        "Session files that could not be restored (deleted; the request recomputed).",
        load(&m.session_restore_failures),
    );
    scalar(
        &mut out,
        "corral_generated_tokens_total",
        "counter",
        "Tokens generated.",
        load(&m.generated_tokens),
    );
    histogram(
        &mut out,
        "corral_time_to_first_token_seconds",
        "Time from arrival to first token.",
        &m.ttft,
    );
    histogram(
        &mut out,
        "corral_inter_token_latency_seconds",
        "Time between tokens of a sequence.",
        &m.inter_token,
    );
    scalar(
        &mut out,
        "corral_queue_depth",
        "gauge",
        "Requests waiting for admission.",
        load(&m.queue_depth),
    );
    scalar(
        &mut out,
        "corral_running_sequences",
        "gauge",
        "Sequences being generated.",
        load(&m.running),
    );
    scalar(
        &mut out,
        "corral_kv_blocks_used",
        "gauge",
        "KV cache blocks held by sequences.",
        load(&m.kv_blocks_used),
    );
    scalar(
        &mut out,
        "corral_kv_blocks_cached",
        "gauge",
        "KV cache blocks kept by the prefix cache.",
        load(&m.kv_blocks_cached),
    );
    scalar(
        &mut out,
        "corral_kv_blocks_total",
        "gauge",
        "KV cache blocks in the pool.",
        load(&m.kv_blocks_total),
    );
    scalar(
        &mut out,
        "corral_state_slots_used",
        "gauge",
        "State slots held by running sequences (one each; the hybrids' recurrent state).",
        load(&m.state_slots_used),
    );
    scalar(
        &mut out,
        "corral_preemptions_total",
        "counter",
        "Sequences preempted for KV blocks.",
        load(&m.preemptions),
    );
    let _ = writeln!(
        out,
        "# HELP corral_decode_step_seconds_total Time of steps that only decoded (drafts \
         verified included), by phase: planning (drafting included), forward, output.\n\
         # TYPE corral_decode_step_seconds_total counter"
    );
    for (phase, micros) in ["plan", "forward", "output"]
        .iter()
        .zip(&m.decode_step_micros)
    {
        let _ = writeln!(
            out,
            "corral_decode_step_seconds_total{{phase=\"{phase}\"}} {}",
            load(micros) / 1e6
        );
    }
    scalar(
        &mut out,
        "corral_decode_steps_total",
        "counter",
        "Steps that only decoded (drafts verified included).",
        load(&m.decode_steps),
    );
    let tokens = load(&m.forward_tokens);
    let per_token = if tokens > 0.0 {
        load(&m.dispatches) / tokens
    } else {
        0.0
    };
    scalar(
        &mut out,
        "corral_dispatches_per_token",
        "gauge",
        "Dispatches per token run through the model, since start.",
        per_token,
    );
    vllm_compatible(&mut out, &state);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label_value(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(label_value("x\ny"), "x\\ny");
    }
}
