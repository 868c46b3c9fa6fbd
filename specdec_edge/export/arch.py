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
    rope_by_layer_type: bool = False  # the rotary tables differ by layer type (the model's rotary_emb takes it)


LLAMA = ArchSpec("llama", ("llama", "mistral", "qwen2"))
GEMMA3 = ArchSpec(
    "gemma3",
    ("gemma3_text",),
    norm_offset=1.0,
    qk_norm=True,
    sandwich_norm=True,
    embed_scale=True,
    activation="gelu_tanh",
    rope_by_layer_type=True,
)

REGISTRY = {a.name: a for a in (LLAMA, GEMMA3)}

# Which layers apply ``config.sliding_window``, per model type, as transformers' modeling files do: "none" (the
# attention has no window: a value in the config is ignored), "every_layer" (Mistral), "layer_types" (the layers
# that config.layer_types marks "sliding_attention": Qwen2 sets them from use_sliding_window, Gemma 3 alternates).
WINDOW_RULES = {"llama": "none", "mistral": "every_layer", "qwen2": "layer_types", "gemma3_text": "layer_types"}


def attention_windows(config, model_type: str, capacity: int) -> tuple[list[str], int | None]:
    """(layer types, window) of a transformers text config: each layer "full_attention" or "sliding_attention", and
    the window the sliding layers attend within, None where it cannot matter (no sliding layer, or a window of at
    least ``capacity`` keys: no query ever sees that far back)."""
    rule = WINDOW_RULES.get(model_type)
    if rule is None:  # a new model type must say how it applies a window before it can be exported
        raise ExportError(f"no sliding-window rule for model type {model_type!r}: add it to arch.WINDOW_RULES.")
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if rule == "every_layer":
        types = ["sliding_attention" if window else "full_attention"] * layers
    else:
        given = getattr(config, "layer_types", None) if rule == "layer_types" else None
        types = ["sliding_attention" if t == "sliding_attention" else "full_attention" for t in given or [""] * layers]
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise ExportError(
            f"the config marks sliding-window layers but its sliding_window is {window!r}: set it to the window "
            "the model was trained with (a positive integer)."
        )
    if "sliding_attention" not in types or window >= capacity:
        window = None
    return types, window


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
