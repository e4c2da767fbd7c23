//! The `corral` binary end to end: `logits` matches transformers at every chunk size, `run`
//! reproduces transformers' greedy continuation and chats on the demo model, `inspect`
//! describes a checkpoint, and bad input exits non-zero with a message naming the culprit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const FIXTURES: &[&str] = &[
    "qwen3_moe_fused",
    "qwen3_moe_per_expert",
    "qwen3_moe_sharded",
    "qwen3_dense",
    "qwen3_5_moe_hub",
    "qwen3_5_moe_text",
    "qwen3_5_dense",
    "qwen3_next",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures").join(name)
}

/// A small synthetic Qwen3-MoE for the bench commands.
const TINY_MOE_CONFIG: &str = r#"{"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 16,
    "norm_topk_prob": true}"#;

fn corral(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(args)
        .args(["--threads", "2"])
        .output()
        .expect("run corral")
}

/// The log `corral serve ARGS --port 0` writes (under `RUST_LOG=rust_log`) until it
/// listens or exits; the server is stopped then.
fn serve_log_until_listening(args: &[&str], rust_log: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("serve")
        .args(args)
        .args(["--port", "0", "--threads", "2"])
        .env("RUST_LOG", rust_log)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run corral serve");
    let mut log = String::new();
    let mut reader = std::io::BufReader::new(child.stderr.take().expect("stderr piped"));
    while !log.contains("listening on") {
        let mut line = String::new();
        if std::io::BufRead::read_line(&mut reader, &mut line).unwrap_or(0) == 0 {
            break;
        }
        log.push_str(&line);
    }
    let _ = child.kill();
    let _ = child.wait();
    log
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn read_tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    (t.shape().to_vec(), t.data().to_vec())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn join(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn logits_command_matches_transformers_at_chunk_1_7_and_whole() {
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let reference = fixture(name).join("reference.safetensors");
        let ids = i64s(&read_tensor(&reference, "token_ids").1);
        let (ref_shape, ref_bytes) = read_tensor(&reference, "logits");
        let expected = f32s(&ref_bytes);
        // The f32 KV cache at every chunk size; the default bf16 cache whole, within bf16
        // tolerance (these fixtures' sharp attention makes K and V's rounding show).
        let cases = [
            (Some("1"), "f32", 1e-4),
            (Some("7"), "f32", 1e-4),
            (Some("64"), "f32", 1e-4),
            (None, "f32", 1e-4),
            (None, "bf16", 2e-2),
        ];
        for (chunk, kv, tolerance) in cases {
            let out_path = tmp
                .path()
                .join(format!("{name}-{chunk:?}-{kv}.safetensors"));
            let model = fixture(name);
            let mut args = vec![
                "logits",
                "--model",
                model.to_str().unwrap(),
                "--out",
                out_path.to_str().unwrap(),
                "--kv-dtype",
                kv,
            ];
            let id_list = join(&ids);
            args.extend(["--token-ids", &id_list]);
            if let Some(c) = chunk {
                args.extend(["--chunk", c]);
            }
            let out = corral(&args);
            assert!(out.status.success(), "{name}: {}", stderr(&out));
            let (shape, bytes) = read_tensor(&out_path, "logits");
            assert_eq!(shape, ref_shape);
            let ours = f32s(&bytes);
            let diff: f64 = ours
                .iter()
                .zip(&expected)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum();
            let norm: f64 = expected.iter().map(|b| (*b as f64).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            assert!(
                rel <= tolerance,
                "{name} chunk {chunk:?} {kv} KV: relative error {rel:e}"
            );
        }
    }
}

#[test]
fn run_reproduces_the_greedy_continuation() {
    for name in FIXTURES {
        let reference = fixture(name).join("reference.safetensors");
        let prompt = join(&i64s(&read_tensor(&reference, "greedy_prompt").1));
        let expected = i64s(&read_tensor(&reference, "greedy_continuation").1);
        let model = fixture(name);
        let out = corral(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--token-ids",
            &prompt,
            "--max-tokens",
            "16",
            "--prefill-chunk",
            "3",
        ]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let got: Vec<i64> = String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        assert_eq!(got, expected, "{name}");
    }
}

#[test]
fn run_chats_on_the_demo_model_and_reports_stats() {
    let model = repo().join("models/tiny-qwen3-moe");
    let out = corral(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "8",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--seed",
        "1",
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    for field in [
        "prompt tokens",
        "TTFT",
        "prefill",
        "decode",
        "dispatches",
        "host syncs",
        "allocations",
    ] {
        assert!(err.contains(field), "missing `{field}` in:\n{err}");
    }
    // The chat template wraps the 2-word prompt in ChatML: far more than 2 prompt tokens.
    let prompt_tokens: usize = err
        .lines()
        .find_map(|l| l.strip_prefix("prompt tokens"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(prompt_tokens > 6, "{err}");
}

/// The demo model as a GGUF file (its vocabulary and chat template inside) answers a chat
/// prompt with the same text and prompt length as its checkpoint directory.
#[test]
fn run_on_a_gguf_file_gives_what_its_checkpoint_directory_gives() {
    let run = |model: PathBuf| {
        let out = corral(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--chat",
            "--prompt",
            "Hello there, 12 GGUF files",
            "--max-tokens",
            "12",
            "--temperature",
            "0.7",
            "--seed",
            "3",
        ]);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        let prompt_tokens = err
            .lines()
            .find(|l| l.starts_with("prompt tokens"))
            .unwrap_or_else(|| panic!("no prompt tokens line in:\n{err}"))
            .to_string();
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            prompt_tokens,
        )
    };
    let from_dir = run(repo().join("models/tiny-qwen3-moe"));
    let from_gguf = run(repo().join("tests/fixtures/gguf/tiny-qwen3-moe.gguf"));
    assert!(!from_dir.0.is_empty());
    assert_eq!(from_dir, from_gguf);
}

/// `serve` on a GGUF file reads its header once for the model, the vocabulary and the stop
/// ids.
#[test]
fn serve_reads_a_gguf_header_once() {
    let file = repo().join("tests/fixtures/gguf/tiny-qwen3-moe.gguf");
    let log = serve_log_until_listening(
        &["--model", file.to_str().unwrap()],
        "info,corral_model=debug",
    );
    assert!(log.contains("listening on"), "{log}");
    assert_eq!(log.matches("read a GGUF header").count(), 1, "{log}");
}

/// `plan` reads a GGUF file's config and weight bytes as it reads the checkpoint it came from.
#[test]
fn plan_reads_a_gguf_file_as_its_checkpoint_directory() {
    let plan = |model: PathBuf| {
        let out = Command::new(env!("CARGO_BIN_EXE_corral"))
            .args(["plan", "--memory", "1G", "--context", "2048", "--model"])
            .arg(&model)
            .output()
            .expect("run corral plan");
        assert!(out.status.success(), "{}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines().skip(1).collect::<Vec<_>>().join("\n")
    };
    let from_dir = plan(repo().join("tests/fixtures/qwen3_moe_sharded"));
    assert!(from_dir.contains("KV"), "{from_dir}");
    assert_eq!(
        plan(repo().join("tests/fixtures/gguf/qwen3_moe_sharded.gguf")),
        from_dir
    );
}

/// `plan --speculative` counts an MTP head as `serve` does: its weights (with its copies of
/// the embedding and LM head) and its one layer's KV a token; `auto` does on the CPU and the
/// GPU alike; asking for the head of a model without one fails. A
/// hybrid's speculation also keeps K recurrent states a drafting sequence (none with
/// `:replay`).
#[test]
fn plan_counts_the_mtp_head_that_speculation_loads() {
    let plan = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("plan")
            .args(args)
            .output()
            .expect("run corral plan")
    };
    let needs = |model: &str, speculative: &str, device: &str| {
        let path = fixture(model);
        let out = plan(&[
            "--memory",
            "1G",
            "--context",
            "2048",
            "--json",
            "--device",
            device,
            "--speculative",
            speculative,
            "--model",
            path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let needs = &value["needs"];
        (
            needs["weights"].as_u64().unwrap(),
            needs["kv_per_token"].as_u64().unwrap(),
            needs["workspace"].as_u64().unwrap(),
            needs["state_per_sequence"].as_u64().unwrap(),
        )
    };
    let kept = needs("qwen3_5_moe_mtp", "lookup:4", "cpu");
    let replayed = needs("qwen3_5_moe_mtp", "lookup:4:replay", "cpu");
    let extra = kept.2 - replayed.2;
    assert!(
        extra > 0 && extra % (4 * kept.3) == 0,
        "kept states: {extra} bytes beside {} a state",
        kept.3
    );
    let needs = |model: &str, speculative: &str, device: &str| {
        let n = needs(model, speculative, device);
        (n.0, n.1)
    };
    for model in ["qwen3_5_moe_mtp", "gguf/hybrid/qwen35moe.mtp.q4_k_m.gguf"] {
        let off = needs(model, "off", "cpu");
        let mtp = needs(model, "mtp", "cpu");
        assert!(mtp.0 > off.0 && mtp.1 > off.1, "{model}: {off:?} {mtp:?}");
        assert_eq!(needs(model, "auto", "cpu"), mtp, "{model}");
        assert_eq!(
            needs(model, "auto", "cuda"),
            needs(model, "mtp", "cuda"),
            "{model}"
        );
        assert!(needs(model, "auto", "cuda").0 > needs(model, "off", "cuda").0);
        assert_eq!(needs(model, "lookup", "cpu"), off, "{model}");
    }
    let path = fixture("qwen3_5_moe_text");
    let out = plan(&[
        "--memory",
        "1G",
        "--speculative",
        "mtp",
        "--model",
        path.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("needs the checkpoint's MTP head"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        needs("qwen3_5_moe_text", "auto", "cpu"),
        needs("qwen3_5_moe_text", "off", "cpu")
    );
}

#[test]
fn inspect_describes_the_checkpoint() {
    let model = fixture("qwen3_moe_fused");
    let out = corral(&["inspect", "--model", model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("qwen3_moe"), "{text}");
    assert!(text.contains("parameters           241280"), "{text}");
    assert!(text.contains("8 routed, top-2"), "{text}");
    assert!(text.contains("sparse layers        2 of 3"), "{text}");
}

#[test]
fn inspect_synthetic_counts_qwen3_30b_a3b_parameters_without_making_weights() {
    let config = repo().join("bench/configs/qwen3-30b-a3b.json");
    let out = corral(&["inspect", "--synthetic", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    // The published parameter count of Qwen3-30B-A3B.
    assert!(text.contains("parameters           30532122624"), "{text}");
}

#[test]
fn inspect_counts_hybrid_parameters_without_vision_tower() {
    let config = repo().join("bench/configs/qwen3.5-35b-a3b.json");
    let out = corral(&["inspect", "--synthetic", config.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    // The parameter count of Qwen3.5-35B-A3B's language model (text config, no MTP).
    assert!(text.contains("parameters           34660610688"), "{text}");
    assert!(
        text.contains(
            "KV bytes per token   40960 at f32, 20480 at bf16, 10560 at fp8 (with its head scales)"
        ),
        "{text}"
    );
    assert!(
        text.contains("30 Gated DeltaNet, 10 gated attention"),
        "{text}"
    );
    // The Hub-shaped fixture's vision tower is in the file but not in the count.
    let model = fixture("qwen3_5_moe_hub");
    let out = corral(&["inspect", "--model", model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let from_file = String::from_utf8(out.stdout).unwrap();
    let out = corral(&[
        "inspect",
        "--synthetic",
        model.join("config.json").to_str().unwrap(),
    ]);
    let from_config = String::from_utf8(out.stdout).unwrap();
    let params = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("parameters"))
            .map(str::to_string)
    };
    assert_eq!(
        params(&from_file),
        params(&from_config),
        "{from_file}\n{from_config}"
    );
}

#[test]
fn bad_input_exits_nonzero_naming_the_culprit() {
    let fused = fixture("qwen3_moe_fused");
    let fused = fused.to_str().unwrap();
    let demo = repo().join("models/tiny-qwen3-moe");
    let demo = demo.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["inspect", "--model", "/nonexistent/model"],
            "/nonexistent/model",
        ),
        (
            vec!["run", "--model", fused, "--token-ids", "1,99999"],
            "99999",
        ),
        (
            vec!["run", "--model", fused, "--prompt", "hi"],
            "tokenizer.json",
        ),
        (
            vec!["run", "--model", fused, "--token-ids", "1", "--top-p", "0"],
            "top_p",
        ),
        (
            vec![
                "logits",
                "--model",
                fused,
                "--token-ids",
                "1,2",
                "--out",
                "/tmp/x.safetensors",
                "--chunk",
                "0",
            ],
            "--chunk",
        ),
        (
            vec![
                "logits",
                "--model",
                fused,
                "--token-ids",
                "1,2",
                "--out",
                "/nonexistent/dir/x.safetensors",
            ],
            "/nonexistent/dir/x.safetensors",
        ),
        (
            vec![
                "run",
                "--model",
                fused,
                "--token-ids",
                "1",
                "--device",
                "cpu",
                "--kv-dtype",
                "fp8",
            ],
            "a KV cache of fp8 (f32 or bf16 on the CPU)",
        ),
        (
            vec![
                "serve",
                "--model",
                demo,
                "--default-chat-template-kwargs",
                "[\"enable_thinking\"]",
            ],
            "--default-chat-template-kwargs: expected a JSON object",
        ),
        (
            vec!["serve", "--model", demo, "--output-syntax", "glm"],
            "--output-syntax: unknown output syntax `glm`; known: qwen3-coder, qwen3",
        ),
    ];
    for (args, culprit) in cases {
        let out = corral(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(culprit), "{args:?}: `{culprit}` not in: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A bad flag value is a usage error (exit 2), named.
    let out = corral(&["run", "--model", fused, "--kv-dtype", "fp4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("unknown KV type `fp4` (bf16, fp8 or f32)"));
}

#[test]
fn corrupt_checkpoint_exits_nonzero_without_panic() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("qwen3_moe_fused").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":",
    )
    .unwrap();
    let out = corral(&["inspect", "--model", dir.path().to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_prefill_writes_table_json_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, TINY_MOE_CONFIG).unwrap();
    let json = dir.path().join("bench.json");
    let plot = dir.path().join("bench.svg");
    let out = corral(&[
        "bench",
        "prefill",
        "--synthetic",
        config.to_str().unwrap(),
        "--prompt-lens",
        "3,10,40",
        "--strategies",
        "grouped,per-expert,per-token,auto",
        "--reps",
        "2",
        "--idle-seconds",
        "0",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("fixed ms") && table.contains("marginal tok/s"),
        "{table}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let keys: Vec<&str> = doc
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    for key in ["model", "device", "threads", "rows", "fit"] {
        assert!(doc.get(key).is_some(), "missing {key}");
    }
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 12);
    for row in rows {
        assert_eq!(row.as_object().unwrap().len(), 9, "{row}");
        let strategy = row["strategy"].as_str().unwrap();
        let allocations = row["allocations"].as_u64().unwrap();
        let per_layer = row["dispatches_per_moe_layer"].as_f64().unwrap();
        match strategy {
            "grouped" => {
                assert!(per_layer <= 6.0, "{row}");
                assert_eq!(allocations, 0, "{row}");
            }
            "per-expert" => assert!(allocations > 0 && per_layer > 6.0, "{row}"),
            _ => {}
        }
    }
    assert_eq!(doc["fit"].as_array().unwrap().len(), 4);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 4);
}

/// `--chunk` prefills a prompt in forwards of that many tokens: 40 tokens in chunks of 16
/// take three forwards' dispatches where the whole prompt takes one's (less the output head
/// of the two chunks that want no logits).
#[test]
fn bench_prefill_chunks_a_prompt_into_forwards() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, TINY_MOE_CONFIG).unwrap();
    let dispatches = |chunk: &str| {
        let json = dir.path().join(format!("chunk-{chunk}.json"));
        let out = corral(&[
            "bench",
            "prefill",
            "--synthetic",
            config.to_str().unwrap(),
            "--prompt-lens",
            "40",
            "--strategies",
            "grouped",
            "--reps",
            "1",
            "--idle-seconds",
            "0",
            "--chunk",
            chunk,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        doc["rows"][0]["dispatches"].as_u64().unwrap()
    };
    let (whole, chunked) = (dispatches("0"), dispatches("16"));
    assert!(
        chunked > 2 * whole && chunked < 3 * whole,
        "whole {whole}, chunks of 16 {chunked}"
    );
}

/// `corral bench decode` on the tiny synthetic MoE on the CPU, 2 steps after 1 of warm-up,
/// with `args`: its output, and its JSON report where it wrote one.
fn bench_decode(args: &[&str]) -> (std::process::Output, Option<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, TINY_MOE_CONFIG).unwrap();
    let json = dir.path().join("decode.json");
    let (config, json_path) = (config.to_str().unwrap(), json.to_str().unwrap());
    let mut all = vec!["bench", "decode", "--synthetic", config, "--device", "cpu"];
    all.extend(["--steps", "2", "--warmup", "1", "--json", json_path]);
    all.extend(args);
    let out = corral(&all);
    let doc = std::fs::read_to_string(&json)
        .ok()
        .map(|text| serde_json::from_str(&text).unwrap());
    (out, doc)
}

#[test]
fn bench_decode_writes_table_and_json() {
    let (out, doc) = bench_decode(&[
        "--batch",
        "1,3",
        "--context",
        "5,40",
        "--strategies",
        "per-token,grouped",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("ms/step") && table.contains("replays"),
        "{table}"
    );
    let doc = doc.unwrap();
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2 * 2 * 2);
    for row in rows {
        // One read-back a step, nothing allocated after the first step, no graphs on the CPU.
        assert_eq!(row["host_syncs_per_step"].as_u64(), Some(1), "{row}");
        assert_eq!(row["allocations_per_step"].as_u64(), Some(0), "{row}");
        assert_eq!(row["graph_replays_per_step"].as_u64(), Some(0), "{row}");
        assert!(row["tok_s"].as_f64().unwrap() > 0.0, "{row}");
    }
    let (bad, _) = bench_decode(&["--graphs", "sometimes"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("--graphs"), "{}", stderr(&bad));
}

/// `--draft-tokens` times verify steps (1 + K tokens a sequence, every row read back) beside
/// the one-token step, each against it; every row's logits come back.
#[test]
fn bench_decode_times_verify_steps_against_the_one_token_step() {
    let (out, doc) = bench_decode(&["--batch", "2", "--context", "8", "--draft-tokens", "0,3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = doc.unwrap();
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["draft_tokens"], 0);
    assert_eq!(rows[0]["vs_one_token_step"].as_f64(), Some(1.0));
    assert_eq!(
        (&rows[1]["draft_tokens"], &rows[1]["sampling"]),
        (&3.into(), &"host".into())
    );
    assert!(
        rows[1]["vs_one_token_step"].as_f64().unwrap() > 0.0,
        "{doc}"
    );
    let read_back = |r: &serde_json::Value| r["bytes_transferred_per_step"].as_u64().unwrap();
    assert!(read_back(&rows[1]) > 3 * read_back(&rows[0]), "{doc}");
    let (bad, _) = bench_decode(&["--draft-tokens", "9"]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("at most 7"), "{}", stderr(&bad));
}

/// Contexts past the model's positions are skipped, saying so; a list of none left fails.
#[test]
fn bench_decode_skips_contexts_the_model_cannot_hold() {
    let run = |contexts: &str| bench_decode(&["--batch", "1", "--context", contexts]);
    let (out, doc) = run("5,1000000");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("skipping --context 1000000"),
        "{}",
        stderr(&out)
    );
    let contexts: Vec<u64> = doc.unwrap()["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["context"].as_u64().unwrap())
        .collect();
    assert_eq!(contexts, [5]);
    let (none, _) = run("1000000");
    assert!(!none.status.success());
    assert!(
        stderr(&none).contains("no --context fits"),
        "{}",
        stderr(&none)
    );
}

/// `plan` reads a config alone: Qwen3.5-35B-A3B's 131,072 tokens at C=1 fit 96 GiB (2.5 GiB
/// of bf16 KV: 10 attention layers x 2 x 2 KV heads x 256 x 2 bytes = 20,480 a token), and
/// its weights alone do not fit 8 GiB; contexts past the model's and a GPU without a budget
/// are refused by name.
#[test]
fn plan_says_what_fits_and_by_how_much() {
    let plan = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_corral"))
            .arg("plan")
            .args([
                "--synthetic",
                "bench/configs/qwen3.5-35b-a3b.json",
                "--device",
                "cuda",
            ])
            .args(args)
            .current_dir(repo())
            .output()
            .expect("run corral plan")
    };
    let out = plan(&["--memory", "96G", "--context", "131072", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["needs"]["kv_per_token"], 20480);
    assert_eq!(json["kv"], 20480u64 * 131_072);
    assert_eq!(json["fits"], true);
    assert_eq!(json["max_context"], 262_144);
    let out = plan(&["--memory", "8G", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (json["fits"].clone(), json["weights_fit"].clone()),
        (false.into(), false.into())
    );
    let out = plan(&["--memory", "96G", "--context", "300000"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_position_embeddings"));
    let out = plan(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--memory"));
}

/// `serve` sizes its KV pool from the memory plan: a budget the weights alone overflow is
/// refused at start with the plan printed, and the plan's sizes are logged before listening.
#[test]
fn serve_sizes_its_kv_pool_from_the_memory_plan() {
    let model = repo().join("models/tiny-qwen3-moe");
    let model = model.to_str().unwrap();
    let out = corral(&["serve", "--model", model, "--port", "0", "--memory", "1M"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("do not fit the memory budget") && err.contains("largest    context 0"),
        "{err}"
    );
    let out = corral(&[
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--memory",
        "1M",
        "--kv-memory",
        "1M",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
    // A budget that holds the weights and workspace and a few blocks: the KV pool, not the
    // model's 4,096 positions, limits the context.
    let log = serve_log_until_listening(&["--model", model, "--memory", "9000K"], "info");
    assert!(log.contains("memory budget: given"), "{log}");
    assert!(log.contains(" blocks, 16 state slots"), "{log}");
    assert!(
        log.contains("under 32,768 tokens, set by the KV pool"),
        "{log}"
    );
}

/// Perplexity of `ids[1..]` under the reference logits of `ids` (one row per position).
fn reference_perplexity(logits: &[f32], ids: &[i64], vocab: usize) -> f64 {
    let nll: f64 = logits
        .chunks(vocab)
        .zip(&ids[1..])
        .map(|(row, &t)| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            lse - row[t as usize] as f64
        })
        .sum();
    (nll / (ids.len() - 1) as f64).exp()
}

fn eval_json(args: &[&str]) -> serde_json::Value {
    let out = corral(args);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("eval --json prints one JSON object")
}

/// `corral eval --json` of fixture `name`'s reference tokens with an f32 KV cache and the
/// `extra` arguments, and transformers' perplexity of them.
fn eval_fixture(name: &str, extra: &[&str]) -> (serde_json::Value, f64, usize) {
    let reference = fixture(name).join("reference.safetensors");
    let ids = i64s(&read_tensor(&reference, "token_ids").1);
    let (shape, bytes) = read_tensor(&reference, "logits");
    let expected = reference_perplexity(&f32s(&bytes), &ids, shape[1]);
    let model = fixture(name);
    let list = join(&ids);
    let mut args = vec![
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        &list,
        "--kv-dtype",
        "f32",
        "--json",
    ];
    args.extend_from_slice(extra);
    (eval_json(&args), expected, ids.len())
}

/// `--mtp N` scores the checkpoint's MTP head at depths 1..N beside the perplexity; a model
/// without one is refused by name. (The head's logits are tested against its trainer in
/// corral-model's `mtp` tests.)
#[test]
fn eval_scores_the_mtp_head_at_each_depth() {
    let (result, expected, _) = eval_fixture("qwen3_5_moe_mtp", &["--mtp", "3"]);
    let ppl = result["perplexity"].as_f64().unwrap();
    assert!(
        ((ppl - expected) / expected).abs() < 1e-4,
        "{ppl} against {expected}"
    );
    let depths = result["mtp_top1"].as_array().expect("mtp_top1");
    assert_eq!(depths.len(), 3);
    assert!(
        depths
            .iter()
            .all(|d| d.as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)))
    );
    // A GGUF file converted with its head.
    let gguf = fixture("gguf/hybrid/qwen35moe.mtp.q4_k_m.gguf");
    let out = corral(&[
        "eval",
        "--model",
        gguf.to_str().unwrap(),
        "--token-ids",
        "5,42,7,99,13,200,31,8,77,150",
        "--mtp",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(result["mtp_top1"].as_array().map(Vec::len), Some(2));
    let other = fixture("qwen3_5_moe_text");
    let out = corral(&[
        "eval",
        "--model",
        other.to_str().unwrap(),
        "--token-ids",
        "1,2,3",
        "--mtp",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no MTP head"), "{}", stderr(&out));
}

#[test]
fn eval_perplexity_matches_transformers_and_compares_configurations() {
    for name in ["qwen3_5_moe_text", "qwen3_next", "qwen3_moe_fused"] {
        let (result, expected, tokens) = eval_fixture(name, &[]);
        let ppl = result["perplexity"].as_f64().unwrap();
        assert_eq!(result["tokens"].as_u64(), Some(tokens as u64 - 1));
        assert!(
            ((ppl - expected) / expected).abs() < 1e-4,
            "{name}: perplexity {ppl} against transformers' {expected}"
        );
        // The same configuration against itself: identical distributions.
        let (result, ..) = eval_fixture(name, &["--against", "moe-strategy=auto"]);
        assert_eq!(result["against"]["kl_mean"].as_f64(), Some(0.0), "{name}");
        assert_eq!(result["against"]["top1_agreement"].as_f64(), Some(1.0));
        // A bf16 KV cache moves the distributions a little, not the scoring.
        let (result, ..) = eval_fixture(name, &["--against", "kv-dtype=bf16"]);
        let kl = result["against"]["kl_mean"].as_f64().unwrap();
        assert!(kl > 0.0 && kl < 0.05, "{name}: KL {kl}");
        // Windows shorter than the sequence restart the context, and still score every token.
        let (result, ..) = eval_fixture(name, &["--window", "7"]);
        assert_eq!(result["tokens"].as_u64(), Some(tokens as u64 - 1));
        assert_ne!(result["perplexity"].as_f64(), Some(ppl));
    }
    let model = fixture("qwen3_5_moe_text");
    let out = corral(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        "1,2,3",
        "--against",
        "colour=blue",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("unknown key `colour`"),
        "{}",
        stderr(&out)
    );
    let out = corral(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--token-ids",
        "1",
    ]);
    assert!(
        stderr(&out).contains("fewer than two tokens"),
        "{}",
        stderr(&out)
    );
}

/// `--speculative`: the MTP head, prompt lookup and none give the same greedy tokens; asking
/// for a head a checkpoint lacks, or for a drafter that does not exist, says what is wrong.
#[test]
fn run_speculates_without_changing_the_greedy_tokens() {
    let model = fixture("qwen3_5_moe_mtp");
    let prompt = "5,9,200,31,5,9,200,31,5,9";
    let run = |speculative: &str| {
        let out = corral(&[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--token-ids",
            prompt,
            "--max-tokens",
            "24",
            "--speculative",
            speculative,
        ]);
        assert!(out.status.success(), "{speculative}: {}", stderr(&out));
        let log = stderr(&out);
        (String::from_utf8(out.stdout).unwrap(), log)
    };
    let (plain, log) = run("off");
    assert!(!log.contains("speculation"), "{log}");
    for speculative in ["mtp:1", "mtp:3", "lookup:2", "auto", "mtp+lookup:2"] {
        let (tokens, log) = run(speculative);
        assert_eq!(tokens, plain, "{speculative}");
        assert!(log.contains("speculation"), "{speculative}: {log}");
    }
    let out = corral(&[
        "run",
        "--model",
        fixture("qwen3_5_moe_text").to_str().unwrap(),
        "--token-ids",
        "1,2,3",
        "--speculative",
        "mtp",
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("MTP head"), "{}", stderr(&out));
    let out = corral(&[
        "run",
        "--synthetic",
        "x.json",
        "--token-ids",
        "1",
        "--speculative",
        "eagle",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not off, auto"),
        "{}",
        stderr(&out)
    );
}

/// `corral bench speculative` on a GGUF file with its MTP head: each variant's row, drafts
/// made by the head, and every variant's tokens those of plain decoding (in the JSON too).
#[test]
fn bench_speculative_compares_variants_with_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(30),
    )
    .unwrap();
    let json = dir.path().join("spec.json");
    let model = fixture("gguf/hybrid/qwen35moe.mtp.q4_k_m.gguf");
    let out = corral(&[
        "bench",
        "speculative",
        "--model",
        model.to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--prompts",
        "2",
        "--prompt-tokens",
        "24",
        "--max-tokens",
        "10",
        "--echo",
        "8",
        "--speculative",
        "off,mtp:2,lookup:3",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    for variant in ["off", "mtp:2", "lookup:3"] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(variant) && l.contains(" yes ")),
            "{table}"
        );
    }
    let value: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let variants = value["variants"].as_array().unwrap();
    assert_eq!(variants.len(), 3);
    assert!(
        variants.iter().all(|v| v["same_tokens_as_off"] == true),
        "{value}"
    );
    assert!(variants[1]["drafted"].as_u64().unwrap() > 0, "{value}");
}

/// A synthetic hybrid drafts with a random MTP head of its shape on random prompts, and
/// `--forced-acceptance 1` takes every draft token: each step of fixed K yields 1 + K tokens,
/// one sequence at a time or two at once. The table says the acceptance was forced and claims
/// no equality with plain decoding.
#[test]
fn bench_speculative_forces_acceptance_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("spec.json");
    let config = fixture("qwen3_5_moe_text").join("config.json");
    let out = corral(&[
        "bench",
        "speculative",
        "--synthetic",
        config.to_str().unwrap(),
        "--prompts",
        "2",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "13",
        "--speculative",
        "off,mtp:2:fixed",
        "--forced-acceptance",
        "1",
        "--concurrency",
        "1,2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with("FORCED ACCEPTANCE 1"), "{table}");
    assert!(table.contains("  2 at once"), "{table}");
    let value: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let variants = value["variants"].as_array().unwrap();
    assert_eq!(variants.len(), 4, "{value}");
    for (mtp, concurrency) in [(&variants[1], 1), (&variants[3], 2)] {
        assert_eq!(mtp["variant"], "mtp:2:fixed");
        assert_eq!(mtp["concurrency"], concurrency);
        assert_eq!(mtp["drafted"].as_u64(), Some(2 * 8), "{value}");
        assert_eq!(mtp["accepted"], mtp["drafted"], "{value}");
        // 12 tokens after the prompt's: four steps of three (fixed lengths: adaptive ones
        // may probe shorter drafts).
        assert_eq!(mtp["tokens_per_step"].as_f64(), Some(3.0), "{value}");
        assert!(mtp["same_tokens_as_off"].is_null(), "{value}");
    }
    // Two at once share the engine's decode steps.
    let steps = |v: &serde_json::Value| v["engine_decode_steps"].as_u64().unwrap();
    assert!(steps(&variants[3]) < steps(&variants[1]), "{value}");
    let bad = corral(&[
        "bench",
        "speculative",
        "--synthetic",
        config.to_str().unwrap(),
        "--forced-acceptance",
        "1.5",
    ]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("probability"), "{}", stderr(&bad));
}

/// An MTP head drafting beside the model counts in serve's memory: its one layer's KV for
/// every token the model's cache holds (fewer blocks in the same KV bytes) and its weights.
#[test]
fn serve_counts_the_mtp_heads_memory() {
    let model = fixture("gguf/hybrid/qwen35moe.mtp.q4_k_m.gguf");
    let model = model.to_str().unwrap();
    let number_before = |log: &str, marker: &str| -> u64 {
        let at = log
            .find(marker)
            .unwrap_or_else(|| panic!("{marker}: {log}"));
        log[..at]
            .rsplit(|c: char| !c.is_ascii_digit())
            .find(|w| !w.is_empty())
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("{marker}: {log}"))
    };
    let number_after = |log: &str, marker: &str| -> u64 {
        let at = log
            .find(marker)
            .unwrap_or_else(|| panic!("{marker}: {log}"))
            + marker.len();
        log[at..]
            .split(|c: char| !c.is_ascii_digit())
            .find(|w| !w.is_empty())
            .and_then(|w| w.parse().ok())
            .unwrap_or_else(|| panic!("{marker}: {log}"))
    };
    let serve = |speculative: &str, memory: &[&str]| {
        let mut args = vec!["--model", model, "--speculative", speculative];
        args.extend_from_slice(memory);
        // The log's fields without their colours.
        let log = serve_log_until_listening(&args, "info");
        let mut plain = String::new();
        let mut rest = log.as_str();
        while let Some(at) = rest.find('\u{1b}') {
            plain.push_str(&rest[..at]);
            rest = rest[at..].split_once('m').map_or("", |(_, after)| after);
        }
        plain + rest
    };
    let (off, mtp) = (
        serve("off", &["--kv-memory", "256K"]),
        serve("mtp", &["--kv-memory", "256K"]),
    );
    assert!(mtp.contains("speculative decoding: MTP head"), "{mtp}");
    let (blocks_off, blocks_mtp) = (
        number_before(&off, " blocks,"),
        number_before(&mtp, " blocks,"),
    );
    assert!(
        blocks_mtp < blocks_off,
        "{blocks_mtp} blocks with the head, {blocks_off} without"
    );
    let (off, mtp) = (
        serve("off", &["--memory", "64M"]),
        serve("mtp", &["--memory", "64M"]),
    );
    let (weights_off, weights_mtp) = (
        number_after(&off, "weights="),
        number_after(&mtp, "weights="),
    );
    assert!(
        weights_mtp > weights_off,
        "{weights_mtp} bytes of weights with the head, {weights_off} without"
    );
}
