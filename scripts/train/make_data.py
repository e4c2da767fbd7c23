#!/usr/bin/env python3
"""Builds what a training run reads, into OUT (a folder that travels to the GPU machine):
the tokenizer, the corpus's training text (xz) and held-out text, and the tuning
conversations rendered by the chat template as (text, trainable) segments (xz), plus the
held-out tool requests the evaluation sends.

    python3 scripts/train/make_data.py --corpus target/train/corpus \
        --tokenizer target/train/tokenizer --out .train/data
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corral_train import chat, render  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=60000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    from transformers import AutoTokenizer  # the chat template as transformers renders it

    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(args.tokenizer / name, args.out / name)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train = read_jsonl(args.corpus / "train.jsonl")
    heldout = read_jsonl(args.corpus / "heldout.jsonl")
    eos = "<|endoftext|>"
    with lzma.open(args.out / "pretrain.txt.xz", "wt", preset=6) as f:
        for doc in train:
            f.write(doc["text"] + eos)
    (args.out / "heldout.txt").write_text("".join(doc["text"] + "\n" for doc in heldout))

    rng = random.Random(args.seed)
    facts = chat.wordnet_facts() + chat.man_facts(train) + chat.python_facts()
    snippets = chat.snippets_from(train, rng)
    rendered = 0
    with lzma.open(args.out / "sft.jsonl.xz", "wt", preset=6) as f:
        for k in range(args.conversations):
            thinking = rng.random() < 0.5
            kind = rng.random()
            if kind < 0.42:
                messages, tools = chat.tool_conversation(rng, snippets, thinking), chat.TOOLS
            elif kind < 0.52:
                messages = chat.smalltalk_conversation(rng, thinking)
                tools = chat.TOOLS if rng.random() < 0.3 else None
            else:
                messages = chat.qa_conversation(rng.choice(facts), rng, thinking)
                tools = chat.TOOLS if rng.random() < 0.2 else None
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
            f.write(json.dumps(render.segments(text, render.last_user_header(text))) + "\n")
            rendered += 1
    # The held-out tool requests: the evaluation's phrasings, then a second set's (see chat.py).
    for held_out, seed, name in (("eval", args.seed + 1, "tool_requests.jsonl"),
                                 ("fresh", args.seed + 2, "tool_requests_fresh.jsonl")):
        eval_rng = random.Random(seed)
        requests = []
        while len(requests) < 50:
            messages = chat.tool_conversation(eval_rng, snippets, eval_rng.random() < 0.5, held_out=held_out)
            calls = [m for m in messages if m.get("tool_calls")]
            if not calls:
                continue
            first_call = messages.index(calls[0])
            requests.append({"messages": messages[:first_call], "expected": calls[0]["tool_calls"][0]["function"],
                             "tool_result": messages[first_call + 1]["content"]})
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in requests))
    print(f"{len(train)} training documents, {len(heldout)} held out; {rendered} conversations; "
          f"{len(facts)} facts; {len(requests)} held-out tool requests in each of two sets")


if __name__ == "__main__":
    main()
