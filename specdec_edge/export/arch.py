"""Registry of supported architectures: a small declarative spec per model family.

The graph builder reads only these fields, so adding a Llama-like family is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec_edge.errors import ExportError


@dataclass(frozen=True)
class ArchSpec:
    name: str
    model_types: tuple  # transformers config.model_type values
    norm_offset: float = 0.0  # Gemma RMSNorm scales by (1 + w)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary
    sandwich_norm: bool = False  # extra norms after attention and around the MLP (Gemma 3)
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size)
    activation: str = "silu"  # "silu" | "gelu_tanh"
    sliding_window: bool = False  # some layers attend to a local window (config.layer_types)


LLAMA = ArchSpec("llama", ("llama", "mistral", "qwen2"))
GEMMA3 = ArchSpec(
    "gemma3",
    ("gemma3_text",),
    norm_offset=1.0,
    qk_norm=True,
    sandwich_norm=True,
    embed_scale=True,
    activation="gelu_tanh",
    sliding_window=True,
)

REGISTRY = {a.name: a for a in (LLAMA, GEMMA3)}


def supported_model_types() -> list[str]:
    return sorted(t for a in REGISTRY.values() for t in a.model_types)


def arch_for(model_type: str) -> ArchSpec:
    for arch in REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    raise ExportError(
        f"architecture {model_type!r} is not supported; supported model types: "
        f"{', '.join(supported_model_types())} (SmolLM2 is 'llama')."
    )
