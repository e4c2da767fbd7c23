//! The routed experts: the router and the sort by expert, the grouped gate/up, down and
//! combine, and the per-token experts, against the references, over both ways experts are
//! stored, a shared expert folded in, and the shapes where a GPU's kernels change.

use std::sync::Arc;

use corral_backend::{
    Backend, BufferUsage, DType, DeviceBuffer, ExpertMatrices, ExpertWeights, MoeRouting,
    MoeSorted, reference,
};
use proptest::prelude::*;

use crate::{
    Rng, Subject, assert_refused, assert_within, download, f32_buf, out_buf, stored, subjects,
    u32_buf,
};

/// One layer's routing and experts.
#[derive(Clone, Copy, Debug)]
struct Layer {
    tokens: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    inter: usize,
    dtype: DType,
    /// Experts stored as fused tensors (`gate_up` `[E, 2I, H]`), else one buffer each.
    fused: bool,
    /// A shared expert folded in as expert `experts`, gated by one more logit a token.
    shared: bool,
    renormalize: bool,
    /// Logits of a few levels, so that ties (to the lower id) are common.
    ties: bool,
}

/// The layer's experts on `b`, from the three projections' values (and the shared expert's).
fn expert_weights(
    b: &dyn Backend,
    layer: &Layer,
    values: &[Vec<f32>; 3],
    extra: &[Vec<f32>; 3],
) -> ExpertWeights {
    let Layer {
        experts: e,
        hidden: h,
        inter: i,
        dtype,
        ..
    } = *layer;
    let weights = |v: &[f32]| b.weight_from_f32(v, dtype).unwrap();
    let mut w = if layer.fused {
        let mut gate_up = Vec::with_capacity(e * 2 * i * h);
        for x in 0..e {
            gate_up.extend_from_slice(&values[0][x * i * h..(x + 1) * i * h]);
            gate_up.extend_from_slice(&values[1][x * i * h..(x + 1) * i * h]);
        }
        let gate_up = Arc::new(weights(&gate_up));
        let down = Arc::new(weights(&values[2]));
        ExpertWeights {
            gate: ExpertMatrices::stacked(Arc::clone(&gate_up), e, 2 * i, 0, i, h).unwrap(),
            up: ExpertMatrices::stacked(gate_up, e, 2 * i, i, i, h).unwrap(),
            down: ExpertMatrices::stacked(down, e, h, 0, h, i).unwrap(),
        }
    } else {
        let per = |v: &[f32], rows: usize, cols: usize| {
            let each = v.chunks(rows * cols).map(weights).collect();
            ExpertMatrices::per_expert(each, rows, cols).unwrap()
        };
        ExpertWeights {
            gate: per(&values[0], i, h),
            up: per(&values[1], i, h),
            down: per(&values[2], h, i),
        }
    };
    if layer.shared {
        let add = |m: ExpertMatrices, v: &[f32]| m.with_extra(weights(v)).unwrap();
        w = ExpertWeights {
            gate: add(w.gate, &extra[0]),
            up: add(w.up, &extra[1]),
            down: add(w.down, &extra[2]),
        };
    }
    w
}

/// A routing made on a backend and its sort: what the expert ops read.
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
    fn new(b: &dyn Backend, layer: &Layer, logits: &[f32]) -> Self {
        let shared = usize::from(layer.shared);
        let (choices, sorted_experts) = (layer.top_k + shared, layer.experts + shared);
        let pairs = layer.tokens * choices;
        let meta = |n| b.take_buffer(DType::U32, n, BufferUsage::Metadata).unwrap();
        let (mut ids, mut weights) = (meta(pairs), out_buf(b, pairs));
        b.moe_route(
            &f32_buf(b, logits),
            layer.tokens,
            layer.experts,
            layer.top_k,
            layer.renormalize,
            layer.shared,
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
            tokens: layer.tokens,
            choices,
        };
        let routing = MoeRouting {
            expert_ids: &r.ids,
            expert_weights: &r.weights,
            tokens: r.tokens,
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

fn words(b: &dyn Backend, buf: &DeviceBuffer, n: usize) -> Vec<u32> {
    let mut v = vec![0; n];
    b.download_u32(buf, &mut v).unwrap();
    v
}

/// Routes, sorts and runs `layer`'s experts on every subject, each step against the
/// references; a backend's strategies also against each other.
fn experts_match_the_references(layer: Layer, seed: u64) {
    let Layer {
        tokens,
        experts: e,
        top_k,
        hidden: h,
        inter: i,
        dtype,
        shared,
        ..
    } = layer;
    let mut rng = Rng(seed);
    let row = e + usize::from(shared);
    let x = rng.values(tokens * h);
    let logits: Vec<f32> = rng
        .values(tokens * row)
        .iter()
        .map(|v| if layer.ties { (v * 3.0).floor() } else { *v })
        .collect();
    let values = [
        rng.values(e * i * h),
        rng.values(e * i * h),
        rng.values(e * h * i),
    ];
    let extra = [rng.values(i * h), rng.values(i * h), rng.values(h * i)];
    let all = |k: usize| {
        let mut v = stored(dtype, &values[k]);
        if shared {
            v.extend(stored(dtype, &extra[k]));
        }
        v
    };
    let (gate, up, down) = (all(0), all(1), all(2));
    let (ids, weights) = reference::moe_route(&logits, e, top_k, layer.renormalize, shared);
    let choices = top_k + usize::from(shared);
    let pairs = tokens * choices;
    let sorted = reference::moe_sort(&ids, row);
    let want = reference::moe_experts(&x, &ids, &weights, choices, [&gate, &up, &down], i, h);
    let what = format!("{layer:?}");
    let mut grouped_by_subject = Vec::new();
    for s in subjects() {
        let b = s.backend;
        let w = expert_weights(b, &layer, &values, &extra);
        let r = Routed::new(b, &layer, &logits);
        assert_eq!(
            words(b, &r.ids, pairs),
            ids,
            "{}: {what}: expert ids",
            s.name
        );
        let got = download(b, &r.weights, pairs);
        assert_within(
            &s,
            &format!("{what}: routing weights"),
            &got,
            &weights,
            1e-6,
        );
        assert_eq!(
            words(b, &r.offsets, row + 1),
            sorted.offsets,
            "{}: {what}: offsets",
            s.name
        );
        let hit = words(b, &r.hit, row + 1);
        let count = (hit[0] as usize).min(row);
        assert_eq!(
            &hit[1..=count],
            sorted.hit,
            "{}: {what}: experts hit",
            s.name
        );
        assert_eq!(
            words(b, &r.sorted_pairs, pairs),
            sorted.sorted_pairs,
            "{}: {what}: sorted pairs",
            s.name
        );
        assert_eq!(
            words(b, &r.positions, pairs),
            sorted.positions,
            "{}: {what}: positions",
            s.name
        );

        let (routing, by_expert) = (r.routing(), r.sorted());
        let xb = f32_buf(b, &x);
        let (mut act, mut y) = (out_buf(b, pairs * i), out_buf(b, pairs * h));
        let mut grouped = out_buf(b, tokens * h);
        b.moe_grouped_gate_up(&xb, routing, by_expert, &w, &mut act)
            .unwrap();
        b.moe_grouped_down(&act, routing, by_expert, &w, &mut y)
            .unwrap();
        b.moe_combine(&y, routing, by_expert, h, &mut grouped)
            .unwrap();
        let mut down_combined = out_buf(b, tokens * h);
        b.moe_grouped_down_combine(&act, routing, by_expert, &w, &mut y, &mut down_combined)
            .unwrap();
        let mut per_token = out_buf(b, tokens * h);
        b.moe_experts_per_token(&xb, routing, &w, &mut act, &mut per_token)
            .unwrap();
        // A device that rounds projection inputs to bf16 does so in its expert tiles too, as
        // tiles on cooperative matrices round them to f16.
        let grouped_tol = if b.capabilities().bf16_projection_inputs || s.f16_tiles {
            1.5e-2
        } else {
            s.tol
        };
        let grouped = download(b, &grouped, tokens * h);
        assert_within(
            &s,
            &format!("{what}: grouped"),
            &grouped,
            &want,
            grouped_tol,
        );
        let down_combined = download(b, &down_combined, tokens * h);
        assert_within(
            &s,
            &format!("{what}: down and combine"),
            &down_combined,
            &want,
            grouped_tol,
        );
        let per_token = download(b, &per_token, tokens * h);
        assert_within(&s, &format!("{what}: per token"), &per_token, &want, 1e-5);
        grouped_by_subject.push((s, grouped));
    }
    strategies_agree(&what, &grouped_by_subject);
}

/// A backend's strategies (subjects named `"<backend>, ..."`) give its own results within
/// 1e-5: the same operands summed in another order.
pub(crate) fn strategies_agree(what: &str, results: &[(Subject, Vec<f32>)]) {
    for (variant, got) in results {
        let base = results
            .iter()
            .find(|(s, _)| variant.name.starts_with(&format!("{}, ", s.name)));
        if let Some((base, want)) = base {
            let what = format!("{what}: against {}", base.name);
            assert_within(variant, &what, got, want, 1e-5);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn routed_experts_match_the_references(
        tokens in 1usize..80,
        experts in 1usize..40,
        top_k in 1usize..9,
        hidden in prop_oneof![(1usize..12).prop_map(|h| 8 * h), 1usize..40],
        inter in prop_oneof![(1usize..12).prop_map(|i| 8 * i), 1usize..70],
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)],
        flags in 0u8..16,
        seed in any::<u64>(),
    ) {
        let layer = Layer {
            tokens,
            experts,
            top_k: top_k.min(experts),
            hidden,
            inter,
            dtype,
            fused: flags & 1 != 0,
            shared: flags & 2 != 0,
            renormalize: flags & 4 != 0,
            ties: flags & 8 != 0,
        };
        experts_match_the_references(layer, seed);
    }
}

/// The shapes at which a GPU's expert kernels change: rows per expert on each side of the
/// few-row products and the 128-row tiles (several tiles, the last partial, more than one
/// block of output features, K not a multiple of 64), an odd hidden size (unaligned rows,
/// the combine a feature a thread), more experts than a block ranks in registers (a warp a
/// token), and pairs sorted in several chunks.
#[test]
fn routed_experts_match_the_references_where_kernels_change() {
    let shapes = [
        (200, 128, 8, 64, 48, DType::F32),
        (70, 300, 8, 16, 24, DType::BF16),
        (200, 8, 4, 40, 32, DType::F16),
        (10, 600, 8, 37, 24, DType::BF16),
        (300, 4, 3, 136, 72, DType::BF16),
        (170, 8, 8, 72, 200, DType::BF16),
        (1100, 128, 8, 16, 24, DType::F32),
        (70, 1100, 8, 16, 24, DType::BF16),
    ];
    for (n, (tokens, experts, top_k, hidden, inter, dtype)) in shapes.into_iter().enumerate() {
        let layer = Layer {
            tokens,
            experts,
            top_k,
            hidden,
            inter,
            dtype,
            fused: n % 2 == 0,
            shared: n % 3 == 1,
            renormalize: n % 4 < 2,
            ties: n % 3 == 0,
        };
        experts_match_the_references(layer, n as u64);
    }
}

/// Experts of mismatched projections or counts, short buffers and bad expert counts are
/// refused alike by every backend, and experts of two types or of rows across blocks are
/// not made.
#[test]
fn expert_ops_refuse_bad_shapes() {
    for s in subjects() {
        let b = s.backend;
        let layer = Layer {
            tokens: 2,
            experts: 3,
            top_k: 2,
            hidden: 8,
            inter: 4,
            dtype: DType::F32,
            fused: false,
            shared: false,
            renormalize: true,
            ties: false,
        };
        let mut rng = Rng(3);
        let values = [rng.values(96), rng.values(96), rng.values(96)];
        let w = expert_weights(b, &layer, &values, &values);
        let r = Routed::new(b, &layer, &rng.values(6));
        let (routing, sorted) = (r.routing(), r.sorted());
        let x = f32_buf(b, &rng.values(16));
        let mut act = out_buf(b, 16);
        let mut short = out_buf(b, 15);
        let mut out = out_buf(b, 16);
        let op = "moe_grouped_gate_up";
        assert_refused(
            &s,
            op,
            b.moe_grouped_gate_up(&x, routing, sorted, &w, &mut short),
        );
        let ids = u32_buf(b, &[0; 4]);
        assert_refused(
            &s,
            op,
            b.moe_grouped_gate_up(&ids, routing, sorted, &w, &mut act),
        );
        // Up one row short of gate.
        let narrow = |v: &[f32]| {
            let each = v
                .chunks(32)
                .map(|c| b.weight_from_f32(&c[..24], DType::F32).unwrap());
            ExpertMatrices::per_expert(each.collect(), 3, 8).unwrap()
        };
        let mismatched = ExpertWeights {
            gate: expert_weights(b, &layer, &values, &values).gate,
            up: narrow(&values[1]),
            down: expert_weights(b, &layer, &values, &values).down,
        };
        assert_refused(
            &s,
            op,
            b.moe_grouped_gate_up(&x, routing, sorted, &mismatched, &mut act),
        );
        let op = "moe_experts_per_token";
        assert_refused(
            &s,
            op,
            b.moe_experts_per_token(&x, routing, &mismatched, &mut act, &mut out),
        );
        assert_refused(
            &s,
            op,
            b.moe_experts_per_token(&x, routing, &w, &mut act, &mut short),
        );
        let mut y = out_buf(b, 32);
        let op = "moe_grouped_down";
        assert_refused(
            &s,
            op,
            b.moe_grouped_down(&short, routing, sorted, &w, &mut y),
        );
        assert_refused(
            &s,
            op,
            b.moe_grouped_down(&act, routing, sorted, &w, &mut short),
        );
        let op = "moe_combine";
        assert_refused(&s, op, b.moe_combine(&y, routing, sorted, 8, &mut short));
        assert_refused(&s, op, b.moe_combine(&y, routing, sorted, 9, &mut out));
        let op = "moe_grouped_down_combine";
        let fused = b.moe_grouped_down_combine(&act, routing, sorted, &w, &mut y, &mut short);
        assert_refused(&s, op, fused);
        let op = "moe_sort";
        let meta = |n| b.take_buffer(DType::U32, n, BufferUsage::Metadata).unwrap();
        let (mut offsets, mut hit) = (meta(4), meta(4));
        let (mut pairs, mut positions) = (meta(4), meta(3));
        for experts in [0, 5000] {
            let sort = b.moe_sort(
                routing,
                experts,
                &mut offsets,
                &mut hit,
                &mut pairs,
                &mut positions,
            );
            assert_refused(&s, op, sort);
        }
        let sort = b.moe_sort(
            routing,
            3,
            &mut offsets,
            &mut hit,
            &mut pairs,
            &mut positions,
        );
        assert_refused(&s, op, sort);
        // Experts of one projection stored in two types.
        let mixed = vec![
            b.weight_from_f32(&values[0][..32], DType::F32).unwrap(),
            b.weight_from_f32(&values[0][32..64], DType::BF16).unwrap(),
        ];
        assert!(
            ExpertMatrices::per_expert(mixed, 4, 8).is_err(),
            "{}: experts of two types",
            s.name
        );
        // Rows that are not whole blocks of their format.
        let q8 = corral_backend::QuantFormat::Q8_0;
        if !b.capabilities().reads(q8) {
            continue;
        }
        let blocks = b.weight_synthetic_blocks(q8, 2 * 48, 1, 0.1).unwrap();
        assert!(
            ExpertMatrices::stacked(Arc::new(blocks), 2, 3, 0, 3, 16).is_err(),
            "{}: Q8_0 experts of rows of 16",
            s.name
        );
    }
}

/// Experts stored in block formats, gate/up and down each in its own (as Q4_K_M files store
/// them), read as stored by every backend that reads the formats: the grouped and the
/// per-token experts against the reference over the decoded values. Each backend quantizes
/// activations for its integer products or rounds them to bf16 for its tiles: 1.5e-2; FP8
/// experts a token at a time within 3e-3 (a GPU's tensor cores take x and the activations
/// as f16, scaled per 128 values).
#[test]
fn block_format_experts_match_the_references() {
    use corral_backend::{QuantFormat, quant, synthetic};
    let f8 = QuantFormat::F8E4M3x128;
    let cases = [
        (QuantFormat::Q4K, QuantFormat::Q6K, 1, 8, 2, 256, 512),
        (QuantFormat::Q8_0, QuantFormat::Q8_0, 3, 16, 4, 64, 96),
        (QuantFormat::Q5K, QuantFormat::Q4K, 40, 8, 8, 256, 256),
        (QuantFormat::Q4_0, QuantFormat::Q5_0, 200, 32, 8, 96, 32),
        (f8, f8, 1, 8, 8, 256, 384),
        (f8, f8, 5, 16, 10, 128, 256),
        (f8, f8, 70, 16, 3, 384, 128),
    ];
    let mut rng = Rng(43);
    for (case, (up_format, down_format, tokens, e, top_k, h, i)) in cases.into_iter().enumerate() {
        let blocks = |format, seed, len| {
            let blocks = synthetic::quant_blocks(format, seed, len, 0.5);
            let mut values = vec![0.0; len];
            quant::dequantize(format, &blocks, &mut values);
            (blocks, values)
        };
        let (gu_blocks, gu_values) = blocks(up_format, 70 + case as u64, e * 2 * i * h);
        let (d_blocks, d_values) = blocks(down_format, 80 + case as u64, e * h * i);
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for expert in gu_values.chunks(2 * i * h) {
            gate.extend_from_slice(&expert[..i * h]);
            up.extend_from_slice(&expert[i * h..]);
        }
        let x = rng.values(tokens * h);
        let logits = rng.values(tokens * e);
        let (ids, weights) = reference::moe_route(&logits, e, top_k, true, false);
        let want = reference::moe_experts(&x, &ids, &weights, top_k, [&gate, &up, &d_values], i, h);
        let what = format!(
            "{} gate/up, {} down: {tokens} tokens, top {top_k} of {e}, h {h} i {i}",
            up_format.name(),
            down_format.name()
        );
        let layer = Layer {
            tokens,
            experts: e,
            top_k,
            hidden: h,
            inter: i,
            dtype: DType::Quant(up_format),
            fused: true,
            shared: false,
            renormalize: true,
            ties: false,
        };
        for s in subjects() {
            let b = s.backend;
            if !b.capabilities().reads(up_format) || !b.capabilities().reads(down_format) {
                continue;
            }
            let w = crate::common::block_experts(
                b,
                (up_format, &gu_blocks),
                (down_format, &d_blocks),
                (e, h, i),
            );
            let r = Routed::new(b, &layer, &logits);
            let (routing, sorted) = (r.routing(), r.sorted());
            let pairs = tokens * top_k;
            let xb = f32_buf(b, &x);
            let (mut act, mut y) = (out_buf(b, pairs * i), out_buf(b, pairs * h));
            let mut grouped = out_buf(b, tokens * h);
            b.moe_grouped_gate_up(&xb, routing, sorted, &w, &mut act)
                .unwrap();
            b.moe_grouped_down_combine(&act, routing, sorted, &w, &mut y, &mut grouped)
                .unwrap();
            let mut per_token = out_buf(b, tokens * h);
            b.moe_experts_per_token(&xb, routing, &w, &mut act, &mut per_token)
                .unwrap();
            let grouped = download(b, &grouped, tokens * h);
            assert_within(&s, &format!("{what}: grouped"), &grouped, &want, 1.5e-2);
            let per_token = download(b, &per_token, tokens * h);
            let tol = if up_format == f8 { 3e-3 } else { 1.5e-2 };
            assert_within(&s, &format!("{what}: per token"), &per_token, &want, tol);
        }
    }
}
