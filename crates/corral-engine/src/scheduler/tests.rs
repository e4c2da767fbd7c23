use super::*;
use crate::SamplingParams;

fn request(tokens: &[u32], max_tokens: usize) -> EngineRequest {
    let (events, _) = tokio::sync::mpsc::unbounded_channel();
    EngineRequest {
        prompt: tokens.to_vec(),
        params: SamplingParams::default(),
        max_tokens,
        max_context: 4096,
        stop_token_ids: Vec::new(),
        top_logprobs: None,
        events,
        session: None,
        constraint: None,
    }
}

fn config(max_batch: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch,
        max_prefill_tokens: 64,
        session_pin: std::time::Duration::ZERO,
    }
}

/// Decode rows count against the step's token budget: a prefill beside them takes what
/// they leave, so no step is larger than the budget the workspace was sized for (unless
/// its decode rows alone are, which always run).
#[test]
fn decode_rows_and_a_prefill_share_the_step_budget() {
    let mut s = Scheduler::new(config(4), KvBlockPool::new(64, 16));
    let mut receivers = Vec::new();
    let long: Vec<u32> = (0..300).collect();
    for (prompt, max_tokens) in [(&[1, 2, 3][..], 8), (&[4, 5], 8), (&[6], 8), (&long, 4)] {
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        receivers.push(rx);
        s.add(EngineRequest {
            events,
            ..request(prompt, max_tokens)
        });
    }
    let vocab = 16;
    let mut shared = 0;
    for _ in 0..40 {
        let Some(plan) = s.step() else { break };
        let tokens: usize = plan.runs.iter().map(|r| r.tokens).sum();
        let decode = plan.runs.iter().filter(|r| r.tokens == 1).count();
        assert!(
            tokens <= 64,
            "a step of {tokens} tokens over a budget of 64"
        );
        // A prefill chunk that does not end its prompt takes what the decode rows leave.
        let mid_prompt = plan.runs.iter().any(|r| r.tokens > 1 && r.logits == 0);
        if decode > 0 && mid_prompt {
            shared += 1;
            assert_eq!(
                tokens, 64,
                "a prefill beside decode rows takes what they leave"
            );
        }
        let rows = plan.runs.iter().filter(|r| r.logits > 0).count();
        let mut logits = vec![0.0f32; rows * vocab];
        let _ = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
    }
    assert!(shared > 0, "no step had decode rows beside a prefill");
}

/// A constrained sequence samples only what its grammar allows, whatever its logits
/// favour, and ends when the document is complete; a free one in the same steps samples
/// its logits' favourite as before.
#[test]
fn a_constrained_sequence_follows_its_grammar_beside_a_free_one() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/tiny-qwen3-moe");
    let tok =
        crate::Tokenizer::from_file(&std::path::Path::new(dir).join("tokenizer.json")).unwrap();
    let grammar = crate::Grammar::JsonSchema(serde_json::json!({"enum": ["yes", "no!"]}));
    let constraint = tok
        .grammar_compiler(&[])
        .unwrap()
        .compile(&grammar)
        .unwrap();
    let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4));
    let (events_a, mut rx_a) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events: events_a,
        constraint: Some(constraint),
        ..request(&[1, 2, 3], 16)
    });
    let (events_b, mut rx_b) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events: events_b,
        ..request(&[4, 5, 6], 3)
    });
    let (vocab, favourite) = (1600, 7);
    for _ in 0..20 {
        let Some(plan) = s.step() else { break };
        let rows = plan.runs.iter().filter(|r| r.logits > 0).count();
        let mut logits = vec![0.0f32; rows * vocab];
        for row in 0..rows {
            logits[row * vocab + favourite] = 10.0;
            // Among what the grammar allows, "n" stands out.
            let n = tok.encode("n").unwrap()[0] as usize;
            logits[row * vocab + n] = 5.0;
        }
        let counts = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
        // As the engine does: the end goes to the request's channel.
        for (events, finished) in counts.finished {
            let _ = events.send(Event::Finished(finished));
        }
    }
    let drain = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>| {
        let (mut ids, mut end) = (Vec::new(), None);
        while let Ok(event) = rx.try_recv() {
            match event {
                Event::Tokens(t) => ids.extend(t.iter().map(|t| t.id)),
                Event::Finished(f) => end = Some(f),
                Event::Failed(e) => panic!("{e}"),
            }
        }
        (ids, end.expect("finished"))
    };
    let (ids, end) = drain(&mut rx_a);
    assert_eq!(tok.decode(&ids).unwrap(), "\"no!\"");
    assert_eq!(end.reason, FinishReason::Stop);
    assert!(end.constraint.is_some_and(|c| c.masks == ids.len()));
    let (ids, end) = drain(&mut rx_b);
    assert_eq!(ids, [favourite as u32; 3]);
    assert_eq!(end.reason, FinishReason::Length);
    assert!(s.is_idle());
}

/// A request whose prompt needs more blocks than the whole cache fails at once (before,
/// it was preempted and re-admitted for ever); the others run.
#[test]
fn a_sequence_larger_than_the_whole_cache_fails() {
    let mut s = Scheduler::new(config(2), KvBlockPool::new(4, 4));
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events,
        ..request(&(0..17).collect::<Vec<u32>>(), 1)
    });
    s.add(request(&[1, 2, 3], 1));
    let plan = s.step().expect("the small request runs");
    assert_eq!(plan.runs.len(), 1);
    match rx.try_recv() {
        Ok(Event::Failed(message)) => assert!(message.contains("5 KV blocks"), "{message}"),
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// A step whose batch cannot be built fails its sequences instead of being planned again
/// and again (the engine loop spun on it).
#[test]
fn a_step_that_cannot_be_built_fails_its_sequences() {
    let mut s = Scheduler::new(config(2), KvBlockPool::new(8, 4));
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events,
        ..request(&[1, 2, 3], 1)
    });
    s.add(request(&[4, 5, 6], 1));
    // Two sequences under one id: the batch refuses the second run.
    let id = s.waiting[0].id;
    s.waiting[1].id = id;
    assert!(s.step().is_none());
    assert!(matches!(rx.try_recv(), Ok(Event::Failed(_))));
    assert!(s.is_idle(), "the failed sequences are gone");
    assert_eq!(s.pool().num_free(), 8, "their blocks are free");
}

/// A sequence that starts from a partly matching cached block and is preempted before
/// its first step (so before the copy into its own block is made) leaves only what it
/// really holds in the cache: its own, never written, block is not indexed.
#[test]
fn a_block_whose_copy_was_never_made_is_not_cached() {
    let config = SchedulerConfig {
        max_batch: 2,
        max_prefill_tokens: 64,
        session_pin: std::time::Duration::ZERO,
    };
    let mut s = Scheduler::new(config, KvBlockPool::new(8, 4)).with_prefix_cache();
    // A: two whole blocks and a tail of 2 cached when it ends.
    s.add(request(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1));
    let plan = s.step().unwrap();
    let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
    assert_eq!(s.cached_blocks(), 3);
    // B shares the first block and 2 ids of the second (a copy into a block of its
    // own), but needs more blocks than the pool has: it fails in the same step.
    let b: Vec<u32> = [1, 2, 3, 4, 5, 6].into_iter().chain(90..120).collect();
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events,
        ..request(&b, 1)
    });
    assert!(s.step().is_none());
    assert!(matches!(rx.try_recv(), Ok(Event::Failed(_))));
    // A's blocks stay; B's never-written block is not a tail [5, 6].
    assert_eq!(s.cached_blocks(), 3);
}

/// With every block of the pool cached (a warm server), a partly matching block is still
/// copied: a cached block nobody holds is evicted for the copy.
#[test]
fn a_full_pool_makes_room_for_the_copy() {
    let config = SchedulerConfig {
        max_batch: 2,
        max_prefill_tokens: 64,
        session_pin: std::time::Duration::ZERO,
    };
    let mut s = Scheduler::new(config, KvBlockPool::new(4, 4)).with_prefix_cache();
    let a: Vec<u32> = (1..=13).collect();
    s.add(request(&a, 1));
    let plan = s.step().unwrap();
    let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
    assert_eq!(
        s.cached_blocks(),
        4,
        "the whole pool: three blocks and a tail"
    );
    s.add(request(&[1, 2, 3, 4, 5, 6, 99, 98], 1));
    let plan = s.step().unwrap();
    assert_eq!(
        plan.block_copies.len(),
        1,
        "the second block's first 2 ids, copied"
    );
    let _ = s.finish_step(plan, &mut [0.0; 16], 16, DispatchStats::default());
}

/// Proposes its tokens after whatever it is shown past the first `.0` (a prompt's length).
struct FixedDrafter(usize, Vec<u32>);

/// Logits rows of `vocab` that each sample the token given for it.
fn favouring(rows: &[u32], vocab: usize) -> Vec<f32> {
    let mut logits = vec![0.0f32; rows.len() * vocab];
    for (r, &t) in rows.iter().enumerate() {
        logits[r * vocab + t as usize] = 10.0;
    }
    logits
}

impl Drafter for FixedDrafter {
    fn propose(&mut self, _seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        if tokens.len() <= self.0 {
            return Vec::new();
        }
        self.1.iter().copied().take(max).collect()
    }
}

/// A decode step verifying a draft of 3 asks for 1 + 3 logits rows; the output step
/// accepts the draft while the rows sample it (here 1 of 3), sends the accepted token
/// and the row's own, and cuts what was rejected: without recurrent state the KV keeps
/// the accepted tokens, with it either the verify keeps the state after each draft position
/// in a group of slots and the one after the accepted token is copied into the sequence's
/// slot before the next step, or (no group) the state is snapshotted before the step and
/// copied back before the next (which computes the accepted tokens again). A hybrid's prompt
/// stops one short of its end first, for its state checkpoint.
#[test]
fn a_verify_run_asks_for_one_logits_row_per_draft_token_and_cuts_the_rejected() {
    for (recurrent, kept) in [(false, false), (true, false), (true, true)] {
        let base = Scheduler::new(config(2), KvBlockPool::new(16, 4))
            .with_drafter(Box::new(FixedDrafter(3, vec![10, 11, 12])), 3);
        let mut s = match (recurrent, kept) {
            (false, _) => base,
            (true, false) => base.with_state_checkpoints(2, 2),
            (true, true) => base.with_state_checkpoints(2, 2).with_kept_states(4, 1, 3),
        };
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            ..request(&[1, 2, 3], 8)
        });
        let vocab = 16;
        // Rows sample these tokens: the prompt's row 9, then 10 (the draft's first),
        // then 7 where the draft says 11.
        let favour = |rows: &[u32]| favouring(rows, vocab);
        let mut plan = s.step().unwrap();
        if recurrent {
            let run = plan.runs[0];
            assert_eq!(
                (run.tokens, run.logits),
                (2, 0),
                "one short of the prompt's end"
            );
            assert_eq!(plan.state_copies.len(), 0);
            let _ = s.finish_step(plan, &mut [], vocab, DispatchStats::default());
            plan = s.step().unwrap();
        }
        assert_eq!(
            plan.runs[0].logits, 1,
            "a prompt's run asks for its last row"
        );
        let _ = s.finish_step(plan, &mut favour(&[9]), vocab, DispatchStats::default());
        let plan = s.step().unwrap();
        let run = plan.runs[0];
        assert_eq!(
            (run.tokens, run.logits),
            (4, 4),
            "the last token and 3 drafted"
        );
        assert_eq!(plan.batch.runs()[0].first_position, 3);
        assert_eq!(plan.batch.logit_rows().len(), 4);
        let slot = s.running[0].kv.slot.unwrap();
        if recurrent && !kept {
            assert_eq!(plan.state_copies.len(), 1, "a snapshot before the verify");
            assert_eq!(plan.state_copies[0].1, slot);
        } else {
            assert!(plan.state_copies.is_empty());
        }
        let kept_states = plan.batch.runs()[0].kept_states;
        assert_eq!(
            kept_states,
            kept.then_some(SlotId(4)),
            "states kept in the group"
        );
        let counts = s.finish_step(
            plan,
            &mut favour(&[10, 7, 3, 3]),
            vocab,
            DispatchStats::default(),
        );
        assert_eq!((counts.draft_tokens, counts.accepted_tokens), (3, 1));
        assert_eq!(counts.generated_tokens, 2);
        let seq = &s.running[0];
        assert_eq!(seq.tokens, [1, 2, 3, 9, 10, 7]);
        let computed = if recurrent && !kept { 3 } else { 5 };
        assert_eq!(seq.kv.computed, computed);
        assert_eq!(
            seq.kv.table.blocks.len(),
            computed.div_ceil(4),
            "rejected blocks cut"
        );
        let events: Vec<Vec<u32>> = std::iter::from_fn(|| match rx.try_recv() {
            Ok(Event::Tokens(t)) => Some(t.iter().map(|t| t.id).collect()),
            _ => None,
        })
        .collect();
        assert_eq!(
            events,
            [vec![9], vec![10, 7]],
            "a step's tokens in one event"
        );
        let plan = s.step().unwrap();
        if recurrent {
            let (_, from, to) = plan.state_copies[0];
            assert_eq!(to, slot, "the roll-back comes first");
            assert_ne!(from, slot);
            if kept {
                assert_eq!(from, SlotId(5), "the state after 10, the accepted token");
            }
        }
        if recurrent && !kept {
            assert_eq!(plan.runs[0].tokens, 3, "9, 10 again, then 7");
        } else {
            assert_eq!(plan.runs[0].tokens, 1 + 3, "7, then the next draft");
        }
        if kept {
            // The group copied from is free again: this step's verify keeps its states there.
            assert_eq!(plan.batch.runs()[0].kept_states, Some(SlotId(4)));
        }
        s.fail_step(plan, "end of test");
        assert!(s.is_idle());
    }
}

/// A sequence whose draft ends it part-way (a stop id accepted, the draft's later tokens
/// never used) gives its group of kept states back with its slot, and the next sequence
/// keeps its states in the same group.
#[test]
fn a_sequence_ended_within_its_draft_gives_its_kept_states_back() {
    let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4))
        .with_drafter(Box::new(FixedDrafter(3, vec![10, 11, 12])), 3)
        .with_state_checkpoints(2, 2)
        .with_kept_states(4, 1, 3);
    let vocab = 16;
    let favour = |rows: &[u32]| favouring(rows, vocab);
    for round in 0..2 {
        let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            stop_token_ids: vec![11],
            ..request(&[1, 2, 3], 16)
        });
        // The prompt (one short of its end, then its last token), then a verify of 9 and
        // the draft 10, 11, 12: 10 and 11 are accepted, and 11 ends the sequence.
        let mut verified = false;
        while let Some(plan) = s.step() {
            let rows = plan.runs[0].logits;
            let keeps = plan.batch.runs()[0].kept_states;
            let mut logits = match rows {
                0 => Vec::new(),
                1 => favour(&[9]),
                _ => {
                    assert_eq!(keeps, Some(SlotId(4)), "round {round}: the group is free");
                    verified = true;
                    favour(&[10, 11, 5, 5])
                }
            };
            let _ = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
        }
        assert!(verified, "round {round}: a verify step ran");
        assert!(s.is_idle(), "round {round}");
        assert_eq!(s.slots_in_use(), 0, "round {round}");
    }
}

/// A session store whose one file holds the first 8 tokens of prompts starting 1, 2, 3,
/// and whose read takes `polls` polls, then gives `result`.
struct SlowStore {
    polls: usize,
    result: Result<(), String>,
    kept: Vec<RestoreId>,
}

impl SessionStore for SlowStore {
    fn spill(&mut self, _: &crate::EvictedPrefix<'_>) {}
    fn write_ahead(&mut self, _: &crate::EvictedPrefix<'_>) {}
    fn find(&mut self, tokens: &[u32], beyond: usize, _: usize) -> Option<(usize, RestoreId)> {
        (tokens.starts_with(&[1, 2, 3]) && beyond < 8).then_some((8, RestoreId(7)))
    }
    fn poll_load(
        &mut self,
        _: RestoreId,
        blocks: &[corral_model::BlockId],
        _: Option<SlotId>,
    ) -> Option<Result<(), String>> {
        assert_eq!(blocks.len(), 2, "the restore's blocks are held");
        if self.polls > 0 {
            self.polls -= 1;
            return None;
        }
        Some(self.result.clone())
    }
    fn keep_restores(&mut self, ids: &[RestoreId]) {
        self.kept = ids.to_vec();
    }
}

/// A sequence restoring from a session file waits for the read as a state of its own:
/// steps go on for the others meanwhile, and it then runs from the restored tokens (or,
/// where the read failed, from the start).
#[test]
fn a_restore_from_disk_is_a_state_that_other_sequences_run_past() {
    for (result, resumed_at) in [(Ok(()), 8), (Err("bad file".to_string()), 0)] {
        let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4)).with_prefix_cache();
        let mut store = SlowStore {
            polls: 2,
            result,
            kept: Vec::new(),
        };
        let mut receivers = Vec::new();
        for (prompt, max_tokens) in [((1..=12).collect::<Vec<u32>>(), 1), (vec![50, 51, 52], 8)] {
            let (events, rx) = tokio::sync::mpsc::unbounded_channel();
            receivers.push(rx);
            s.add(EngineRequest {
                events,
                ..request(&prompt, max_tokens)
            });
        }
        let mut a_ran = None;
        for step in 0..6 {
            let plan = s
                .step_with(Some(&mut store))
                .unwrap_or_else(|| panic!("step {step}: b runs"));
            let a = s.running[0].id;
            match plan.runs.iter().find(|r| r.seq == a) {
                Some(run) => {
                    a_ran = Some((step, plan.batch.runs()[0].first_position, run.tokens));
                    break;
                }
                None => assert!(plan.runs.iter().all(|r| r.seq != a)),
            }
            assert_eq!(store.kept, [RestoreId(7)]);
            let rows = plan.runs.iter().filter(|r| r.logits > 0).count();
            let _ = s.finish_step(
                plan,
                &mut vec![0.0; rows * 16],
                16,
                DispatchStats::default(),
            );
        }
        assert_eq!(
            a_ran,
            Some((2, resumed_at, 12 - resumed_at)),
            "two steps without it, then its run from the restored tokens"
        );
    }
}

/// χ² statistic of `counts` against probabilities `p` (every expected count at least 5).
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &p)| {
            let expected = n as f64 * p;
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

/// Sampled speculation keeps the model's distribution: with a draft token verified at each
/// step, the token a step emits at the draft's position follows the model's distribution
/// there (the draft's token no more often than the model gives it), and the token after an
/// accepted draft follows the next row's. 6,000 seeded sequences; χ² with 5 degrees of
/// freedom stays below 20.5 (p = 0.001) for both.
#[test]
fn sampled_speculation_keeps_the_models_distribution() {
    let vocab = 6;
    let p = [0.05, 0.4, 0.1, 0.2, 0.15, 0.1];
    let q = [0.3, 0.05, 0.05, 0.2, 0.25, 0.15];
    let draft = 3u32;
    let (mut at_draft, mut after) = (vec![0usize; vocab], vec![0usize; vocab]);
    for seed in 0..6000u64 {
        let mut s = Scheduler::new(config(1), KvBlockPool::new(16, 4))
            .with_drafter(Box::new(FixedDrafter(3, vec![draft])), 1);
        let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            params: SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            },
            ..request(&[1, 2, 3], 8)
        });
        // The prompt's row makes token 5 certain; the verify step's rows are p, then q.
        let plan = s.step().unwrap();
        let mut certain = vec![-100.0f32; vocab];
        certain[5] = 0.0;
        let _ = s.finish_step(plan, &mut certain, vocab, DispatchStats::default());
        let plan = s.step().unwrap();
        assert_eq!(plan.runs[0].logits, 2, "the token and its draft verified");
        let mut rows: Vec<f32> = p.iter().chain(&q).map(|&x| (x as f32).ln()).collect();
        let _ = s.finish_step(plan, &mut rows, vocab, DispatchStats::default());
        let tokens = &s.running[0].tokens;
        at_draft[tokens[4] as usize] += 1;
        if tokens[4] == draft {
            after[tokens[5] as usize] += 1;
        }
    }
    let (x1, x2) = (chi_square(&at_draft, &p), chi_square(&after, &q));
    assert!(
        x1 < 20.5,
        "at the draft's position: {at_draft:?}, χ² {x1:.1}"
    );
    assert!(x2 < 20.5, "after an accepted draft: {after:?}, χ² {x2:.1}");
}

/// With a draft limit of one running sequence, a lone sequence verifies drafts and two
/// running together do not.
#[test]
fn drafts_stop_past_the_running_limit() {
    for sequences in [1usize, 2] {
        let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4))
            .with_drafter(Box::new(FixedDrafter(3, vec![10])), 1)
            .with_draft_limit(1);
        let mut receivers = Vec::new();
        for _ in 0..sequences {
            let (events, rx) = tokio::sync::mpsc::unbounded_channel();
            receivers.push(rx);
            s.add(EngineRequest {
                events,
                ..request(&[1, 2, 3], 8)
            });
        }
        let plan = s.step().unwrap();
        let mut logits = vec![0.0f32; sequences * 16];
        let _ = s.finish_step(plan, &mut logits, 16, DispatchStats::default());
        let plan = s.step().unwrap();
        let rows: Vec<usize> = plan.runs.iter().map(|r| r.logits).collect();
        let expected = if sequences == 1 { vec![2] } else { vec![1, 1] };
        assert_eq!(rows, expected, "{sequences} running");
    }
}

/// Forced acceptance takes each draft token with its probability whatever the rows sample
/// (rows here never sample the draft): at 1 every draft is accepted whole, at 0 none is,
/// at 0.5 about half the first positions.
#[test]
fn forced_acceptance_takes_drafts_at_its_rate() {
    let vocab = 16;
    for (rate, expected) in [(1.0, (1.0, 1.0)), (0.0, (0.0, 0.0)), (0.5, (0.42, 0.58))] {
        let mut s = Scheduler::new(config(1), KvBlockPool::new(1024, 4))
            .with_drafter(Box::new(FixedDrafter(3, vec![10, 11])), 2)
            .with_forced_acceptance(rate);
        let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
        s.add(EngineRequest {
            events,
            ..request(&[1, 2, 3], 2000)
        });
        // Every row samples token 5.
        let (mut drafts, mut first) = (0, 0);
        for _ in 0..600 {
            let Some(plan) = s.step() else { break };
            let rows = plan.batch.logit_rows().len();
            let mut logits = vec![0.0f32; rows * vocab];
            for r in 0..rows {
                logits[r * vocab + 5] = 10.0;
            }
            let counts = s.finish_step(plan, &mut logits, vocab, DispatchStats::default());
            drafts += counts.drafts;
            first += counts.accepted_by_position[0];
            if counts.drafts > 0 && rate == 1.0 {
                assert_eq!(counts.accepted_tokens, 2, "the whole draft");
                assert_eq!(
                    s.running[0].tokens[s.running[0].tokens.len() - 3..],
                    [10, 11, 5]
                );
            }
        }
        assert!(drafts > 500, "{rate}: {drafts} drafts");
        let share = first as f64 / drafts as f64;
        assert!(
            (expected.0..=expected.1).contains(&share),
            "{rate}: first draft token taken in {share} of drafts"
        );
    }
}

/// Adaptive drafts are chosen by cost. With measured steps of 100 µs and 30 more a draft
/// token, a sequence starting at an even chance drafts one token; as its drafts are all
/// taken it drafts the longest (one shorter on every eighth choice, a probe); once they are
/// all rejected it stops drafting but for a one-token probe every eighth choice.
#[test]
fn draft_lengths_are_chosen_by_acceptance_and_measured_cost() {
    let vocab = 16;
    let mut s = Scheduler::new(config(1), KvBlockPool::new(64, 4))
        .with_drafter(Box::new(FixedDrafter(3, vec![10, 10, 10])), 3)
        .with_adaptive_drafts();
    for drafts in 0..=3 {
        // Each length's first step is not counted.
        for _ in 0..2 {
            s.observe_decode_step((1, drafts), 100.0 + 30.0 * drafts as f64);
            // Steps of two sequences, far dearer, are no measure of one's.
            s.observe_decode_step((2, drafts), 100.0 + 300.0 * drafts as f64);
        }
    }
    let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
    s.add(EngineRequest {
        events,
        ..request(&[1, 2, 3], 200)
    });
    let rows_sampling = |rows: usize, token: usize| {
        let mut logits = vec![0.0f32; rows * vocab];
        for r in 0..rows {
            logits[r * vocab + token] = 10.0;
        }
        logits
    };
    let plan = s.step().unwrap();
    let _ = s.finish_step(
        plan,
        &mut rows_sampling(1, 10),
        vocab,
        DispatchStats::default(),
    );
    let mut verified = Vec::new();
    for step in 0..48 {
        let plan = s.step().unwrap();
        let rows = plan.runs[0].logits;
        verified.push(rows - 1);
        // The draft's token for 16 steps, then another.
        let token = if step < 16 { 10 } else { 7 };
        let _ = s.finish_step(
            plan,
            &mut rows_sampling(rows, token),
            vocab,
            DispatchStats::default(),
        );
    }
    eprintln!("{verified:?}");
    assert_eq!(verified[..4], [1, 2, 3, 3], "taken: longer drafts");
    assert_eq!(verified[7], 2, "the eighth choice probes one shorter");
    assert!(verified[8..15].iter().all(|&v| v == 3));
    // Rejected from the 17th step: shorter, then none but probes.
    let stopped = verified[16..].iter().position(|&v| v == 0).unwrap() + 16;
    assert!(stopped < 26, "{verified:?}");
    // No longer than the step before, probes aside.
    assert!((17..stopped).all(|i| verified[i] <= verified[i - 1] || (i + 1) % 8 == 0));
    let probes: Vec<usize> = (stopped..48).filter(|&i| verified[i] > 0).collect();
    assert!(
        probes.iter().all(|&i| verified[i] == 1 && (i + 1) % 8 == 0),
        "{verified:?}"
    );
    assert!(!probes.is_empty());
}

/// A drafter that reads hidden states (as an MTP head does), proposing nothing.
struct ReadsHidden;

impl Drafter for ReadsHidden {
    fn propose(&mut self, _seq: SeqId, _tokens: &[u32], _max: usize) -> Vec<u32> {
        Vec::new()
    }

    fn wants_hidden(&self) -> bool {
        true
    }
}

/// Hidden states are read back for a drafter that takes them only while sequences draft
/// (within the running limit).
#[test]
fn hidden_states_are_read_only_while_sequences_draft() {
    for sequences in [1usize, 2] {
        let mut s = Scheduler::new(config(2), KvBlockPool::new(16, 4))
            .with_drafter(Box::new(ReadsHidden), 2)
            .with_draft_limit(1);
        for _ in 0..sequences {
            s.add(request(&[1, 2, 3], 8));
        }
        let _plan = s.step().unwrap();
        assert_eq!(
            s.drafter_wants_hidden(),
            sequences == 1,
            "{sequences} running"
        );
    }
}
