"""Engines that run bundle graphs (ONNX Runtime on CPU, CUDA or TensorRT execution providers; TensorRT).

Light: imports numpy and onnxruntime only; ``open_engine`` imports a GPU engine when it is chosen.
Warns at import when several ONNX Runtime packages (e.g. onnxruntime and onnxruntime-gpu) are installed.
"""

from specdec_edge.runtime.base import causal_bias
from specdec_edge.runtime.ort_engine import OrtEngine, StepOutput
from specdec_edge.runtime.providers import BACKENDS, open_engine, warn_on_package_conflict

warn_on_package_conflict()

__all__ = ["BACKENDS", "OrtEngine", "StepOutput", "causal_bias", "open_engine"]
