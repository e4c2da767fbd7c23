#!/usr/bin/env python3
"""Writes a synthetic Qwen3-MoE model of a bench config's shape as a bf16 GGUF file, the
tensor names, layouts and metadata keys as llama.cpp's converter writes them, with random
weights (normal, std 0.02; norms 1) and the tiny model's vocabulary (padded to the config's
size) and chat template, so that llama.cpp and Corral can run the same file.

Run in a venv with `pip install gguf numpy`:
    python scripts/make_bench_gguf.py bench/configs/qwen3-moe-64e-h512-v8k.json OUT.gguf
"""
import json
import pathlib
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from gguf_vocab import add_vocab

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "models/tiny-qwen3-moe"


def bf16(values):
    """f32 values rounded to bf16 (nearest even), as raw u16 bits."""
    bits = values.astype(np.float32).view(np.uint32)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype(np.uint16)


def add_qwen3moe_metadata(w, c):
    """The qwen3moe architecture's metadata keys of config `c`, as llama.cpp's converter
    writes them."""
    arch = "qwen3moe"
    w.add_uint32(f"{arch}.block_count", c["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", c["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", c["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", c["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", c["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", c["head_dim"])
    w.add_float32(f"{arch}.rope.freq_base", c["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(f"{arch}.expert_count", c["num_experts"])
    w.add_uint32(f"{arch}.expert_used_count", c["num_experts_per_tok"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", c["moe_intermediate_size"])


def main(config_path, out):
    c = json.loads(pathlib.Path(config_path).read_text())
    rng = np.random.default_rng(2026)
    arch = "qwen3moe"
    w = gguf.GGUFWriter(out, arch)
    add_qwen3moe_metadata(w, c)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # The tiny model's tokenizer, padded with unused tokens to the config's vocabulary.
    vocab = c["vocab_size"]
    add_vocab(w, TOKENIZER, vocab)
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    w.add_uint32("tokenizer.ggml.bos_token_id", special.get("<|endoftext|>", 0))
    w.add_uint32("tokenizer.ggml.eos_token_id", special.get("<|im_end|>", 0))

    h, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, e, fi = c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"], \
        c["moe_intermediate_size"]

    def matrix(name, *shape):
        values = bf16(rng.standard_normal(shape) * 0.02)
        w.add_tensor(name, values.view(np.uint8), raw_dtype=T.BF16)

    def ones(name, n):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    matrix("token_embd.weight", vocab, h)
    for layer in range(c["num_hidden_layers"]):
        p = f"blk.{layer}."
        ones(p + "attn_norm.weight", h)
        ones(p + "ffn_norm.weight", h)
        matrix(p + "attn_q.weight", nh * hd, h)
        matrix(p + "attn_k.weight", nkv * hd, h)
        matrix(p + "attn_v.weight", nkv * hd, h)
        matrix(p + "attn_output.weight", h, nh * hd)
        ones(p + "attn_q_norm.weight", hd)
        ones(p + "attn_k_norm.weight", hd)
        w.add_tensor(p + "ffn_gate_inp.weight",
                     (rng.standard_normal((e, h)) * 0.02).astype(np.float32))
        matrix(p + "ffn_gate_exps.weight", e, fi, h)
        matrix(p + "ffn_up_exps.weight", e, fi, h)
        matrix(p + "ffn_down_exps.weight", e, h, fi)
    ones("output_norm.weight", h)
    matrix("output.weight", vocab, h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out} ({pathlib.Path(out).stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
