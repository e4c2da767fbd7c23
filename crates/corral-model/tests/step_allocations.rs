//! A warm forward pass on the CPU allocates no heap memory: decode steps of several rows and
//! prefill chunks, sampled where they are, of a Qwen3-MoE model in Q4_K_M and in bf16, of a
//! hybrid, and of a synthetic Qwen3.5-MoE in Q4_K_M, over the default bf16 KV cache. (An f32 cache's prefill attention runs the GEMM
//! crate, which allocates its packing room each call.) Every allocation of this test binary
//! is counted, so it holds this one test.

use std::path::Path;
use std::sync::Arc;

use corral_backend::DType;
use corral_backend::alloc_count::{CountingAllocator, allocations};
use corral_backend::sampling::{Filter, Penalty};
use corral_cpu::CpuBackend;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, ModelConfig, PagedKvCache, RaggedBatch,
    RecurrentStateCache, SampledStep, SeqId, SlotId, SyntheticMix, TokenId,
};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Rows of 256 values, so that every matrix of the Q4_K_M mix takes K-quant blocks.
const MOE_CONFIG: &str = r#"{
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "intermediate_size": 512, "norm_topk_prob": true,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": false
}"#;

/// A Qwen3.5-MoE of rows of 256 values (its q_proj picked apart into query and gate rows).
const HYBRID_CONFIG: &str = r#"{
    "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 256,
    "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_value_head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "mrope_interleaved": true, "mrope_section": [4, 2, 2]},
    "max_position_embeddings": 4096, "tie_word_embeddings": false
}"#;

const BLOCK_SIZE: usize = 16;
const SEQUENCES: usize = 3;
const PREFILL: usize = 24;

/// The allocations of `model`'s warm steps, by the step's name: a prefill chunk of
/// [`PREFILL`] tokens, then decode steps of all [`SEQUENCES`] sequences together, greedy and
/// sampled (top-k, penalties).
fn warm_step_allocations(model: &Model) -> Vec<(&'static str, usize)> {
    let backend = model.backend().as_ref();
    let per_seq = (4 * PREFILL + 16).div_ceil(BLOCK_SIZE);
    let mut cache =
        PagedKvCache::new(backend, model.config(), SEQUENCES * per_seq, BLOCK_SIZE).unwrap();
    let mut state = RecurrentStateCache::new(backend, model.config(), SEQUENCES).unwrap();
    let tables: Vec<BlockTable> = (0..SEQUENCES)
        .map(|s| BlockTable {
            blocks: (0..per_seq)
                .map(|b| BlockId((s * per_seq + b) as u32))
                .collect(),
        })
        .collect();
    let vocab = model.config().vocab_size as u32;
    let mut positions = [0; SEQUENCES];
    let mut step = SampledStep::default();
    let hybrid = model.is_hybrid();
    // Runs one step of `runs` (sequence, tokens) and returns its allocations.
    let mut run = |runs: &[(usize, usize)], step: &mut SampledStep| {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        for &(s, len) in runs {
            let ids: Vec<TokenId> = (0..len)
                .map(|i| TokenId((7 * (positions[s] + i) as u32 + 3 * s as u32) % vocab))
                .collect();
            let seq = SeqId(s as u64);
            batch
                .push_run(seq, &ids, positions[s], &tables[s], LogitsWanted::Last)
                .unwrap();
            batch.set_state_slot(seq, SlotId(s as u32)).unwrap();
            positions[s] += len;
        }
        let state = hybrid.then_some(&mut state);
        let before = allocations();
        let _ = model
            .forward_sampled(&batch, &mut cache, state, step)
            .unwrap();
        allocations() - before
    };
    let greedy = Filter::GREEDY;
    let sampled = Filter {
        temperature: 0.8,
        top_k: 40,
        ..Filter::GREEDY
    };
    let mut counts = Vec::new();
    step.rows = vec![(greedy, greedy.draw(0))];
    // Chunks of sequences 0 (twice) and 1 warm the pool, the buffers and each thread's
    // reused room; sequence 2's, the shape of sequence 1's, counts. Which thread takes which
    // item varies, so a thread may first meet a kind of item in a later step: the fewest of
    // several steps counts (an allocation in the forward pass is in every step).
    let mut fewest = usize::MAX;
    for (s, counted) in [(0, false), (0, false), (1, false), (2, true)] {
        let allocated = run(&[(s, PREFILL)], &mut step);
        if counted {
            fewest = fewest.min(allocated);
        }
    }
    // Again, over sequence 1's and 2's first chunk: their second, the same shapes.
    for s in [1, 2] {
        fewest = fewest.min(run(&[(s, PREFILL)], &mut step));
    }
    counts.push(("prefill", fewest));
    let all: Vec<(usize, usize)> = (0..SEQUENCES).map(|s| (s, 1)).collect();
    for (name, filter, penalties) in [("greedy decode", greedy, 0), ("sampled decode", sampled, 5)]
    {
        step.rows = (0..SEQUENCES)
            .map(|s| (filter, filter.draw(s as u64 + 1)))
            .collect();
        step.penalties = (0..penalties)
            .map(|i| Penalty {
                index: 97 * i as u32,
                subtract: 0.5,
                repetition: 1.1,
            })
            .collect();
        let mut fewest = usize::MAX;
        for counted in [false, false, false, true, true, true, true] {
            let allocated = run(&all, &mut step);
            assert_eq!(step.candidates.len(), SEQUENCES);
            if counted {
                fewest = fewest.min(allocated);
            }
        }
        counts.push((name, fewest));
    }
    counts
}

#[test]
fn warm_forward_passes_allocate_nothing() {
    let config = |json: &str| ModelConfig::from_json(json, Path::new("config.json")).unwrap();
    let cpu = || Arc::new(CpuBackend::with_kv_dtype(DType::BF16).unwrap());
    let models = [
        (
            "Qwen3-MoE, Q4_K_M",
            Model::synthetic_mixed(
                config(MOE_CONFIG),
                SyntheticMix::Q4KM,
                cpu(),
                1,
                &mut |_, _| {},
            )
            .unwrap(),
        ),
        (
            "Qwen3.5-MoE, Q4_K_M",
            Model::synthetic_mixed(
                config(HYBRID_CONFIG),
                SyntheticMix::Q4KM,
                cpu(),
                3,
                &mut |_, _| {},
            )
            .unwrap(),
        ),
        (
            "Qwen3-MoE, bf16",
            Model::synthetic(config(MOE_CONFIG), cpu(), 2, &mut |_, _| {}).unwrap(),
        ),
        (
            "Qwen3-Next",
            Model::load(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_next"),
                cpu(),
                &mut |_, _| {},
            )
            .unwrap(),
        ),
    ];
    let mut failures = Vec::new();
    for (name, model) in &models {
        for (step, allocated) in warm_step_allocations(model) {
            eprintln!("{name}, {step}: {allocated} allocations");
            if allocated != 0 {
                failures.push(format!("{name}, {step}: {allocated}"));
            }
        }
    }
    assert!(failures.is_empty(), "warm steps allocated: {failures:?}");
}
