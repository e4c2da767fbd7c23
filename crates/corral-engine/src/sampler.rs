//! Sampling the next token from logits: repetition penalty (over prompt and output), presence
//! and frequency penalties (over the output, OpenAI's definition), then temperature, top-k,
//! top-p and min-p filtering (the order llama.cpp and vLLM apply them), then a seeded draw. Temperature 0
//! is greedy.

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

/// Below this temperature sampling is greedy.
const MIN_TEMPERATURE: f32 = 1e-5;

/// SplitMix64: a small, well-mixed, seedable generator.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
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
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
        token
    }

    fn pick(&mut self, logits: &mut [f32], seen: &[u32]) -> u32 {
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
        // Temperatures this small would overflow `logit / T`; they mean greedy anyway.
        if p.temperature < MIN_TEMPERATURE {
            return argmax(logits);
        }
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
        // Most likely first, ties to the lower id. Only top-k and top-p need that order:
        // top-k selects its candidates in linear time, top-p sorts what is left, and a plain
        // draw over the whole vocabulary sorts nothing.
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_rank);
            c.truncate(p.top_k);
        }
        let max = c.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.1));
        let mut total = 0.0f64;
        for (_, l) in c.iter_mut() {
            *l = (*l - max).exp();
            total += *l as f64;
        }
        if p.top_p < 1.0 {
            c.sort_unstable_by(by_rank);
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

    proptest! {
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
