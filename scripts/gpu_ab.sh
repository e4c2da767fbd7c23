#!/usr/bin/env bash
# Two builds against each other on the GPU machine, interleaved (A B B A ...): `corral bench
# prefill` and `corral bench decode` on a full-size synthetic shape, ROUNDS rounds, each run's
# table to $OUT/ab-<shape>-<build><round>-{prefill,decode}.txt and its lines here.
#
#   A=.gpu/bin/corral-base B=.gpu/bin/corral MODEL=bench/configs/qwen3.5-35b-a3b.json \
#     OUT=.gpu/out scripts/gpu_ab.sh
set -euo pipefail
cd "$(dirname "$0")/.."
A="${A:?the first build}"
B="${B:?the second build}"
MODEL="${MODEL:-bench/configs/qwen3-30b-a3b.json}"
OUT="${OUT:-.gpu/out}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$OUT"
shape="$(basename "$MODEL" .json)"
run() {
  local name="$1" corral="$2" round="$3"
  echo "== $name round $round"
  timeout 280 "$corral" bench prefill --synthetic "$MODEL" --device cuda \
    --prompt-lens "${PREFILL_LENS:-2048,8192}" --strategies grouped --reps "${REPS:-5}" \
    --idle-seconds 0 2>&1 | tee "$OUT/ab-$shape-$name$round-prefill.txt" | grep -E "^grouped" || true
  timeout 280 "$corral" bench decode --synthetic "$MODEL" --device cuda \
    --batch "${DECODE_BATCH:-1,8}" --context "${DECODE_CONTEXT:-512}" --strategies auto \
    --graphs on --steps "${STEPS:-16}" 2>&1 | tee "$OUT/ab-$shape-$name$round-decode.txt" \
    | grep -E "^(auto|grouped|per-token)" || true
}
for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) -eq 1 ]; then
    run a "$A" "$round"
    run b "$B" "$round"
  else
    run b "$B" "$round"
    run a "$A" "$round"
  fi
done
