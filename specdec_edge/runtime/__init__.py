"""Engines that run bundle graphs (ONNX Runtime on CPU, CUDA or TensorRT execution providers).

Light: imports numpy and onnxruntime only.
"""

from specdec_edge.runtime.ort_engine import OrtEngine, StepOutput, causal_bias

__all__ = ["OrtEngine", "StepOutput", "causal_bias"]
