//! Text ↔ token ids with the checkpoint's `tokenizer.json`, and incremental detokenisation
//! that never emits half a UTF-8 character.

use std::path::Path;
use std::sync::{Arc, Mutex};

use corral_model::checkpoint::gguf_file::GgufHeader;

use crate::EngineError;
use crate::segment_cache::{MIN_CACHED_BYTES, SegmentCache, split_before};

/// Where chat prompts split into separately tokenized segments.
const SEGMENT_DELIMITER: &str = "<|im_start|>";

/// Bytes of prompt segments (text and ids) whose tokenization is kept, at most.
const SEGMENT_CACHE_BYTES: usize = 64 << 20;
/// ... and at least, once fitted to a KV pool.
const SEGMENT_CACHE_MIN_BYTES: usize = 1 << 20;
/// Bytes a cached token takes: about 4 of text and 4 of id, and its share of its segment's
/// entry, with room to spare.
const SEGMENT_BYTES_PER_TOKEN: usize = 16;

/// The checkpoint's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Added (special) tokens' text by id.
    added: std::collections::HashMap<u32, String>,
    /// For a byte-level BPE vocabulary, the byte each character of a token string stands
    /// for (GPT-2's alphabet, indexed by the character's code point).
    byte_of_char: Option<Vec<Option<u8>>>,
    /// Ids of segments of earlier prompts, when the vocabulary has SEGMENT_DELIMITER as an
    /// added token matched as written (then the text on either side of it is tokenized on
    /// its own, and a segment's ids do not depend on what surrounds it).
    segments: Option<Mutex<SegmentCache>>,
}

impl Tokenizer {
    /// The compiler of constraints over this vocabulary; `eos`: the ids that end a document.
    pub fn grammar_compiler(&self, eos: &[u32]) -> Result<crate::GrammarCompiler, EngineError> {
        crate::GrammarCompiler::new(&self.inner, eos)
    }

    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        if !path.exists() {
            return Err(EngineError::Tokenizer {
                path: path.to_path_buf(),
                detail: "file not found".to_string(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| EngineError::Tokenizer {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        Ok(Self::from_inner(inner))
    }

    /// The vocabulary a GGUF file carries (`tokenizer.ggml.*`), as the `tokenizer.json` it
    /// was converted from.
    pub fn from_gguf(header: &GgufHeader, path: &Path) -> Result<Self, EngineError> {
        let json = crate::gguf_vocab::tokenizer_json(header, path)?;
        let invalid = |detail: String| EngineError::Tokenizer {
            path: path.to_path_buf(),
            detail,
        };
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| invalid(e.to_string()))?;
        for (id, token) in inner.get_added_tokens_decoder() {
            if inner.token_to_id(&token.content) != Some(id) {
                return Err(invalid(format!(
                    "added token `{}` did not keep its id {id}",
                    token.content
                )));
            }
        }
        Ok(Self::from_inner(inner))
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let added = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .collect();
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        let splits = splits_cleanly(&inner);
        Self {
            inner,
            added,
            byte_of_char: byte_level.then(byte_level_alphabet),
            segments: splits.then(|| Mutex::new(SegmentCache::new(SEGMENT_CACHE_BYTES))),
        }
    }

    /// Sizes the cache of earlier prompts' segments for a KV pool of `tokens` tokens (1 to
    /// 64 MiB), and returns its budget in bytes. A conversation whose KV is no longer held
    /// costs a prefill or a read from disk, beside which tokenizing it again is nothing; so
    /// segments beyond what the pool holds are not worth their memory.
    pub fn fit_segment_cache(&self, tokens: usize) -> usize {
        let budget = tokens
            .saturating_mul(SEGMENT_BYTES_PER_TOKEN)
            .clamp(SEGMENT_CACHE_MIN_BYTES, SEGMENT_CACHE_BYTES);
        match &self.segments {
            Some(cache) => {
                cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .set_budget(budget);
                budget
            }
            None => 0,
        }
    }

    /// Bytes the cache of earlier prompts' segments holds now (at most 64 MiB, or what
    /// [`Self::fit_segment_cache`] set).
    pub fn segment_cache_bytes(&self) -> usize {
        self.segments
            .as_ref()
            .map_or(0, |c| c.lock().unwrap_or_else(|e| e.into_inner()).bytes())
    }

    /// The bytes token `id` stands for: one token of a byte-level vocabulary may hold part
    /// of a UTF-8 character, which decoding it alone replaces by U+FFFD. Other vocabularies
    /// (and unknown ids) give their decoded text's bytes.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, EngineError> {
        if let Some(text) = self.added.get(&id) {
            return Ok(text.as_bytes().to_vec());
        }
        if let (Some(table), Some(token)) = (&self.byte_of_char, self.inner.id_to_token(id)) {
            let bytes: Option<Vec<u8>> = token
                .chars()
                .map(|c| table.get(c as usize).copied().flatten())
                .collect();
            if let Some(bytes) = bytes {
                return Ok(bytes);
            }
        }
        Ok(self.decode(&[id])?.into_bytes())
    }

    /// Token ids of `text`; special tokens written in the text (`<|im_start|>`) are
    /// recognised, and no BOS or other tokens are added.
    /// A chat prompt's segments seen in earlier prompts (the re-sent history) are not
    /// tokenized again.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let Some(cache) = &self.segments else {
            return self.encode_whole(text);
        };
        let mut ids = Vec::new();
        for piece in split_before(text, SEGMENT_DELIMITER) {
            if piece.len() < MIN_CACHED_BYTES {
                ids.extend(self.encode_whole(piece)?);
                continue;
            }
            // The cache holds no invariant a panic could break: a poisoned lock is used as is.
            let lock = || {
                cache
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            };
            let cached = lock().get(piece);
            match cached {
                Some(hit) => ids.extend_from_slice(&hit),
                None => {
                    let fresh: Arc<[u32]> = self.encode_whole(piece)?.into();
                    ids.extend_from_slice(&fresh);
                    lock().insert(piece, fresh);
                }
            }
        }
        Ok(ids)
    }

    /// Token ids of `text` through the tokenizer, no cache.
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenize(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.decode_with(ids, false)
    }

    /// Text of `ids`, without the vocabulary's special tokens (`<|im_start|>`,
    /// `<|endoftext|>`; not `<think>` or `<tool_call>`, which are plain added tokens) when
    /// `skip_special`.
    pub fn decode_with(&self, ids: &[u32], skip_special: bool) -> Result<String, EngineError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| EngineError::Tokenize(e.to_string()))
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Whether a text's ids are its segments' ids (split before each SEGMENT_DELIMITER)
/// concatenated: the delimiter is an added token matched as written, with no stripping
/// around it; no other added token contains it or ends with its beginning (the tokenizer
/// matches the leftmost, longest added token, which would then win over the delimiter);
/// and nothing is truncated or padded per call.
fn splits_cleanly(inner: &tokenizers::Tokenizer) -> bool {
    let added = inner.get_added_tokens_decoder();
    let delimiter_plain = added.values().any(|t| {
        t.content == SEGMENT_DELIMITER && !t.normalized && !t.lstrip && !t.rstrip && !t.single_word
    });
    let overlaps = added.values().any(|t| {
        t.content != SEGMENT_DELIMITER
            && (t.content.contains(SEGMENT_DELIMITER)
                || (1..SEGMENT_DELIMITER.len()).any(|n| {
                    SEGMENT_DELIMITER.is_char_boundary(n)
                        && t.content.ends_with(&SEGMENT_DELIMITER[..n])
                }))
    });
    delimiter_plain
        && !overlaps
        && inner.get_truncation().is_none()
        && inner.get_padding().is_none()
}

/// GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the other 68
/// for code points 256 onwards in byte order.
fn byte_level_alphabet() -> Vec<Option<u8>> {
    let mut table = vec![None; 256 + 68];
    let mut next = 256;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
}

/// Turns a growing list of generated ids into text pieces as they become complete.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Whether special tokens stay in the text.
    keep_special: bool,
}

impl IncrementalDecoder {
    /// A decoder that drops special tokens from the text (as clients expect), or keeps
    /// them (`skip_special_tokens: false`).
    pub fn new(skip_special: bool) -> Self {
        Self {
            keep_special: !skip_special,
            ..Self::default()
        }
    }

    fn text(&self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String, EngineError> {
        tokenizer.decode_with(ids, !self.keep_special)
    }

    /// Adds `id`; returns the text it completes, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, EngineError> {
        self.ids.push(id);
        let prefix = self.text(tokenizer, &self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.text(tokenizer, &self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(Some(full[prefix.len()..].to_string()));
        }
        Ok(None)
    }

    /// Whatever text is still held back at the end of generation.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, EngineError> {
        let prefix = self.text(tokenizer, &self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.text(tokenizer, &self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            return Ok(Some(full[prefix.len()..].to_string()));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/tiny-qwen3-moe/tokenizer.json");
        Tokenizer::from_file(&path).unwrap()
    }

    /// Pieces of text that stress the segment split: added tokens, whitespace at the
    /// borders, combining marks (NFC composes across them), multi-byte characters.
    const PIECES: [&str; 16] = [
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</tool_call>",
        "user\n",
        "assistant",
        " the file",
        "  ",
        "\n\n",
        "\t",
        "e\u{301}",
        "\u{301}",
        "世界",
        "🦀",
        "Grüße",
        " search result path line error test build value config output",
    ];

    proptest::proptest! {
        /// With the segment cache, a prompt's ids are the tokenizer's for the whole text,
        /// the first time, the second (every segment cached) and when it extends an earlier
        /// prompt.
        #[test]
        fn segment_cached_ids_equal_the_whole_texts(
            picks in proptest::collection::vec(0..PIECES.len(), 0..120),
            cut in 0usize..120,
        ) {
            let t = tokenizer();
            let text: String = picks.iter().map(|&i| PIECES[i]).collect();
            let earlier: String = picks[..cut.min(picks.len())].iter().map(|&i| PIECES[i]).collect();
            let whole = t.encode_whole(&text).unwrap();
            t.encode(&earlier).unwrap();
            proptest::prop_assert_eq!(&t.encode(&text).unwrap(), &whole);
            proptest::prop_assert_eq!(&t.encode(&text).unwrap(), &whole);
        }
    }

    /// A conversation's earlier segments are served from the cache: tokenizing the next turn
    /// adds only its new segments.
    #[test]
    fn a_resent_history_is_not_tokenized_again() {
        let t = tokenizer();
        let turn = |n: usize| -> String {
            (0..n)
                .map(|i| {
                    format!(
                        "<|im_start|>user\n{}<|im_end|>\n",
                        "a long message ".repeat(20 + i)
                    )
                })
                .collect()
        };
        let cached = |t: &Tokenizer| t.segments.as_ref().unwrap().lock().unwrap().bytes();
        t.encode(&turn(3)).unwrap();
        let after_three = cached(&t);
        assert!(after_three > 0);
        assert_eq!(
            t.encode(&turn(4)).unwrap(),
            t.encode_whole(&turn(4)).unwrap()
        );
        let added = cached(&t) - after_three;
        let fourth = format!(
            "<|im_start|>user\n{}<|im_end|>\n",
            "a long message ".repeat(23)
        );
        let fourth_ids = t.encode_whole(&fourth).unwrap();
        assert_eq!(
            added,
            SegmentCache::entry_bytes(&fourth, &fourth_ids),
            "only the new segment was added"
        );
    }

    /// The segment cache fitted to a KV pool holds 16 bytes a pool token, 1 to 64 MiB, and
    /// drops what is over at once.
    #[test]
    fn the_segment_cache_fits_the_kv_pool() {
        let t = tokenizer();
        assert_eq!(t.fit_segment_cache(10), 1 << 20);
        assert_eq!(t.fit_segment_cache(200_000), 3_200_000);
        assert_eq!(t.fit_segment_cache(usize::MAX), 64 << 20);
        let long = |i: usize| format!("<|im_start|>user\n{i} {}<|im_end|>\n", "words ".repeat(200));
        let text: String = (0..4000).map(long).collect();
        t.encode(&text).unwrap();
        assert!(
            t.segment_cache_bytes() > 1 << 20,
            "{}",
            t.segment_cache_bytes()
        );
        t.fit_segment_cache(0);
        assert!(t.segment_cache_bytes() <= 1 << 20);
    }

    /// No segments where splitting could change the ids: a delimiter that strips whitespace
    /// around it, another added token that ends with the delimiter's start (it would win the
    /// match), or truncation; the ids are the whole text's all the same.
    #[test]
    fn no_segments_where_the_split_is_not_clean() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/tiny-qwen3-moe/tokenizer.json");
        let original: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let text = format!("{}  \n<|im_start|>x <|im_start|>y", "y ".repeat(100));
        type Change = fn(&mut serde_json::Value);
        let variants: [(&str, Change); 3] = [
            ("lstrip", |json| {
                for token in json["added_tokens"].as_array_mut().unwrap() {
                    if token["content"] == SEGMENT_DELIMITER {
                        token["lstrip"] = serde_json::Value::Bool(true);
                    }
                }
            }),
            ("an overlapping added token", |json| {
                json["added_tokens"]
                    .as_array_mut()
                    .unwrap()
                    .push(serde_json::json!({
                        "id": 1543, "content": "\n<|im", "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": true,
                    }));
            }),
            ("truncation", |json| {
                json["truncation"] = serde_json::json!({
                    "direction": "Right", "max_length": 64, "strategy": "LongestFirst",
                    "stride": 0,
                });
            }),
        ];
        for (what, change) in variants {
            let mut json = original.clone();
            change(&mut json);
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("tokenizer.json");
            std::fs::write(&file, json.to_string()).unwrap();
            let t = Tokenizer::from_file(&file).unwrap();
            assert!(t.segments.is_none(), "{what}");
            assert_eq!(
                t.encode(&text).unwrap(),
                t.encode_whole(&text).unwrap(),
                "{what}"
            );
        }
    }

    /// Generated special tokens leave the text unless asked for; `<think>` stays.
    #[test]
    fn special_tokens_are_skipped_unless_kept() {
        let t = tokenizer();
        let ids = t
            .encode("<think>a</think>b<|im_start|>c<|endoftext|>")
            .unwrap();
        for (skip, expected) in [
            (true, "<think>a</think>bc"),
            (false, "<think>a</think>b<|im_start|>c<|endoftext|>"),
        ] {
            let mut d = IncrementalDecoder::new(skip);
            let mut text = String::new();
            for &id in &ids {
                text.extend(d.push(&t, id).unwrap());
            }
            text.extend(d.finish(&t).unwrap());
            assert_eq!(text, expected, "skip {skip}");
        }
    }

    /// Each token's bytes, concatenated, are the text's UTF-8 bytes, also where a token holds
    /// part of a character (its text alone is U+FFFD) and for special tokens.
    #[test]
    fn token_bytes_rebuild_the_text_exactly() {
        let t = tokenizer();
        for text in ["Grüße, 世界! 🙂🦀 ok", "<|im_start|>user\n\tcafé<|im_end|>"] {
            let ids = t.encode(text).unwrap();
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| t.token_bytes(id).unwrap())
                .collect();
            assert_eq!(bytes, text.as_bytes(), "{text}");
            assert!(
                !text.starts_with('G')
                    || ids
                        .iter()
                        .any(|&id| t.decode(&[id]).unwrap().contains('\u{FFFD}')),
                "the test text should split a character across tokens"
            );
        }
    }
}
