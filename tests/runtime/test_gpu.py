"""The NVIDIA backends on real hardware: tests marked `gpu`/`trt` skip themselves, with the reason,
where no NVIDIA GPU or TensorRT is present (tests/conftest.py). scripts/gpu_check.sh runs them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from specdec_edge import Pipeline
from specdec_edge.bundle.hashes import verify_bundle
from specdec_edge.bundle.manifest import read_manifest
from specdec_edge.runtime.base import GpuOptions
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine
from specdec_edge.runtime.threads import CpuThreads
from tests.runtime.test_backends_cpu import drive


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["ort-fp16", "portable"])
@pytest.mark.parametrize("pad_to", [0, 16])
def test_cuda_engine_matches_cpu(which, pad_to, ort_fp16_bundle, portable_bundle):
    bundle = ort_fp16_bundle if which == "ort-fp16" else portable_bundle
    graph = read_manifest(bundle).target.graph
    want = drive(OrtEngine(bundle / graph.path, graph, cpu=CpuThreads(1)))
    got = drive(OrtGpuEngine(bundle / graph.path, graph, provider="cuda", gpu=GpuOptions(pad_to=pad_to)))
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


@pytest.mark.gpu
def test_cuda_prompt_cache_restores_a_context_from_host_memory(ort_fp16_bundle):
    """The CUDA EP's device cache snapshotted to the host and restored (its slot graphs on the GPU)."""
    pipe = Pipeline.load(ort_fp16_bundle, provider="cuda", method="plain", prompt_cache_mb=64)
    docs = ["The quick brown fox jumps over the lazy dog. " * 6, "Speculative decoding verifies tokens. " * 6]
    want = [pipe.generate(d, max_new_tokens=16, reuse=False).token_ids for d in docs]
    got = [pipe.generate(d, max_new_tokens=16) for d in (*docs, docs[0])]
    assert [g.token_ids for g in got] == [*want, want[0]]
    assert pipe.engines.target.can_snapshot and got[2].stats.restored_tokens > 0


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


@pytest.mark.gpu
def test_cuda_graph_decoding_matches_the_cuda_engine(ort_fp16_bundle):
    """Fixed-shape passes replayed as one CUDA graph: logits as without it (fp16 tolerance), every decode pass
    in the graph, and greedy pld / lookahead output equal to plain output with and without graphs."""
    graph = read_manifest(ort_fp16_bundle).target.graph
    want = drive(OrtGpuEngine(ort_fp16_bundle / graph.path, graph, provider="cuda"))
    engine = OrtGpuEngine(ort_fp16_bundle / graph.path, graph, provider="cuda", gpu=GpuOptions(cuda_graph=True))
    got = drive(engine)
    for a, b in zip(want, got):
        assert np.abs(a - b).max() <= 3e-2 * np.abs(a).max()
    assert engine.fixed_passes == engine.passes
    plain = Pipeline.load(ort_fp16_bundle, provider="cuda", method="plain")
    graphed = Pipeline.load(ort_fp16_bundle, provider="cuda", method="plain", cuda_graph=True)
    for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
        want = plain.generate(prompt, max_new_tokens=24).token_ids
        assert graphed.generate(prompt, max_new_tokens=24).token_ids == want
        for method in ("pld", "lookahead"):
            assert graphed.with_method(method).generate(prompt, max_new_tokens=24).token_ids == want


@pytest.mark.gpu
@pytest.mark.trt_rtx
def test_trt_rtx_engine_builds_loads_and_is_exact(tmp_path, portable_bundle):
    """TensorRT-RTX on this GPU; where its support matrix leaves the GPU out (Hopper), the refusal is the result."""
    from specdec_edge.errors import SpecdecError
    from specdec_edge.export.build_engines import build_engines
    from specdec_edge.runtime.prebuilt import gpu_info
    from specdec_edge.runtime.trt_libraries import RTX_COMPUTE_CAPABILITIES

    bundle = Path(shutil.copytree(portable_bundle, tmp_path / "bundle"))
    cc = gpu_info()["compute_capability"]
    try:
        build_engines(bundle, backends=("trt-rtx",), max_verify=16)
    except SpecdecError as e:
        if cc not in RTX_COMPUTE_CAPABILITIES:
            pytest.skip(f"TensorRT-RTX refused compute capability {cc}: {e}")
        raise
    pipe = Pipeline.load(bundle, provider="trt-rtx", method="pld", k=4)
    plain = pipe.with_method("plain")
    for prompt in ("The quick brown fox The quick brown fox", "def add(a, b):"):
        assert pipe.generate(prompt, max_new_tokens=32).token_ids == plain.generate(prompt, max_new_tokens=32).token_ids
