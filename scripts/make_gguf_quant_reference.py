#!/usr/bin/env python3
"""transformers' reference outputs for the quantized GGUF fixtures.

For each tests/fixtures/gguf/qwen3_moe_sharded.<type>.gguf (written by make_gguf_fixtures.py),
its weights are decoded by the `gguf` package (bit-identical to ggml's own decoder), written as
an fp32 Hugging Face checkpoint beside the fixture's config.json, and run through transformers'
pure-torch path in fp32 on the fixture's token ids: the logits and a greedy continuation go to
tests/fixtures/gguf/qwen3_moe_sharded.<type>.reference.safetensors. So the reference is exactly
the function the quantized file defines.

Run in the fixture venv (scripts/requirements-fixtures.txt, plus `pip install gguf`):
    python scripts/make_gguf_quant_reference.py
"""
import json
import pathlib
import shutil
import sys
import tempfile

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402  (its reference model loading and greedy run)

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/qwen3_moe_sharded"
GGUF_DIR = ROOT / "tests/fixtures/gguf"

PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
}
STACKED = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def decoded_state_dict(path):
    """The file's tensors decoded to fp32 under transformers' names."""
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape([int(d) for d in reversed(t.shape)])
        base = t.name.removesuffix(".weight")
        if base in TOP:
            state[TOP[base] + ".weight"] = torch.from_numpy(values.copy())
            continue
        _, layer, kind = base.split(".")
        prefix = f"model.layers.{layer}."
        if kind in STACKED:
            for e, expert in enumerate(values):
                state[f"{prefix}mlp.experts.{e}.{STACKED[kind]}.weight"] = torch.from_numpy(expert.copy())
        else:
            state[f"{prefix}{PER_LAYER[kind]}.weight"] = torch.from_numpy(values.copy())
    return state


def main():
    # Quantizing moves some routing decisions closer than the checkpoint fixtures allow
    # (1e-4): 1e-5 is still ten times what the f32 engine's router differs from transformers'.
    make_fixtures.MIN_ROUTER_GAP = 1e-5
    original = load_file(FIXTURE / "reference.safetensors")
    for path in sorted(GGUF_DIR.glob("qwen3_moe_sharded.q*.gguf")):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            config = json.loads((FIXTURE / "config.json").read_text())
            config["torch_dtype"] = "float32"
            (tmp / "config.json").write_text(json.dumps(config))
            shutil.copy(FIXTURE / "generation_config.json", tmp)
            save_file(decoded_state_dict(path), tmp / "model.safetensors")
            model = make_fixtures.load_reference_model(tmp)
            reference = make_fixtures.compute_reference(model, original["token_ids"])
        out = path.with_suffix(".reference.safetensors")
        save_file({k: v for k, v in reference.items() if not k.startswith("_")}, out)
        print(f"wrote {out}: greedy margin {float(reference['_margin']):.3f}, "
              f"router gap {float(reference['_router_gap']):.2e}")


if __name__ == "__main__":
    main()
