//! Per-expert strategies: the baseline Corral exists to replace, kept faithful on purpose,
//! and its milder form with one read-back per layer.
//! Routing is read back to the host; then, for each expert hit, in a host loop: its token
//! indices are uploaded, and the gather, gate, up, activation, down and weighted scatter-add
//! each run as their own dispatch into a freshly allocated buffer, followed by a blocking
//! wait. Nothing else in `moe/` may look like this.

use corral_backend::{Backend, BufferUsage, DType, DeviceBuffer, ExpertWeights, MoeRouting};

use crate::Result;

/// `out = Σ_j w_j · expert_j(x)` per token, expert by expert.
pub(super) fn forward(
    backend: &dyn Backend,
    x: &DeviceBuffer,
    routing: MoeRouting<'_>,
    experts: &ExpertWeights,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let MoeRouting { tokens, top_k, .. } = routing;
    let (hidden, inter) = (experts.gate.cols(), experts.gate.rows());
    let mut ids = vec![0u32; tokens * top_k];
    let mut weights = vec![0f32; tokens * top_k];
    backend.download_u32(routing.expert_ids, &mut ids)?;
    backend.download_f32(routing.expert_weights, &mut weights)?;
    backend.fill_zero(out, tokens * hidden)?;
    let alloc = |dtype, len| backend.alloc_zeroed(dtype, len, BufferUsage::Activations);
    for expert in 0..experts.gate.num_experts() {
        let (rows, scales): (Vec<u32>, Vec<f32>) = ids
            .iter()
            .zip(&weights)
            .enumerate()
            .filter(|(_, (e, _))| **e as usize == expert)
            .map(|(p, (_, w))| ((p / top_k) as u32, *w))
            .unzip();
        let n = rows.len();
        if n == 0 {
            continue;
        }
        let mut row_buf = alloc(DType::U32, n)?;
        backend.upload_u32(&rows, &mut row_buf)?;
        let mut scale_buf = alloc(DType::F32, n)?;
        backend.upload_f32(&scales, &mut scale_buf)?;
        let mut xe = alloc(DType::F32, n * hidden)?;
        backend.gather_rows(x, &row_buf, n, hidden, &mut xe)?;
        backend.synchronize()?;
        let mut gate = alloc(DType::F32, n * inter)?;
        backend.matmul(&xe, n, experts.gate.view(expert), &mut gate)?;
        backend.synchronize()?;
        let mut up = alloc(DType::F32, n * inter)?;
        backend.matmul(&xe, n, experts.up.view(expert), &mut up)?;
        backend.synchronize()?;
        let mut act = alloc(DType::F32, n * inter)?;
        backend.silu_mul(&gate, &up, n * inter, &mut act)?;
        backend.synchronize()?;
        let mut y = alloc(DType::F32, n * hidden)?;
        backend.matmul(&act, n, experts.down.view(expert), &mut y)?;
        backend.synchronize()?;
        backend.scale_scatter_add(&y, &row_buf, &scale_buf, n, hidden, out)?;
        backend.synchronize()?;
    }
    Ok(())
}

/// `out = Σ_j w_j · expert_j(x)` per token, expert by expert after one read-back of the
/// routing (transformers' loop): each hit expert's token rows and routing weights are
/// gathered on the device, its projections run back to back, and nothing waits until the
/// step's read-back. Buffers come from the pool and go back at the end of the layer.
pub(super) fn forward_one_sync(
    backend: &dyn Backend,
    x: &DeviceBuffer,
    routing: MoeRouting<'_>,
    experts: &ExpertWeights,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let MoeRouting { tokens, top_k, .. } = routing;
    let (hidden, inter) = (experts.gate.cols(), experts.gate.rows());
    let mut ids = vec![0u32; tokens * top_k];
    backend.download_u32(routing.expert_ids, &mut ids)?;
    backend.fill_zero(out, tokens * hidden)?;
    let mut held = Vec::new();
    let result = (|| {
        for expert in 0..experts.gate.num_experts() {
            let pairs: Vec<u32> = (0..ids.len() as u32)
                .filter(|&p| ids[p as usize] as usize == expert)
                .collect();
            let n = pairs.len();
            if n == 0 {
                continue;
            }
            let rows: Vec<u32> = pairs.iter().map(|&p| p / top_k as u32).collect();
            let mut take = |dtype, len| -> Result<usize> {
                held.push(backend.take_buffer(dtype, len, BufferUsage::Activations)?);
                Ok(held.len() - 1)
            };
            let (pb, rb) = (take(DType::U32, n)?, take(DType::U32, n)?);
            let (sb, xb) = (take(DType::F32, n)?, take(DType::F32, n * hidden)?);
            let (gb, ub) = (take(DType::F32, n * inter)?, take(DType::F32, n * inter)?);
            let (ab, yb) = (take(DType::F32, n * inter)?, take(DType::F32, n * hidden)?);
            backend.upload_u32(&pairs, &mut held[pb])?;
            backend.upload_u32(&rows, &mut held[rb])?;
            let [p, r, scale, xe, gate, up, act, y] = held
                .get_disjoint_mut([pb, rb, sb, xb, gb, ub, ab, yb])
                .map_err(|_| crate::ModelError::InvalidBatch("buffer bookkeeping".into()))?;
            backend.gather_rows(routing.expert_weights, p, n, 1, scale)?;
            backend.gather_rows(x, r, n, hidden, xe)?;
            backend.matmul(xe, n, experts.gate.view(expert), gate)?;
            backend.matmul(xe, n, experts.up.view(expert), up)?;
            backend.silu_mul(gate, up, n * inter, act)?;
            backend.matmul(act, n, experts.down.view(expert), y)?;
            backend.scale_scatter_add(y, r, scale, n, hidden, out)?;
        }
        Ok(())
    })();
    for buffer in held {
        backend.give_buffer(buffer);
    }
    result
}
