#!/usr/bin/env bash
# The training pipeline's unit tests (markup cleaners, held-out split, tokenizer, tuning data and rows),
# in target/train-venv with the pinned tokenizers package; the pipeline itself needs torch and
# runs on the GPU machine, not here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv=target/train-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import tokenizers" 2>/dev/null; then
  "$venv/bin/pip" install --quiet -r scripts/train/requirements-test.txt
fi
"$venv/bin/python" -m unittest discover -s scripts/train/tests
