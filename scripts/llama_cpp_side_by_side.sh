#!/usr/bin/env bash
# Corral against llama.cpp on the same GGUF files, on this CPU, interleaved.
#
#   scripts/llama_cpp_side_by_side.sh build    llama.cpp's llama-bench and llama-quantize, from
#                                              the llama.cpp that the llama-cpp-python sdist on
#                                              PyPI vendors (LLAMA_CPP_PYTHON, a version), in $WORK
#   scripts/llama_cpp_side_by_side.sh fetch    that source alone, in $WORK/src (with the venv)
#   scripts/llama_cpp_side_by_side.sh models   CONFIG's shape as a bf16 GGUF with random weights
#                                              (scripts/make_bench_gguf.py), then Q8_0, Q6_K and
#                                              Q4_K_M by llama-quantize
#   scripts/llama_cpp_side_by_side.sh bench    ROUNDS rounds over the files, the order of the two
#                                              engines alternating: llama-bench -p 10,300 -n 32
#                                              -t THREADS, and corral bench prefill (10, 300
#                                              tokens) and decode (batch 1, 32 steps); then one
#                                              table of tokens/s and Corral/llama.cpp ratios
#                                              (TYPES: the files' types, default bf16 q8_0
#                                              q4_k_m; q6_k is made too)
#
# Nothing of llama.cpp enters this repository: it is fetched and built under $WORK
# (default /tmp/llama-side), with a venv there for cmake, ninja and the gguf package.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/llama-side}"
CONFIG="${CONFIG:-bench/configs/qwen3-moe-64e-h512-v8k.json}"
NAME="${NAME:-$(basename "$CONFIG" .json)}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
TYPES="${TYPES:-bf16 q8_0 q4_k_m}"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-0.3.36}"
CORRAL="${CORRAL:-target/release/corral}"
OUT="${OUT:-$WORK/results}"
mkdir -p "$WORK" "$OUT"

venv() {
  if [ ! -x "$WORK/venv/bin/python" ]; then
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q gguf numpy cmake ninja
  fi
  export PATH="$WORK/venv/bin:$PATH"
}

fetch() {
  venv
  if [ ! -d "$WORK/src" ]; then
    local url
    url="$(python3 - "$LLAMA_CPP_PYTHON" <<'PY'
import json, sys, urllib.parse, urllib.request
v, index = sys.argv[1], "https://pypi.org/pypi/llama-cpp-python/json"
d = json.load(urllib.request.urlopen(index))
url = next(u["url"] for u in d["releases"][v] if u["packagetype"] == "sdist")
print(urllib.parse.urljoin(index, url))
PY
)"
    curl -sSL -o "$WORK/sdist.tar.gz" "$url"
    tar xzf "$WORK/sdist.tar.gz" -C "$WORK" "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
    mv "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$WORK/src"
    rm -rf "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON" "$WORK/sdist.tar.gz"
  fi
}

build() {
  fetch
  cmake -S "$WORK/src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF > "$WORK/cmake.log"
  cmake --build "$WORK/build" --target llama-bench llama-quantize -j "$THREADS"
}

models() {
  venv
  python "scripts/make_bench_gguf.py" "$CONFIG" "$WORK/$NAME-bf16.gguf"
  for q in Q8_0 Q6_K Q4_K_M; do
    "$WORK/build/bin/llama-quantize" "$WORK/$NAME-bf16.gguf" "$WORK/$NAME-${q,,}.gguf" "$q" \
      > "$WORK/quantize-$q.log" 2>&1
  done
}

llama() {
  "$WORK/build/bin/llama-bench" -m "$1" -p 10,300 -n 32 -t "$THREADS" -r 5 -o json \
    > "$OUT/llama-$2.json" 2> "$OUT/llama-$2.log"
}

corral() {
  "$CORRAL" bench prefill --model "$1" --device cpu --threads "$THREADS" --prompt-lens 10,300 \
    --strategies auto --reps 5 --idle-seconds 0 --json "$OUT/corral-prefill-$2.json" \
    > "$OUT/corral-prefill-$2.txt" 2>&1
  "$CORRAL" bench decode --model "$1" --device cpu --threads "$THREADS" --batch 1 --context 16 \
    --steps 32 --strategies auto --graphs off --json "$OUT/corral-decode-$2.json" > "$OUT/corral-decode-$2.txt" 2>&1
}

bench() {
  for round in $(seq 1 "$ROUNDS"); do
    for q in $TYPES; do
      local file="$WORK/$NAME-$q.gguf" tag="$q-$round"
      if [ $((round % 2)) -eq 1 ]; then llama "$file" "$tag"; corral "$file" "$tag"
      else corral "$file" "$tag"; llama "$file" "$tag"; fi
      echo "round $round $q done"
    done
  done
  python3 - "$OUT" "$ROUNDS" $TYPES <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'file':8} {'test':6} {'llama.cpp tok/s':>28} {'Corral tok/s':>28} {'ratio':>6}")
for q in sys.argv[3:]:
    for test in ["pp10", "pp300", "tg32"]:
        ll, co = [], []
        for r in range(1, rounds + 1):
            for row in json.load(open(f"{out}/llama-{q}-{r}.json")):
                name = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
                if name == test:
                    ll.append(row["avg_ts"])
            if test == "tg32":
                rows = json.load(open(f"{out}/corral-decode-{q}-{r}.json"))["rows"]
                co.append(rows[0]["tok_s"])
            else:
                n = int(test[2:])
                rows = json.load(open(f"{out}/corral-prefill-{q}-{r}.json"))["rows"]
                co.append(next(x["prefill_tok_s"] for x in rows if x["prompt_tokens"] == n))
        fmt = lambda v: " / ".join(f"{x:.0f}" for x in v)
        ratio = statistics.median(co) / statistics.median(ll)
        print(f"{q:8} {test:6} {fmt(ll):>28} {fmt(co):>28} {ratio:6.2f}")
PY
}

case "${1:-}" in
  fetch) fetch ;;
  build) build ;;
  models) models ;;
  bench) bench ;;
  *) echo "usage: scripts/llama_cpp_side_by_side.sh build|models|bench" >&2; exit 2 ;;
esac
