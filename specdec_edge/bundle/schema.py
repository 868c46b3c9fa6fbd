"""The bundle's schema: the manifest as frozen dataclasses (``Manifest`` and the specs it holds) and its constants.

A bundle is a directory::

    manifest.json        what is inside and how to drive it (see ``Manifest``)
    tokenizer.json       the `tokenizers` file shared by target and draft
    target/model.onnx    target decoder graph (+ model.onnx.data for weights)
    draft/model.onnx     optional draft decoder graph

``manifest.json`` lists every other file with its sha256 and size. Reading and checking a manifest is
``manifest.py``, the checksums ``hashes.py``, writing ``write.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 2  # 2: graphs record the export device's exactness verdict (``GraphSpec.verdict``)
MANIFEST = "manifest.json"
# Head sections a manifest may carry, with the positive integers their config must hold, and their tree keys.
HEAD_SECTIONS = {
    "eagle": ("num_kv_heads", "head_dim"),
    "eagle3": ("num_kv_heads", "head_dim", "hidden_size"),
    "medusa": ("medusa_heads",),
}
HEAD_TREE_KEYS = {"eagle": {"topk", "nodes", "depth"}, "eagle3": {"topk", "nodes", "depth"}, "medusa": {"tree"}}


@dataclass(frozen=True)
class CacheSpec:
    """Fixed-capacity KV buffers, one key and one value tensor per layer.

    Shape ``[batch, num_kv_heads, capacity, head_dim]`` (BNSH). The graph writes the
    new tokens' K/V at slots ``past .. past+S-1`` where ``past`` is implied by the
    attention bias width; the host keeps the valid length, so rollback copies nothing.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    dtype: str  # "float32" | "float16"
    input_template: str = "past_key_values.{layer}.{kind}"
    output_template: str = "present.{layer}.{kind}"
    layout: str = "BNSH"
    in_place: bool = True

    def input_name(self, layer: int, kind: str) -> str:
        return self.input_template.format(layer=layer, kind=kind)

    def output_name(self, layer: int, kind: str) -> str:
        return self.output_template.format(layer=layer, kind=kind)


@dataclass(frozen=True)
class GraphSpec:
    """The engine contract of one decoder graph (see docs/DESIGN.md)."""

    path: str  # relative to the bundle root
    flavour: str  # "ort" (com.microsoft fused attention) | "portable" (standard ONNX)
    dtype: str  # weights: "fp32" | "fp16" | "int8" | "int4"
    vocab_size: int
    hidden_size: int
    cache: CacheSpec
    has_hidden_states: bool = False
    # Layers whose entering residual stream the ``layer_features`` output [B, S, n*H] concatenates (EAGLE-3
    # heads read it); k = after k decoder layers, 0 = the embedding. Empty: no such output.
    feature_layers: tuple = ()
    # The exactness verdict measured on the export machine (runtime/verdicts.py; exactness.py decides what it
    # lets run): True when a token's logits are bit-identical in every pass width from ``min_pass_width`` up
    # (narrower passes are padded to it) at every key range measured, and the rest of the verdict in
    # ``verdict`` (the widest pass measured, the device, the key-count boundaries a pass must not straddle).
    # Any other device measures its own verdict on first use. Required in a manifest (no defaults there).
    batch_invariant: bool = True
    min_pass_width: int = 1
    # Tree rows bit-identical to their branches run as chains. When False, a float graph differs by rounding
    # only (near-ties are logged); a quantized graph verifies only chain-shaped proposals exactly.
    tree_invariant: bool = True
    verdict: dict = field(default_factory=dict)  # {"max_width", "device", "details"}
    # The graph reads the valid cache length from the attention bias's values, so the bias may span the whole
    # capacity (later slots masked): every decode pass can then have one shape (CUDA graphs). The portable
    # flavour, which slices the cache to the bias width, needs past+S columns.
    capacity_bias: bool = False
    inputs: tuple = ()
    outputs: tuple = ()


@dataclass(frozen=True)
class ModelSpec:
    """One model in the bundle (target or draft)."""

    role: str  # "target" | "draft"
    source: str
    revision: str | None
    architecture: str  # registry name, e.g. "llama", "gemma3"
    hf_architecture: str
    graph: GraphSpec
    validation: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerSpec:
    file: str
    vocab_size: int
    eos_token_ids: tuple
    bos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    special_tokens: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HeadSpec:
    """One trained draft head of a bundle (``Manifest.heads[method]``): its graph and what it was made with."""

    graph: str  # relative to the bundle root
    top_k: int  # candidates per row the graph returns
    config: dict  # the head's architecture (hidden size, heads, draft vocabulary, feature layers, ...)
    tree: dict = field(default_factory=dict)  # the tree settings the bundle records (HEAD_TREE_KEYS)
    training: dict = field(default_factory=dict)  # the training summary
    validation: dict = field(default_factory=dict)  # the export-time check against PyTorch


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    exporter: dict
    target: ModelSpec
    tokenizer: TokenizerSpec
    draft: ModelSpec | None = None
    files: dict = field(default_factory=dict)  # relpath -> {"sha256", "size"}
    heads: dict[str, HeadSpec] = field(default_factory=dict)  # trained draft heads by method (HEAD_SECTIONS)
    engines: list = field(default_factory=list)  # prebuilt TensorRT engines (runtime/prebuilt.py)
    default_method: str | None = None  # what a pipeline runs when none is asked for (else auto)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        def model(d):
            if d is None:
                return None
            g = dict(d["graph"])
            missing = [k for k in ("batch_invariant", "min_pass_width", "tree_invariant", "verdict") if k not in g]
            if missing:
                raise KeyError(f"the {d.get('role')} graph has no {', '.join(missing)}")
            g["cache"] = CacheSpec(**g["cache"])
            g["inputs"] = tuple(g.get("inputs", ()))
            g["outputs"] = tuple(g.get("outputs", ()))
            g["feature_layers"] = tuple(g.get("feature_layers", ()))
            return ModelSpec(**{**d, "graph": GraphSpec(**g)})

        def heads(d: dict) -> dict[str, HeadSpec]:
            if not isinstance(d, dict):
                raise TypeError("heads is not an object")
            return {m: HeadSpec(**s) if isinstance(s, dict) else s for m, s in d.items()}

        tok = dict(data["tokenizer"])
        tok["eos_token_ids"] = tuple(tok["eos_token_ids"])
        return cls(
            schema_version=data["schema_version"],
            exporter=data["exporter"],
            target=model(data["target"]),
            draft=model(data.get("draft")),
            tokenizer=TokenizerSpec(**tok),
            files=data.get("files", {}),
            heads=heads(data.get("heads") or {}),
            engines=list(data.get("engines", [])),
            default_method=data.get("default_method"),
        )
