//! Conformance of the CUDA backend: every Qwen3 / Qwen3-MoE fixture, and the hybrid (Gated
//! DeltaNet + gated attention) fixtures made for bf16, within bf16 tolerance of transformers'
//! fp32 logits at chunk 1, 7 (64 for the hybrids) and whole under every MoE strategy,
//! identical 16-token greedy continuations, strategies agreeing with each other and the GPU
//! agreeing with the CPU; the other hybrid fixtures on the f32 decode paths. Without a usable
//! GPU each test says why it skipped and passes.
//!
//! Two KV cache types: with an f32 cache every error is the kernels' (bf16 tensor-core
//! operands): ≤ 2e-2 over all positions and in the worst row (5e-2 for the bf16 hybrids'
//! worst row, see `gpu_bf16_hybrids_match_transformers_with_an_f32_kv_cache`). With the default bf16 cache
//! these tiny fixtures, whose perturbed q/k norms make attention sharp, also see K and V
//! rounded: the CPU with bf16-rounded K/V shows the same error (3.95e-3 on the fused
//! fixture at chunk 1, as the GPU), so the bf16-cache bound is on all positions (2e-2)
//! and on the worst row 1e-1.

mod common;

use std::sync::Arc;

use common::{
    LONG_TAIL, fixture_dir, greedy, load, load_on, logits_chunked, read_long_reference,
    read_reference, rel_err, worst_row_rel_err,
};
use corral_backend::{Backend, DType, DispatchStats};
use corral_cuda::{CudaBackend, CudaOptions, cuda_available};
use corral_model::{LogitsWanted, Model, MoeStrategy, RaggedBatch, SeqId, SlotId, TokenId};

const FIXTURES: &[&str] = common::QWEN3_FIXTURES;
const STRATEGIES: [MoeStrategy; 5] = common::STRATEGIES;
const TOLERANCE: f64 = 2e-2;

fn gpu(kv_dtype: DType) -> Option<Arc<dyn Backend>> {
    gpu_with(CudaOptions {
        kv_dtype: Some(kv_dtype),
        ..Default::default()
    })
}

fn gpu_with(options: CudaOptions) -> Option<Arc<dyn Backend>> {
    match cuda_available() {
        Err(why) => {
            eprintln!("skipped: no CUDA device ({why})");
            None
        }
        Ok(_) => Some(Arc::new(CudaBackend::new(options).expect("open cuda:0"))),
    }
}

#[test]
fn gpu_logits_match_transformers_with_an_f32_kv_cache() {
    check_logits(DType::F32, TOLERANCE, TOLERANCE);
}

#[test]
fn gpu_logits_match_transformers_with_the_bf16_kv_cache() {
    check_logits(DType::BF16, TOLERANCE, 1e-1);
}

/// K and V in fp8 (e4m3, a scale per token and head): 3 bits of mantissa against bf16's 7,
/// a rounding step 32 times bf16's, and these fixtures' sharp attention shows it (measured on
/// the H200: 4.4e-2 to 1.37e-1 over all positions, worst rows up to 5.5e-1 on
/// qwen3_moe_sharded, whose bf16 cache gives 3.5e-3). So this bounds gross faults only; the
/// attention kernels and the fused store are held to the reference over the same rounded K
/// and V in corral-device's op conformance suite (the attention within 2.5e-2 on CUDA, the
/// store within 1e-2).
#[test]
fn gpu_logits_stay_near_transformers_with_the_fp8_kv_cache() {
    check_logits(DType::F8E4M3, 2e-1, 8e-1);
}

/// The long-context fixtures (Qwen3 with YaRN at 32,768 tokens, a hybrid's partial RoPE at
/// 8,192) on the GPU with an f32 KV cache, whole and in chunks of 3,000: the last positions'
/// logits within bf16 tolerance of transformers', and the two chunkings within it of each
/// other. The hybrid runs its delta rule as the f32 recurrence: the chunked form's bf16
/// operands put these tiny fixtures past 2e-2 at any length (2.4e-2 here, as at chunk 64 in
/// `gpu_hybrid_decode_matches_transformers_on_the_f32_paths`), which is not what this checks;
/// its worst row may reach 5e-2 (2.7e-2 seen: the bf16 projections on these perturbed
/// weights; the CPU's is 9e-6, and Qwen3's at 32k on the GPU 1.6e-3).
#[test]
fn gpu_long_context_logits_match_transformers() {
    let Some(backend) = gpu(DType::F32) else {
        return;
    };
    let recurrent: Arc<dyn Backend> = Arc::new(
        CudaBackend::new(CudaOptions {
            kv_dtype: Some(DType::F32),
            recurrent_delta_rule: true,
            ..Default::default()
        })
        .expect("open cuda:0"),
    );
    for (name, backend, worst_row) in [
        ("long_qwen3_yarn", &backend, TOLERANCE),
        ("long_qwen3_5", &recurrent, 5e-2),
    ] {
        let model = load_on(name, Arc::clone(backend));
        let vocab = model.config().vocab_size;
        let (tokens, reference) = read_long_reference(name);
        let mut tails = Vec::new();
        for chunk in [tokens.len(), 3000] {
            let all = logits_chunked(&model, &tokens, chunk);
            let tail = all[all.len() - LONG_TAIL * vocab..].to_vec();
            let (err, worst) = (
                rel_err(&tail, &reference),
                worst_row_rel_err(&tail, &reference, vocab),
            );
            eprintln!("{name} chunk {chunk}: relative error {err:.2e}, worst row {worst:.2e}");
            assert!(err <= TOLERANCE, "{name} chunk {chunk}: {err:e}");
            assert!(worst <= worst_row, "{name} chunk {chunk}: row {worst:e}");
            tails.push(tail);
        }
        let apart = rel_err(&tails[1], &tails[0]);
        eprintln!("{name}: chunks of 3000 against whole {apart:.2e}");
        assert!(
            apart <= TOLERANCE,
            "{name}: chunked against whole {apart:e}"
        );
    }
}

fn check_logits(kv_dtype: DType, all_positions: f64, worst_row: f64) {
    check_fixture_logits(FIXTURES, &[1, 7], kv_dtype, all_positions, worst_row);
}

/// Every strategy at each of `chunks` and whole ([`common::check_fixture_logits`]).
fn check_fixture_logits(
    fixtures: &[&str],
    chunks: &[usize],
    kv_dtype: DType,
    all_positions: f64,
    worst_row: f64,
) {
    let Some(backend) = gpu(kv_dtype) else { return };
    common::check_fixture_logits(
        &backend,
        &format!("{kv_dtype} KV"),
        &[(fixtures, chunks)],
        &STRATEGIES,
        (all_positions, worst_row),
    );
}

/// Hybrid fixtures at a trained model's weight scale (scripts/make_fixtures.py `bf16_*`),
/// on which bf16 operands and noise inside the kernels move transformers' own logits by
/// 2.8e-3 to 4.4e-3 (every row within 8.9e-3).
const BF16_HYBRID_FIXTURES: &[&str] = &[
    "bf16_qwen3_5_moe_hub",
    "bf16_qwen3_5_moe_text",
    "bf16_qwen3_5_dense",
    "bf16_qwen3_next",
];

/// Every hybrid op on its bf16 paths (grouped experts, few-row and prefill projections, the
/// chunked delta rule on tensor cores from chunk 64) within bf16 tolerance over all
/// positions. A single row may move further: the grouped expert tiles' bf16 operands move
/// one row of `bf16_qwen3_next` by 3.0e-2 (every position together 4.3e-3; the other
/// strategies' worst rows 3.2e-3 to 3.8e-3, 2.0e-2 before the chunked delta rule's operands
/// were split), so the worst row's bound is 5e-2.
#[test]
fn gpu_bf16_hybrids_match_transformers_with_an_f32_kv_cache() {
    check_fixture_logits(
        BF16_HYBRID_FIXTURES,
        &[1, 7, 64],
        DType::F32,
        TOLERANCE,
        5e-2,
    );
}

/// As above with K and V rounded to bf16 in the cache; the worst row's bound as for Qwen3.
#[test]
fn gpu_bf16_hybrids_match_transformers_with_the_bf16_kv_cache() {
    check_fixture_logits(
        BF16_HYBRID_FIXTURES,
        &[1, 7, 64],
        DType::BF16,
        TOLERANCE,
        1e-1,
    );
}

#[test]
fn gpu_greedy_continuations_match_transformers() {
    let Some(backend) = gpu(DType::F32) else {
        return;
    };
    for name in FIXTURES.iter().chain(BF16_HYBRID_FIXTURES) {
        let mut model = load_on(name, Arc::clone(&backend));
        let reference = read_reference(&fixture_dir(name));
        for strategy in STRATEGIES {
            model.set_moe_strategy(strategy);
            let generated = greedy(
                &model,
                &reference.greedy_prompt,
                reference.greedy_continuation.len(),
            );
            eprintln!("{name} {strategy}: greedy {generated:?}");
            assert_eq!(
                generated, reference.greedy_continuation,
                "{name} {strategy}"
            );
        }
    }
}

const HYBRID_FIXTURES: &[&str] = &[
    "qwen3_5_moe_hub",
    "qwen3_5_moe_text",
    "qwen3_5_dense",
    "qwen3_next",
];

/// The hybrid layers' kernels (conv, gates, delta rule, gated attention, zero-centred norms)
/// on the f32 paths: decode steps (chunk 1) under per-token and per-expert, whose one-row
/// projections run in f32, against transformers; greedy continuations under both. Every
/// other strategy and chunk is printed, not asserted: these fixtures, built so that every
/// fp32 error shows, amplify bf16 rounding past the bound (up to 9.7e-2 here; transformers'
/// own bf16 run misses it on them by 2–15×). `gpu_bf16_hybrids_*` assert the bf16 paths.
#[test]
fn gpu_hybrid_decode_matches_transformers_on_the_f32_paths() {
    let Some(backend) = gpu(DType::F32) else {
        return;
    };
    for name in HYBRID_FIXTURES {
        let mut model = load_on(name, Arc::clone(&backend));
        let reference = read_reference(&fixture_dir(name));
        let vocab = model.config().vocab_size;
        for strategy in [
            MoeStrategy::PerToken,
            MoeStrategy::PerExpert,
            MoeStrategy::Grouped,
        ] {
            model.set_moe_strategy(strategy);
            let f32_path = strategy != MoeStrategy::Grouped;
            for chunk in [1, 7, 64, reference.token_ids.len()] {
                let ours = logits_chunked(&model, &reference.token_ids, chunk);
                let err = rel_err(&ours, &reference.logits);
                let worst = worst_row_rel_err(&ours, &reference.logits, vocab);
                eprintln!(
                    "{name} {strategy} chunk {chunk}: relative error {err:.2e}, worst row {worst:.2e}"
                );
                if chunk == 1 && f32_path {
                    assert!(
                        worst <= TOLERANCE,
                        "{name} {strategy} chunk 1: row {worst:e}"
                    );
                }
            }
            let generated = greedy(
                &model,
                &reference.greedy_prompt,
                reference.greedy_continuation.len(),
            );
            eprintln!("{name} {strategy}: greedy {generated:?}");
            if f32_path {
                assert_eq!(
                    generated, reference.greedy_continuation,
                    "{name} {strategy}"
                );
            }
        }
    }
}

/// Each strategy is within TOLERANCE of transformers, so two of them within twice that.
#[test]
fn gpu_strategies_agree_and_gpu_agrees_with_cpu() {
    let Some(backend) = gpu(DType::F32) else {
        return;
    };
    for name in FIXTURES {
        let mut model = load_on(name, Arc::clone(&backend));
        let cpu = load(name);
        let reference = read_reference(&fixture_dir(name));
        let vocab = model.config().vocab_size;
        for chunk in [1, 7, reference.token_ids.len()] {
            let on_cpu = logits_chunked(&cpu, &reference.token_ids, chunk);
            model.set_moe_strategy(MoeStrategy::PerExpert);
            let baseline = logits_chunked(&model, &reference.token_ids, chunk);
            let err = worst_row_rel_err(&baseline, &on_cpu, vocab);
            eprintln!("{name} chunk {chunk}: GPU vs CPU worst row {err:.2e}");
            assert!(err <= TOLERANCE, "{name} chunk {chunk}: GPU vs CPU {err:e}");
            for strategy in &STRATEGIES[1..] {
                model.set_moe_strategy(*strategy);
                let other = logits_chunked(&model, &reference.token_ids, chunk);
                let err = worst_row_rel_err(&other, &baseline, vocab);
                eprintln!("{name} {strategy} vs per-expert chunk {chunk}: worst row {err:.2e}");
                assert!(
                    err <= 2.0 * TOLERANCE,
                    "{name} {strategy} vs per-expert, chunk {chunk}: {err:e}"
                );
            }
        }
    }
}

/// Verify-shaped steps after `prompt` on a fresh cache: each a run of `run_tokens` tokens
/// (the last row's greedy pick, then picks of the rows before it, as a drafter's guesses
/// would be) asking for every row's logits, all of them kept; each step's logits (as bits,
/// followed by every token's final hidden state where `all_hidden`, as an MTP drafter
/// reads them) and its counts. With runs of one token these are greedy decode steps (the
/// last row's logits asked for, as decoding asks).
fn verify_steps(
    model: &Model,
    prompt: &[u32],
    steps: usize,
    (run_tokens, all_hidden): (usize, bool),
) -> (Vec<Vec<u32>>, Vec<DispatchStats>) {
    let vocab = model.config().vocab_size;
    let (mut kv, mut state, table) = common::caches(model, prompt.len() + steps * run_tokens);
    let (mut out, mut stats, mut logits) = (Vec::new(), Vec::new(), Vec::new());
    let mut hidden = Vec::new();
    let (mut next, mut position) = (prompt.to_vec(), 0);
    for step in 0..=steps {
        let mut batch = RaggedBatch::new(common::BLOCK_SIZE);
        let ids: Vec<TokenId> = next.iter().map(|&t| TokenId(t)).collect();
        let wanted = if step == 0 || run_tokens == 1 {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        batch
            .push_run(SeqId(1), &ids, position, &table, wanted)
            .unwrap();
        batch.set_state_slot(SeqId(1), SlotId(0)).unwrap();
        let report = if all_hidden {
            let state = model.is_hybrid().then_some(&mut state);
            model.forward_with_all_hidden(&batch, &mut kv, state, &mut logits, &mut hidden)
        } else {
            model.forward_with_state(&batch, &mut kv, &mut state, &mut logits)
        }
        .unwrap();
        position += next.len();
        let rows: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        if step > 0 {
            let hidden = hidden.iter().filter(|_| all_hidden);
            out.push(logits.iter().chain(hidden).map(|v| v.to_bits()).collect());
            stats.push(report.stats);
        }
        let last = rows[rows.len() - 1];
        next = (0..run_tokens as u32)
            .map(|i| (last + i * 7) % vocab as u32)
            .collect();
    }
    (out, stats)
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Decode steps replayed from recorded graphs give the eager steps' logits bit for bit and
/// count the same kernels; only the replays differ. Hybrids too: the graphs carry the
/// recurrent-state updates of their slots.
#[test]
fn graph_replay_equals_eager_launches_bit_for_bit() {
    let Some(backend) = gpu(DType::BF16) else {
        return;
    };
    for name in [
        "qwen3_moe_fused",
        "qwen3_dense",
        "qwen3_5_moe_text",
        "qwen3_next",
    ] {
        for strategy in [MoeStrategy::PerToken, MoeStrategy::Grouped] {
            let mut model = load_on(name, Arc::clone(&backend));
            model.set_moe_strategy(strategy);
            let reference = read_reference(&fixture_dir(name));
            let (graphed, graphed_stats) =
                verify_steps(&model, &reference.greedy_prompt, 12, (1, false));
            model.set_graphs(false);
            let (eager, eager_stats) =
                verify_steps(&model, &reference.greedy_prompt, 12, (1, false));
            assert_eq!(graphed, eager, "{name} {strategy}: logits differ");
            // The first decode step records nothing (warm-up); every later one replays.
            assert_eq!(graphed_stats[0].graph_replays, 0);
            assert!(
                graphed_stats[2..].iter().all(|s| s.graph_replays == 1),
                "{name}"
            );
            assert!(eager_stats.iter().all(|s| s.graph_replays == 0));
            // The first step of the shape is its warm-up (it may allocate its workspace).
            for (g, e) in graphed_stats.iter().zip(&eager_stats).skip(1) {
                assert_eq!(
                    g.dispatches, e.dispatches,
                    "{name} {strategy}: kernels per step"
                );
                assert_eq!(g.host_syncs, 1);
                assert_eq!(g.allocations, 0, "{name} {strategy}: allocations per step");
            }
            eprintln!(
                "{name} {strategy}: {} kernels per decode step, replayed bit for bit",
                graphed_stats[2].dispatches
            );
            // Verify steps of speculative decoding (runs of 1 + 2 drafts, every row's
            // logits, and every token's hidden state as the MTP drafter reads them): graphed
            // by their shape too, bit for bit.
            for all_hidden in [false, true] {
                let shape = (3, all_hidden);
                model.set_graphs(true);
                let (graphed, graphed_stats) =
                    verify_steps(&model, &reference.greedy_prompt, 6, shape);
                model.set_graphs(false);
                let (eager, eager_stats) = verify_steps(&model, &reference.greedy_prompt, 6, shape);
                assert_eq!(
                    graphed, eager,
                    "{name} {strategy} {shape:?}: verify steps differ"
                );
                assert!(
                    graphed_stats[2..].iter().all(|s| s.graph_replays == 1),
                    "{name} {strategy} {shape:?}: verify steps replayed"
                );
                for (g, e) in graphed_stats.iter().zip(&eager_stats).skip(1) {
                    assert_eq!(
                        g.dispatches, e.dispatches,
                        "{name} {strategy} {shape:?}: verify kernels"
                    );
                    assert_eq!(g.allocations, 0, "{name} {strategy}: verify allocations");
                }
            }
        }
    }
}

/// Overlapped (programmatic dependent) launches give the logits of kernels launched
/// strictly one after another, bit for bit: no kernel reads a buffer its predecessor is
/// still writing. Prefill in chunks of 7 and graph-replayed decode steps, every strategy.
#[test]
fn overlapped_launches_equal_serial_launches_bit_for_bit() {
    if gpu(DType::BF16).is_none() {
        return;
    }
    let open = |serial_launches| -> Arc<dyn Backend> {
        Arc::new(
            CudaBackend::new(CudaOptions {
                serial_launches,
                ..Default::default()
            })
            .expect("open cuda:0"),
        )
    };
    let (overlapped, serial) = (open(false), open(true));
    for name in ["qwen3_moe_fused", "qwen3_5_moe_text"] {
        let reference = read_reference(&fixture_dir(name));
        for strategy in [MoeStrategy::PerToken, MoeStrategy::Grouped] {
            let mut results = Vec::new();
            for backend in [&overlapped, &serial] {
                let mut model = load_on(name, Arc::clone(backend));
                model.set_moe_strategy(strategy);
                let prefill: Vec<u32> = logits_chunked(&model, &reference.token_ids, 7)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let (decode, _) = verify_steps(&model, &reference.greedy_prompt, 6, (1, false));
                results.push((prefill, decode));
            }
            assert_eq!(results[0], results[1], "{name} {strategy}");
        }
    }
}

/// A prefill of more than 32 tokens takes its projections' input in bf16 straight from the
/// norms (`Backend::gemm_input_dtype`), which round it exactly as the conversion before each
/// cuBLAS GEMM did: the logits equal those of f32 inputs bit for bit, with fewer kernels (the
/// conversions gone), and the bf16 inputs' fallbacks (few-row experts, f32-only ops) give the
/// same too. Qwen3 MoE and dense, and a hybrid (Qwen3.5 dense).
#[test]
fn bf16_norm_outputs_equal_f32_projection_inputs_bit_for_bit() {
    if gpu(DType::BF16).is_none() {
        return;
    }
    let open = |f32_gemm_inputs| -> Arc<dyn Backend> {
        Arc::new(
            CudaBackend::new(CudaOptions {
                f32_gemm_inputs,
                ..Default::default()
            })
            .expect("open cuda:0"),
        )
    };
    let (bf16_inputs, f32_inputs) = (open(false), open(true));
    // The bf16 fixtures (the others' f32 and f16 weights keep f32 inputs).
    for name in ["qwen3_moe_fused", "qwen3_dense", "qwen3_5_dense"] {
        let reference = read_reference(&fixture_dir(name));
        assert!(
            reference.token_ids.len() > 32,
            "{name}: a prompt past 32 tokens"
        );
        let mut results = Vec::new();
        for backend in [&bf16_inputs, &f32_inputs] {
            let mut model = load_on(name, Arc::clone(backend));
            model.set_moe_strategy(MoeStrategy::Grouped);
            let _ = logits_chunked(&model, &reference.token_ids, reference.token_ids.len());
            let before = backend.stats();
            let logits: Vec<u32> =
                logits_chunked(&model, &reference.token_ids, reference.token_ids.len())
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
            results.push((logits, (backend.stats() - before).dispatches));
        }
        assert_eq!(results[0].0, results[1].0, "{name}: logits differ");
        assert!(
            results[0].1 < results[1].1,
            "{name}: {} kernels with bf16 inputs, {} with f32",
            results[0].1,
            results[1].1
        );
        eprintln!(
            "{name}: {} kernels with bf16 projection inputs, {} with f32, logits equal",
            results[0].1, results[1].1
        );
    }
}

/// The quantized GGUF fixtures (Q8_0, Q4_0) on the GPU: few rows (chunk 1, per-token
/// experts) quantize activations per 32 values as the CPU does and read the blocks on integer
/// units, so the GPU gives the CPU's logits; more rows decode the blocks to bf16 for the
/// tensor-core paths. Against transformers run on the decoded blocks, this tiny fixture
/// amplifies either rounding (the CPU's int8 activations: 2.0e-1, gguf.rs), so that bound is
/// against gross faults; the per-op tests (corral-device's conformance suite and
/// cuda_backend, against the CPU's integer products) bound each product tightly.
#[test]
fn gpu_quantized_gguf_logits_match_their_reference_and_the_cpu() {
    let Some(backend) = gpu(DType::F32) else {
        return;
    };
    let dir = fixture_dir("gguf");
    let mut failures = Vec::new();
    for ty in ["q8_0", "q4_0"] {
        let path = dir.join(format!("qwen3_moe_sharded.{ty}.gguf"));
        let mut on_gpu = Model::load_gguf(&path, Arc::clone(&backend), &mut |_, _| {}).unwrap();
        let on_cpu = Model::load_gguf(
            &path,
            Arc::new(corral_cpu::CpuBackend::new()),
            &mut |_, _| {},
        )
        .unwrap();
        let reference = common::read_reference_file(
            &dir.join(format!("qwen3_moe_sharded.{ty}.reference.safetensors")),
        );
        let tokens = &reference.token_ids;
        let vocab = on_gpu.config().vocab_size;
        for strategy in [MoeStrategy::PerToken, MoeStrategy::Grouped] {
            on_gpu.set_moe_strategy(strategy);
            for chunk in [1, 7, tokens.len()] {
                let ours = logits_chunked(&on_gpu, tokens, chunk);
                let err = rel_err(&ours, &reference.logits);
                let worst = worst_row_rel_err(&ours, &reference.logits, vocab);
                let cpu = rel_err(&ours, &logits_chunked(&on_cpu, tokens, chunk));
                let case = format!(
                    "{ty} {strategy} chunk {chunk}: relative error {err:.2e}, worst row {worst:.2e}; from the CPU {cpu:.2e}"
                );
                eprintln!("{case}");
                let integer_path = chunk == 1 && strategy == MoeStrategy::PerToken;
                if err > 3e-1 || cpu > 3e-1 || (integer_path && cpu > 1e-3) {
                    failures.push(case);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "out of bounds:\n{}",
        failures.join("\n")
    );
}

/// The hybrid GGUF fixtures (qwen35, qwen35moe, qwen3next from llama.cpp's converter and
/// quantizer) on the GPU, f32 KV cache: the median position's error against each file's
/// reference, a token at a time and in one prefill, at most llama.cpp's own CPU build's on
/// the same file, with precise experts (split activations in prefill's expert tiles). With
/// the default bf16 activations, BF16 files in one prefill are bounded at 1.07 times
/// llama.cpp's: qwen3next's 3.64e-3 against llama.cpp's CPU 3.42e-3 (qwen35 3.65e-3 against
/// 3.65e-3, qwen35moe 3.40e-3 against 3.48e-3; H100 and H200 alike). Q5_K_M's experts mix
/// Q5_K and Q5_1, which the GPU decodes: all three projections are then decoded.
#[test]
fn gpu_hybrid_gguf_files_match_their_references_as_closely_as_llama_cpp() {
    for precise_experts in [false, true] {
        let Some(backend) = gpu_with(CudaOptions {
            kv_dtype: Some(DType::F32),
            precise_experts,
            ..Default::default()
        }) else {
            return;
        };
        check_hybrid_gguf_files(backend, precise_experts);
    }
}

fn check_hybrid_gguf_files(backend: Arc<dyn Backend>, precise_experts: bool) {
    let dir = fixture_dir("gguf/hybrid");
    let mut failures = Vec::new();
    for (arch, formats) in common::LLAMA_CPP_HYBRID_ERRORS {
        for (format, llama_cpp) in formats {
            let path = dir.join(format!("{arch}.{format}.gguf"));
            let model = Model::load_gguf(&path, Arc::clone(&backend), &mut |_, _| {})
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let (ids, want) = common::read_logits_reference(
                &dir.join(format!("{arch}.{format}.reference.safetensors")),
            );
            let vocab = want.len() / ids.len();
            for chunk in [1, ids.len()] {
                let got = logits_chunked(&model, &ids, chunk);
                let whole = rel_err(&got, &want);
                let median = common::median_row_err(&got, &want, vocab);
                let case = format!(
                    "{arch} {format} chunk {chunk}{}: {whole:.4e} whole, {median:.4e} median position (llama.cpp's CPU {llama_cpp:.4e})",
                    if precise_experts {
                        " (precise experts)"
                    } else {
                        ""
                    }
                );
                eprintln!("{case}");
                let bound = if format == "bf16" && chunk > 1 && !precise_experts {
                    llama_cpp * 1.07
                } else {
                    llama_cpp * common::SAME_KERNELS
                };
                if median > bound {
                    failures.push(case);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "above llama.cpp:\n{}",
        failures.join("\n")
    );
}

/// An MTP head's drafting passes on the GPU: one row a pass on its own cache, each taking
/// the head's own last output (as a drafter chains drafts). Replayed from recorded graphs
/// (the hidden-state input uploaded into the workspace's buffer), they give the eager
/// passes' logits and outputs bit for bit, and the device's greedy picks equal the argmax
/// of those logits.
#[test]
fn mtp_head_passes_replay_from_graphs_bit_for_bit() {
    let Some(backend) = gpu(DType::BF16) else {
        return;
    };
    let name = "qwen3_5_moe_mtp";
    let passes = |graphs: bool| {
        let mut head = Model::load_mtp(&fixture_dir(name), Arc::clone(&backend), &mut |_, _| {})
            .expect("the fixture's MTP head");
        head.set_graphs(graphs);
        let h = head.config().hidden_size;
        let vocab = head.config().vocab_size;
        let (mut kv, _, table) = common::caches(&head, 64);
        let mut input: Vec<f32> = (0..h)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let (mut logits, mut out, mut picks) = (Vec::new(), Vec::new(), Vec::new());
        let mut sampled_out = Vec::new();
        let mut token = 5u32;
        let mut bits = Vec::new();
        let mut replays = Vec::new();
        for position in 0..10 {
            let mut batch = RaggedBatch::new(common::BLOCK_SIZE);
            batch
                .push_run(
                    SeqId(1),
                    &[TokenId(token)],
                    position,
                    &table,
                    LogitsWanted::Last,
                )
                .unwrap();
            let report = head
                .forward_mtp(&batch, &mut kv, &input, &mut logits, &mut out)
                .unwrap();
            replays.push(report.stats.graph_replays);
            // The same pass again, reduced on the device (it rewrites the same KV row).
            let mut step = corral_model::SampledStep::default();
            let greedy = corral_backend::sampling::Filter::GREEDY;
            step.rows.push((greedy, greedy.draw(0)));
            let _ = head
                .forward_mtp_sampled(&batch, &mut kv, &input, &mut step, &mut sampled_out)
                .unwrap();
            let pick = step.candidates[0].top[0].0;
            assert_eq!(pick, argmax(&logits[..vocab]), "pass {position}");
            assert_eq!(sampled_out, out, "pass {position}: the head's output");
            picks.push(pick);
            bits.extend(logits.iter().chain(&out).map(|v| v.to_bits()));
            token = pick;
            input.clone_from(&out);
        }
        (bits, picks, replays)
    };
    let (graphed, graphed_picks, replays) = passes(true);
    let (eager, eager_picks, eager_replays) = passes(false);
    assert_eq!(graphed_picks, eager_picks);
    assert!(graphed == eager, "graphed passes differ from eager ones");
    assert!(replays[2..].iter().all(|&r| r == 1), "replays {replays:?}");
    assert!(eager_replays.iter().all(|&r| r == 0));
}
