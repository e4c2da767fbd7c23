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
  models/tiny-qwen3-moe/                random qwen3_moe (fused, bf16) with a real
                                        byte-level BPE tokenizer and a ChatML template

Each fixture directory is a checkpoint written by transformers' save_pretrained plus
reference.safetensors, holding:

  token_ids            I64 [40]         seeded random ids in [0, vocab_size)
  logits               F32 [40, vocab]  one forward pass over token_ids
  greedy_prompt        I64 [8]          token_ids[:8]
  greedy_continuation  I64 [16]         the 16 greedy tokens generated after the prompt

The reference model is always reloaded from the saved directory in float32 with eager
attention and eager experts, so reference logits reflect the stored (possibly bf16/f16)
weights. Every parameter, norm weights included, is perturbed after init. The script
asserts that the references are robust to rounding noise: every greedy step wins by a
clear margin (top-1 minus top-2 logit), and no MoE routing decision is a near-tie.
The demo model gets no reference; the script checks its tokenizer and chat template.

Usage, from the repository root, in a virtualenv with the pinned requirements (do NOT
install flash-linear-attention or causal_conv1d: they change the reference numerics):

    python3 -m venv ../venv-fixtures && . ../venv-fixtures/bin/activate
    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_fixtures.py [--out-dir DIR]

Everything runs on CPU and is seeded; rerunning rewrites the same files.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import (
    AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

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
]


# --------------------------------------------------------------------------------------
# Model construction, saving and reference computation
# --------------------------------------------------------------------------------------


def build_model(config_class: type, config: dict, seed: int) -> torch.nn.Module:
    """Random model from a config, with every parameter perturbed (norm weights too)."""
    cfg = config_class(**COMMON_CONFIG, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # tied parameters are yielded once
            noise = NORM_NOISE if param.ndim == 1 else MATRIX_NOISE
            param.add_(torch.randn_like(param) * noise)
    return model.eval()


def load_reference_model(path: Path) -> torch.nn.Module:
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "qwen3_moe":
        kwargs["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


@torch.no_grad()
def compute_reference(model: torch.nn.Module, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full-sequence logits plus a greedy continuation; asserts both are numerically robust.

    Robust means: every greedy step wins by MIN_GREEDY_MARGIN, and no MoE routing decision
    (in either full forward pass) is closer than MIN_ROUTER_GAP, so a correct fp32
    implementation cannot flip a token or an expert choice through rounding noise.
    """
    router_gaps = []
    with record_router_gaps(model, router_gaps):
        logits = model(input_ids=token_ids[None]).logits[0].float()

    prompt = token_ids[:PROMPT_LEN]
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
    continuation = out.sequences[0, PROMPT_LEN:]
    assert continuation.shape == (NEW_TOKENS,), continuation.shape

    step_logits = torch.stack(out.logits)[:, 0].float()  # [NEW_TOKENS, vocab]
    assert torch.equal(step_logits.argmax(-1), continuation)
    margin = min_top2_margin(step_logits)

    # The cached decode must agree with one forward pass over prompt + continuation.
    full = torch.cat([prompt, continuation])
    with record_router_gaps(model, router_gaps):
        full_logits = model(input_ids=full[None]).logits[0, PROMPT_LEN - 1 : -1].float()
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

    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
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

    model = build_model(spec.config_class, spec.config, spec.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model.to(spec.save_dtype)
    save_kwargs = {}
    if spec.fused_experts:
        save_kwargs["save_original_format"] = False
    if spec.max_shard_size:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    model.save_pretrained(path, **save_kwargs)
    del model

    vocab_size = spec.config["vocab_size"]
    token_ids = torch.randint(0, vocab_size, (SEQ_LEN,), generator=torch.Generator().manual_seed(spec.seed))
    reference = compute_reference(load_reference_model(path), token_ids)

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
    print_checkpoint_tensors(path)


def print_checkpoint_tensors(path: Path) -> None:
    """List the tensors of a checkpoint, collapsing layer and expert indices."""
    seen: dict[str, tuple] = {}
    for file in sorted(path.glob("model*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                generic = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)
                generic = re.sub(r"\.layers\.\d+\.", ".layers.{i}.", generic)
                if generic not in seen:
                    sl = f.get_slice(name)
                    seen[generic] = (sl.get_dtype(), sl.get_shape())
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    print(f"   files: {files}")
    for generic, (dtype, shape) in sorted(seen.items()):
        print(f"   {dtype:5} {str(list(shape)):16} {generic}")


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
    args = parser.parse_args()

    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        raise SystemExit(f"transformers {EXPECTED_TRANSFORMERS} required, found {transformers.__version__}")
    for package in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(package) is not None:
            raise SystemExit(f"uninstall {package}: it changes the reference numerics")

    transformers.logging.disable_progress_bar()
    torch.set_num_threads(1)  # reproducible CPU reductions
    for spec in FIXTURES:
        make_fixture(spec, args.out_dir)
    make_demo_model(args.out_dir)


if __name__ == "__main__":
    main()
