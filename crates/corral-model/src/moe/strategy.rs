//! Which MoE execution strategy runs, and why. All strategies compute the same function; the
//! conformance and equivalence tests hold them to it.

use std::fmt;
use std::str::FromStr;

/// Default token threshold of [`MoeStrategy::Auto`]: from this many routed tokens on, grouped
/// execution is at least as fast as per-token matrix-vector products on the CPU.
///
/// Measured (docs/performance-log.md, "Choosing the auto threshold"): synthetic Qwen3-MoE, 64
/// experts, top-8, hidden 512, 2 threads, median TTFT per-token / grouped: 1 token 30.6 / 31.2
/// ms (within noise), 2 tokens 34.4 / 34.4 ms, 3 tokens 38.1 / 35.7 ms, 8 tokens 50.1 / 43.3 ms.
pub const DEFAULT_GROUPED_MIN_TOKENS: usize = 2;

/// How a sparse MoE block runs its routed experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeStrategy {
    /// The baseline being replaced: routing read back to the host, then per hit expert a
    /// gather, gate, up, activation, down and scatter, each a dispatch with its own buffer
    /// and a blocking wait.
    PerExpert,
    /// The milder baseline, as transformers' expert loop: routing read back once per layer,
    /// then each hit expert's gather, projections and scatter launched one after another
    /// with pooled buffers and no further wait.
    PerExpertOneSync,
    /// One matrix-vector product per (token, expert) pair, no sorting: for tiny batches.
    PerToken,
    /// Pairs sorted by expert on the device, then one dispatch per operator over all experts.
    Grouped,
    /// Per-token below `grouped_min_tokens` routed tokens, grouped at or above.
    Auto {
        /// Token count from which grouped runs.
        grouped_min_tokens: usize,
    },
}

impl Default for MoeStrategy {
    fn default() -> Self {
        MoeStrategy::Auto {
            grouped_min_tokens: DEFAULT_GROUPED_MIN_TOKENS,
        }
    }
}

impl MoeStrategy {
    /// The concrete strategy for a layer routing `tokens` tokens.
    pub fn resolve(self, tokens: usize) -> MoeStrategy {
        match self {
            MoeStrategy::Auto { grouped_min_tokens } if tokens >= grouped_min_tokens => {
                MoeStrategy::Grouped
            }
            MoeStrategy::Auto { .. } => MoeStrategy::PerToken,
            concrete => concrete,
        }
    }

    /// Whether the strategy reads anything back to the host inside the layer for `tokens`
    /// tokens. // [NO_SYNC_IN_LAYER]
    pub fn syncs_host(self, tokens: usize) -> bool {
        matches!(
            self.resolve(tokens),
            MoeStrategy::PerExpert | MoeStrategy::PerExpertOneSync
        )
    }

    /// The strategy's command-line name.
    pub fn name(self) -> &'static str {
        match self {
            MoeStrategy::PerExpert => "per-expert",
            MoeStrategy::PerExpertOneSync => "per-expert-one-sync",
            MoeStrategy::PerToken => "per-token",
            MoeStrategy::Grouped => "grouped",
            MoeStrategy::Auto { .. } => "auto",
        }
    }
}

impl fmt::Display for MoeStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A strategy name that is not one of `per-expert`, `per-expert-one-sync`, `per-token`,
/// `grouped`, `auto`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown MoE strategy `{0}` (expected per-expert, per-expert-one-sync, per-token, grouped or auto)"
)]
pub struct UnknownStrategy(pub String);

impl FromStr for MoeStrategy {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "per-expert" => Ok(MoeStrategy::PerExpert),
            "per-expert-one-sync" => Ok(MoeStrategy::PerExpertOneSync),
            "per-token" => Ok(MoeStrategy::PerToken),
            "grouped" => Ok(MoeStrategy::Grouped),
            "auto" => Ok(MoeStrategy::default()),
            other => Err(UnknownStrategy(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_switches_at_the_threshold() {
        let auto = MoeStrategy::Auto {
            grouped_min_tokens: 4,
        };
        assert_eq!(auto.resolve(3), MoeStrategy::PerToken);
        assert_eq!(auto.resolve(4), MoeStrategy::Grouped);
        assert_eq!(MoeStrategy::PerExpert.resolve(100), MoeStrategy::PerExpert);
        assert!(MoeStrategy::PerExpert.syncs_host(1));
        assert!(MoeStrategy::PerExpertOneSync.syncs_host(1));
        assert!(!auto.syncs_host(1000));
    }

    #[test]
    fn names_round_trip() {
        for s in [
            "per-expert",
            "per-expert-one-sync",
            "per-token",
            "grouped",
            "auto",
        ] {
            assert_eq!(s.parse::<MoeStrategy>().unwrap().name(), s);
        }
        assert!("fast".parse::<MoeStrategy>().is_err());
    }
}
