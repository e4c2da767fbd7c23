//! The CPU ops of a step allocate no heap memory once warm: attention over the default bf16
//! cache and over an f32 one (few-row and many-row tiles), the per-token and grouped experts
//! over K-quant weights (few-row products and integer panels), K-quant and Q8_0 matmuls. Every
//! allocation of this test binary is counted, so it holds this one test.

use std::sync::Arc;

use corral_backend::alloc_count::{CountingAllocator, allocations};
use corral_backend::{
    AttentionMeta, AttentionShape, Backend, BufferUsage, DType, DeviceBuffer, ExpertMatrices,
    ExpertWeights, MoeRouting, MoeSorted, QuantFormat, WeightView,
};
use corral_cpu::CpuBackend;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn f32_buf(b: &dyn Backend, v: &[f32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::F32, v.len(), BufferUsage::Activations)
        .unwrap();
    b.upload_f32(v, &mut buf).unwrap();
    buf
}

fn u32_buf(b: &dyn Backend, v: &[u32]) -> DeviceBuffer {
    let mut buf = b
        .take_buffer(DType::U32, v.len(), BufferUsage::Metadata)
        .unwrap();
    b.upload_u32(v, &mut buf).unwrap();
    buf
}

#[test]
fn warm_cpu_ops_allocate_nothing() {
    let b: &dyn Backend = &CpuBackend::with_kv_dtype(DType::BF16).unwrap();
    // Attention: one run of 20 tokens (many-row tiles), and its last token alone (few rows).
    let (nh, nkv, hd, block_size) = (8, 2, 64, 16);
    let tokens = 20;
    let slots: Vec<u32> = (0..tokens as u32).collect();
    let (kb, vb, sb) = (
        f32_buf(b, &values(tokens * nkv * hd, 1)),
        f32_buf(b, &values(tokens * nkv * hd, 2)),
        u32_buf(b, &slots),
    );
    // The keys and values in the default bf16 cache, and the same in an f32 one.
    let cache = |b: &dyn Backend, dtype| {
        let len = 2 * block_size * corral_backend::kv_row_elems(dtype, nkv, hd);
        let mut k = b.alloc_zeroed(dtype, len, BufferUsage::KvCache).unwrap();
        let mut v = b.alloc_zeroed(dtype, len, BufferUsage::KvCache).unwrap();
        b.kv_store(&kb, &vb, &sb, tokens, nkv, hd, &mut k, &mut v)
            .unwrap();
        (k, v)
    };
    let (ck, cv) = cache(b, DType::BF16);
    let b32: &dyn Backend = &CpuBackend::with_kv_dtype(DType::F32).unwrap();
    let (ck32, cv32) = cache(b32, DType::F32);
    let positions = u32_buf(b, &slots);
    let (runs, table) = (u32_buf(b, &[0; 20]), u32_buf(b, &[0, 1]));
    let shape = AttentionShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        scale: 0.125,
    };
    let q = f32_buf(b, &values(tokens * nh * hd, 3));
    let mut attn_out = f32_buf(b, &vec![0.0; tokens * nh * hd]);
    let (last_position, last_slot) = (u32_buf(b, &[19]), u32_buf(b, &[19]));
    let q_last = f32_buf(b, &values(nh * hd, 4));
    let mut last_out = f32_buf(b, &vec![0.0; nh * hd]);

    // Experts: 5 of them, Q4_K gate and up, Q6_K down; 40 tokens with every first choice on
    // expert 0 (integer panels) and the rest spread (few-row products).
    let (e, h, i, moe_tokens, top_k) = (5, 512, 256, 40, 2);
    let blocks =
        |format, len, seed| Arc::new(b.weight_synthetic_blocks(format, len, seed, 0.05).unwrap());
    let (gate, up, down) = (
        blocks(QuantFormat::Q4K, e * i * h, 5),
        blocks(QuantFormat::Q4K, e * i * h, 6),
        blocks(QuantFormat::Q6K, e * h * i, 7),
    );
    let experts = ExpertWeights {
        gate: ExpertMatrices::stacked(Arc::clone(&gate), e, i, 0, i, h).unwrap(),
        up: ExpertMatrices::stacked(Arc::clone(&up), e, i, 0, i, h).unwrap(),
        down: ExpertMatrices::stacked(Arc::clone(&down), e, h, 0, h, i).unwrap(),
    };
    let x = f32_buf(b, &values(moe_tokens * h, 8));
    let ids: Vec<u32> = (0..moe_tokens * top_k)
        .map(|p| {
            if p % 2 == 0 {
                0
            } else {
                1 + (p / 2 % (e - 1)) as u32
            }
        })
        .collect();
    let (ids, weights) = (u32_buf(b, &ids), f32_buf(b, &vec![0.5; moe_tokens * top_k]));
    let routing = MoeRouting {
        expert_ids: &ids,
        expert_weights: &weights,
        tokens: moe_tokens,
        top_k,
    };
    let pairs = moe_tokens * top_k;
    let mut act = f32_buf(b, &vec![0.0; pairs * i]);
    let mut y = f32_buf(b, &vec![0.0; pairs * h]);
    let mut moe_out = f32_buf(b, &vec![0.0; moe_tokens * h]);
    let (mut offsets, mut hit, mut sorted_pairs, mut pair_positions) = (
        u32_buf(b, &[0; 6]),
        u32_buf(b, &[0; 6]),
        u32_buf(b, &vec![0; pairs]),
        u32_buf(b, &vec![0; pairs]),
    );
    b.moe_sort(
        routing,
        e,
        &mut offsets,
        &mut hit,
        &mut sorted_pairs,
        &mut pair_positions,
    )
    .unwrap();
    let sorted = MoeSorted {
        expert_offsets: &offsets,
        hit_experts: &hit,
        sorted_pairs: &sorted_pairs,
        pair_positions: &pair_positions,
    };
    // Quantized matmuls of 40 rows (panels: Q4_K's, and Q8_0's on AVX2 or f32 tiles on
    // AVX-512), of three (Q4_K's products over several rows on AVX2) and of one (few-row
    // products).
    let mut mm_out = f32_buf(b, &vec![0.0; moe_tokens * i]);
    let q8_0 = blocks(QuantFormat::Q8_0, i * h, 9);

    let mut step = |b: &dyn Backend| {
        let meta = AttentionMeta {
            positions: &positions,
            token_runs: &runs,
            block_tables: &table,
            slots: &sb,
            max_blocks_per_run: 2,
            block_size,
            tokens,
            max_run_tokens: tokens,
            leading_decode_tokens: 0,
        };
        b.paged_attention(&q, &ck, &cv, &meta, shape, &mut attn_out)
            .unwrap();
        b32.paged_attention(&q, &ck32, &cv32, &meta, shape, &mut attn_out)
            .unwrap();
        let meta = AttentionMeta {
            positions: &last_position,
            token_runs: &runs,
            block_tables: &table,
            slots: &last_slot,
            tokens: 1,
            max_run_tokens: 1,
            leading_decode_tokens: 1,
            ..meta
        };
        b.paged_attention(&q_last, &ck, &cv, &meta, shape, &mut last_out)
            .unwrap();
        b.moe_experts_per_token(&x, routing, &experts, &mut act, &mut moe_out)
            .unwrap();
        b.moe_grouped_gate_up(&x, routing, sorted, &experts, &mut act)
            .unwrap();
        b.moe_grouped_down(&act, routing, sorted, &experts, &mut y)
            .unwrap();
        b.moe_combine(&y, routing, sorted, h, &mut moe_out).unwrap();
        let expert0 = WeightView::stacked(&gate, 0, i, h).unwrap();
        b.matmul(&x, moe_tokens, expert0, &mut mm_out).unwrap();
        b.matmul(&x, 3, expert0, &mut mm_out).unwrap();
        b.matmul(&x, 1, expert0, &mut mm_out).unwrap();
        let q8_0 = WeightView::stacked(&q8_0, 0, i, h).unwrap();
        b.matmul(&x, moe_tokens, q8_0, &mut mm_out).unwrap();
        b.matmul(&x, 1, q8_0, &mut mm_out).unwrap();
    };
    // Warm: the pool's threads start, and each thread's reused buffers grow. Which thread
    // takes which item varies, so a thread may first meet a kind of item in a later step:
    // the fewest of several steps counts (an allocation in the ops is in every step).
    for _ in 0..3 {
        step(b);
    }
    let allocated = (0..5)
        .map(|_| {
            let before = allocations();
            step(b);
            allocations() - before
        })
        .min()
        .unwrap_or(0);
    assert_eq!(
        allocated, 0,
        "every warm step of CPU ops allocated, the fewest {allocated} times"
    );
}
