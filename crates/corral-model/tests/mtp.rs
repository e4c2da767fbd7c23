//! The MTP head (`Model::load_mtp`) against the demo model's trainer (scripts/train), whose
//! `MtpHead` is the definition Corral follows: tests/fixtures/qwen3_5_moe_mtp, made by
//! scripts/make_mtp_fixture.py, a tiny qwen3_5_moe_text model with every parameter perturbed.
//! Row t of the head's input is the model's final hidden state at t (after its final norm)
//! and the token at t + 1; its logits predict the token at t + 2.

mod common;

use std::sync::Arc;

use common::{
    BLOCK_SIZE, fixture_dir, load, logits_chunked, reference_f32s, reference_i64s, rel_err,
};
use corral_cpu::CpuBackend;
use corral_model::{
    BlockId, BlockTable, LogitsWanted, Model, PagedKvCache, RaggedBatch, SeqId, TokenId,
};

const NAME: &str = "qwen3_5_moe_mtp";

struct MtpReference {
    token_ids: Vec<u32>,
    logits: Vec<f32>,
    hidden: Vec<f32>,
    mtp_logits: Vec<f32>,
}

fn read() -> MtpReference {
    let path = fixture_dir(NAME).join("reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference header");
    MtpReference {
        token_ids: reference_i64s(&st, "token_ids")
            .into_iter()
            .map(|t| t as u32)
            .collect(),
        logits: reference_f32s(&st, "logits"),
        hidden: reference_f32s(&st, "hidden"),
        mtp_logits: reference_f32s(&st, "mtp_logits"),
    }
}

/// The MTP head's logits for every row, fed `chunk` rows per forward through its own KV
/// cache: row t (the hidden state at t, token t + 1) at position t. The trainer puts it at
/// t + 1; attention scores under RoPE depend only on differences of positions.
fn mtp_logits_chunked(mtp: &Model, ids: &[u32], hidden: &[f32], chunk: usize) -> Vec<f32> {
    let h = mtp.config().hidden_size;
    let rows = ids.len() - 1;
    let blocks = ids.len().div_ceil(BLOCK_SIZE);
    let mut kv =
        PagedKvCache::new(mtp.backend().as_ref(), mtp.config(), blocks, BLOCK_SIZE).unwrap();
    let table = BlockTable {
        blocks: (0..blocks as u32).map(BlockId).collect(),
    };
    let (mut all, mut out, mut out_hidden) = (Vec::new(), Vec::new(), Vec::new());
    let mut start = 0;
    while start < rows {
        let end = (start + chunk).min(rows);
        let tokens: Vec<TokenId> = ids[start + 1..end + 1]
            .iter()
            .map(|&t| TokenId(t))
            .collect();
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        batch
            .push_run(SeqId(3), &tokens, start, &table, LogitsWanted::All)
            .unwrap();
        let _ = mtp
            .forward_mtp(
                &batch,
                &mut kv,
                &hidden[start * h..end * h],
                &mut out,
                &mut out_hidden,
            )
            .unwrap();
        assert_eq!(out_hidden.len(), (end - start) * h);
        all.extend_from_slice(&out);
        start = end;
    }
    all
}

#[test]
fn mtp_head_matches_the_trainer_at_every_chunk_size() {
    let reference = read();
    let model = load(NAME);
    let ours = logits_chunked(&model, &reference.token_ids, reference.token_ids.len());
    let err = rel_err(&ours, &reference.logits);
    assert!(err < 1e-4, "the model itself: relative error {err:e}");
    let mtp = Model::load_mtp(
        &fixture_dir(NAME),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect("load the MTP head");
    assert_eq!(mtp.config().num_layers, 1);
    for chunk in [1, 7, reference.token_ids.len()] {
        let ours = mtp_logits_chunked(&mtp, &reference.token_ids, &reference.hidden, chunk);
        let err = rel_err(&ours, &reference.mtp_logits);
        eprintln!("chunk {chunk}: relative error {err:.2e}");
        assert!(err < 1e-4, "chunk {chunk}: relative error {err:e}");
    }
}

/// The model's own final hidden states (read back beside its logits) are the trainer's, and
/// the head on them gives the trainer's logits: the path a drafter takes.
#[test]
fn mtp_head_on_the_models_own_hidden_states_matches_the_trainer() {
    let reference = read();
    let model = load(NAME);
    let ids = &reference.token_ids;
    let (logits, hidden) = logits_and_hidden(&model, ids);
    let err = rel_err(&hidden, &reference.hidden);
    assert!(err < 1e-5, "hidden states: relative error {err:e}");
    assert!(rel_err(&logits, &reference.logits) < 1e-4);
    let mtp = Model::load_mtp(
        &fixture_dir(NAME),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect("load the MTP head");
    let h = mtp.config().hidden_size;
    let ours = mtp_logits_chunked(&mtp, ids, &hidden[..(ids.len() - 1) * h], 5);
    let err = rel_err(&ours, &reference.mtp_logits);
    assert!(err < 1e-4, "relative error {err:e}");
}

/// A step that wants only its last row's logits reads back every token's hidden state (what
/// an MTP drafter takes from prefill chunks), equal to the trainer's, chunk after chunk.
#[test]
fn every_tokens_hidden_state_comes_back_beside_the_last_rows_logits() {
    let reference = read();
    let model = load(NAME);
    let ids = &reference.token_ids;
    let h = model.config().hidden_size;
    let (mut kv, mut state, table) = common::caches(&model, ids.len());
    let (mut logits, mut hidden, mut all) = (Vec::new(), Vec::new(), Vec::new());
    for (start, end) in [(0, 5), (5, 6), (6, ids.len())] {
        let tokens: Vec<TokenId> = ids[start..end].iter().map(|&t| TokenId(t)).collect();
        let mut batch = RaggedBatch::new(BLOCK_SIZE);
        batch
            .push_run(SeqId(0), &tokens, start, &table, LogitsWanted::Last)
            .unwrap();
        batch
            .set_state_slot(SeqId(0), corral_model::SlotId(0))
            .unwrap();
        let _ = model
            .forward_with_all_hidden(&batch, &mut kv, Some(&mut state), &mut logits, &mut hidden)
            .unwrap();
        assert_eq!(hidden.len(), (end - start) * h);
        assert_eq!(logits.len(), model.config().vocab_size);
        all.extend_from_slice(&hidden);
    }
    let err = rel_err(&all, &reference.hidden);
    assert!(err < 1e-5, "hidden states: relative error {err:e}");
}

/// The model's logits and final hidden states at every position of `ids` (one chunk).
fn logits_and_hidden(model: &Model, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let (mut kv, mut state, table) = common::caches(model, ids.len());
    let tokens: Vec<TokenId> = ids.iter().map(|&t| TokenId(t)).collect();
    let mut batch = RaggedBatch::new(BLOCK_SIZE);
    batch
        .push_run(SeqId(0), &tokens, 0, &table, LogitsWanted::All)
        .unwrap();
    batch
        .set_state_slot(SeqId(0), corral_model::SlotId(0))
        .unwrap();
    let (mut logits, mut hidden) = (Vec::new(), Vec::new());
    let _ = model
        .forward_with_all_hidden(&batch, &mut kv, Some(&mut state), &mut logits, &mut hidden)
        .unwrap();
    (logits, hidden)
}

/// GGUF files converted with their head (the dense Qwen3.5's MLP layer, the MoE ones'): the
/// head loads from the file (its tensors' values are checked in `gguf_hybrid`) and drafts the
/// same logits fed one row at a time as all at once, each row its own.
#[test]
fn gguf_mtp_heads_draft_alike_row_by_row_and_at_once() {
    for arch in ["qwen35", "qwen35moe", "qwen3next"] {
        let path = fixture_dir("gguf/hybrid").join(format!("{arch}.mtp.q4_k_m.gguf"));
        let gguf = corral_model::checkpoint::GgufCheckpoint::open(&path).unwrap();
        let backend: Arc<dyn corral_backend::Backend> = Arc::new(CpuBackend::new());
        let model = Model::from_gguf(&gguf, backend.clone(), &mut |_, _| {}).unwrap();
        let mtp = Model::mtp_from_gguf(&gguf, backend, &mut |_, _| {}).unwrap();
        assert_eq!(mtp.config().num_layers, 1, "{arch}");
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 200).collect();
        let (_, hidden) = logits_and_hidden(&model, &ids);
        let h = mtp.config().hidden_size;
        let rows = &hidden[..(ids.len() - 1) * h];
        let whole = mtp_logits_chunked(&mtp, &ids, rows, ids.len());
        let stepped = mtp_logits_chunked(&mtp, &ids, rows, 1);
        let err = rel_err(&stepped, &whole);
        // Products of a few rows with block-format weights quantize x to int8 blocks (as
        // llama.cpp's CPU path does); of many, on a CPU without integer panels (no AVX2), they
        // convert the weights to f32: the trunk's decode and prefill differ as well, and the
        // head may differ as much, or by its Q8_0 LM head's rounding of x alone (at most 1/254
        // of a block's largest value) where the trunk's weights take one path either way.
        let trunk = rel_err(
            &logits_chunked(&model, &ids, 1),
            &logits_chunked(&model, &ids, ids.len()),
        );
        eprintln!("{arch}: row by row against at once {err:.2e} (the trunk: {trunk:.2e})");
        let int8_rounding = 1.0 / 254.0;
        assert!(
            err < (2.0 * trunk).max(int8_rounding),
            "{arch}: row by row against at once {err:e}, the trunk {trunk:e}"
        );
        let vocab = mtp.config().vocab_size;
        assert!(whole.iter().all(|v| v.is_finite()), "{arch}");
        assert_ne!(
            whole[..vocab],
            whole[vocab..2 * vocab],
            "{arch}: rows differ"
        );
    }
}

#[test]
fn a_checkpoint_without_an_mtp_head_says_so() {
    let err = Model::load_mtp(
        &fixture_dir("qwen3_5_moe_text"),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect_err("no mtp.* tensors");
    assert!(err.to_string().contains("no MTP head"), "{err}");
    let err = Model::load_mtp(
        &fixture_dir("qwen3_moe_fused"),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect_err("not a hybrid");
    assert!(err.to_string().contains("no MTP head"), "{err}");
}

/// A synthetic model's head (for timing speculation at full size) has the parameters a
/// checkpoint's head of the same config has, and drafts from the synthetic model's hidden
/// states with the model's own embedding and LM head.
#[test]
fn a_synthetic_head_has_a_real_heads_shape_and_drafts() {
    let real = Model::load_mtp(
        &fixture_dir(NAME),
        Arc::new(CpuBackend::new()),
        &mut |_, _| {},
    )
    .expect("load the MTP head");
    let config = real.config().clone();
    let backend: Arc<dyn corral_backend::Backend> = Arc::new(CpuBackend::new());
    let mix = corral_model::SyntheticMix::Float;
    let mut trunk_config = load(NAME).config().clone();
    trunk_config.dtype = Some("float32".into());
    let trunk = Model::synthetic_mixed(
        trunk_config.clone(),
        mix,
        backend.clone(),
        7,
        &mut |_, _| {},
    )
    .unwrap();
    let head = Model::synthetic_mtp(&trunk_config, mix, backend, 7).unwrap();
    assert_eq!(head.num_parameters(), real.num_parameters());
    assert_eq!(head.config().num_layers, config.num_layers);
    let ids: Vec<u32> = (0..12).map(|i| (i * 29 + 3) % 200).collect();
    let (_, hidden) = logits_and_hidden(&trunk, &ids);
    let rows = &hidden[..(ids.len() - 1) * trunk_config.hidden_size];
    let drafts = mtp_logits_chunked(&head, &ids, rows, ids.len());
    let vocab = config.vocab_size;
    assert_eq!(drafts.len(), (ids.len() - 1) * vocab);
    assert!(drafts.iter().all(|v| v.is_finite()));
    assert_ne!(drafts[..vocab], drafts[vocab..2 * vocab], "rows differ");
}

/// A drafting head's LM head stored again as Q8_0 (`Model::use_q8_0_lm_head`, what
/// speculation loads): its logits stay within Q8_0's rounding of the exact head's and pick
/// the same top token on nearly every row; a second call finds a block format and changes
/// nothing.
#[test]
fn a_q8_0_lm_head_drafts_near_the_exact_head() {
    let reference = read();
    let load_head = || {
        Model::load_mtp(
            &fixture_dir(NAME),
            Arc::new(CpuBackend::new()),
            &mut |_, _| {},
        )
        .expect("load the MTP head")
    };
    let exact = load_head();
    let mut q8 = load_head();
    assert!(
        q8.use_q8_0_lm_head().unwrap(),
        "a float LM head is converted"
    );
    assert!(!q8.use_q8_0_lm_head().unwrap(), "already Q8_0");
    let ids = &reference.token_ids;
    let a = mtp_logits_chunked(&exact, ids, &reference.hidden, ids.len());
    let b = mtp_logits_chunked(&q8, ids, &reference.hidden, ids.len());
    let err = rel_err(&b, &a);
    eprintln!("Q8_0 LM head: relative error {err:.2e}");
    assert!(err > 0.0 && err < 2e-2, "relative error {err:e}");
    let vocab = exact.config().vocab_size;
    let top = |l: &[f32]| -> Vec<usize> {
        l.chunks_exact(vocab)
            .map(|r| {
                (0..vocab)
                    .max_by(|&i, &j| r[i].total_cmp(&r[j]))
                    .unwrap_or(0)
            })
            .collect()
    };
    let (ta, tb) = (top(&a), top(&b));
    let same = ta.iter().zip(&tb).filter(|(x, y)| x == y).count();
    assert!(
        same * 10 >= ta.len() * 9,
        "{same} of {} rows pick the same token",
        ta.len()
    );
}
