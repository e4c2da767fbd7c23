//! The Gated DeltaNet's recurrent ops (`causal_conv1d.comp`, `delta_net_gates.comp`,
//! `gated_delta_rule.comp`, their runs read by `recurrent.glsl`): the convolution and decode's
//! delta rule step token by token through each run's slot's state, a dispatch for every span
//! of tokens of the promised longest run; prefill's delta rule goes in chunks
//! (`delta_rule_chunk_prepare.comp` for every chunk at once, then `delta_rule_chunk_scan.comp`
//! through each run's chunks in order, a wave of chunks at a time). A run beyond the batch or
//! the state pool, or longer than promised, is a fault the next read-back reports.

use corral_backend::{DeltaNetShape, DeviceBuffer, RecurrentOps, RecurrentRuns, Result};

use super::{grid, grid_of};
use crate::VulkanBackend;
use crate::args::{Args, address};

/// Value columns of the delta rule's state a workgroup keeps (`GROUP_SIZE` of
/// `gated_delta_rule.comp`).
const DELTA_COLUMNS: usize = 64;

/// Tokens of each run one delta-rule dispatch steps through: lavapipe ends an invocation's
/// loops after 65535 iterations in all, and a token takes up to 3 · 128 + 1 of them.
const DELTA_SPAN: usize = 64;

/// Tokens of a chunk of the chunked delta rule (`CHUNK` of `delta_chunks.glsl`).
const DELTA_CHUNK: usize = 32;

/// State columns a chunked scan's workgroup carries (`SLICE` of `delta_rule_chunk_scan.comp`).
const DELTA_SLICE: usize = 16;

/// Runs at least this long take the chunked delta rule (shorter ones, a decode step's or a
/// verify's, step token by token), unless they keep their states after each token.
const CHUNKED_DELTA_MIN_RUN: usize = 16;

/// Chunks one wave of the chunked delta rule takes at most: a scan's invocation loops about
/// 600 times a chunk, within lavapipe's 65535 (see [`DELTA_SPAN`]).
const DELTA_WAVE_CHUNKS: usize = 24;

/// Bytes of the chunked delta rule's scratch, allocated once: 24 chunks of 32 value heads of
/// dims 128 (Qwen3.5's and Qwen3-Next's) take 28.6 MiB; wider layers take fewer a wave.
pub(crate) const DELTA_SCRATCH_BYTES: usize = 32 << 20;

/// Floats of one (chunk, value head)'s products (`chunk_floats` of `delta_chunks.glsl`).
fn chunk_floats(dk: usize, dv: usize) -> usize {
    DELTA_CHUNK * (dk + dv + DELTA_CHUNK + 3)
}

/// Tokens of each run one convolution dispatch steps through (a token takes up to 47 loop
/// iterations; see [`DELTA_SPAN`]).
const CONV_SPAN: usize = 512;

/// The address of the runs' kept slots, 0 where none are kept.
fn kept_address(op: &'static str, runs: RecurrentRuns<'_>) -> Result<u64> {
    runs.kept.map_or(Ok(0), |kept| address(op, kept))
}

/// The first token of each span of `span` tokens covering the longest run (no run is longer
/// than the promise, nor than the batch of `tokens`): one span where every run is empty, for
/// fresh ones to zero their states.
fn spans(
    runs: RecurrentRuns<'_>,
    tokens: usize,
    span: usize,
) -> (usize, impl Iterator<Item = usize>) {
    let longest = runs.max_run_tokens.min(tokens);
    (longest, (0..longest.max(1)).step_by(span))
}

impl RecurrentOps for VulkanBackend {
    fn causal_conv1d(
        &self,
        x: &DeviceBuffer,
        weight: &DeviceBuffer,
        channels: usize,
        kernel: usize,
        runs: RecurrentRuns<'_>,
        conv_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "causal_conv1d";
        let tokens = x.len() / channels.max(1);
        let slots = conv_state.len() / (channels * kernel.saturating_sub(1)).max(1);
        let groups = grid_of(op, runs.num_runs * channels)?;
        let (longest, firsts) = spans(runs, tokens, CONV_SPAN);
        for first in firsts {
            let args = Args::new(op)
                .buf(x)?
                .buf(weight)?
                .buf(runs.runs)?
                .address(kept_address(op, runs)?)?
                .buf(conv_state)?
                .buf(out)?
                .address(self.fault.address())?
                .count(channels)?
                .count(kernel)?
                .count(runs.num_runs)?
                .count(longest)?
                .count(tokens)?
                .count(slots)?
                .count(first)?
                .count(CONV_SPAN)?;
            self.dispatch(op, groups, &args)?;
        }
        Ok(())
    }

    fn delta_net_gates(
        &self,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        a_log: &DeviceBuffer,
        dt_bias: &DeviceBuffer,
        tokens: usize,
        heads: usize,
        g: &mut DeviceBuffer,
        beta: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "delta_net_gates";
        let len = tokens * heads;
        let args = Args::new(op)
            .buf(a)?
            .buf(b)?
            .buf(a_log)?
            .buf(dt_bias)?
            .buf(g)?
            .buf(beta)?
            .count(len)?
            .count(heads)?;
        self.dispatch(op, grid_of(op, len)?, &args)
    }

    fn gated_delta_rule(
        &self,
        qkv: &DeviceBuffer,
        g: &DeviceBuffer,
        beta: &DeviceBuffer,
        shape: DeltaNetShape,
        runs: RecurrentRuns<'_>,
        recurrent_state: &mut DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        } = shape;
        let tokens = qkv.len() / (2 * nk * dk + nv * dv).max(1);
        let slots = recurrent_state.len() / (nv * dk * dv).max(1);
        let per_wave =
            (DELTA_SCRATCH_BYTES / 4 / (nv * chunk_floats(dk, dv)).max(1)).min(DELTA_WAVE_CHUNKS);
        if runs.max_run_tokens >= CHUNKED_DELTA_MIN_RUN
            && runs.kept.is_none()
            && !self.recurrent_delta_rule
            && per_wave > 0
        {
            let args = |first: usize, wave: usize| {
                Args::new(op)
                    .buf(qkv)?
                    .buf(g)?
                    .buf(beta)?
                    .buf(runs.runs)?
                    .address(self.delta_scratch.address())?
                    .buf(recurrent_state)?
                    .buf(out)?
                    .address(self.fault.address())?
                    .count(nk)?
                    .count(nv)?
                    .count(dk)?
                    .count(dv)?
                    .count(runs.num_runs)?
                    .count(runs.max_run_tokens.min(tokens))?
                    .count(tokens)?
                    .count(slots)?
                    .count(first)?
                    .count(wave)
            };
            return self.chunked_delta_rule(shape, runs, tokens, per_wave, args);
        }
        let groups = grid(op, runs.num_runs * nv * dv.div_ceil(DELTA_COLUMNS))?;
        let (longest, firsts) = spans(runs, tokens, DELTA_SPAN);
        for first in firsts {
            let args = Args::new(op)
                .buf(qkv)?
                .buf(g)?
                .buf(beta)?
                .buf(runs.runs)?
                .address(kept_address(op, runs)?)?
                .buf(recurrent_state)?
                .buf(out)?
                .address(self.fault.address())?
                .count(nk)?
                .count(nv)?
                .count(dk)?
                .count(dv)?
                .count(runs.num_runs)?
                .count(longest)?
                .count(tokens)?
                .count(slots)?
                .count(first)?
                .count(DELTA_SPAN)?;
            self.dispatch(op, groups, &args)?;
        }
        Ok(())
    }
}

impl VulkanBackend {
    /// The chunked delta rule (the math of the CPU's) over a batch of `tokens`, `per_wave`
    /// chunks of every value head at a time: the chunks' products of a wave
    /// (`delta_rule_chunk_prepare`), then each run's state through them
    /// (`delta_rule_chunk_scan`), carried in its slot between waves; `args(first, wave)` are
    /// both shaders' arguments (`delta_chunks.glsl`).
    fn chunked_delta_rule(
        &self,
        shape: DeltaNetShape,
        runs: RecurrentRuns<'_>,
        tokens: usize,
        per_wave: usize,
        args: impl Fn(usize, usize) -> Result<Args>,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let (nv, dv) = (shape.num_value_heads, shape.value_dim);
        let longest = runs.max_run_tokens.min(tokens);
        // Every run has at most one partial chunk.
        let chunks = (tokens.div_ceil(DELTA_CHUNK) + runs.num_runs)
            .min(runs.num_runs * longest.div_ceil(DELTA_CHUNK));
        let scan_groups = grid(op, runs.num_runs * nv * dv.div_ceil(DELTA_SLICE))?;
        for first in (0..chunks.max(1)).step_by(per_wave) {
            let wave = per_wave.min(chunks.saturating_sub(first));
            let args = args(first, wave)?;
            self.dispatch("delta_rule_chunk_prepare", grid(op, wave * nv)?, &args)?;
            self.dispatch("delta_rule_chunk_scan", scan_groups, &args)?;
        }
        Ok(())
    }
}
