//! The Gated DeltaNet's recurrent ops. The CPU backend's entries: the computations in `ops/` on
//! arguments `dyn Backend`'s entries have checked.

use corral_backend::RecurrentOps;

use crate::*;
impl RecurrentOps for CpuBackend {
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
        let slots = conv_state.len() / (channels * (kernel - 1)).max(1);
        ops::with_reused(&RECURRENT_RUNS, |checked| {
            recurrent_runs(op, runs, tokens, slots, checked)?;
            let x = read_f32(op, x, tokens * channels)?;
            let weight = read_f32(op, weight, channels * kernel)?;
            let state = write_f32(op, conv_state, slots * channels * (kernel - 1))?;
            let out = write_f32(op, out, tokens * channels)?;
            self.stats.dispatch(1);
            ops::delta_net::causal_conv1d(x, weight, channels, kernel, checked, state, out);
            Ok(())
        })
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
        let a = read_f32(op, a, tokens * heads)?;
        let b = read_f32(op, b, tokens * heads)?;
        let a_log = read_f32(op, a_log, heads)?;
        let dt_bias = read_f32(op, dt_bias, heads)?;
        let g = write_f32(op, g, tokens * heads)?;
        let beta = write_f32(op, beta, tokens * heads)?;
        self.stats.dispatch(1);
        ops::delta_net::gates(a, b, a_log, dt_bias, heads, g, beta);
        Ok(())
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
        let width = 2 * nk * dk + nv * dv;
        let tokens = qkv.len() / width.max(1);
        let slots = recurrent_state.len() / (nv * dk * dv).max(1);
        ops::with_reused(&RECURRENT_RUNS, |checked| {
            recurrent_runs(op, runs, tokens, slots, checked)?;
            let qkv = read_f32(op, qkv, tokens * width)?;
            let g = read_f32(op, g, tokens * nv)?;
            let beta = read_f32(op, beta, tokens * nv)?;
            let state = write_f32(op, recurrent_state, slots * nv * dk * dv)?;
            let out = write_f32(op, out, tokens * nv * dv)?;
            self.stats.dispatch(1);
            ops::delta_net::delta_rule(qkv, g, beta, (nk, nv, dk, dv), checked, state, out);
            Ok(())
        })
    }
}
