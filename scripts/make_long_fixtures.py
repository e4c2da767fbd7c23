#!/usr/bin/env python3
"""Long-context conformance fixtures: transformers' logits at the end of long sequences.

Outputs (relative to --out-dir, default the repository root):

  tests/fixtures/long_qwen3_yarn/     qwen3 (dense), f32, 32,768 tokens, YaRN RoPE scaling
                                      (factor 4 over an original 8,192 positions: the sequence is
                                      four times the trained length); head_dim 32 puts the blend
                                      of extrapolated and interpolated frequencies at pairs 4..9
                                      of 16, so all three regimes are exercised
  tests/fixtures/long_qwen3_5/        qwen3_5_text (dense hybrid), f32, 8,192 tokens, partial
                                      RoPE (rotary dim 8 of 32) at long positions, 3 Gated
                                      DeltaNet layers and 1 attention layer

Each directory is a checkpoint written by save_pretrained plus reference.safetensors:

  token_ids    I64 [T]          seeded random ids
  tail_logits  F32 [32, vocab]  the logits of the last 32 positions of one forward pass

Dense models only: no routing decision can flip through rounding over so many tokens. Weights
are saved in f32 and the reference runs in f32 (attention: torch's sdpa at 32,768 tokens,
where eager's T x T matrix would not fit in memory; eager otherwise), every parameter
perturbed (make_fixtures.build_model). Run as make_fixtures.py says, in the same virtualenv:

    python scripts/make_long_fixtures.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3_5TextConfig, Qwen3Config

import make_fixtures as base

TAIL = 32

FIXTURES = [
    dict(
        name="long_qwen3_yarn",
        config_class=Qwen3Config,
        config=dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=96, tie_word_embeddings=False, initializer_range=0.15,
            bos_token_id=254, eos_token_id=255,
        ),
        common_config=dict(
            rms_norm_eps=1e-6, max_position_embeddings=32768,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                 original_max_position_embeddings=8192),
        ),
        seed=21,
        seq_len=32768,
        attention="sdpa",
    ),
    dict(
        name="long_qwen3_5",
        config_class=Qwen3_5TextConfig,
        config=dict(
            vocab_size=256, hidden_size=64, **base.HYBRID_LAYERS, intermediate_size=96,
            **base.QWEN3_5_ROPE, tie_word_embeddings=False, bos_token_id=254, eos_token_id=255,
        ),
        common_config=dict(rms_norm_eps=1e-6, max_position_embeddings=16384),
        seed=23,
        seq_len=8192,
        attention="eager",
    ),
]


@torch.no_grad()
def make(spec: dict, out_dir: Path) -> None:
    path = out_dir / "tests" / "fixtures" / spec["name"]
    if path.exists():
        shutil.rmtree(path)
    model = base.build_model(spec["config_class"], spec["config"], spec["seed"], spec["common_config"])
    model.save_pretrained(path)
    del model
    vocab = spec["config"]["vocab_size"]
    seq_len = spec["seq_len"]
    token_ids = torch.randint(0, vocab - 2, (seq_len,), generator=torch.Generator().manual_seed(spec["seed"]))
    reference = base.load_reference_model(path)
    reference.config._attn_implementation = spec["attention"]
    reference.set_attn_implementation(spec["attention"])
    rope = getattr(reference.model.rotary_emb, "attention_scaling", 1.0)
    logits = reference(input_ids=token_ids[None]).logits[0, -TAIL:].float().contiguous()
    save_file({"token_ids": token_ids.clone(), "tail_logits": logits}, path / "reference.safetensors")
    config = json.loads((path / "config.json").read_text())
    total = sum(p.stat().st_size for p in path.iterdir())
    print(f"== {spec['name']}: {seq_len} tokens, {spec['attention']} attention, rope {config.get('rope_parameters')}, "
          f"attention scaling {rope}, max |logit| {logits.abs().max():.3f}, {total:,} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    if transformers.__version__ != base.EXPECTED_TRANSFORMERS:
        raise SystemExit(f"transformers {base.EXPECTED_TRANSFORMERS} required, found {transformers.__version__}")
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)
    for spec in FIXTURES:
        make(spec, args.out_dir)


if __name__ == "__main__":
    main()
