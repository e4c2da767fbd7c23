//! Prompt lookup: the sequence's last tokens found earlier in its own prompt and output, and
//! the tokens that followed them there proposed. Agents re-emit code and text from their
//! context (an edited file, a quoted error, a path), where this drafts long runs right.
//!
//! Each sequence keeps an index of where each `min_match`-token run ends, grown with the
//! sequence, so that a proposal looks only at the places its suffix could match (the latest
//! [`MAX_CANDIDATES`] of them) instead of scanning a long context every step.

use std::collections::HashMap;

use corral_model::SeqId;

use crate::Drafter;

/// Most earlier occurrences of a suffix's last `min_match` tokens a proposal compares, the
/// latest first (a run repeated more often than this is matched among its latest).
const MAX_CANDIDATES: usize = 256;

/// Drafts the continuation of the latest earlier occurrence of the sequence's longest
/// matching suffix (`min_match` tokens at least, `max_match` compared at most).
#[derive(Clone, Debug)]
pub struct LookupDrafter {
    min_match: usize,
    max_match: usize,
    /// Each sequence's index of its runs.
    seqs: HashMap<SeqId, RunIndex>,
}

/// Where each `min_match`-token run of a sequence ends, for positions `..indexed`. A
/// sequence's tokens only grow (drafts are not among them); one found otherwise is indexed
/// afresh.
#[derive(Clone, Debug, Default)]
struct RunIndex {
    indexed: usize,
    /// The token at `indexed - 1` when it was indexed, to notice a sequence that changed.
    last: Option<u32>,
    ends: HashMap<u64, Vec<u32>>,
}

impl Default for LookupDrafter {
    /// Suffixes of 2 to 8 tokens (a single token repeats too often to predict much).
    fn default() -> Self {
        Self::new(2, 8)
    }
}

impl LookupDrafter {
    /// A drafter matching suffixes of `min_match..=max_match` tokens (`min_match` at least 1).
    pub fn new(min_match: usize, max_match: usize) -> Self {
        let min_match = min_match.max(1);
        Self {
            min_match,
            max_match: max_match.max(min_match),
            seqs: HashMap::new(),
        }
    }

    /// The key of the `min_match` tokens ending at `end`.
    fn key(&self, tokens: &[u32], end: usize) -> u64 {
        tokens[end + 1 - self.min_match..=end]
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
                (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3)
            })
    }

    /// Matched tokens of the earlier occurrence ending at `end` (none below `min_match`).
    fn match_len(&self, tokens: &[u32], end: usize) -> usize {
        let n = tokens.len();
        (1..=self.max_match.min(end + 1))
            .take_while(|&k| tokens[end + 1 - k] == tokens[n - k])
            .last()
            .unwrap_or(0)
    }

    /// [`LookupDrafter::find`] through `seq`'s index, grown to `tokens` first.
    fn find_indexed(&mut self, seq: SeqId, tokens: &[u32]) -> Option<(usize, usize)> {
        let n = tokens.len();
        if n < self.min_match + 1 {
            return None;
        }
        let mut index = self.seqs.remove(&seq).unwrap_or_default();
        if index.indexed > n || (index.indexed > 0 && index.last != Some(tokens[index.indexed - 1]))
        {
            index = RunIndex::default();
        }
        // Runs end at positions before the last token (whose own run is the suffix).
        let first = index.indexed.max(self.min_match - 1);
        for end in first..n - 1 {
            let key = self.key(tokens, end);
            index.ends.entry(key).or_default().push(end as u32);
        }
        index.indexed = n - 1;
        index.last = Some(tokens[n - 2]);
        let mut best: Option<(usize, usize)> = None;
        if let Some(ends) = index.ends.get(&self.key(tokens, n - 1)) {
            for &end in ends.iter().rev().take(MAX_CANDIDATES) {
                let end = end as usize;
                let len = self.match_len(tokens, end);
                if len >= self.min_match && best.is_none_or(|(_, l)| len > l) {
                    best = Some((end + 1, len));
                    if len == self.max_match {
                        break;
                    }
                }
            }
        }
        self.seqs.insert(seq, index);
        best
    }

    /// `(start of the continuation, tokens matched)` of the best earlier occurrence of a
    /// suffix of `tokens`: the longest match, the latest among equals. (Every earlier
    /// position scanned: what the index finds, for the tests.)
    pub fn find(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        let n = tokens.len();
        let &last = tokens.last()?;
        let mut best: Option<(usize, usize)> = None;
        // Every earlier place the last token occurs ends a candidate match; it extends
        // backwards as far as the tokens agree.
        for end in (0..n - 1).rev() {
            if tokens[end] != last {
                continue;
            }
            let len = self.match_len(tokens, end);
            if len >= self.min_match && best.is_none_or(|(_, l)| len > l) {
                best = Some((end + 1, len));
                if len == self.max_match {
                    break;
                }
            }
        }
        best
    }
}

impl Drafter for LookupDrafter {
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        match self.find_indexed(seq, tokens) {
            Some((from, _)) => tokens[from..(from + max).min(tokens.len())].to_vec(),
            None => Vec::new(),
        }
    }

    fn forget(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_latest_match_is_continued() {
        let mut d = LookupDrafter::new(2, 4);
        // "1 2 3" occurs twice before the end; the latest continuation is "9 9".
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3];
        assert_eq!(d.find(&tokens), Some((8, 3)));
        assert_eq!(d.propose(SeqId(0), &tokens, 2), vec![9, 9]);
        // A longer match wins over a later, shorter one.
        let tokens = [0, 1, 2, 3, 7, 8, 5, 2, 3, 6, 0, 1, 2, 3];
        assert_eq!(d.find(&tokens), Some((4, 4)));
        assert_eq!(
            d.propose(SeqId(1), &tokens, 9),
            vec![7, 8, 5, 2, 3, 6, 0, 1, 2]
        );
    }

    #[test]
    fn too_short_a_match_proposes_nothing() {
        let mut d = LookupDrafter::new(3, 8);
        assert!(d.propose(SeqId(0), &[1, 2, 5, 2], 4).is_empty());
        assert!(d.propose(SeqId(0), &[], 4).is_empty());
        assert!(d.propose(SeqId(0), &[7], 4).is_empty());
        let mut d = LookupDrafter::new(1, 1);
        assert_eq!(d.propose(SeqId(0), &[4, 6, 4], 4), vec![6, 4]);
    }

    proptest::proptest! {
        /// The index proposes what scanning every earlier position finds, as the sequence
        /// grows a token at a time (few distinct tokens, so that runs repeat often).
        #[test]
        fn the_index_finds_what_a_scan_finds(
            tokens in proptest::collection::vec(0u32..4, 1..300),
            min_match in 1usize..4,
            extra in 0usize..6,
        ) {
            let mut d = LookupDrafter::new(min_match, min_match + extra);
            for n in 1..=tokens.len() {
                let seen = &tokens[..n];
                proptest::prop_assert_eq!(d.find_indexed(SeqId(3), seen), d.find(seen), "{} tokens", n);
            }
        }
    }
}
