//! Token ids of prompt segments seen before. Agents re-send the whole conversation every
//! turn; a chat prompt splits at each `<|im_start|>` (an added token, so the tokenizer
//! tokenizes the text between two of them on its own), and every segment but the new ones
//! comes back from here instead of through BPE again.

use std::collections::HashMap;
use std::sync::Arc;

/// Segments shorter than this are tokenized every time (cheaper than keeping them).
pub(crate) const MIN_CACHED_BYTES: usize = 128;

/// Segments' ids, the least recently used dropped beyond a byte budget.
#[derive(Debug)]
pub(crate) struct SegmentCache {
    entries: HashMap<String, Entry>,
    bytes: usize,
    budget: usize,
    clock: u64,
}

#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    last_used: u64,
}

impl SegmentCache {
    /// An empty cache holding at most about `budget` bytes (segment text and ids).
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            entries: HashMap::new(),
            bytes: 0,
            budget,
            clock: 0,
        }
    }

    /// The ids of `segment`, if cached.
    pub(crate) fn get(&mut self, segment: &str) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let entry = self.entries.get_mut(segment)?;
        entry.last_used = self.clock;
        Some(Arc::clone(&entry.ids))
    }

    /// Keeps the ids of `segment`, dropping the least recently used entries over budget.
    pub(crate) fn insert(&mut self, segment: &str, ids: Arc<[u32]>) {
        let size = Self::size(segment, &ids);
        if size > self.budget || self.entries.contains_key(segment) {
            return;
        }
        self.clock += 1;
        while self.bytes + size > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= Self::size(&oldest, &e.ids);
            }
        }
        self.bytes += size;
        self.entries.insert(
            segment.to_string(),
            Entry {
                ids,
                last_used: self.clock,
            },
        );
    }

    fn size(segment: &str, ids: &[u32]) -> usize {
        segment.len() + 4 * ids.len()
    }

    /// Bytes held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

/// `text` cut before every occurrence of `delimiter` (the first piece may not start with
/// it); the pieces concatenate to `text`.
pub(crate) fn split_before<'a>(text: &'a str, delimiter: &str) -> Vec<&'a str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for (at, _) in text.match_indices(delimiter) {
        if at > start {
            pieces.push(&text[start..at]);
        }
        start = at;
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_start_at_each_delimiter_and_concatenate_to_the_text() {
        let d = "<|im_start|>";
        let text = "a<|im_start|>b c<|im_start|><|im_start|>d";
        let pieces = split_before(text, d);
        assert_eq!(
            pieces,
            vec!["a", "<|im_start|>b c", "<|im_start|>", "<|im_start|>d"]
        );
        assert_eq!(pieces.concat(), text);
        assert!(split_before("", d).is_empty());
        assert_eq!(split_before("<|im_start|>x", d), vec!["<|im_start|>x"]);
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_budget_holds() {
        let ids: Arc<[u32]> = Arc::from(vec![1u32; 10]);
        // Each entry: 10 bytes of text + 40 of ids.
        let mut cache = SegmentCache::new(120);
        cache.insert("aaaaaaaaaa", Arc::clone(&ids));
        cache.insert("bbbbbbbbbb", Arc::clone(&ids));
        assert!(cache.get("aaaaaaaaaa").is_some());
        cache.insert("cccccccccc", Arc::clone(&ids));
        assert!(
            cache.get("bbbbbbbbbb").is_none(),
            "b was the least recently used"
        );
        assert!(cache.get("aaaaaaaaaa").is_some());
        assert!(cache.get("cccccccccc").is_some());
        assert_eq!(cache.bytes(), 100);
        cache.insert(&"x".repeat(200), ids);
        assert_eq!(
            cache.bytes(),
            100,
            "an entry over the whole budget is not kept"
        );
    }
}
