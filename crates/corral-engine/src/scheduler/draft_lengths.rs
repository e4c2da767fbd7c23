//! Draft lengths chosen by measured cost: each sequence drafts the number of tokens that
//! gives the most expected tokens a second, from its recent acceptance and the time the
//! engine measured for decode steps verifying that many draft tokens a sequence.
//!
//! A draft of L tokens whose k-th is taken with probability α_k once those before it were
//! yields 1 + α_1 + α_1 α_2 + … + α_1 ⋯ α_L tokens; a step verifying it costs t(L). The
//! length with the largest ratio wins; lengths never measured are read off a line through
//! the measured ones. Every [`PROBE_EVERY`]th choice of a sequence tries a length next to
//! the best instead, so that the costs around it stay measured (and a sequence that stopped
//! drafting tries again). A length's first step is not counted: it may have done one-time
//! work (on a GPU, recording the graph of a new step shape), many times a step's cost.

/// Choices of a sequence between two probes of a neighbouring length.
pub(crate) const PROBE_EVERY: usize = 8;

/// How much of a new measurement an estimate takes.
const COST_WEIGHT: f64 = 0.2;
/// How much a draft's outcome moves a sequence's acceptance.
const ACCEPTANCE_DECAY: f64 = 0.75;

/// Measured step time by the draft tokens a sequence of the step verified.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepCosts {
    /// Microseconds, by draft length; `None` until measured after its first step.
    micros: Vec<Option<f64>>,
    /// Lengths whose first step was seen (and not counted).
    seen: Vec<bool>,
}

impl StepCosts {
    /// Takes a decode step's time, `micros`, for steps verifying `drafts` tokens a sequence;
    /// the first such step only marks the length seen.
    pub(crate) fn observe(&mut self, drafts: usize, micros: f64) {
        if self.micros.len() <= drafts {
            self.micros.resize(drafts + 1, None);
            self.seen.resize(drafts + 1, false);
        }
        if !self.seen[drafts] {
            self.seen[drafts] = true;
            return;
        }
        let slot = &mut self.micros[drafts];
        *slot = Some(match *slot {
            Some(old) => old + COST_WEIGHT * (micros - old),
            None => micros,
        });
    }

    /// The time of a step verifying `drafts` tokens a sequence: measured, else on the line
    /// through the nearest measured lengths (below and above it, or the two nearest on one
    /// side); `None` with fewer than two lengths measured, unless this one is.
    pub(crate) fn estimate(&self, drafts: usize) -> Option<f64> {
        if let Some(Some(t)) = self.micros.get(drafts) {
            return Some(*t);
        }
        // Without allocating: this runs for every drafting sequence every step.
        let measured = || {
            self.micros
                .iter()
                .enumerate()
                .filter_map(|(l, t)| t.map(|t| (l as f64, t)))
        };
        let x = drafts as f64;
        let below = measured().rev().find(|p| p.0 < x);
        let above = measured().find(|p| p.0 > x);
        let (a, b) = match (below, above) {
            (Some(a), Some(b)) => (a, b),
            (Some(b), None) => (measured().rev().find(|p| p.0 < b.0)?, b),
            (None, Some(a)) => (a, measured().find(|p| p.0 > a.0)?),
            (None, None) => return None,
        };
        let t = a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0);
        Some(t.max(f64::MIN_POSITIVE))
    }
}

/// Draft positions whose acceptance is counted apart (longer drafts share the last's).
const POSITIONS: usize = 8;

/// A sequence's recent acceptance by draft position: the chance that the token at each
/// position is taken once those before it were, as decayed counts (drafts that go on
/// agreeing tend to keep agreeing, a prompt lookup's above all).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Acceptance {
    taken: [f64; POSITIONS],
    tried: [f64; POSITIONS],
    /// Draft lengths chosen so far (every [`PROBE_EVERY`]th is a probe).
    choices: usize,
}

impl Acceptance {
    /// Takes a draft's outcome: `accepted` of its `drafted` tokens taken, the first rejected
    /// one (if any) tried too.
    pub(crate) fn observe(&mut self, accepted: usize, drafted: usize) {
        for k in 0..POSITIONS {
            self.taken[k] *= ACCEPTANCE_DECAY;
            self.tried[k] *= ACCEPTANCE_DECAY;
        }
        for k in 0..(accepted + 1).min(drafted) {
            let k_at = k.min(POSITIONS - 1);
            self.tried[k_at] += 1.0;
            if k < accepted {
                self.taken[k_at] += 1.0;
            }
        }
    }

    /// The chance that the token at draft position `k` (from 0) is taken once those before
    /// it were: its counts with one more try at the position before's chance (an even
    /// chance for the first), which stands in until the position is measured.
    pub(crate) fn rate(&self, k: usize) -> f64 {
        let prior = match k {
            0 => 0.5,
            k => self.rate(k - 1),
        };
        let k = k.min(POSITIONS - 1);
        ((self.taken[k] + prior) / (self.tried[k] + 1.0)).clamp(0.0, 1.0)
    }

    /// Tokens a step yields with a draft of `len` tokens: 1, and each draft token's chance
    /// of being reached and taken.
    pub(crate) fn expected_tokens(&self, len: usize) -> f64 {
        let mut reached = 1.0;
        let mut tokens = 1.0;
        for k in 0..len {
            reached *= self.rate(k);
            tokens += reached;
        }
        tokens
    }

    /// The draft length (0 to `max`) for the next step by `costs`: the most expected tokens
    /// a microsecond, or a neighbour of it on a probe; `max` while fewer than two lengths
    /// are measured (which measures the longest).
    pub(crate) fn choose(&mut self, costs: &StepCosts, max: usize) -> usize {
        self.choices += 1;
        if (0..=max).any(|l| costs.estimate(l).is_none()) {
            // Lengths not yet measured: the longest, then the shortest draft.
            return if costs.estimate(max).is_none() {
                max
            } else {
                0
            };
        }
        let rate = |l: usize| {
            costs
                .estimate(l)
                .map_or(0.0, |t| self.expected_tokens(l) / t)
        };
        let best = (0..=max)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(max);
        if self.choices.is_multiple_of(PROBE_EVERY) {
            // Alternately one shorter and one longer, where there is such a length.
            let longer = (self.choices / PROBE_EVERY).is_multiple_of(2);
            return match (longer && best < max) || best == 0 {
                true => (best + 1).min(max),
                false => best - 1,
            };
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_read_measured_costs_and_lines_through_them() {
        let mut costs = StepCosts::default();
        assert_eq!(costs.estimate(2), None);
        // A length's first step (recording a graph, say) is not counted.
        costs.observe(1, 5000.0);
        assert_eq!(costs.estimate(1), None, "the first step is not counted");
        costs.observe(1, 140.0);
        assert_eq!(costs.estimate(1), Some(140.0));
        assert_eq!(costs.estimate(3), None, "one length measured");
        costs.observe(3, 9000.0);
        costs.observe(3, 180.0);
        assert_eq!(costs.estimate(2), Some(160.0), "between");
        assert_eq!(costs.estimate(0), Some(120.0), "below both");
        assert_eq!(costs.estimate(4), Some(200.0), "above both");
        // A new measurement moves the estimate by a fifth of the difference.
        costs.observe(3, 230.0);
        assert_eq!(costs.estimate(3), Some(190.0));
    }

    /// An acceptance of `alpha` at every position, as if from many drafts.
    fn steady(alpha: f64) -> Acceptance {
        Acceptance {
            taken: [alpha * 1000.0; POSITIONS],
            tried: [1000.0; POSITIONS],
            choices: 0,
        }
    }

    #[test]
    fn the_length_with_the_most_tokens_a_microsecond_wins() {
        // A verify step of L draft tokens costs 1 + 0.3 L plain steps.
        let mut costs = StepCosts::default();
        for l in 0..=4 {
            costs.observe(l, 10_000.0);
            costs.observe(l, 100.0 + 30.0 * l as f64);
        }
        // α 0.8: 1 + 0.8 + 0.64 tokens for 160 µs against 2.952 for 190.
        for (alpha, expected) in [(0.95, 4), (0.8, 3), (0.5, 1), (0.2, 0)] {
            assert_eq!(steady(alpha).choose(&costs, 4), expected, "α {alpha}");
        }
        // Drafts that agree on and on: a first token taken half the time, every later one
        // once the first was.
        let mut a = steady(1.0);
        a.taken[0] = 500.0;
        assert_eq!(a.choose(&costs, 4), 4);
    }

    #[test]
    fn every_eighth_choice_probes_a_neighbour_and_unmeasured_costs_are_explored() {
        let mut costs = StepCosts::default();
        let mut a = Acceptance::default();
        assert_eq!(a.choose(&costs, 3), 3, "nothing measured: the longest");
        costs.observe(3, 2000.0);
        assert_eq!(a.choose(&costs, 3), 3, "its first step not counted: again");
        costs.observe(3, 200.0);
        assert_eq!(a.choose(&costs, 3), 0, "then the shortest");
        costs.observe(0, 1000.0);
        assert_eq!(a.choose(&costs, 3), 0, "twice");
        costs.observe(0, 100.0);
        // Acceptance 1: the longest (4 tokens for 200 µs against 1 for 100), probes aside.
        a = Acceptance {
            choices: a.choices,
            ..steady(1.0)
        };
        let picks: Vec<usize> = (0..16).map(|_| a.choose(&costs, 3)).collect();
        assert_eq!(picks[..3], [3; 3]);
        assert_eq!(picks[3], 2, "the eighth choice probes one shorter");
        assert_eq!(
            picks[11], 2,
            "the sixteenth too: the longest has no longer neighbour"
        );
        // Acceptance 0: no draft, but a probe of one token every eighth choice.
        a = Acceptance {
            choices: a.choices,
            ..steady(0.0)
        };
        let picks: Vec<usize> = (0..8).map(|_| a.choose(&costs, 3)).collect();
        assert_eq!(picks, [0, 0, 0, 1, 0, 0, 0, 0]);
    }

    #[test]
    fn acceptance_counts_each_position_tried_up_to_the_first_rejected() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(0), 0.5, "an even chance unmeasured");
        a.observe(2, 4);
        // The third rejected once, at the second's chance before; the fourth untried.
        assert_eq!((a.rate(0), a.rate(1)), (0.75, 0.875));
        assert_eq!((a.rate(2), a.rate(3)), (0.4375, 0.4375));
        a.observe(0, 3);
        // Decayed by a quarter, then the first position tried and rejected.
        assert!((a.rate(0) - (0.75 + 0.5) / (1.75 + 1.0)).abs() < 1e-12);
        assert!((a.rate(1) - (0.75 + a.rate(0)) / (0.75 + 1.0)).abs() < 1e-12);
        let tokens = 1.0 + a.rate(0) * (1.0 + a.rate(1));
        assert!((a.expected_tokens(2) - tokens).abs() < 1e-12);
    }
}
