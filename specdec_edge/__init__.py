"""specdec-edge: exact speculative decoding for local LLMs.

The light runtime (this package minus ``specdec_edge.export``) needs only numpy,
onnxruntime, tokenizers, jinja2 and click. ``Pipeline`` and ``LoadSettings`` are imported lazily so that
``import specdec_edge`` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["LoadSettings", "Pipeline", "SpecdecError", "__version__"]

from specdec_edge.errors import SpecdecError


def __getattr__(name):
    if name == "Pipeline":
        from specdec_edge.api.pipeline import Pipeline

        return Pipeline
    if name == "LoadSettings":
        from specdec_edge.api.settings import LoadSettings

        return LoadSettings
    raise AttributeError(name)
