"""One recipe per head method, read by both training (``train_draft.py``) and export (``head_export.py``).

A ``HeadRecipe`` says how a head is sized for a target, which torch module it is, how it is
trained (loss, default epochs), how it becomes an ONNX graph (wrapper, input/output names,
dynamic axes, validation inputs) and which tree settings a bundle records for it. Adding a head
method means adding a recipe to ``RECIPES``; tests/export/test_heads.py exports and validates each one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from specdec_edge.errors import ExportError
from specdec_edge.export.head_builder import build_head_graph
from specdec_edge.export.head_losses import eagle3_loss, eagle_loss, medusa_loss
from specdec_edge.export.head_modules import Eagle3Head, EagleHead, FrozenTarget, HeadConfig, MedusaHeads
from specdec_edge.export.head_onnx import (
    Eagle3Graph,
    EagleGraph,
    MedusaGraph,
    eagle3_examples,
    eagle_examples,
    medusa_examples,
)


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    # (hidden_size, vocab_size, draft_vocab, kv_heads, head_dim, medusa_heads, feature_layers=()) -> the head's
    # sizes for a target (``feature_layers``: the target graph's, which EAGLE-3 reads)
    config: Callable[..., HeadConfig]
    module: type[nn.Module]  # module(cfg, FrozenTarget) -> the head
    loss: Callable  # loss(head, seqs, batch_tokens) -> (loss, top-1 agreement); head_losses.py
    epochs: int  # the shipped heads' recipe (data/heads/README.md)
    # Manifest ``heads.<method>.tree``: the tree settings a pipeline uses unless told otherwise.
    tree: dict
    # The same for a target whose tree rows are not bit-identical to chains (quantized graphs): one branch.
    chain: dict
    graph: type[nn.Module]  # graph(head): what heads/<method>.onnx computes, traced into it unless ``build`` is set
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    examples: Callable[[HeadConfig], list[tuple]]  # graph inputs: the first is traced, all are validated
    reads_layers: bool = False  # reads the target's ``layer_features`` (EAGLE-3), not only its hidden states
    sizes: tuple[str, ...] = ()  # the HeadConfig sizes this module is built from (each at least 1)
    # build(head, table=...) -> the ONNX model, built op by op (``head_builder.py``: 8-bit layers, fused ops) instead
    # of traced from ``graph``; ``table``: the target graph's float embedding table, which the graph then reads
    build: Callable | None = None


def _eagle_config(hidden_size, vocab_size, draft_vocab, kv_heads, head_dim, medusa_heads, feature_layers=()):
    """One decoder layer with the target's head size and KV heads, about hidden/head_dim query heads."""
    heads = max(hidden_size // head_dim, kv_heads)
    heads -= heads % kv_heads
    inter = int(round(8 * hidden_size / 3 / 64)) * 64
    return HeadConfig("eagle", hidden_size, vocab_size, draft_vocab, heads, kv_heads, head_dim, inter)


EAGLE3_TTT_STEPS = 4  # draft steps unrolled in training (the paper: 7)


def _eagle3_config(hidden_size, vocab_size, draft_vocab, kv_heads, head_dim, medusa_heads, feature_layers=()):
    """EAGLE's layer sizes, reading the target graph's feature layers; ``EAGLE3_TTT_STEPS`` training steps."""
    if not feature_layers:
        raise ExportError("EAGLE-3 heads read the target's layer features; the target bundle has no feature layers.")
    cfg = _eagle_config(hidden_size, vocab_size, draft_vocab, kv_heads, head_dim, medusa_heads)
    cfg.method, cfg.feature_layers, cfg.ttt_steps = "eagle3", list(feature_layers), EAGLE3_TTT_STEPS
    return cfg


def _medusa_config(hidden_size, vocab_size, draft_vocab, kv_heads, head_dim, medusa_heads, feature_layers=()):
    return HeadConfig("medusa", hidden_size, vocab_size, draft_vocab, medusa_heads=medusa_heads)


# The tree settings are the fastest measured for SmolLM2-135M on 2 CPU cores (docs/lab/heads.md,
# "Trained heads"). On a CPU a verify pass costs more the wider it is, so small trees win; a GPU,
# where width is nearly free, wants larger ones (-o nodes=..., -o tree=...).
# Dynamic axes of an EAGLE/EAGLE-3 head step besides its feature inputs.
_HEAD_STEP_AXES = {
    "input_ids": {1: "seq"},
    "position_ids": {1: "seq"},
    "past_key": {1: "past"},
    "past_value": {1: "past"},
    "attention_bias": {2: "seq", 3: "total"},
    "logit_rows": {0: "rows"},
    "hidden_states": {1: "seq"},
    "topk_logprobs": {0: "rows"},
    "topk_ids": {0: "rows"},
    "key": {1: "seq"},
    "value": {1: "seq"},
}

RECIPES: dict[str, HeadRecipe] = {
    "eagle": HeadRecipe(
        name="eagle",
        config=_eagle_config,
        module=EagleHead,
        loss=eagle_loss,
        epochs=10,
        tree={"topk": 3, "nodes": 5, "depth": 3},
        chain={"topk": 1, "nodes": 4, "depth": 4},
        graph=EagleGraph,
        inputs=("features", "input_ids", "position_ids", "past_key", "past_value", "attention_bias", "logit_rows"),
        outputs=("hidden_states", "topk_logprobs", "topk_ids", "key", "value"),
        dynamic_axes={"features": {1: "seq"}, **_HEAD_STEP_AXES},
        examples=eagle_examples,
        sizes=("num_heads", "num_kv_heads", "head_dim", "intermediate_size"),
        build=build_head_graph,
    ),
    "eagle3": HeadRecipe(
        name="eagle3",
        config=_eagle3_config,
        module=Eagle3Head,
        loss=eagle3_loss,
        epochs=1,
        tree={"topk": 3, "nodes": 5, "depth": 3},  # EAGLE's: deeper trees cost more than they gain here
        chain={"topk": 1, "nodes": 4, "depth": 4},
        graph=Eagle3Graph,
        inputs=(
            "target_features",
            "features",
            "input_ids",
            "position_ids",
            "past_key",
            "past_value",
            "attention_bias",
            "logit_rows",
        ),
        outputs=("hidden_states", "topk_logprobs", "topk_ids", "key", "value"),
        dynamic_axes={"target_features": {1: "committed"}, "features": {1: "drafted"}, **_HEAD_STEP_AXES},
        examples=eagle3_examples,
        reads_layers=True,
        sizes=("num_heads", "num_kv_heads", "head_dim", "intermediate_size"),
        build=build_head_graph,
    ),
    "medusa": HeadRecipe(
        name="medusa",
        config=_medusa_config,
        module=MedusaHeads,
        loss=medusa_loss,
        epochs=3,
        tree={"tree": [[0], [1], [0, 0], [0, 0, 0]]},
        chain={"tree": [[0], [0, 0], [0, 0, 0]]},
        graph=MedusaGraph,
        inputs=("hidden_states",),
        outputs=("topk_logprobs", "topk_ids"),
        dynamic_axes={"hidden_states": {0: "rows"}, "topk_logprobs": {1: "rows"}, "topk_ids": {1: "rows"}},
        examples=medusa_examples,
        sizes=("medusa_heads",),
    ),
}
HEAD_METHODS = tuple(RECIPES)  # the head methods that can be trained and exported


def recipe_for(method: str) -> HeadRecipe:
    """The recipe of head method ``method``; an ExportError naming the choices if there is none."""
    if method not in RECIPES:
        raise ExportError(f"unknown head method {method!r}; choose one of {', '.join(RECIPES)}.")
    return RECIPES[method]


def build_head(cfg: HeadConfig, target: FrozenTarget) -> nn.Module:
    """The (untrained) torch module of ``cfg.method`` over the frozen target weights."""
    return recipe_for(cfg.method).module(cfg, target)
