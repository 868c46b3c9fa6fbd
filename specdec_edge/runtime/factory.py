"""Backend selection: ``open_engine`` picks the engine that runs a bundle graph.

``provider`` (``Pipeline.load(provider=...)``, ``--provider``) picks one backend:

=============  ==========================================================  ======================
provider       engine                                                      needs
=============  ==========================================================  ======================
``cpu``        ``OrtEngine``: ONNX Runtime CPU EP, numpy-backed cache      ``onnxruntime``
``cuda``       ``OrtGpuEngine``: ONNX Runtime CUDA EP, cache on the GPU    ``onnxruntime-gpu``
``tensorrt``   ``OrtGpuEngine``: ONNX Runtime TensorRT EP (portable graph) ``onnxruntime-gpu`` +
                                                                           TensorRT libraries
``trt``        ``TensorRTEngine``: TensorRT directly, a prebuilt engine    ``tensorrt``,
               from ``specdec-edge build-engines``                         ``cuda-python``
``trt-rtx``    ``TensorRTEngine``: TensorRT-RTX directly (RTX GPUs), a     ``tensorrt_rtx``,
               prebuilt engine (``build-engines --backend trt-rtx``)       ``cuda-python``
=============  ==========================================================  ======================

Every engine is a ``runtime.base.CachedEngine`` and so implements ``runtime.base.Engine``, the one interface the
decode loop sees. The modules below this one: ``base`` (the contract and the base class), ``sessions`` (ONNX
Runtime sessions and providers), ``trt_libraries``, ``trt_profiles`` and ``prebuilt`` (TensorRT and TensorRT-RTX,
shapes, prebuilt engines), then the engines. Light: numpy and onnxruntime only; the GPU engines are imported
when chosen.
"""

from __future__ import annotations

from pathlib import Path

from specdec_edge.bundle.schema import GraphSpec
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import BACKENDS, DEFAULT_GPU, CachedEngine, GpuOptions, check_cache_memory
from specdec_edge.runtime.ort_engine import OrtEngine
from specdec_edge.runtime.threads import DEFAULT_THREADS, CpuThreads


def open_engine(
    root: Path,
    graph: GraphSpec,
    *,
    provider: str = "cpu",
    cpu: CpuThreads = DEFAULT_THREADS,
    gpu: GpuOptions = DEFAULT_GPU,
    share_process: bool = False,
    role: str = "target",
) -> CachedEngine:
    """The engine of ``provider`` over one bundle graph (see the table in this module's docstring).

    ``cpu``: CPU threads (``runtime/threads.py``: by default every CPU session of the process shares one
    spinning pool; GPU engines take its thread count for their CPU fallback ops). ``share_process`` (GPU
    engines only): other sessions run in this process, so the session's CPU fallback pool does not spin.
    ``gpu``: ``pad_to``, GPU engines pad narrower passes to this many rows so that speculative and plain
    decoding round alike (``ort_gpu_engine``; default 32, 0 = off; the CPU engine needs no padding);
    ``cuda_graph`` (provider ``cuda``), replay decode passes as one captured CUDA graph.
    """
    if provider not in BACKENDS:
        raise SpecdecError(f"unknown provider {provider!r}; choose one of {', '.join(BACKENDS)}.")
    if gpu.cuda_graph and provider != "cuda":
        raise SpecdecError(
            f"CUDA graphs are an option of provider 'cuda' (ONNX Runtime's CUDA EP), not {provider!r}; "
            "drop cuda_graph or use provider='cuda'."
        )
    check_cache_memory(graph, root / graph.path)  # before any session or buffer
    engine = BACKENDS[provider]
    if engine == "OrtEngine":
        return OrtEngine(root / graph.path, graph, provider=provider, cpu=cpu)
    if engine == "TensorRTEngine":
        from specdec_edge.runtime.tensorrt_engine import TensorRTEngine

        return TensorRTEngine.from_bundle(root, role, graph, gpu.pad_to, backend=provider)
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine

    return OrtGpuEngine.from_bundle(
        root, role, graph, provider=provider, threads=cpu.threads, share_process=share_process, gpu=gpu
    )
