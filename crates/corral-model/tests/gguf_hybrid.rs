//! The hybrid architectures' GGUF files (`qwen35`, `qwen35moe`, `qwen3next`), as llama.cpp's
//! own converter and quantizer write them (scripts/make_gguf_hybrid_fixtures.py), compute the
//! function their tensors define: each file's logits against transformers' fp32 run on its
//! weights (mapped back through the converter's renames, permutations and value changes), in
//! one prefill and a token at a time through the recurrent state.

mod common;

use std::sync::Arc;

use common::{
    LLAMA_CPP_HYBRID_ERRORS, SAME_KERNELS, fixture_dir, logits_chunked, median_row_err,
    read_logits_reference, rel_err,
};
use corral_backend::CpuBackend;
use corral_model::Model;

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
