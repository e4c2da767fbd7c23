//! Conformance against transformers' fp32 logits on the committed tiny checkpoints
//! (made by scripts/make_fixtures.py): whole-sequence, chunked and token-by-token forwards all
//! match the reference within 1e-4 relative error, and greedy continuations are identical.

mod common;

use common::{fixture_dir, load, max_rel_err, read_reference, rel_err};

use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, MoeStrategy, PagedKvCache, RaggedBatch, SeqId,
    TokenId,
};

const FIXTURES: &[&str] = &[
    "qwen3_moe_fused",
    "qwen3_moe_per_expert",
    "qwen3_moe_sharded",
    "qwen3_dense",
];
const BLOCK_SIZE: usize = 16;
const STRATEGIES: [MoeStrategy; 4] = [
    MoeStrategy::PerExpert,
    MoeStrategy::PerToken,
    MoeStrategy::Grouped,
    MoeStrategy::Auto {
        grouped_min_tokens: 4,
    },
];

fn table(blocks: usize) -> BlockTable {
    BlockTable {
        blocks: (0..blocks as u32).map(BlockId).collect(),
    }
}

/// Logits of every position, fed `chunk` tokens per forward.
fn logits_chunked(model: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let blocks = tokens.len().div_ceil(BLOCK_SIZE);
    let mut cache =
        PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, BLOCK_SIZE).unwrap();
    let mut all = Vec::new();
    let mut out = Vec::new();
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        let ids: Vec<TokenId> = piece.iter().map(|&t| TokenId(t)).collect();
        batch
            .push_run(SeqId(0), &ids, i * chunk, &table(blocks), LogitsWanted::All)
            .unwrap();
        let _ = model.forward(&batch, &mut cache, &mut out).unwrap();
        all.extend_from_slice(&out);
    }
    all
}

#[test]
fn logits_match_transformers_at_every_chunk_size_and_strategy() {
    for name in FIXTURES {
        let mut model = load(name);
        let reference = read_reference(&fixture_dir(name));
        for strategy in STRATEGIES {
            model.set_moe_strategy(strategy);
            for chunk in [1, 7, reference.token_ids.len()] {
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
fn strategies_agree_within_1e_5() {
    for name in FIXTURES {
        let mut model = load(name);
        let reference = read_reference(&fixture_dir(name));
        for chunk in [1, 7, reference.token_ids.len()] {
            model.set_moe_strategy(MoeStrategy::PerExpert);
            let baseline = logits_chunked(&model, &reference.token_ids, chunk);
            for strategy in &STRATEGIES[1..] {
                model.set_moe_strategy(*strategy);
                let other = logits_chunked(&model, &reference.token_ids, chunk);
                let err = rel_err(&other, &baseline);
                assert!(
                    err <= 1e-5,
                    "{name} {strategy} vs per-expert at chunk {chunk}: {err:e}"
                );
                let worst = max_rel_err(&other, &baseline);
                assert!(
                    worst <= 1e-5,
                    "{name} {strategy} vs per-expert at chunk {chunk}: element {worst:e}"
                );
            }
        }
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for (name, strategy) in FIXTURES.iter().flat_map(|n| STRATEGIES.map(|s| (n, s))) {
        let mut model = load(name);
        model.set_moe_strategy(strategy);
        let reference = read_reference(&fixture_dir(name));
        let vocab = model.config().vocab_size;
        let total = reference.greedy_prompt.len() + reference.greedy_continuation.len();
        let blocks = total.div_ceil(BLOCK_SIZE);
        let mut cache =
            PagedKvCache::new(model.backend().as_ref(), model.config(), blocks, BLOCK_SIZE)
                .unwrap();
        let mut next: Vec<u32> = reference.greedy_prompt.clone();
        let mut position = 0;
        let mut generated = Vec::new();
        let mut logits = Vec::new();
        while generated.len() < reference.greedy_continuation.len() {
            let mut batch = RaggedBatch::new(BLOCK_SIZE);
            let ids: Vec<TokenId> = next.iter().map(|&t| TokenId(t)).collect();
            batch
                .push_run(SeqId(7), &ids, position, &table(blocks), LogitsWanted::Last)
                .unwrap();
            let _ = model.forward(&batch, &mut cache, &mut logits).unwrap();
            assert_eq!(logits.len(), vocab);
            position += next.len();
            let best = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            generated.push(best);
            next = vec![best];
        }
        assert_eq!(
            generated, reference.greedy_continuation,
            "{name} {strategy}"
        );
    }
}
