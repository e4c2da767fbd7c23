//! RoPE's frequencies: the base, and YaRN's scaling (Qwen3 past 32k positions), computed as
//! transformers computes them (`_compute_yarn_parameters`), in f32 where it uses f32.

/// Rotary embedding parameters of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// The base (`rope_theta`).
    pub theta: f32,
    /// YaRN scaling (`rope_type: "yarn"`); `None`: plain RoPE.
    pub yarn: Option<Yarn>,
}

/// YaRN's settings, with transformers' defaults filled in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// How many times the original context the positions reach (`factor`).
    pub factor: f64,
    /// The context the model was trained at (`original_max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// Rotations over the original context below which a pair's frequency is interpolated
    /// (`beta_slow`, default 1) and above which it is kept (`beta_fast`, default 32).
    pub beta_fast: f64,
    /// See `beta_fast`.
    pub beta_slow: f64,
    /// cos and sin are multiplied by this (`attention_factor`, by default `0.1 ln(factor) + 1`).
    pub attention_factor: f64,
    /// The blend's bounds rounded outwards to whole pairs (`truncate`, default true).
    pub truncate: bool,
}

/// What a kernel forms each pair's frequency from (see [`RopeParams::inverse_frequency`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeArgs {
    /// The base of the frequencies.
    pub theta: f32,
    /// YaRN's factor; 0: plain RoPE.
    pub factor: f32,
    /// The blend of pair `p`: `clamp((p - ramp_low) / ramp_width, 0, 1)` interpolated.
    pub ramp_low: f32,
    /// See `ramp_low`.
    pub ramp_width: f32,
    /// YaRN's scale of the rotated values (1 for plain RoPE).
    pub attention_factor: f32,
}

impl RopeParams {
    /// Plain RoPE of base `theta`.
    pub fn plain(theta: f32) -> Self {
        Self { theta, yarn: None }
    }

    /// The per-pair values for `rotary_dim` rotated dims (YaRN's blend depends on it).
    pub fn args(&self, rotary_dim: usize) -> RopeArgs {
        let plain = RopeArgs {
            theta: self.theta,
            factor: 0.0,
            ramp_low: 0.0,
            ramp_width: 1.0,
            attention_factor: 1.0,
        };
        let Some(y) = self.yarn else { return plain };
        let (dim, base) = (rotary_dim as f64, self.theta as f64);
        let original = y.original_max_position_embeddings as f64;
        let correction_dim = |rotations: f64| {
            dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(dim - 1.0);
        if low == high {
            high += 0.001;
        }
        RopeArgs {
            factor: y.factor as f32,
            ramp_low: low as f32,
            ramp_width: (high - low) as f32,
            attention_factor: y.attention_factor as f32,
            ..plain
        }
    }

    /// The inverse frequency of pair `p` of `rotary_dim` rotated dims, in f32 as transformers
    /// forms it: `1 / θ^(2p/d)`, and under YaRN that blended with `1 / (factor θ^(2p/d))`
    /// from pair `ramp_low` to `ramp_low + ramp_width`.
    pub fn inverse_frequency(&self, p: usize, rotary_dim: usize) -> f32 {
        self.args(rotary_dim).inverse_frequency(p, rotary_dim)
    }

    /// The factor on cos and sin (1 without YaRN).
    pub fn attention_factor(&self) -> f32 {
        self.yarn.map_or(1.0, |y| y.attention_factor as f32)
    }
}

impl RopeArgs {
    /// [`RopeParams::inverse_frequency`]; the CUDA kernels' `rope_inv_freq` is the same.
    pub fn inverse_frequency(&self, p: usize, rotary_dim: usize) -> f32 {
        let pos_freq = self.theta.powf((2 * p) as f32 / rotary_dim as f32);
        let extrapolated = 1.0 / pos_freq;
        if self.factor == 0.0 {
            return extrapolated;
        }
        let interpolated = 1.0 / (self.factor * pos_freq);
        let ramp = ((p as f32 - self.ramp_low) / self.ramp_width).clamp(0.0, 1.0);
        let extrapolation = 1.0 - ramp;
        interpolated * (1.0 - extrapolation) + extrapolated * extrapolation
    }
}

impl Yarn {
    /// YaRN by `factor` over `original` positions, transformers' defaults for the rest (betas
    /// 32 and 1, the attention factor from the factor, the blend's bounds truncated).
    pub fn new(factor: f64, original: usize) -> Self {
        Self {
            factor,
            original_max_position_embeddings: original,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: Self::default_attention_factor(factor, None, None),
            truncate: true,
        }
    }

    /// YaRN's attention factor when the checkpoint gives none: from `mscale` and
    /// `mscale_all_dim` when both are given, else `0.1 ln(factor) + 1`.
    pub fn default_attention_factor(
        factor: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    ) -> f64 {
        let get = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        match (mscale, mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => get(factor, m) / get(factor, all),
            _ => get(factor, 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64, original: usize) -> RopeParams {
        RopeParams {
            theta: 1e6,
            yarn: Some(Yarn::new(factor, original)),
        }
    }

    /// transformers 5.24's `_compute_yarn_parameters` for head_dim 32, base 1e6, factor 4
    /// over 2,048 positions: the blend runs from pair 2 to pair 7, and the attention factor
    /// is 1.1386294.
    #[test]
    fn yarn_matches_transformers() {
        let rope = yarn(4.0, 2048);
        let args = rope.args(32);
        assert_eq!((args.ramp_low, args.ramp_width), (2.0, 5.0));
        assert!((rope.attention_factor() - 1.138_629_4).abs() < 1e-6);
        // transformers' inv_freq at pairs 1, 3, 5, 7 and 15 (printed from the function).
        for (p, theirs) in [
            (1, 0.421_696_5_f32),
            (3, 0.063_741_01),
            (5, 0.007_334_368),
            (7, 0.000_592_843_45),
            (15, 5.928_434e-7),
        ] {
            let ours = rope.inverse_frequency(p, 32);
            assert!(
                (ours - theirs).abs() <= 1e-6 * theirs,
                "pair {p}: {ours} against {theirs}"
            );
        }
        let plain = RopeParams::plain(1e6);
        for p in 0..16 {
            let (y, x) = (
                rope.inverse_frequency(p, 32),
                plain.inverse_frequency(p, 32),
            );
            match p {
                0..=2 => assert_eq!(y, x, "pair {p} extrapolates"),
                7.. => assert!((y - x / 4.0).abs() <= 1e-7 * x, "pair {p} interpolates"),
                _ => assert!(y < x && y > x / 4.0, "pair {p} blends"),
            }
        }
    }

    #[test]
    fn plain_rope_is_the_base_power() {
        let rope = RopeParams::plain(10_000.0);
        assert_eq!(rope.inverse_frequency(0, 64), 1.0);
        assert_eq!(rope.inverse_frequency(16, 64), 1.0 / 10_000f32.powf(0.5));
        assert_eq!(rope.attention_factor(), 1.0);
    }
}
