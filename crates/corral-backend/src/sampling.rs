//! Sampling where the logits are: the layouts of [`Backend::logit_penalties`] and
//! [`Backend::top_candidates`], shared by every backend, and the CPU's version of the
//! reduction. A step reads back [`CANDIDATE_ROW_WORDS`] words a row instead of the whole
//! vocabulary: the row's best candidates, its normalisers and one Gumbel-max draw.
//!
//! [`Backend::logit_penalties`]: crate::Ops::logit_penalties
//! [`Backend::top_candidates`]: crate::Ops::top_candidates

/// Candidates kept per row, most likely first (ties to the lower id). Mirrors `CAND` of
/// sampling.cu.
pub const TOP_CANDIDATES: usize = 64;

/// `u32` words a row of [`Ops::top_candidates`](crate::Ops::top_candidates) writes:
/// ids, logits, then count, max, log-sum-exp, tempered log-sum-exp, Gumbel id and logit,
/// whether it is truncated.
pub const CANDIDATE_ROW_WORDS: usize = 2 * TOP_CANDIDATES + 8;

/// The largest vocabulary the device reduction takes (the CUDA kernel's 32 blocks of 16k
/// logits a row); larger ones are read back whole.
pub const MAX_REDUCED_VOCAB: usize = 32 * 16 * 1024;

/// [`Ops::argmax`](crate::Ops::argmax)'s id of a row without a finite logit.
pub const NO_FINITE_LOGIT: u32 = u32::MAX;

/// `u32` words of one row's draw parameters and of one penalty entry.
pub const DRAW_WORDS: usize = 4;

/// How one row is reduced: the temperature its tempered normaliser and draw use, and the key
/// of its Gumbel-max draw (none when the host draws among the candidates or picks greedily).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowDraw {
    /// `1 / temperature` (1 for greedy rows).
    pub inv_temperature: f32,
    /// Key of the draw `argmax(l / T + G)`, `G` Gumbel noise hashed from the key and the id.
    pub gumbel_key: Option<u64>,
}

impl RowDraw {
    /// The row's words: inverse temperature bits, key low, key high, whether to draw.
    pub fn words(&self) -> [u32; DRAW_WORDS] {
        let key = self.gumbel_key.unwrap_or(0);
        [
            self.inv_temperature.to_bits(),
            key as u32,
            (key >> 32) as u32,
            u32::from(self.gumbel_key.is_some()),
        ]
    }

    fn from_words(w: &[u32]) -> Self {
        Self {
            inv_temperature: f32::from_bits(w[0]),
            gumbel_key: (w[3] != 0).then(|| u64::from(w[1]) | (u64::from(w[2]) << 32)),
        }
    }
}

/// One logit's penalty: `l' = l - subtract`, then `l' / repetition` if positive, else
/// `l' · repetition` (the order of the host sampler: presence and frequency, then repetition).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty {
    /// Index into the `[rows, vocab]` logits.
    pub index: u32,
    /// Presence plus frequency penalty.
    pub subtract: f32,
    /// Repetition penalty (1 for none).
    pub repetition: f32,
}

impl Penalty {
    /// The entry's words.
    pub fn words(&self) -> [u32; DRAW_WORDS] {
        [
            self.index,
            self.subtract.to_bits(),
            self.repetition.to_bits(),
            0,
        ]
    }

    /// The entry of [`Penalty::words`].
    pub fn from_words(w: &[u32]) -> Self {
        Self {
            index: w[0],
            subtract: f32::from_bits(w[1]),
            repetition: f32::from_bits(w[2]),
        }
    }

    /// The penalised logit.
    pub fn apply(&self, l: f32) -> f32 {
        let l = l - self.subtract;
        if l > 0.0 {
            l / self.repetition
        } else {
            l * self.repetition
        }
    }
}

/// One row as [`Ops::top_candidates`](crate::Ops::top_candidates) reduced it. Only
/// finite logits count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowCandidates {
    /// Up to [`TOP_CANDIDATES`] `(id, logit)`, most likely first, ties to the lower id.
    pub top: Vec<(u32, f32)>,
    /// The largest logit (`-inf` if none is finite).
    pub max: f32,
    /// `ln Σ exp(l)` over the row.
    pub log_sum_exp: f32,
    /// `ln Σ exp(l / T)` over the row.
    pub tempered_log_sum_exp: f32,
    /// The Gumbel-max draw `(id, logit)`, if the row asked for one.
    pub gumbel: Option<(u32, f32)>,
    /// Whether only the first candidate is sure to be the row's best (the device's
    /// reduction met too many near-equal logits); the normalisers and the draw are exact.
    pub truncated: bool,
}

impl RowCandidates {
    /// Reads one row's [`CANDIDATE_ROW_WORDS`] words.
    pub fn from_words(w: &[u32]) -> Self {
        let mut row = Self::default();
        row.read_words(w);
        row
    }

    /// [`RowCandidates::from_words`] into `self`, reusing its room.
    pub fn read_words(&mut self, w: &[u32]) {
        let k = TOP_CANDIDATES;
        let count = (w[2 * k] as usize).min(k);
        self.top.clear();
        self.top
            .extend((0..count).map(|i| (w[i], f32::from_bits(w[k + i]))));
        self.max = f32::from_bits(w[2 * k + 1]);
        self.log_sum_exp = f32::from_bits(w[2 * k + 2]);
        self.tempered_log_sum_exp = f32::from_bits(w[2 * k + 3]);
        self.gumbel =
            (w[2 * k + 4] != u32::MAX).then(|| (w[2 * k + 4], f32::from_bits(w[2 * k + 5])));
        self.truncated = w[2 * k + 6] != 0;
    }

    /// Whether every finite logit of the row is among the candidates.
    pub fn is_whole_row(&self) -> bool {
        self.top.len() < TOP_CANDIDATES && !self.truncated
    }
}

/// Below this temperature sampling is greedy (`logit / T` would overflow).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// A row's filters, as the host sampler applies them: top-k, then top-p, then min-p, over
/// `logit / temperature`; temperature below [`MIN_TEMPERATURE`] is greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Filter {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
}

impl Filter {
    /// The most likely token, always.
    pub const GREEDY: Filter = Filter {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    /// Whether the row is a plain draw from the tempered distribution, which the device's
    /// Gumbel-max draw makes over the whole vocabulary.
    pub fn is_plain_draw(&self) -> bool {
        self.temperature >= MIN_TEMPERATURE
            && self.top_k == 0
            && self.top_p >= 1.0
            && self.min_p <= 0.0
    }

    /// The row's device reduction: `gumbel_key` is used only for a plain draw.
    pub fn draw(&self, gumbel_key: u64) -> RowDraw {
        if self.temperature < MIN_TEMPERATURE {
            return RowDraw {
                inv_temperature: 1.0,
                gumbel_key: None,
            };
        }
        RowDraw {
            inv_temperature: 1.0 / self.temperature,
            gumbel_key: self.is_plain_draw().then_some(gumbel_key),
        }
    }
}

/// What the candidates say of a row's pick.
#[allow(clippy::large_enum_variant)] // held on the stack on purpose: no allocation
enum Kept {
    Token(u32),
    /// Candidates left by the filters (the first `.1`) with weights relative to the best,
    /// `exp(l/T - max)`; held in place, as a step's sampling allocates nothing.
    Among([(u32, f32); TOP_CANDIDATES], usize),
}

impl RowCandidates {
    /// Whether the candidates decide `filter`'s pick; if not, it needs the whole row.
    pub fn decides(&self, filter: &Filter) -> bool {
        self.kept(filter).is_some()
    }

    /// The pick under `filter` with `uniform` in [0, 1) for a draw among candidates; `None`
    /// when the candidates do not decide it ([`RowCandidates::decides`]).
    pub fn choose(&self, filter: &Filter, uniform: impl FnOnce() -> f64) -> Option<u32> {
        Some(match self.kept(filter)? {
            Kept::Token(id) => id,
            Kept::Among(held, len) => {
                let c = &held[..len];
                let total: f64 = c.iter().map(|&(_, w)| f64::from(w)).sum();
                let mut target = uniform() * total;
                let mut pick = c.last().map_or(0, |&(id, _)| id);
                for &(id, w) in c {
                    target -= f64::from(w);
                    if target < 0.0 {
                        pick = id;
                        break;
                    }
                }
                pick
            }
        })
    }

    fn kept(&self, f: &Filter) -> Option<Kept> {
        let Some(&(best, _)) = self.top.first() else {
            return Some(Kept::Token(0));
        };
        if f.temperature < MIN_TEMPERATURE {
            return Some(Kept::Token(best));
        }
        if f.is_plain_draw() {
            return self.gumbel.map(|(id, _)| Kept::Token(id));
        }
        if self.truncated {
            return None;
        }
        let whole = self.is_whole_row();
        let mut top = &self.top[..self.top.len().min(TOP_CANDIDATES)];
        let truncated = f.top_k > 0 && f.top_k < top.len();
        if truncated {
            top = &top[..f.top_k];
        } else if f.top_k > 0 && !whole && f.top_k > top.len() {
            return None;
        }
        let max = top[0].1 / f.temperature;
        let mut held = [(0, 0.0); TOP_CANDIDATES];
        for (h, &(id, l)) in held.iter_mut().zip(top) {
            *h = (id, (l / f.temperature - max).exp());
        }
        let mut len = top.len();
        // Set by the filters so far: the candidates hold every token still in play.
        let mut complete = whole || f.top_k > 0;
        if f.top_p < 1.0 {
            let total = if complete {
                held[..len].iter().map(|&(_, w)| f64::from(w)).sum()
            } else {
                f64::from(self.tempered_log_sum_exp - self.max / f.temperature).exp()
            };
            let mut cumulative = 0.0;
            // Without every token in play the total is the device's, a little off the host's
            // sum: a nucleus ending within that of `top_p` is left to the whole row.
            let margin = if complete { 0.0 } else { 1e-4 };
            let top_p = f64::from(f.top_p);
            let mut before = 0.0;
            let keep = held[..len].iter().position(|&(_, w)| {
                before = cumulative;
                cumulative += f64::from(w) / total;
                cumulative >= top_p
            });
            match keep {
                Some(_) if cumulative < top_p + margin || before > top_p - margin => return None,
                Some(i) => len = i + 1,
                None if !complete => return None,
                None => {}
            }
            complete = true;
        }
        if f.min_p > 0.0 {
            if !complete && held[..len].last().is_some_and(|&(_, w)| w >= f.min_p) {
                return None;
            }
            let mut kept = 0;
            for i in 0..len {
                if held[i].1 >= f.min_p {
                    held[kept] = held[i];
                    kept += 1;
                }
            }
            len = kept;
        }
        Some(Kept::Among(held, len))
    }
}

/// Gumbel noise for `id` under `key`: SplitMix64 of the pair, 23 bits of it as a uniform
/// `u` in (0, 1), `-ln(-ln u)`. Mirrors `gumbel` of sampling.cu.
pub fn gumbel_noise(key: u64, id: u32) -> f32 {
    let mut z = key.wrapping_add(
        u64::from(id)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    -(-uniform_of(z).ln()).ln()
}

/// 23 bits of `z` as a uniform in (0, 1): `(x + 1/2) / 2^23`, exact in f32, so never 0 or 1
/// (24 bits would round the largest to 1, and `-ln(-ln 1)` is infinite).
fn uniform_of(z: u64) -> f32 {
    ((z >> 41) as u32 as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// Order-preserving key of a finite logit: larger logit first, then lower id.
fn key(l: f32, id: u32) -> u64 {
    let u = l.to_bits();
    let s = if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    };
    (u64::from(s) << 32) | u64::from(!id)
}

/// The CPU's [`Ops::top_candidates`](crate::Ops::top_candidates) of one row into its
/// [`CANDIDATE_ROW_WORDS`] words.
pub fn reduce_row(row: &[f32], draw_words: &[u32], keys: &mut Vec<u64>, out: &mut [u32]) {
    let draw = RowDraw::from_words(draw_words);
    let k = TOP_CANDIDATES;
    keys.clear();
    let mut max = f32::NEG_INFINITY;
    let mut best: Option<(f32, u32, f32)> = None;
    let mut finite = 0usize;
    // Keys below the k-th best so far are never kept: a bounded buffer, cut back to the best
    // k whenever it fills.
    let mut threshold = 0u64;
    let keep_best = |keys: &mut Vec<u64>| {
        keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        keys.truncate(k);
        keys.iter().copied().min().unwrap_or(0)
    };
    for (i, &l) in row.iter().enumerate() {
        if !l.is_finite() {
            continue;
        }
        let id = i as u32;
        finite += 1;
        let key = key(l, id);
        if key > threshold {
            keys.push(key);
            if keys.len() == 64 * k {
                threshold = keep_best(keys);
            }
        }
        max = max.max(l);
        if let Some(gk) = draw.gumbel_key {
            let score = l * draw.inv_temperature + gumbel_noise(gk, id);
            if best.is_none_or(|(s, _, _)| score > s) {
                best = Some((score, id, l));
            }
        }
    }
    if keys.len() > k {
        keep_best(keys);
    }
    keys.sort_unstable_by(|a, b| b.cmp(a));
    out.fill(0);
    for (i, &key) in keys.iter().enumerate() {
        let id = !(key as u32);
        out[i] = id;
        out[k + i] = row[id as usize].to_bits();
    }
    let (mut sum, mut tempered) = (0.0f64, 0.0f64);
    if max.is_finite() {
        let tempering = draw.inv_temperature != 1.0;
        for &l in row.iter().filter(|l| l.is_finite()) {
            sum += f64::from((l - max).exp());
            if tempering {
                tempered += f64::from(((l - max) * draw.inv_temperature).exp());
            }
        }
        if !tempering {
            tempered = sum;
        }
    }
    let lse = |m: f32, s: f64| {
        if m.is_finite() {
            m + s.ln() as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    out[2 * k] = finite.min(k) as u32;
    out[2 * k + 1] = max.to_bits();
    out[2 * k + 2] = lse(max, sum).to_bits();
    out[2 * k + 3] = lse(max * draw.inv_temperature, tempered).to_bits();
    let (gid, graw) = best.map_or((u32::MAX, 0.0), |(_, id, l)| (id, l));
    out[2 * k + 4] = gid;
    out[2 * k + 5] = graw.to_bits();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce(row: &[f32], draw: RowDraw) -> RowCandidates {
        let mut out = vec![0; CANDIDATE_ROW_WORDS];
        reduce_row(row, &draw.words(), &mut Vec::new(), &mut out);
        RowCandidates::from_words(&out)
    }

    const GREEDY: RowDraw = RowDraw {
        inv_temperature: 1.0,
        gumbel_key: None,
    };

    #[test]
    fn candidates_are_the_best_logits_ties_to_the_lower_id() {
        let mut row: Vec<f32> = (0..200).map(|i| ((i * 37) % 101) as f32 * 0.1).collect();
        row[5] = f32::NAN;
        row[6] = f32::INFINITY;
        let c = reduce(&row, GREEDY);
        assert_eq!(c.top.len(), TOP_CANDIDATES);
        let mut expected: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        expected.truncate(TOP_CANDIDATES);
        assert_eq!(c.top, expected);
        assert_eq!(c.max, 10.0);
        assert!(c.gumbel.is_none());
        assert!(!c.is_whole_row());
    }

    #[test]
    fn long_rows_keep_the_best_through_the_buffer_cuts() {
        // Ascending (every logit beats the ones before), descending and scattered, with ties.
        for pattern in 0..3 {
            let row: Vec<f32> = (0..20_000u32)
                .map(|i| match pattern {
                    0 => i as f32,
                    1 => -(i as f32),
                    _ => ((i * 7919) % 1009) as f32 * 0.5,
                })
                .collect();
            let c = reduce(&row, GREEDY);
            let mut expected: Vec<(u32, f32)> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .collect();
            expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            expected.truncate(TOP_CANDIDATES);
            assert_eq!(c.top, expected, "pattern {pattern}");
        }
    }

    #[test]
    fn normalisers_match_the_definitions() {
        let row = [1.0f32, -2.0, 0.5, f32::NEG_INFINITY, 3.0];
        let c = reduce(
            &row,
            RowDraw {
                inv_temperature: 2.0,
                gumbel_key: None,
            },
        );
        let lse = |t: f32| {
            row.iter()
                .filter(|l| l.is_finite())
                .map(|&l| f64::from(l * t).exp())
                .sum::<f64>()
                .ln() as f32
        };
        assert!((c.log_sum_exp - lse(1.0)).abs() < 1e-6);
        assert!((c.tempered_log_sum_exp - lse(2.0)).abs() < 1e-6);
        assert_eq!(c.top.len(), 4);
        assert!(c.is_whole_row());
        let empty = reduce(&[f32::NAN, f32::NEG_INFINITY], GREEDY);
        assert!(empty.top.is_empty() && empty.max == f32::NEG_INFINITY);
        assert_eq!(empty.log_sum_exp, f32::NEG_INFINITY);
    }

    #[test]
    fn gumbel_draws_follow_the_tempered_distribution() {
        // p ∝ exp(l / 0.5): weights 1, e², e⁴ → 0.0159, 0.117, 0.867.
        let row = [0.0f32, 1.0, 2.0];
        let mut counts = [0usize; 3];
        for key in 0..6000u64 {
            let c = reduce(
                &row,
                RowDraw {
                    inv_temperature: 2.0,
                    gumbel_key: Some(key.wrapping_mul(0x2545_F491_4F6C_DD1D)),
                },
            );
            let (id, l) = c.gumbel.unwrap();
            assert_eq!(l, row[id as usize]);
            counts[id as usize] += 1;
        }
        let z = 1.0 + 2f64.exp() + 4f64.exp();
        for (i, &n) in counts.iter().enumerate() {
            let p = (2.0 * i as f64).exp() / z;
            let sd = (6000.0 * p * (1.0 - p)).sqrt();
            assert!(
                (n as f64 - 6000.0 * p).abs() < 4.0 * sd,
                "token {i}: {n} of 6000, expected {:.0}",
                6000.0 * p
            );
        }
    }

    #[test]
    fn gumbel_uniforms_stay_inside_zero_and_one() {
        for z in [0, u64::MAX, u64::MAX >> 1, 1 << 41] {
            let u = uniform_of(z);
            assert!(u > 0.0 && u < 1.0, "{z:#x}: {u}");
            assert!(-(-u.ln()).ln() < f32::INFINITY);
        }
    }

    #[test]
    fn penalties_subtract_then_divide_or_multiply() {
        let p = Penalty {
            index: 0,
            subtract: 0.5,
            repetition: 2.0,
        };
        assert_eq!(p.apply(3.0), 1.25);
        assert_eq!(p.apply(0.0), -1.0);
    }
}
