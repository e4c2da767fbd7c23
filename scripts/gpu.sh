#!/usr/bin/env bash
# The GPU checks and measurements, in two halves.
#
#   scripts/gpu.sh prepare   here (no GPU needed): builds the release binary and the GPU test
#                            binaries and puts them in .gpu/ (git-ignored), with what the
#                            runs read. The Vulkan backend's cooperative-matrix kernels need
#                            a glslc that knows them: GLSLC="$(scripts/
#                            llama_cpp_vulkan_side_by_side.sh glslc)" where the system's is
#                            Debian bookworm's.
#   scripts/gpu.sh remote    on the GPU machine, from the repository root with .gpu/ beside
#                            it: runs the GPU tests, then the benchmarks, writing logs and JSON
#                            to $OUT (default: .gpu/out). STAGES picks parts: tests,run,prefill,
#                            prefill-recurrent,decode,decode-serial,serve,serve-long,sessions (default: all but
#                            prefill-recurrent, which repeats prefill with
#                            CORRAL_RECURRENT_DELTA_RULE=1, and decode-serial, which repeats
#                            decode with CORRAL_SERIAL_LAUNCHES=1, and serve-long: served
#                            long prompts under MEMORY, LONG_PROMPT, PER_PROMPT and PREFILL_CHUNK,
#                            and sessions: the 3-session replay, PREFIX_CACHE on or off, and
#                            speculative: verify steps of DRAFTS tokens against the one-token
#                            step, then the VARIANTS end to end at ACCEPTANCE, forced, with
#                            WEIGHTS synthetic weights, PROMPTS prompts ending with ECHO of
#                            their own tokens again, CONCURRENCY levels of that many at once, and ab: prefill and decode of AB_MODELS
#                            by the binary BASE and this build, interleaved for AB_ROUNDS
#                            rounds, and vulkan: a greedy run and a fixture's prefill on the
#                            GPU's Vulkan driver); TEST_LOGS puts the
#                            test logs elsewhere; MODEL picks the synthetic config; the serve
#                            stage takes MAX_BATCH, SERVE_CONCURRENCY, SERVE_REQUESTS,
#                            SERVE_MAX_TOKENS, PROMPT_TOKENS and HANGUPS, and it and sessions
#                            DEVICE (default cuda; vulkan too); the prefill stage
#                            PREFILL_LENS, PREFILL_STRATEGIES, REPS, CHUNK; prefill, decode and
#                            serve-long KV_DTYPE. CORRAL runs another
#                            build of corral; TAG names its results (prefill-TAG.json, ...).
#
# The test binaries find the fixtures through the path they were built at; `remote` links
# that path to the repository when it differs.
set -euo pipefail
cd "$(dirname "$0")/.."

prepare() {
  cargo build --release -p corral-cli
  mkdir -p .gpu/bin
  cp target/release/corral .gpu/bin/
  cargo test --release --no-run --message-format=json \
      -p corral-device --test cuda_backend --test conformance \
      -p corral-model --test gpu_conformance --test expert_reads --test fp8_checkpoint \
      --test vulkan_conformance 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' \
    | while read -r exe; do cp "$exe" ".gpu/bin/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"; done
  strip .gpu/bin/* 2>/dev/null || true
  echo "$(pwd)" > .gpu/built-at
  du -sh .gpu
}

remote() {
  local out="${OUT:-.gpu/out}" stages="${STAGES:-tests,run,prefill,decode,serve}"
  mkdir -p "$out"
  local built
  built="$(cat .gpu/built-at)"
  if [ "$built" != "$(pwd)" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$(pwd)" "$built"
  fi
  export CORRAL_KERNEL_CACHE="$PWD/.gpu/kernel-cache"
  local corral="${CORRAL:-.gpu/bin/corral}" tag="${TAG:+-$TAG}"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
    | tee "$out/gpu.txt"
  has() { [[ ",$stages," == *",$1,"* ]]; }
  if has tests; then
    for t in conformance cuda_backend gpu_conformance expert_reads fp8_checkpoint \
        vulkan_conformance; do
      echo "== test $t"
      timeout 300 ".gpu/bin/$t" --test-threads=1 --nocapture 2>&1 | tee "${TEST_LOGS:-$out}/test-$t.log" \
        | grep -E "^test |test result|panicked|error|relative error" || true
    done
  fi
  if has run; then
    echo "== corral run on the GPU"
    timeout 120 $corral run --model models/tiny-qwen3-moe --device cuda --prompt "Hello" \
      --max-tokens 16 --temperature 0 2>&1 | tee "$out/run.log" | tail -12 || true
  fi
  if has vulkan; then
    # The Vulkan backend on the GPU's own driver: a greedy run and a fixture's prefill,
    # grouped against per-token (the tests stage runs its conformance when a loader is there).
    echo "== corral run on Vulkan"
    timeout 120 $corral run --model models/tiny-qwen3-moe --device vulkan --prompt "Hello" \
      --max-tokens 16 --temperature 0 2>&1 | tee "$out/run-vulkan.log" | tail -12 || true
    timeout 300 $corral bench prefill --model tests/fixtures/qwen3_5_moe_text --device vulkan \
      --prompt-lens 10,80 --strategies grouped,per-token --reps 3 --profile \
      --json "$out/prefill-vulkan-fixture.json" 2>&1 | tee "$out/prefill-vulkan-fixture.txt" \
      | tail -30 || true
  fi
  local model="${MODEL:-bench/configs/qwen3-30b-a3b.json}"
  prefill() {
    timeout 420 $corral bench prefill --synthetic "$model" --device cuda \
      --prompt-lens "${PREFILL_LENS:-10,32,300,2048}" --strategies "${PREFILL_STRATEGIES:-grouped,per-expert}" \
      --reps "${REPS:-5}" --idle-seconds 0 ${CHUNK:+--chunk "$CHUNK"} ${PROFILE:+--profile} \
      ${KV_DTYPE:+--kv-dtype "$KV_DTYPE"} \
      --json "$out/$1.json" 2>&1 | tee "$out/$1.txt" || true
  }
  if has prefill; then
    echo "== bench prefill"
    prefill "prefill$tag"
  fi
  if has prefill-recurrent; then
    echo "== bench prefill, the delta rule token by token"
    CORRAL_RECURRENT_DELTA_RULE=1 prefill prefill-recurrent
  fi
  decode() {
    timeout 420 $corral bench decode --synthetic "$model" --device cuda \
      --batch "${DECODE_BATCH:-1,8,32}" --context "${DECODE_CONTEXT:-512,8192}" \
      --strategies "${DECODE_STRATEGIES:-per-token,grouped,auto}" --graphs "${GRAPHS:-on,off}" \
      --steps "${STEPS:-16}" ${PROFILE:+--profile} ${KV_DTYPE:+--kv-dtype "$KV_DTYPE"} \
      --json "$out/$1.json" 2>&1 | tee "$out/$1.txt" || true
  }
  if has decode; then
    echo "== bench decode"
    decode "decode$tag"
  fi
  if has decode-serial; then
    echo "== bench decode, serial launches"
    CORRAL_SERIAL_LAUNCHES=1 decode decode-serial
  fi
  if has serve; then
    echo "== serve + bench serve"
    $corral serve --synthetic "$model" --tokenizer models/tiny-qwen3-moe --device "${DEVICE:-cuda}" \
      --port 18181 --max-batch "${MAX_BATCH:-32}" --kv-memory 16G \
      > "$out/serve.log" 2>&1 &
    local pid=$!
    if ! serving "$pid"; then
      echo "the server did not start:"; tail -5 "$out/serve.log"
      return 0
    fi
    timeout 300 $corral bench serve --url http://127.0.0.1:18181 \
      --concurrency "${SERVE_CONCURRENCY:-1,8,32}" --requests "${SERVE_REQUESTS:-64}" \
      --max-tokens "${SERVE_MAX_TOKENS:-64}" ${PROMPT_TOKENS:+--prompt-tokens "$PROMPT_TOKENS"} \
      ${HANGUPS:+--hangups "$HANGUPS"} --json "$out/serve.json" 2>&1 | tee "$out/serve.txt" || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  if has serve-long; then
    # C=1 with one prompt of LONG_PROMPT tokens, then C=8 with prompts of PER_PROMPT tokens,
    # under an explicit budget; GPU memory in use after each.
    local memory="${MEMORY:-96GiB}" chunk="${PREFILL_CHUNK:-8192}"
    echo "== serve under --memory $memory: C=1 at ${LONG_PROMPT:-131000} tokens, C=8 at ${PER_PROMPT:-32000}"
    # The engine's debug lines time each step.
    RUST_LOG=info,corral_engine=debug $corral serve --synthetic "$model" --tokenizer models/tiny-qwen3-moe \
      --device cuda --port 18181 --max-batch 8 --max-prefill-tokens "$chunk" --memory "$memory" \
      ${KV_DTYPE:+--kv-dtype "$KV_DTYPE"} > "$out/serve-long$tag.log" 2>&1 &
    local pid=$!
    if ! serving "$pid"; then
      echo "the server did not start:"; tail -5 "$out/serve-long$tag.log"
      return 0
    fi
    grep -E "memory budget|KV .* tokens" "$out/serve-long$tag.log" | cut -c1-400
    # The same plan as `corral plan` prints it (with the server's state checkpoints), to set
    # against the memory in use.
    local checkpoints
    checkpoints="$(grep -oE '[0-9]+ state checkpoints' "$out/serve-long$tag.log" | head -1 | cut -d' ' -f1)"
    $corral plan --synthetic "$model" --memory "$memory" --concurrency 8 --device cuda \
      ${KV_DTYPE:+--kv-dtype "$KV_DTYPE"} --prefill-chunk "$chunk" --sessions "${checkpoints:-0}" 2>&1 \
      | tee "$out/serve-long-plan$tag.txt"
    used() { echo "GPU memory in use $1: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"; }
    used "after start"
    for level in "1 ${LONG_PROMPT:-131000} c1" "8 ${PER_PROMPT:-32000} c8"; do
      set -- $level
      timeout 300 $corral bench serve --url http://127.0.0.1:18181 --concurrency "$1" --requests "$1" \
        --max-tokens 16 --stream-fraction 1 --prompt-tokens "$2" --json "$out/serve-long-$3$tag.json" 2>&1 \
        | tee "$out/serve-long-$3$tag.txt" || true
      used "after C=$1"
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  if has speculative; then
    # Verify steps (1 + K tokens a sequence, every row's logits read back) against the
    # one-token step, then one sequence decoding with the synthetic MTP head, each draft token
    # taken with probability ACCEPTANCE whatever the model samples (random drafts mean
    # nothing): the tokens a second speculation gives at that acceptance.
    local weights="${WEIGHTS:-float}"
    echo "== bench decode, verify steps ($weights weights)"
    timeout 300 $corral bench decode --synthetic "$model" --synthetic-weights "$weights" --device cuda \
      --batch "${DECODE_BATCH:-1,8}" --context 512 --draft-tokens "${DRAFTS:-0,1,2,3,4}" \
      --steps "${STEPS:-16}" --json "$out/verify-$weights$tag.json" 2>&1 | tee "$out/verify-$weights$tag.txt" || true
    echo "== bench speculative, forced acceptance ${ACCEPTANCE:-0.8} ($weights weights)"
    timeout 300 $corral bench speculative --synthetic "$model" --synthetic-weights "$weights" --device cuda \
      --prompts "${PROMPTS:-4}" --prompt-tokens 512 --echo "${ECHO:-0}" --max-tokens 128 --reps "${REPS:-2}" \
      --speculative "${VARIANTS:-off,mtp:1:fixed,mtp:2:fixed,mtp:3:fixed,mtp:4:fixed,mtp:4}" --forced-acceptance "${ACCEPTANCE:-0.8}" \
      ${CONCURRENCY:+--concurrency "$CONCURRENCY"} \
      --json "$out/speculative-$weights$tag.json" 2>&1 | tee "$out/speculative-$weights$tag.txt" || true
  fi
  if has ab; then
    # The build before against this one, interleaved (base, new, base, new, ...) so that
    # drift of the clocks falls on both: prefill and decode on each of AB_MODELS, BASE the
    # baseline binary, AB_ROUNDS rounds.
    local base="${BASE:-.gpu/base/corral}"
    for m in ${AB_MODELS:-bench/configs/qwen3-30b-a3b.json bench/configs/qwen3.5-35b-a3b.json}; do
      local name
      name="$(basename "$m" .json)"
      for round in $(seq 1 "${AB_ROUNDS:-2}"); do
        for side in base new; do
          local bin="$corral"
          [ "$side" = base ] && bin="$base"
          echo "== ab $name round $round: $side"
          timeout 300 "$bin" bench prefill --synthetic "$m" --device cuda --prompt-lens 10,300,2048 \
            --strategies auto --reps 3 --idle-seconds 0 \
            --json "$out/ab-prefill-$name-$side-$round.json" 2>&1 | tail -6 || true
          timeout 300 "$bin" bench decode --synthetic "$m" --device cuda --batch 1,8,32 \
            --context 512 --strategies auto --graphs on --steps 16 \
            --json "$out/ab-decode-$name-$side-$round.json" 2>&1 | tail -6 || true
        done
      done
    done
  fi
  if has sessions; then
    # Three interleaved agent sessions, each revisit against its new text alone.
    echo "== serve + bench sessions, prefix cache ${PREFIX_CACHE:-on}"
    $corral serve --synthetic "$model" --tokenizer models/tiny-qwen3-moe --device "${DEVICE:-cuda}" \
      --port 18181 --max-batch 32 --kv-memory 16G --prefix-cache "${PREFIX_CACHE:-on}" \
      > "$out/sessions-serve$tag.log" 2>&1 &
    local pid=$!
    if ! serving "$pid"; then
      echo "the server did not start:"; tail -5 "$out/sessions-serve$tag.log"
      return 0
    fi
    timeout 400 $corral bench sessions --url http://127.0.0.1:18181 --sessions 3 \
      --turns "${TURNS:-6}" --system-words 2000 --tool-words 300 --reply-tokens 32 \
      --json "$out/sessions$tag.json" 2>&1 | tee "$out/sessions$tag.txt" || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
}

# Waits until the server of pid $1 answers /health (true), or has exited or taken 240 s (false).
serving() {
  for _ in $(seq 1 240); do
    kill -0 "$1" 2>/dev/null || return 1
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:18181/health', timeout=2)" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

case "${1:-}" in
  prepare) prepare ;;
  remote) remote ;;
  *) echo "usage: scripts/gpu.sh prepare|remote" >&2; exit 2 ;;
esac
