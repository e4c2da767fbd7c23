//! Long-context conformance against transformers' fp32 logits at the end of long sequences
//! (fixtures made by scripts/make_long_fixtures.py): Qwen3 with YaRN scaling at 32,768 tokens,
//! four times its original context, and a Qwen3.5 hybrid's partial RoPE at 8,192 positions,
//! prefilled whole (the CPU's tiled attention over every key) and in chunks that do not divide
//! the sequence.

mod common;

use common::{LONG_TAIL, load, logits_chunked, read_long_reference, rel_err, worst_row_rel_err};

fn check(name: &str, len: usize) {
    let model = load(name);
    let vocab = model.config().vocab_size;
    let (tokens, reference) = read_long_reference(name);
    assert_eq!(tokens.len(), len);
    for chunk in [tokens.len(), 3000] {
        let all = logits_chunked(&model, &tokens, chunk);
        let tail = &all[all.len() - LONG_TAIL * vocab..];
        let (err, worst) = (
            rel_err(tail, &reference),
            worst_row_rel_err(tail, &reference, vocab),
        );
        eprintln!("{name} chunk {chunk}: relative error {err:.2e}, worst row {worst:.2e}");
        assert!(err <= 1e-4, "{name} chunk {chunk}: relative error {err:e}");
        assert!(worst <= 2e-4, "{name} chunk {chunk}: worst row {worst:e}");
    }
}

#[test]
fn yarn_logits_match_transformers_at_32k_four_times_the_original_context() {
    let yarn = load("long_qwen3_yarn").config().rope.yarn;
    let y = yarn.expect("the fixture asks for YaRN");
    assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 8192));
    check("long_qwen3_yarn", 32_768);
}

#[test]
fn hybrid_partial_rope_matches_transformers_at_long_positions() {
    check("long_qwen3_5", 8192);
}
