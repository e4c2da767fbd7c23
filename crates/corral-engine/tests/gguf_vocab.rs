//! The vocabulary and chat template a GGUF file carries give what the checkpoint's own
//! `tokenizer.json` and `tokenizer_config.json` give (the repository's small model, converted
//! by scripts/make_gguf_fixtures.py as llama.cpp's converter writes GGUF).

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use corral_engine::{Tokenizer, TokenizerConfig, stop_token_ids};
use corral_model::checkpoint::GgufCheckpoint;
use corral_model::checkpoint::gguf_file::parse_header;
use proptest::prelude::*;

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

/// `tiny-qwen3-moe.gguf`'s bytes and its header's length, read once for every fuzz case.
static VOCAB_FILE: LazyLock<(PathBuf, Vec<u8>, usize)> = LazyLock::new(|| {
    let path = repo().join("tests/fixtures/gguf/tiny-qwen3-moe.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let header_len = parse_header(&bytes).unwrap().data_offset;
    (path, bytes, header_len)
});

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Fuzzing the vocabulary a GGUF header carries (tokens, types, merges, special ids, the
    /// chat template): bytes of a real header changed, what parses builds a tokenizer or an
    /// error, never a panic, and a tokenizer that builds encodes and decodes.
    #[test]
    fn mutated_vocabularies_build_or_are_refused(
        edits in prop::collection::vec(
            (
                any::<prop::sample::Index>(),
                // Printable bytes half the time, so that edited strings often stay UTF-8.
                prop_oneof![any::<u8>(), 0x20u8..0x7f],
                // Half the edits inside a string's text (the next printable byte): a changed
                // length or count mostly stops the header parse before the vocabulary.
                any::<bool>(),
            ),
            1..5,
        ),
    ) {
        let (path, original, header_len) = &*VOCAB_FILE;
        let (mut bytes, header_len) = (original.clone(), *header_len);
        for (at, value, in_text) in edits {
            let mut at = at.index(header_len);
            while in_text && at + 1 < header_len && !bytes[at].is_ascii_graphic() {
                at += 1;
            }
            bytes[at] = value;
        }
        let Ok(header) = parse_header(&bytes) else {
            return Ok(());
        };
        let _ = TokenizerConfig::from_gguf(&header);
        if let Ok(tokenizer) = Tokenizer::from_gguf(&header, path)
            && let Ok(ids) = tokenizer.encode("<|im_start|>user\nnaïve café, 12345 🦀<|im_end|>")
        {
            let _ = tokenizer.decode(&ids);
            let _ = tokenizer.decode_with(&ids, true);
        }
    }
}
