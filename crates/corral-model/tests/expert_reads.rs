//! A batch of decode rows reads each hit expert once per step under the grouped strategy,
//! while per-token reads an expert once per (row, expert) pair: counted exactly by the
//! backend's weight-bytes counter.

use std::path::Path;
use std::sync::Arc;

use corral_backend::CpuBackend;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, ModelConfig, MoeStrategy, PagedKvCache, RaggedBatch,
    SeqId, TokenId,
};

const CONFIG: &str = r#"{
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true,
    "rope_theta": 1000000.0, "torch_dtype": "bfloat16"
}"#;
const ROWS: usize = 8;

fn decode_step_moe_bytes(model: &Model) -> u64 {
    let mut cache = PagedKvCache::new(model.backend().as_ref(), model.config(), ROWS, 4).unwrap();
    let mut batch = RaggedBatch::new(4);
    for row in 0..ROWS {
        let table = BlockTable {
            blocks: vec![BlockId(row as u32)],
        };
        batch
            .push_run(
                SeqId(row as u64),
                &[TokenId(row as u32 * 7 + 1)],
                0,
                &table,
                LogitsWanted::Last,
            )
            .unwrap();
    }
    let mut logits = Vec::new();
    model
        .forward(&batch, &mut cache, &mut logits)
        .unwrap()
        .moe_stats
        .weight_bytes_read
}

#[test]
fn grouped_reads_each_hit_expert_once_per_step() {
    let config = ModelConfig::from_json(CONFIG, Path::new("config.json")).unwrap();
    let mut model =
        Model::synthetic(config, Arc::new(CpuBackend::new()), 3, &mut |_, _| {}).unwrap();
    let (h, i, e, k, layers) = (32u64, 16u64, 8u64, 2u64, 2u64);
    let expert = 3 * h * i * 2;
    let router = e * h * 2;

    model.set_moe_strategy(MoeStrategy::PerToken);
    let per_token = decode_step_moe_bytes(&model);
    assert_eq!(per_token, layers * (router + ROWS as u64 * k * expert));

    model.set_moe_strategy(MoeStrategy::Grouped);
    let grouped = decode_step_moe_bytes(&model);
    // 16 (row, expert) pairs over 8 experts: at most 8 distinct experts per layer.
    assert!(grouped <= layers * (router + e * expert), "{grouped}");
    assert!(grouped >= layers * (router + k * expert), "{grouped}");
    assert!(grouped < per_token);
    assert_eq!(
        (grouped - layers * router) % expert,
        0,
        "whole experts only"
    );
}
