//! Prompt lookup: the sequence's last tokens found earlier in its own prompt and output, and
//! the tokens that followed them there proposed. Agents re-emit code and text from their
//! context (an edited file, a quoted error, a path), where this drafts long runs right.

use corral_model::SeqId;

use crate::Drafter;

/// Drafts the continuation of the latest earlier occurrence of the sequence's longest
/// matching suffix (`min_match` tokens at least, `max_match` compared at most).
#[derive(Clone, Copy, Debug)]
pub struct LookupDrafter {
    min_match: usize,
    max_match: usize,
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
        }
    }

    /// `(start of the continuation, tokens matched)` of the best earlier occurrence of a
    /// suffix of `tokens`: the longest match, the latest among equals.
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
            let len = (1..=self.max_match.min(end + 1))
                .take_while(|&k| tokens[end + 1 - k] == tokens[n - k])
                .last()
                .unwrap_or(0);
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
    fn propose(&mut self, _seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        match self.find(tokens) {
            Some((from, _)) => tokens[from..(from + max).min(tokens.len())].to_vec(),
            None => Vec::new(),
        }
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
            d.propose(SeqId(0), &tokens, 9),
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
}
