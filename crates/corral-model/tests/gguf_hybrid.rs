//! The hybrid architectures' GGUF files (`qwen35`, `qwen35moe`, `qwen3next`), as llama.cpp's
//! own converter and quantizer write them (scripts/make_gguf_hybrid_fixtures.py), compute the
//! function their tensors define: each file's logits against transformers' fp32 run on its
//! weights (mapped back through the converter's renames, permutations and value changes), in
//! one prefill and a token at a time through the recurrent state.

mod common;

use std::sync::Arc;

use common::{
    LLAMA_CPP_HYBRID_ERRORS, SAME_KERNELS, fixture_dir, logits_chunked, median_row_err,
    read_logits_reference, reference_f32s, reference_i64s, rel_err,
};
use corral_cpu::CpuBackend;
use corral_model::Model;
use corral_model::checkpoint::GgufCheckpoint;

/// Each file, each format, in one prefill and a token at a time: the median position's error
/// against its reference at most llama.cpp's own CPU build's on the same file
/// ([`LLAMA_CPP_HYBRID_ERRORS`]), or 1e-5 for BF16, which Corral computes in f32 on the stored values.
#[test]
fn hybrid_gguf_files_match_their_references_as_closely_as_llama_cpp() {
    let dir = fixture_dir("gguf/hybrid");
    let mut failures = Vec::new();
    for (arch, formats) in LLAMA_CPP_HYBRID_ERRORS {
        for (format, llama_cpp) in formats {
            let path = dir.join(format!("{arch}.{format}.gguf"));
            let model = Model::load_gguf(&path, Arc::new(CpuBackend::new()), &mut |_, _| {})
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let (ids, want) =
                read_logits_reference(&dir.join(format!("{arch}.{format}.reference.safetensors")));
            let vocab = want.len() / ids.len();
            let bound = if format == "bf16" {
                1e-5
            } else {
                llama_cpp * SAME_KERNELS
            };
            for chunk in [ids.len(), 1] {
                let got = logits_chunked(&model, &ids, chunk);
                let (whole, median) = (rel_err(&got, &want), median_row_err(&got, &want, vocab));
                eprintln!(
                    "{arch} {format} chunk {chunk}: {whole:.4e} whole, {median:.4e} median position (llama.cpp {llama_cpp:.4e})"
                );
                if median > bound {
                    failures.push(format!(
                        "{arch} {format} chunk {chunk}: median {median:.4e} > {bound:.4e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Files converted with their MTP head (the "-MTP-GGUF" conversions; Q4_K_M here): the trunk
/// runs as above, and every head tensor reads under its checkpoint name (`mtp.*`) as the file
/// holds it: the reference's values (every `step`-th, decoded by the `gguf` package and
/// mapped back through the converter's renames and value changes), to f32 rounding.
#[test]
fn mtp_heads_read_under_their_checkpoint_names() {
    let dir = fixture_dir("gguf/hybrid");
    for arch in ["qwen35", "qwen35moe", "qwen3next"] {
        let path = dir.join(format!("{arch}.mtp.q4_k_m.gguf"));
        let gguf = GgufCheckpoint::open(&path).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(gguf.mtp_layers(), 1, "{arch}");
        assert_eq!(gguf.config().expect("config").num_layers, 2, "{arch}");
        // The head is not loaded: its bytes are not counted.
        let stored: usize = gguf.tensors().map(|t| t.byte_len).sum();
        let head: usize = gguf
            .tensors()
            .filter(|t| t.name.starts_with("blk.2."))
            .map(|t| t.byte_len)
            .sum();
        assert!(head > 0, "{arch}: no head tensors");
        assert_eq!(gguf.loaded_bytes(&|_| true), stored - head, "{arch}");
        let bytes = std::fs::read(dir.join(format!("{arch}.mtp.q4_k_m.reference.safetensors")))
            .expect("reference");
        let reference = safetensors::SafeTensors::deserialize(&bytes).expect("reference header");
        let mut heads = Vec::new();
        for (name, _) in reference.tensors() {
            if !name.starts_with("mtp.") {
                continue;
            }
            let shape: Vec<usize> = reference_i64s(&reference, &format!("shape:{name}"))
                .into_iter()
                .map(|d| d as usize)
                .collect();
            let got = gguf
                .read_tensor_f32(&name, &shape)
                .unwrap_or_else(|e| panic!("{arch} {name}: {e}"));
            let step = (got.len() / 256).max(1);
            let want = reference_f32s(&reference, &name);
            assert_eq!(want.len(), got.len().div_ceil(step), "{arch} {name}");
            for (i, w) in want.into_iter().enumerate() {
                let g = got[i * step];
                assert!(
                    (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{arch} {name}[{}]: {g} read, {w} in the file",
                    i * step
                );
            }
            heads.push(name);
        }
        // The head's own four tensors and its layer's (11 for the dense layer, more with
        // experts).
        assert!(
            heads.len() >= 15 && heads.iter().any(|n| n == "mtp.fc.weight"),
            "{arch}: {heads:?}"
        );
    }
}
