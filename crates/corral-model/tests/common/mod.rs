//! Helpers shared by the conformance tests: fixture paths, transformers' reference outputs
//! (`reference.safetensors`, made by scripts/make_fixtures.py) and error measures.

#![allow(dead_code, missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_backend::CpuBackend;
use corral_model::Model;

/// A committed fixture's directory.
pub(crate) fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Loads a fixture on the CPU backend.
pub(crate) fn load(name: &str) -> Model {
    Model::load(
        &fixture_dir(name),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect("load fixture")
}

/// transformers' outputs for a fixture.
pub(crate) struct Reference {
    pub(crate) token_ids: Vec<u32>,
    pub(crate) logits: Vec<f32>,
    pub(crate) greedy_prompt: Vec<u32>,
    pub(crate) greedy_continuation: Vec<u32>,
}

pub(crate) fn read_reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).expect("reference file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference header");
    let ids = |name: &str| -> Vec<u32> {
        st.tensor(name)
            .expect(name)
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    };
    Reference {
        token_ids: ids("token_ids"),
        logits: st
            .tensor("logits")
            .expect("logits")
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        greedy_prompt: ids("greedy_prompt"),
        greedy_continuation: ids("greedy_continuation"),
    }
}

/// `‖ours − reference‖ / ‖reference‖`.
pub(crate) fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let diff: f64 = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// Largest element-wise difference relative to the largest reference magnitude.
pub(crate) fn max_rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    diff / scale
}
