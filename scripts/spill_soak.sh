#!/usr/bin/env bash
# The session spill store under an agent-like load, for as long as DURATION seconds: `corral
# serve` on the demo model with a small KV pool (KV_MEMORY, default 16M, about 11k tokens: less
# than the sessions reach) and a session directory, against `corral bench sessions` (6
# interleaved sessions of TURNS turns sharing a system prompt, re-sending their history) run
# again and again, each pass new sessions (other tasks and tool results) behind the same
# system prompt. Every INTERVAL seconds one line: seconds,
# the server's resident and anonymous memory (KiB), the directory's files and bytes, and the
# server's spill and restore counters and the tokenizer's segment cache (/metrics). REPEATS
# (default 3, the bench's own) is how often each turn is re-sent with its reply opened by
# other words, and its new text alone.
#
# With RESTART_AT=S the server is stopped after S seconds and started again on the same folder;
# a probe conversation sent (twice) at the start is sent again after the restart, and one line says
# whether its greedy reply is the same and how many of its prompt tokens came from the folder
# (the counters in the lines after it start again from zero).
#
#   scripts/spill_soak.sh                      15 minutes, lines to stdout and $OUT/soak.tsv
#   DURATION=120 scripts/spill_soak.sh         a short one
#   DURATION=240 RESTART_AT=120 scripts/spill_soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CORRAL="${CORRAL:-target/release/corral}"
# The client (`corral bench sessions`), the server's binary unless another is named.
CLIENT="${CLIENT:-$CORRAL}"
DURATION="${DURATION:-900}"
INTERVAL="${INTERVAL:-30}"
KV_MEMORY="${KV_MEMORY:-16M}"
PORT="${PORT:-18431}"
OUT="${OUT:-$(mktemp -d)}"
DIR="$OUT/sessions"
mkdir -p "$DIR"
start_server() {
  "$CORRAL" serve --model models/tiny-qwen3-moe --device cpu --port "$PORT" \
    --kv-memory "$KV_MEMORY" --session-dir "$DIR" >> "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 0.2
  done
}
start_server
client=""
trap 'kill $server $client 2>/dev/null || true' EXIT
# A conversation of a few hundred tokens: its reply (JSON), cached and prompt tokens.
python3 - "$OUT/probe.json" <<'PY'
import json, sys
words = "file search result path line error test build value config output module".split()
text = lambda n, k: " ".join(words[(i * 7 + k) % len(words)] for i in range(n))
messages = [
    {"role": "system", "content": "Probe. " + text(150, 1)},
    {"role": "user", "content": text(60, 2)},
    {"role": "assistant", "content": text(40, 3)},
    {"role": "user", "content": text(60, 4)},
]
json.dump({"messages": messages, "max_tokens": 16, "temperature": 0}, open(sys.argv[1], "w"))
PY
probe() {
  curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d @"$OUT/probe.json" | python3 -c 'import json, sys
r = json.load(sys.stdin); u = r["usage"]
print(json.dumps(r["choices"][0]["message"]["content"]),
      (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0), u["prompt_tokens"], sep="\t")'
}
# Sent twice, as an agent re-sends its conversation: what the folder keeps of an evicted
# prompt is what requests came back to.
probe > /dev/null
before=$(probe)
(
  pass=0
  while true; do
    pass=$((pass + 1))
    "$CLIENT" bench sessions --url "http://127.0.0.1:$PORT" --sessions 6 --turns "${TURNS:-20}" \
      --random-order --repeats "${REPEATS:-3}" --seed "$pass" > /dev/null 2>> "$OUT/client.log" \
      || sleep 1
  done
) &
client=$!
metric() { curl -s "http://127.0.0.1:$PORT/metrics" | awk -v n="$1" '$1 == n {print $2}'; }
printf 'seconds\trss_kib\tanon_kib\tfiles\tdir_bytes\tspills\tspill_bytes\trestores\trestored_tokens\trestored_bytes\tsegment_cache_bytes\n' \
  | tee "$OUT/soak.tsv"
start=$(date +%s)
while true; do
  now=$(( $(date +%s) - start ))
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$server/status")
  anon=$(awk '/^RssAnon/ {print $2}' "/proc/$server/status")
  # Files deleted under the byte cap while these walk the folder are not errors.
  files=$( (find "$DIR" -type f 2>/dev/null || true) | wc -l)
  bytes=$( (du -sb "$DIR" 2>/dev/null || true) | cut -f1)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$now" "$rss" "$anon" "$files" "$bytes" \
    "$(metric corral_session_spills_total)" "$(metric corral_session_spill_bytes_total)" \
    "$(metric corral_session_restores_total)" "$(metric corral_session_restored_tokens_total)" \
    "$(metric corral_session_restored_bytes_total)" "$(metric corral_tokenizer_segment_cache_bytes)" \
    | tee -a "$OUT/soak.tsv"
  [ "$now" -ge "$DURATION" ] && break
  if [ -n "${RESTART_AT:-}" ] && [ "$now" -ge "$RESTART_AT" ]; then
    RESTART_AT=""
    kill "$server" && wait "$server" 2>/dev/null || true
    start_server
    after=$(probe)
    same=no
    [ "$(cut -f1 <<< "$before")" = "$(cut -f1 <<< "$after")" ] && same=yes
    echo "restart at ${now} s: the probe's greedy reply the same: $same; cached $(cut -f2 <<< "$after") of $(cut -f3 <<< "$after") prompt tokens (before: $(cut -f2 <<< "$before"))" \
      | tee -a "$OUT/soak.tsv"
    continue
  fi
  sleep "$INTERVAL"
done
echo "raw: $OUT/soak.tsv"
