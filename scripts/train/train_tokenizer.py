#!/usr/bin/env python3
"""Trains the byte-level BPE tokenizer on the corpus's training split and writes it, with
Qwen's added tokens and the Qwen3.5 chat template, to OUT.

    python3 scripts/train/train_tokenizer.py --corpus target/train/corpus \
        --template target/qwen-templates/Qwen3.5-4B.jinja --out target/train/tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corral_train import tokenizer  # noqa: E402


def texts(path: Path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--template", type=Path, required=True, help="the official Qwen3.5 chat template")
    parser.add_argument("--vocab-size", type=int, default=8192, help="learned tokens, bytes included")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tok = tokenizer.train(texts(args.corpus / "train.jsonl"), args.vocab_size)
    tokenizer.save(tok, args.out, args.template.read_text())
    sample = "The quick brown fox jumps over the lazy dog. def main():\n    return 0\n"
    print(f"{tok.get_vocab_size()} tokens; sample: {len(tok.encode(sample).ids)} tokens for {len(sample)} chars")


if __name__ == "__main__":
    main()
