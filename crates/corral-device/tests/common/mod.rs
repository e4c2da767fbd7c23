//! Helpers the op tests share (the conformance suite, and the CPU's and CUDA's own).

use std::sync::Arc;

use corral_backend::{
    Backend, BufferUsage, DType, DeltaNetShape, DeviceBuffer, ExpertMatrices, ExpertWeights,
    QuantFormat, RecurrentRuns,
};

/// `v` in a buffer of its length (at least one element).
pub(crate) fn f32_buf(b: &dyn Backend, v: &[f32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::F32, v.len().max(1), BufferUsage::Activations)
        .unwrap();
    b.upload_f32(v, &mut buf).unwrap();
    buf
}

/// `v` in a metadata buffer of its length (at least one element).
pub(crate) fn u32_buf(b: &dyn Backend, v: &[u32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::U32, v.len().max(1), BufferUsage::Metadata)
        .unwrap();
    b.upload_u32(v, &mut buf).unwrap();
    buf
}

/// An f32 buffer of `n` NaNs, so that an element an op fails to write shows.
pub(crate) fn out_buf(b: &dyn Backend, n: usize) -> DeviceBuffer {
    f32_buf(b, &vec![f32::NAN; n])
}

/// The first `n` values of `buf`.
pub(crate) fn download(b: &dyn Backend, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    b.download_f32(buf, &mut out).unwrap();
    out
}

/// `e` experts in block formats as a Q4_K_M file stores them: gate and up stacked in one
/// `up_format` tensor of [e, 2i, h] (`gate_up` its blocks), down in a `down_format` one of
/// [e, h, i].
pub(crate) fn block_experts(
    b: &dyn Backend,
    (up_format, gate_up): (QuantFormat, &[u8]),
    (down_format, down): (QuantFormat, &[u8]),
    (e, h, i): (usize, usize, usize),
) -> ExpertWeights {
    let gate_up = b
        .weight_from_blocks(gate_up.to_vec(), DType::Quant(up_format), e * 2 * i * h)
        .unwrap();
    let down = b
        .weight_from_blocks(down.to_vec(), DType::Quant(down_format), e * h * i)
        .unwrap();
    let gate_up = Arc::new(gate_up);
    ExpertWeights {
        gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h).unwrap(),
        up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h).unwrap(),
        down: ExpertMatrices::stacked(Arc::new(down), e, h, 0, h, i).unwrap(),
    }
}

/// What a Gated DeltaNet layer's two recurrent ops leave: the convolution's and the delta
/// rule's outputs and state pools.
pub(crate) struct Recurrence {
    pub(crate) conv_out: Vec<f32>,
    pub(crate) conv_state: Vec<f32>,
    pub(crate) out: Vec<f32>,
    pub(crate) state: Vec<f32>,
}

/// The convolution and the delta rule over `runs` (`[start, len, slot, fresh]` each), from
/// the state pools `conv0` and `state0`, keeping intermediate states from the slots `kept`
/// names per run where it is given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn recurrence(
    b: &dyn Backend,
    (x, w, kernel): (&[f32], &[f32], usize),
    (qkv, gate, beta): (&[f32], &[f32], &[f32]),
    shape: DeltaNetShape,
    runs: &[[u32; 4]],
    kept: Option<&[u32]>,
    (conv0, state0): (&[f32], &[f32]),
) -> Recurrence {
    let flat: Vec<u32> = runs.iter().flatten().copied().collect();
    let runs_buf = u32_buf(b, &flat);
    let kept_buf = kept.map(|k| u32_buf(b, k));
    let rr = RecurrentRuns {
        runs: &runs_buf,
        num_runs: runs.len(),
        max_run_tokens: runs.iter().map(|r| r[1] as usize).max().unwrap_or(1),
        kept: kept_buf.as_ref(),
    };
    let channels = w.len() / kernel;
    let (mut conv_state, mut conv_out) = (f32_buf(b, conv0), f32_buf(b, &vec![0.0; x.len()]));
    let weight = b.weight_from_f32(w, DType::F32).unwrap();
    b.causal_conv1d(
        &f32_buf(b, x),
        &weight,
        channels,
        kernel,
        rr,
        &mut conv_state,
        &mut conv_out,
    )
    .unwrap();
    let tokens = gate.len() / shape.num_value_heads;
    let out_len = tokens * shape.num_value_heads * shape.value_dim;
    let (mut state, mut out) = (f32_buf(b, state0), f32_buf(b, &vec![0.0; out_len]));
    b.gated_delta_rule(
        &f32_buf(b, qkv),
        &f32_buf(b, gate),
        &f32_buf(b, beta),
        shape,
        rr,
        &mut state,
        &mut out,
    )
    .unwrap();
    Recurrence {
        conv_out: download(b, &conv_out, x.len()),
        conv_state: download(b, &conv_state, conv0.len()),
        out: download(b, &out, out_len),
        state: download(b, &state, state0.len()),
    }
}

/// A deterministic stream of values in [-1, 1) and indices.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// The next 31 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// A value below `n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` values in [-1, 1).
    pub(crate) fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / (1u64 << 31) as f32) * 2.0 - 1.0)
            .collect()
    }
}
