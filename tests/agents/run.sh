#!/usr/bin/env bash
# Agent CLIs against `corral serve` (see check_agents.py): installs the pinned clients from
# their registries (npm, PyPI) into target/agents on first use (and when a pin changes),
# builds corral, and runs each client headless for one turn. Arguments pick clients by name
# (default: all). Needs Qwen's templates (scripts/fetch_templates.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
clients=target/agents
mkdir -p "$clients"
npm_pins=(
  @anthropic-ai/claude-code@2.1.197
  @openai/codex@0.171.0
  @qwen-code/qwen-code@0.15.10
  opencode-ai@1.18.33
  @continuedev/cli@1.5.47
)
aider_pin=aider-chat==0.86.2
if [ ! -f "$clients/npm-pins" ] || [ "$(cat "$clients/npm-pins")" != "${npm_pins[*]}" ]; then
  # Scripts stay unrun (npm 11 asks before running them): the clients run without them.
  (cd "$clients" && npm install --ignore-scripts --no-audit --no-fund --no-save --prefix . "${npm_pins[@]}")
  echo "${npm_pins[*]}" > "$clients/npm-pins"
fi
if [ ! -x "$clients/aider-venv/bin/aider" ] || ! grep -qx "$aider_pin" "$clients/aider-pin" 2>/dev/null; then
  python3 -m venv "$clients/aider-venv"
  "$clients/aider-venv/bin/pip" install --quiet "$aider_pin"
  echo "$aider_pin" > "$clients/aider-pin"
fi
cargo build --quiet -p corral-cli
python3 tests/agents/check_agents.py target/debug/corral "$clients" "$@"
