#!/usr/bin/env python3
"""Writes tests/fixtures/gguf/quant_blocks.gguf and GGUF copies of two checkpoint fixtures.

quant_blocks.gguf: for each block format Corral decodes, a
tensor `<TYPE>` of 3 x 512 values in that format and `<TYPE>.ref`, the same values decoded to
f32 by the `gguf` package (whose decoders match ggml's bit for bit), plus metadata of every
value type for the header tests.

Run in a venv with `pip install gguf numpy`:
    python scripts/make_gguf_fixtures.py
Formats the package can quantize (Q4_0 .. Q8_0, BF16, F16) are quantized from random normal
values; for the k-quants, which it only decodes, the blocks are random bytes with their f16
scale fields set to finite values of a weight's size.

qwen3_moe_sharded.gguf, qwen3_dense.gguf: the safetensors fixtures of those names written as
llama.cpp's converter writes them (its tensor names, experts stacked per projection, its
metadata keys), the values unchanged, so that a model loaded from either gives the same logits.
"""
import json
import struct
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from gguf_vocab import add_vocab

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gguf/quant_blocks.gguf"
ROWS, COLS = 3, 512
rng = np.random.default_rng(2026)


def random_kquant(qtype, scale_offsets):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS * COLS // block, size), dtype=np.uint8)
    for off in scale_offsets:
        scales = (rng.uniform(1e-4, 2e-2, size=blocks.shape[0])).astype(np.float16)
        blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


writer = gguf.GGUFWriter(str(OUT), "corral-test")
writer.add_uint8("test.u8", 200)
writer.add_int8("test.i8", -100)
writer.add_uint16("test.u16", 60000)
writer.add_int16("test.i16", -30000)
writer.add_uint32("test.u32", 4_000_000_000)
writer.add_int32("test.i32", -2_000_000_000)
writer.add_uint64("test.u64", 2**63 + 5)
writer.add_int64("test.i64", -(2**62))
writer.add_float32("test.f32", 0.15625)
writer.add_float64("test.f64", -2.5e300)
writer.add_bool("test.bool", True)
writer.add_string("test.string", "héllo ✓")
writer.add_array("test.strings", ["a", "bc", ""])
writer.add_array("test.ints", [1, 2, 3])
writer.add_array("test.nested", [[1, 2], [3]])

values = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
for qtype in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]:
    raw = gguf.quants.quantize(values, qtype)
    writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.add_tensor(qtype.name + ".ref", gguf.quants.dequantize(raw, qtype).astype(np.float32))
# k-quants: the byte offsets of their f16 scales (d and dmin first for Q4_K/Q5_K, d last for Q6_K).
for qtype, offsets in [(T.Q4_K, [0, 2]), (T.Q5_K, [0, 2]), (T.Q6_K, [208])]:
    raw = random_kquant(qtype, offsets)
    writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.add_tensor(qtype.name + ".ref", gguf.quants.dequantize(raw, qtype).astype(np.float32))

writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")

FIXTURES = OUT.parent.parent
NP_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(directory):
    """Every tensor of a fixture directory's safetensors files, as numpy arrays (bf16 as raw
    u16, written back as BF16)."""
    tensors = {}
    for path in sorted(directory.glob("model*.safetensors")):
        data = path.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            raw = np.frombuffer(data[8 + n + lo:8 + n + hi], dtype=NP_TYPES[info["dtype"]])
            tensors[name] = (raw.reshape(info["shape"]), info["dtype"])
    return tensors


def add(writer, name, array, dtype, quant=None):
    """A tensor as stored, or with `quant` (a GGMLQuantizationType), matrices whose rows are
    whole blocks quantized to it (the router and the norms stay as stored, as llama-quantize
    leaves them)."""
    block = gguf.GGML_QUANT_SIZES[quant][0] if quant is not None else 0
    if quant is not None and array.ndim >= 2 and array.shape[-1] % block == 0 \
            and not name.endswith("ffn_gate_inp.weight"):
        values = array.astype(np.float32) if dtype != "BF16" else \
            (array.astype(np.uint32) << 16).view(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, quant), raw_dtype=quant)
        return
    if dtype == "BF16":
        raw = np.ascontiguousarray(array).view(np.uint8)
        writer.add_tensor(name, raw, raw_dtype=T.BF16)
    else:
        writer.add_tensor(name, np.ascontiguousarray(array))


def convert(name, arch, directory=None, vocab=False, split_max_tensors=0, quant=None,
            fuse_gate_up=False):
    directory = directory or FIXTURES / name
    config = json.loads((directory / "config.json").read_text())
    tensors = read_safetensors(directory)
    suffix = f".{quant.name.lower()}" if quant is not None else ".fused" if fuse_gate_up else ""
    out = OUT.parent / ("split" if split_max_tensors else "") / f"{name}{suffix}.gguf"
    out.parent.mkdir(exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    w.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    n_experts = config.get("num_experts") or config.get("num_local_experts")
    w.add_float32(f"{arch}.rope.freq_base", theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.expert_count", n_experts)
        w.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    w.add_uint32("tokenizer.ggml.bos_token_id", config["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    if vocab:
        add_vocab(w, directory, config["vocab_size"])
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
    }
    experts = {}
    for hf, (array, dtype) in tensors.items():
        if hf in names:
            add(w, names[hf], array, dtype, quant)
            continue
        layer, rest = hf.removeprefix("model.layers.").split(".", 1)
        if rest == "mlp.experts.gate_up_proj":
            # transformers' fused layout [E, 2I, H], gate rows first.
            half = array.shape[1] // 2
            add(w, f"blk.{layer}.ffn_gate_exps.weight", array[:, :half], dtype, quant)
            add(w, f"blk.{layer}.ffn_up_exps.weight", array[:, half:], dtype, quant)
        elif rest == "mlp.experts.down_proj":
            add(w, f"blk.{layer}.ffn_down_exps.weight", array, dtype, quant)
        elif rest.startswith("mlp.experts."):
            e, proj = rest.removeprefix("mlp.experts.").split(".", 1)
            experts.setdefault((int(layer), proj), {})[int(e)] = (array, dtype)
        else:
            add(w, f"blk.{layer}.{per_layer[rest]}.weight", array, dtype, quant)
    stacked = {"gate_proj.weight": "ffn_gate_exps", "up_proj.weight": "ffn_up_exps",
               "down_proj.weight": "ffn_down_exps"}
    stacks = {}
    for (layer, proj), by_expert in sorted(experts.items()):
        arrays = [by_expert[e][0] for e in sorted(by_expert)]
        stacks[(layer, proj)] = (np.stack(arrays), by_expert[0][1])
    for (layer, proj), (array, dtype) in stacks.items():
        if fuse_gate_up and proj in ("gate_proj.weight", "up_proj.weight"):
            if proj == "gate_proj.weight":
                # --fuse-gate-up-exps: gate and up in one tensor, gate rows first.
                up = stacks[(layer, "up_proj.weight")][0]
                add(w, f"blk.{layer}.ffn_gate_up_exps.weight",
                    np.concatenate([array, up], axis=1), dtype, quant)
            continue
        add(w, f"blk.{layer}.{stacked[proj]}.weight", array, dtype, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in sorted(out.parent.glob(out.stem + "*.gguf")):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


convert("qwen3_moe_sharded", "qwen3moe")
convert("qwen3_dense", "qwen3")
# The MoE model quantized (its references: scripts/make_gguf_quant_reference.py).
convert("qwen3_moe_sharded", "qwen3moe", quant=T.Q8_0)
convert("qwen3_moe_sharded", "qwen3moe", quant=T.Q4_0)
# Its experts' gate and up in one tensor, as the converter's --fuse-gate-up-exps writes them.
convert("qwen3_moe_sharded", "qwen3moe", fuse_gate_up=True)
# The same MoE model in two files, as llama-gguf-split writes them.
convert("qwen3_moe_sharded", "qwen3moe", split_max_tensors=20)
# The repository's small model with its vocabulary and chat template: a whole GGUF model.
convert("tiny-qwen3-moe", "qwen3moe", FIXTURES.parent.parent / "models/tiny-qwen3-moe", vocab=True)
