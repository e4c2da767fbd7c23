//! Conformance against transformers' fp32 logits on the committed tiny checkpoints
//! (made by scripts/make_fixtures.py): whole-sequence, chunked and token-by-token forwards all
//! match the reference within 1e-4 relative error, and greedy continuations are identical.

mod common;

use common::{fixture_dir, greedy, load, logits_chunked, max_rel_err, read_reference, rel_err};

use corral_model::MoeStrategy;

const FIXTURES: &[&str] = common::QWEN3_FIXTURES;
const STRATEGIES: [MoeStrategy; 5] = common::STRATEGIES;

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
        let generated = greedy(
            &model,
            &reference.greedy_prompt,
            reference.greedy_continuation.len(),
        );
        assert_eq!(
            generated, reference.greedy_continuation,
            "{name} {strategy}"
        );
    }
}
