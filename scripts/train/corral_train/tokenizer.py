"""A byte-level BPE tokenizer trained on the corpus, shaped as Qwen's: the same
pre-tokenizer split, NFC normalization, byte-level decoding, and Qwen's added tokens after
the learned vocabulary, so chat templates and tool-call parsers see the strings they expect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

#: Qwen's pre-tokenizer split (contractions, letter runs, single digits, punctuation runs,
#: newlines, spaces).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen3.5's added tokens in its order: (text, special). Special tokens are control tokens a
#: decoder drops; the others (thinking and tool-call tags) stay in decoded text.
QWEN_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]


def new_tokenizer() -> Tokenizer:
    """An untrained tokenizer with Qwen's normalizer, pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Learns `vocab_size` tokens (all 256 bytes included) from `texts`, then appends Qwen's
    added tokens after them."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 bytes plus merges a tokenizer needs")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in QWEN_ADDED_TOKENS
                    if not special])
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, special in QWEN_ADDED_TOKENS
                            if special])
    # The order above puts the special ones last; renumber so ids follow QWEN_ADDED_TOKENS.
    return _renumber_added(tok)


def _renumber_added(tok: Tokenizer) -> Tokenizer:
    data = json.loads(tok.to_str())
    base = len(data["model"]["vocab"])
    by_text = {a["content"]: a for a in data["added_tokens"]}
    data["added_tokens"] = []
    for k, (text, special) in enumerate(QWEN_ADDED_TOKENS):
        entry = dict(by_text[text], id=base + k, special=special)
        data["added_tokens"].append(entry)
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_config(tok: Tokenizer) -> dict:
    """transformers' tokenizer_config.json for `tok`, Qwen's fields (eos `<|im_end|>`, pad
    `<|endoftext|>`, no BOS)."""
    added = {}
    for text, special in QWEN_ADDED_TOKENS:
        added[str(tok.token_to_id(text))] = {
            "content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return config


def save(tok: Tokenizer, out: Path, chat_template: str | None) -> None:
    """Writes tokenizer.json, tokenizer_config.json and (when given) chat_template.jinja, where
    transformers and Corral read the template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
    if chat_template is not None:
        (out / "chat_template.jinja").write_text(chat_template)
