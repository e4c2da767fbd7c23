//! CUDA ops against the CPU backend (itself proven against the references) on the shapes
//! where the GPU's kernels change: the comparisons the conformance suite does not make for
//! every backend yet (attention's fused store and paged attention over every cache type,
//! the Gated DeltaNet's chunked form and kept states, block-format products and experts).
//! Without a usable GPU every test prints why it skipped and passes.

use std::sync::Arc;

// The other op tests' helpers come too, not all used here.
#[allow(dead_code)]
mod common;
#[allow(dead_code)]
#[macro_use]
#[path = "common/gpu.rs"]
mod gpu;

use common::{Rng, download, f32_buf, out_buf, u32_buf};
use gpu::*;

use corral_backend::{
    Backend, BufferUsage, DType, DeltaNetShape, DeviceBuffer, ExpertMatrices, ExpertWeights,
    MoeRouting, MoeSorted, QuantFormat, RecurrentRuns, RopeParams, WeightView,
};
use corral_cpu::CpuBackend;

#[test]
fn fused_qkv_norm_rope_store_matches_cpu() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(11);
    for case in 0..12 {
        // Cases 8.. are prefill-sized (several heads a warp), some with more heads than one
        // block takes.
        let (tokens, heads, kv_heads) = if case >= 8 {
            (256 + rng.below(60), 24 + rng.below(17), 1 + rng.below(8))
        } else {
            (1 + rng.below(40), 1 + rng.below(8), 1 + rng.below(3))
        };
        let head_dim = [16, 64, 128, 256][case % 4];
        let rotary_dim = if case % 3 == 0 {
            head_dim / 2
        } else {
            head_dim
        };
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let qkv = rng.values(tokens * (q_dim + 2 * kv_dim));
        let (qw, kw) = (rng.values(head_dim), rng.values(head_dim));
        let positions: Vec<u32> = (0..tokens).map(|_| rng.below(5000) as u32).collect();
        let capacity = 2 * tokens + 3;
        let slots: Vec<u32> = (0..tokens).map(|t| (2 * t + 1) as u32).collect();
        let shape = corral_backend::QkShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
            // Even cases under YaRN: 0 and 6 with a partial rotary dim.
            rope: if case % 2 == 0 {
                yarn(8.0, 512)
            } else {
                RopeParams::plain(1e6)
            },
            eps: 1e-6,
        };
        let mut results = Vec::new();
        for b in [c, g] {
            let (qw_b, kw_b) = (
                b.weight_from_f32(&qw, DType::F32).unwrap(),
                b.weight_from_f32(&kw, DType::F32).unwrap(),
            );
            let mut q_out = out_buf(b, tokens * q_dim);
            let mut cache_k = f32_buf(b, &vec![0.0; capacity * kv_dim]);
            let mut cache_v = f32_buf(b, &vec![0.0; capacity * kv_dim]);
            b.qkv_norm_rope_store(
                &f32_buf(b, &qkv),
                &qw_b,
                &kw_b,
                &u32_buf(b, &positions),
                &u32_buf(b, &slots),
                shape,
                &mut q_out,
                &mut cache_k,
                &mut cache_v,
            )
            .unwrap();
            results.push([
                download(b, &q_out, tokens * q_dim),
                download(b, &cache_k, capacity * kv_dim),
                download(b, &cache_v, capacity * kv_dim),
            ]);
        }
        let what = format!("case {case}: {tokens} tokens, {heads}/{kv_heads} heads of {head_dim}");
        // RoPE angles reach ~5000 rad: see norms_rope_and_elementwise_ops_match_cpu.
        assert_close(&format!("{what}: q"), &results[1][0], &results[0][0], 1e-4);
        assert_close(
            &format!("{what}: k cache"),
            &results[1][1],
            &results[0][1],
            1e-4,
        );
        assert_eq!(results[1][2], results[0][2], "{what}: v cache");
        // Into an fp8 cache: each stored head the CPU's k or v rounded to e4m3 under its
        // scale.
        let row = corral_backend::kv_row_elems(DType::F8E4M3, kv_heads, head_dim);
        let mut q_out = out_buf(g, tokens * q_dim);
        let mut fp8 = [0, 1].map(|_| {
            g.alloc_zeroed(DType::F8E4M3, capacity * row, BufferUsage::KvCache)
                .unwrap()
        });
        let [cache_k, cache_v] = &mut fp8;
        g.qkv_norm_rope_store(
            &f32_buf(g, &qkv),
            &g.weight_from_f32(&qw, DType::F32).unwrap(),
            &g.weight_from_f32(&kw, DType::F32).unwrap(),
            &u32_buf(g, &positions),
            &u32_buf(g, &slots),
            shape,
            &mut q_out,
            cache_k,
            cache_v,
        )
        .unwrap();
        for (which, cache, cpu) in [
            ("k", &fp8[0], &results[0][1]),
            ("v", &fp8[1], &results[0][2]),
        ] {
            let mut bytes = vec![0u8; capacity * row];
            g.read_bytes(cache, 0, &mut bytes).unwrap();
            let (mut stored, mut expected) = (Vec::new(), Vec::new());
            for &slot in &slots {
                let r = &bytes[slot as usize * row..(slot as usize + 1) * row];
                for h in 0..kv_heads {
                    let at = kv_dim + 4 * h;
                    let scale = f32::from_le_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]]);
                    let values = &r[h * head_dim..(h + 1) * head_dim];
                    stored.extend(values.iter().map(|&b| e4m3_value(b) * scale));
                }
                let from = slot as usize * kv_dim;
                expected.extend(fp8_rounded(&cpu[from..from + kv_dim], head_dim));
            }
            assert_close(
                &format!("{what}: fp8 {which} cache"),
                &stored,
                &expected,
                1e-2,
            );
        }
    }
}

/// Runs of a ragged batch `[runs, 4]` (start, length, slot, fresh) over `lens`, in slots
/// counting down from `slots - 1`, every other one starting fresh.
fn recurrent_runs(lens: &[usize], slots: usize) -> Vec<u32> {
    let mut start = 0;
    let mut out = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        out.extend([
            start as u32,
            len as u32,
            (slots - 1 - i) as u32,
            (i % 2) as u32,
        ]);
        start += len;
    }
    out
}

/// The delta rule's gates `g` in `[-decay, 0]` and `beta` in `[0, 1]` for `n` (token, head)
/// pairs, and a small incoming state of `state_len` floats.
fn delta_inputs(
    rng: &mut Rng,
    n: usize,
    state_len: usize,
    decay: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let gate = rng.values(n).iter().map(|v| -decay * v.abs()).collect();
    let beta = rng.values(n).iter().map(|v| 0.5 + 0.5 * v).collect();
    let state = rng.values(state_len).iter().map(|v| 0.1 * v).collect();
    (gate, beta, state)
}

#[test]
fn delta_net_ops_match_cpu() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(13);
    for case in 0..13 {
        // Cases 10 and on: head dims that are not multiples of 16 (the first the qwen3_next
        // fixture's), with a run long enough for the chunked form.
        let lens: Vec<usize> = if case >= 10 {
            vec![70 + rng.below(60), 1 + rng.below(90)]
        } else {
            (0..1 + rng.below(3))
                .map(|_| if case % 2 == 0 { 1 } else { 1 + rng.below(90) })
                .collect()
        };
        let tokens: usize = lens.iter().sum();
        let slots = lens.len() + 2;
        let runs = recurrent_runs(&lens, slots);
        // Conv: channels, kernel 2..=4, states continuing from random history.
        let (channels, kernel) = (1 + rng.below(300), 2 + rng.below(3));
        let x = rng.values(tokens * channels);
        let w = rng.values(channels * kernel);
        let conv0 = rng.values(slots * channels * (kernel - 1));
        // Gates.
        let heads = 1 + rng.below(6);
        let (a, b) = (rng.values(tokens * heads), rng.values(tokens * heads));
        let (a_log, dt_bias) = (rng.values(heads), rng.values(heads));
        // Delta rule: value heads a multiple of key heads.
        let nk = 1 + rng.below(2);
        let nv = nk * (1 + rng.below(3));
        // Value dims past 128 take the delta-rule kernel for blocks of more than 256 threads.
        let (dk, dv) = match case {
            9 => (16, 256),
            10 => (16, 24),
            11 => (24, 40),
            12 => (72, 200),
            _ => ([16, 32, 128][case % 3], [16, 64, 128][(case / 3) % 3]),
        };
        let shape = DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        };
        let qkv = rng.values(tokens * (2 * nk * dk + nv * dv));
        let (gate, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.5);
        let mut results = Vec::new();
        for be in [c, g] {
            let rb = u32_buf(be, &runs);
            let rr = RecurrentRuns {
                runs: &rb,
                num_runs: lens.len(),
                max_run_tokens: lens.iter().copied().max().unwrap_or(1),
                kept: None,
            };
            let wb = be.weight_from_f32(&w, DType::F32).unwrap();
            let mut conv_state = f32_buf(be, &conv0);
            let mut conv_out = out_buf(be, tokens * channels);
            be.causal_conv1d(
                &f32_buf(be, &x),
                &wb,
                channels,
                kernel,
                rr,
                &mut conv_state,
                &mut conv_out,
            )
            .unwrap();
            let (mut gb, mut betab) = (out_buf(be, tokens * heads), out_buf(be, tokens * heads));
            let (alb, dtb) = (
                be.weight_from_f32(&a_log, DType::F32).unwrap(),
                be.weight_from_f32(&dt_bias, DType::F32).unwrap(),
            );
            be.delta_net_gates(
                &f32_buf(be, &a),
                &f32_buf(be, &b),
                &alb,
                &dtb,
                tokens,
                heads,
                &mut gb,
                &mut betab,
            )
            .unwrap();
            let mut state = f32_buf(be, &state0);
            let mut out = out_buf(be, tokens * nv * dv);
            be.gated_delta_rule(
                &f32_buf(be, &qkv),
                &f32_buf(be, &gate),
                &f32_buf(be, &beta),
                shape,
                rr,
                &mut state,
                &mut out,
            )
            .unwrap();
            results.push([
                download(be, &conv_out, tokens * channels),
                download(be, &conv_state, conv0.len()),
                download(be, &gb, tokens * heads),
                download(be, &betab, tokens * heads),
                download(be, &out, tokens * nv * dv),
                download(be, &state, state0.len()),
            ]);
        }
        let what = format!(
            "case {case}: runs {lens:?}, conv {channels}x{kernel}, {nv}/{nk} heads of {dv}/{dk}"
        );
        let names = ["conv out", "conv state", "g", "beta"];
        for (i, name) in names.iter().enumerate() {
            assert_close(
                &format!("{what}: {name}"),
                &results[1][i],
                &results[0][i],
                1e-5,
            );
        }
        // Both run prefill runs in the chunked form (the GPU from 16 tokens, on tensor cores:
        // CHUNKED_TOLERANCE and CHUNKED_STATE_TOLERANCE).
        let chunked = lens.iter().any(|&l| l >= 16);
        let tol = if chunked { CHUNKED_TOLERANCE } else { 1e-3 };
        let state_tol = if chunked {
            CHUNKED_STATE_TOLERANCE
        } else {
            1e-3
        };
        eprintln!(
            "{what}: delta out {:.2e}, state {:.2e}",
            rel(&results[1][4], &results[0][4]),
            rel(&results[1][5], &results[0][5])
        );
        assert_close(
            &format!("{what}: delta out"),
            &results[1][4],
            &results[0][4],
            tol,
        );
        assert_close(
            &format!("{what}: delta state"),
            &results[1][5],
            &results[0][5],
            state_tol,
        );
    }
}

/// Relative errors allowed the chunked delta rule against f32 arithmetic, its outputs and
/// its states: q̂ and k̂ are f16 operands in Q Kᵀ and K Kᵀ, and bf16 where they meet the
/// state and V' (as W does); T, V, M, V' and the state are split bf16 pairs (about 16
/// significant bits). Measured on an H100 and an H200: outputs 2.8e-4 to 5.9e-4, states
/// 1.75e-3 to 1.78e-3 (the state update's bf16 k̂), at every run length up to 3,300 tokens;
/// with every operand bf16 (the kernels before) 3.9e-3 to 4.7e-3 and 3.1e-3 to 3.2e-3.
const CHUNKED_TOLERANCE: f64 = 1.5e-3;
const CHUNKED_STATE_TOLERANCE: f64 = 2.5e-3;

/// The chunked delta rule (one launch for runs of any length) equals the recurrence fed one
/// token at a time, at the Qwen3.5 shape, with live incoming states, across chunk boundaries
/// and across the launch pairs a long run needs (the op scratch holds 46 chunks of 32 heads),
/// and equals the CPU.
#[test]
fn chunked_delta_rule_equals_the_token_by_token_recurrence() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(29);
    let (nk, nv, dk, dv) = (16, 32, 128, 128);
    let shape = DeltaNetShape {
        num_key_heads: nk,
        num_value_heads: nv,
        key_dim: dk,
        value_dim: dv,
    };
    let width = 2 * nk * dk + nv * dv;
    for lens in [vec![130, 1, 64, 7, 65, 200], vec![3300, 20]] {
        let tokens: usize = lens.iter().sum();
        let slots = lens.len() + 1;
        let runs = recurrent_runs(&lens, slots);
        let qkv = rng.values(tokens * width);
        let (gate, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.3);
        let longest = lens.iter().copied().max().unwrap_or(1);
        let whole = |be: &dyn Backend| {
            let rb = u32_buf(be, &runs);
            let rr = RecurrentRuns {
                runs: &rb,
                num_runs: lens.len(),
                max_run_tokens: longest,
                kept: None,
            };
            let mut state = f32_buf(be, &state0);
            let mut out = out_buf(be, tokens * nv * dv);
            be.gated_delta_rule(
                &f32_buf(be, &qkv),
                &f32_buf(be, &gate),
                &f32_buf(be, &beta),
                shape,
                rr,
                &mut state,
                &mut out,
            )
            .unwrap();
            (
                download(be, &out, tokens * nv * dv),
                download(be, &state, state0.len()),
            )
        };
        let (chunked_out, chunked_state) = whole(g);
        let (cpu_out, cpu_state) = whole(c);
        // Step s: token s of every run that long, each a one-token run in its own slot.
        let (qkv_b, gate_b, beta_b) = (f32_buf(g, &qkv), f32_buf(g, &gate), f32_buf(g, &beta));
        let mut state = f32_buf(g, &state0);
        let mut out = out_buf(g, tokens * nv * dv);
        for step in 0..longest {
            let step_runs: Vec<u32> = runs
                .chunks_exact(4)
                .filter(|r| (r[1] as usize) > step)
                .flat_map(|r| {
                    [
                        r[0] + step as u32,
                        1,
                        r[2],
                        u32::from(step == 0 && r[3] != 0),
                    ]
                })
                .collect();
            let rb = u32_buf(g, &step_runs);
            let rr = RecurrentRuns {
                runs: &rb,
                num_runs: step_runs.len() / 4,
                max_run_tokens: 1,
                kept: None,
            };
            g.gated_delta_rule(&qkv_b, &gate_b, &beta_b, shape, rr, &mut state, &mut out)
                .unwrap();
        }
        let stepped_out = download(g, &out, tokens * nv * dv);
        let stepped_state = download(g, &state, state0.len());
        // Each run on its own, so that a short run's error cannot hide in a long one's norm.
        let per_token = nv * dv;
        let per_slot = nv * dk * dv;
        for r in runs.chunks_exact(4) {
            let (start, len, slot) = (r[0] as usize, r[1] as usize, r[2] as usize);
            let what = format!("runs {lens:?}: the run of {len} in slot {slot}");
            let out = start * per_token..(start + len) * per_token;
            let st = slot * per_slot..(slot + 1) * per_slot;
            for (name, a, b) in [
                (
                    "out, chunked against stepped",
                    &chunked_out[out.clone()],
                    &stepped_out[out.clone()],
                ),
                (
                    "state, chunked against stepped",
                    &chunked_state[st.clone()],
                    &stepped_state[st.clone()],
                ),
                (
                    "out, against the CPU",
                    &chunked_out[out.clone()],
                    &cpu_out[out],
                ),
                (
                    "state, against the CPU",
                    &chunked_state[st.clone()],
                    &cpu_state[st],
                ),
            ] {
                eprintln!("{what}: {name}: relative error {:.2e}", rel(a, b));
                let tol = if name.starts_with("state") {
                    CHUNKED_STATE_TOLERANCE
                } else {
                    CHUNKED_TOLERANCE
                };
                assert_close(&format!("{what}: {name}"), a, b, tol);
            }
        }
    }
}

#[test]
fn paged_attention_matches_cpu_over_several_runs_and_block_tables() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(4);
    for case in 0..25 {
        // Groups of up to 8 heads run on tensor cores at head dims 64, 128 and 256 over the
        // bf16 cache; 12 takes the CUDA-core kernel.
        let (nkv, group) = (1 + rng.below(3), [1, 2, 4, 8, 12][rng.below(5)]);
        // Cases 10..16 are prefill chunks of 64+ tokens at head dims 64, 128 and 256 (the
        // tensor-core kernel), next to a decode row, so that some 64-token tiles mix runs;
        // the even ones also open with a decode row of a long history, which the batch's
        // leading decode rows give the decode kernel.
        // Cases 16..22 are batches of decode rows (every run one token) on tensor cores, where
        // a token's earlier keys are read before the kernel storing its own has ended.
        // Cases 22.. are prefill chunks after long histories: too few tiles to fill the GPU,
        // so their keys split over blocks, and the short run beside them has splits with no
        // key at all.
        let prefill = (10..16).contains(&case) || case >= 22;
        let decode_rows = (16..22).contains(&case);
        let group = if decode_rows { group.min(8) } else { group };
        let nh = nkv * group;
        let hd = if prefill || decode_rows {
            [64, 128, 256][case % 3]
        } else {
            [8, 16, 24, 32, 64, 128, 256][case % 7]
        };
        let block_size = [4, 16][case % 2];
        let kv_dim = nkv * hd;
        // Runs of different lengths, each continuing a history of `past` cached tokens.
        // The last cases have long histories, so that attention splits over the keys.
        let long = (7..10).contains(&case) || case >= 19;
        let mut runs: Vec<(usize, usize)> = (0..1 + rng.below(if decode_rows { 5 } else { 3 }))
            .map(|_| {
                let past = if prefill && long {
                    1000 + rng.below(3000)
                } else if long {
                    600 + rng.below(1400)
                } else {
                    rng.below(70)
                };
                let new = if prefill {
                    64 + rng.below(150)
                } else if decode_rows {
                    1
                } else {
                    1 + rng.below(40)
                };
                (past, new)
            })
            .collect();
        if prefill {
            runs.insert(rng.below(runs.len() + 1), (rng.below(100), 1));
            if case % 2 == 0 {
                runs.insert(0, (600 + rng.below(1400), 1));
            }
        }
        let width = runs
            .iter()
            .map(|(p, n)| (p + n).div_ceil(block_size))
            .max()
            .unwrap();
        let num_blocks = runs.len() * width + 3;
        // Blocks handed out in a shuffled order so that tables are not the identity.
        let mut order: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut tables = vec![0u32; runs.len() * width];
        for (r, t) in tables.chunks_mut(width).enumerate() {
            t.copy_from_slice(&order[r * width..(r + 1) * width]);
        }
        let (mut positions, mut token_runs, mut slots) = (vec![], vec![], vec![]);
        let mut past_slots = vec![];
        for (r, &(past, n)) in runs.iter().enumerate() {
            for p in 0..past + n {
                let slot = tables[r * width + p / block_size] * block_size as u32
                    + (p % block_size) as u32;
                if p >= past {
                    positions.push(p as u32);
                    token_runs.push(r as u32);
                    slots.push(slot);
                } else {
                    past_slots.push(slot);
                }
            }
        }
        let tokens = positions.len();
        let history = past_slots.len();
        let k_past = rng.values(history * kv_dim);
        let v_past = rng.values(history * kv_dim);
        // For decode rows the store before the attention first writes many dummy rows to a
        // spare slot, so that the batch's own keys land while the attention has begun: a
        // kernel reading them early would see the zeroed cache.
        let dummies = if decode_rows { 8192 } else { 0 };
        let spare = order[runs.len() * width] * block_size as u32;
        let mut store_slots = vec![spare; dummies];
        store_slots.extend_from_slice(&slots);
        let k_new = rng.values((dummies + tokens) * kv_dim);
        let v_new = rng.values((dummies + tokens) * kv_dim);
        let q = rng.values(tokens * nh * hd);
        // The fp8 cache against the CPU over the same K and V rounded to e4m3 as its store
        // rounds them, a scale per (token, head): rows of magnitudes 2^-4 .. 2^4 apart, K's
        // and V's apart, so that a scale read for the wrong key, head or tensor shows.
        let mut spread = |values: &[f32]| -> Vec<f32> {
            values
                .chunks(hd)
                .flat_map(|row| {
                    let f = 2f32.powi(rng.below(9) as i32 - 4);
                    row.iter().map(move |v| v * f).collect::<Vec<_>>()
                })
                .collect()
        };
        let (k_past_s, v_past_s, k_new_s, v_new_s) = (
            spread(&k_past),
            spread(&v_past),
            spread(&k_new),
            spread(&v_new),
        );
        let (k_past_q, v_past_q) = (fp8_rounded(&k_past_s, hd), fp8_rounded(&v_past_s, hd));
        let (k_new_q, v_new_q) = (fp8_rounded(&k_new_s, hd), fp8_rounded(&v_new_s, hd));
        let mut outs = Vec::new();
        let mut out_bf16 = Vec::new();
        for (b, kv_dtype, inputs) in [
            (c, DType::F32, 0),
            (g, DType::BF16, 0),
            (g, DType::F32, 0),
            (c, DType::F32, 2),
            (g, DType::F8E4M3, 1),
        ] {
            let (k_past, v_past, k_new, v_new) = match inputs {
                0 => (&k_past, &v_past, &k_new, &v_new),
                1 => (&k_past_s, &v_past_s, &k_new_s, &v_new_s),
                _ => (&k_past_q, &v_past_q, &k_new_q, &v_new_q),
            };
            let len = num_blocks * block_size * corral_backend::kv_row_elems(kv_dtype, nkv, hd);
            let mut ck = b.alloc_zeroed(kv_dtype, len, BufferUsage::KvCache).unwrap();
            let mut cv = b.alloc_zeroed(kv_dtype, len, BufferUsage::KvCache).unwrap();
            // Earlier steps' keys are stored; this batch's own are stored by the kernel just
            // before the attention, as in a forward step.
            let (kb, vb, sb) = (
                f32_buf(b, k_past),
                f32_buf(b, v_past),
                u32_buf(b, &past_slots),
            );
            if history > 0 {
                b.kv_store(&kb, &vb, &sb, history, nkv, hd, &mut ck, &mut cv)
                    .unwrap();
            }
            let (pb, rb, tb, slb) = (
                u32_buf(b, &positions),
                u32_buf(b, &token_runs),
                u32_buf(b, &tables),
                u32_buf(b, &slots),
            );
            let meta = corral_backend::AttentionMeta {
                positions: &pb,
                token_runs: &rb,
                block_tables: &tb,
                slots: &slb,
                max_blocks_per_run: width,
                block_size,
                tokens,
                max_run_tokens: runs.iter().map(|r| r.1).max().unwrap_or(1),
                leading_decode_tokens: runs.iter().take_while(|r| r.1 == 1).count(),
            };
            let shape = corral_backend::AttentionShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let qb = f32_buf(b, &q);
            let mut out = out_buf(b, tokens * nh * hd);
            let (knb, vnb, ssb) = (
                f32_buf(b, k_new),
                f32_buf(b, v_new),
                u32_buf(b, &store_slots),
            );
            b.kv_store(
                &knb,
                &vnb,
                &ssb,
                dummies + tokens,
                nkv,
                hd,
                &mut ck,
                &mut cv,
            )
            .unwrap();
            b.paged_attention(&qb, &ck, &cv, &meta, shape, &mut out)
                .unwrap();
            outs.push(download(b, &out, tokens * nh * hd));
            if kv_dtype == DType::BF16 {
                // The output in bf16 (for a projection that takes it so): the same values,
                // rounded once, whether the flash kernel writes them or a rounding copy.
                let mut out16 = b
                    .take_buffer(DType::BF16, tokens * nh * hd, BufferUsage::Activations)
                    .unwrap();
                b.paged_attention(&qb, &ck, &cv, &meta, shape, &mut out16)
                    .unwrap();
                let mut bytes = vec![0u8; tokens * nh * hd * 2];
                b.read_bytes(&out16, 0, &mut bytes).unwrap();
                out_bf16 = bytes
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect();
            }
        }
        let what = format!("heads {nh}/{nkv} dim {hd} block {block_size} runs {runs:?}");
        assert_close(&format!("{what} f32 cache"), &outs[2], &outs[0], 1e-5);
        assert_close(&format!("{what} bf16 cache"), &outs[1], &outs[0], 1e-2);
        assert_close(&format!("{what} fp8 cache"), &outs[4], &outs[3], 1e-2);
        let rounded: Vec<u16> = outs[1]
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        assert!(out_bf16 == rounded, "{what}: the bf16 output");
    }
}

/// A routing of `tokens` tokens over `e` experts (top `top_k`, and a shared expert folded in as
/// expert `e` where `shared`) and its sort, made on `b` from `logits`: what the grouped and
/// per-token expert ops read.
struct Routed {
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    offsets: DeviceBuffer,
    hit: DeviceBuffer,
    sorted_pairs: DeviceBuffer,
    positions: DeviceBuffer,
    tokens: usize,
    choices: usize,
}

impl Routed {
    fn new(
        b: &dyn Backend,
        logits: &DeviceBuffer,
        tokens: usize,
        e: usize,
        top_k: usize,
        renormalize: bool,
        shared: bool,
    ) -> Self {
        let (choices, sorted_experts) = (top_k + shared as usize, e + shared as usize);
        let pairs = tokens * choices;
        let meta = |n| b.take_buffer(DType::U32, n, BufferUsage::Metadata).unwrap();
        let (mut ids, mut weights) = (meta(pairs), out_buf(b, pairs));
        b.moe_route(
            logits,
            tokens,
            e,
            top_k,
            renormalize,
            shared,
            &mut ids,
            &mut weights,
        )
        .unwrap();
        let mut r = Routed {
            ids,
            weights,
            offsets: meta(sorted_experts + 1),
            hit: meta(sorted_experts + 1),
            sorted_pairs: meta(pairs),
            positions: meta(pairs),
            tokens,
            choices,
        };
        let routing = MoeRouting {
            expert_ids: &r.ids,
            expert_weights: &r.weights,
            tokens,
            top_k: choices,
        };
        b.moe_sort(
            routing,
            sorted_experts,
            &mut r.offsets,
            &mut r.hit,
            &mut r.sorted_pairs,
            &mut r.positions,
        )
        .unwrap();
        r
    }

    fn routing(&self) -> MoeRouting<'_> {
        MoeRouting {
            expert_ids: &self.ids,
            expert_weights: &self.weights,
            tokens: self.tokens,
            top_k: self.choices,
        }
    }

    fn sorted(&self) -> MoeSorted<'_> {
        MoeSorted {
            expert_offsets: &self.offsets,
            hit_experts: &self.hit,
            sorted_pairs: &self.sorted_pairs,
            pair_positions: &self.positions,
        }
    }
}

#[test]
fn block_format_products_and_embeddings_match_their_decoded_weights() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(41);
    let formats = g.capabilities().weight_formats.clone();
    for (n, format) in formats.into_iter().enumerate() {
        let block = format.block().0;
        for rows in [1, 2, 3, 5, 8, 9, 40] {
            let (out_rows, spans) = (1 + rng.below(70), 1 + rng.below(3));
            // FP8 rows of 40 blocks: the kernel's warps take K's blocks in more than one pass.
            let passes = format == QuantFormat::F8E4M3x128 && (rows == 1 || rows == 8);
            let cols = block * if passes { 40 } else { spans };
            let (blocks, values) = blocks_and_values(format, 50 + n as u64, out_rows * cols);
            let w = g
                .weight_from_blocks(blocks.clone(), DType::Quant(format), out_rows * cols)
                .unwrap();
            let view = WeightView::new(&w, out_rows, cols).unwrap();
            let wc = c.weight_from_f32(&values, DType::F32).unwrap();
            // The CPU decodes FP8 blocks at load, as its loader does.
            let wq = if c.capabilities().reads(format) {
                c.weight_from_blocks(blocks, DType::Quant(format), out_rows * cols)
            } else {
                c.weight_from_f32(&values, DType::F32)
            }
            .unwrap();
            let x = rng.values(rows * cols);
            let mut want = out_buf(c, rows * out_rows);
            c.matmul(
                &f32_buf(c, &x),
                rows,
                WeightView::new(&wc, out_rows, cols).unwrap(),
                &mut want,
            )
            .unwrap();
            let want = download(c, &want, rows * out_rows);
            // The CPU on the blocks a row at a time: activations quantized per 32 values,
            // integer dots (from 8 rows it may decode Q8_0 to f32 instead).
            let q_view = WeightView::new(&wq, out_rows, cols).unwrap();
            let cpu_blocks: Vec<f32> = x
                .chunks(cols)
                .flat_map(|row| {
                    let mut out = out_buf(c, out_rows);
                    c.matmul(&f32_buf(c, row), 1, q_view, &mut out).unwrap();
                    download(c, &out, out_rows)
                })
                .collect();
            let mut got = out_buf(g, rows * out_rows);
            g.matmul(&f32_buf(g, &x), rows, view, &mut got).unwrap();
            let got = download(g, &got, rows * out_rows);
            let what = format!(
                "{} matmul, {rows} rows of {cols} into {out_rows}",
                format.name()
            );
            // Few rows read the blocks with activations quantized as the CPU quantizes them
            // (the same integers; the scales combined in another order); more run bf16 tensor
            // cores on a bf16 copy. Either within rounding of the exact product.
            // FP8 blocks: few rows on tensor cores, x staged as f16 scaled per 128 values
            // (the CPU decodes the blocks, exactly).
            let fp8 = format == QuantFormat::F8E4M3x128;
            if rows <= 8 && !fp8 {
                assert_close(&format!("{what}: against the CPU"), &got, &cpu_blocks, 1e-5);
            }
            // One product of a few hundred terms may cancel to a small value: 5e-2.
            let tol = match (rows <= 8, fp8) {
                (true, true) => 3e-3,
                (true, false) => 5e-2,
                (false, _) => 1.5e-2,
            };
            assert_close(&what, &got, &want, tol);
            // Into columns 3.. of rows of out_rows + 5: the rest stays as it was.
            let wide = out_rows + 5;
            let mut cols_out = out_buf(g, rows * wide);
            g.matmul_columns(&f32_buf(g, &x), rows, view, &mut cols_out, wide, 3)
                .unwrap();
            let placed = download(g, &cols_out, rows * wide);
            for r in 0..rows {
                let row = &placed[r * wide..(r + 1) * wide];
                assert!(
                    row[..3]
                        .iter()
                        .chain(&row[3 + out_rows..])
                        .all(|v| v.is_nan()),
                    "{what}: columns outside"
                );
                assert_close(
                    &format!("{what}: columns"),
                    &row[3..3 + out_rows],
                    &want[r * out_rows..(r + 1) * out_rows],
                    tol,
                );
            }
        }
        // Embedding rows decoded exactly, and an id past the table raises the flag.
        let (vocab, hidden) = (11, 2 * block);
        let (blocks, values) = blocks_and_values(format, 60 + n as u64, vocab * hidden);
        let table = g
            .weight_from_blocks(blocks, DType::Quant(format), vocab * hidden)
            .unwrap();
        let ids = [3u32, 0, 10, 3];
        let mut id_buf = g
            .take_buffer(DType::U32, ids.len(), BufferUsage::Metadata)
            .unwrap();
        g.upload_u32(&ids, &mut id_buf).unwrap();
        let mut out = out_buf(g, ids.len() * hidden);
        g.embedding(
            WeightView::new(&table, vocab, hidden).unwrap(),
            &id_buf,
            ids.len(),
            &mut out,
        )
        .unwrap();
        let got = download(g, &out, ids.len() * hidden);
        for (t, id) in ids.iter().enumerate() {
            let want = &values[*id as usize * hidden..(*id as usize + 1) * hidden];
            assert!(
                got[t * hidden..(t + 1) * hidden]
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} embedding row {id}",
                format.name()
            );
        }
        g.upload_u32(&[3, 11, 0, 1], &mut id_buf).unwrap();
        g.embedding(
            WeightView::new(&table, vocab, hidden).unwrap(),
            &id_buf,
            ids.len(),
            &mut out,
        )
        .unwrap();
        let err = g.download_f32(&out, &mut vec![0.0; hidden]);
        assert!(err.is_err(), "{}: an id past the table", format.name());
    }
}

#[test]
fn block_format_experts_per_token_and_grouped_match_their_decoded_weights() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(43);
    // Gate/up and down in their own formats, as Q4_K_M files store them.
    let cases = [
        (QuantFormat::Q4K, QuantFormat::Q6K, 1, 8, 2, 256, 512),
        (QuantFormat::Q8_0, QuantFormat::Q8_0, 3, 16, 4, 64, 96),
        (QuantFormat::Q5K, QuantFormat::Q4K, 40, 8, 8, 256, 256),
        (QuantFormat::Q4_0, QuantFormat::Q5_0, 200, 32, 8, 96, 32),
        (
            QuantFormat::F8E4M3x128,
            QuantFormat::F8E4M3x128,
            1,
            8,
            8,
            256,
            384,
        ),
        (
            QuantFormat::F8E4M3x128,
            QuantFormat::F8E4M3x128,
            5,
            16,
            10,
            128,
            256,
        ),
        (
            QuantFormat::F8E4M3x128,
            QuantFormat::F8E4M3x128,
            70,
            16,
            3,
            384,
            128,
        ),
    ];
    for (case, (up_format, down_format, tokens, e, top_k, h, i)) in cases.into_iter().enumerate() {
        let gate_up_len = e * 2 * i * h;
        let (gu_blocks, gu_values) = blocks_and_values(up_format, 70 + case as u64, gate_up_len);
        let (d_blocks, d_values) = blocks_and_values(down_format, 80 + case as u64, e * h * i);
        let x = rng.values(tokens * h);
        let logits = rng.values(tokens * e);
        let pairs = tokens * top_k;
        let mut results = Vec::new();
        for (k, b) in [c, c, g].into_iter().enumerate() {
            // The CPU holds the decoded values in f32 (exact products), then the blocks (its
            // integer products); the GPU the blocks.
            // (The CPU decodes FP8 blocks at load, as its loader does.)
            let decoded = k == 0 || !b.capabilities().reads(up_format);
            let (gate_up, down) = if decoded {
                (
                    b.weight_from_f32(&gu_values, DType::F32).unwrap(),
                    b.weight_from_f32(&d_values, DType::F32).unwrap(),
                )
            } else {
                (
                    b.weight_from_blocks(gu_blocks.clone(), DType::Quant(up_format), gate_up_len)
                        .unwrap(),
                    b.weight_from_blocks(d_blocks.clone(), DType::Quant(down_format), e * h * i)
                        .unwrap(),
                )
            };
            let gate_up = Arc::new(gate_up);
            let w = ExpertWeights {
                gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h).unwrap(),
                up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h).unwrap(),
                down: ExpertMatrices::stacked(Arc::new(down), e, h, 0, h, i).unwrap(),
            };
            let (xb, lb) = (f32_buf(b, &x), f32_buf(b, &logits));
            let r = Routed::new(b, &lb, tokens, e, top_k, true, false);
            let (routing, sorted) = (r.routing(), r.sorted());
            let mut act = out_buf(b, pairs * i);
            let mut y = out_buf(b, pairs * h);
            let mut grouped = out_buf(b, tokens * h);
            b.moe_grouped_gate_up(&xb, routing, sorted, &w, &mut act)
                .unwrap();
            b.moe_grouped_down_combine(&act, routing, sorted, &w, &mut y, &mut grouped)
                .unwrap();
            let mut per_token = out_buf(b, tokens * h);
            b.moe_experts_per_token(&xb, routing, &w, &mut act, &mut per_token)
                .unwrap();
            results.push((
                download(b, &grouped, tokens * h),
                download(b, &per_token, tokens * h),
            ));
        }
        let what = format!(
            "{} gate/up, {} down: {tokens} tokens, top {top_k} of {e}, h {h} i {i}",
            up_format.name(),
            down_format.name()
        );
        let (exact, cpu_blocks, gpu) = (&results[0], &results[1], &results[2]);
        // Per-token: the integer products of the CPU's, and near the exact ones; FP8 blocks
        // on tensor cores with x and act staged as f16 scaled per 128 values (the CPU decodes
        // them, exactly).
        // Activations quantized per super-block (Q4_K, Q6_K): the two backends compute the
        // act rows in different float orders, a value on a rounding edge lands on the
        // neighbouring int8 step, and a super-block's step is up to eight times a block's
        // (measured 1.15e-4 for Q5_K gate/up with a Q4_K down at 40 tokens; a GPU that
        // quantized per 32 against these CPU products was off by 1.7e-2).
        let fp8 = up_format == QuantFormat::F8E4M3x128;
        let supers = [up_format, down_format]
            .iter()
            .any(|&f| matches!(f, QuantFormat::Q4K | QuantFormat::Q6K));
        let against_cpu = if fp8 {
            3e-3
        } else if supers {
            3e-4
        } else {
            1e-4
        };
        assert_close(
            &format!("{what}: per-token against the CPU"),
            &gpu.1,
            &cpu_blocks.1,
            against_cpu,
        );
        assert_close(&format!("{what}: per-token"), &gpu.1, &exact.1, 1.5e-2);
        // Grouped: the experts decoded to bf16 and the few-row or tile products' bf16 inputs.
        assert_close(&format!("{what}: grouped"), &gpu.0, &exact.0, 1.5e-2);
    }
}

/// Runs keeping their recurrent states (a verify step's): the convolution's and the delta
/// rule's states after each token but the last, in each run's slots past the running ones,
/// as the CPU keeps them, with outputs and final states as the CPU's; the 35B-A3B's head
/// shape among the cases.
#[test]
fn kept_recurrent_states_match_cpu() {
    let g = gpu_or_skip!();
    let c: &dyn Backend = &CpuBackend::new();
    let mut rng = Rng(29);
    for case in 0..6 {
        let lens: Vec<usize> = (0..1 + rng.below(4)).map(|_| 1 + rng.below(5)).collect();
        let tokens: usize = lens.iter().sum();
        let num_runs = lens.len();
        let runs = recurrent_runs(&lens, num_runs);
        let mut kept = Vec::new();
        let mut next = num_runs;
        for &len in &lens {
            kept.push(if len > 1 {
                next as u32
            } else {
                corral_backend::NO_KEPT_STATES
            });
            next += len.saturating_sub(1);
        }
        let slots = next;
        let (nk, nv, dk, dv) = if case == 0 {
            (16, 32, 128, 128)
        } else {
            let nk = 1 + rng.below(2);
            (
                nk,
                nk * (1 + rng.below(3)),
                [16, 32, 128][case % 3],
                [16, 64, 128][case % 3],
            )
        };
        let channels = 2 * nk * dk + nv * dv;
        let kernel = 4;
        let x = rng.values(tokens * channels);
        let w = rng.values(channels * kernel);
        let conv0 = rng.values(slots * channels * (kernel - 1));
        let qkv = rng.values(tokens * channels);
        let (gate, beta, state0) = delta_inputs(&mut rng, tokens * nv, slots * nv * dk * dv, 0.5);
        let shape = DeltaNetShape {
            num_key_heads: nk,
            num_value_heads: nv,
            key_dim: dk,
            value_dim: dv,
        };
        let runs: Vec<[u32; 4]> = runs
            .chunks_exact(4)
            .map(|r| [r[0], r[1], r[2], r[3]])
            .collect();
        let results: Vec<[Vec<f32>; 4]> = [c, g]
            .into_iter()
            .map(|be| {
                let r = common::recurrence(
                    be,
                    (&x, &w, kernel),
                    (&qkv, &gate, &beta),
                    shape,
                    &runs,
                    Some(&kept),
                    (&conv0, &state0),
                );
                [r.conv_out, r.conv_state, r.out, r.state]
            })
            .collect();
        let what = format!("case {case}: runs {lens:?}, {nv}/{nk} heads of {dv}/{dk}");
        for (i, (name, tol)) in [
            ("conv out", 1e-5),
            ("conv states", 1e-5),
            ("delta out", 1e-3),
            ("delta states", 1e-3),
        ]
        .into_iter()
        .enumerate()
        {
            assert_close(
                &format!("{what}: {name}"),
                &results[1][i],
                &results[0][i],
                tol,
            );
        }
    }
}
