"""The NVIDIA backends on real hardware: tests marked `gpu`/`trt` skip themselves, with the reason,
where no NVIDIA GPU or TensorRT is present (tests/conftest.py). scripts/gpu_check.sh runs them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle import read_manifest, verify_bundle
from specdec_edge.runtime import OrtEngine
from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine
from tests.test_backends_cpu import drive


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["ort-fp16", "portable"])
@pytest.mark.parametrize("pad_to", [0, 16])
def test_cuda_engine_matches_cpu(which, pad_to, ort_fp16_bundle, portable_bundle):
    bundle = ort_fp16_bundle if which == "ort-fp16" else portable_bundle
    graph = read_manifest(bundle).target.graph
    want = drive(OrtEngine(bundle / graph.path, graph, threads=1))
    got = drive(OrtGpuEngine(bundle / graph.path, graph, provider="cuda", pad_to=pad_to))
    tol = 1e-4 if graph.dtype == "fp32" else 3e-2  # fp32 with TF32 off; fp16 as the export's validation
    for a, b in zip(want, got):
        assert np.abs(a - b).max() <= tol * np.abs(a).max()


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["ort-fp16", "portable"])
def test_cuda_speculative_equals_plain(which, ort_fp16_bundle, portable_bundle):
    pipe = Pipeline.load(ort_fp16_bundle if which == "ort-fp16" else portable_bundle, provider="cuda")
    plain = pipe.with_method("plain")
    for method in ("pld", "lookahead"):
        spec = pipe.with_method(method)
        for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
            want = plain.generate(prompt, max_new_tokens=32).token_ids
            assert spec.generate(prompt, max_new_tokens=32).token_ids == want


@pytest.mark.trt
@pytest.mark.parametrize("provider", ["trt", "tensorrt"])
def test_tensorrt_engines_build_load_and_are_exact(provider, tmp_path, portable_bundle):
    from specdec_edge.export.build_engines import build_engines

    bundle = Path(shutil.copytree(portable_bundle, tmp_path / "bundle"))
    build_engines(bundle, backends=(provider,), max_verify=16)
    assert verify_bundle(bundle) == []
    pipe = Pipeline.load(bundle, provider=provider, method="pld", k=4)
    plain = pipe.with_method("plain")
    for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
        assert pipe.generate(prompt, max_new_tokens=32).token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
