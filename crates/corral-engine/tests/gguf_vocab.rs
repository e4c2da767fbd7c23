//! The vocabulary and chat template a GGUF file carries give what the checkpoint's own
//! `tokenizer.json` and `tokenizer_config.json` give (the repository's small model, converted
//! by scripts/make_gguf_fixtures.py as llama.cpp's converter writes GGUF).

use std::path::{Path, PathBuf};

use corral_engine::{Tokenizer, TokenizerConfig, stop_token_ids};
use corral_model::checkpoint::GgufCheckpoint;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn a_gguf_vocabulary_tokenizes_and_decodes_as_its_tokenizer_json() {
    let dir = repo().join("models/tiny-qwen3-moe");
    let path = repo().join("tests/fixtures/gguf/tiny-qwen3-moe.gguf");
    let gguf = GgufCheckpoint::open(&path).unwrap();
    let ours = Tokenizer::from_gguf(gguf.header(), &path).unwrap();
    let theirs = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let texts = [
        "Hello, world!",
        "<|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces,\ttabs\n\nand new lines  ",
        "naïve café — ünïcödé, 日本語, emoji 🦀",
        "I'll they're we've it's DON'T",
        "<think>\nreasoning\n</think>\n\n<tool_call>{\"a\": 1}</tool_call>",
        "",
    ];
    for text in texts {
        let (a, b) = (ours.encode(text).unwrap(), theirs.encode(text).unwrap());
        assert_eq!(a, b, "{text:?}");
        assert_eq!(
            ours.decode(&a).unwrap(),
            theirs.decode(&b).unwrap(),
            "{text:?}"
        );
        // Which added tokens are special (control) and which are user-defined.
        assert_eq!(
            ours.decode_with(&a, true).unwrap(),
            theirs.decode_with(&b, true).unwrap(),
            "{text:?} without special tokens"
        );
    }
    for id in 0..1543 {
        assert_eq!(
            ours.token_bytes(id).unwrap(),
            theirs.token_bytes(id).unwrap(),
            "token {id}"
        );
    }
    let from_gguf = TokenizerConfig::from_gguf(gguf.header());
    let from_dir = TokenizerConfig::from_dir(&dir).unwrap();
    assert!(from_gguf.chat_template.is_some());
    assert_eq!(from_gguf.chat_template, from_dir.chat_template);
    assert_eq!(from_gguf.eos_token.as_deref(), Some("<|im_end|>"));
    // The ids that end generation: generation_config.json's for the directory, the
    // vocabulary's end tokens for the GGUF file.
    let (mut from_dir, mut from_file) = (
        stop_token_ids(&dir, &[1538]).unwrap(),
        stop_token_ids(&path, &[1538]).unwrap(),
    );
    from_dir.sort_unstable();
    from_file.sort_unstable();
    assert_eq!(from_file, from_dir);
    assert!(from_dir.len() > 1, "{from_dir:?}");
}
