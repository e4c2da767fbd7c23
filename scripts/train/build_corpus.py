#!/usr/bin/env python3
"""Builds the pretraining corpus from installed Debian documentation packages (see
corral_train/sources.py for the list) into OUT/train.jsonl and OUT/heldout.jsonl, one
document a line ({"source", "name", "text"}), and prints each source's size.

    python3 scripts/train/build_corpus.py --out target/train/corpus
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corral_train import sources, split  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sources", default=",".join(sources.DEFAULT_SOURCES), help="comma-separated source names")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.sources.split(",") if s]
    unknown = [s for s in names if s not in sources.SOURCES]
    if unknown:
        sys.exit(f"unknown sources {unknown}; known: {', '.join(sources.SOURCES)}")
    with open(args.out / "train.jsonl", "w") as train, open(args.out / "heldout.jsonl", "w") as heldout:
        for name in names:
            counts = {"train": [0, 0], "heldout": [0, 0]}
            for doc in sources.SOURCES[name]():
                part = "heldout" if split.held_out(doc.source, doc.name) else "train"
                (heldout if part == "heldout" else train).write(
                    json.dumps({"source": doc.source, "name": doc.name, "text": doc.text}, ensure_ascii=False) + "\n"
                )
                counts[part][0] += 1
                counts[part][1] += len(doc.text)
            print(f"{name}: train {counts['train'][0]} docs {counts['train'][1] / 1e6:.1f} MB, "
                  f"held out {counts['heldout'][0]} docs {counts['heldout'][1] / 1e6:.2f} MB", flush=True)


if __name__ == "__main__":
    main()
