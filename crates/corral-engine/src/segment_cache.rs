//! Token ids of prompt segments seen before. Agents re-send the whole conversation every
//! turn; a chat prompt splits at each `<|im_start|>` (an added token, so the tokenizer
//! tokenizes the text between two of them on its own), and every segment but the new ones
//! comes back from here instead of through BPE again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Segments shorter than this are tokenized every time (cheaper than keeping them).
pub(crate) const MIN_CACHED_BYTES: usize = 128;

/// Bytes an entry costs beyond its text and ids (its key, handle and table slots), counted
/// against the budget.
const ENTRY_OVERHEAD: usize = 96;

/// Segments' ids, the least recently used dropped beyond a byte budget.
#[derive(Debug)]
pub(crate) struct SegmentCache {
    entries: HashMap<Arc<str>, Entry>,
    /// Segments by last use, oldest first (the text shared with `entries`' key).
    by_use: BTreeMap<u64, Arc<str>>,
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
    /// An empty cache holding at most about `budget` bytes.
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            bytes: 0,
            budget,
            clock: 0,
        }
    }

    /// The ids of `segment`, if cached.
    pub(crate) fn get(&mut self, segment: &str) -> Option<Arc<[u32]>> {
        let entry = self.entries.get_mut(segment)?;
        self.clock += 1;
        if let Some(key) = self.by_use.remove(&entry.last_used) {
            self.by_use.insert(self.clock, key);
        }
        entry.last_used = self.clock;
        Some(Arc::clone(&entry.ids))
    }

    /// Keeps the ids of `segment`, dropping the least recently used entries over budget.
    pub(crate) fn insert(&mut self, segment: &str, ids: Arc<[u32]>) {
        let size = Self::size(segment, &ids);
        if size > self.budget || self.entries.contains_key(segment) {
            return;
        }
        self.evict_to(self.budget - size);
        self.clock += 1;
        self.bytes += size;
        let key: Arc<str> = Arc::from(segment);
        self.by_use.insert(self.clock, Arc::clone(&key));
        self.entries.insert(
            key,
            Entry {
                ids,
                last_used: self.clock,
            },
        );
    }

    /// Drops the least recently used entries until at most `bytes` are held.
    fn evict_to(&mut self, bytes: usize) {
        while self.bytes > bytes {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= Self::size(&oldest, &e.ids);
            }
        }
    }

    /// Holds at most about `budget` bytes from now on, dropping the least recently used
    /// entries over it.
    pub(crate) fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.evict_to(budget);
    }

    fn size(segment: &str, ids: &[u32]) -> usize {
        segment.len() + 4 * ids.len() + ENTRY_OVERHEAD
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The bytes `insert` counts for an entry.
    #[cfg(test)]
    pub(crate) fn entry_bytes(segment: &str, ids: &[u32]) -> usize {
        Self::size(segment, ids)
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
        let one = SegmentCache::entry_bytes("aaaaaaaaaa", &ids);
        let mut cache = SegmentCache::new(2 * one + one / 2);
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
        assert_eq!(cache.bytes(), 2 * one);
        cache.insert(&"x".repeat(4 * one), ids);
        assert_eq!(
            cache.bytes(),
            2 * one,
            "an entry over the whole budget is not kept"
        );
    }

    /// A smaller budget drops the least recently used entries at once.
    #[test]
    fn a_smaller_budget_keeps_the_most_recent() {
        let ids: Arc<[u32]> = Arc::from(vec![1u32; 10]);
        let one = SegmentCache::entry_bytes("aaaaaaaaaa", &ids);
        let mut cache = SegmentCache::new(10 * one);
        for text in ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"] {
            cache.insert(text, Arc::clone(&ids));
        }
        assert!(cache.get("aaaaaaaaaa").is_some());
        cache.set_budget(2 * one);
        assert_eq!(cache.bytes(), 2 * one);
        assert!(cache.get("bbbbbbbbbb").is_none());
        assert!(cache.get("aaaaaaaaaa").is_some() && cache.get("cccccccccc").is_some());
        cache.insert("dddddddddd", ids);
        assert_eq!(cache.bytes(), 2 * one, "the new budget holds for inserts");
    }

    /// Many small entries evicted by one large one: each eviction takes the oldest at once.
    #[test]
    fn a_large_entry_evicts_the_oldest_small_ones() {
        let small: Arc<[u32]> = Arc::from(vec![7u32; 1]);
        let one = SegmentCache::entry_bytes(&format!("{:08}", 0), &small);
        let mut cache = SegmentCache::new(1000 * one);
        for i in 0..1000 {
            cache.insert(&format!("{i:08}"), Arc::clone(&small));
        }
        assert!(cache.get(&format!("{:08}", 0)).is_some());
        let big: Arc<[u32]> = Arc::from(vec![1u32; 100]);
        let text = "y".repeat(10 * one);
        cache.insert(&text, big);
        assert!(cache.get(&text).is_some());
        assert!(cache.get(&format!("{:08}", 0)).is_some(), "used recently");
        assert!(
            cache.get(&format!("{:08}", 1)).is_none(),
            "the oldest unused"
        );
        assert!(cache.bytes() <= 1000 * one);
    }
}
