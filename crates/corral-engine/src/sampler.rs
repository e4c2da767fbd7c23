//! Sampling the next token from logits: repetition penalty (over prompt and output), presence
//! and frequency penalties (over the output, OpenAI's definition), then temperature, top-k,
//! top-p and min-p filtering (the order llama.cpp and vLLM apply them), then a seeded draw. Temperature 0
//! is greedy.

use corral_backend::sampling::{
    Filter, MIN_TEMPERATURE, Penalty, RowCandidates, RowDraw, TOP_CANDIDATES, gumbel_noise,
};

use crate::EngineError;

/// How to pick tokens; checked by [`SamplingParams::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely; 0 disables.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen; 1 disables.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token already generated; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the output; 0 disables.
    pub frequency_penalty: f32,
    /// Seed of the random draw; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Rejects values outside each parameter's meaningful range.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |param: &'static str, problem: String| {
            Err(EngineError::InvalidParameter { param, problem })
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", format!("{} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                format!("{} must be > 0", self.repetition_penalty),
            );
        }
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return bad(param, format!("{value} must be in [-2, 2]"));
            }
        }
        Ok(())
    }
}

/// SplitMix64: a small, well-mixed, seedable generator.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-sequence sampling state: parameters, random stream and candidate scratch.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    candidates: Vec<(u32, f32)>,
    /// Distinct tokens seen, for the repetition penalty.
    seen_scratch: Vec<u32>,
    /// How often each token has been sampled so far (presence and frequency penalties).
    output_counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler with `params` (assumed validated).
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
            seen_scratch: Vec::new(),
            output_counts: std::collections::HashMap::new(),
        }
    }

    /// Picks the next token from one row of `logits`, given the tokens seen so far
    /// (prompt and generated) for the repetition penalty. `logits` is modified.
    pub fn sample(&mut self, logits: &mut [f32], seen: &[u32]) -> u32 {
        let token = self.pick(logits, seen);
        self.count_output(token);
        token
    }

    /// Whether this row must come back whole: the device's candidates cannot serve a top-k
    /// beyond them, nor log-probabilities of logits before penalties the device applied.
    pub fn needs_whole_logits(&self, top_logprobs: Option<usize>) -> bool {
        self.params.top_k > TOP_CANDIDATES
            || top_logprobs.is_some_and(|n| n > TOP_CANDIDATES || self.has_penalties())
    }

    /// Whether a row's sampling depends on the tokens before it (repetition, presence or
    /// frequency penalties).
    pub fn has_penalties(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
    }

    /// The row's filters.
    pub fn filter(&self) -> Filter {
        let p = &self.params;
        Filter {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
        }
    }

    /// How the device reduces this row (a plain draw takes its key from the random stream).
    pub fn device_draw(&mut self) -> RowDraw {
        let filter = self.filter();
        let key = if filter.is_plain_draw() {
            self.rng.next_u64()
        } else {
            0
        };
        filter.draw(key)
    }

    /// This row's penalties on the device, for logits row `row` of `vocab`: the adjustments
    /// [`Sampler::sample`] makes on the host.
    pub fn device_penalties(
        &mut self,
        seen: &[u32],
        row: usize,
        vocab: usize,
        out: &mut Vec<Penalty>,
    ) {
        if !self.has_penalties() {
            return;
        }
        let p = &self.params;
        let repeats = p.repetition_penalty != 1.0;
        let subtract = |t: u32| {
            self.output_counts.get(&t).map_or(0.0, |&n| {
                p.presence_penalty + p.frequency_penalty * n as f32
            })
        };
        let mut push = |t: u32, subtract: f32, repetition: f32| {
            let index = u32::try_from(row * vocab + t as usize);
            if let (true, Ok(index)) = ((t as usize) < vocab, index) {
                out.push(Penalty {
                    index,
                    subtract,
                    repetition,
                });
            }
        };
        self.seen_scratch.clear();
        if repeats {
            self.seen_scratch.extend_from_slice(seen);
            self.seen_scratch.sort_unstable();
            self.seen_scratch.dedup();
            for &t in &self.seen_scratch {
                push(t, subtract(t), p.repetition_penalty);
            }
        }
        for &t in self.output_counts.keys() {
            if !(repeats && self.seen_scratch.binary_search(&t).is_ok()) {
                push(t, subtract(t), 1.0);
            }
        }
    }

    /// Picks the next token from the device's candidates of this row (whose penalties were
    /// applied there); `None` if they do not decide it and the whole row is needed.
    pub fn sample_candidates(&mut self, candidates: &RowCandidates) -> Option<u32> {
        let filter = self.filter();
        let rng = &mut self.rng;
        let token = candidates.choose(&filter, || rng.next_f64())?;
        self.count_output(token);
        Some(token)
    }

    /// Picks the next token from a row whose penalties were already applied.
    pub fn sample_penalised(&mut self, logits: &[f32]) -> u32 {
        let token = self.pick_filtered(logits);
        self.count_output(token);
        token
    }

    fn count_output(&mut self, token: u32) {
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
    }

    fn pick(&mut self, logits: &mut [f32], seen: &[u32]) -> u32 {
        self.apply_penalties(logits, seen);
        self.pick_filtered(logits)
    }

    fn apply_penalties(&mut self, logits: &mut [f32], seen: &[u32]) {
        let p = &self.params;
        for (&t, &n) in &self.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
        if p.repetition_penalty != 1.0 {
            // Once per distinct token, however often it occurs (as transformers and vLLM do).
            self.seen_scratch.clear();
            self.seen_scratch.extend_from_slice(seen);
            self.seen_scratch.sort_unstable();
            self.seen_scratch.dedup();
            for &t in &self.seen_scratch {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
    }

    fn pick_filtered(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        // Temperatures this small would overflow `logit / T`; they mean greedy anyway.
        if p.temperature < MIN_TEMPERATURE {
            return argmax(logits);
        }
        let filter = self.filter();
        if filter.is_plain_draw() {
            // The device's Gumbel-max draw, so that a row draws alike whichever path it takes.
            let draw = filter.draw(self.rng.next_u64());
            return gumbel_argmax(logits, &draw).unwrap_or_else(|| argmax(logits));
        }
        let p = &self.params;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        if c.is_empty() {
            return argmax(logits);
        }
        // Most likely first, ties to the lower id: what is left after a filter is drawn from
        // in that order (the order of the device's candidates, so both paths draw the same
        // token from the same seed). Top-k selects its candidates in linear time and min-p
        // sorts only what it keeps; a plain draw over the whole vocabulary sorts nothing.
        // By the logits themselves (as the device ranks them): `l / T` can tie where they
        // do not.
        let raw = logits;
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| {
            raw[b.0 as usize]
                .total_cmp(&raw[a.0 as usize])
                .then(a.0.cmp(&b.0))
        };
        let mut sorted = false;
        if p.top_k > 0 {
            if p.top_k < c.len() {
                c.select_nth_unstable_by(p.top_k - 1, by_rank);
                c.truncate(p.top_k);
            }
            c.sort_unstable_by(by_rank);
            sorted = true;
        } else if p.top_p < 1.0 {
            c.sort_unstable_by(by_rank);
            sorted = true;
        }
        let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
        let mut total = 0.0f64;
        for (_, l) in c.iter_mut() {
            *l = (*l - max).exp();
            total += *l as f64;
        }
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = c.len();
            for (i, (_, w)) in c.iter().enumerate() {
                cumulative += *w as f64 / total;
                if cumulative >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            // Weights are relative to the top token's, which is exp(0) = 1.
            c.retain(|(_, w)| *w >= p.min_p);
            if !sorted {
                c.sort_unstable_by(by_rank);
            }
        }
        let total: f64 = c.iter().map(|(_, w)| *w as f64).sum();
        let mut target = self.rng.next_f64() * total;
        for &(id, w) in c.iter() {
            target -= w as f64;
            if target < 0.0 {
                return id;
            }
        }
        c.last().map_or(0, |&(id, _)| id)
    }
}

/// `argmax(l · (1/T) + G)` over the finite logits, `G` the Gumbel noise of `draw`'s key (the
/// device's draw, computed alike); `None` without a key or a finite logit.
fn gumbel_argmax(logits: &[f32], draw: &RowDraw) -> Option<u32> {
    use rayon::prelude::*;
    let key = draw.gumbel_key?;
    // A noise value a token is two logarithms: a whole vocabulary costs milliseconds on one
    // core, so pieces of it are drawn on all of them and the best of each kept.
    logits
        .par_chunks(GUMBEL_PIECE)
        .enumerate()
        .map(|(piece, chunk)| gumbel_best(chunk, piece * GUMBEL_PIECE, key, draw.inv_temperature))
        .reduce(
            || None,
            |a, b| match (a, b) {
                (Some(x), Some(y)) => Some(if y.0 > x.0 || (y.0 == x.0 && y.1 < x.1) {
                    y
                } else {
                    x
                }),
                (x, None) => x,
                (None, y) => y,
            },
        )
        .map(|(_, id)| id)
}

/// Logits a piece of [`gumbel_argmax`]'s parallel draw takes.
const GUMBEL_PIECE: usize = 8192;

/// The best (score, id) of `logits`, ids from `first`: the highest logit / T + noise, ties to
/// the lower id.
fn gumbel_best(logits: &[f32], first: usize, key: u64, inv_temperature: f32) -> Option<(f32, u32)> {
    let mut best: Option<(f32, u32)> = None;
    for (i, &l) in logits.iter().enumerate().filter(|(_, l)| l.is_finite()) {
        let id = (first + i) as u32;
        let score = l * inv_temperature + gumbel_noise(key, id);
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, id));
        }
    }
    best
}

/// Index of the largest logit; ties go to the lower id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The parallel draw picks what one pass over the whole row picks, ties and
        /// masked (-inf) logits included, at lengths across several pieces.
        #[test]
        fn the_parallel_gumbel_draw_equals_one_pass(
            len in 1usize..40_000,
            key in any::<u64>(),
            temperature in 0.05f32..4.0,
            masked in 0usize..4,
        ) {
            let logits: Vec<f32> = (0..len)
                .map(|i| match (i * 7919) % 11 {
                    n if n < masked => f32::NEG_INFINITY,
                    n => ((i * 2_654_435_761) % 1000) as f32 / 250.0 - n as f32 * 0.01,
                })
                .collect();
            let draw = Filter { temperature, top_k: 0, top_p: 1.0, min_p: 0.0 }.draw(key);
            let whole = gumbel_best(&logits, 0, key, draw.inv_temperature).map(|(_, id)| id);
            prop_assert_eq!(gumbel_argmax(&logits, &draw), whole);
        }
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut s = Sampler::new(params(0.0));
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.9, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens_once() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..params(0.0)
        });
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[1]), 2);
        // Seen three times, still divided once: 3.9 / 2 = 1.95 beats 1.9.
        assert_eq!(s.sample(&mut [0.0, 3.9, 1.9], &[1, 1, 1]), 1);
    }

    #[test]
    fn tiny_temperature_is_greedy() {
        let mut s = Sampler::new(params(1e-30));
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.9], &[]), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_demote_output_tokens() {
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 0.6,
            ..params(0.0)
        });
        // 1 wins first; after it has been output twice (penalty 1.2) token 2 wins.
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[]), 1);
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[]), 1);
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[]), 2);
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 1.5,
            ..params(0.0)
        });
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[]), 1);
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_keeps_the_head() {
        let mut s = Sampler::new(SamplingParams {
            top_k: 1,
            ..params(1.0)
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [1.0, 2.0, 1.9], &[]), 1);
        }
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.5,
            ..params(1.0)
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [0.0, 5.0, 0.0], &[]), 1);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.5,
            ..params(1.0)
        });
        for _ in 0..50 {
            // exp(-1) ≈ 0.37 < 0.5 of the top: only tokens 0 and 2 survive.
            let t = s.sample(&mut [2.0, 1.0, 2.0, -5.0], &[]);
            assert!(t == 0 || t == 2, "{t}");
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let mut s = Sampler::new(SamplingParams {
            seed: 3,
            ..params(1.0)
        });
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000)
            .filter(|_| s.sample(&mut logits.clone(), &[]) == 1)
            .count();
        // Expected 3000 of 4000; allow ±4 standard deviations (σ ≈ 27).
        assert!((2890..3110).contains(&ones), "{ones}");
    }

    #[test]
    fn invalid_params_are_named() {
        let err = SamplingParams {
            top_p: 0.0,
            ..params(1.0)
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("top_p"), "{err}");
        let err = SamplingParams {
            temperature: -1.0,
            ..params(1.0)
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("temperature"), "{err}");
    }

    /// One row through the device path on the CPU backend: penalties, reduction, pick (or
    /// the whole penalised row when the candidates do not decide it).
    fn device_sample(s: &mut Sampler, row: &[f32], seen: &[u32]) -> (u32, bool) {
        use corral_backend::sampling::{CANDIDATE_ROW_WORDS, DRAW_WORDS};
        use corral_backend::{Backend, BufferUsage, DType};
        use corral_cpu::CpuBackend;
        let b: &dyn Backend = &CpuBackend::new();
        let vocab = row.len();
        let mut logits = b.weight_from_f32(row, DType::F32).unwrap();
        let mut penalties = Vec::new();
        let draw = s.device_draw();
        s.device_penalties(seen, 0, vocab, &mut penalties);
        let words: Vec<u32> = penalties.iter().flat_map(Penalty::words).collect();
        let mut entries = b
            .take_buffer(DType::U32, words.len().max(1), BufferUsage::Metadata)
            .unwrap();
        b.upload_u32(&words, &mut entries).unwrap();
        b.logit_penalties(&mut logits, vocab, &entries, penalties.len())
            .unwrap();
        let mut draws = b
            .take_buffer(DType::U32, DRAW_WORDS, BufferUsage::Metadata)
            .unwrap();
        b.upload_u32(&draw.words(), &mut draws).unwrap();
        let mut out = b
            .take_buffer(DType::U32, CANDIDATE_ROW_WORDS, BufferUsage::Metadata)
            .unwrap();
        b.top_candidates(&logits, 1, vocab, &draws, &mut out)
            .unwrap();
        let mut words = vec![0; CANDIDATE_ROW_WORDS];
        b.download_u32(&out, &mut words).unwrap();
        let candidates = RowCandidates::from_words(&words);
        match s.sample_candidates(&candidates) {
            Some(t) => (t, true),
            None => {
                let mut full = vec![0.0; vocab];
                b.download_f32(&logits, &mut full).unwrap();
                (s.sample_penalised(&full), false)
            }
        }
    }

    #[test]
    fn device_path_needs_the_whole_row_only_when_its_candidates_fall_short() {
        // 200 equal logits: top-p 0.9 needs 180 of them, beyond the 64 candidates.
        let flat = vec![1.0f32; 200];
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.9,
            ..params(1.0)
        });
        let (t, decided) = device_sample(&mut s, &flat, &[]);
        assert!(!decided && t < 180, "{t}");
        // One dominant logit: the nucleus is one candidate.
        let mut peaked = flat.clone();
        peaked[77] = 30.0;
        let (t, decided) = device_sample(&mut s, &peaked, &[]);
        assert!(decided && t == 77, "{t}");
        // min-p over a flat row keeps everything; over a peaked one, one token.
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.5,
            ..params(1.0)
        });
        assert!(!device_sample(&mut s, &flat, &[]).1);
        assert_eq!(device_sample(&mut s, &peaked, &[]), (77, true));
        let s = Sampler::new(SamplingParams {
            top_k: TOP_CANDIDATES + 1,
            ..params(1.0)
        });
        assert!(s.needs_whole_logits(None));
        let s = Sampler::new(SamplingParams {
            repetition_penalty: 1.1,
            ..params(1.0)
        });
        assert!(s.needs_whole_logits(Some(5)) && !s.needs_whole_logits(None));
    }

    #[test]
    fn device_plain_draws_follow_the_distribution() {
        let mut s = Sampler::new(SamplingParams {
            seed: 5,
            ..params(1.0)
        });
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000)
            .filter(|_| device_sample(&mut s, &logits, &[]).0 == 1)
            .count();
        assert!((2890..3110).contains(&ones), "{ones}");
    }

    fn filter_params() -> impl Strategy<Value = SamplingParams> {
        (
            any::<u64>(),
            prop_oneof![Just(0.0f32), 0.3f32..2.0],
            prop_oneof![Just(0usize), 1usize..=70],
            prop_oneof![Just(1.0f32), 0.05f32..1.0],
            prop_oneof![Just(0.0f32), 0.0f32..0.9],
            prop_oneof![Just(1.0f32), 0.5f32..2.0],
            prop_oneof![Just(0.0f32), -2.0f32..2.0],
            prop_oneof![Just(0.0f32), -2.0f32..2.0],
        )
            .prop_map(|(seed, t, k, top_p, min_p, rep, presence, frequency)| {
                SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p,
                    min_p,
                    repetition_penalty: rep,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    seed,
                }
            })
    }

    proptest! {
        /// Device and host paths draw the same tokens from the same seed (a plain draw on
        /// both is the Gumbel-max draw). Logits on a grid of quarters, so that ties are
        /// common.
        #[test]
        fn device_and_host_paths_pick_the_same_tokens(
            p in filter_params(),
            logits in proptest::collection::vec((-24i32..24).prop_map(|q| q as f32 * 0.25), 2..300),
            seen in proptest::collection::vec(0u32..300, 0..20),
        ) {
            let seen: Vec<u32> = seen.into_iter().filter(|&t| (t as usize) < logits.len()).collect();
            let mut host = Sampler::new(p.clone());
            let mut device = Sampler::new(p);
            for _ in 0..4 {
                let h = host.sample(&mut logits.clone(), &seen);
                let (d, _) = device_sample(&mut device, &logits, &seen);
                prop_assert_eq!(h, d);
            }
        }

        #[test]
        fn device_penalties_equal_the_hosts(
            p in filter_params(),
            logits in proptest::collection::vec(-5.0f32..5.0, 2..100),
            seen in proptest::collection::vec(0u32..100, 0..40),
        ) {
            use corral_backend::{Backend, BufferUsage, DType};
            use corral_cpu::CpuBackend;
            let seen: Vec<u32> = seen.into_iter().filter(|&t| (t as usize) < logits.len()).collect();
            let mut s = Sampler::new(p);
            for &t in &seen[..seen.len() / 2] {
                s.count_output(t);
            }
            let mut host = logits.clone();
            s.clone().apply_penalties(&mut host, &seen);
            let mut entries = Vec::new();
            s.device_penalties(&seen, 0, logits.len(), &mut entries);
            let b: &dyn Backend = &CpuBackend::new();
            let mut device = b.weight_from_f32(&logits, DType::F32).unwrap();
            let words: Vec<u32> = entries.iter().flat_map(Penalty::words).collect();
            let mut buf = b.take_buffer(DType::U32, words.len().max(1), BufferUsage::Metadata).unwrap();
            b.upload_u32(&words, &mut buf).unwrap();
            b.logit_penalties(&mut device, logits.len(), &buf, entries.len()).unwrap();
            let mut back = vec![0.0; logits.len()];
            b.download_f32(&device, &mut back).unwrap();
            prop_assert_eq!(
                host.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
                back.iter().map(|l| l.to_bits()).collect::<Vec<_>>()
            );
        }

        #[test]
        fn same_seed_same_tokens(seed in any::<u64>(), logits in proptest::collection::vec(-5.0f32..5.0, 2..50)) {
            let p = SamplingParams { seed, top_k: 10, top_p: 0.9, min_p: 0.01, ..params(0.8) };
            let mut a = Sampler::new(p.clone());
            let mut b = Sampler::new(p);
            for _ in 0..5 {
                let ta = a.sample(&mut logits.clone(), &[]);
                let tb = b.sample(&mut logits.clone(), &[]);
                prop_assert_eq!(ta, tb);
                prop_assert!((ta as usize) < logits.len());
            }
        }
    }
}
