#!/usr/bin/env bash
# Qwen's official chat templates (Qwen3-0.6B, Qwen3-Coder, Qwen3.5-4B), for the template
# parity test: taken from the llama.cpp copy vendored in llama-cpp-python's source release on
# PyPI (checked against its SHA-256), into DIR (default target/qwen-templates). Nothing is
# committed; a second run with the files present does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-target/qwen-templates}"
templates=(Qwen-Qwen3-0.6B.jinja Qwen3-Coder.jinja Qwen3.5-4B.jinja)
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
missing=0
for t in "${templates[@]}"; do [ -f "$dir/$t" ] || missing=1; done
[ "$missing" = 0 ] && exit 0
mkdir -p "$dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
  "llama-cpp-python==$version" -d "$work"
archive="$work/llama_cpp_python-$version.tar.gz"
echo "$sha256  $archive" | sha256sum --check --quiet
prefix="llama_cpp_python-$version/vendor/llama.cpp/models/templates"
tar -xzf "$archive" -C "$work" "${templates[@]/#/$prefix/}"
for t in "${templates[@]}"; do cp "$work/$prefix/$t" "$dir/$t"; done
echo "templates in $dir"
