#!/usr/bin/env bash
# The official openai and anthropic Python clients against `corral serve` (see
# check_openai.py and check_anthropic.py). Installs the pinned clients into
# target/openai-venv on first use (and when a pin is missing there).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/openai-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import openai, anthropic, langchain_openai" 2>/dev/null; then
  "$venv/bin/pip" install --quiet -r tests/openai_client/requirements.txt
fi
cargo build --quiet -p corral-cli
"$venv/bin/python" tests/openai_client/check_openai.py target/debug/corral models/tiny-qwen3-moe
"$venv/bin/python" tests/openai_client/check_anthropic.py target/debug/corral models/tiny-qwen3-moe
