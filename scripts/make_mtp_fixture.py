#!/usr/bin/env python3
"""The MTP conformance fixture, tests/fixtures/qwen3_5_moe_mtp: a tiny qwen3_5_moe_text
model with an MTP head stored as Qwen stores it (`mtp.*`: the two pre-fc norms, `fc`, one
full-attention decoder layer, the final norm; embedding and LM head shared), every parameter
perturbed, and the reference outputs of the demo model's trainer (scripts/train), whose
MtpHead is the definition Corral follows:

  token_ids   I64 [T]           seeded random ids
  logits      F32 [T, vocab]    the model's logits
  hidden      F32 [T, hidden]   the model's final hidden states, after its final norm
  mtp_logits  F32 [T-1, vocab]  row t: the MTP head on hidden[t] and the embedding of
                                token_ids[t+1] at position t+1, predicting token_ids[t+2]

Run from the repository root with the training pipeline's packages (torch, transformers):
    ../venv-train/bin/python scripts/make_mtp_fixture.py
"""

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "train"))

from make_fixtures import (  # noqa: E402
    A_INIT_RANGE, HYBRID_COMMON_CONFIG, HYBRID_LAYERS, HYBRID_MOE, MATRIX_NOISE, NORM_NOISE, QWEN3_5_ROPE,
)
from corral_train.model import DemoModel, mtp_state_from_export  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

NAME = "qwen3_5_moe_mtp"
SEED = 46
SEQ_LEN = 40


def build() -> DemoModel:
    config = Qwen3_5MoeTextConfig(
        **HYBRID_COMMON_CONFIG, vocab_size=256, hidden_size=64, **HYBRID_LAYERS, **HYBRID_MOE,
        **QWEN3_5_ROPE, tie_word_embeddings=True, bos_token_id=254, eos_token_id=255,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(SEED)
    model = DemoModel(config).float()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.copy_(torch.linspace(math.log(A_INIT_RANGE[0]), math.log(A_INIT_RANGE[1]),
                                                  module.A_log.numel()))
        for name, param in model.named_parameters():
            noise = NORM_NOISE if param.ndim == 1 else MATRIX_NOISE
            param.add_(torch.randn_like(param) * noise)
    return model.eval()


def save(model: DemoModel, path: Path) -> None:
    model.lm.config.dtype = "float32"
    model.lm.save_pretrained(path)
    mtp = {k: v.contiguous() for k, v in model.state_dict_for_export().items()}
    save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map.update({k: "model-mtp.safetensors" for k in mtp})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    config.pop("_experts_implementation", None)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def reference(model: DemoModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model.lm.model(input_ids=ids[None], use_cache=False)
    hidden = out.last_hidden_state
    logits = model.lm.lm_head(hidden)
    embeds = model.lm.model.embed_tokens(ids[None, 1:])
    positions = torch.arange(1, len(ids))[None]
    mtp_logits = model.lm.lm_head(model.mtp(hidden[:, :-1], embeds, positions))
    return {
        "token_ids": ids.to(torch.int64),
        "logits": logits[0].float().contiguous(),
        "hidden": hidden[0].float().contiguous(),
        "mtp_logits": mtp_logits[0].float().contiguous(),
    }


def main() -> None:
    path = REPO / "tests" / "fixtures" / NAME
    if path.exists():
        shutil.rmtree(path)
    model = build()
    save(model, path)
    ids = torch.randint(0, 254, (SEQ_LEN,), generator=torch.Generator().manual_seed(SEED))
    ref = reference(model, ids)
    # The saved files read back give the same outputs (the model is f32 throughout).
    again = DemoModel(model.lm.config).float().eval()
    again.lm = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    again.mtp.load_state_dict(mtp_state_from_export(load_file(str(path / "model-mtp.safetensors"))))
    assert torch.equal(reference(again, ids)["mtp_logits"], ref["mtp_logits"])
    save_file(ref, str(path / "reference.safetensors"))
    sizes = ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in sorted(path.iterdir()))
    print(f"== {NAME}: {sum(p.numel() for p in model.parameters()):,} parameters; {sizes}")
    print(f"   max |mtp logit| {ref['mtp_logits'].abs().max():.3f}, "
          f"MTP top-1 = model's next-next token at {(ref['mtp_logits'].argmax(-1)[:-1] == ref['logits'].argmax(-1)[1:-1]).float().mean():.2f}")


if __name__ == "__main__":
    main()
