"""Tuning rows from rendered conversations (token ids and loss masks, 1 where the assistant
speaks): packed rows of the training length, and long rows that put a tool conversation
behind a long system prompt. Plain lists; train.py makes tensors of them."""

from __future__ import annotations

import random
from collections.abc import Sequence

#: A rendered conversation: its token ids, its loss mask, and whether it offers tools.
Conversation = tuple[list[int], list[int], bool]


def pack(convs: Sequence[Conversation], pad: int, seq: int) -> tuple[list[list[int]], list[list[int]]]:
    """Conversations packed whole into rows of `seq` tokens (one longer than `seq` is cut),
    padded with `pad` (not trained on)."""
    rows, masks = [], []
    row: list[int] = []
    mask: list[int] = []
    for ids, m, _ in convs:
        ids, m = ids[:seq], m[:seq]
        if len(row) + len(ids) > seq:
            rows.append(row + [pad] * (seq - len(row)))
            masks.append(mask + [0] * (seq - len(mask)))
            row, mask = [], []
        row += ids
        mask += m
    if row:
        rows.append(row + [pad] * (seq - len(row)))
        masks.append(mask + [0] * (seq - len(mask)))
    return rows, masks


def long_tool_rows(convs: Sequence[Conversation], stream: Sequence[int], count: int, length: int,
                   rng: random.Random, *, im_end: int, eos: int, newline: int) -> tuple[list[list[int]], list[list[int]]]:
    """Up to `count` rows of exactly `length` tokens, each a tool conversation whose system
    message is lengthened, just before its end, by a slice of `stream` (corpus text, `eos`
    read as `newline`), not trained on: as agents' system prompts of 15-20k tokens are, so that
    the model finds the tools and the request past a long prefix, at positions short rows
    never reach. Conversations already `length` long or longer are not drawn."""
    fits = [c for c in convs if c[2] and len(c[0]) < length]
    rows, masks = [], []
    if not fits:
        return rows, masks
    for _ in range(count):
        ids, m, _ = fits[rng.randrange(len(fits))]
        end = ids.index(im_end)  # the end of the system message
        fill = length - len(ids)
        if fill > len(stream):
            continue
        at = rng.randrange(len(stream) - fill + 1)
        piece = stream[at:at + fill]
        piece = piece.tolist() if hasattr(piece, "tolist") else list(piece)  # a tensor's slice too
        text = [newline if t == eos else t for t in piece]
        rows.append(ids[:end] + text + ids[end:])
        masks.append(m[:end] + [0] * fill + m[end:])
    return rows, masks
