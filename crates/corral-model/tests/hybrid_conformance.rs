//! Conformance of the hybrid families (Qwen3.5 MoE in the Hub multimodal and text-only
//! layouts, Qwen3.5 dense, Qwen3-Next; each also at a trained model's weight scale, the
//! `bf16_*` fixtures the GPU's bf16 tests use) against transformers' fp32 logits: chunk sizes 1, 7,
//! 64 and whole (crossing the 64-token chunk and starting with prefixes shorter than the conv
//! kernel), every MoE strategy, and transformers' greedy continuation.

mod common;

use common::{BLOCK_SIZE, fixture_dir, greedy, load, logits_chunked, read_reference, rel_err};

use corral_model::{
    BlockId, BlockTable, LogitsWanted, MoeStrategy, PagedKvCache, RaggedBatch, RecurrentStateCache,
    SeqId, SlotId, TokenId,
};

const FIXTURES: &[&str] = &[
    "qwen3_5_moe_hub",
    "qwen3_5_moe_text",
    "qwen3_5_dense",
    "qwen3_next",
    "bf16_qwen3_5_moe_hub",
    "bf16_qwen3_5_moe_text",
    "bf16_qwen3_5_dense",
    "bf16_qwen3_next",
];

#[test]
fn hybrid_logits_match_transformers_at_every_chunk_size() {
    for name in FIXTURES {
        let mut model = load(name);
        let reference = read_reference(&fixture_dir(name));
        for strategy in [
            MoeStrategy::Grouped,
            MoeStrategy::PerToken,
            MoeStrategy::PerExpert,
        ] {
            model.set_moe_strategy(strategy);
            for chunk in [1, 7, 64, reference.token_ids.len()] {
                let ours = logits_chunked(&model, &reference.token_ids, chunk);
                let err = rel_err(&ours, &reference.logits);
                eprintln!("{name} {strategy} chunk {chunk}: relative error {err:.2e}");
                assert!(
                    err <= 1e-4,
                    "{name} {strategy} chunk {chunk}: relative error {err:e}"
                );
            }
        }
    }
}

#[test]
fn hybrid_greedy_continuation_matches_transformers() {
    for name in FIXTURES {
        let model = load(name);
        let reference = read_reference(&fixture_dir(name));
        let generated = greedy(
            &model,
            &reference.greedy_prompt,
            reference.greedy_continuation.len(),
        );
        assert_eq!(generated, reference.greedy_continuation, "{name}");
    }
}

#[test]
fn hybrid_moe_strategies_agree_within_1e_5() {
    for name in ["qwen3_5_moe_hub", "qwen3_next"] {
        let mut model = load(name);
        let reference = read_reference(&fixture_dir(name));
        for chunk in [1, 64] {
            model.set_moe_strategy(MoeStrategy::PerExpert);
            let baseline = logits_chunked(&model, &reference.token_ids, chunk);
            for strategy in [MoeStrategy::PerToken, MoeStrategy::Grouped] {
                model.set_moe_strategy(strategy);
                let other = logits_chunked(&model, &reference.token_ids, chunk);
                let err = rel_err(&other, &baseline);
                assert!(
                    err <= 1e-5,
                    "{name} {strategy} vs per-expert at chunk {chunk}: {err:e}"
                );
            }
        }
    }
}

#[test]
fn mixed_ragged_batch_of_hybrid_sequences_matches_each_alone() {
    let model = load("qwen3_5_moe_hub");
    let vocab = model.config().vocab_size as u32;
    let a: Vec<u32> = (0..70).map(|i| (i * 37 + 5) % (vocab - 10)).collect();
    let b: Vec<u32> = (0..9).map(|i| (i * 53 + 2) % (vocab - 10)).collect();
    let (ref_a, ref_b) = (
        logits_chunked(&model, &a, a.len()),
        logits_chunked(&model, &b, b.len()),
    );
    let blocks = 16;
    let mut kv =
        PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, BLOCK_SIZE).unwrap();
    let mut state = RecurrentStateCache::new(model.backend().as_ref(), model.config(), 2).unwrap();
    let table_a = BlockTable {
        blocks: (0..8).map(BlockId).collect(),
    };
    let table_b = BlockTable {
        blocks: (8..16).map(BlockId).collect(),
    };
    let (mut got_a, mut got_b, mut out) = (Vec::new(), Vec::new(), Vec::new());
    // a: prefill chunks of 66 then 3, then one decode row; b: decode rows, then a chunk of 5.
    let plan = [
        (0, 66, 0, 1),
        (66, 69, 1, 2),
        (69, 70, 2, 3),
        (70, 70, 3, 4),
        (70, 70, 4, 9),
    ];
    for (a0, a1, b0, b1) in plan {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        if a1 > a0 {
            let ids: Vec<TokenId> = a[a0..a1].iter().map(|&t| TokenId(t)).collect();
            batch
                .push_run(SeqId(1), &ids, a0, &table_a, LogitsWanted::All)
                .unwrap();
            batch.set_state_slot(SeqId(1), SlotId(1)).unwrap();
        }
        let ids: Vec<TokenId> = b[b0..b1].iter().map(|&t| TokenId(t)).collect();
        batch
            .push_run(SeqId(2), &ids, b0, &table_b, LogitsWanted::All)
            .unwrap();
        batch.set_state_slot(SeqId(2), SlotId(0)).unwrap();
        let _ = model
            .forward_with_state(&batch, &mut kv, &mut state, &mut out)
            .unwrap();
        let split = (a1 - a0) * vocab as usize;
        got_a.extend_from_slice(&out[..split]);
        got_b.extend_from_slice(&out[split..]);
    }
    // Split differently, a run takes the recurrence (one token) or the chunked form (several);
    // both are fp32 and agree to rounding, which the gated norm can lift to ~1e-5.
    assert!(
        rel_err(&got_a, &ref_a) < 1e-4,
        "sequence a: {}",
        rel_err(&got_a, &ref_a)
    );
    assert!(
        rel_err(&got_b, &ref_b) < 1e-4,
        "sequence b: {}",
        rel_err(&got_b, &ref_b)
    );
}
