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

from specdec_edge.exactness import Verdict

SCHEMA_VERSION = 2  # 2: graphs record the export device's exactness verdict (``GraphSpec.verdict``)
MANIFEST = "manifest.json"
# Head sections a manifest may carry, with the positive integers their config must hold, and their tree keys.
HEAD_SECTIONS = {
    "eagle": ("num_kv_heads", "head_dim"),
    "eagle3": ("num_kv_heads", "head_dim", "hidden_size"),
    "medusa": ("medusa_heads",),
}
HEAD_TREE_KEYS = {"eagle": {"topk", "nodes", "depth"}, "eagle3": {"topk", "nodes", "depth"}, "medusa": {"tree"}}
# How a graph's verdict (``exactness.Verdict``) is written: these fields beside the graph's others, the rest in its
# ``verdict`` object.
VERDICT_FLAGS = ("batch_invariant", "min_pass_width", "tree_invariant")
VERDICT_REST = ("max_width", "device", "details")


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
    # The exactness verdict measured on the export machine (runtime/verdicts.py; exactness.py decides what it lets
    # run): whether a token's logits are bit-identical in every pass width from ``min_pass_width`` up (narrower
    # passes are padded to it) at every key range measured, whether token trees match their branches run as chains,
    # the widest pass measured, the device and the key-count boundaries a pass must not straddle. Any other device
    # measures its own on first use. Required in a manifest (``GraphSpec.from_json``); None only in the spec that
    # export opens an engine on to measure it. On disk: ``batch_invariant``, ``min_pass_width`` and
    # ``tree_invariant`` beside the other fields, the rest in ``verdict`` (``to_json``).
    verdict: Verdict | None = None
    # The graph reads the valid cache length from the attention bias's values, so the bias may span the whole
    # capacity (later slots masked): every decode pass can then have one shape (CUDA graphs). The portable
    # flavour, which slices the cache to the bias width, needs past+S columns.
    capacity_bias: bool = False
    inputs: tuple = ()
    outputs: tuple = ()
    # A graph with this one's contract and weights whose 4-bit layers compute with fp32 activations, for prefill
    # passes where it measured faster on the device (export/prefill_graph.py, runtime/graph_prefill.py); relative
    # to the bundle root, "" where there is none.
    prefill_path: str = ""

    def to_json(self) -> dict:
        """The manifest form (``from_json`` reads it back): the verdict's flags beside the other fields, the rest of
        it in ``verdict``."""
        if self.verdict is None:
            raise ValueError(f"the graph {self.path} has no exactness verdict; measure it before writing a manifest")
        data = {}
        for key, value in asdict(self).items():
            if key == "verdict":
                data.update({k: value[k] for k in VERDICT_FLAGS})
                value = {k: value[k] for k in VERDICT_REST}
            data[key] = value
        return data

    @classmethod
    def from_json(cls, data: dict, role: str | None = None) -> GraphSpec:
        """A graph spec from its manifest form; ``KeyError`` names a missing field, ``ValueError`` a malformed verdict
        (``role``: the model's, for the message)."""
        g = dict(data)
        missing = [k for k in (*VERDICT_FLAGS, "verdict") if k not in g]
        if missing:
            raise KeyError(f"the {role} graph has no {', '.join(missing)}")
        rest = g.pop("verdict")
        if not isinstance(rest, dict):
            raise ValueError(f"the {role} graph's verdict = {rest!r} is not an object")
        flat = {k: g.pop(k) for k in VERDICT_FLAGS} | {k: rest.get(k) for k in VERDICT_REST}
        try:
            g["verdict"] = Verdict.from_json(flat)
        except ValueError as e:
            raise ValueError(f"the {role} graph's {e}") from None
        g["cache"] = CacheSpec(**g["cache"])
        g["inputs"] = tuple(g.get("inputs", ()))
        g["outputs"] = tuple(g.get("outputs", ()))
        g["feature_layers"] = tuple(g.get("feature_layers", ()))
        return cls(**g)


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
    ngram_table: str | None = None  # an n-gram table of the model's own text (speculative/table.py), for auto

    def to_json(self) -> dict:
        """The manifest's JSON form (``from_json`` reads it back)."""
        data = asdict(self)
        for role in ("target", "draft"):
            model = getattr(self, role)
            if model is not None:
                data[role]["graph"] = model.graph.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        def model(d):
            if d is None:
                return None
            return ModelSpec(**{**d, "graph": GraphSpec.from_json(d["graph"], d.get("role"))})

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
            ngram_table=data.get("ngram_table"),
        )
