#!/usr/bin/env bash
# llama.cpp's Vulkan backend against Corral's (and Corral's CUDA) on the same GPU and the same
# full-size synthetic Q4_K_M GGUF files, in two halves.
#
#   scripts/llama_cpp_vulkan_side_by_side.sh glslc    here: Debian trixie's glslc under $WORK,
#       its path printed (the build below uses it, and Corral's own cooperative-matrix
#       kernels need it where the system's glslc is bookworm's).
#   scripts/llama_cpp_vulkan_side_by_side.sh build    here: llama-bench with GGML_VULKAN from
#       the llama.cpp that llama-cpp-python's sdist vendors (scripts/llama_cpp_side_by_side.sh
#       fetches it, in $WORK), with Debian trixie's Vulkan headers and glslc (bookworm's lack
#       what this llama.cpp needs, and the cooperative-matrix extensions its NVIDIA kernels
#       use) unpacked under $WORK, never installed; then $WORK/travel.tgz: llama-bench, its
#       libgomp and the gguf package, for the GPU machine (unpack it under .gpu/llama).
#   scripts/llama_cpp_vulkan_side_by_side.sh remote [30b] [35b]   on the GPU machine, from the
#       repository root, with .gpu/llama unpacked and the Vulkan loader installed: each model
#       made in $GGUF_DIR by scripts/make_bench_gguf_q4km.py (random Q4_K/Q6_K blocks, a
#       minute or two), benched, deleted; ROUNDS rounds, the engines' order alternating, of
#         llama-bench -p $LENS -n $GEN -r $REPS -o json      (its Vulkan device)
#         llama-bench -p 0 -n $GEN -d 512 -r $REPS -o json   (decode at 512 tokens of context)
#         corral bench prefill / decode --device vulkan, then --device cuda
#       and a table of tok/s with Corral-Vulkan/llama.cpp and Corral-Vulkan/Corral-CUDA
#       ratios, $OUT/summary.txt. About 6-8 minutes a model on an H100 (an estimate).
#       LLAMA_ENV="GGML_VK_DISABLE_COOPMAT=1 GGML_VK_DISABLE_COOPMAT2=1" runs llama.cpp's
#       portable kernels (no cooperative matrices, as Corral's shaders today); LLAMA_EXTRA
#       and CORRAL_EXTRA add flags to either engine's benches.
#
# Nothing of llama.cpp enters this repository.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/llama-vk}"

# Debian trixie's glslc (and Vulkan headers) unpacked under $WORK/apt-trixie, run through
# $WORK/glslc under trixie's own libc and libstdc++ (build time only); prints that path.
# Corral's cooperative-matrix kernels need such a glslc too:
# GLSLC="$(scripts/llama_cpp_vulkan_side_by_side.sh glslc)" scripts/gpu.sh prepare
glslc() {
  set -e
  local apt="$WORK/apt-trixie" o
  mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/root"
  echo "deb http://deb.debian.org/debian trixie main" > "$apt/trixie.list"
  o=(-oDir::Etc::SourceList="$apt/trixie.list" -oDir::Etc::SourceParts=/dev/null
     -oDir::State::Lists="$apt/lists" -oDir::Cache="$apt" -oAPT::Architecture=amd64)
  apt-get "${o[@]}" update -qq >&2
  (cd "$apt" && apt-get "${o[@]}" download glslc libshaderc1 libc6 libgcc-s1 libstdc++6 libvulkan-dev >&2)
  for deb in "$apt"/*.deb; do dpkg -x "$deb" "$apt/root"; done
  # trixie's glslc under trixie's own libc and libstdc++ (build time only).
  cat > "$WORK/glslc" <<SH
#!/bin/sh
R=$apt/root
exec \$R/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path \$R/usr/lib/x86_64-linux-gnu \$R/usr/bin/glslc "\$@"
SH
  chmod +x "$WORK/glslc"
  echo "$WORK/glslc"
}

build() {
  set -e
  WORK="$WORK" scripts/llama_cpp_side_by_side.sh fetch
  local apt="$WORK/apt-trixie"
  glslc > /dev/null
  export PATH="$WORK/venv/bin:$PATH"
  cmake -S "$WORK/src" -B "$WORK/build-vk" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DVulkan_INCLUDE_DIR="$apt/root/usr/include" -DVulkan_GLSLC_EXECUTABLE="$WORK/glslc" \
    > "$WORK/cmake-vk.log"
  cmake --build "$WORK/build-vk" --target llama-bench -j "${THREADS:-2}"
  local dist="$WORK/dist"
  rm -rf "$dist" && mkdir -p "$dist"
  cp "$WORK/build-vk/bin/llama-bench" "$dist/" && strip "$dist/llama-bench"
  cp "$(ldconfig -p | awk '/libgomp.so.1 .*x86-64/ {print $NF; exit}')" "$dist/"
  "$WORK/venv/bin/pip" download -q --no-deps gguf -d "$WORK/wheel"
  python3 -m zipfile -e "$WORK"/wheel/gguf-*.whl "$dist/gguf-py"
  tar czf "$WORK/travel.tgz" -C "$dist" .
  du -h "$WORK/travel.tgz"
}

remote() {
LLAMA_BENCH="${LLAMA_BENCH:-.gpu/llama/llama-bench}" GGUF_PY="${GGUF_PY:-.gpu/llama/gguf-py}"
: "${LLAMA_BENCH:?path to llama-bench}" "${GGUF_PY:?directory holding the gguf package}"
OUT="${OUT:-/tmp/bench-out}"
if [ -z "${CORRAL:-}" ]; then
  CORRAL=target/release/corral
  [ -x .gpu/bin/corral ] && CORRAL=.gpu/bin/corral
fi
# llama-bench's libgomp.so.1 (and libvulkan.so.1, if carried there) beside it.
export LD_LIBRARY_PATH="$(cd "$(dirname "$LLAMA_BENCH")" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -d .gpu ] && export CORRAL_KERNEL_CACHE="${CORRAL_KERNEL_CACHE:-$PWD/.gpu/kernel-cache}"
ROUNDS="${ROUNDS:-2}" LENS="${LENS:-10,512,2048}" GEN="${GEN:-128}" REPS="${REPS:-3}"
GGUF_DIR="${GGUF_DIR:-/tmp}" KEEP="${KEEP:-0}"
MODELS="${*:-30b 35b}"
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/remote.log"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$LLAMA_BENCH" --list-devices 2>&1
  "$CORRAL" --version 2>&1 || true
  df -h "$GGUF_DIR"
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

config_of() {
  case "$1" in
    30b) echo bench/configs/qwen3-30b-a3b.json ;;
    35b) echo bench/configs/qwen3.5-35b-a3b.json ;;
    *) echo "$1" ;;  # a config path
  esac
}

llama() {  # model file, tag
  log "llama-bench $2"
  env ${LLAMA_ENV:-} timeout 420 "$LLAMA_BENCH" -m "$1" -p "$LENS" -n "$GEN" -r "$REPS" -o json \
    ${LLAMA_EXTRA:-} > "$OUT/llama-$2.json" 2> "$OUT/llama-$2.log" || log "llama-bench $2 failed: $?"
  env ${LLAMA_ENV:-} timeout 300 "$LLAMA_BENCH" -m "$1" -p 0 -n "$GEN" -d 512 -r "$REPS" -o json \
    ${LLAMA_EXTRA:-} > "$OUT/llama-d512-$2.json" 2> "$OUT/llama-d512-$2.log" \
    || log "llama-bench -d 512 $2 failed: $?"
}

corral() {  # model file, device, tag
  log "corral $2 $3"
  timeout 420 "$CORRAL" bench prefill --model "$1" --device "$2" --prompt-lens "$LENS" \
    --strategies auto --reps "$REPS" --idle-seconds 0 ${CORRAL_EXTRA:-} --json "$OUT/corral-prefill-$2-$3.json" \
    > "$OUT/corral-prefill-$2-$3.txt" 2>&1 || log "corral prefill $2 $3 failed: $?"
  timeout 300 "$CORRAL" bench decode --model "$1" --device "$2" --batch 1 --context 512 \
    --steps "$GEN" ${CORRAL_EXTRA:-} --json "$OUT/corral-decode-$2-$3.json" \
    > "$OUT/corral-decode-$2-$3.txt" 2>&1 || log "corral decode $2 $3 failed: $?"
}

for m in $MODELS; do
  config="$(config_of "$m")" name="$(basename "$(config_of "$m")" .json)"
  file="$GGUF_DIR/$name-q4_k_m.gguf"
  if [ ! -s "$file" ]; then
    log "generating $file (free: $(df -h --output=avail "$GGUF_DIR" | tail -1))"
    start=$SECONDS
    PYTHONPATH="$GGUF_PY${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/make_bench_gguf_q4km.py \
      "$config" "$file" 2>&1 | tee "$OUT/gen-$name.log"
    [ -s "$file" ] || { log "generation of $file failed"; continue; }
    log "generated in $((SECONDS - start)) s"
  fi
  for round in $(seq 1 "$ROUNDS"); do
    tag="$name-$round"
    if [ $((round % 2)) -eq 1 ]; then
      llama "$file" "$tag"; corral "$file" vulkan "$tag"; corral "$file" cuda "$tag"
    else
      corral "$file" cuda "$tag"; corral "$file" vulkan "$tag"; llama "$file" "$tag"
    fi
  done
  [ "$KEEP" = 1 ] || rm -f "$file"
done

python3 - "$OUT" "$ROUNDS" "$LENS" "$GEN" > "$OUT/summary.txt" <<'PY'
import glob, json, os, statistics, sys
out, rounds, lens, gen = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
def med(v):
    return statistics.median(v) if v else float("nan")
names = sorted({os.path.basename(p)[len("llama-"):-len("-1.json")]
                for p in glob.glob(f"{out}/llama-*-1.json") if "-d512-" not in p}
               | {os.path.basename(p)[len("corral-prefill-vulkan-"):-len("-1.json")]
                  for p in glob.glob(f"{out}/corral-prefill-vulkan-*-1.json")})
print("tok/s, median of the rounds (each round's value: llama-bench avg_ts of -r reps, Corral's "
      "median of --reps); llama tg is at depth 0 (-n) and 512 (-d 512); Corral decode at "
      "context 512, batch 1")
head = f"{'model':22} {'test':7} {'llama vk':>9} {'corral vk':>9} {'corral cuda':>11} {'vk/llama':>8} {'vk/cuda':>8}"
for name in names:
    print(); print(head)
    for test in [f"pp{n}" for n in lens] + [f"tg{gen}", f"tg{gen}@d512"]:
        ll, vk, cu = [], [], []
        for r in range(1, rounds + 1):
            path = f"{out}/llama-d512-{name}-{r}.json" if "@" in test else f"{out}/llama-{name}-{r}.json"
            for row in load(path) or []:
                t = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
                if row.get("n_depth", 0):
                    t += f"@d{row['n_depth']}"
                if t == test:
                    ll.append(row["avg_ts"])
            for dev, acc in (("vulkan", vk), ("cuda", cu)):
                if test.startswith("tg"):
                    if "@" not in test:
                        continue
                    d = load(f"{out}/corral-decode-{dev}-{name}-{r}.json")
                    acc.extend(x["tok_s"] for x in (d or {}).get("rows", [])[:1])
                else:
                    d = load(f"{out}/corral-prefill-{dev}-{name}-{r}.json")
                    acc.extend(x["prefill_tok_s"] for x in (d or {}).get("rows", [])
                               if x["prompt_tokens"] == int(test[2:]))
        l, v, c = med(ll), med(vk), med(cu)
        print(f"{name:22} {test:7} {l:9.1f} {v:9.1f} {c:11.1f} {v / l:8.2f} {v / c:8.2f}")
PY
cat "$OUT/summary.txt"
log "done"
}

case "${1:-}" in
  glslc) glslc ;;
  build) build ;;
  remote) shift; remote "$@" ;;
  *) echo "usage: $0 glslc | build | remote [30b] [35b]" >&2; exit 2 ;;
esac
