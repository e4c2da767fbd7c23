//! Conformance of the Vulkan backend on the committed tiny checkpoints (on lavapipe in CI):
//! every Qwen3 / Qwen3-MoE fixture against transformers' fp32 logits at chunk 1, 7 and whole
//! under every MoE strategy, and every hybrid (Qwen3.5 MoE in both layouts, Qwen3.5 dense,
//! Qwen3-Next) at chunk 1, 7, 64 and whole under the grouped and per-token experts, within
//! 1e-4 with an f32 KV cache (its shaders compute in f32, as the CPU does); the Qwen3 ones
//! within bf16 tolerance with the default bf16 cache, near them with an fp8 cache; greedy
//! continuations identical to the CPU's; the portable f32 tiles all along, and where the
//! device has cooperative matrices, its f16 tiles near the references; quantized GGUF files (Q4_K_M, Q6_K, Q8_0, Q4_0) read as stored, within 1e-4 of
//! transformers on their decoded blocks. (Lavapipe takes about 2 s a hybrid forward: the
//! matrix is cut to what CI affords.) Without a Vulkan device each test says why it skipped
//! and passes, unless `CORRAL_REQUIRE_VULKAN=1` (as CI sets it), which fails it instead.

mod common;

use std::sync::Arc;

use common::{fixture_dir, greedy, load, load_on, read_reference};
use corral_backend::{Backend, DType};
use corral_model::{Model, MoeStrategy};
use corral_vulkan::{VulkanBackend, VulkanOptions};

const FIXTURES: &[&str] = common::QWEN3_FIXTURES;

/// The hybrid fixtures at the references' weight scale (the `bf16_*` ones test a GPU's bf16
/// operands, which this backend does not use).
const HYBRID_FIXTURES: &[&str] = &[
    "qwen3_5_moe_hub",
    "qwen3_5_moe_text",
    "qwen3_5_dense",
    "qwen3_next",
];

/// Chunkings of the hybrids: across the delta rule's 64-token chunk, and prefixes shorter
/// than the convolution's kernel.
const HYBRID_CHUNKS: &[usize] = &[1, 7, 64];

/// The Vulkan backend with a `kv_dtype` cache and its portable f32 tiles; `force_staging`
/// copies through staging buffers, as on a discrete GPU.
fn vulkan(kv_dtype: DType, force_staging: bool) -> Option<Arc<dyn Backend>> {
    vulkan_with(VulkanOptions {
        kv_dtype: Some(kv_dtype),
        force_staging,
        portable_tiles: true,
        ..Default::default()
    })
    .map(|b| Arc::new(b) as Arc<dyn Backend>)
}

/// The Vulkan backend opened with `options`, or why not (a failure where Vulkan is required).
fn vulkan_with(options: VulkanOptions) -> Option<VulkanBackend> {
    match VulkanBackend::new(options) {
        Ok(b) => Some(b),
        Err(why) if std::env::var("CORRAL_REQUIRE_VULKAN").is_ok_and(|v| v == "1") => {
            panic!("Vulkan is required here: {why}")
        }
        Err(why) => {
            eprintln!("skipped: no Vulkan device ({why})");
            None
        }
    }
}

/// [`common::check_fixture_logits`] on a Vulkan backend with a `kv_dtype` cache, copies
/// staged or not.
fn check_logits(
    cases: &[(&[&str], &[usize])],
    strategies: &[MoeStrategy],
    (kv_dtype, force_staging): (DType, bool),
    bounds: (f64, f64),
) {
    let Some(backend) = vulkan(kv_dtype, force_staging) else {
        return;
    };
    let label = format!("{kv_dtype} KV");
    common::check_fixture_logits(&backend, &label, cases, strategies, bounds);
}

#[test]
fn vulkan_logits_match_transformers_with_an_f32_kv_cache() {
    check_logits(
        &[(FIXTURES, &[1, 7])],
        &common::STRATEGIES,
        (DType::F32, false),
        (1e-4, 1e-4),
    );
    let strategies = [MoeStrategy::Grouped, MoeStrategy::PerToken];
    let hybrids: [(&[&str], &[usize]); 1] = [(HYBRID_FIXTURES, HYBRID_CHUNKS)];
    check_logits(&hybrids, &strategies, (DType::F32, false), (1e-4, 1e-4));
}

/// K and V rounded to bf16 in the cache: the bounds the CUDA backend's bf16 cache meets on
/// these fixtures, whose perturbed q/k norms make attention sharp (the CPU with bf16-rounded
/// K and V shows the same error). The two strategies a GPU runs, on the Qwen3 fixtures (the
/// hybrids' attention layers store and read the cache through the same shaders). Weights,
/// inputs and read-backs go through staging buffers here, as on a discrete GPU.
#[test]
fn vulkan_logits_match_transformers_with_the_bf16_kv_cache() {
    let strategies = [MoeStrategy::Grouped, MoeStrategy::PerToken];
    check_logits(
        &[(FIXTURES, &[1, 7])],
        &strategies,
        (DType::BF16, true),
        (2e-2, 1e-1),
    );
}

/// K and V in fp8 (e4m3, a scale per token and head), as the CUDA backend's fp8 cache
/// holds them: its bounds (gross faults only: these fixtures' sharp attention shows fp8's
/// rounding; the op suite holds the store and the attention to the references over the same
/// rounded values). The Qwen3 fixtures under the two strategies a GPU runs.
#[test]
fn vulkan_logits_stay_near_transformers_with_the_fp8_kv_cache() {
    let strategies = [MoeStrategy::Grouped, MoeStrategy::PerToken];
    check_logits(
        &[(FIXTURES, &[1, 7])],
        &strategies,
        (DType::F8E4M3, false),
        (2e-1, 8e-1),
    );
}

/// Where the device multiplies tiles on cooperative matrices (f16 operands, f32 sums), the
/// fixtures prefilled whole (their products of more than 8 rows in tiles), an f32 KV cache,
/// within about ten times what the Qwen3 fixtures show on lavapipe's 8 by 8 matrices (6.9e-4
/// to 1.0e-3 of the logits' norm, worst rows 1.3e-3 to 1.8e-3).
#[test]
fn vulkan_matrix_tiles_stay_near_transformers() {
    let Some(backend) = vulkan_with(VulkanOptions {
        kv_dtype: Some(DType::F32),
        ..Default::default()
    }) else {
        return;
    };
    let Some(side) = backend.matrix_tiles() else {
        eprintln!(
            "skipped: no cooperative matrices on {}",
            backend.info().name
        );
        return;
    };
    eprintln!("cooperative matrices of {side} by {side}");
    let backend: Arc<dyn Backend> = Arc::new(backend);
    let strategies = [MoeStrategy::Grouped];
    let cases: [(&[&str], &[usize]); 2] = [(FIXTURES, &[]), (HYBRID_FIXTURES, &[64])];
    common::check_fixture_logits(&backend, "f16 tiles", &cases, &strategies, (1e-2, 2e-2));
}

/// Sixteen greedy tokens after each fixture's prompt (the hybrids' too), prefilled whole then
/// decoded a token a step, are the CPU's.
#[test]
fn vulkan_greedy_tokens_are_the_cpus() {
    let Some(backend) = vulkan(DType::F32, false) else {
        return;
    };
    for name in FIXTURES.iter().chain(HYBRID_FIXTURES) {
        let reference = read_reference(&fixture_dir(name));
        let want = greedy(&load(name), &reference.token_ids, 16);
        let got = greedy(
            &load_on(name, Arc::clone(&backend)),
            &reference.token_ids,
            16,
        );
        assert_eq!(got, want, "{name}");
    }
}

/// Quantized GGUF files read as stored (every block format a Q4_K_M, Q6_K or Q8_0 file
/// holds, and Q4_0), decoded value by value in the shaders to f32: logits within 1e-4 of
/// transformers run on the decoded blocks, prefilled whole and a token at a time, for the
/// Qwen3-MoE files and every hybrid's (the CPU's integer products, which quantize
/// activations, are 1e-2 from these references, as llama.cpp's CPU build is: gguf.rs,
/// gguf_hybrid.rs).
#[test]
fn vulkan_reads_quantized_gguf_files_as_stored() {
    let Some(backend) = vulkan(DType::F32, false) else {
        return;
    };
    let qwen3 = ["q8_0", "q4_0"].map(|ty| {
        let name = format!("qwen3_moe_sharded.{ty}");
        let reference = fixture_dir("gguf").join(format!("{name}.reference.safetensors"));
        let reference = common::read_reference_file(&reference);
        (
            fixture_dir("gguf").join(format!("{name}.gguf")),
            reference.token_ids,
            reference.logits,
        )
    });
    let hybrids = common::LLAMA_CPP_HYBRID_ERRORS
        .iter()
        .flat_map(|(arch, _)| {
            ["q4_k_m", "q6_k", "q8_0"].map(|format| {
                let dir = fixture_dir("gguf/hybrid");
                let reference = dir.join(format!("{arch}.{format}.reference.safetensors"));
                let (ids, logits) = common::read_logits_reference(&reference);
                (dir.join(format!("{arch}.{format}.gguf")), ids, logits)
            })
        });
    let mut failures = Vec::new();
    for (path, ids, want) in qwen3.into_iter().chain(hybrids) {
        let model = Model::load_gguf(&path, Arc::clone(&backend), &mut |_, _| {})
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for chunk in [1, ids.len()] {
            let err = common::rel_err(&common::logits_chunked(&model, &ids, chunk), &want);
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let case = format!("{} chunk {chunk}: {err:.3e}", name.unwrap_or_default());
            eprintln!("{case}");
            if err > 1e-4 {
                failures.push(case);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
