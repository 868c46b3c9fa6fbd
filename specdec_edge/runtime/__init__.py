"""Engines that run bundle graphs (ONNX Runtime on CPU, CUDA or TensorRT execution providers; TensorRT).

Imports run one way: ``base`` (the engine contract) <- ``sessions`` <- ``trt_profiles``,
``prebuilt`` <- the engines (``ort_engine``, ``ort_gpu_engine``, ``tensorrt_engine``) and
``head_graphs`` <- ``factory`` (``open_engine``).

Light: numpy and onnxruntime only. The names below load on first use, so that importing the
engine contract (``runtime.base``) does not load ONNX Runtime; ``open_engine`` imports a GPU
engine when it is chosen. ``sessions`` warns at import when several ONNX Runtime packages
(e.g. onnxruntime and onnxruntime-gpu) are installed.
"""

import importlib

_EXPORTS = {
    "BACKENDS": "base",
    "Engine": "base",
    "OrtEngine": "ort_engine",
    "StepOutput": "base",
    "causal_bias": "base",
    "open_engine": "factory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specdec_edge.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
