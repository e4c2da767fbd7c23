//! The CPU backend's own op tests: fused ops against their parts, the pool, byte copies, kept
//! states (the ops against plain references are in the conformance suite).

use corral_backend::{Backend, BufferUsage, DType, WeightView};
use corral_cpu::CpuBackend;
use proptest::prelude::*;

// The other op tests' helpers come too, not all used here.
#[allow(dead_code)]
mod common;

use common::{Rng, download, f32_buf, u32_buf};

fn close(a: &[f32], b: &[f32], tol: f32) -> Result<(), TestCaseError> {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        prop_assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {}: {} vs {}",
            i,
            x,
            y
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fused_qkv_norm_rope_store_equals_the_separate_ops(
        tokens in 1usize..9, heads in 1usize..5, kv_heads in 1usize..3, quarter in 1usize..9,
        partial in any::<bool>(), yarn in any::<bool>(), seed in any::<u64>(),
    ) {
        let b: &dyn Backend = &CpuBackend::new();
        let head_dim = 4 * quarter;
        let rope = corral_backend::RopeParams {
            theta: 1e6,
            yarn: yarn.then_some(corral_backend::Yarn::new(4.0, 256)),
        };
        let rotary_dim = if partial { head_dim / 2 } else { head_dim };
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let width = q_dim + 2 * kv_dim;
        let qkv = Rng(seed).values(tokens * width);
        let (qw, kw) = (Rng(seed ^ 3).values(head_dim), Rng(seed ^ 5).values(head_dim));
        let positions: Vec<u32> = (0..tokens).map(|t| (seed as u32 % 900) + 3 * t as u32).collect();
        // Distinct slots in a cache of more slots than tokens, in no particular order.
        let capacity = tokens + 5;
        let slots: Vec<u32> = (0..tokens).map(|t| ((t * 7 + seed as usize) % capacity) as u32).collect();
        prop_assume!({ let mut s = slots.clone(); s.sort(); s.dedup(); s.len() == tokens });
        let shape = corral_backend::QkShape {
            tokens, heads, kv_heads, head_dim, rotary_dim, rope, eps: 1e-6,
        };
        let (qw_b, kw_b) = (b.weight_from_f32(&qw, DType::F32).unwrap(), b.weight_from_f32(&kw, DType::F32).unwrap());
        let (pos_b, slot_b) = (u32_buf(b, &positions), u32_buf(b, &slots));
        let cache = |b: &dyn Backend| f32_buf(b, &vec![0.0; capacity * kv_dim]);
        let mut q_fused = f32_buf(b, &vec![0.0; tokens * q_dim]);
        let (mut k_fused, mut v_fused) = (cache(b), cache(b));
        b.qkv_norm_rope_store(&f32_buf(b, &qkv), &qw_b, &kw_b, &pos_b, &slot_b, shape, &mut q_fused, &mut k_fused, &mut v_fused).unwrap();
        // The same through rms_norm, rope and kv_store on q, k and v split apart.
        let part = |from: usize, len: usize| -> Vec<f32> {
            qkv.chunks(width).flat_map(|row| row[from..from + len].to_vec()).collect()
        };
        let (q, k, v) = (part(0, q_dim), part(q_dim, kv_dim), part(q_dim + kv_dim, kv_dim));
        let mut q_out = f32_buf(b, &vec![0.0; tokens * q_dim]);
        let mut k_out = f32_buf(b, &vec![0.0; tokens * kv_dim]);
        b.rms_norm(&f32_buf(b, &q), &qw_b, tokens * heads, head_dim, 1e-6, false, &mut q_out).unwrap();
        b.rms_norm(&f32_buf(b, &k), &kw_b, tokens * kv_heads, head_dim, 1e-6, false, &mut k_out).unwrap();
        b.rope(&mut q_out, &pos_b, tokens, heads, head_dim, rotary_dim, rope).unwrap();
        b.rope(&mut k_out, &pos_b, tokens, kv_heads, head_dim, rotary_dim, rope).unwrap();
        let (mut k_sep, mut v_sep) = (cache(b), cache(b));
        b.kv_store(&k_out, &f32_buf(b, &v), &slot_b, tokens, kv_heads, head_dim, &mut k_sep, &mut v_sep).unwrap();
        let n = capacity * kv_dim;
        prop_assert_eq!(download(b, &q_fused, tokens * q_dim), download(b, &q_out, tokens * q_dim));
        prop_assert_eq!(download(b, &k_fused, n), download(b, &k_sep, n));
        prop_assert_eq!(download(b, &v_fused, n), download(b, &v_sep, n));
    }
}

#[test]
fn pool_reuses_buffers_and_counts_only_misses() {
    let b: &dyn Backend = &CpuBackend::new();
    let before = b.stats();
    let big = b
        .take_buffer(DType::F32, 100, BufferUsage::Activations)
        .unwrap();
    b.give_buffer(big);
    let small = b
        .take_buffer(DType::F32, 40, BufferUsage::Activations)
        .unwrap();
    assert_eq!(small.len(), 40);
    assert_eq!(small.capacity(), 100);
    let other = b
        .take_buffer(DType::U32, 40, BufferUsage::Metadata)
        .unwrap();
    assert_eq!(
        (b.stats() - before).allocations,
        2,
        "one f32 miss, one u32 miss"
    );
    b.give_buffer(small);
    b.give_buffer(other);
}

/// Several projections of one input equal one `matmul` each, and weights without as many
/// outputs are an error.
#[test]
fn matmuls_equal_each_matmul() {
    let b: &dyn Backend = &CpuBackend::new();
    let (rows, k, ns) = (5, 24, [7, 16, 3]);
    let x = f32_buf(b, &Rng(9).values(rows * k));
    let weights: Vec<_> = ns
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            b.weight_from_f32(&Rng(10 + i as u64).values(n * k), DType::BF16)
                .unwrap()
        })
        .collect();
    let views: Vec<WeightView> = weights
        .iter()
        .zip(ns)
        .map(|(w, n)| WeightView::new(w, n, k).unwrap())
        .collect();
    let take = |n: usize| {
        b.take_buffer(DType::F32, rows * n, BufferUsage::Activations)
            .unwrap()
    };
    let mut joint: Vec<_> = ns.iter().map(|&n| take(n)).collect();
    let mut outs: Vec<&mut corral_backend::DeviceBuffer> = joint.iter_mut().collect();
    b.matmuls(&x, rows, &views, &mut outs).unwrap();
    for ((view, out), n) in views.iter().zip(&joint).zip(ns) {
        let mut each = take(n);
        b.matmul(&x, rows, *view, &mut each).unwrap();
        assert_eq!(download(b, out, rows * n), download(b, &each, rows * n));
    }
    let mut one = take(7);
    let err = b.matmuls(&x, rows, &views, &mut [&mut one]).unwrap_err();
    assert!(err.to_string().contains("3 weights for 1 outputs"), "{err}");
}

#[test]
fn ops_reject_bad_arguments_without_panicking() {
    let b: &dyn Backend = &CpuBackend::new();
    let x = f32_buf(b, &[1.0; 8]);
    let w = b.weight_from_f32(&[1.0; 8], DType::BF16).unwrap();
    let mut out = b
        .take_buffer(DType::F32, 2, BufferUsage::Activations)
        .unwrap();
    // Needs 4 rows of 8 but x holds one row.
    let err = b
        .matmul(&x, 4, WeightView::new(&w, 1, 8).unwrap(), &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("matmul"), "{err}");
    assert!(
        WeightView::new(&w, 3, 8).is_err(),
        "view larger than the buffer"
    );
}

#[test]
fn read_and_write_bytes_round_trip_and_reject_bad_ranges() {
    let b: &dyn Backend = &CpuBackend::new();
    let v = Rng(4).values(10);
    let buf = f32_buf(b, &v);
    let mut bytes = vec![0u8; 16];
    b.read_bytes(&buf, 2, &mut bytes).unwrap();
    let mut other = f32_buf(b, &[0.0; 10]);
    b.write_bytes(&bytes, &mut other, 6).unwrap();
    assert_eq!(&download(b, &other, 10)[6..], &v[2..6]);
    assert!(b.read_bytes(&buf, 8, &mut bytes).is_err(), "past the end");
    assert!(
        b.write_bytes(&bytes[..5], &mut other, 0).is_err(),
        "part of an element"
    );
}

/// Synthetic experts of block formats (`e` experts, hidden `h`, intermediate `i`): gate and up
/// in `up_format`, down in `down_format`, from seeds `seed`, `seed + 1`, `seed + 2`; with the
/// weight buffers the matrices view.
fn block_experts(
    b: &dyn Backend,
    (up_format, down_format): (corral_backend::QuantFormat, corral_backend::QuantFormat),
    (e, h, i): (usize, usize, usize),
    seed: u64,
) -> (
    corral_backend::ExpertWeights,
    [std::sync::Arc<corral_backend::DeviceBuffer>; 3],
) {
    use corral_backend::{ExpertMatrices, ExpertWeights};
    use std::sync::Arc;
    let blocks =
        |format, len, seed| Arc::new(b.weight_synthetic_blocks(format, len, seed, 0.05).unwrap());
    let (gate, up, down) = (
        blocks(up_format, e * i * h, seed),
        blocks(up_format, e * i * h, seed + 1),
        blocks(down_format, e * h * i, seed + 2),
    );
    let experts = ExpertWeights {
        gate: ExpertMatrices::stacked(Arc::clone(&gate), e, i, 0, i, h).unwrap(),
        up: ExpertMatrices::stacked(Arc::clone(&up), e, i, 0, i, h).unwrap(),
        down: ExpertMatrices::stacked(Arc::clone(&down), e, h, 0, h, i).unwrap(),
    };
    (experts, [gate, up, down])
}

/// The routing of `ids`: their buffer, and positive weights from `seed` with theirs.
fn routing_buffers(
    b: &dyn Backend,
    ids: &[u32],
    seed: u64,
) -> (
    corral_backend::DeviceBuffer,
    corral_backend::DeviceBuffer,
    Vec<f32>,
) {
    let weights: Vec<f32> = Rng(seed)
        .values(ids.len())
        .iter()
        .map(|v| v.abs())
        .collect();
    (u32_buf(b, ids), f32_buf(b, &weights), weights)
}

/// The per-token experts over block-format weights, which quantize each token's row and each
/// pair's act row once for every expert reading it, equal bit for bit each (token, expert)
/// pair's products by `matmul`, `silu_mul` and a weighted sum, which quantize their rows
/// themselves.
#[test]
fn block_format_experts_per_token_equal_their_pairs_one_at_a_time() {
    use corral_backend::{MoeRouting, QuantFormat};
    let b: &dyn Backend = &CpuBackend::new();
    let (e, h, i, tokens, top_k) = (6, 256, 512, 3, 4);
    let formats = [
        (QuantFormat::Q4K, QuantFormat::Q6K),
        (QuantFormat::Q8_0, QuantFormat::Q5K),
        (QuantFormat::Q4_0, QuantFormat::Q8_0),
    ];
    for (case, (up_format, down_format)) in formats.into_iter().enumerate() {
        let seed = 10 * case as u64;
        let (experts, [gate, up, down]) =
            block_experts(b, (up_format, down_format), (e, h, i), seed);
        let x = Rng(seed + 3).values(tokens * h);
        let ids: Vec<u32> = (0..tokens * top_k)
            .map(|p| ((p * 5 + case) % e) as u32)
            .collect();
        let (ids_buf, weights_buf, weights) = routing_buffers(b, &ids, seed + 4);
        let routing = MoeRouting {
            expert_ids: &ids_buf,
            expert_weights: &weights_buf,
            tokens,
            top_k,
        };
        let mut act = f32_buf(b, &vec![0.0; tokens * top_k * i]);
        let mut out = f32_buf(b, &vec![0.0; tokens * h]);
        b.moe_experts_per_token(&f32_buf(b, &x), routing, &experts, &mut act, &mut out)
            .unwrap();
        let got = download(b, &out, tokens * h);
        let mut want = vec![0.0f32; tokens * h];
        let product =
            |v: &[f32], w: &std::sync::Arc<corral_backend::DeviceBuffer>, at: usize, rows, cols| {
                let mut o = f32_buf(b, &vec![0.0; rows]);
                let view = WeightView::stacked(w, at, rows, cols).unwrap();
                b.matmul(&f32_buf(b, v), 1, view, &mut o).unwrap();
                download(b, &o, rows)
            };
        for t in 0..tokens {
            for j in 0..top_k {
                let (p, ex) = (t * top_k + j, ids[t * top_k + j] as usize);
                let xt = &x[t * h..(t + 1) * h];
                let (g, u) = (product(xt, &gate, ex, i, h), product(xt, &up, ex, i, h));
                let mut a = f32_buf(b, &vec![0.0; i]);
                b.silu_mul(&f32_buf(b, &g), &f32_buf(b, &u), i, &mut a)
                    .unwrap();
                let y = product(&download(b, &a, i), &down, ex, h, i);
                for (o, y) in want[t * h..(t + 1) * h].iter_mut().zip(&y) {
                    *o += weights[p] * y;
                }
            }
        }
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{} / {}: {differ} of {} outputs differ (first {:?} against {:?})",
            up_format.name(),
            down_format.name(),
            tokens * h,
            &got[..4],
            &want[..4]
        );
    }
}

/// The grouped experts over K-quant weights, whose experts with many rows multiply them as
/// integer panels (and the rest as few-row products), give what the per-token experts give
/// (few-row products only), up to float summation order and the act rows' quantization that
/// it can move by a step.
#[test]
fn grouped_k_quant_experts_equal_the_per_token_experts() {
    use corral_backend::{MoeRouting, MoeSorted, QuantFormat};
    let b: &dyn Backend = &CpuBackend::new();
    // Expert 0 takes every token's first choice (40 rows: panels of 16, 16 and 8), the others
    // a few each.
    let (e, h, i, tokens, top_k) = (5, 512, 256, 40, 2);
    for (case, formats) in [
        (QuantFormat::Q4K, QuantFormat::Q6K),
        (QuantFormat::Q6K, QuantFormat::Q4K),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 20 + 10 * case as u64;
        let (experts, _) = block_experts(b, formats, (e, h, i), seed);
        let x = f32_buf(b, &Rng(seed + 3).values(tokens * h));
        let ids: Vec<u32> = (0..tokens * top_k)
            .map(|p| {
                if p % 2 == 0 {
                    0
                } else {
                    1 + (p / 2 % (e - 1)) as u32
                }
            })
            .collect();
        let (ids_buf, weights_buf, _) = routing_buffers(b, &ids, seed + 4);
        let routing = MoeRouting {
            expert_ids: &ids_buf,
            expert_weights: &weights_buf,
            tokens,
            top_k,
        };
        let pairs = tokens * top_k;
        let mut act = f32_buf(b, &vec![0.0; pairs * i]);
        let mut per_token = f32_buf(b, &vec![0.0; tokens * h]);
        b.moe_experts_per_token(&x, routing, &experts, &mut act, &mut per_token)
            .unwrap();
        let meta = |n: usize| u32_buf(b, &vec![0; n]);
        let (mut offsets, mut hit, mut sorted_pairs, mut positions) =
            (meta(e + 1), meta(e + 1), meta(pairs), meta(pairs));
        b.moe_sort(
            routing,
            e,
            &mut offsets,
            &mut hit,
            &mut sorted_pairs,
            &mut positions,
        )
        .unwrap();
        let sorted = MoeSorted {
            expert_offsets: &offsets,
            hit_experts: &hit,
            sorted_pairs: &sorted_pairs,
            pair_positions: &positions,
        };
        let mut y = f32_buf(b, &vec![0.0; pairs * h]);
        let mut grouped = f32_buf(b, &vec![0.0; tokens * h]);
        b.moe_grouped_gate_up(&x, routing, sorted, &experts, &mut act)
            .unwrap();
        b.moe_grouped_down(&act, routing, sorted, &experts, &mut y)
            .unwrap();
        b.moe_combine(&y, routing, sorted, h, &mut grouped).unwrap();
        let (got, want) = (
            download(b, &grouped, tokens * h),
            download(b, &per_token, tokens * h),
        );
        let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|a| a * a).sum::<f32>().sqrt();
        let err =
            norm(&mut got.iter().zip(&want).map(|(a, b)| a - b)) / norm(&mut want.iter().copied());
        eprintln!(
            "{} / {}: relative error {err:.2e}",
            formats.0.name(),
            formats.1.name()
        );
        assert!(
            err < 1e-5,
            "{} / {}: grouped against per-token relative error {err:.2e}",
            formats.0.name(),
            formats.1.name()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Runs keeping their recurrent states: the state kept after token i of a run equals the
    /// final state of the run cut after token i, and the outputs and final states equal those
    /// of the same runs keeping nothing.
    #[test]
    fn kept_states_equal_the_states_of_each_prefix(
        lens in proptest::collection::vec(1usize..6, 1..4),
        (nk, group, dk, dv) in (1usize..3, 1usize..3, 1usize..9, 1usize..9),
        kernel in 2usize..5,
        seed in any::<u64>(),
    ) {
        let b: &dyn Backend = &CpuBackend::new();
        let nv = nk * group;
        let shape = corral_backend::DeltaNetShape {
            num_key_heads: nk, num_value_heads: nv, key_dim: dk, value_dim: dv,
        };
        let channels = 2 * nk * dk + nv * dv;
        let tokens: usize = lens.iter().sum();
        let num_runs = lens.len();
        // Run r in slot r from a state of its own; its kept states after the running slots.
        let mut runs = Vec::new();
        let mut kept = Vec::new();
        let (mut start, mut next_kept) = (0, num_runs);
        for (r, &len) in lens.iter().enumerate() {
            runs.push([start as u32, len as u32, r as u32, 0]);
            kept.push(if len > 1 { next_kept as u32 } else { corral_backend::NO_KEPT_STATES });
            next_kept += len - 1;
            start += len;
        }
        let slots = next_kept;
        let hist = kernel - 1;
        let x = Rng(seed).values(tokens * channels);
        let w = Rng(seed ^ 1).values(channels * kernel);
        let qkv = Rng(seed ^ 2).values(tokens * channels);
        let gate: Vec<f32> = Rng(seed ^ 3).values(tokens * nv).iter().map(|v| -v.abs()).collect();
        let beta: Vec<f32> = Rng(seed ^ 4).values(tokens * nv).iter().map(|v| v.abs()).collect();
        let mut conv0 = Rng(seed ^ 5).values(slots * channels * hist);
        let mut state0 = Rng(seed ^ 6).values(slots * nv * dk * dv);
        conv0[num_runs * channels * hist..].fill(0.0);
        state0[num_runs * nv * dk * dv..].fill(0.0);
        let inputs = ((&x[..], &w[..], kernel), (&qkv[..], &gate[..], &beta[..]));
        let keeping =
            common::recurrence(b, inputs.0, inputs.1, shape, &runs, Some(&kept), (&conv0, &state0));
        let plain = common::recurrence(b, inputs.0, inputs.1, shape, &runs, None, (&conv0, &state0));
        close(&keeping.conv_out, &plain.conv_out, 1e-6)?;
        close(&keeping.out, &plain.out, 1e-4)?;
        let running = |v: &[f32], per: usize| v[..num_runs * per].to_vec();
        close(&running(&keeping.conv_state, channels * hist), &running(&plain.conv_state, channels * hist), 1e-6)?;
        close(&running(&keeping.state, nv * dk * dv), &running(&plain.state, nv * dk * dv), 1e-4)?;
        for (r, run) in runs.iter().enumerate() {
            for i in 0..run[1] as usize - 1 {
                let cut = [[run[0], i as u32 + 1, run[2], 0]];
                let prefix = common::recurrence(b, inputs.0, inputs.1, shape, &cut, None, (&conv0, &state0));
                let k = kept[r] as usize + i;
                let (c, s) = (channels * hist, nv * dk * dv);
                close(&keeping.conv_state[k * c..(k + 1) * c], &prefix.conv_state[r * c..(r + 1) * c], 1e-6)?;
                close(&keeping.state[k * s..(k + 1) * s], &prefix.state[r * s..(r + 1) * s], 1e-4)?;
            }
        }
    }
}

#[test]
fn kept_states_past_the_pool_or_on_a_running_slot_are_refused() {
    let b: &dyn Backend = &CpuBackend::new();
    let shape = corral_backend::DeltaNetShape {
        num_key_heads: 1,
        num_value_heads: 1,
        key_dim: 2,
        value_dim: 2,
    };
    let runs = u32_buf(b, &[0, 3, 0, 0]);
    for kept in [[3u32], [0], [u32::MAX - 1]] {
        let kept = u32_buf(b, &kept);
        let rr = corral_backend::RecurrentRuns {
            runs: &runs,
            num_runs: 1,
            max_run_tokens: 3,
            kept: Some(&kept),
        };
        let mut state = f32_buf(b, &[0.0; 4 * 4]);
        let mut out = f32_buf(b, &[0.0; 6]);
        let err = b
            .gated_delta_rule(
                &f32_buf(b, &[0.5; 18]),
                &f32_buf(b, &[-0.1; 3]),
                &f32_buf(b, &[0.5; 3]),
                shape,
                rr,
                &mut state,
                &mut out,
            )
            .expect_err("kept slots out of place");
        assert!(err.to_string().contains("keeps states"), "{err}");
    }
}
