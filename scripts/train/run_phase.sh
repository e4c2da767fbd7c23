#!/usr/bin/env bash
# One training command on the GPU machine, from the repository root: installs the wheels in
# .train/whl if there are any (packages the machine lacks), then runs PHASE of train.py, its
# log appended to OUT/train.log (and, for `sft`, the exported model in OUT/model and its
# evaluation in OUT/eval.log).
#
#   OUT=/tmp/out SECONDS_BUDGET=540 TOTAL_SECONDS=1080 scripts/train/run_phase.sh pretrain
#   OUT=/tmp/out SECONDS_BUDGET=540 RESUME=1 scripts/train/run_phase.sh pretrain
#   OUT=/tmp/out SECONDS_BUDGET=200 scripts/train/run_phase.sh sft
#   OUT=/tmp/out SECONDS_BUDGET=200 INIT=path/to/exported/model scripts/train/run_phase.sh sft
#   OUT=/tmp/out CORRAL=path/to/corral scripts/train/run_phase.sh corral-eval
set -euo pipefail
cd "$(dirname "$0")/../.."
phase="${1:?pretrain, sft or corral-eval}"
out="${OUT:?a folder for the log and results}"
mkdir -p "$out"
if compgen -G ".train/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .train/whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
[ "$phase" = corral-eval ] || python3 scripts/train/train.py "$phase" --data .train/data --run .train/run \
  --seconds "${SECONDS_BUDGET:-420}" --batch "${BATCH:-0}" \
  ${TOTAL_SECONDS:+--total-seconds "$TOTAL_SECONDS"} ${RESUME:+--resume} ${EXTRA:+--extra "$EXTRA"} \
  ${LONG_SHARE:+--long-share "$LONG_SHARE"} ${INIT:+--init "$INIT"} 2>&1 | grep -v "falling back" | tee -a "$out/train.log"
if [ "$phase" = sft ]; then
  python3 scripts/train/train.py export --data .train/data --run .train/run --out .train/run/model 2>&1 | tee -a "$out/train.log"
  python3 scripts/train/train.py eval --data .train/data --model .train/run/model 2>&1 | tee "$out/eval.log"
  # Eight files come back: the weights, config, index and generation config (the tokenizer
  # files are the ones in .train/data) beside the two logs.
  mkdir -p "$out/model"
  cp .train/run/model/*.safetensors .train/run/model/*.json "$out/model/"
  rm -f "$out/model/tokenizer.json" "$out/model/tokenizer_config.json"
fi
# Corral on the exported model, on this machine's GPU (CORRAL: its binary): the held-out
# perplexity (bf16 KV), and the GPU in f32 against this machine's CPU.
if [ "$phase" = corral-eval ]; then
  corral="${CORRAL:?the corral binary}"
  "$corral" eval --model .train/run/model --device cuda --text .train/data/heldout.txt --json \
    2>&1 | tee "$out/corral-eval.log"
  "$corral" eval --model .train/run/model --device cuda --kv-dtype f32 --text .train/data/heldout.txt \
    --against device=cpu --json 2>&1 | tee -a "$out/corral-eval.log"
fi
