"""Heavy side: load Hugging Face / GGUF models, build ONNX decoder graphs, validate, quantize, write bundles.

Needs the ``export`` extra (torch, transformers, onnx, gguf). Nothing in the light
runtime imports this package, except ``default_model`` (light) from `specdec-edge demo`: it finds the cached
default bundle and imports the exporter only when it must export it.
"""
