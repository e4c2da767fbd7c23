#!/usr/bin/env python3
"""Each GGUF format's error against the file's exact reference: Corral beside llama.cpp.

A tiny Qwen3-MoE with every width a multiple of 256 (so that llama-quantize writes k-quant
blocks for every matrix) is made with random weights at a trained model's scale, converted by
llama.cpp's own converter (convert_hf_to_gguf.py) to F32 and BF16, and quantized by its own
llama-quantize to Q8_0, Q6_K, Q5_K_M and Q4_K_M. For each file:
- the exact reference: the file's tensors decoded by the `gguf` package (ggml's decoders) to
  fp32 and run through transformers' pure-torch path in fp32 (scripts/make_fixtures.py's
  loader): the function the file defines;
- llama.cpp's CPU build: every position's logits (scripts/llama_logits.cpp), with its default
  f16 KV cache (asking it for an f32 one gave the same numbers to three digits);
- Corral on the CPU: `corral logits`, with an f32 KV cache and its default bf16 one.
The error is ||logits - reference|| / ||reference|| over all positions, and the median of the
positions' own (a router that picks another expert at one position moves the whole error;
the median shows what every position carries). Prints one markdown table and writes it, with the raw numbers, to WORK.

Usage (scripts/gguf_fidelity.sh sets it up): python gguf_fidelity.py WORK LLAMA_SRC LLAMA_BIN CORRAL
The converter's tokenizer check knows the pre-tokenizers of released models by a hash; the
demo model's small tokenizer (Qwen's regex, its own merges) is named `qwen2` to it here.
"""
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_fixtures  # noqa: E402  (its model builder and reference loader)
import make_gguf_quant_reference  # noqa: E402  (the qwen3moe GGUF decoder)

DEMO = ROOT / "models/tiny-qwen3-moe"
FORMATS = ["F32", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"]
TOKENS = 48
THREADS = "2"
SEED = 7

CONFIG = dict(
    vocab_size=1600, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False, initializer_range=make_fixtures.BF16_INIT_RANGE,
    bos_token_id=1536, eos_token_id=1538, pad_token_id=1536,
)

def checkpoint(work):
    """The model as a Hugging Face directory, with the demo model's tokenizer."""
    path = work / "hf"
    if path.exists():
        shutil.rmtree(path)
    model = make_fixtures.build_model(Qwen3MoeConfig, CONFIG, SEED,
                                      matrix_noise=make_fixtures.BF16_MATRIX_NOISE)
    model.save_pretrained(path)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(DEMO / name, path / name)
    return path


def convert(src, hf, work, outtype, *extra):
    """llama.cpp's converter, its pre-tokenizer check told the tokenizer is Qwen2's; `extra`
    arguments passed on."""
    out = work / f"model-{outtype}.gguf"
    code = (
        "import sys; sys.argv = sys.argv[1:]\n"
        f"sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]\n"
        "import conversion.base\n"
        "conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        "import convert_hf_to_gguf\n"
        "convert_hf_to_gguf.main()\n"
    )
    with open(work / f"convert-{outtype}.log", "w") as log:
        subprocess.run([sys.executable, "-c", code, "convert_hf_to_gguf.py", str(hf),
                        "--outtype", outtype.lower(), "--outfile", str(out), *extra], check=True,
                       stdout=log, stderr=log)
    return out


def quantize(bin_dir, f32, work, kind):
    out = work / f"model-{kind}.gguf"
    subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(out), kind], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def decoded_checkpoint(path, hf, work):
    """The file's tensors decoded to fp32 under transformers' names, beside the config."""
    state = make_gguf_quant_reference.decoded_state_dict(path)
    out = work / f"decoded-{path.stem}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    save_file(state, out / "model.safetensors")
    shutil.copy(hf / "config.json", out / "config.json")
    return out


def reference_logits(decoded, ids):
    model = make_fixtures.load_reference_model(decoded)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def llama_logits(tool, path, work, ids, kv):
    out = work / f"llama-{path.stem}-{kv}.f32"
    subprocess.run([str(tool), str(path), str(out), kv, THREADS, *map(str, ids)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return np.fromfile(out, dtype=np.float32).reshape(len(ids), -1).astype(np.float64)


def corral_logits(corral, path, work, ids, kv):
    out = work / f"corral-{path.stem}-{kv}.safetensors"
    subprocess.run([str(corral), "logits", "--model", str(path), "--device", "cpu",
                    "--threads", THREADS, "--kv-dtype", kv,
                    "--token-ids", ",".join(map(str, ids)), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return load_numpy(out)["logits"].astype(np.float64)


def errors(ours, reference):
    """Relative error over all positions, and the median of the positions' own."""
    whole = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    rows = np.linalg.norm(ours - reference, axis=1) / np.linalg.norm(reference, axis=1)
    return float(whole), float(np.median(rows))


HYBRIDS = ROOT / "tests/fixtures/gguf/hybrid"
# mtp.q4_k_m: the Q4_K_M file with an MTP head, whose trunk llama-quantize types differently.
HYBRID_FORMATS = ["bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "mtp.q4_k_m"]


def hybrid_table(work, tool, corral):
    """The hybrid fixtures (scripts/make_gguf_hybrid_fixtures.py): each file's error against its
    reference, llama.cpp's CPU build (f16 KV) beside Corral's CPU (f32 KV), median position."""
    from safetensors.numpy import load_file as load_reference
    lines = ["| file | " + " | ".join(HYBRID_FORMATS) + " |", "|---|" + "---|" * len(HYBRID_FORMATS)]
    raw = {}
    for arch in ["qwen35", "qwen35moe", "qwen3next"]:
        cells = []
        for kind in HYBRID_FORMATS:
            path = HYBRIDS / f"{arch}.{kind}.gguf"
            ref = load_reference(HYBRIDS / f"{arch}.{kind}.reference.safetensors")
            ids, reference = ref["token_ids"].tolist(), ref["logits"].astype(np.float64)
            llama = errors(llama_logits(tool, path, work, ids, "f16"), reference)[1]
            ours = errors(corral_logits(corral, path, work, ids, "f32"), reference)[1]
            raw[f"{arch}.{kind}"] = {"llama.cpp": llama, "corral": ours}
            cells.append(f"{llama:.4e} / {ours:.4e}")
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines), raw


def main():
    work, src, bin_dir, corral = (pathlib.Path(a).resolve() for a in sys.argv[1:5])
    if sys.argv[5:] == ["hybrid"]:
        table, raw = hybrid_table(work, work / "llama-logits", corral)
        print(table)
        (work / "fidelity-hybrid.md").write_text(table + "\n")
        (work / "fidelity-hybrid.json").write_text(json.dumps(raw, indent=2) + "\n")
        return
    work.mkdir(parents=True, exist_ok=True)
    tool = work / "llama-logits"
    ids = np.random.default_rng(SEED).integers(0, 1536, TOKENS).tolist()
    hf = checkpoint(work)
    f32 = convert(src, hf, work, "F32")
    files = {"F32": f32, "BF16": convert(src, hf, work, "BF16")}
    for kind in FORMATS[2:]:
        files[kind] = quantize(bin_dir, f32, work, kind)
    columns = [("llama.cpp (f16 KV, its default)", lambda p: llama_logits(tool, p, work, ids, "f16")),
               ("Corral, f32 KV", lambda p: corral_logits(corral, p, work, ids, "f32")),
               ("Corral, bf16 KV (its default)", lambda p: corral_logits(corral, p, work, ids, "bf16"))]
    raw = {}
    lines = ["| file | " + " | ".join(name for name, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for kind in FORMATS:
        path = files[kind]
        reference = reference_logits(decoded_checkpoint(path, hf, work), ids)
        cells = []
        for name, run in columns:
            whole, median = errors(run(path), reference)
            raw[f"{kind} / {name}"] = {"relative_error": whole, "median_position": median}
            cells.append(f"{whole:.2e} / {median:.2e}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print()
    print(table)
    (work / "fidelity.md").write_text(table + "\n")
    (work / "fidelity.json").write_text(json.dumps(raw, indent=2) + "\n")


if __name__ == "__main__":
    main()
