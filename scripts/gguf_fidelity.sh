#!/usr/bin/env bash
# Each GGUF format's error against the file's exact reference, Corral beside llama.cpp's CPU
# build on the same files (scripts/gguf_fidelity.py says how): builds llama.cpp as
# scripts/llama_cpp_side_by_side.sh does (in $WORK, default /tmp/llama-side), the logits tool
# scripts/llama_logits.cpp against it, and corral; then runs the comparison in the fixture
# venv (VENV, default ../venv-ref: scripts/requirements-fixtures.txt plus gguf).
#
#   scripts/gguf_fidelity.sh            the table, also written to $WORK/fidelity/fidelity.md
#   scripts/gguf_fidelity.sh hybrid     the hybrid fixtures' table (llama.cpp / Corral, median
#                                       position), also in $WORK/fidelity/fidelity-hybrid.md
#
# Nothing of llama.cpp enters this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/llama-side}"
VENV="${VENV:-../venv-ref}"
export WORK
if [ ! -x "$WORK/build/bin/llama-quantize" ]; then
  scripts/llama_cpp_side_by_side.sh build
fi
mkdir -p "$WORK/fidelity"
g++ -O2 -std=c++17 scripts/llama_logits.cpp -o "$WORK/fidelity/llama-logits" \
  -I "$WORK/src/include" -I "$WORK/src/ggml/include" -L "$WORK/build/bin" \
  -lllama -lggml -lggml-base -Wl,-rpath,"$WORK/build/bin"
cargo build --release --quiet -p corral-cli
"$VENV/bin/python" scripts/gguf_fidelity.py "$WORK/fidelity" "$WORK/src" "$WORK/build/bin" \
  target/release/corral "$@"
