//! A batch of decode rows reads each hit expert once per step under the grouped strategy,
//! while per-token reads an expert once per (row, expert) pair: counted exactly by the
//! backend's weight-bytes counter.

use std::path::Path;
use std::sync::Arc;

use corral_cpu::CpuBackend;
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

/// Weight bytes of one decode step of `ROWS` sequences, in the MoE blocks and in all; with
/// `same_token` every row is the same token at position 0, so every row routes alike.
fn decode_step_bytes(model: &Model, same_token: bool) -> (u64, u64) {
    let mut cache = PagedKvCache::new(model.backend().as_ref(), model.config(), ROWS, 4).unwrap();
    let mut batch = RaggedBatch::new(4);
    for row in 0..ROWS {
        let table = BlockTable {
            blocks: vec![BlockId(row as u32)],
        };
        batch
            .push_run(
                SeqId(row as u64),
                &[TokenId(if same_token { 5 } else { row as u32 * 7 + 1 })],
                0,
                &table,
                LogitsWanted::Last,
            )
            .unwrap();
    }
    let mut logits = Vec::new();
    let report = model.forward(&batch, &mut cache, &mut logits).unwrap();
    (
        report.moe_stats.weight_bytes_read,
        report.stats.weight_bytes_read,
    )
}

fn decode_step_moe_bytes(model: &Model) -> u64 {
    decode_step_bytes(model, false).0
}

/// Rows that all route alike hit exactly `top_k` experts per layer: grouped reads each of
/// them once (not once per row, and not every expert), per-token once per (row, expert).
/// The totals of the whole step are compared, since a GPU counts on the device and reports
/// at the step's read-back; everything outside the experts reads the same under both.
fn check_identical_rows_read_each_hit_expert_once(backend: Arc<dyn corral_backend::Backend>) {
    let config = ModelConfig::from_json(CONFIG, Path::new("config.json")).unwrap();
    let mut model = Model::synthetic(config, backend, 3, &mut |_, _| {}).unwrap();
    let (h, i, k, layers) = (32u64, 16u64, 2u64, 2u64);
    let expert = 3 * h * i * 2;
    model.set_moe_strategy(MoeStrategy::Grouped);
    let grouped = decode_step_bytes(&model, true).1;
    model.set_moe_strategy(MoeStrategy::PerToken);
    let per_token = decode_step_bytes(&model, true).1;
    // Per-token reads ROWS·k expert matrices a layer; grouped the k distinct ones. Reading
    // every expert (8) or each once per row (16) would change this difference.
    assert_eq!(per_token - grouped, layers * (ROWS as u64 - 1) * k * expert);
}

#[test]
fn identical_rows_read_each_hit_expert_exactly_once() {
    check_identical_rows_read_each_hit_expert_once(Arc::new(CpuBackend::new()));
}

#[test]
fn identical_rows_read_each_hit_expert_exactly_once_on_the_gpu() {
    match corral_cuda::cuda_available() {
        Err(why) => eprintln!("skipped: no CUDA device ({why})"),
        Ok(_) => check_identical_rows_read_each_hit_expert_once(Arc::new(
            corral_cuda::CudaBackend::new(Default::default()).unwrap(),
        )),
    }
}

/// Rows that route differently: grouped reads exactly what the per-expert loop reads (each
/// hit expert once), and fewer than every expert are hit, so reading all of them, or an
/// expert once per row, would not pass.
#[test]
fn grouped_reads_each_hit_expert_once_as_the_per_expert_loop_does() {
    let config = ModelConfig::from_json(CONFIG, Path::new("config.json")).unwrap();
    let mut model =
        Model::synthetic(config, Arc::new(CpuBackend::new()), 3, &mut |_, _| {}).unwrap();
    let (h, i, e, k, layers) = (32u64, 16u64, 8u64, 2u64, 2u64);
    let expert = 3 * h * i * 2;
    let router = e * h * 2;

    model.set_moe_strategy(MoeStrategy::PerToken);
    let per_token = decode_step_moe_bytes(&model);
    assert_eq!(per_token, layers * (router + ROWS as u64 * k * expert));

    model.set_moe_strategy(MoeStrategy::PerExpert);
    let per_expert = decode_step_moe_bytes(&model);
    model.set_moe_strategy(MoeStrategy::Grouped);
    let grouped = decode_step_moe_bytes(&model);
    assert_eq!(grouped, per_expert);
    assert!(
        per_expert < layers * (router + e * expert),
        "{per_expert}: every expert hit"
    );
    assert!(
        per_expert > layers * (router + k * expert),
        "{per_expert}: the rows route alike"
    );
}
