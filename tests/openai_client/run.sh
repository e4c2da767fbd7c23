#!/usr/bin/env bash
# The official openai Python client against `corral serve` (see check_openai.py).
# Installs the pinned client into target/openai-venv on first use.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/openai-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r tests/openai_client/requirements.txt
fi
cargo build --quiet -p corral-cli
"$venv/bin/python" tests/openai_client/check_openai.py target/debug/corral models/tiny-qwen3-moe
