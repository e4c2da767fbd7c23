//! Text ↔ token ids with the checkpoint's `tokenizer.json`, and incremental detokenisation
//! that never emits half a UTF-8 character.

use std::path::Path;

use crate::EngineError;

/// The checkpoint's tokenizer.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
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
        Ok(Self { inner })
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
        self.inner
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenize(e.to_string()))
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Turns a growing list of generated ids into text pieces as they become complete.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Adds `id`; returns the text it completes, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, EngineError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
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
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            return Ok(Some(full[prefix.len()..].to_string()));
        }
        Ok(None)
    }
}
