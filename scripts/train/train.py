#!/usr/bin/env python3
"""Trains Corral's demo model on the GPU machine, one phase per command within a time budget:
`pretrain` on the corpus, then `sft` on the rendered conversations (mixed with corpus text),
then `export` writes the Hugging Face directory (bf16, shards under 15 MB) and `eval` reports
held-out perplexity and the MTP head's agreement. Seeds are fixed; the learning-rate schedule
is fitted to the time budget from the measured step time.

    python3 scripts/train/train.py pretrain --data .train/data --run .train/run --seconds 540 --total-seconds 1080
    python3 scripts/train/train.py pretrain --data .train/data --run .train/run --seconds 540 --resume
    python3 scripts/train/train.py sft --data .train/data --run .train/run --seconds 300
    python3 scripts/train/train.py sft --data .train/data --run .train/run --seconds 300 --init MODEL
    python3 scripts/train/train.py export --data .train/data --run .train/run --out OUT/model
    python3 scripts/train/train.py eval --data .train/data --model OUT/model
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corral_train import model as demo  # noqa: E402
from corral_train import rows as rows_lib  # noqa: E402

SEQ = 1024


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_tokenizer(data: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(data / "tokenizer.json"))


def pretrain_tokens(data: Path, tok, extra: list[str]) -> torch.Tensor:
    """The corpus's training text as one token stream, documents ended by `<|endoftext|>`,
    with the `extra` sources read where training runs (their held-out documents left out)."""
    from corral_train import sources, split

    eos = tok.token_to_id("<|endoftext|>")
    with lzma.open(data / "pretrain.txt.xz", "rt") as f:
        docs = f.read().split("<|endoftext|>")
    for name in extra:
        before = len(docs)
        docs += [d.text for d in sources.SOURCES[name]() if not split.held_out(d.source, d.name)]
        log(f"{name}: {len(docs) - before} documents")
    ids: list[int] = []
    for enc in tok.encode_batch([d for d in docs if d]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def sft_conversations(data: Path, tok) -> list[rows_lib.Conversation]:
    """Each rendered conversation's token ids, loss mask (1 on what the assistant says) and
    whether it offers tools."""
    with lzma.open(data / "sft.jsonl.xz", "rt") as f:
        convs = [json.loads(line) for line in f]
    pieces = [t for c in convs for t, _ in c]
    encoded = iter(tok.encode_batch(pieces, add_special_tokens=False))
    out = []
    for conv in convs:
        ids: list[int] = []
        m: list[int] = []
        for _, trainable in conv:
            e = next(encoded).ids
            ids.extend(e)
            m.extend([int(trainable)] * len(e))
        out.append((ids, m, "<tools>" in conv[0][0]))
    return out


def build_model(tok, device: str) -> demo.DemoModel:
    config = demo.demo_config(tok.get_vocab_size(), eos_token_id=tok.token_to_id("<|im_end|>"),
                              pad_token_id=tok.token_to_id("<|endoftext|>"))
    return demo.DemoModel(config).to(device)


def choose_experts(model: demo.DemoModel, device: str) -> None:
    """Runs the experts as one grouped product (torch's grouped_mm) where a probe step
    succeeds, else as transformers' loop over experts."""
    wanted = os.environ.get("CORRAL_TRAIN_EXPERTS", "grouped_mm" if device == "cuda" else "eager")
    configs = [model.lm.config, model.mtp.layers[0].mlp.experts.config]
    for c in configs:
        c._experts_implementation = wanted
    if wanted == "eager":
        return
    try:
        ids = torch.randint(0, model.lm.config.vocab_size, (2, 64), device=device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(ids)[0]
        loss.backward()
        model.zero_grad(set_to_none=True)
        log(f"experts: {wanted}")
    except Exception as e:  # the probe decides; any failure means the loop runs instead
        log(f"experts: {wanted} failed ({type(e).__name__}: {e}); the loop over experts runs")
        for c in configs:
            c._experts_implementation = "eager"


PROBE_BATCHES = (32, 64, 128, 256)


def probe_batch(model, windows: torch.Tensor, device: str) -> int:
    """The batch of windows that trains fastest per token here: a forward and backward at each
    of PROBE_BATCHES (after one to warm up), stopping where tokens/s gains less than 10% or
    memory runs out. A model this small is bound by kernel launches, not arithmetic, on a
    GPU. Gradients are dropped; nothing is learnt."""
    if device != "cuda":
        return PROBE_BATCHES[0]
    best, best_rate = PROBE_BATCHES[0], 0.0
    for batch in PROBE_BATCHES:
        try:
            ids = windows[:batch].to(next(model.parameters()).device)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.time()
                with torch.autocast(device_type=device, dtype=torch.bfloat16):
                    loss = model(ids)[0]
                loss.backward()
                torch.cuda.synchronize()
                times.append(time.time() - t)
            model.zero_grad(set_to_none=True)
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            break
        rate = batch * SEQ / min(times[1:])
        log(f"batch {batch}: {rate / 1e3:.0f} k tokens/s")
        if rate < 1.1 * best_rate:
            break
        best, best_rate = batch, rate
    return best


def train(args, phase: str) -> None:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = load_tokenizer(args.data)
    args.run.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model = build_model(tok, device)
    if phase == "sft" and args.init:
        load_exported(model, args.init)
        log(f"sft from {args.init}")
    elif phase == "sft":
        model.load_state_dict(torch.load(args.run / "pretrain.pt", map_location=device))
    choose_experts(model, device)
    params = sum(p.numel() for p in model.parameters())
    log(f"{phase}: {params / 1e6:.2f} M parameters on {device}")
    stream = pretrain_tokens(args.data, tok, [e for e in args.extra.split(",") if e])
    n_windows = (len(stream) - 1) // SEQ
    windows = stream[: n_windows * SEQ].view(n_windows, SEQ).long()
    log(f"corpus: {len(stream) / 1e6:.2f} M tokens, {n_windows} windows")
    if phase == "sft":
        convs = sft_conversations(args.data, tok)
        packed = rows_lib.pack(convs, tok.token_to_id("<|endoftext|>"), SEQ)
        rows, masks = torch.tensor(packed[0], dtype=torch.int64), torch.tensor(packed[1], dtype=torch.int8)
        special = {name: tok.token_to_id(f"<|{name}|>") for name in ("im_end", "endoftext")}
        newline = tok.encode("\n", add_special_tokens=False).ids[0]
        long_rng = random.Random(args.seed + 1)
        log(f"conversations: {len(rows)} rows, {int(masks.sum()) / 1e6:.2f} M trained tokens")
    peak_lr = args.lr if args.lr else (2e-3 if phase == "pretrain" else 5e-4)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "A_log" in name or "dt_bias" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    warmup = 100 if phase == "pretrain" else 30
    total = None
    step = 0
    resumed = args.resume and (args.run / f"{phase}.state").exists()
    if resumed:
        saved = torch.load(args.run / f"{phase}.state", map_location=device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, total = saved["step"], saved["total"]
        args.batch = saved.get("batch", args.batch or PROBE_BATCHES[0])
        log(f"resumed at step {step} of {total}")
    if not args.batch:
        args.batch = probe_batch(model, windows, device)
        log(f"batch {args.batch}")
    # A resumed run draws other windows than the run it goes on from.
    gen = torch.Generator().manual_seed(args.seed + 7919 * resumed)
    t_measure = None
    budget = args.seconds - (time.time() - started) - 20
    # The schedule spans --total-seconds of training (several commands, each resuming the last).
    planned = max(budget, args.total_seconds - (time.time() - started) - 20) if args.total_seconds else budget
    first_step = step
    train_start = time.time()
    while True:
        draw = random.random() if phase == "sft" else 0.0
        if phase == "pretrain" or draw < 0.2:
            idx = torch.randint(0, n_windows, (args.batch,), generator=gen)
            ids, mask = windows[idx], None
        elif draw < 0.2 + args.long_share:
            # Rows of --long-length, as many tokens as a step of short rows up to two rows (the
            # attention layers' masks and scores grow with the square of the length).
            count = max(1, min(2, args.batch * SEQ // args.long_length))
            long_ids, long_mask = rows_lib.long_tool_rows(
                convs, stream, count, args.long_length, long_rng,
                im_end=special["im_end"], eos=special["endoftext"], newline=newline)
            if not long_ids:
                continue
            ids, mask = torch.tensor(long_ids), torch.tensor(long_mask, dtype=torch.int8).to(device)
        else:
            idx = torch.randint(0, len(rows), (args.batch,), generator=gen)
            ids, mask = rows[idx], masks[idx].to(device)
        ids = ids.to(device, non_blocking=True)
        if total is None:
            lr = peak_lr * min(1.0, (step + 1) / warmup)
        else:
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            lr = peak_lr * (min(1.0, (step + 1) / warmup) if step < warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, lm_loss, mtp_loss, aux = model(ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == first_step + 10:
            if device == "cuda":
                torch.cuda.synchronize()
            t_measure = time.time()
        if step == first_step + 40:
            if device == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_measure) / 30
            if total is None:
                total = max(step + 1, int(planned / per_step))
            log(f"{per_step * 1000:.0f} ms a step, {args.batch * SEQ / per_step / 1e3:.0f} k tokens/s: {total} steps in all")
        if step % 100 == 0 or step == 1:
            log(f"step {step} lr {lr:.2e} loss {lm_loss.item():.3f} mtp {mtp_loss.item():.3f} aux {aux.item():.3f}")
        if total is not None and step >= total:
            break
        if time.time() - train_start > budget + 10:
            log("time budget reached")
            break
    torch.save(model.state_dict(), args.run / f"{phase}.pt")
    if total is None:  # the budget ended before the step time was measured
        total = max(step, int(planned / max(1e-9, (time.time() - train_start) / max(1, step - first_step))))
    if step < total:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "total": total,
                    "batch": args.batch}, args.run / f"{phase}.state")
        log(f"{phase} paused at step {step} of {total}: --resume goes on")
    else:
        (args.run / f"{phase}.state").unlink(missing_ok=True)
    log(f"{phase}: {step - first_step} steps this run, {step} in all, "
        f"{step * args.batch * SEQ / 1e6:.1f} M tokens, {time.time() - started:.0f} s")


def export(args) -> None:
    from safetensors.torch import save_file

    tok = load_tokenizer(args.data)
    model = build_model(tok, "cpu")
    model.load_state_dict(torch.load(args.run / f"{args.phase}.pt", map_location="cpu"))
    model = model.to(torch.bfloat16)
    model.lm.config._experts_implementation = "eager"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.lm.config.dtype = "bfloat16"
    model.lm.save_pretrained(out, max_shard_size="15MB")
    mtp = {k: v.contiguous() for k, v in model.state_dict_for_export().items()}
    save_file(mtp, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        single = out / "model.safetensors"
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    for k in mtp:
        index["weight_map"][k] = "model-mtp.safetensors"
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    config["mtp_use_dedicated_embeddings"] = False
    config.pop("_experts_implementation", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((args.data / name).read_bytes())
    (out / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
    }, indent=2) + "\n")
    log(f"exported to {out}: {sorted(p.name for p in out.iterdir())}")


@torch.no_grad()
def evaluate(args) -> None:
    """Held-out perplexity by transformers (bf16 on the GPU and f32) and the MTP head's top-1
    agreement with the model's own greedy next-next token at depths 1-3."""
    from transformers import Qwen3_5MoeForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = load_tokenizer(args.data)
    text = (args.data / "heldout.txt").read_text()
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.int64)
    if args.max_tokens:
        ids = ids[: args.max_tokens + 1]
    results = {}
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        lm = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        nll, count = 0.0, 0
        for start in range(0, len(ids) - 1, SEQ):
            chunk = ids[start: start + SEQ + 1].to(device)
            if len(chunk) < 2:
                break
            logits = lm(chunk[None, :-1]).logits.float()[0]
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += len(chunk) - 1
        results[str(dtype).removeprefix("torch.")] = {"tokens": count, "ppl": math.exp(nll / count)}
        log(f"{dtype}: perplexity {math.exp(nll / count):.3f} over {count} tokens (windows of {SEQ})")
    results["mtp_top1"] = mtp_agreement(args.model, ids, device, windows=args.mtp_windows)
    log(f"MTP head's top-1 agreement with the model's next-next token, depths 1-3: {results['mtp_top1']}")
    print(json.dumps(results))


@torch.no_grad()
def mtp_agreement(model_dir: Path, ids: torch.Tensor, device: str, windows: int, depths: int = 3) -> list[float]:
    """How often the MTP head's top token at depth k (from the model's hidden state at t, or
    the head's own at the depth before, and the text's token at t+k) equals the model's own
    top token at t+k, over the first `windows` windows of the text, f32."""
    from transformers import Qwen3_5MoeForCausalLM

    lm = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    head = demo.MtpHead(lm.config).to(device).eval()
    load_mtp_head(head, model_dir)
    same = [0] * depths
    total = [0] * depths
    for w in range(windows):
        chunk = ids[w * SEQ: (w + 1) * SEQ].to(device)[None]
        if chunk.shape[1] < depths + 2:
            break
        out = lm.model(input_ids=chunk)
        hidden = out.last_hidden_state
        greedy = lm.lm_head(hidden).argmax(-1)  # the model's top token after each position
        for k in range(1, depths + 1):
            t = chunk.shape[1] - k
            positions = torch.arange(k, k + t, device=device)[None]
            hidden = head(hidden[:, :t], lm.model.embed_tokens(chunk[:, k:k + t]), positions)
            drafted = lm.lm_head(hidden).argmax(-1)
            same[k - 1] += int((drafted == greedy[:, k:k + t]).sum())
            total[k - 1] += t
    return [round(s / max(1, n), 4) for s, n in zip(same, total)]


def load_exported(model: demo.DemoModel, model_dir: Path) -> None:
    """An exported directory's weights (bf16) into `model` (its master weights f32), the
    language model's as transformers reads them and the MTP head's from `mtp.*`."""
    from transformers import Qwen3_5MoeForCausalLM

    lm = Qwen3_5MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.lm.load_state_dict(lm.state_dict())
    load_mtp_head(model.mtp, model_dir)


def load_mtp_head(head: demo.MtpHead, model_dir: Path) -> None:
    """An exported directory's `mtp.*` tensors into `head` (its rotary table is computed)."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model-mtp.safetensors"))
    missing, unexpected = head.load_state_dict(demo.mtp_state_from_export(tensors), strict=False)
    if unexpected or any("rotary_emb" not in k for k in missing):
        raise ValueError(f"MTP tensors do not match the head: missing {missing}, unexpected {unexpected}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["pretrain", "sft", "export", "eval"])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--run", type=Path, default=Path(".train/run"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--phase", default="sft", help="export: which checkpoint")
    parser.add_argument("--seconds", type=float, default=500, help="this command's time budget")
    parser.add_argument("--total-seconds", type=float, default=0,
                        help="the schedule's span across resumed commands (default: --seconds)")
    parser.add_argument("--resume", action="store_true", help="go on from the paused state in --run")
    parser.add_argument("--extra", default="", help="corpus sources read where training runs (e.g. python-source)")
    parser.add_argument("--init", type=Path,
                        help="sft: start from this exported model instead of --run's pretraining")
    parser.add_argument("--long-share", type=float, default=0.0,
                        help="sft: share of steps that train on long tool conversations (corral_train/rows.py)")
    parser.add_argument("--long-length", type=int, default=16384, help="sft: tokens of a long row")
    parser.add_argument("--batch", type=int, default=0,
                        help="windows a step (default: the fastest per token of a short probe on the GPU, else 32)")
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-tokens", type=int, default=0, help="eval: score at most this many tokens")
    parser.add_argument("--mtp-windows", type=int, default=64, help="eval: windows the MTP head is measured on")
    args = parser.parse_args()
    if args.command in ("pretrain", "sft"):
        train(args, args.command)
    elif args.command == "export":
        export(args)
    else:
        evaluate(args)


if __name__ == "__main__":
    main()
