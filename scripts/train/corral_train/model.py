"""Corral's demo model: a Qwen3.5-MoE text model (transformers' own classes, so the result is a
genuine checkpoint of that family) and its MTP head, stored as Qwen stores it (`mtp.*`) and
trained jointly: from the final hidden state at t and the embedding of token t+1 it predicts
token t+2 (model-spec.md §5.4)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm

#: The demo model's shape: about 11 M parameters (the MTP head included), 8 layers of which
#: every fourth is gated attention, 8 routed experts (2 a token) and a shared expert.
DEMO_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=96,
    shared_expert_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    router_aux_loss_coef=0.01,
    full_attention_interval=4,
)


def demo_config(vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides) -> Qwen3_5MoeTextConfig:
    """The demo model's config for a tokenizer of `vocab_size` tokens (overrides for tests)."""
    shape = dict(DEMO_SHAPE, **overrides)
    config = Qwen3_5MoeTextConfig(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **shape)
    config.mtp_num_hidden_layers = 1
    return config


class MtpHead(nn.Module):
    """Qwen's MTP head: `fc([norm_e(Emb[x_{t+1}]); norm_h(h_t)])`, one full-attention decoder
    layer at position t+1, then `norm`; the LM head is the model's."""

    def __init__(self, config: Qwen3_5MoeTextConfig):
        super().__init__()
        h = config.hidden_size
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        self.pre_fc_norm_embedding = qm.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = qm.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([qm.Qwen3_5MoeDecoderLayer(layer_config, 0)])
        self.norm = qm.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = qm.Qwen3_5MoeTextRotaryEmbedding(config=layer_config)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H]: the model's final (normed) hidden states at t; next_embeds: the
        embeddings of the tokens at t+1; position_ids [B, T]: t+1. Returns normed states."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # The rotary embedding takes the three (text) position rows of Qwen's multimodal RoPE.
        position_embeddings = self.rotary_emb(u, position_ids[None].expand(3, -1, -1))
        mask = create_causal_mask(
            config=self.layers[0].self_attn.config, inputs_embeds=u, attention_mask=None,
            past_key_values=None, position_ids=position_ids,
        )
        u = self.layers[0](u, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids)
        return self.norm(u)


class DemoModel(nn.Module):
    """The language model and its MTP head, trained together."""

    def __init__(self, config: Qwen3_5MoeTextConfig):
        super().__init__()
        self.lm = Qwen3_5MoeForCausalLM(config)
        self.mtp = MtpHead(config)
        self.mtp.apply(self.lm._init_weights)

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None, mtp_weight: float = 0.3):
        """Returns (total loss, LM loss, MTP loss, router aux loss): next-token loss over the
        positions `loss_mask` marks as targets (all when None), and the MTP head's loss on the
        token after next over the same targets."""
        out = self.lm.model(input_ids=input_ids, output_router_logits=True, use_cache=False)
        hidden = out.last_hidden_state
        logits = self.lm.lm_head(hidden).float()
        targets = input_ids[:, 1:]
        mask = torch.ones_like(targets, dtype=torch.bool) if loss_mask is None else loss_mask[:, 1:].bool()
        lm_loss = _masked_ce(logits[:, :-1], targets, mask)
        # MTP at t (0 .. T-3) sees h_t and x_{t+1}, predicts x_{t+2}.
        embeds = self.lm.model.embed_tokens(input_ids[:, 1:-1])
        positions = torch.arange(1, input_ids.shape[1] - 1, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
        mtp_hidden = self.mtp(hidden[:, :-2], embeds, positions)
        mtp_logits = self.lm.lm_head(mtp_hidden).float()
        mtp_loss = _masked_ce(mtp_logits, input_ids[:, 2:], mask[:, 1:])
        aux = qm.load_balancing_loss_func(
            out.router_logits, self.lm.config.num_experts, self.lm.config.num_experts_per_tok, None
        )
        total = lm_loss + mtp_weight * mtp_loss + self.lm.config.router_aux_loss_coef * aux
        return total, lm_loss.detach(), mtp_loss.detach(), aux.detach()

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """Qwen's tensor names: the model's as transformers saves them, the head's as `mtp.*`
        (experts per expert, as the model's own are saved)."""
        tensors = {f"mtp.{k}": v for k, v in self.mtp.state_dict().items() if "rotary_emb" not in k}
        return _experts_per_expert(tensors)


def mtp_state_from_export(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors as exported (experts per expert) as MtpHead's state dict (fused)."""
    state = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            prefix = ".".join(parts[: at + 1])
            fused.setdefault(prefix, {}).setdefault(int(parts[at + 1]), {})[parts[at + 2]] = t
        else:
            out[name] = t
    for prefix, experts in fused.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def _masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    mask = mask.reshape(-1).float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def _experts_per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] as
    `experts.N.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out
