//! The Gated DeltaNet's recurrent ops. The CUDA backend's host halves: launches of the kernels
//! beside them, on arguments `dyn Backend`'s entries have checked.

use corral_backend::RecurrentOps;

use crate::*;
impl RecurrentOps for CudaBackend {
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
        if runs.num_runs == 0 || channels == 0 {
            return Ok(());
        }
        let tokens = x.len() / channels;
        let slots = conv_state.len() / (channels * (kernel - 1));
        let args = [
            addr(op, x)?,
            addr(op, weight)?,
            u32_of(op, channels)?,
            u32_of(op, kernel)?,
            addr(op, runs.runs)?,
            u32_of(op, tokens)?,
            u32_of(op, slots)?,
            addr(op, conv_state)?,
            addr(op, out)?,
            kept_arg(op, runs)?,
            self.diag(),
        ];
        // Tiles of CONV_TILE tokens (delta_net.cu) of the longest run.
        let grid = (
            grid_of(op, channels.div_ceil(32))?,
            grid_of(op, runs.max_run_tokens.div_ceil(64).max(1))?,
            grid_of(op, runs.num_runs)?,
        );
        self.launch(&self.kernels.causal_conv1d, grid, 256, &args)
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
        if len == 0 {
            return Ok(());
        }
        let args = [
            addr(op, a)?,
            addr(op, b)?,
            addr(op, a_log)?,
            addr(op, dt_bias)?,
            u32_of(op, tokens)?,
            u32_of(op, heads)?,
            addr(op, g)?,
            addr(op, beta)?,
        ];
        self.launch(
            &self.kernels.delta_net_gates,
            Self::elementwise_grid(op, len)?,
            256,
            &args,
        )
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
        if runs.num_runs == 0 {
            return Ok(());
        }
        let width = 2 * nk * dk + nv * dv;
        let tokens = qkv.len() / width;
        let slots = recurrent_state.len() / (nv * dk * dv);
        let args = [
            addr(op, qkv)?,
            addr(op, g)?,
            addr(op, beta)?,
            u32_of(op, nk)?,
            u32_of(op, nv)?,
            u32_of(op, dk)?,
            u32_of(op, dv)?,
            addr(op, runs.runs)?,
            u32_of(op, tokens)?,
            u32_of(op, slots)?,
            addr(op, recurrent_state)?,
            addr(op, out)?,
            self.diag(),
        ];
        // Runs keeping their states go token by token (a verify's few tokens).
        if runs.max_run_tokens >= CHUNKED_DELTA_MIN_RUN
            && !self.recurrent_delta_rule
            && runs.kept.is_none()
        {
            let per_wave = OP_SCRATCH_FLOATS * 4 / (nv * gdr_chunk_bytes(dk, dv));
            if per_wave > 0 {
                // Every run has at most one partial chunk.
                let chunks = (tokens.div_ceil(GDR_CHUNK) + runs.num_runs)
                    .min(runs.num_runs * runs.max_run_tokens.div_ceil(GDR_CHUNK));
                return self.chunked_delta_rule(args, chunks, (nv, dv), runs.num_runs, per_wave);
            }
        }
        // Two threads per state column, and at least one per key dim, in whole warps.
        let threads = (2 * dv).max(dk).div_ceil(32) * 32;
        let grid = (grid_of(op, runs.num_runs)?, grid_of(op, nv)?, 1);
        let kernel = if threads <= 256 {
            &self.kernels.gated_delta_rule_256
        } else {
            &self.kernels.gated_delta_rule
        };
        let [head @ .., diag] = args;
        let mut with_kept = [Arg::Ptr(0); 14];
        with_kept[..12].copy_from_slice(&head);
        with_kept[12] = kept_arg(op, runs)?;
        with_kept[13] = diag;
        self.launch(kernel, grid, threads as u32, &with_kept)
    }
}

impl CudaBackend {
    /// The chunked gated delta rule (delta_net.cu's gdr_chunk_prepare and gdr_chunk_scan) over
    /// at most `chunks` chunks, in launch pairs of `per_wave`: `args` are
    /// [`Ops::gated_delta_rule`](corral_backend::Ops::gated_delta_rule)'s kernel arguments.
    pub(crate) fn chunked_delta_rule(
        &self,
        args: [Arg; 13],
        chunks: usize,
        (nv, dv): (usize, usize),
        num_runs: usize,
        per_wave: usize,
    ) -> Result<()> {
        let op = "gated_delta_rule";
        let [
            qkv,
            g,
            beta,
            nk_a,
            nv_a,
            dk_a,
            dv_a,
            runs,
            tokens_a,
            slots,
            state,
            out,
            diag,
        ] = args;
        let scratch = Arg::Ptr(ptr_of(op, &self.op_scratch)?);
        for first in (0..chunks).step_by(per_wave) {
            let wave = per_wave.min(chunks - first);
            let (first_a, num_runs_a) = (u32_of(op, first)?, u32_of(op, num_runs)?);
            let prepare = [
                qkv, g, beta, nk_a, nv_a, dk_a, dv_a, runs, num_runs_a, tokens_a, slots, first_a,
                scratch, diag,
            ];
            self.launch(
                &self.kernels.gdr_chunk_prepare,
                (grid_of(op, wave)?, grid_of(op, nv)?, 1),
                GDR_THREADS,
                &prepare,
            )?;
            let scan = [
                nv_a,
                dk_a,
                dv_a,
                runs,
                num_runs_a,
                tokens_a,
                slots,
                first_a,
                u32_of(op, wave)?,
                u32_of(op, chunks)?,
                scratch,
                state,
                out,
                diag,
            ];
            let grid = (
                grid_of(op, num_runs)?,
                grid_of(op, nv)?,
                grid_of(op, dv.div_ceil(GDR_SLICE))?,
            );
            self.launch(&self.kernels.gdr_chunk_scan, grid, GDR_THREADS, &scan)?;
        }
        Ok(())
    }
}
