"""Conversations rendered by the chat template into segments: the text before each
trainable assistant reply, and the reply itself (through its `<|im_end|>`). Only replies
after the last user message are trained, the part of a conversation the Qwen3.5 template
renders as the model will see it when generating (its earlier turns lose their thinking)."""

from __future__ import annotations

ASSISTANT_HEADER = "<|im_start|>assistant\n"
END = "<|im_end|>"


def segments(rendered: str, last_user_header_at: int) -> list[tuple[str, bool]]:
    """`rendered` split into (text, trainable) pieces: every assistant reply that starts after
    `last_user_header_at` is trainable from just after its header through its `<|im_end|>`."""
    out: list[tuple[str, bool]] = []
    pos = 0
    search = last_user_header_at
    while True:
        start = rendered.find(ASSISTANT_HEADER, search)
        if start < 0:
            break
        body = start + len(ASSISTANT_HEADER)
        end = rendered.find(END, body)
        if end < 0:
            break
        end += len(END)
        out.append((rendered[pos:body], False))
        out.append((rendered[body:end], True))
        pos = search = end
    if pos < len(rendered):
        out.append((rendered[pos:], False))
    return [(t, train) for t, train in out if t]


def last_user_header(rendered: str) -> int:
    """Where the last real user message (not a tool response) starts in `rendered`."""
    at = len(rendered)
    while True:
        at = rendered.rfind("<|im_start|>user\n", 0, at)
        if at < 0:
            return 0
        if not rendered.startswith("<|im_start|>user\n<tool_response>", at):
            return at
