//! Malformed checkpoints give errors that name the file, tensor or field at fault, never a
//! panic. Each case copies a good fixture into a temporary directory and breaks one thing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_cpu::CpuBackend;
use corral_model::Model;
use safetensors::tensor::{Dtype, TensorView};

const FIXTURE: &str = "qwen3_moe_fused";

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(FIXTURE)
}

/// A copy of the fixture's config.json and model.safetensors.
fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir().join(file), dir.path().join(file)).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    let err =
        Model::load(dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).expect_err("load must fail");
    err.to_string()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(value.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

/// Rewrites model.safetensors through `edit`, which sees (name, dtype, shape, bytes) tuples.
fn edit_tensors(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let metadata: Option<HashMap<String, String>> = None;
    safetensors::serialize_to_file(views, &metadata, &path).unwrap();
}

#[test]
fn missing_config_names_the_file() {
    let dir = copy_fixture();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("config.json"), "{msg}");
}

#[test]
fn missing_weights_file_is_reported() {
    let dir = copy_fixture();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn malformed_config_json_names_the_file() {
    let dir = copy_fixture();
    std::fs::write(
        dir.path().join("config.json"),
        "{\"model_type\": \"qwen3_moe\",",
    )
    .unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("config.json") && msg.contains("JSON"), "{msg}");
}

#[test]
fn unknown_model_type_is_named() {
    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "llama4".into());
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("llama4") && msg.contains("model_type"),
        "{msg}"
    );
}

#[test]
fn config_field_of_wrong_type_is_named() {
    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.insert("hidden_size".into(), "sixty-four".into());
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("hidden_size") && msg.contains("string"),
        "{msg}"
    );

    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.insert("norm_topk_prob".into(), 3.into());
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("norm_topk_prob") && msg.contains("boolean"),
        "{msg}"
    );
}

#[test]
fn missing_config_field_is_named() {
    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.remove("num_hidden_layers");
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("num_hidden_layers") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let dir = copy_fixture();
    edit_tensors(dir.path(), |t| {
        t.retain(|(n, ..)| n != "model.layers.2.self_attn.k_proj.weight")
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("model.layers.2.self_attn.k_proj.weight") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let dir = copy_fixture();
    edit_tensors(dir.path(), |t| {
        let entry = t
            .iter_mut()
            .find(|(n, ..)| n == "model.layers.0.mlp.gate.weight")
            .unwrap();
        entry.2 = vec![entry.2[1], entry.2[0]];
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("model.layers.0.mlp.gate.weight")
            && msg.contains("[64, 8]")
            && msg.contains("[8, 64]"),
        "{msg}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let dir = copy_fixture();
    edit_tensors(dir.path(), |t| {
        let entry = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        // Same byte length as the bf16 original: half as many i32 elements.
        entry.1 = Dtype::I32;
        entry.2 = vec![entry.2[0] / 2];
    });
    let msg = load_err(dir.path());
    assert!(
        msg.contains("model.norm.weight") && msg.contains("I32"),
        "{msg}"
    );
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = copy_fixture();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let msg = load_err(dir.path());
    assert!(
        msg.contains("model.safetensors") && msg.contains("invalid safetensors"),
        "{msg}"
    );
}

#[test]
fn corrupt_header_names_the_file() {
    for corrupt in [
        // Header length far beyond the file.
        {
            let mut b = vec![0xff; 8];
            b.extend_from_slice(b"{}");
            b
        },
        // Header that is not JSON.
        {
            let mut b = 12u64.to_le_bytes().to_vec();
            b.extend_from_slice(b"not json!!!!");
            b
        },
        // Shorter than the length prefix.
        vec![1, 2, 3],
    ] {
        let dir = copy_fixture();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, corrupt).unwrap();
        let msg = load_err(dir.path());
        assert!(
            msg.contains("model.safetensors") && msg.contains("invalid safetensors"),
            "{msg}"
        );
    }
}

#[test]
fn index_naming_a_missing_shard_names_it() {
    let dir = copy_fixture();
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("a.safetensors"),
    )
    .unwrap();
    let index = r#"{"weight_map": {"model.norm.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}}"#;
    std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
    let msg = load_err(dir.path());
    assert!(msg.contains("b.safetensors"), "{msg}");
}
