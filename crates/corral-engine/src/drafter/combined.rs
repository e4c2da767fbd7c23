//! Prompt lookup and the MTP head together: the lookup's draft where the sequence repeats
//! itself (long, cheap, often right in agents' edits), the head's elsewhere.

use corral_model::SeqId;

use super::{LookupDrafter, MtpDrafter};
use crate::Drafter;

/// Lookup first, the MTP head where the lookup finds no match. The head sees every step's
/// hidden states either way, so that it can draft from where the lookup stops.
#[derive(Debug)]
pub struct CombinedDrafter {
    lookup: LookupDrafter,
    mtp: MtpDrafter,
}

impl CombinedDrafter {
    /// Drafts by `lookup`, else by `mtp`.
    pub fn new(lookup: LookupDrafter, mtp: MtpDrafter) -> Self {
        Self { lookup, mtp }
    }
}

impl Drafter for CombinedDrafter {
    fn propose(&mut self, seq: SeqId, tokens: &[u32], max: usize) -> Vec<u32> {
        let found = self.lookup.propose(seq, tokens, max);
        if found.is_empty() {
            self.mtp.propose(seq, tokens, max)
        } else {
            found
        }
    }

    /// The lookup's drafts where it matches; the head's for the rest, in one pass.
    fn propose_many(&mut self, requests: &[(SeqId, &[u32], usize)]) -> Vec<Vec<u32>> {
        let mut drafts = self.lookup.propose_many(requests);
        let (missing, rest): (Vec<usize>, Vec<_>) = requests
            .iter()
            .zip(&drafts)
            .enumerate()
            .filter(|(_, (_, d))| d.is_empty())
            .map(|(i, (r, _))| (i, *r))
            .unzip();
        if !rest.is_empty() {
            for (i, d) in missing.into_iter().zip(self.mtp.propose_many(&rest)) {
                drafts[i] = d;
            }
        }
        drafts
    }

    fn forget(&mut self, seq: SeqId) {
        self.lookup.forget(seq);
        self.mtp.forget(seq);
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, seq: SeqId, first: usize, hidden: &[f32]) {
        self.mtp.observe(seq, first, hidden);
    }
}
