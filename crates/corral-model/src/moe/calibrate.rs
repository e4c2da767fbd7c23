//! Measuring where the grouped strategy starts beating per-token products, for this model's
//! MoE shape on this device: the `auto` threshold is a measurement, never a constant carried
//! over from another machine. Results are cached on disk by device and shape.

use std::path::PathBuf;
use std::time::Instant;

use corral_backend::{Backend, DType};

use super::{MoeStrategy, SparseMoe};
use crate::layers::Workspace;
use crate::{ModelConfig, Result};

/// Token counts timed, in order.
pub const CALIBRATION_TOKENS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// What calibration found.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeCalibration {
    /// Tokens from which grouped runs under `auto`.
    pub grouped_min_tokens: usize,
    /// (tokens, per-token ms, grouped ms) per count timed; empty when read from the cache.
    pub timings: Vec<(usize, f64, f64)>,
    /// Whether the result came from the on-disk cache.
    pub cached: bool,
}

/// The smallest count from which grouped is at least as fast as per-token at every larger
/// count timed (one past the last count if it never is).
pub fn crossover(timings: &[(usize, f64, f64)]) -> usize {
    let mut threshold = timings.last().map_or(1, |t| t.0 * 2);
    for &(tokens, per_token, grouped) in timings.iter().rev() {
        if grouped <= per_token {
            threshold = tokens;
        } else {
            break;
        }
    }
    threshold
}

fn cache_path(device: &str, kernels: u64, config: &ModelConfig, experts: &str) -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = env("CORRAL_CALIBRATION_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("corral/calibration")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/corral/calibration")))?;
    let moe = config.moe.as_ref()?;
    let key = format!(
        "v4|{device}|kernels {kernels:016x}|h{}|e{}|k{}|i{}|{:?}|{experts}",
        config.hidden_size, moe.num_experts, moe.top_k, moe.moe_intermediate_size, config.dtype
    );
    let hash = corral_backend::fnv1a(key.as_bytes());
    Some(dir.join(format!("moe-{hash:016x}.txt")))
}

/// Milliseconds one timing of back-to-back blocks aims at: a slow device (lavapipe, a CPU
/// running Vulkan) times fewer blocks instead of taking minutes.
const TIMING_BUDGET_MS: f64 = 25.0;

/// Blocks to time back to back: `reps`, or fewer where the warm-up block took so long that
/// `reps` of them would overrun [`TIMING_BUDGET_MS`]; at least one.
fn reps_within(reps: usize, warm_up_ms: f64) -> usize {
    let fit = (TIMING_BUDGET_MS / warm_up_ms.max(1e-6)).floor();
    if fit >= reps as f64 {
        reps
    } else {
        (fit as usize).max(1)
    }
}

/// Times the MoE blocks under per-token and grouped for each of [`CALIBRATION_TOKENS`]
/// (`reps` blocks back to back per timing, fewer where a block is slow, median of three,
/// after a warm-up), or reads an earlier result for the same device and shape.
pub(crate) fn calibrate(
    backend: &dyn Backend,
    config: &ModelConfig,
    moes: &[&SparseMoe],
    reps: usize,
) -> Result<MoeCalibration> {
    let Some(first) = moes.first() else {
        return Ok(MoeCalibration {
            grouped_min_tokens: crate::DEFAULT_GROUPED_MIN_TOKENS,
            timings: Vec::new(),
            cached: false,
        });
    };
    // The experts' stored types (block formats run other kernels).
    let experts = first.expert_dtypes();
    let path = cache_path(
        &backend.device_name(),
        backend.kernels_id(),
        config,
        &experts,
    );
    if let Some(n) = path
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| s.trim().parse::<usize>().ok())
    {
        return Ok(MoeCalibration {
            grouped_min_tokens: n,
            timings: Vec::new(),
            cached: true,
        });
    }
    let mut timings = Vec::new();
    for &tokens in &CALIBRATION_TOKENS {
        let mut ws = Workspace::take(backend, config, (tokens, DType::F32), 1, 1, 1)?;
        let values: Vec<f32> = (0..tokens * config.hidden_size)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 2.0)
            .collect();
        let result = (|| {
            backend.upload_f32(&values, &mut ws.h)?;
            // Back-to-back blocks between two waits, as inside a forward, where launches
            // overlap the previous block's work, each block a different layer's (as in a
            // forward, whose experts are not in cache); the median of three such runs.
            let mut medians = [0.0f64; 2];
            for (m, strategy) in medians
                .iter_mut()
                .zip([MoeStrategy::PerToken, MoeStrategy::Grouped])
            {
                backend.synchronize()?;
                let warm_up = Instant::now();
                first.forward(backend, &mut ws, tokens, strategy)?;
                backend.synchronize()?;
                let reps = reps_within(reps, warm_up.elapsed().as_secs_f64() * 1e3);
                let mut times = Vec::with_capacity(3);
                for _ in 0..3 {
                    backend.synchronize()?;
                    let start = Instant::now();
                    for rep in 0..reps {
                        moes[rep % moes.len()].forward(backend, &mut ws, tokens, strategy)?;
                    }
                    backend.synchronize()?;
                    times.push(start.elapsed().as_secs_f64() * 1e3 / reps as f64);
                }
                times.sort_by(f64::total_cmp);
                *m = times[1];
            }
            Ok::<_, crate::ModelError>(medians)
        })();
        // One read-back, so that the device's counters (and any error it flagged) belong to
        // the calibration, not to the first forward after it.
        let flushed = result.and_then(|m| {
            let mut one = [0u32; 1];
            backend.download_u32(&ws.expert_ids, &mut one)?;
            Ok(m)
        });
        ws.give(backend);
        let [per_token, grouped] = flushed?;
        timings.push((tokens, per_token, grouped));
    }
    let grouped_min_tokens = crossover(&timings);
    if let Some(path) = path {
        // A cache that cannot be written costs a calibration next start, nothing more.
        let _ = path
            .parent()
            .map(std::fs::create_dir_all)
            .map(|_| std::fs::write(&path, format!("{grouped_min_tokens}\n")));
    }
    Ok(MoeCalibration {
        grouped_min_tokens,
        timings,
        cached: false,
    })
}

#[cfg(test)]
mod tests {
    use super::{cache_path, crossover, reps_within};

    /// A fast block is timed `reps` times; a slow one fewer, down to one, within the budget.
    #[test]
    fn slow_blocks_are_timed_fewer_times() {
        assert_eq!(reps_within(48, 0.1), 48);
        assert_eq!(reps_within(48, 0.0), 48);
        assert_eq!(reps_within(48, 5.0), 5);
        assert_eq!(reps_within(48, 24.0), 1);
        assert_eq!(reps_within(48, 400.0), 1);
    }

    #[test]
    fn a_calibration_is_cached_per_device_shape_kernels_and_expert_types() {
        let config = crate::ModelConfig::from_json(
            include_str!("../../../../bench/configs/qwen3-30b-a3b.json"),
            std::path::Path::new("qwen3-30b-a3b.json"),
        )
        .expect("bench config");
        let path = |device: &str, kernels| cache_path(device, kernels, &config, "BF16/BF16");
        if path("gpu", 1).is_none() {
            return; // no cache folder in this environment
        }
        assert_ne!(
            path("gpu", 1),
            cache_path("gpu", 1, &config, "Q4K/Q6K"),
            "block-format experts, new measurement"
        );
        assert_ne!(
            path("gpu", 1),
            path("gpu", 2),
            "new kernels, new measurement"
        );
        assert_ne!(path("gpu", 1), path("other gpu", 1));
        assert_eq!(path("gpu", 1), path("gpu", 1));
    }

    #[test]
    fn the_threshold_is_where_grouped_stays_ahead() {
        let t = |p: f64, g: f64, n| (n, p, g);
        assert_eq!(
            crossover(&[t(1.0, 2.0, 1), t(2.0, 2.0, 2), t(5.0, 3.0, 4)]),
            2
        );
        // A lucky win below a loss does not count.
        assert_eq!(
            crossover(&[t(2.0, 1.0, 1), t(1.0, 2.0, 2), t(5.0, 3.0, 4)]),
            4
        );
        assert_eq!(crossover(&[t(1.0, 2.0, 1), t(1.0, 2.0, 8)]), 16);
        assert_eq!(crossover(&[t(3.0, 2.0, 1), t(3.0, 2.0, 8)]), 1);
    }
}
