//! Helpers the CPU and CUDA op tests share.

use corral_backend::{Backend, BufferUsage, DType, DeltaNetShape, DeviceBuffer, RecurrentRuns};

/// `v` in a buffer of exactly its length.
pub(crate) fn upload(b: &dyn Backend, v: &[f32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::F32, v.len(), BufferUsage::Activations)
        .unwrap();
    b.upload_f32(v, &mut buf).unwrap();
    buf
}

/// `v` in a metadata buffer of exactly its length.
pub(crate) fn upload_u32(b: &dyn Backend, v: &[u32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::U32, v.len(), BufferUsage::Metadata)
        .unwrap();
    b.upload_u32(v, &mut buf).unwrap();
    buf
}

/// The first `n` values of `buf`.
pub(crate) fn download(b: &dyn Backend, buf: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    b.download_f32(buf, &mut out).unwrap();
    out
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
    let runs_buf = upload_u32(b, &flat);
    let kept_buf = kept.map(|k| upload_u32(b, k));
    let rr = RecurrentRuns {
        runs: &runs_buf,
        num_runs: runs.len(),
        max_run_tokens: runs.iter().map(|r| r[1] as usize).max().unwrap_or(1),
        kept: kept_buf.as_ref(),
    };
    let channels = w.len() / kernel;
    let (mut conv_state, mut conv_out) = (upload(b, conv0), upload(b, &vec![0.0; x.len()]));
    let weight = b.weight_from_f32(w, DType::F32).unwrap();
    b.causal_conv1d(
        &upload(b, x),
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
    let (mut state, mut out) = (upload(b, state0), upload(b, &vec![0.0; out_len]));
    b.gated_delta_rule(
        &upload(b, qkv),
        &upload(b, gate),
        &upload(b, beta),
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
