//! Text ↔ token ids with the checkpoint's `tokenizer.json`, and incremental detokenisation
//! that never emits half a UTF-8 character.

use std::path::Path;

use crate::EngineError;

/// The checkpoint's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Added (special) tokens' text by id.
    added: std::collections::HashMap<u32, String>,
    /// For a byte-level BPE vocabulary, the byte each character of a token string stands
    /// for (GPT-2's alphabet, indexed by the character's code point).
    byte_of_char: Option<Vec<Option<u8>>>,
}

impl Tokenizer {
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
        let added = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, token)| (id, token.content))
            .collect();
        let byte_level = matches!(
            inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        Ok(Self {
            inner,
            added,
            byte_of_char: byte_level.then(byte_level_alphabet),
        })
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
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
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
