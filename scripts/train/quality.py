#!/usr/bin/env python3
"""The demo model's quality table: its GGUF files made by llama.cpp's own converter and
quantizer (BF16, Q8_0, Q4_K_M; llama.cpp fetched and built in WORK as
scripts/llama_cpp_side_by_side.sh build does), then `corral eval` of each configuration
against the checkpoint in f32 (f32 KV cache, CPU) over the held-out text: perplexity, mean KL
divergence and top-1 agreement. A markdown table to stdout.

    python3 scripts/train/quality.py --model models/corral-demo --text .train/data/heldout.txt \
        --work /tmp/llama-side --corral target/release/corral [--max-tokens 65536] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_fidelity import convert, quantize  # noqa: E402


def evaluate(corral: Path, model: Path, text: Path, max_tokens: int, base: list[str], against: str) -> dict:
    out = subprocess.run(
        [str(corral), "eval", "--model", str(model), "--text", str(text), "--max-tokens", str(max_tokens),
         "--kv-dtype", "f32", *base, "--against", against, "--json"],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama-side"))
    parser.add_argument("--corral", type=Path, default=Path("target/release/corral"))
    parser.add_argument("--max-tokens", type=int, default=65536)
    parser.add_argument("--device", default="cpu", help="where the compared configurations run")
    args = parser.parse_args()
    work = args.work / "demo-gguf"
    work.mkdir(parents=True, exist_ok=True)
    src, bins = args.work / "src", args.work / "build" / "bin"
    files = {"BF16": convert(src, args.model, work, "BF16")}
    f32 = convert(src, args.model, work, "F32")
    for kind in ("Q8_0", "Q4_K_M"):
        files[kind] = quantize(bins, f32, work, kind)
    base = ["--device", "cpu"]
    rows = [("checkpoint, bf16 KV", f"device={args.device},kv-dtype=bf16")]
    if args.device != "cpu":
        rows.insert(0, ("checkpoint, f32 KV", f"device={args.device}"))
        rows.append(("checkpoint, fp8 KV", f"device={args.device},kv-dtype=fp8"))
    rows += [(f"GGUF {kind}, f32 KV", f"model={path},device={args.device}") for kind, path in files.items()]
    print(f"Against the checkpoint in f32 (CPU, f32 KV), {args.max_tokens} tokens of {args.text.name}; "
          f"the configurations on {args.device}.\n")
    print("| configuration | perplexity | mean KL (nats) | top-1 agreement |")
    print("|---|---|---|---|")
    first = None
    for label, against in rows:
        r = evaluate(args.corral, args.model, args.text, args.max_tokens, base, against)
        if first is None:
            first = r["perplexity"]
            print(f"| checkpoint, f32 KV, CPU | {first:.4f} | — | — |")
        a = r["against"]
        print(f"| {label} | {a['perplexity']:.4f} | {a['kl_mean']:.3e} | {100 * a['top1_agreement']:.2f}% |",
              flush=True)


if __name__ == "__main__":
    main()
