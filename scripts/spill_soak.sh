#!/usr/bin/env bash
# The session spill store under an agent-like load, for as long as DURATION seconds: `corral
# serve` on the demo model with a small KV pool (KV_MEMORY, default 16M, about 11k tokens: less
# than the sessions reach) and a session directory, against `corral bench sessions` (6
# interleaved sessions of TURNS turns sharing a system prompt, re-sending their history) run
# again and again. Every INTERVAL seconds one line: seconds,
# the server's resident and anonymous memory (KiB), the directory's files and bytes, and the
# server's spill and restore counters (/metrics).
#
#   scripts/spill_soak.sh                      15 minutes, lines to stdout and $OUT/soak.tsv
#   DURATION=120 scripts/spill_soak.sh         a short one
set -euo pipefail
cd "$(dirname "$0")/.."
CORRAL="${CORRAL:-target/release/corral}"
DURATION="${DURATION:-900}"
INTERVAL="${INTERVAL:-30}"
KV_MEMORY="${KV_MEMORY:-16M}"
PORT="${PORT:-18431}"
OUT="${OUT:-$(mktemp -d)}"
DIR="$OUT/sessions"
mkdir -p "$DIR"
"$CORRAL" serve --model models/tiny-qwen3-moe --device cpu --port "$PORT" \
  --kv-memory "$KV_MEMORY" --session-dir "$DIR" > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server $client 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  sleep 0.2
done
(
  while true; do
    "$CORRAL" bench sessions --url "http://127.0.0.1:$PORT" --sessions 6 --turns "${TURNS:-20}" \
      --random-order --repeats 1 > /dev/null 2>> "$OUT/client.log" || sleep 1
  done
) &
client=$!
metric() { curl -s "http://127.0.0.1:$PORT/metrics" | awk -v n="$1" '$1 == n {print $2}'; }
printf 'seconds\trss_kib\tanon_kib\tfiles\tdir_bytes\tspills\tspill_bytes\trestores\trestored_tokens\n' \
  | tee "$OUT/soak.tsv"
start=$(date +%s)
while true; do
  now=$(( $(date +%s) - start ))
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$server/status")
  anon=$(awk '/^RssAnon/ {print $2}' "/proc/$server/status")
  files=$(find "$DIR" -type f | wc -l)
  bytes=$(du -sb "$DIR" | cut -f1)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$now" "$rss" "$anon" "$files" "$bytes" \
    "$(metric corral_session_spills_total)" "$(metric corral_session_spill_bytes_total)" \
    "$(metric corral_session_restores_total)" "$(metric corral_session_restored_tokens_total)" \
    | tee -a "$OUT/soak.tsv"
  [ "$now" -ge "$DURATION" ] && break
  sleep "$INTERVAL"
done
echo "raw: $OUT/soak.tsv"
