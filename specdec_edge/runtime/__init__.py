"""Engines that run bundle graphs (ONNX Runtime on CPU, CUDA or TensorRT execution providers; TensorRT).

Imports run one way: ``base`` (the engine contract ``Engine`` and the engines' base class ``CachedEngine``) <-
``sessions`` <- ``trt_profiles``, ``prebuilt`` <- the engines (``ort_engine``, ``ort_gpu_engine``,
``tensorrt_engine``) and ``head_graphs`` <- ``factory`` (``open_engine``).

Light: numpy and onnxruntime only. Import names from their modules (``runtime.base.Engine``,
``runtime.factory.open_engine``, ...): importing the engine contract does not load ONNX Runtime, and
``open_engine`` imports a GPU engine when it is chosen. ``sessions`` warns at import when several
ONNX Runtime packages (e.g. onnxruntime and onnxruntime-gpu) are installed.
"""
