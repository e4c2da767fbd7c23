#!/usr/bin/env bash
# One training command on the GPU machine, from the repository root: installs the wheels in
# .train/whl if there are any (packages the machine lacks), then runs PHASE of train.py, its
# log appended to OUT/train.log (and, for `sft`, the exported model in OUT/model and its
# evaluation in OUT/eval.log).
#
#   OUT=/tmp/out SECONDS_BUDGET=540 TOTAL_SECONDS=1080 scripts/train/run_phase.sh pretrain
#   OUT=/tmp/out SECONDS_BUDGET=540 RESUME=1 scripts/train/run_phase.sh pretrain
#   OUT=/tmp/out SECONDS_BUDGET=200 scripts/train/run_phase.sh sft
set -euo pipefail
cd "$(dirname "$0")/../.."
phase="${1:?pretrain or sft}"
out="${OUT:?a folder for the log and results}"
mkdir -p "$out"
if compgen -G ".train/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .train/whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 scripts/train/train.py "$phase" --data .train/data --run .train/run \
  --seconds "${SECONDS_BUDGET:-420}" --batch "${BATCH:-32}" \
  ${TOTAL_SECONDS:+--total-seconds "$TOTAL_SECONDS"} ${RESUME:+--resume} ${EXTRA:+--extra "$EXTRA"} 2>&1 | grep -v "falling back" | tee -a "$out/train.log"
if [ "$phase" = sft ]; then
  python3 scripts/train/train.py export --data .train/data --run .train/run --out "$out/model" 2>&1 | tee -a "$out/train.log"
  python3 scripts/train/train.py eval --data .train/data --model "$out/model" 2>&1 | tee "$out/eval.log"
fi
# Eight files come back: keep the weights, config and index (the tokenizer files are the
# ones in .train/data).
if [ "$phase" = sft ]; then
  rm -f "$out/model/tokenizer.json" "$out/model/tokenizer_config.json" "$out/model/chat_template.jinja"
fi
