#!/usr/bin/env bash
# GPU check: export -> build-engines -> greedy exactness (speculative == plain) -> short bench, per backend.
#
#   scripts/gpu_check.sh [MODEL]     MODEL: HF folder/id or .gguf (default: random weights in SmolLM2-135M's shape, made here)
#
# Backends: cuda (onnxruntime-gpu CUDA EP), tensorrt (ONNX Runtime TensorRT EP + EPContext engines),
# trt (TensorRT Python API + cuda-python). Each one whose packages are present is checked; without an
# NVIDIA GPU or without any backend the script lists what is missing and exits 1. Whole run: < 10 min.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=${1:-}

missing=()
have() { "$PY" -c "$1" >/dev/null 2>&1; }
gpu=1 export_ok=1 backends=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  gpu=0; missing+=("an NVIDIA GPU with its driver (nvidia-smi)")
fi
if ! have "import torch, transformers"; then
  export_ok=0; missing+=("the export extra (pip install -e '.[export]')")
fi
if have "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"; then
  backends+=(cuda)
else
  missing+=("onnxruntime-gpu with CUDAExecutionProvider (backend cuda): replace onnxruntime with onnxruntime-gpu")
fi
if have "import tensorrt"; then
  if have "import onnxruntime as o; assert 'TensorrtExecutionProvider' in o.get_available_providers()"; then
    backends+=(tensorrt)
  else
    missing+=("onnxruntime-gpu with TensorrtExecutionProvider (backend tensorrt)")
  fi
  if have "from cuda.bindings import runtime" || have "from cuda import cudart"; then
    backends+=(trt)
  else
    missing+=("cuda-python (backend trt): pip install cuda-python")
  fi
else
  missing+=("the tensorrt Python package (backends tensorrt, trt): pip install tensorrt, or JetPack's python3-libnvinfer")
fi
for m in "${missing[@]}"; do echo "missing: $m"; done
if (( !gpu || !export_ok || ${#backends[@]} == 0 )); then
  echo "gpu_check: cannot run here (see 'missing' above); nothing was checked." >&2
  exit 1
fi
echo "gpu_check: backends ${backends[*]} on $(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -1)"

exec timeout 600 "$PY" scripts/gpu_check.py "${backends[*]}" "$MODEL"
