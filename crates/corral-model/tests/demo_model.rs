//! The trained demo model (`models/corral-demo`) on the CPU: the greedy continuations of a few
//! fixed chat prompts are the same under every MoE strategy and every prefill chunking. A model
//! that predicts puts real margins between its top tokens, so this is where an error in one
//! path shows as a different word rather than as a small relative error.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{STRATEGIES, greedy_chunked};
use corral_cpu::CpuBackend;
use corral_model::{Model, MoeStrategy};

/// The demo model's directory (`CORRAL_DEMO_MODEL` points elsewhere, for a model in training).
fn demo_dir() -> PathBuf {
    std::env::var_os("CORRAL_DEMO_MODEL").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/corral-demo"),
        PathBuf::from,
    )
}

/// The prompts, rendered as the chat template renders one user turn with thinking off.
const QUESTIONS: [&str; 3] = [
    "Hello, who are you?",
    "What does \"ornithology\" mean?",
    "What does the ls command do?",
];

fn prompt_ids(tokenizer: &tokenizers::Tokenizer, question: &str) -> Vec<u32> {
    let text = format!(
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    let encoding = tokenizer.encode(text, false).expect("encode prompt");
    encoding.get_ids().to_vec()
}

#[test]
fn demo_model_greedy_tokens_agree_across_strategies_and_chunking() {
    let dir = demo_dir();
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut model =
        Model::load(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).expect("load demo model");
    const COUNT: usize = 24;
    for question in QUESTIONS {
        let prompt = prompt_ids(&tokenizer, question);
        model.set_moe_strategy(MoeStrategy::PerExpert);
        let baseline = greedy_chunked(&model, &prompt, COUNT, prompt.len());
        let text = tokenizer.decode(&baseline, false).unwrap_or_default();
        eprintln!("{question:?} → {text:?}");
        for strategy in STRATEGIES {
            model.set_moe_strategy(strategy);
            for chunk in [1, 5, 16, prompt.len()] {
                let tokens = greedy_chunked(&model, &prompt, COUNT, chunk);
                assert_eq!(
                    tokens, baseline,
                    "{question:?}: {strategy} with prefill chunks of {chunk} against per-expert whole"
                );
            }
        }
    }
}
