#!/usr/bin/env bash
# GPU check: export -> build-engines -> greedy exactness (speculative == plain) -> short bench, per backend.
#
#   scripts/gpu_check.sh [MODEL]     MODEL: HF folder/id or .gguf (default: a small random Llama made here)
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

exec timeout 600 "$PY" - "${backends[*]}" "$MODEL" <<'EOF'
import sys, tempfile, time
from pathlib import Path

from specdec_edge import Pipeline
from specdec_edge.export.exporter import export_bundle

backends, model = sys.argv[1].split(), sys.argv[2]
work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
if not model:
    sys.path.insert(0, ".")
    from tests.tiny_models import make_model
    model = str(make_model(work / "model", "llama", layers=4, hidden_size=256, intermediate_size=512,
                           num_attention_heads=8, num_key_value_heads=2))
t0 = time.perf_counter()
bundles = {"ort": export_bundle(model, work / "ort", capacity=1024, progress=False),
           "portable": export_bundle(model, work / "portable", flavour="portable", dtype="fp16", capacity=1024,
                                     progress=False)}
print(f"export: {time.perf_counter() - t0:.1f} s")
build = {}
if {"tensorrt", "trt"} & set(backends):
    from specdec_edge.export.trt_build import build_engines
    for b in ("trt", "tensorrt"):
        if b in backends:
            t0 = time.perf_counter()
            try:
                build_engines(bundles["portable"], backends=(b,), max_verify=16, echo=lambda s: None)
            except Exception as e:  # the load below reports it in the table
                print(f"build-engines --backend {b} failed: {e}")
            build[b] = time.perf_counter() - t0

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):", "Summarize the following article in three sentences."]
rows, failed = [], False
runs = [("cpu", "ort")] + [(b, f) for b in backends for f in (("ort", "portable") if b == "cuda" else ("portable",))]
for b, flavour in runs:
    bundle = bundles[flavour]
    try:
        spec = Pipeline.load(bundle, provider=b, method="pld", k=4)
    except Exception as e:  # report every backend, then fail
        rows.append((b, flavour, "-", f"load failed: {e}", "-", "-", "-"))
        failed = True
        continue
    plain = spec.with_method("plain")
    plain.generate(PROMPTS[0], max_new_tokens=8)  # warm-up
    same, times, tokens = True, {"plain": 0.0, "pld": 0.0}, {"plain": 0, "pld": 0}
    for prompt in PROMPTS:
        for name, pipe in (("plain", plain), ("pld", spec)):
            t0 = time.perf_counter()
            out = pipe.generate(prompt, max_new_tokens=96)
            times[name] += time.perf_counter() - t0
            tokens[name] += len(out.token_ids)
            if name == "plain":
                ref = out.token_ids
            elif out.token_ids != ref:
                same = False
    failed |= not same
    rate = {n: tokens[n] / times[n] for n in times}
    rows.append((b, flavour, f"{build.get(b, 0):.1f}", "yes" if same else "NO", f"{rate['plain']:.1f}",
                 f"{rate['pld']:.1f}", f"{rate['pld'] / rate['plain']:.2f}x"))
head = ("backend", "bundle", "build s", "greedy pld == plain", "plain tok/s", "pld tok/s", "speedup")
print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
for r in rows:
    print("| " + " | ".join(r) + " |")
sys.exit(1 if failed else 0)
EOF
