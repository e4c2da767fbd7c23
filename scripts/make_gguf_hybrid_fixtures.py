#!/usr/bin/env python3
"""GGUF fixtures of the hybrid families, written by llama.cpp's own converter and quantizer,
each with its exact reference.

For each of qwen35 (Qwen3.5/3.6 dense), qwen35moe and qwen3next, a tiny random checkpoint
(hidden size 256, so that llama-quantize writes k-quant blocks; see LAYERS) is converted by convert_hf_to_gguf.py to BF16 and F32, and the F32 file quantized by
llama-quantize to Q8_0, Q6_K, Q5_K_M and Q4_K_M, into tests/fixtures/gguf/hybrid/ARCH.FORMAT.gguf.

The reference of each file is transformers' fp32 run on the weights the file holds. The
converter permutes and transforms tensors (V heads re-ordered for Qwen3.5, Qwen3-Next's qkvz
regrouped, norms stored as 1 + w, A_log as -exp(A_log)); rather than restating those rules
here, they are read off the converter itself: a copy of the checkpoint whose every value is
its own global index is converted to F32 too, and each GGUF element's value then names the
checkpoint element it came from. A file's tensors, decoded by the `gguf` package, go back to
their checkpoint places through that map (less the 1 + w and -exp value changes), and the
reference is that checkpoint's logits and greedy continuation:
ARCH.FORMAT.reference.safetensors (`logits` [T, vocab], `token_ids`).

With an MTP head (the "-MTP-GGUF" conversions): the same checkpoint plus an `mtp.*` head (one
layer, the full attention layer's shapes, random values) is converted with the head and
quantized to Q4_K_M, ARCH.mtp.q4_k_m.gguf; its reference holds the trunk's logits as above and
the head's tensors as the file holds them (decoded, mapped back the same way): every
HEAD_STEP(n)-th value of each, flattened, under its checkpoint name, its shape under
`shape:NAME`.

Usage: python make_gguf_hybrid_fixtures.py LLAMA_SRC LLAMA_BIN  (in the fixture venv, plus gguf;
scripts/gguf_fidelity.sh builds llama.cpp).
"""
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_fixtures  # noqa: E402
from gguf_fidelity import convert, quantize  # noqa: E402

OUT = ROOT / "tests/fixtures/gguf/hybrid"
# The checkpoints have no MTP head (transformers makes none); the converter asks to be told.
NO_MTP = ("--no-mtp",)
QUANTS = ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"]
TOKENS = 40

# Small, with k-quant blocks where most rows allow them: every matrix whose rows are the hidden
# size (256: the projections into attention, the DeltaNet and the experts, the embedding and
# the head) is written in the file's k-quant; those whose rows are narrower (attention's and
# the DeltaNet's output, the experts' down projections) fall back to a block format, as
# llama-quantize does in real files for widths that are no multiple of 256. So the fifteen
# files stay under 10 MB. One linear and one full attention layer; two key heads of four
# value heads (so the value heads' re-ordering shows); two experts, both chosen (a router tie
# at one position would flip that token's whole output and drown the comparison).
VOCAB = 288
LAYERS = dict(
    num_hidden_layers=2, full_attention_interval=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    linear_conv_kernel_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=32,
    initializer_range=make_fixtures.BF16_INIT_RANGE,
    vocab_size=VOCAB, hidden_size=256, tie_word_embeddings=False,
)
MOE = dict(num_experts=2, num_experts_per_tok=2, moe_intermediate_size=64,
           shared_expert_intermediate_size=32)
ROPE35 = dict(rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                   mrope_section=[11, 11, 10], mrope_interleaved=True))

SPECS = {
    "qwen35": (Qwen3_5TextConfig, dict(LAYERS, intermediate_size=64, **ROPE35), 3),
    "qwen35moe": (Qwen3_5MoeTextConfig, dict(LAYERS, **MOE, **ROPE35), 4),
    "qwen3next": (Qwen3NextConfig, dict(
        LAYERS, **MOE, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        intermediate_size=64,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.25)), 5),
}
# GGUF tensors the converter stores as 1 + w (zero-centred norms); A_log is stored as
# -exp(A_log).
PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight",
            "attn_q_norm.weight", "attn_k_norm.weight", "nextn.enorm.weight",
            "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
# The MTP head's file: one quantization, whose k-quant blocks cover its tensors too.
MTP_QUANT = "Q4_K_M"
# The layer the MTP head's layer copies its shapes from (full attention).
FULL_ATTENTION_LAYER = 1


def head_step(n):
    """The stride of the values of an n-value head tensor the reference keeps (about 256)."""
    return max(1, n // 256)


def tokenizer():
    """Byte-level BPE of the byte alphabet and a few merges (llama.cpp refuses a vocabulary
    without merges), with Qwen's special tokens."""
    make_fixtures.DEMO_BPE_VOCAB = 264
    return make_fixtures.train_tokenizer()


def save_checkpoint(model, tok, path):
    model.save_pretrained(path)
    make_fixtures.write_tokenizer_files(tok, path)


def index_copy(hf, path):
    """`hf` with every value its global index (A_log its index within the tensor)."""
    shutil.copytree(hf, path)
    tensors = load_file(hf / "model.safetensors")
    names, base, indexed = sorted(tensors), 0, {}
    for name in names:
        n = tensors[name].numel()
        if name.endswith("A_log"):
            values = torch.arange(n, dtype=torch.float64)
        else:
            values = torch.arange(base, base + n, dtype=torch.float64)
            base += n
        assert base < 2**24, "indices must stay exact in f32"
        indexed[name] = values.to(torch.float32).reshape(tensors[name].shape)
    save_file(indexed, path / "model.safetensors", metadata={"format": "pt"})
    return names, tensors


def gguf_tensors(path):
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
            for t in gguf.GGUFReader(str(path)).tensors}


def untransform(name, values):
    if name.endswith(PLUS_ONE):
        return values - 1.0
    if name.endswith("ssm_a"):
        return np.log(-values)
    return values


def source_map(index_gguf, names, shapes):
    """For each checkpoint tensor, where each element is in the GGUF file: a tensor name and
    an element index per element."""
    starts, base = [], 0
    for name in names:
        if not name.endswith("A_log"):
            starts.append((base, name))
            base += shapes[name].numel()
    firsts = np.array([b for b, _ in starts])
    where = {name: (np.full(shapes[name].numel(), "", dtype=object),
                    np.full(shapes[name].numel(), -1, dtype=np.int64)) for name in names}
    for gname, values in gguf_tensors(index_gguf).items():
        idx = np.rint(untransform(gname, values)).astype(np.int64)
        elements = np.arange(len(idx))
        if gname.endswith("ssm_a"):
            layer = gname.split(".")[1]
            owner = next(n for n in names if n.endswith(f"layers.{layer}.linear_attn.A_log"))
            where[owner][0][idx] = gname
            where[owner][1][idx] = elements
            continue
        owners = np.searchsorted(firsts, idx, side="right") - 1
        for k in np.unique(owners):
            start, owner = starts[k]
            mask = owners == k
            where[owner][0][idx[mask] - start] = gname
            where[owner][1][idx[mask] - start] = elements[mask]
    for name, (gnames, elements) in where.items():
        missing = int((elements < 0).sum())
        assert missing == 0, f"{name}: {missing} elements not in the file"
    return where


def reference(hf, where, file, out, ids):
    """The trunk's logits on the weights `file` holds; with an MTP head, its tensors too."""
    values = gguf_tensors(file)
    shapes = load_file(hf / "model.safetensors")
    state = {}
    for name, (gnames, elements) in where.items():
        flat = np.zeros(len(elements))
        for g in np.unique(gnames):
            mask = gnames == g
            flat[mask] = untransform(g, values[g][elements[mask]])
        state[name] = torch.from_numpy(flat.astype(np.float32)).reshape(shapes[name].shape)
    head = {n: t for n, t in state.items() if n.startswith("mtp.")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        shutil.copy(hf / "config.json", tmp / "config.json")
        trunk = {n: t for n, t in state.items() if n not in head}
        save_file(trunk, tmp / "model.safetensors", metadata={"format": "pt"})
        model = make_fixtures.load_reference_model(tmp)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    kept = {}
    for name, t in head.items():
        kept[name] = t.reshape(-1)[::head_step(t.numel())].contiguous()
        kept[f"shape:{name}"] = torch.tensor(list(t.shape), dtype=torch.int64)
    save_file({"logits": logits.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.int64),
               **kept}, out)


def with_mtp_head(hf, path, seed):
    """`hf` plus an MTP head as Qwen3.5's checkpoints carry it: `mtp.fc` [H, 2H], three
    zero-centred norms and one decoder layer (the full attention layer's tensors, perturbed)."""
    shutil.copytree(hf, path)
    tensors = load_file(hf / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noise = lambda t: t + 0.02 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    prefix = f"model.layers.{FULL_ATTENTION_LAYER}."
    hidden = tensors["model.norm.weight"].numel()
    head = {f"mtp.layers.0.{n[len(prefix):]}": noise(t) for n, t in tensors.items()
            if n.startswith(prefix)}
    head["mtp.fc.weight"] = 0.02 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]:
        head[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)
    save_file({**tensors, **head}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def main():
    src, bin_dir = (pathlib.Path(a).resolve() for a in sys.argv[1:3])
    OUT.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(5).integers(0, 256, TOKENS).tolist()
    tok = tokenizer()
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    specials = dict(bos_token_id=tok.token_to_id("<|endoftext|>"),
                    eos_token_id=tok.token_to_id("<|im_end|>"))
    for arch, (config_class, config, seed) in SPECS.items():
        config = dict(config, **specials)
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(tmp)
            hf = work / "hf"
            print(f"{arch}: converter logs in {work} until it is done", flush=True)
            model = make_fixtures.build_model(config_class, config, seed,
                                              common_config=make_fixtures.HYBRID_COMMON_CONFIG,
                                              matrix_noise=make_fixtures.BF16_MATRIX_NOISE)
            save_checkpoint(model, tok, hf)
            names, tensors = index_copy(hf, work / "index")
            shapes = {n: t for n, t in tensors.items()}
            try:
                where = source_map(convert(src, work / "index", work, "F32", *NO_MTP), names, shapes)
            except subprocess.CalledProcessError:
                sys.exit((work / "convert-F32.log").read_text()[-3000:])
            f32 = convert(src, hf, work, "F32", *NO_MTP)
            files = {"BF16": convert(src, hf, work, "BF16", *NO_MTP)}
            for kind in QUANTS:
                files[kind] = quantize(bin_dir, f32, work, kind)
            for kind, path in files.items():
                stem = f"{arch}.{kind.lower()}"
                shutil.copy(path, OUT / f"{stem}.gguf")
                reference(hf, where, path, OUT / f"{stem}.reference.safetensors", ids)
                print(f"{stem}: {path.stat().st_size} bytes", flush=True)
            mtp = with_mtp_head(hf, work / "hf-mtp", seed)
            names, tensors = index_copy(mtp, work / "index-mtp")
            where = source_map(convert(src, work / "index-mtp", work, "F32"), names, tensors)
            path = quantize(bin_dir, convert(src, mtp, work, "F32"), work, MTP_QUANT)
            stem = f"{arch}.mtp.{MTP_QUANT.lower()}"
            shutil.copy(path, OUT / f"{stem}.gguf")
            reference(mtp, where, path, OUT / f"{stem}.reference.safetensors", ids)
            print(f"{stem}: {path.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
