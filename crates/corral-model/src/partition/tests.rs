use std::path::PathBuf;

use super::*;
use crate::checkpoint::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn config(name: &str) -> ModelConfig {
    ModelConfig::from_file(&fixture(name).join("config.json")).expect("fixture config")
}

/// Every tensor of every family's fixtures (the MTP head's and a vision tower's aside) has a split, and over the
/// ranks of a group its parts hold each element once, or on every rank for whole tensors, or
/// on `ranks / kv_heads` ranks for key/value heads repeated; each part's shape holds what it
/// picks.
#[test]
fn every_fixture_tensor_splits_into_parts_that_cover_it() {
    for name in [
        "qwen3_moe_fused",
        "qwen3_moe_per_expert",
        "qwen3_moe_sharded",
        "qwen3_dense",
        "qwen3_next",
        "qwen3_5_moe_text",
        "qwen3_5_moe_hub",
        "qwen3_5_dense",
    ] {
        let config = config(name);
        let checkpoint = Checkpoint::open(&fixture(name)).expect("fixture checkpoint");
        let mut tested = 0;
        for ranks in [2, 4] {
            let group: Vec<Partition> = (0..ranks)
                .map(|r| Partition::new(r, ranks).expect("rank"))
                .collect();
            if group[0].rank_config(&config).is_err() {
                continue;
            }
            tested += 1;
            // The text model's tensors (not the MTP head's, nor a vision tower's).
            let text = |n: &&str| !n.contains("mtp") && !n.contains("visual");
            for tensor in checkpoint.names().filter(text) {
                let shape = checkpoint.entry(tensor).expect("entry").shape.clone();
                let n: usize = shape.iter().product();
                // Each element's index as its value, so that the parts say what they hold.
                let index: Vec<f32> = (0..n).map(|i| i as f32).collect();
                let mut held = vec![0usize; n];
                let mut whole = false;
                for p in &group {
                    let shard = p
                        .shard(&config, tensor)
                        .unwrap_or_else(|e| panic!("{name}: {tensor}: {e}"));
                    whole |= shard == Shard::Whole;
                    let part = shard.pick(tensor, &index, &shape).expect("pick");
                    let local: usize = shard.shape(&shape).iter().product();
                    assert_eq!(
                        part.len(),
                        local,
                        "{name}: {tensor} over {ranks}: its shape"
                    );
                    part.iter().for_each(|&i| held[i as usize] += 1);
                }
                let kv = tensor.ends_with("k_proj.weight") || tensor.ends_with("v_proj.weight");
                let times = if whole {
                    ranks
                } else if kv && config.num_kv_heads < ranks {
                    ranks / config.num_kv_heads
                } else {
                    1
                };
                assert!(
                    held.iter().all(|&h| h == times),
                    "{name}: {tensor} {shape:?} over {ranks} ranks: held {:?} times, not {times}",
                    held.iter().collect::<std::collections::BTreeSet<_>>()
                );
            }
        }
        assert!(tested > 0, "{name}: no group tested");
    }
}

/// A rank's config has its share of every head count and intermediate size; key/value
/// heads fewer than the ranks repeat, one a rank.
#[test]
fn rank_configs_hold_their_share_of_heads_and_rows() {
    let whole = config("qwen3_next");
    let local = Partition::new(1, 2).unwrap().rank_config(&whole).unwrap();
    assert_eq!((local.num_heads, local.num_kv_heads), (2, 1));
    assert_eq!(local.intermediate_size, whole.intermediate_size / 2);
    assert_eq!(local.vocab_size, whole.vocab_size);
    let moe = local.moe.as_ref().unwrap();
    assert_eq!(moe.moe_intermediate_size, 16);
    assert_eq!(moe.num_experts, whole.moe.as_ref().unwrap().num_experts);
    let hybrid = local.hybrid.as_ref().unwrap();
    assert_eq!(
        (hybrid.linear.num_key_heads, hybrid.linear.num_value_heads),
        (1, 3)
    );
    assert_eq!(hybrid.shared_expert_intermediate_size, Some(24));

    let dense = config("qwen3_dense");
    let four = Partition::new(3, 4).unwrap();
    let local = four.rank_config(&dense).unwrap();
    assert_eq!((local.num_heads, local.num_kv_heads), (1, 1));
    // Two KV heads over four ranks: ranks 2 and 3 attend with head 1.
    let head_1 = dense.head_dim..2 * dense.head_dim;
    assert_eq!(
        four.shard(&dense, "model.layers.0.self_attn.k_proj.weight")
            .unwrap(),
        Shard::Rows(vec![head_1])
    );
}

/// What does not split evenly, a rank past the group and a tensor without a known split are
/// refused, naming what is wrong.
#[test]
fn partitions_refuse_what_does_not_split() {
    let err = |r: Result<ModelConfig>| r.unwrap_err().to_string();
    assert!(
        Partition::new(2, 2)
            .unwrap_err()
            .to_string()
            .contains("rank 2")
    );
    let next = config("qwen3_next");
    let message = err(Partition::new(0, 3).unwrap().rank_config(&next));
    assert!(message.contains("attention heads (4)"), "{message}");
    let message = err(Partition::new(0, 4).unwrap().rank_config(&next));
    assert!(message.contains("linear key heads (2)"), "{message}");
    let message = Partition::new(0, 2)
        .unwrap()
        .shard(&next, "model.layers.0.mlp.mystery.weight")
        .unwrap_err()
        .to_string();
    assert!(message.contains("mlp.mystery.weight"), "{message}");
}
