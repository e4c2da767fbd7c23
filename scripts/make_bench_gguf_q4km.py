#!/usr/bin/env python3
"""Writes a synthetic model of a bench config's shape straight as a Q4_K_M GGUF file: random
quantized blocks, no float model and no llama-quantize, so that a full-size file (17-20 GB) is
made in a minute or two, with numpy alone, on the machine that benchmarks it.

Configs: Qwen3-MoE (model_type qwen3_moe, llama.cpp arch `qwen3moe`, as
scripts/make_bench_gguf.py writes it) and the Qwen3.5 MoE hybrid (model_type qwen3_5_moe,
arch `qwen35moe`, as llama.cpp's converter wrote tests/fixtures/gguf/hybrid/qwen35moe.*.gguf):
the tensor names, shapes and metadata keys those write, the tiny model's vocabulary padded to
the config's size (scripts/gguf_vocab.py), and the tensors in llama-quantize's order (the
non-layer tensors, then layer by layer, by name within a layer).

The tensor types are those of llama-quantize's Q4_K_M recipe (llama_tensor_get_type_impl in
the llama.cpp that llama-cpp-python 0.3.36 vendors) for a model whose expert count is not 8
and whose every matrix row is a multiple of 256 wide (checked):
  - output.weight: Q6_K; token_embd.weight and every other matrix: Q4_K;
  - attn_v.weight (and the hybrid's attn_qkv.weight, which llama.cpp counts with them; each
    layer has exactly one of the two, so the counter is the layer index), ffn_down_exps.weight
    and ffn_down_shexp.weight of layer i: Q6_K when use_more_bits(i, n_layer), i.e.
    i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2 (integer division), else Q4_K;
  - F32: the norms, ffn_gate_inp (the router), ssm_conv1d and every 1-D tensor (ssm_a,
    ssm_dt.bias, ssm_norm, ffn_gate_inp_shexp).

The blocks are random bytes, then fixed so that the weights have std about 0.02 and mean about
0, like scripts/make_bench_gguf.py's bf16 weights: Q4_K (d, dmin, 12 bytes of 6-bit scales and
mins, 128 bytes of nibbles; w = d*sc*q - dmin*m) keeps random scales, mins and nibbles, with d
about 7.7e-5 (+-25%, f16) and dmin = 7.5 d; Q6_K (128 + 64 bytes of 6-bit values, 16 int8
scales, d; w = d*sc*(q - 32)) has its scales shifted into -16..15 and d about 1.2e-4 (+-25%).
Norms are 1 (the converter stores the hybrid's zero-centred norms as 1 + w), the routers
(ffn_gate_inp, ffn_gate_inp_shexp) and ssm_conv1d normal with std 0.02, ssm_a = -exp(A_log)
in -16..-1, ssm_dt.bias 1.

Tensors are made and written one by one (GGUFWriter.add_tensor_info, then
write_tensor_data), so memory stays under twice the largest tensor (about 0.5 GB at full
size). Needs numpy and the `gguf` package (PyYAML is stubbed when absent: only gguf.metadata
imports it, and nothing here calls it):
    python scripts/make_bench_gguf_q4km.py bench/configs/qwen3-30b-a3b.json OUT.gguf [SEED]
"""
import json
import pathlib
import sys
import time
import types

import numpy as np

try:
    import yaml  # noqa: F401
except ImportError:
    sys.modules["yaml"] = types.ModuleType("yaml")
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from gguf_vocab import add_vocab  # noqa: E402
from make_bench_gguf import add_qwen3moe_metadata  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "models/tiny-qwen3-moe"
QK = 256
BLOCK = {T.Q4_K: 144, T.Q6_K: 210}
Q4K_D, Q6K_D = 7.74e-5, 1.17e-4


def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class Model:
    def __init__(self, c, seed):
        self.c = c
        self.rng = np.random.default_rng(seed)
        self.bitgen = np.random.PCG64(seed + 1)
        self.tensors = []  # (name, shape in numpy's order, type)
        jitter = np.linspace(0.75, 1.25, 256)
        self.q4k_d = (jitter * Q4K_D).astype(np.float16).view(np.uint16)
        self.q4k_dmin = (jitter * Q4K_D * 7.5).astype(np.float16).view(np.uint16)
        self.q6k_d = (jitter * Q6K_D).astype(np.float16).view(np.uint16)

    def random_bytes(self, n):
        raw = self.bitgen.random_raw((n + 7) // 8)
        return raw.view(np.uint8)[:n]

    def quant(self, name, shape, ty):
        assert shape[-1] % QK == 0, f"{name}: rows of {shape[-1]} are no multiple of {QK}"
        self.tensors.append((name, shape, ty))

    def f32(self, name, *shape):
        self.tensors.append((name, shape, T.F32))

    def data(self, name, shape, ty):
        """The tensor's bytes (quantized) or values (F32)."""
        n = int(np.prod(shape))
        if ty == T.F32:
            if name.endswith("ssm_a"):
                return -self.rng.uniform(1.0, 16.0, shape).astype(np.float32)
            if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
                              "ssm_conv1d.weight")):
                return (self.rng.standard_normal(shape) * 0.02).astype(np.float32)
            return np.ones(shape, dtype=np.float32)  # norms, dt bias
        blocks = n // QK
        raw = self.random_bytes(blocks * BLOCK[ty]).reshape(blocks, BLOCK[ty])
        if ty == T.Q4_K:
            halves = raw.view(np.uint16)  # [blocks, 72]: d, dmin, then scales and nibbles
            pick = raw[:, 0].copy()
            halves[:, 0] = self.q4k_d[pick]
            halves[:, 1] = self.q4k_dmin[pick]
        else:
            scales = raw[:, 192:208].view(np.int8)
            scales >>= 3
            halves = raw.view(np.uint16)  # [blocks, 105]; d is the last
            halves[:, 104] = self.q6k_d[raw[:, 0]]
        return raw.reshape(*shape[:-1], shape[-1] // QK * BLOCK[ty])


def qwen3moe(w, m, c):
    add_qwen3moe_metadata(w, c)
    h, hd, n = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    nh, nkv, e, fi = (c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"],
                      c["moe_intermediate_size"])
    for i in range(n):
        p, more = f"blk.{i}.", use_more_bits(i, n)
        layer = [
            (p + "attn_k.weight", (nkv * hd, h), False),
            (p + "attn_k_norm.weight", (hd,), None),
            (p + "attn_norm.weight", (h,), None),
            (p + "attn_output.weight", (h, nh * hd), False),
            (p + "attn_q.weight", (nh * hd, h), False),
            (p + "attn_q_norm.weight", (hd,), None),
            (p + "attn_v.weight", (nkv * hd, h), more),
            (p + "ffn_down_exps.weight", (e, h, fi), more),
            (p + "ffn_gate_exps.weight", (e, fi, h), False),
            (p + "ffn_gate_inp.weight", (e, h), None),
            (p + "ffn_norm.weight", (h,), None),
            (p + "ffn_up_exps.weight", (e, fi, h), False),
        ]
        yield from sorted(layer)


def qwen35moe(w, m, c):
    arch = "qwen35moe"
    n, interval = c["num_hidden_layers"], c["full_attention_interval"]
    rope = c["rope_parameters"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    w.add_uint32(f"{arch}.block_count", n)
    w.add_uint32(f"{arch}.context_length", c["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", c["hidden_size"])
    w.add_uint32(f"{arch}.attention.head_count", c["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["num_key_value_heads"])
    w.add_array(f"{arch}.rope.dimension_sections", list(rope["mrope_section"]) + [0])
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_uint32(f"{arch}.expert_count", c["num_experts"])
    w.add_uint32(f"{arch}.expert_used_count", c["num_experts_per_tok"])
    w.add_uint32(f"{arch}.attention.key_length", c["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", c["head_dim"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", c["moe_intermediate_size"])
    w.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                 c["shared_expert_intermediate_size"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", c["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", dk)
    w.add_uint32(f"{arch}.ssm.group_count", nk)
    w.add_uint32(f"{arch}.ssm.time_step_rank", nv)
    w.add_uint32(f"{arch}.ssm.inner_size", nv * dv)
    w.add_array(f"{arch}.attention.recurrent_layers",
                [(i + 1) % interval != 0 for i in range(n)])
    w.add_uint32(f"{arch}.full_attention_interval", interval)
    w.add_uint32(f"{arch}.rope.dimension_count",
                 int(c["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
    h, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, e, fi, si = (c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"],
                          c["moe_intermediate_size"], c["shared_expert_intermediate_size"])
    conv = 2 * nk * dk + nv * dv
    for i in range(n):
        p, more = f"blk.{i}.", use_more_bits(i, n)
        if (i + 1) % interval != 0:  # Gated DeltaNet
            mixer = [
                (p + "attn_gate.weight", (nv * dv, h), False),
                (p + "attn_norm.weight", (h,), None),
                (p + "attn_qkv.weight", (conv, h), more),
            ]
            ssm = [
                (p + "ssm_a", (nv,), None),
                (p + "ssm_alpha.weight", (nv, h), False),
                (p + "ssm_beta.weight", (nv, h), False),
                (p + "ssm_conv1d.weight", (conv, c["linear_conv_kernel_dim"]), None),
                (p + "ssm_dt.bias", (nv,), None),
                (p + "ssm_norm.weight", (dv,), None),
                (p + "ssm_out.weight", (h, nv * dv), False),
            ]
        else:  # full attention, its query projection with the output gate
            mixer = [
                (p + "attn_k.weight", (nkv * hd, h), False),
                (p + "attn_k_norm.weight", (hd,), None),
                (p + "attn_norm.weight", (h,), None),
                (p + "attn_output.weight", (h, nh * hd), False),
                (p + "attn_q.weight", (2 * nh * hd, h), False),
                (p + "attn_q_norm.weight", (hd,), None),
                (p + "attn_v.weight", (nkv * hd, h), more),
            ]
            ssm = []
        ffn = [
            (p + "ffn_down_exps.weight", (e, h, fi), more),
            (p + "ffn_down_shexp.weight", (h, si), more),
            (p + "ffn_gate_exps.weight", (e, fi, h), False),
            (p + "ffn_gate_inp.weight", (e, h), None),
            (p + "ffn_gate_inp_shexp.weight", (h,), None),
            (p + "ffn_gate_shexp.weight", (si, h), False),
            (p + "ffn_up_exps.weight", (e, fi, h), False),
            (p + "ffn_up_shexp.weight", (si, h), False),
            (p + "post_attention_norm.weight", (h,), None),
        ]
        yield from sorted(mixer + ffn + ssm)


def main(config_path, out, seed=2026):
    c = json.loads(pathlib.Path(config_path).read_text())
    model_type = c["model_type"]
    c = c.get("text_config", c)
    arch, layers = {"qwen3_moe": ("qwen3moe", qwen3moe),
                    "qwen3_5_moe": ("qwen35moe", qwen35moe)}[model_type]
    if c["num_experts"] == 8:
        sys.exit("llama.cpp's Q4_K_M recipe differs for 8 experts (attn_v, attn_k Q8_0)")
    m = Model(c, seed)
    w = gguf.GGUFWriter(out, arch)
    vocab, h = c["vocab_size"], c["hidden_size"]
    per_layer = list(layers(w, m, c))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(w, TOKENIZER, vocab)
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    w.add_uint32("tokenizer.ggml.bos_token_id", special.get("<|endoftext|>", 0))
    w.add_uint32("tokenizer.ggml.eos_token_id", special.get("<|im_end|>", 0))
    w.add_uint32("tokenizer.ggml.padding_token_id", special.get("<|endoftext|>", 0))
    w.add_bool("tokenizer.ggml.add_bos_token", False)

    m.quant("output.weight", (vocab, h), T.Q6_K)
    m.f32("output_norm.weight", h)
    m.quant("token_embd.weight", (vocab, h), T.Q4_K)
    for name, shape, q6 in per_layer:
        if q6 is None:
            m.f32(name, *shape)
        else:
            m.quant(name, shape, T.Q6_K if q6 else T.Q4_K)
    for name, shape, ty in m.tensors:
        if ty == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            byte_shape = (*shape[:-1], shape[-1] // QK * BLOCK[ty])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = time.time()
    for name, shape, ty in m.tensors:
        w.write_tensor_data(m.data(name, shape, ty))
    w.close()
    size = pathlib.Path(out).stat().st_size
    took = time.time() - start
    print(f"wrote {out}: {len(m.tensors)} tensors, {size} bytes; the tensors in {took:.1f} s "
          f"({size / took / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]))
