//! Helpers shared by the conformance tests: fixture paths, transformers' reference outputs
//! (`reference.safetensors`, made by scripts/make_fixtures.py) and error measures.

#![allow(dead_code, missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use corral_cpu::CpuBackend;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, RecurrentStateCache,
    SeqId, SlotId, TokenId,
};

/// The committed Qwen3 / Qwen3-MoE fixtures.
pub(crate) const QWEN3_FIXTURES: &[&str] = &[
    "qwen3_moe_fused",
    "qwen3_moe_per_expert",
    "qwen3_moe_sharded",
    "qwen3_dense",
];

/// Every MoE strategy, `auto` switching within the fixtures' prompt lengths.
pub(crate) const STRATEGIES: [corral_model::MoeStrategy; 5] = [
    corral_model::MoeStrategy::PerExpert,
    corral_model::MoeStrategy::PerExpertOneSync,
    corral_model::MoeStrategy::PerToken,
    corral_model::MoeStrategy::Grouped,
    corral_model::MoeStrategy::Auto {
        grouped_min_tokens: 4,
    },
];

/// A committed fixture's directory.
pub(crate) fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Loads a fixture on the CPU backend.
pub(crate) fn load(name: &str) -> Model {
    load_on(name, Arc::new(CpuBackend::new()))
}

/// Loads a fixture on `backend`.
pub(crate) fn load_on(name: &str, backend: Arc<dyn corral_backend::Backend>) -> Model {
    Model::load(&fixture_dir(name), backend, &mut |_, _| {}).expect("load fixture")
}

/// The largest `‖row − reference row‖ / ‖reference row‖` over rows of `width`.
pub(crate) fn worst_row_rel_err(ours: &[f32], reference: &[f32], width: usize) -> f64 {
    assert_eq!(ours.len(), reference.len());
    ours.chunks(width)
        .zip(reference.chunks(width))
        .map(|(a, b)| rel_err(a, b))
        .fold(0.0, f64::max)
}

/// transformers' outputs for a fixture.
pub(crate) struct Reference {
    pub(crate) token_ids: Vec<u32>,
    pub(crate) logits: Vec<f32>,
    pub(crate) greedy_prompt: Vec<u32>,
    pub(crate) greedy_continuation: Vec<u32>,
}

pub(crate) fn read_reference(dir: &Path) -> Reference {
    read_reference_file(&dir.join("reference.safetensors"))
}

/// transformers' outputs in the file `path`.
pub(crate) fn read_reference_file(path: &Path) -> Reference {
    let bytes = std::fs::read(path).expect("reference file");
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

/// Rows of logits the long-context fixtures keep: the last positions of the sequence.
pub(crate) const LONG_TAIL: usize = 32;

/// A long-context fixture's tokens and transformers' logits of its last [`LONG_TAIL`]
/// positions (scripts/make_long_fixtures.py).
pub(crate) fn read_long_reference(name: &str) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(fixture_dir(name).join("reference.safetensors")).expect("reference");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference header");
    let ids = st
        .tensor("token_ids")
        .expect("token_ids")
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let logits = st
        .tensor("tail_logits")
        .expect("tail_logits")
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (ids, logits)
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

/// Tokens per KV block in the conformance tests.
pub(crate) const BLOCK_SIZE: usize = 16;

/// A fresh KV cache and recurrent state (for hybrids) for one sequence of up to `tokens`
/// tokens, and the block table covering it.
pub(crate) fn caches(
    model: &Model,
    tokens: usize,
) -> (PagedKvCache, RecurrentStateCache, BlockTable) {
    let blocks = tokens.div_ceil(BLOCK_SIZE);
    let backend = model.backend().as_ref();
    let kv = PagedKvCache::new(backend, model.config(), blocks, BLOCK_SIZE).unwrap();
    let state = RecurrentStateCache::new(backend, model.config(), 3).unwrap();
    let table = BlockTable {
        blocks: (0..blocks as u32).map(BlockId).collect(),
    };
    (kv, state, table)
}

/// Logits of every position of `tokens`, fed `chunk` tokens per forward through the cache
/// (state slot 2 of 3, so a slot other than the first is exercised).
pub(crate) fn logits_chunked(model: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let (mut kv, mut state, table) = caches(model, tokens.len());
    let (mut all, mut out) = (Vec::new(), Vec::new());
    for (i, piece) in tokens.chunks(chunk).enumerate() {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        let ids: Vec<TokenId> = piece.iter().map(|&t| TokenId(t)).collect();
        batch
            .push_run(SeqId(0), &ids, i * chunk, &table, LogitsWanted::All)
            .unwrap();
        batch.set_state_slot(SeqId(0), SlotId(2)).unwrap();
        let _ = model
            .forward_with_state(&batch, &mut kv, &mut state, &mut out)
            .unwrap();
        all.extend_from_slice(&out);
    }
    all
}

/// `count` greedy tokens after `prompt`: prefill, then one decode step per token.
pub(crate) fn greedy(model: &Model, prompt: &[u32], count: usize) -> Vec<u32> {
    greedy_chunked(model, prompt, count, prompt.len().max(1))
}

/// `count` greedy tokens after `prompt`, prefilled `chunk` tokens per forward, then one
/// decode step per token.
pub(crate) fn greedy_chunked(
    model: &Model,
    prompt: &[u32],
    count: usize,
    chunk: usize,
) -> Vec<u32> {
    let (mut kv, mut state, table) = caches(model, prompt.len() + count);
    let vocab = model.config().vocab_size;
    let (mut position, mut generated, mut logits) = (0, Vec::new(), Vec::new());
    let mut pieces = prompt.chunks(chunk.max(1));
    let mut next = pieces.next().unwrap_or_default().to_vec();
    while generated.len() < count {
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        let ids: Vec<TokenId> = next.iter().map(|&t| TokenId(t)).collect();
        batch
            .push_run(SeqId(5), &ids, position, &table, LogitsWanted::Last)
            .unwrap();
        batch.set_state_slot(SeqId(5), SlotId(0)).unwrap();
        let _ = model
            .forward_with_state(&batch, &mut kv, &mut state, &mut logits)
            .unwrap();
        assert_eq!(logits.len(), vocab, "one row of logits per decode step");
        position += next.len();
        if let Some(piece) = pieces.next() {
            next = piece.to_vec();
            continue;
        }
        let best = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        generated.push(best);
        next = vec![best];
    }
    generated
}

/// The hybrid GGUF fixtures (tests/fixtures/gguf/hybrid, made by llama.cpp's converter and
/// quantizer): reading their references and the error llama.cpp itself has on them.
/// (token ids, logits) of a fixture's reference file.
pub(crate) fn read_logits_reference(path: &Path) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference header");
    let ids = reference_i64s(&st, "token_ids")
        .into_iter()
        .map(|i| i as u32)
        .collect();
    (ids, reference_f32s(&st, "logits"))
}

/// Tensor `name` of a reference file, as i64 values.
pub(crate) fn reference_i64s(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<i64> {
    let view = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    view.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Tensor `name` of a reference file, as f32 values.
pub(crate) fn reference_f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<f32> {
    let view = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    view.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The median of the positions' own relative errors.
pub(crate) fn median_row_err(ours: &[f32], reference: &[f32], vocab: usize) -> f64 {
    let mut rows: Vec<f64> = ours
        .chunks(vocab)
        .zip(reference.chunks(vocab))
        .map(|(a, b)| rel_err(a, b))
        .collect();
    rows.sort_by(f64::total_cmp);
    rows[rows.len() / 2]
}

/// The median position's relative error llama.cpp's CPU build (llama-cpp-python 0.3.36's
/// vendored llama.cpp, f16 KV cache) has on each fixture, from `scripts/gguf_fidelity.sh`'s
/// logits tool; Corral's, measured beside them (AVX2 and AVX-512 CPUs), is at or below in every cell
/// (scripts/gguf_fidelity.sh hybrid).
pub(crate) const LLAMA_CPP_HYBRID_ERRORS: [(&str, [(&str, f64); 6]); 3] = [
    (
        "qwen35",
        [
            ("bf16", 3.6510e-03),
            ("q8_0", 1.3057e-02),
            ("q6_k", 1.6192e-02),
            ("q5_k_m", 1.6298e-02),
            ("q4_k_m", 1.5554e-02),
            ("mtp.q4_k_m", 1.5970e-02),
        ],
    ),
    (
        "qwen35moe",
        [
            ("bf16", 3.4750e-03),
            ("q8_0", 1.2104e-02),
            ("q6_k", 1.4190e-02),
            ("q5_k_m", 1.4991e-02),
            ("q4_k_m", 1.4492e-02),
            ("mtp.q4_k_m", 1.4722e-02),
        ],
    ),
    (
        "qwen3next",
        [
            ("bf16", 3.4178e-03),
            ("q8_0", 1.1972e-02),
            ("q6_k", 1.5144e-02),
            ("q5_k_m", 1.5066e-02),
            ("q4_k_m", 1.5562e-02),
            ("mtp.q4_k_m", 1.5335e-02),
        ],
    ),
];

/// Room for another CPU's kernels (AVX-512's f32 tiles where AVX2 has integer panels) to
/// land a few units of the last digit apart.
pub(crate) const SAME_KERNELS: f64 = 1.01;

/// Every fixture of `cases` (fixtures, and their chunkings besides whole) on `backend` under
/// each of `strategies`, against transformers' logits: each case printed with its time
/// (`label` first: the KV cache's type), then every case beyond `all_positions` (relative
/// error over all positions) or `worst_row` named in one failure.
pub(crate) fn check_fixture_logits(
    backend: &Arc<dyn corral_backend::Backend>,
    label: &str,
    cases: &[(&[&str], &[usize])],
    strategies: &[corral_model::MoeStrategy],
    (all_positions, worst_row): (f64, f64),
) {
    let mut failures = Vec::new();
    for (name, chunks) in cases
        .iter()
        .flat_map(|&(names, chunks)| names.iter().map(move |n| (n, chunks)))
    {
        let mut model = load_on(name, Arc::clone(backend));
        let reference = read_reference(&fixture_dir(name));
        let vocab = model.config().vocab_size;
        for &strategy in strategies {
            model.set_moe_strategy(strategy);
            for &chunk in chunks.iter().chain([&reference.token_ids.len()]) {
                let start = std::time::Instant::now();
                let ours = logits_chunked(&model, &reference.token_ids, chunk);
                let err = rel_err(&ours, &reference.logits);
                let worst = worst_row_rel_err(&ours, &reference.logits, vocab);
                let case = format!(
                    "{label}: {name} {strategy} chunk {chunk}: relative error {err:.2e}, worst row {worst:.2e} ({:.1} s)",
                    start.elapsed().as_secs_f64()
                );
                eprintln!("{case}");
                if err > all_positions || worst > worst_row {
                    failures.push(case);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "beyond {all_positions:e} (all positions) or {worst_row:e} (worst row):\n{}",
        failures.join("\n")
    );
}
