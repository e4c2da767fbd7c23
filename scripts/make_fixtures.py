#!/usr/bin/env python3
"""Regenerate Corral's conformance fixtures and the tiny demo model.

Outputs (paths relative to --out-dir, which defaults to the current directory,
i.e. the repository root):

  tests/fixtures/qwen3_moe_fused/       qwen3_moe, fused experts, bf16, untied,
                                        norm_topk_prob=True, layer 1 dense
  tests/fixtures/qwen3_moe_per_expert/  qwen3_moe, per-expert tensors, f32, tied,
                                        norm_topk_prob=False, decoder_sparse_step=2
  tests/fixtures/qwen3_moe_sharded/     qwen3_moe, per-expert tensors, f16, several
                                        shards + index, config.json in Hub spelling
  tests/fixtures/qwen3_dense/           qwen3 (dense), bf16, untied
  tests/fixtures/qwen3_5_moe_hub/       qwen3_5_moe laid out like the Hub release: multimodal
                                        (tiny vision tower), model.language_model.* keys,
                                        fused experts, bf16, untied
  tests/fixtures/qwen3_5_moe_text/      qwen3_5_moe_text (text-only), per-expert tensors, f32,
                                        untied, dk == dv, the shared expert of the routed
                                        experts' size (Corral folds it into the routed ops)
  tests/fixtures/qwen3_5_dense/         qwen3_5_text (dense hybrid), bf16, tied
  tests/fixtures/qwen3_next/            qwen3_next, per-expert tensors, f16, untied,
                                        nv/nk = 3, dk != dv, norm_topk_prob=True
  models/tiny-qwen3-moe/                random qwen3_moe (fused, bf16) with a real
                                        byte-level BPE tokenizer and a ChatML template

The four hybrid (Gated DeltaNet) fixtures have 4 layers: 3 linear_attention + 1
full_attention (layers 0-2 and 3), partial RoPE (head_dim 32, rotary dim 8), conv kernel 4,
and an MoE with a shared expert (except qwen3_5_dense).

Each fixture directory is a checkpoint written by transformers' save_pretrained plus
reference.safetensors, holding (T, P = 40, 8 for the Qwen3 fixtures; 80, 3 for the hybrids:
80 crosses the 64-token chunk of the chunked delta-rule kernel, 3 is shorter than the conv
kernel):

  token_ids            I64 [T]          seeded random ids in [0, vocab_size) (the hub
                                        fixture: below its first vision special token)
  logits               F32 [T, vocab]   one forward pass over token_ids
  greedy_prompt        I64 [P]          token_ids[:P]
  greedy_continuation  I64 [16]         the 16 greedy tokens generated after the prompt

The reference model is always reloaded from the saved directory in float32 with eager
attention and eager experts, so reference logits reflect the stored (possibly bf16/f16)
weights. Every parameter, norm weights included, is perturbed after init. The script
asserts that the references are robust to rounding noise: every greedy step wins by a
clear margin (top-1 minus top-2 logit), and no MoE routing decision is a near-tie.
For the hybrids it also asserts that the pure-PyTorch Gated DeltaNet kernels ran, that an
incremental run (prefill of 70 tokens, then 10 single-token steps through the conv and
recurrent state) reproduces the one-shot logits, and, for the multimodal checkpoint, that
the text-only class (the reference) and the multimodal class give identical logits.
The `bf16_*` fixtures repeat four hybrid layouts at a trained model's weight scale, for the
GPU's bf16 tolerance tests: the others, built to make every fp32 error show, amplify bf16
rounding past any bf16 tolerance (transformers' own bf16 run misses it on them), so for these
the script asserts that bf16 operands and noise inside the kernels stay well inside the
tolerance and that a zeroed layer would not.
The demo model gets no reference; the script checks its tokenizer and chat template.

Usage, from the repository root, in a virtualenv with the pinned requirements (do NOT
install flash-linear-attention or causal_conv1d: they change the reference numerics):

    python3 -m venv ../venv-fixtures && . ../venv-fixtures/bin/activate
    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py [--out-dir DIR] [--only NAME,...]

Everything runs on CPU and is seeded; rerunning rewrites the same files.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import (
    AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers,
)
from transformers import (
    AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

EXPECTED_TRANSFORMERS = "5.24.0"

SEQ_LEN = 40
PROMPT_LEN = 8
NEW_TOKENS = 16
MIN_GREEDY_MARGIN = 1e-3  # top-1 minus top-2 logit, fp32, at every greedy step
NORM_NOISE = 0.1  # std of the noise added to RMSNorm weights (initialised to 1)
MATRIX_NOISE = 0.05  # std of the noise added to every matrix on top of its init
MIN_ROUTER_GAP = 1e-4  # k-th minus (k+1)-th router probability, fp32, every token and MoE layer

# Shared by all models: realistic RoPE base, no biases, eps as in Qwen3.
COMMON_CONFIG = dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096)

# Hybrid (Gated DeltaNet) fixtures.
HYBRID_SEQ_LEN = 80  # crosses the 64-token chunk of the chunked gated-delta-rule prefill
HYBRID_PROMPT_LEN = 3  # shorter than the conv kernel: the conv state starts zero-padded
INCREMENTAL_PREFILL = 70  # incremental check: prefill this many tokens, decode the rest one by one
MAX_INCREMENTAL_REL_DIFF = 1e-5  # max |incremental - one-shot| / max |one-shot|, fp32
A_INIT_RANGE = (0.01, 16.0)  # decay rates A = exp(A_log), spread log-evenly per layer (see build_model)
# RoPE parameters are passed explicitly per family (theta, partial factor, MRoPE for Qwen3.5).
# bf16 conformance fixtures (`bf16_*`): weights at a trained model's scale, so that rounding
# to bf16 is not amplified past the tolerance it is tested at (see check_bf16_robust).
BF16_INIT_RANGE = 0.02
BF16_MATRIX_NOISE = 0.01
BF16_ROUTER_SCALE = 10.0  # a trained router's decisive logits, so few routing choices are near-ties
BF16_LM_HEAD_SCALE = 4.0  # a trained head's spread of logits, so greedy steps win clearly
BF16_OPERANDS_MAX_REL = 5e-3  # projection, router and expert inputs in bf16 (and kernel noise), all positions
BF16_OPERANDS_MAX_ROW_REL = 1e-2  # the same, the worst position (a routing near-tie flipped shows here)
BF16_KERNEL_NOISE = 2.0**-8  # relative noise on what a bf16 engine rounds inside its kernels
BF16_NOISE_DRAWS = 3
BF16_MIN_GREEDY_MARGIN = 2e-2  # top-1 minus top-2 logit at every greedy step
BF16_MIN_ABLATION_REL = 5e-2  # zeroing any layer's token mixer or MLP moves the logits at least this much
HYBRID_COMMON_CONFIG = dict(rms_norm_eps=1e-6, max_position_embeddings=4096)
# One shape for the hybrid layers: 4 layers = 3 linear_attention + 1 full_attention,
# head_dim 32 with partial_rotary_factor 0.25 (rotary dim 8), conv kernel 4.
HYBRID_LAYERS = dict(
    num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=24,
    initializer_range=0.15,
)
HYBRID_MOE = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
)
# Qwen3.5 text RoPE as on the Hub, scaled down: mrope_section sums to rotary_dim / 2 = 4.
# Text-only input makes the three MRoPE streams equal, i.e. plain 1-D RoPE.
QWEN3_5_ROPE = dict(rope_parameters=dict(
    rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
    mrope_section=[2, 1, 1], mrope_interleaved=True,
))
# The tiny vision tower of the multimodal checkpoint (not used by the text reference).
TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
)


@dataclass
class FixtureSpec:
    name: str
    config_class: type
    config: dict
    seed: int
    save_dtype: torch.dtype
    fused_experts: bool = False  # save_original_format=False -> fused 3-D expert tensors
    max_shard_size: str | None = None
    hub_spelling: bool = False  # rewrite config.json the way official Qwen checkpoints spell it
    seq_len: int = SEQ_LEN
    prompt_len: int = PROMPT_LEN
    common_config: dict = field(default_factory=lambda: COMMON_CONFIG)
    # Multimodal (ImageTextToText) checkpoint: `config` becomes text_config, and these are
    # the other top-level config fields (vision_config, image/video token ids, ...).
    multimodal: dict | None = None
    hybrid: bool = False  # Gated DeltaNet model: kernel-path and incremental-decode checks
    matrix_noise: float = MATRIX_NOISE
    bf16_robust: bool = False  # asserts what check_bf16_robust checks


FIXTURES = [
    FixtureSpec(
        name="qwen3_moe_fused",
        config_class=Qwen3MoeConfig,
        config=dict(
            vocab_size=384, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[1],
            tie_word_embeddings=False, initializer_range=0.15,
            bos_token_id=382, eos_token_id=383,
        ),
        seed=7,
        save_dtype=torch.bfloat16,
        fused_experts=True,
    ),
    FixtureSpec(
        name="qwen3_moe_per_expert",
        config_class=Qwen3MoeConfig,
        config=dict(
            vocab_size=320, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
            decoder_sparse_step=2, mlp_only_layers=[],
            tie_word_embeddings=True, initializer_range=0.15,
            bos_token_id=318, eos_token_id=319,
        ),
        seed=10,
        save_dtype=torch.float32,
    ),
    FixtureSpec(
        name="qwen3_moe_sharded",
        config_class=Qwen3MoeConfig,
        config=dict(
            vocab_size=448, hidden_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False, initializer_range=0.15,
            bos_token_id=446, eos_token_id=447,
        ),
        seed=7,
        save_dtype=torch.float16,
        max_shard_size="300KB",
        hub_spelling=True,
    ),
    FixtureSpec(
        name="qwen3_dense",
        config_class=Qwen3Config,
        config=dict(
            vocab_size=512, hidden_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=128,
            tie_word_embeddings=False, initializer_range=0.15,
            bos_token_id=510, eos_token_id=511,
        ),
        seed=0,
        save_dtype=torch.bfloat16,
    ),
    FixtureSpec(
        name="qwen3_5_moe_hub",
        config_class=Qwen3_5MoeConfig,
        config=dict(
            # hidden 96 != 2 * moe_intermediate: no fused expert tensor is square.
            vocab_size=320, hidden_size=96, **HYBRID_LAYERS, **HYBRID_MOE, **QWEN3_5_ROPE,
            tie_word_embeddings=False, bos_token_id=318, eos_token_id=319,
        ),
        multimodal=dict(
            vision_config=dict(TINY_VISION, out_hidden_size=96),
            # Special tokens inside the vocabulary, in the Hub's order (vision start/end,
            # image, video); token_ids stay below them.
            vision_start_token_id=312, vision_end_token_id=313, image_token_id=315, video_token_id=316,
            tie_word_embeddings=False,
        ),
        seed=38,
        save_dtype=torch.bfloat16,
        fused_experts=True,
        seq_len=HYBRID_SEQ_LEN,
        prompt_len=HYBRID_PROMPT_LEN,
        common_config=HYBRID_COMMON_CONFIG,
        hybrid=True,
    ),
    FixtureSpec(
        name="qwen3_5_moe_text",
        config_class=Qwen3_5MoeTextConfig,
        config=dict(
            vocab_size=256, hidden_size=64, **dict(HYBRID_LAYERS, linear_value_head_dim=16),
            **dict(HYBRID_MOE, shared_expert_intermediate_size=32), **QWEN3_5_ROPE,
            tie_word_embeddings=False, bos_token_id=254, eos_token_id=255,
        ),
        seed=18,
        save_dtype=torch.float32,
        seq_len=HYBRID_SEQ_LEN,
        prompt_len=HYBRID_PROMPT_LEN,
        common_config=HYBRID_COMMON_CONFIG,
        hybrid=True,
    ),
    FixtureSpec(
        name="qwen3_5_dense",
        config_class=Qwen3_5TextConfig,
        config=dict(
            vocab_size=384, hidden_size=96, **HYBRID_LAYERS, intermediate_size=128, **QWEN3_5_ROPE,
            tie_word_embeddings=True, bos_token_id=382, eos_token_id=383,
        ),
        seed=1,
        save_dtype=torch.bfloat16,
        seq_len=HYBRID_SEQ_LEN,
        prompt_len=HYBRID_PROMPT_LEN,
        common_config=HYBRID_COMMON_CONFIG,
        hybrid=True,
    ),
    FixtureSpec(
        name="qwen3_next",
        config_class=Qwen3NextConfig,
        config=dict(
            vocab_size=320, hidden_size=64, **dict(HYBRID_LAYERS, linear_num_value_heads=6),
            **HYBRID_MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            intermediate_size=96,  # dense-fallback size, unused: every layer is MoE
            rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25),
            tie_word_embeddings=False, bos_token_id=318, eos_token_id=319,
        ),
        seed=28,
        save_dtype=torch.float16,
        seq_len=HYBRID_SEQ_LEN,
        prompt_len=HYBRID_PROMPT_LEN,
        common_config=HYBRID_COMMON_CONFIG,
        hybrid=True,
    ),
]




def bf16_variant(base: str, seed: int, **config) -> FixtureSpec:
    """The layout of fixture `base` at a trained model's weight scale, saved in bf16, for the
    bf16 tolerance tests of the GPU (the seed picked so that check_bf16_robust passes)."""
    spec = next(spec for spec in FIXTURES if spec.name == base)
    return dataclasses.replace(
        spec, name=f"bf16_{base}", config=dict(spec.config, initializer_range=BF16_INIT_RANGE, **config),
        seed=seed, save_dtype=torch.bfloat16, max_shard_size=None, matrix_noise=BF16_MATRIX_NOISE,
        bf16_robust=True,
    )


FIXTURES += [
    bf16_variant("qwen3_5_moe_hub", seed=115),
    bf16_variant("qwen3_5_moe_text", seed=14),
    # Untied: at this scale a tied head repeats the input token.
    bf16_variant("qwen3_5_dense", seed=7, tie_word_embeddings=False),
    bf16_variant("qwen3_next", seed=44),
]


# --------------------------------------------------------------------------------------
# Model construction, saving and reference computation
# --------------------------------------------------------------------------------------


def build_model(config_class: type, config: dict, seed: int, common_config: dict = COMMON_CONFIG,
                multimodal: dict | None = None, matrix_noise: float = MATRIX_NOISE) -> torch.nn.Module:
    """Random model from a config, with every parameter perturbed (norm weights too).

    Hybrids: Kind-B (1+w) norms start at 0 and get NORM_NOISE, so a missing `1+` shows;
    A_log, dt_bias and the gated norm are 1-D and get NORM_NOISE too; conv1d weights,
    like every other matrix, get MATRIX_NOISE. Before the noise, each layer's decay rates
    A = exp(A_log) are spread log-evenly over transformers' init range [0.01, 16] instead of
    drawn uniformly (which makes nearly all heads forget within a few tokens), so some heads
    carry state across the 64-token chunk boundary and through the decode steps.
    """
    if multimodal is None:
        cfg = config_class(**common_config, **config)
        auto_class = AutoModelForCausalLM
    else:
        cfg = config_class(text_config={**common_config, **config}, **multimodal)
        auto_class = AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = auto_class.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):  # Gated DeltaNet layer
                module.A_log.copy_(torch.linspace(math.log(A_INIT_RANGE[0]), math.log(A_INIT_RANGE[1]),
                                                  module.A_log.numel()))
        for param in model.parameters():  # tied parameters are yielded once
            noise = NORM_NOISE if param.ndim == 1 else matrix_noise
            param.add_(torch.randn_like(param) * noise)
    return model.eval()


@torch.no_grad()
def scale_router_and_head(model: torch.nn.Module, router_scale: float, lm_head_scale: float) -> None:
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter") or (name.endswith("mlp.gate") and isinstance(module, torch.nn.Linear)):
            module.weight.mul_(router_scale)
    model.lm_head.weight.mul_(lm_head_scale)


# model_type of config.json -> the model has experts (whose implementation must be pinned).
MOE_MODEL_TYPES = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}
ROUTER_CLASSES = (Qwen3MoeTopKRouter, Qwen3NextTopKRouter, Qwen3_5MoeTopKRouter)


def load_reference_model(path: Path, auto_class: type = AutoModelForCausalLM) -> torch.nn.Module:
    """fp32, eager attention and experts. AutoModelForCausalLM on a multimodal checkpoint
    gives the text-only class (model.language_model.* -> model.*, model.visual.* ignored)."""
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] in MOE_MODEL_TYPES:
        kwargs["experts_implementation"] = "eager"
    model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    for key in ("missing_keys", "mismatched_keys", "error_msgs"):
        assert not info[key], f"loading {path}: {key} {sorted(info[key])}"
    return model.eval()


@torch.no_grad()
def compute_reference(model: torch.nn.Module, token_ids: torch.Tensor,
                      prompt_len: int = PROMPT_LEN) -> dict[str, torch.Tensor]:
    """Full-sequence logits plus a greedy continuation; asserts both are numerically robust.

    Robust means: every greedy step wins by MIN_GREEDY_MARGIN, and no MoE routing decision
    (in either full forward pass) is closer than MIN_ROUTER_GAP, so a correct fp32
    implementation cannot flip a token or an expert choice through rounding noise.
    """
    router_gaps = []
    with record_router_gaps(model, router_gaps):
        logits = model(input_ids=token_ids[None]).logits[0].float()

    prompt = token_ids[:prompt_len]
    # No eos at all: no logits processor may touch the scores, and exactly NEW_TOKENS come out.
    model.generation_config.eos_token_id = None
    out = model.generate(
        input_ids=prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    continuation = out.sequences[0, prompt_len:]
    assert continuation.shape == (NEW_TOKENS,), continuation.shape

    step_logits = torch.stack(out.logits)[:, 0].float()  # [NEW_TOKENS, vocab]
    assert torch.equal(step_logits.argmax(-1), continuation)
    margin = min_top2_margin(step_logits)

    # The cached decode must agree with one forward pass over prompt + continuation.
    full = torch.cat([prompt, continuation])
    with record_router_gaps(model, router_gaps):
        full_logits = model(input_ids=full[None]).logits[0, prompt_len - 1 : -1].float()
    assert torch.equal(full_logits.argmax(-1), continuation), "cached decode != full forward"
    margin = min(margin, min_top2_margin(full_logits))
    assert margin >= MIN_GREEDY_MARGIN, f"greedy margin {margin:.2e} too small; change seed/scale"

    router_gap = min(router_gaps, default=float("inf"))
    assert router_gap >= MIN_ROUTER_GAP, f"router gap {router_gap:.2e} too small; change seed/scale"

    return {
        "token_ids": token_ids.clone(),
        "logits": logits.contiguous(),
        "greedy_prompt": prompt.clone(),
        "greedy_continuation": continuation.clone(),
        "_margin": torch.tensor(margin),
        "_router_gap": torch.tensor(router_gap),
    }


def min_top2_margin(logits: torch.Tensor) -> float:
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@contextmanager
def record_router_gaps(model: torch.nn.Module, gaps: list[float]):
    """Append, per router call, the smallest gap between the k-th and (k+1)-th expert."""

    def hook(router, _inputs, outputs):
        router_logits = outputs[0]
        probs = torch.softmax(router_logits.float(), dim=-1)
        top = probs.topk(router.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    routers = [m for m in model.modules() if isinstance(m, ROUTER_CLASSES)]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def rewrite_config_hub_spelling(path: Path) -> None:
    """Spell config.json like the official Qwen3-MoE checkpoints (transformers 4.x era)."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.pop("rope_parameters")
    assert rope["rope_type"] == "default", rope
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = None
    config["num_experts"] = config.pop("num_local_experts")
    config["torch_dtype"] = config.pop("dtype")
    config["max_window_layers"] = config["num_hidden_layers"]  # legacy field; ignored
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_fixture(spec: FixtureSpec, out_dir: Path) -> None:
    path = out_dir / "tests" / "fixtures" / spec.name
    if path.exists():
        shutil.rmtree(path)

    model = build_model(spec.config_class, spec.config, spec.seed, spec.common_config, spec.multimodal,
                        spec.matrix_noise)
    if spec.bf16_robust:
        scale_router_and_head(model, BF16_ROUTER_SCALE, BF16_LM_HEAD_SCALE)
    n_params = sum(p.numel() for p in model.parameters())
    model.to(spec.save_dtype)
    if spec.multimodal is not None:
        # save_pretrained records the model dtype at the top level only; without this the
        # sub-configs would keep the float32 they were built in.
        model.config.text_config.dtype = model.config.vision_config.dtype = spec.save_dtype
    save_kwargs = {}
    if spec.fused_experts:
        save_kwargs["save_original_format"] = False
    if spec.max_shard_size:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    model.save_pretrained(path, **save_kwargs)
    del model

    vocab_size = spec.config["vocab_size"]
    special_ids = multimodal_token_ids(spec)  # empty unless multimodal
    high = min([vocab_size, *special_ids])  # token_ids never hold an image/video/vision token
    token_ids = torch.randint(0, high, (spec.seq_len,), generator=torch.Generator().manual_seed(spec.seed))
    reference_model = load_reference_model(path)
    reference = compute_reference(reference_model, token_ids, spec.prompt_len)

    # `corral run --max-tokens 16` must produce all 16 tokens: no eos (nor, for the multimodal
    # checkpoint, a vision token) in the continuation.
    forbidden = {spec.config["eos_token_id"], *special_ids} & set(reference["greedy_continuation"].tolist())
    assert not forbidden, f"greedy continuation holds eos/vision token(s) {sorted(forbidden)}; change seed"

    if spec.hybrid:
        kernels = linear_attention_kernels(reference_model)
        incremental_diff = check_incremental(reference_model, token_ids, reference["logits"])
    if spec.bf16_robust:
        bf16_report = check_bf16_robust(reference_model, reference)
    if spec.multimodal is not None:
        assert type(reference_model).__name__.endswith("ForCausalLM"), type(reference_model)
        check_multimodal_class(path, reference)
    del reference_model

    if spec.hub_spelling:
        rewrite_config_hub_spelling(path)
        hub_reference = compute_reference(load_reference_model(path), token_ids)
        for key in reference:
            assert torch.equal(reference[key], hub_reference[key]), f"Hub-spelled config changes {key}"
        reference = hub_reference

    margin = float(reference.pop("_margin"))
    router_gap = float(reference.pop("_router_gap"))
    save_file(reference, path / "reference.safetensors")

    print(f"== {spec.name}: {n_params:,} parameters, saved as {spec.save_dtype}, "
          f"max |logit| {reference['logits'].abs().max():.3f}")
    print(f"   min greedy margin {margin:.4f}, min router gap {router_gap:.2e}")
    print(f"   greedy_prompt       {reference['greedy_prompt'].tolist()}")
    print(f"   greedy_continuation {reference['greedy_continuation'].tolist()}")
    if spec.hybrid:
        print("   linear-attention kernels (pure PyTorch):")
        for name, implementation in kernels.items():
            print(f"     {name:33} -> {implementation}")
        n_decode = spec.seq_len - INCREMENTAL_PREFILL
        print(f"   incremental (prefill {INCREMENTAL_PREFILL} + {n_decode} single-token steps) vs one-shot: "
              f"max rel diff {incremental_diff:.2e}")
    if spec.bf16_robust:
        print(f"   bf16: {bf16_report}")
    if spec.multimodal is not None:
        print("   multimodal class logits == text-only class logits (token_ids and prompt+continuation)")
    print_checkpoint_tensors(path)
    if spec.hybrid:
        sizes = ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(path.iterdir()))
        total = sum(p.stat().st_size for p in path.iterdir())
        print(f"   sizes: {sizes}; total {total:,} B")
        print("   config.json:")
        print("".join(f"     {line}\n" for line in (path / "config.json").read_text().splitlines()), end="")


def multimodal_token_ids(spec: FixtureSpec) -> list[int]:
    if spec.multimodal is None:
        return []
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return [spec.multimodal[key] for key in keys]


KERNEL_FUNCTIONS = (
    "causal_conv1d_fn", "causal_conv1d_update",
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
)


def linear_attention_kernels(model: torch.nn.Module) -> dict[str, str]:
    """The implementation behind each Gated DeltaNet helper; asserts it is transformers' own torch code.

    transformers picks, per helper, a hub kernel (only with use_kernels=True), else the
    causal_conv1d / fla package if importable, else its reference PyTorch function. The pick
    is held in the wrapper's closure as `implementation`.
    """
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert layers, "no Gated DeltaNet layer"
    module = sys.modules[type(layers[0]).__module__]
    kernels = {}
    for name in KERNEL_FUNCTIONS:
        implementation = inspect.getclosurevars(getattr(module, name)).nonlocals.get("implementation")
        assert implementation is not None, f"cannot tell which implementation {name} uses (kernels installed?)"
        assert implementation.__module__ == module.__name__, f"{name} runs {implementation.__module__}"
        kernels[name] = f"{implementation.__module__}.{implementation.__qualname__}"
    assert not model.use_kernels, "hub kernels are enabled"
    return kernels


@torch.no_grad()
def check_incremental(model: torch.nn.Module, token_ids: torch.Tensor, logits: torch.Tensor) -> float:
    """Prefill INCREMENTAL_PREFILL tokens, then feed the rest one at a time through the cache
    (conv state, fp32 recurrent state, KV cache); the logits must match the one-shot forward.
    Asserts that the single-token steps ran the per-step kernels (conv update, recurrence)."""
    out = model(input_ids=token_ids[None, :INCREMENTAL_PREFILL], use_cache=True)
    steps = [out.logits[0]]
    cache = out.cache
    with count_kernel_calls(model) as calls:
        for t in range(INCREMENTAL_PREFILL, len(token_ids)):
            out = model(input_ids=token_ids[None, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[0])
            cache = out.cache
    n_linear = sum(1 for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    n_steps = len(token_ids) - INCREMENTAL_PREFILL
    expected = dict.fromkeys(("causal_conv1d_update", "torch_recurrent_gated_delta_rule"), n_steps * n_linear)
    assert calls == expected, f"decode steps ran {calls}, expected {expected}"
    incremental = torch.cat(steps).float()
    assert incremental.shape == logits.shape, (incremental.shape, logits.shape)
    rel_diff = float((incremental - logits).abs().max() / logits.abs().max())
    assert rel_diff <= MAX_INCREMENTAL_REL_DIFF, f"incremental != one-shot: rel diff {rel_diff:.2e}"
    return rel_diff


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """||ours - reference|| / ||reference||, as the Rust tests measure it."""
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


@contextmanager
def bf16_operands(model: torch.nn.Module):
    """Round the input of every projection, router and expert block to bf16, weights and
    everything else as stored and in fp32: a bf16 engine's tensor-core operands with fp32
    accumulation."""
    def round_inputs(_module, args, kwargs):
        def round_one(x):
            return x.to(torch.bfloat16).to(x.dtype) if torch.is_tensor(x) and x.is_floating_point() else x
        return tuple(round_one(a) for a in args), {k: round_one(v) for k, v in kwargs.items()}

    handles = [module.register_forward_pre_hook(round_inputs, with_kwargs=True) for module in model.modules()
               if isinstance(module, torch.nn.Linear) or type(module).__name__.endswith(("Experts", "Router"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def bf16_kernel_noise(model: torch.nn.Module, seed: int):
    """Relative noise of up to BF16_KERNEL_NOISE on what a bf16 engine rounds inside its
    kernels beyond the projections' inputs: the delta rule's q, k, v and its output (its
    tensor-core operands), and attention's output (its probabilities in bf16)."""
    generator = torch.Generator().manual_seed(seed)

    def noisy(x):
        if not (torch.is_tensor(x) and x.is_floating_point()):
            return x
        return x * (1 + BF16_KERNEL_NOISE * (2 * torch.rand(x.shape, generator=generator, dtype=x.dtype) - 1))

    def wrap(fn):
        def delta_rule(query, key, value, *args, **kwargs):
            out, state = fn(noisy(query), noisy(key), noisy(value), *args, **kwargs)
            return noisy(out), state
        return delta_rule

    patched = []
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is not None:
        module = sys.modules[type(layer).__module__]
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            patched.append((module, name, getattr(module, name)))
            setattr(module, name, wrap(getattr(module, name)))
    handles = [module.o_proj.register_forward_pre_hook(lambda _m, args: tuple(noisy(a) for a in args))
               for module in model.modules()
               if type(module).__name__.endswith("Attention") and hasattr(module, "o_proj")]
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        for handle in handles:
            handle.remove()


@contextmanager
def zeroed_output(module: torch.nn.Module):
    def zero(_module, _args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    handle = module.register_forward_hook(zero)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def check_bf16_robust(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> str:
    """A fixture for bf16 tolerance must not amplify bf16 rounding past that tolerance, and
    must not be able to pass with a layer broken: asserts that transformers with bf16 operands
    (with and without noise inside the kernels, as bf16 kernels round) stays within
    BF16_OPERANDS_MAX_REL of its fp32 logits (BF16_OPERANDS_MAX_ROW_REL in every row), that
    the greedy tokens stay the same,
    and that zeroing any layer's token mixer or MLP moves the logits by BF16_MIN_ABLATION_REL."""
    token_ids, logits = reference["token_ids"], reference["logits"]
    prompt, continuation = reference["greedy_prompt"], reference["greedy_continuation"]
    with bf16_operands(model):
        rounded = model(input_ids=token_ids[None]).logits[0].float()
        operands_err = relative_error(rounded, logits)
        operands_row_err = max(relative_error(row, reference_row) for row, reference_row in zip(rounded, logits))
        generated = model.generate(
            input_ids=prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):]
    for seed in range(BF16_NOISE_DRAWS):
        with bf16_operands(model), bf16_kernel_noise(model, seed):
            noisy = model(input_ids=token_ids[None]).logits[0].float()
        operands_err = max(operands_err, relative_error(noisy, logits))
        operands_row_err = max(operands_row_err, *(relative_error(row, ref) for row, ref in zip(noisy, logits)))
    assert operands_err <= BF16_OPERANDS_MAX_REL, f"bf16 operands move the logits by {operands_err:.2e}"
    assert operands_row_err <= BF16_OPERANDS_MAX_ROW_REL, f"bf16 operands move a row by {operands_row_err:.2e}"
    margin = float(reference["_margin"])
    assert margin >= BF16_MIN_GREEDY_MARGIN, f"greedy margin {margin:.2e} too small for bf16; change seed"
    distinct = len(set(continuation.tolist()))
    assert distinct >= NEW_TOKENS // 2, f"greedy continuation of {distinct} distinct tokens; change seed"
    assert torch.equal(generated, continuation), "bf16 operands change the greedy continuation"

    ablations = []
    for layer in model.get_decoder().layers:
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        for part in (mixer, layer.mlp):
            with zeroed_output(part):
                ablations.append(relative_error(model(input_ids=token_ids[None]).logits[0].float(), logits))
    assert min(ablations) >= BF16_MIN_ABLATION_REL, f"a zeroed layer part moves the logits only {min(ablations):.2e}"

    whole = copy.deepcopy(model).to(torch.bfloat16)
    whole_err = relative_error(whole(input_ids=token_ids[None]).logits[0].float(), logits)
    return (f"bf16 operands and kernel noise {operands_err:.2e} relative, worst row {operands_row_err:.2e}, "
            f"same greedy tokens; "
            f"the whole model in bf16 "
            f"{whole_err:.2e}; a zeroed token mixer or MLP moves the logits {min(ablations):.2f}-{max(ablations):.2f}")


@contextmanager
def count_kernel_calls(model: torch.nn.Module):
    """Count calls of the Gated DeltaNet helpers (looked up as module globals at call time)."""
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    module = sys.modules[type(layer).__module__]
    calls: dict[str, int] = {}
    originals = {name: getattr(module, name) for name in KERNEL_FUNCTIONS}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(module, name, counting(name, fn))
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


@torch.no_grad()
def check_multimodal_class(path: Path, reference: dict[str, torch.Tensor]) -> None:
    """The multimodal class must give the reference's (text-only class's) logits exactly."""
    model = load_reference_model(path, AutoModelForImageTextToText)
    assert type(model).__name__.endswith("ForConditionalGeneration"), type(model)
    logits = model(input_ids=reference["token_ids"][None]).logits[0].float()
    assert torch.equal(logits, reference["logits"]), \
        f"multimodal != text-only: max diff {(logits - reference['logits']).abs().max():.2e}"
    prompt, continuation = reference["greedy_prompt"], reference["greedy_continuation"]
    full_logits = model(input_ids=torch.cat([prompt, continuation])[None]).logits[0, len(prompt) - 1 : -1]
    assert torch.equal(full_logits.argmax(-1), continuation), "multimodal greedy != text-only greedy"


def print_checkpoint_tensors(path: Path) -> None:
    """List the tensors of a checkpoint, collapsing layer, expert and vision-block indices.

    Each collapsed name shows the dtype and shape of its first layer and the layers {i} it
    occurs in; the script asserts that all occurrences agree in dtype and shape.
    """
    seen: dict[str, tuple] = {}
    layers: dict[str, set[int]] = {}
    for file in sorted(path.glob("model*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                generic = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)
                generic = re.sub(r"\.blocks\.\d+\.", ".blocks.{b}.", generic)
                layer = re.search(r"\.layers\.(\d+)\.", generic)
                generic = re.sub(r"\.layers\.\d+\.", ".layers.{i}.", generic)
                sl = f.get_slice(name)
                dtype_shape = (sl.get_dtype(), sl.get_shape())
                assert seen.setdefault(generic, dtype_shape) == dtype_shape, (name, dtype_shape, seen[generic])
                if layer:
                    layers.setdefault(generic, set()).add(int(layer.group(1)))
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    print(f"   files: {files}")
    for generic, (dtype, shape) in sorted(seen.items()):
        where = f"  {{i}} in {sorted(layers[generic])}" if generic in layers else ""
        print(f"   {dtype:5} {str(list(shape)):16} {generic}{where}")


# --------------------------------------------------------------------------------------
# Demo model with a real tokenizer
# --------------------------------------------------------------------------------------

DEMO_NAME = "tiny-qwen3-moe"
DEMO_SEED = 5
DEMO_BPE_VOCAB = 1536  # BPE vocabulary before special/added tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Qwen2/Qwen3 pre-tokenizer split pattern.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Modules whose docstrings form the tokenizer's training text. transformers is pinned,
# so the text (and hence the trained vocabulary) is reproducible.
CORPUS_MODULES = [
    "transformers.cache_utils",
    "transformers.configuration_utils",
    "transformers.generation.configuration_utils",
    "transformers.generation.logits_process",
    "transformers.generation.utils",
    "transformers.modeling_utils",
    "transformers.tokenization_utils_base",
]

# ChatML in the style of Qwen3's template, restricted to constructs that minijinja
# renders too (no Python string methods, no raise_exception).
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if message.content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def tokenizer_corpus() -> list[str]:
    """Docstrings of a fixed set of modules, in a fixed order."""
    texts = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        objects = [module]
        for _, obj in sorted(vars(module).items()):
            if getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isclass(obj):
                objects.append(obj)
                objects.extend(m for _, m in sorted(vars(obj).items()) if inspect.isfunction(m))
            elif inspect.isfunction(obj):
                objects.append(obj)
        texts.extend(inspect.cleandoc(obj.__doc__) for obj in objects if obj.__doc__)
    return texts


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE like Qwen2/Qwen3: NFC, regex split, ByteLevel bytes-to-unicode."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_BPE_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    # Special and added tokens go after the BPE vocabulary, as in Qwen3.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, path: Path) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def make_demo_model(out_dir: Path) -> None:
    path = out_dir / "models" / DEMO_NAME
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)

    tokenizer = train_tokenizer()
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    endoftext, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    config = dict(
        vocab_size=-(-n_tokens // 64) * 64,  # round up to a multiple of 64
        hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        intermediate_size=256, moe_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False, initializer_range=0.1,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
    )
    model = build_model(Qwen3MoeConfig, config, DEMO_SEED)
    n_params = sum(p.numel() for p in model.parameters())
    model.generation_config.bos_token_id = endoftext
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.generation_config.pad_token_id = endoftext
    model.to(torch.bfloat16).save_pretrained(path, save_original_format=False)
    write_tokenizer_files(tokenizer, path)

    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer_roundtrip(tokenizer, hf_tokenizer)
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    no_think = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", repr(prompt)
    assert no_think == prompt + "<think>\n\n</think>\n\n", repr(no_think)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=12)
    sample = hf_tokenizer.decode(out[0, ids.shape[1]:])

    print(f"== {DEMO_NAME}: {n_params:,} parameters, tokenizer {n_tokens} tokens "
          f"(vocab_size {config['vocab_size']}), <|endoftext|>={endoftext} <|im_end|>={im_end}")
    print(f"   chat prompt {prompt!r} -> ids {ids[0].tolist()}")
    print(f"   enable_thinking=False: {no_think!r}")
    print(f"   greedy sample: {sample!r}")
    print_checkpoint_tensors(path)


def check_tokenizer_roundtrip(raw: Tokenizer, hf_tokenizer) -> None:
    """transformers must tokenize exactly like the raw tokenizers object, and decode losslessly."""
    samples = [
        "Hello, world! Returns the   tensor's shape.\n\n  def f(x):\n\treturn x**2  # 1234567",
        "<|im_start|>user\nNFC café, naïve 日本語 🙂<|im_end|>\n<think>\n\n</think>\n\n",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|endoftext|>",
    ]
    for text in samples:
        ids = raw.encode(text).ids
        assert hf_tokenizer(text).input_ids == ids, text
        assert hf_tokenizer.decode(ids) == text, text


# --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("."),
                        help="root under which tests/fixtures/ and models/ are written (default: .)")
    parser.add_argument("--only", default="",
                        help="comma-separated fixture names: make only these (and not the demo model)")
    args = parser.parse_args()
    only = {name for name in args.only.split(",") if name}
    unknown = only - {spec.name for spec in FIXTURES}
    if unknown:
        raise SystemExit(f"unknown fixture(s): {', '.join(sorted(unknown))}")

    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        raise SystemExit(f"transformers {EXPECTED_TRANSFORMERS} required, found {transformers.__version__}")
    for package in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(package) is not None:
            raise SystemExit(f"uninstall {package}: it changes the reference numerics")

    transformers.logging.disable_progress_bar()
    torch.set_num_threads(1)  # reproducible CPU reductions
    for spec in FIXTURES:
        if not only or spec.name in only:
            make_fixture(spec, args.out_dir)
    if not only:
        make_demo_model(args.out_dir)


if __name__ == "__main__":
    main()
