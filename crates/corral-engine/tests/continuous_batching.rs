//! The engine thread batches requests continuously without changing what each one generates:
//! concurrent greedy requests equal the same requests run alone, also when a tiny KV cache
//! forces preemption by recompute; a dropped receiver frees its blocks.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use corral_cpu::CpuBackend;
use corral_engine::{
    CombinedDrafter, Drafter, EngineConfig, EngineHandle, EngineRequest, Event, FinishReason,
    Finished, LookupDrafter, ModelDrafter, MtpDrafter, SamplingParams, Speculation, spawn_engine,
    spawn_engine_drafting,
};
use corral_model::Model;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

fn model() -> Model {
    model_named("qwen3_moe_fused")
}

fn model_named(name: &str) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    Model::load(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| {
            (0..(5 + 7 * i))
                .map(|j| (i * 31 + j * 17 + 3) % 250)
                .collect()
        })
        .collect()
}

/// What `prompt` generates with nothing else running: an engine of one sequence that
/// prefills it in one forward.
fn alone(name: &str, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let single = EngineConfig {
        max_batch: 1,
        max_prefill_tokens: 4096,
        max_queue: 1,
        kv_blocks: 256,
        block_size: 16,
        max_context: 4096,
        prefix_cache: false,
        state_checkpoints: 0,
        ..EngineConfig::default()
    };
    let (engine, thread) = spawn_engine(model_named(name), single).unwrap();
    let mut rx = submit(&engine, prompt, max_tokens);
    let (tokens, _) = collect(&mut rx);
    engine.shutdown();
    thread.join().unwrap();
    tokens
}

fn submit(engine: &EngineHandle, prompt: &[u32], max_tokens: usize) -> UnboundedReceiver<Event> {
    submit_in(engine, prompt, max_tokens, None)
}

fn submit_in(
    engine: &EngineHandle,
    prompt: &[u32],
    max_tokens: usize,
    session: Option<&str>,
) -> UnboundedReceiver<Event> {
    let (tx, rx) = unbounded_channel();
    engine
        .submit(EngineRequest {
            prompt: prompt.to_vec(),
            params: SamplingParams::default(),
            max_tokens,
            max_context: 4096,
            stop_token_ids: Vec::new(),
            top_logprobs: None,
            events: tx,
            session: session.map(str::to_string),
            constraint: None,
        })
        .unwrap();
    rx
}

/// The generated tokens and the request's final event.
fn collect(rx: &mut UnboundedReceiver<Event>) -> (Vec<u32>, Finished) {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("engine ended the stream") {
            Event::Tokens(t) => tokens.extend(t.iter().map(|t| t.id)),
            Event::Finished(f) => return (tokens, f),
            Event::Failed(e) => panic!("{e}"),
        }
    }
}

fn config(kv_blocks: usize) -> EngineConfig {
    EngineConfig {
        max_batch: 4,
        max_prefill_tokens: 16,
        max_queue: 64,
        kv_blocks,
        block_size: 4,
        max_context: 4096,
        prefix_cache: false,
        state_checkpoints: 16,
        ..EngineConfig::default()
    }
}

/// Waits until every KV block and state slot is back (the gauges say so).
fn wait_for_zero_blocks(engine: &EngineHandle) {
    let start = Instant::now();
    let m = engine.metrics();
    while m.kv_blocks_used.load(Ordering::Relaxed) != 0
        || m.state_slots_used.load(Ordering::Relaxed) != 0
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "blocks or slots never returned"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_requests_match_each_alone() {
    for name in ["qwen3_moe_fused", "qwen3_next", "qwen3_5_moe_hub"] {
        concurrent_requests_match_each_alone_for(name);
    }
}

fn concurrent_requests_match_each_alone_for(name: &str) {
    let expected: Vec<Vec<u32>> = prompts().iter().map(|p| alone(name, p, 12)).collect();
    for kv_blocks in [256, 14] {
        let (engine, thread) = spawn_engine(model_named(name), config(kv_blocks)).unwrap();
        let mut receivers: Vec<_> = prompts().iter().map(|p| submit(&engine, p, 12)).collect();
        for (i, rx) in receivers.iter_mut().enumerate() {
            let (tokens, Finished { reason, .. }) = collect(rx);
            assert_eq!(
                tokens, expected[i],
                "{name}: request {i} with {kv_blocks} blocks"
            );
            assert_eq!(reason, FinishReason::Length);
        }
        if kv_blocks == 14 {
            assert!(
                engine.metrics().preemptions.load(Ordering::Relaxed) > 0,
                "expected preemption"
            );
        }
        wait_for_zero_blocks(&engine);
        engine.shutdown();
        thread.join().unwrap();
    }
}

#[test]
fn dropped_receiver_cancels_and_frees_blocks() {
    let (engine, thread) = spawn_engine(model(), config(256)).unwrap();
    let mut rx = submit(&engine, &prompts()[3], 100_000);
    // Wait for the first tokens, then hang up mid-generation.
    for _ in 0..3 {
        assert!(matches!(rx.blocking_recv(), Some(Event::Tokens(_))));
    }
    assert!(engine.metrics().kv_blocks_used.load(Ordering::Relaxed) > 0);
    assert_eq!(engine.metrics().state_slots_used.load(Ordering::Relaxed), 1);
    drop(rx);
    wait_for_zero_blocks(&engine);
    // The engine keeps serving.
    let mut rx = submit(&engine, &prompts()[0], 4);
    assert_eq!(collect(&mut rx).0.len(), 4);
    engine.shutdown();
    thread.join().unwrap();
}

/// Turns that re-send an earlier prompt (plus more) start from its cached blocks and still
/// generate what they generate alone; with a pool too small for everything, cached blocks are
/// evicted rather than wrong. A hybrid starts only where a state checkpoint exists too: at
/// an earlier prompt's end, a branch point, or a turn's last computed token.
#[test]
fn prefix_cache_hits_generate_what_uncached_runs_do() {
    let base: Vec<u32> = (0..40).map(|j| (j * 37 + 11) % 250).collect();
    let longer: Vec<u32> = base
        .iter()
        .copied()
        .chain([7, 8, 9, 10, 11, 12, 13, 14, 15])
        .collect();
    let branch: Vec<u32> = base[..22]
        .iter()
        .copied()
        .chain([200, 201, 202, 203])
        .collect();
    let other: Vec<u32> = (0..30).map(|j| (j * 13 + 5) % 250).collect();
    for name in ["qwen3_moe_fused", "qwen3_next"] {
        // An agent's next turn: the history, the reply it got, and more.
        let reply = alone(name, &base, 12);
        let resumed: Vec<u32> = base
            .iter()
            .chain(&reply)
            .copied()
            .chain([50, 51, 52])
            .collect();
        let turns = [&base, &longer, &branch, &other, &longer, &base, &resumed];
        let expected: Vec<Vec<u32>> = turns.iter().map(|p| alone(name, p, 12)).collect();
        for kv_blocks in [256, 30] {
            let config = EngineConfig {
                prefix_cache: true,
                ..config(kv_blocks)
            };
            let (engine, thread) = spawn_engine(model_named(name), config).unwrap();
            let mut cached = Vec::new();
            for (i, prompt) in turns.iter().enumerate() {
                let (tokens, done) = collect(&mut submit(&engine, prompt, 12));
                assert_eq!(
                    tokens, expected[i],
                    "{name}: turn {i} with {kv_blocks} blocks"
                );
                cached.push(done.cached_tokens);
            }
            wait_for_zero_blocks(&engine);
            let restores = engine.metrics().state_restores.load(Ordering::Relaxed);
            engine.shutdown();
            thread.join().unwrap();
            if name == "qwen3_next" && kv_blocks == 256 {
                // Each prompt leaves a checkpoint one token short of its end (a turn always
                // computes its last token): the longer turn resumes at the base's (39); the
                // branch finds no checkpoint inside its 22 shared tokens (and leaves one
                // there, a tail inside a block); the longer turn again, and the base again,
                // each at its own (48, 39): an identical re-send computes one token; and the
                // resumed turn at the base turn's last computed token (40 + 11 reply tokens).
                assert_eq!(cached, [0, 39, 0, 0, 48, 39, 51], "{name}");
                assert_eq!(restores, 4, "{name}: one restore per resumed turn");
            } else if kv_blocks == 256 {
                // Down to a token (blocks of 4, a partly matching one copied): the branch
                // shares 22 tokens of the base; a turn never takes its last token from the
                // cache (the base again: 39); the resumed turn finds the base and the 11
                // computed reply tokens (the reply's last token was sampled, never computed).
                assert_eq!(cached, [0, 40, 22, 0, 48, 39, 51], "{name}");
            } else {
                // A pool too small for everything: still hits, and for the hybrid restores.
                assert!(
                    cached.iter().any(|&c| c > 0) && (name != "qwen3_next" || restores > 0),
                    "{name}: {cached:?}, {restores} restores"
                );
            }
        }
    }
}

/// State poisoning: interleaved agent sessions of a hybrid model, several running at once,
/// each turn re-sending its history with the reply and more (one session branching from an
/// earlier turn), with a KV pool and a checkpoint pool too small for everything (eviction,
/// stolen checkpoints, preemption): every turn generates what it generates from scratch.
#[test]
fn interleaved_hybrid_sessions_resume_exactly_under_eviction_and_preemption() {
    let name = "qwen3_next";
    let sessions: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            // A shared system prompt, then the session's own task.
            (0..24)
                .map(|j| (j * 29 + 7) % 250)
                .chain((0..9).map(|j| (s * 71 + j * 13 + 1) % 250))
                .collect()
        })
        .collect();
    // Rounds of turns: each session's next prompt is its history, its reply and new tokens;
    // session 2 branches in round 2 from its round-0 prompt.
    let mut expected_rounds: Vec<Vec<(Vec<u32>, Vec<u32>)>> = Vec::new();
    let mut histories = sessions.clone();
    for round in 0..3u32 {
        let mut turns = Vec::new();
        for (s, history) in histories.iter_mut().enumerate() {
            let prompt = if round == 2 && s == 2 {
                expected_rounds[0][2]
                    .0
                    .iter()
                    .copied()
                    .chain([240, 241])
                    .collect()
            } else {
                history.clone()
            };
            let reply = alone(name, &prompt, 6);
            *history = prompt
                .iter()
                .chain(&reply)
                .copied()
                .chain([100 + round, 110 + s as u32])
                .collect();
            turns.push((prompt, reply));
        }
        expected_rounds.push(turns);
    }
    for (kv_blocks, checkpoints) in [(256, 16), (20, 3)] {
        let config = EngineConfig {
            prefix_cache: true,
            state_checkpoints: checkpoints,
            ..config(kv_blocks)
        };
        let (engine, thread) = spawn_engine(model_named(name), config).unwrap();
        let mut cached = 0;
        for (round, turns) in expected_rounds.iter().enumerate() {
            let mut receivers: Vec<_> = turns.iter().map(|(p, _)| submit(&engine, p, 6)).collect();
            for (s, rx) in receivers.iter_mut().enumerate() {
                let (tokens, done) = collect(rx);
                assert_eq!(
                    tokens, turns[s].1,
                    "round {round} session {s}, {kv_blocks} blocks, {checkpoints} checkpoints"
                );
                cached += done.cached_tokens;
            }
        }
        let metrics = engine.metrics();
        let restores = metrics.state_restores.load(Ordering::Relaxed);
        assert!(
            cached > 0 && restores > 0,
            "{kv_blocks} blocks: nothing resumed"
        );
        // Resumed inside a block too: a cached block's first tokens copied into a turn's own
        // (where the pools leave room to keep them).
        assert!(
            kv_blocks == 20 || metrics.kv_block_copies.load(Ordering::Relaxed) > 0,
            "{kv_blocks} blocks: no partly matching block was copied"
        );
        if kv_blocks == 20 {
            assert!(
                metrics.preemptions.load(Ordering::Relaxed) > 0,
                "expected preemption"
            );
        }
        wait_for_zero_blocks(&engine);
        engine.shutdown();
        thread.join().unwrap();
    }
}

/// A turn that resumed from a session file: what a from-scratch run generates, at least
/// `history` tokens cached, and a restore counted.
fn assert_resumed_from_disk(
    engine: &EngineHandle,
    (tokens, done): (Vec<u32>, Finished),
    expected: &[u32],
    history: usize,
    what: &str,
) {
    assert_eq!(tokens, expected, "{what}: resumed from disk");
    assert!(
        done.cached_tokens >= history,
        "{what}: {} cached",
        done.cached_tokens
    );
    assert!(
        engine.metrics().session_restores.load(Ordering::Relaxed) > 0,
        "{what}: no restore"
    );
}

/// A history of 40 tokens, three other prompts of 40 that need its blocks in a cache of 16
/// blocks of 4 tokens, and the turn after the history: it, its greedy reply of 6, and 3 more.
struct Turns {
    history: Vec<u32>,
    reply: Vec<u32>,
    others: Vec<Vec<u32>>,
    next: Vec<u32>,
}

fn evicting_turns(name: &str) -> Turns {
    let history: Vec<u32> = (0..40).map(|j| (j * 37 + 11) % 250).collect();
    let others = (0..3u32)
        .map(|i| (0..40).map(|j| (i * 97 + j * 13 + 5) % 250).collect())
        .collect();
    let reply = alone(name, &history, 6);
    let next = history
        .iter()
        .chain(&reply)
        .copied()
        .chain([60, 61, 62])
        .collect();
    Turns {
        history,
        reply,
        others,
        next,
    }
}

/// Sessions on disk: a history the cache had to evict (one a turn went on from: what requests
/// came back to) is written to the session folder and read back by the turn that extends it, in the same engine and after a restart; a corrupt
/// file is deleted and the turn recomputes. Every turn generates what it does from scratch.
#[test]
fn spilled_sessions_come_back_from_disk_and_corrupt_files_are_recomputed() {
    for name in ["qwen3_moe_fused", "qwen3_next"] {
        let dir =
            std::env::temp_dir().join(format!("corral-sessions-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let Turns {
            history,
            reply,
            others,
            next,
        } = evicting_turns(name);
        let expected = alone(name, &next, 6);
        let config = EngineConfig {
            prefix_cache: true,
            session_dir: Some(dir.clone()),
            session_dir_bytes: 1 << 30,
            ..config(16)
        };
        let run = |corrupt: bool| {
            if corrupt {
                for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                    let mut bytes = std::fs::read(entry.path()).unwrap();
                    let at = bytes.len() / 2;
                    bytes[at] ^= 0x40;
                    std::fs::write(entry.path(), bytes).unwrap();
                }
            }
            let (engine, thread) = spawn_engine(model_named(name), config.clone()).unwrap();
            let (tokens, done) = collect(&mut submit(&engine, &next, 6));
            let m = engine.metrics();
            let counts = (
                m.session_restores.load(Ordering::Relaxed),
                m.session_restore_failures.load(Ordering::Relaxed),
            );
            engine.shutdown();
            thread.join().unwrap();
            (tokens, done.cached_tokens, counts)
        };
        // The history, and a turn that extends it (what is written on eviction is what
        // requests came back to), then other prompts that need its blocks (16 blocks of 4
        // tokens).
        let (engine, thread) = spawn_engine(model_named(name), config.clone()).unwrap();
        assert_eq!(
            collect(&mut submit(&engine, &history, 6)).0,
            reply,
            "{name}"
        );
        let goes_on: Vec<u32> = history.iter().copied().chain([7]).collect();
        collect(&mut submit(&engine, &goes_on, 6));
        for other in &others {
            collect(&mut submit(&engine, other, 6));
        }
        let spills = engine.metrics().session_spills.load(Ordering::Relaxed);
        assert!(spills > 0, "{name}: nothing was spilled");
        let turn = collect(&mut submit(&engine, &next, 6));
        assert_resumed_from_disk(&engine, turn, &expected, 40, name);
        engine.shutdown();
        thread.join().unwrap();
        // A new engine on the same folder: the session survives the restart.
        let (tokens, cached, (restores, failures)) = run(false);
        assert_eq!(tokens, expected, "{name}: after a restart");
        assert!(
            cached >= 40 && restores > 0 && failures == 0,
            "{name}: {cached} {restores}"
        );
        // Corrupt files: detected, deleted, recomputed.
        let (tokens, cached, (restores, failures)) = run(true);
        assert_eq!(tokens, expected, "{name}: from corrupt files");
        assert!(
            failures > 0 && restores == 0 && cached == 0,
            "{name}: {cached} {failures}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Two sessions sharing a system prompt share its blocks on disk: the second session's spill
/// writes its own blocks only, and its next turn is restored from both files (every byte
/// restored counted), generating what it does from scratch. Qwen3-MoE and a hybrid (whose
/// second file also carries the state at its end).
#[test]
fn sessions_sharing_a_prompt_share_its_blocks_on_disk() {
    for name in ["qwen3_moe_fused", "qwen3_next"] {
        let folder = tempfile::Builder::new()
            .prefix(&format!("corral-shared-{name}-"))
            .tempdir()
            .unwrap();
        let system: Vec<u32> = (0..32).map(|j| (j * 37 + 11) % 250).collect();
        let session = |k: u32| -> Vec<u32> {
            system
                .iter()
                .copied()
                .chain((0..8).map(|j| (k * 53 + j * 17 + 3) % 250))
                .collect()
        };
        let (a, b) = (session(1), session(2));
        let fillers: Vec<Vec<u32>> = (0..2u32)
            .map(|i| (0..44).map(|j| (i * 97 + j * 13 + 5) % 250).collect())
            .collect();
        let reply = alone(name, &b, 4);
        let next: Vec<u32> = b.iter().chain(&reply).copied().chain([60, 61]).collect();
        let expected = alone(name, &next, 4);
        let config = EngineConfig {
            prefix_cache: true,
            session_dir: Some(folder.path().join("sessions")),
            session_dir_bytes: 1 << 30,
            ..config(16)
        };
        let (engine, thread) = spawn_engine(model_named(name), config).unwrap();
        let m = engine.metrics();
        let written = || m.session_spill_bytes.load(Ordering::Relaxed);
        // a, and a turn that extends it (a conversation that goes on), then a filler that
        // evicts it (a written whole); b (Qwen3-MoE restores the system prompt from a's
        // file; a hybrid has no state there) and a turn that extends it evict the filler
        // (no request came back to it: its opening written, or for a hybrid nothing); a
        // second filler evicts b.
        let a_goes_on: Vec<u32> = a.iter().copied().chain([7]).collect();
        collect(&mut submit(&engine, &a, 4));
        collect(&mut submit(&engine, &a_goes_on, 4));
        collect(&mut submit(&engine, &fillers[0], 4));
        let first = written();
        assert!(first > 0, "{name}: the first session was not spilled");
        collect(&mut submit(&engine, &b, 4));
        let b_goes_on: Vec<u32> = b.iter().copied().chain([7]).collect();
        collect(&mut submit(&engine, &b_goes_on, 4));
        let before_b = written();
        assert!(
            (before_b - first) * 3 < first,
            "{name}: a prompt nobody came back to was written on eviction past its opening: \
             {} bytes, a's {first}",
            before_b - first
        );
        collect(&mut submit(&engine, &fillers[1], 4));
        let second = written() - before_b;
        assert!(
            second > 0 && second < first,
            "{name}: the second session wrote {second} bytes, the first {first}: the \
             shared blocks again"
        );
        let turn = collect(&mut submit(&engine, &next, 4));
        assert_resumed_from_disk(&engine, turn, &expected, 40, name);
        assert!(
            m.session_restored_bytes.load(Ordering::Relaxed) > 0,
            "{name}: restored bytes counted"
        );
        engine.shutdown();
        thread.join().unwrap();
    }
}

/// An idle engine writes its cached history to the session folder after a pause (no
/// eviction asked for it); the eviction that later needs its blocks finds the files there and
/// writes nothing more for it (as many files in all as without the pause), and the turn that
/// extends the history restores it from disk.
#[test]
fn an_idle_engine_writes_its_cached_histories_ahead() {
    for name in ["qwen3_moe_fused", "qwen3_next"] {
        let history: Vec<u32> = (0..40).map(|j| (j * 37 + 11) % 250).collect();
        let filler: Vec<u32> = (0..44).map(|j| (j * 13 + 5) % 250).collect();
        let reply = alone(name, &history, 6);
        let next: Vec<u32> = history
            .iter()
            .chain(&reply)
            .copied()
            .chain([60, 61])
            .collect();
        let expected = alone(name, &next, 6);
        let mut totals = Vec::new();
        for pause in [false, true] {
            let folder = tempfile::Builder::new()
                .prefix(&format!("corral-ahead-{name}-{pause}-"))
                .tempdir()
                .unwrap();
            let dir = folder.path().join("sessions");
            let config = EngineConfig {
                prefix_cache: true,
                session_dir: Some(dir.clone()),
                session_dir_bytes: 1 << 30,
                ..config(16)
            };
            let (engine, thread) = spawn_engine(model_named(name), config).unwrap();
            let spills = || engine.metrics().session_spills.load(Ordering::Relaxed);
            collect(&mut submit(&engine, &history, 6));
            if pause {
                let waited = std::time::Instant::now();
                while spills() == 0 && waited.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert!(spills() > 0, "{name}: the idle engine wrote nothing");
                std::thread::sleep(Duration::from_millis(300));
            }
            // A filler that needs the history's blocks, the next turn queued behind it (its
            // admission evicts the filler in turn).
            let mut first = submit(&engine, &filler, 6);
            let mut second = submit(&engine, &next, 6);
            collect(&mut first);
            let turn = collect(&mut second);
            assert_resumed_from_disk(
                &engine,
                turn,
                &expected,
                40,
                &format!("{name}, pause {pause}"),
            );
            totals.push(spills());
            engine.shutdown();
            thread.join().unwrap();
        }
        assert_eq!(
            totals[1], totals[0],
            "{name}: files written with the pause against without (the eviction wrote the \
             history again)"
        );
    }
}

/// Session pins: a turn sent with a session id keeps its prefix through the eviction that
/// other requests cause, where the same turn without one loses it; and pins give way when
/// nothing else is left to evict (a request larger than the unpinned room still runs).
#[test]
fn a_session_id_keeps_its_prefix_through_eviction() {
    let history: Vec<u32> = (0..40).map(|j| (j * 37 + 11) % 250).collect();
    let next: Vec<u32> = history.iter().copied().chain([5, 6, 7]).collect();
    let fillers: Vec<Vec<u32>> = (0..4u32)
        .map(|f| (0..40).map(|j| (j * 13 + 17 * f + 3) % 250).collect())
        .collect();
    let expected = alone("qwen3_moe_fused", &next, 4);
    let mut cached = Vec::new();
    for session in [None, Some("agent-1")] {
        let config = EngineConfig {
            prefix_cache: true,
            session_pin: Duration::from_secs(600),
            ..config(40)
        };
        let (engine, thread) = spawn_engine(model_named("qwen3_moe_fused"), config).unwrap();
        collect(&mut submit_in(&engine, &history, 4, session));
        // Other requests, one at a time, need most of the 40 blocks: the cache evicts.
        for filler in &fillers {
            collect(&mut submit(&engine, filler, 4));
        }
        let pins = engine.metrics().session_pins.load(Ordering::Relaxed);
        let (tokens, done) = collect(&mut submit_in(&engine, &next, 4, session));
        assert_eq!(tokens, expected, "{session:?}");
        cached.push((done.cached_tokens, pins));
        // A prompt of nearly the whole pool runs, pinned prefix or not.
        let long: Vec<u32> = (0..150).map(|j| (j * 7 + 1) % 250).collect();
        assert_eq!(collect(&mut submit(&engine, &long, 4)).0.len(), 4);
        wait_for_zero_blocks(&engine);
        engine.shutdown();
        thread.join().unwrap();
    }
    assert_eq!(
        cached[0],
        (0, 0),
        "without a session id the history is evicted"
    );
    assert_eq!(cached[1], (40, 1), "pinned, all of the history");
}

/// A stand-in drafter: it knows each prompt's greedy reply and proposes its next tokens,
/// every third one wrong, so that verify steps accept some tokens and reject others.
struct KnowingDrafter {
    replies: Vec<(Vec<u32>, Vec<u32>)>,
}

impl Drafter for KnowingDrafter {
    fn propose(&mut self, _seq: corral_model::SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        let Some((prompt, reply)) = self.replies.iter().find(|(p, r)| {
            tokens.starts_with(p) && r.starts_with(&tokens[p.len().min(tokens.len())..])
        }) else {
            return Vec::new();
        };
        let done = tokens.len() - prompt.len();
        reply[done..]
            .iter()
            .take(max)
            .enumerate()
            .map(|(i, &t)| {
                if (done + i) % 3 == 2 {
                    (t + 1) % 250
                } else {
                    t
                }
            })
            .collect()
    }
}

/// Speculative decoding against plain: with drafts verified in one run per step (accepted
/// while the model samples them, the rest cut from the KV cache and a hybrid's recurrent
/// state taken from the one kept after the last accepted token, or rolled back to its
/// snapshot and the accepted tokens computed again), concurrent greedy requests generate
/// exactly what each generates alone, with and without the prefix cache, also under
/// preemption; drafts were both accepted and rejected, every block and slot comes back, and
/// keeping states computes fewer tokens than replaying (as many for a model without
/// recurrent state).
#[test]
fn drafted_decoding_generates_what_plain_decoding_does() {
    for name in ["qwen3_next", "qwen3_5_moe_hub", "qwen3_moe_fused"] {
        let replies: Vec<(Vec<u32>, Vec<u32>)> = prompts()
            .into_iter()
            .map(|p| {
                let r = alone(name, &p, 12);
                (p, r)
            })
            .collect();
        for (prefix_cache, kv_blocks) in [(false, 256), (true, 256), (true, 16)] {
            let mut computed = Vec::new();
            for keep_states in [true, false] {
                let drafter = KnowingDrafter {
                    replies: replies.clone(),
                };
                let config = EngineConfig {
                    prefix_cache,
                    ..config(kv_blocks)
                };
                // Fixed lengths: adaptive ones follow measured step times, which differ
                // between the two runs.
                let speculation = Speculation::new(Box::new(drafter), 4).fixed();
                let speculation = if keep_states {
                    speculation
                } else {
                    speculation.replaying()
                };
                let (engine, thread) =
                    spawn_engine_drafting(model_named(name), config, Some(speculation)).unwrap();
                let mut receivers: Vec<_> = replies
                    .iter()
                    .map(|(p, _)| submit(&engine, p, 12))
                    .collect();
                for (i, rx) in receivers.iter_mut().enumerate() {
                    let (tokens, Finished { reason, .. }) = collect(rx);
                    let what = format!(
                        "{name}: request {i}, prefix cache {prefix_cache}, {kv_blocks} blocks"
                    );
                    assert_eq!(tokens, replies[i].1, "{what}");
                    assert_eq!(reason, FinishReason::Length, "{what}");
                }
                let m = engine.metrics();
                let (drafted, accepted) = drafted_and_accepted(&engine);
                assert!(
                    accepted > 0 && accepted < drafted,
                    "{name}: {accepted} of {drafted} draft tokens accepted"
                );
                assert!(
                    m.generated_tokens.load(Ordering::Relaxed) == 12 * replies.len() as u64,
                    "{name}: every token counted once"
                );
                computed.push(m.forward_tokens.load(Ordering::Relaxed));
                wait_for_zero_blocks(&engine);
                engine.shutdown();
                thread.join().unwrap();
            }
            let what = format!("{name}, prefix cache {prefix_cache}, {kv_blocks} blocks");
            if name == "qwen3_moe_fused" {
                assert_eq!(computed[0], computed[1], "{what}: tokens computed");
            } else {
                assert!(
                    computed[0] < computed[1],
                    "{what}: tokens computed {computed:?}"
                );
            }
        }
    }
}

/// Speculation across turns on disk: a history evicted from a small cache is written to the
/// session folder with only the tokens verify steps accepted, and the turn that extends it,
/// drafting again, is restored from it (in the same engine and after a restart) and
/// generates what plain decoding does from scratch. Qwen3-MoE and a hybrid (whose file
/// carries the recurrent state at the history's end, never a rejected draft's).
#[test]
fn speculative_turns_spill_and_come_back_from_disk_exactly() {
    for name in ["qwen3_moe_fused", "qwen3_next"] {
        let folder = tempfile::Builder::new()
            .prefix(&format!("corral-speculative-{name}-"))
            .tempdir()
            .unwrap();
        let Turns {
            history,
            others,
            next,
            ..
        } = evicting_turns(name);
        // The history, a turn that goes on from it, then prompts that need its blocks (16
        // blocks of 4 tokens), then the next turn.
        let mut prompts = vec![
            history.clone(),
            history.iter().copied().chain([7]).collect(),
        ];
        prompts.extend(others);
        prompts.push(next.clone());
        let replies: Vec<(Vec<u32>, Vec<u32>)> = prompts
            .iter()
            .map(|p| (p.clone(), alone(name, p, 6)))
            .collect();
        let in_memory = EngineConfig {
            prefix_cache: true,
            ..config(256)
        };
        let spilling = EngineConfig {
            prefix_cache: true,
            session_dir: Some(folder.path().to_path_buf()),
            session_dir_bytes: 1 << 30,
            ..config(16)
        };
        let spawn = |config: &EngineConfig| {
            let drafter = KnowingDrafter {
                replies: replies.clone(),
            };
            let speculation = Speculation::new(Box::new(drafter), 4);
            spawn_engine_drafting(model_named(name), config.clone(), Some(speculation)).unwrap()
        };
        let expected = &replies[replies.len() - 1].1;
        // In memory first: the turn resumes past the reply, whose last verify step rejected
        // a draft token as the reply ended (no state checkpoint was taken with it).
        let (engine, thread) = spawn(&in_memory);
        collect(&mut submit(&engine, &history, 6));
        let (tokens, done) = collect(&mut submit(&engine, &next, 6));
        assert_eq!(&tokens, expected, "{name}: resumed in memory");
        assert!(
            done.cached_tokens > 40,
            "{name}: {} cached",
            done.cached_tokens
        );
        engine.shutdown();
        thread.join().unwrap();
        let (engine, thread) = spawn(&spilling);
        for (i, (prompt, expected)) in replies[..replies.len() - 1].iter().enumerate() {
            let (tokens, _) = collect(&mut submit(&engine, prompt, 6));
            assert_eq!(&tokens, expected, "{name}: turn {i}");
        }
        let spills = engine.metrics().session_spills.load(Ordering::Relaxed);
        assert!(spills > 0, "{name}: nothing was spilled");
        let turn = collect(&mut submit(&engine, &next, 6));
        assert_resumed_from_disk(&engine, turn, expected, 40, name);
        let (drafted, accepted) = drafted_and_accepted(&engine);
        assert!(
            accepted > 0 && accepted < drafted,
            "{name}: {accepted} of {drafted} draft tokens accepted"
        );
        wait_for_zero_blocks(&engine);
        engine.shutdown();
        thread.join().unwrap();
        let (engine, thread) = spawn(&spilling);
        let turn = collect(&mut submit(&engine, &next, 6));
        assert_resumed_from_disk(&engine, turn, expected, 40, &format!("{name}, restarted"));
        engine.shutdown();
        thread.join().unwrap();
    }
}

/// A second model beside the target, with caches of its own, drafting greedily: the target
/// generates what it does alone whichever model drafts (itself: every draft token accepted;
/// a Qwen3-MoE or a hybrid of the same vocabulary: some rejected, its caches cut back and
/// its state rolled back to its snapshot), with and without the prefix cache.
#[test]
fn a_draft_model_beside_the_target_leaves_its_tokens_unchanged() {
    let target = "qwen3_next";
    let prompts = prompts();
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(target, p, 12)).collect();
    for draft in ["qwen3_next", "qwen3_moe_per_expert", "qwen3_5_moe_hub"] {
        for prefix_cache in [false, true] {
            let drafter = ModelDrafter::new(model_named(draft), 256, 4, 4).unwrap();
            let config = EngineConfig {
                prefix_cache,
                ..config(256)
            };
            let (engine, thread) = spawn_engine_drafting(
                model_named(target),
                config,
                Some(Speculation::new(Box::new(drafter), 3)),
            )
            .unwrap();
            let mut receivers: Vec<_> = prompts.iter().map(|p| submit(&engine, p, 12)).collect();
            for (i, rx) in receivers.iter_mut().enumerate() {
                let (tokens, _) = collect(rx);
                assert_eq!(tokens, expected[i], "{draft} drafting, request {i}");
            }
            let (drafted, accepted) = drafted_and_accepted(&engine);
            eprintln!(
                "{draft} drafting, prefix cache {prefix_cache}: {accepted} of {drafted} accepted"
            );
            assert!(drafted > 0, "{draft}: nothing drafted");
            if draft == target {
                assert_eq!(accepted, drafted, "the target drafting itself");
            }
            wait_for_zero_blocks(&engine);
            engine.shutdown();
            thread.join().unwrap();
        }
    }
}

/// The draft model's caches follow what the target accepts: after each verdict (none, some
/// or all of its draft accepted, then the target's own token) its next proposal equals a
/// fresh drafter's for the same tokens, for a hybrid draft model (its state rolled back to
/// the snapshot before the draft) and a Qwen3-MoE one (its KV cut to the common prefix).
#[test]
fn a_draft_models_proposals_after_a_verdict_equal_a_fresh_ones() {
    for draft in ["qwen3_5_moe_hub", "qwen3_moe_per_expert"] {
        let seq = corral_model::SeqId(7);
        let mut drafter = ModelDrafter::new(model_named(draft), 64, 4, 1).unwrap();
        let mut tokens: Vec<u32> = (0..9).map(|j| (j * 29 + 3) % 250).collect();
        for (round, accepted) in [1usize, 0, 3, 2, 0].into_iter().enumerate() {
            let proposed = drafter.propose(seq, &tokens, 3);
            let mut fresh = ModelDrafter::new(model_named(draft), 64, 4, 1).unwrap();
            assert_eq!(
                proposed,
                fresh.propose(seq, &tokens, 3),
                "{draft}, round {round}: after the last verdict"
            );
            assert_eq!(proposed.len(), 3);
            // The target takes `accepted` of them, then a token of its own.
            tokens.extend_from_slice(&proposed[..accepted]);
            tokens.push((round as u32 * 41 + 17) % 250);
        }
    }
}

/// Draft tokens the engine verified, and those it accepted.
fn drafted_and_accepted(engine: &EngineHandle) -> (u64, u64) {
    let m = engine.metrics();
    (
        m.draft_tokens.load(Ordering::Relaxed),
        m.accepted_draft_tokens.load(Ordering::Relaxed),
    )
}

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn mtp_drafter(name: &str) -> MtpDrafter {
    let head = Model::load_mtp(&fixture(name), Arc::new(CpuBackend::new()), &mut |_, _| {})
        .expect("the fixture's MTP head");
    MtpDrafter::new(head, 256, 4, 4).unwrap()
}

/// Proposals written down: `(tokens, proposal)`.
type ProposalLog = Arc<std::sync::Mutex<Vec<(Vec<u32>, Vec<u32>)>>>;

/// A drafter whose proposals are written down.
struct Recording<D> {
    inner: D,
    log: ProposalLog,
}

impl<D: Drafter> Drafter for Recording<D> {
    fn propose(&mut self, seq: corral_model::SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        let out = self.inner.propose(seq, tokens, max);
        self.log
            .lock()
            .unwrap()
            .push((tokens.to_vec(), out.clone()));
        out
    }
    fn forget(&mut self, seq: corral_model::SeqId) {
        self.inner.forget(seq);
    }
    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }
    fn observe(&mut self, seq: corral_model::SeqId, first: usize, hidden: &[f32]) {
        self.inner.observe(seq, first, hidden);
    }
}

/// What a fresh MTP head proposes after `tokens`, given the model's hidden states of all but
/// the last, computed at once.
fn fresh_mtp_proposal(name: &str, tokens: &[u32], max: usize) -> Vec<u32> {
    let model = model_named(name);
    let n = tokens.len() - 1;
    let blocks = n.div_ceil(4) + 1;
    let mut kv =
        corral_model::PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, 4)
            .unwrap();
    let mut state =
        corral_model::RecurrentStateCache::new(model.backend().as_ref(), model.config(), 1)
            .unwrap();
    let table = corral_model::BlockTable {
        blocks: (0..blocks as u32).map(corral_model::BlockId).collect(),
    };
    let ids: Vec<corral_model::TokenId> = tokens[..n]
        .iter()
        .map(|&t| corral_model::TokenId(t))
        .collect();
    let mut batch = corral_model::RaggedBatch::new(4);
    let seq = corral_model::SeqId(0);
    batch
        .push_run(seq, &ids, 0, &table, corral_model::LogitsWanted::Last)
        .unwrap();
    batch.set_state_slot(seq, corral_model::SlotId(0)).unwrap();
    let (mut logits, mut hidden) = (Vec::new(), Vec::new());
    let _ = model
        .forward_with_all_hidden(&batch, &mut kv, Some(&mut state), &mut logits, &mut hidden)
        .unwrap();
    let mut drafter = mtp_drafter(name);
    drafter.observe(seq, 0, &hidden);
    drafter.propose(seq, tokens, max)
}

/// The model's MTP head drafting (alone, and after prompt lookup): concurrent greedy requests
/// generate exactly what each generates alone, with and without the prefix cache and under
/// preemption; each proposal equals a fresh head's on the model's hidden states computed at
/// once (the head's cache follows what was accepted), and every block comes back.
#[test]
fn mtp_drafting_generates_what_plain_decoding_does() {
    let name = "qwen3_5_moe_mtp";
    let prompts = prompts();
    let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(name, p, 12)).collect();
    for combined in [false, true] {
        for (prefix_cache, kv_blocks) in [(false, 256), (true, 256), (true, 24)] {
            let log = Arc::new(std::sync::Mutex::new(Vec::new()));
            let drafter: Box<dyn Drafter> = if combined {
                Box::new(Recording {
                    inner: CombinedDrafter::new(LookupDrafter::default(), mtp_drafter(name)),
                    log: Arc::clone(&log),
                })
            } else {
                Box::new(Recording {
                    inner: mtp_drafter(name),
                    log: Arc::clone(&log),
                })
            };
            let config = EngineConfig {
                prefix_cache,
                ..config(kv_blocks)
            };
            let (engine, thread) = spawn_engine_drafting(
                model_named(name),
                config,
                Some(Speculation::new(drafter, 3)),
            )
            .unwrap();
            let mut receivers: Vec<_> = prompts.iter().map(|p| submit(&engine, p, 12)).collect();
            let what =
                format!("combined {combined}, prefix cache {prefix_cache}, {kv_blocks} blocks");
            for (i, rx) in receivers.iter_mut().enumerate() {
                let (tokens, _) = collect(rx);
                assert_eq!(tokens, expected[i], "{what}: request {i}");
            }
            let m = engine.metrics();
            let (drafted, accepted) = drafted_and_accepted(&engine);
            eprintln!("{what}: {accepted} of {drafted} accepted");
            assert!(drafted > 0, "{what}: nothing drafted");
            // A draft's token k is accepted only after those before it.
            let by_position: Vec<u64> = m
                .accepted_by_position
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect();
            assert_eq!(by_position.iter().sum::<u64>(), accepted, "{what}");
            assert!(
                by_position.windows(2).all(|w| w[0] >= w[1]),
                "{what}: {by_position:?}"
            );
            assert!(m.drafts.load(Ordering::Relaxed) * 3 >= drafted, "{what}");
            wait_for_zero_blocks(&engine);
            engine.shutdown();
            thread.join().unwrap();
            if !combined && !prefix_cache {
                let log = log.lock().unwrap();
                assert!(log.len() > 20, "{what}: {} proposals", log.len());
                for (tokens, proposal) in log.iter().filter(|l| !l.1.is_empty()) {
                    assert_eq!(
                        proposal,
                        &fresh_mtp_proposal(name, tokens, proposal.len()),
                        "{what}: after {} tokens",
                        tokens.len()
                    );
                }
            }
        }
    }
}

/// Under a running limit the MTP head sees no hidden states while more sequences run than
/// draft; a sequence left alone drafts from the rows it sees from then on, and generates
/// what plain decoding does.
#[test]
fn mtp_drafting_resumes_after_a_busy_stretch() {
    let name = "qwen3_5_moe_mtp";
    let prompts = prompts();
    let (long, short) = (&prompts[0], &prompts[1]);
    let expected = (alone(name, long, 16), alone(name, short, 3));
    let speculation = Speculation::new(Box::new(mtp_drafter(name)), 3).up_to_running(1);
    let (engine, thread) =
        spawn_engine_drafting(model_named(name), config(256), Some(speculation)).unwrap();
    let mut first = submit(&engine, long, 16);
    let mut second = submit(&engine, short, 3);
    assert_eq!(collect(&mut second).0, expected.1, "the short request");
    assert_eq!(collect(&mut first).0, expected.0, "the long request");
    let (drafted, _) = drafted_and_accepted(&engine);
    assert!(drafted > 0, "nothing drafted once alone");
    wait_for_zero_blocks(&engine);
    engine.shutdown();
    thread.join().unwrap();
}

/// Prompt lookup for every family: a prompt that repeats itself is drafted from, and greedy
/// output is what plain decoding gives.
#[test]
fn lookup_drafting_generates_what_plain_decoding_does() {
    for name in [
        "qwen3_next",
        "qwen3_5_moe_hub",
        "qwen3_moe_fused",
        "qwen3_5_moe_mtp",
    ] {
        let cycle: Vec<u32> = (0..7).map(|j| (j * 37 + 11) % 250).collect();
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                cycle
                    .iter()
                    .cycle()
                    .skip(i)
                    .take(17 + 5 * i)
                    .copied()
                    .collect()
            })
            .collect();
        let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(name, p, 10)).collect();
        let (engine, thread) = spawn_engine_drafting(
            model_named(name),
            config(256),
            Some(Speculation::new(Box::new(LookupDrafter::default()), 4)),
        )
        .unwrap();
        let mut receivers: Vec<_> = prompts.iter().map(|p| submit(&engine, p, 10)).collect();
        for (i, rx) in receivers.iter_mut().enumerate() {
            let (tokens, _) = collect(rx);
            assert_eq!(tokens, expected[i], "{name}: request {i}");
        }
        let drafted = engine.metrics().draft_tokens.load(Ordering::Relaxed);
        assert!(drafted > 0, "{name}: nothing drafted");
        wait_for_zero_blocks(&engine);
        engine.shutdown();
        thread.join().unwrap();
    }
}

/// Every hybrid family's MTP head, from GGUF files converted with it (Qwen3.5 dense, its
/// MoE, Qwen3-Next), drafts beside the model: every request completes, drafts are made and
/// verified, and every block comes back, with and without the prefix cache. (Token-for-token
/// equality with plain decoding is the f32 fixture's test above: on Q4_K weights, products of
/// several rows round differently from those of one, so that these files' greedy tokens
/// already differ between decoding alone and in a batch of four.)
#[test]
fn mtp_heads_of_every_hybrid_family_draft_in_the_engine() {
    for arch in ["qwen35", "qwen35moe", "qwen3next"] {
        let path = fixture("gguf/hybrid").join(format!("{arch}.mtp.q4_k_m.gguf"));
        let gguf = corral_model::checkpoint::GgufCheckpoint::open(&path).unwrap();
        let backend = || -> Arc<dyn corral_backend::Backend> { Arc::new(CpuBackend::new()) };
        for prefix_cache in [false, true] {
            let config = EngineConfig {
                prefix_cache,
                ..config(256)
            };
            let model = Model::from_gguf(&gguf, backend(), &mut |_, _| {}).unwrap();
            let head = Model::mtp_from_gguf(&gguf, backend(), &mut |_, _| {}).unwrap();
            let drafter = MtpDrafter::new(head, 256, 4, 4).unwrap();
            let (engine, thread) =
                spawn_engine_drafting(model, config, Some(Speculation::new(Box::new(drafter), 3)))
                    .unwrap();
            let mut receivers: Vec<_> = prompts().iter().map(|p| submit(&engine, p, 10)).collect();
            for rx in &mut receivers {
                let (tokens, finished) = collect(rx);
                assert_eq!(tokens.len(), 10, "{arch}");
                assert_eq!(finished.reason, FinishReason::Length, "{arch}");
            }
            let drafted = engine.metrics().draft_tokens.load(Ordering::Relaxed);
            assert!(
                drafted > 0,
                "{arch}, prefix cache {prefix_cache}: nothing drafted"
            );
            wait_for_zero_blocks(&engine);
            engine.shutdown();
            thread.join().unwrap();
        }
    }
}

/// The engine counts and times the steps that only decode: one a decode step of a request
/// running alone, drafts verified included, its time split between planning (the MTP head's
/// drafting) and the forward pass.
#[test]
fn decode_only_steps_are_counted_and_timed_by_phase() {
    let name = "qwen3_5_moe_mtp";
    let drafter: Box<dyn Drafter> = Box::new(mtp_drafter(name));
    let (engine, thread) = spawn_engine_drafting(
        model_named(name),
        config(256),
        Some(Speculation::new(drafter, 3)),
    )
    .unwrap();
    let (tokens, finished) = collect(&mut submit(&engine, &prompts()[3], 12));
    let metrics = Arc::clone(engine.metrics());
    engine.shutdown();
    thread.join().unwrap();
    assert_eq!(tokens.len(), 12);
    assert!(finished.decode_steps > 0);
    assert_eq!(
        metrics.decode_steps.load(Ordering::Relaxed),
        finished.decode_steps as u64
    );
    let [plan, forward, _] = metrics
        .decode_step_micros
        .each_ref()
        .map(|m| m.load(Ordering::Relaxed));
    assert!(
        plan > 0 && forward > 0,
        "plan {plan} µs, forward {forward} µs"
    );
}
