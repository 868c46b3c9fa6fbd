"""Export a target (and optional draft) model into a validated bundle.

Stages, each reported on stderr: load -> build graph -> quantize -> validate -> write.
Everything is written into a staging directory next to ``--out`` and renamed into place
only after every graph validated, so a failed or interrupted export leaves nothing behind.
"""

from __future__ import annotations

import datetime
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specdec_edge import __version__
from specdec_edge.bundle.schema import SCHEMA_VERSION, CacheSpec, GraphSpec
from specdec_edge.bundle.write import StagingDir, disk_errors, prepare_out_dir
from specdec_edge.errors import ExportError
from specdec_edge.exactness import trees_exact
from specdec_edge.runtime.base import physical_memory

# "gguf": a GGUF's own quantized blocks, kept as they are (export/gguf_blocks.py), the rest fp32.
DTYPES = ("fp32", "fp16", "int8", "int4", "gguf")
FLAVOURS = ("ort", "portable")


class Progress:
    """Stage lines on stderr: ``[target] build graph ... 3.2 s``."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def stage(self, label: str):
        return _Stage(label, self.enabled)


class _Stage:
    def __init__(self, label, enabled):
        self.label, self.enabled = label, enabled

    def __enter__(self):
        self.t0 = time.perf_counter()
        if self.enabled:
            print(f"  {self.label} ...", end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.enabled:
            status = "done" if exc_type is None else "failed"
            print(f" {status} ({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)


DEFAULT_CAPACITY = 2048  # or the model's positions, if it has fewer (``default_capacity``)


def default_capacity(limits: dict[str, tuple[int | None, int]]) -> int:
    """The KV cache capacity when none is asked for: 2048 tokens, or the fewest positions of the models."""
    return min([DEFAULT_CAPACITY, *(positions for positions, _ in limits.values() if positions)])


def check_capacity(capacity: int, limits: dict[str, tuple[int | None, int]], memory: int | None = None) -> None:
    """Refuse a --capacity beyond the positions a model was trained for, or whose KV cache would not fit in
    half of this machine's memory. ``limits``: source -> ``sources.cache_limits``."""
    for source, (positions, _) in limits.items():
        if positions and capacity > positions:
            raise ExportError(
                f"--capacity {capacity} exceeds the {positions} positions that {source} handles "
                f"(max_position_embeddings); use --capacity {positions} or less (the default is 2048, or the "
                "model's positions if fewer)."
            )
    need = capacity * sum(per_token for _, per_token in limits.values())
    memory = memory or physical_memory()
    if memory and need > memory // 2:
        raise ExportError(
            f"--capacity {capacity} needs a {need / 1e9:.1f} GB KV cache, more than half of this machine's "
            f"{memory / 1e9:.1f} GB of memory; use a smaller --capacity (the default is 2048)."
        )


BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2, "int8": 1, "int4": 0.5, "gguf": 1}


def weights_bytes(models, dtype: str) -> int:
    """About the bytes the models' weights take in a bundle of ``dtype`` (what an export needs on disk)."""
    params = sum(p.numel() for m in models if m is not None for p in m.model.parameters())
    return int(params * BYTES_PER_WEIGHT.get(dtype, 4))


@dataclass(frozen=True)
class ExportSettings:
    """How ``export_bundle`` builds a bundle (`specdec-edge export`'s options).

    ``capacity``: KV cache tokens; None: 2048, or the model's positions if it has fewer (said on stderr).
    ``feature_layers``: the target graph also outputs these layers' entering residual streams
    (``layer_features``, what EAGLE-3 heads read); "default": EAGLE-3's low, middle and high layers
    (``head_modules.default_feature_layers``). EAGLE-3 heads in ``heads`` set them.
    ``heads``: trained heads folders (``train-draft``) to add as graphs; implies ``hidden_states``.
    ``default_method``: the method the bundle runs when none is asked for (an exact method it can run; default:
    none recorded, so auto).
    ``chat_template``: a Jinja chat template to store instead of the tokenizer's own (base models have none).
    ``ngram_table``: an n-gram table of the model's own text (``speculative/table.py``, made from a corpus by
    `specdec-edge corpus --table`) to copy into the bundle, where ``auto`` drafts from it.
    """

    draft: str | None = None
    flavour: str = "ort"
    dtype: str = "fp32"
    capacity: int | None = None
    hidden_states: bool = False
    feature_layers: tuple | str = ()
    heads: tuple = ()
    default_method: str | None = None
    chat_template: str | None = None
    force: bool = False
    revision: str | None = None
    progress: bool = True
    ngram_table: str | Path | None = None


def export_bundle(target: str, out: str | Path, settings: ExportSettings | None = None, **keywords) -> Path:
    """Export ``target`` (and ``settings.draft``) to a bundle at ``out``; returns the bundle path. ``settings``
    (``ExportSettings``), or its fields as ``keywords``, say how."""
    settings = replace(settings or ExportSettings(), **keywords)
    settings, table = _check_export(target, Path(out), settings)
    prog = Progress(settings.progress)
    tgt, drf, settings = _load_models(target, settings, prog)
    return _write_bundle(tgt, drf, Path(out), settings, table, prog)


def _check_export(target: str, out: Path, s: ExportSettings) -> tuple[ExportSettings, object]:
    """Fail on bad options, paths, an occupied ``out``, heads folders and the capacity before the slow load; the
    settings with the capacity, hidden states and heads' feature layers settled, and the n-gram table read."""
    if s.dtype not in DTYPES:
        raise ExportError(f"unknown --dtype {s.dtype!r}; choose one of {', '.join(DTYPES)}.")
    if s.flavour not in FLAVOURS:
        raise ExportError(f"unknown --flavour {s.flavour!r}; choose one of {', '.join(FLAVOURS)}.")
    if s.flavour == "portable" and s.dtype in ("int8", "int4", "gguf"):
        raise ExportError(
            f"--dtype {s.dtype} uses ONNX Runtime quantized ops; use --flavour ort, or fp16 for portable."
        )
    if s.capacity is not None and s.capacity < 16:
        raise ExportError(f"--capacity {s.capacity} is too small; use at least 16 tokens (default 2048).")
    from specdec_edge.export.heads_folder import check_heads_folder
    from specdec_edge.export.sources import cache_limits, resolve_source

    sources = list(filter(None, (target, s.draft)))
    for source in sources:
        resolve_source(source)
    prepare_out_dir(out, s.force)
    if s.dtype == "gguf" and not all(str(source).endswith(".gguf") for source in sources):
        raise ExportError(
            "--dtype gguf keeps a GGUF file's quantized weights: --target (and --draft) must be .gguf files."
        )
    table = _read_table(s.ngram_table)
    methods = [check_heads_folder(Path(folder)).method for folder in s.heads]  # config and weights, whole
    if len(set(methods)) < len(methods):
        raise ExportError(f"two heads folders of one method were given ({', '.join(methods)}); pass one per method.")
    limits = {source: cache_limits(source, s.revision if source == target else None) for source in sources}
    capacity = s.capacity
    if capacity is None:
        capacity = default_capacity(limits)
        if s.progress and capacity < DEFAULT_CAPACITY:
            print(f"  KV cache capacity {capacity} tokens: the model's positions (default 2048)", file=sys.stderr)
    check_capacity(capacity, limits)
    feature_layers = s.feature_layers
    if s.heads:
        from specdec_edge.export.heads_folder import heads_feature_layers

        feature_layers = heads_feature_layers(s.heads, feature_layers)
    hidden_states = s.hidden_states or bool(s.heads)
    return replace(s, capacity=capacity, hidden_states=hidden_states, feature_layers=feature_layers), table


def _load_models(target: str, s: ExportSettings, prog: Progress) -> tuple:
    """The target and draft models (the draft None without one), and the settings with the feature layers
    settled from the target's depth."""
    from specdec_edge.export.sources import load_model

    with prog.stage(f"[target] load {target}"):
        tgt = load_model(target, s.revision, s.capacity)
    if s.feature_layers == "default":
        from specdec_edge.export.head_modules import default_feature_layers

        s = replace(s, feature_layers=default_feature_layers(tgt.decoder.num_layers))
    if s.dtype == "gguf":
        with prog.stage("[target] read the GGUF's quantized blocks"):
            keep_gguf_blocks(tgt, target)
    drf = None
    if s.draft is not None:
        with prog.stage(f"[draft] load {s.draft}"):
            drf = load_model(s.draft, None, s.capacity)
        if s.dtype == "gguf":
            keep_gguf_blocks(drf, s.draft)
        check_same_vocab(tgt, drf)
    return tgt, drf, s


def _write_bundle(tgt, drf, out: Path, s: ExportSettings, table, prog: Progress) -> Path:
    """Build, validate and write the graphs, tokenizer, heads, table and manifest in a staging folder, then commit
    it to ``out``."""
    with disk_errors(out, weights_bytes((tgt, drf), s.dtype)), StagingDir(out, s.force) as staging:
        specs = {}
        for role, loaded in (("target", tgt), ("draft", drf)):
            if loaded is not None:
                layers = tuple(s.feature_layers) if role == "target" else ()
                specs[role] = export_graph(loaded, staging.path, role, replace(s, feature_layers=layers), prog)
        with prog.stage("[bundle] write tokenizer"):
            tokenizer = write_tokenizer(tgt, staging.path, s.chat_template)
            manifest = {
                "schema_version": SCHEMA_VERSION,
                "exporter": {
                    "name": "specdec-edge",
                    "version": __version__,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                },
                "target": specs["target"],
                "draft": specs.get("draft"),
                "tokenizer": tokenizer,
            }
        if s.heads:
            from specdec_edge.export.head_export import export_heads

            with prog.stage(f"[heads] build and validate {len(s.heads)} head graph(s)"):
                embed = tgt.decoder.weights["model.embed_tokens.weight"]
                target_graph = specs["target"]["graph"]
                chains = not trees_exact(GraphSpec.from_json(target_graph).verdict, s.dtype)
                lm_head = tgt.decoder.weights.get("lm_head.weight", embed)
                manifest["heads"] = export_heads(
                    s.heads, embed, lm_head, staging.path, chains, target_graph=target_graph["path"]
                )
        if table is not None:
            manifest["ngram_table"] = _write_table(table, tgt.decoder.vocab_size, staging.path, s.ngram_table)
        if s.default_method is not None:
            has_draft = drf is not None
            manifest["default_method"] = check_default_method(s.default_method, has_draft, manifest.get("heads"))
        with prog.stage("[bundle] write manifest"):
            return staging.commit(manifest)


TABLE_FILE = "ngram/table.npz"


def _read_table(path):
    """The n-gram table at ``path`` (checked before the slow load), or None."""
    if path is None:
        return None
    from specdec_edge.errors import SpecdecError
    from specdec_edge.speculative.table import NgramTable

    if not Path(path).is_file():
        raise ExportError(f"--ngram-table {path} is not a file; make one with `specdec-edge corpus DIR --table FILE`.")
    try:
        return NgramTable.load(path)
    except SpecdecError as e:
        raise ExportError(str(e)) from None


def _write_table(table, vocab_size: int, root: Path, source) -> str:
    """Copy the table into the bundle (``TABLE_FILE``) once its vocabulary is known to be the target's."""
    if table.vocab != vocab_size:
        raise ExportError(
            f"--ngram-table {source} was made for a vocabulary of {table.vocab} tokens; the target has {vocab_size}."
        )
    (root / TABLE_FILE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, root / TABLE_FILE)
    return TABLE_FILE


def check_default_method(method: str, has_draft: bool, heads: dict | None) -> str:
    """``method`` if the bundle can run it exactly, else an error naming the methods it can."""
    from specdec_edge.speculative.methods import METHODS, available_methods

    choices = [m for m in available_methods(has_draft, heads or {}) if not METHODS[m].lossy]
    if method not in choices:
        raise ExportError(f"--default-method {method!r} cannot run on this bundle; choose one of {', '.join(choices)}.")
    return method


def keep_gguf_blocks(loaded, source: str) -> None:
    """Give the graph builder the GGUF's own blocks for every quantized linear weight (exact: the same
    values transformers dequantized), instead of a round through fp32 and a second quantizer."""
    from specdec_edge.export.gguf_blocks import gguf_linear_weights

    loaded.decoder.quantized = gguf_linear_weights(source)


def check_same_vocab(target, draft) -> None:
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv or target.decoder.vocab_size != draft.decoder.vocab_size:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise ExportError(
            f"draft {draft.source} does not share the target's vocabulary "
            f"(target {target.decoder.vocab_size} logits / {len(tv)} tokens, "
            f"draft {draft.decoder.vocab_size} / {len(dv)}, "
            f"{diff} differing entries); choose a draft from the same model family and tokenizer."
        )


def export_graph(loaded, root: Path, role: str, settings: ExportSettings, prog) -> dict:
    """The graph of ``loaded`` as ``settings`` ask (flavour, dtype, capacity, hidden states, feature layers), built,
    validated and saved under ``root/role``; its manifest section."""
    flavour, dtype, capacity = settings.flavour, settings.dtype, settings.capacity
    hidden_states, feature_layers = settings.hidden_states, settings.feature_layers
    from specdec_edge.export.graph import build_decoder, save
    from specdec_edge.export.validate import validate_graph
    from specdec_edge.runtime.device import device_identity
    from specdec_edge.runtime.ort_engine import OrtEngine
    from specdec_edge.runtime.verdicts import measure, to_verdict

    cfg = loaded.decoder
    folder = root / role
    folder.mkdir()
    path = folder / "model.onnx"
    with prog.stage(f"[{role}] build {flavour} graph ({cfg.num_layers} layers, {dtype})"):
        if not all(0 <= k < cfg.num_layers for k in feature_layers):
            raise ExportError(
                f"feature layers {list(feature_layers)} are outside the target's layers 0..{cfg.num_layers - 1}; "
                "train the heads for this target."
            )
        graph = build_decoder(
            cfg,
            flavour=flavour,
            dtype=dtype,
            capacity=capacity,
            hidden_states=hidden_states,
            feature_layers=feature_layers,
        )
        save(graph, path)
        del graph
    if flavour == "portable":
        with prog.stage(f"[{role}] onnx.checker full check"):
            import onnx

            try:
                onnx.checker.check_model(str(path), full_check=True)
            except onnx.checker.ValidationError as e:
                raise ExportError(f"the portable graph failed onnx.checker: {e}") from None
    cache_dtype = "float16" if dtype == "fp16" else "float32"
    spec = GraphSpec(
        path=f"{role}/model.onnx",
        flavour=flavour,
        dtype=dtype,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        cache=CacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, cache_dtype),
        has_hidden_states=hidden_states,
        capacity_bias=flavour == "ort",
        feature_layers=tuple(feature_layers),
        inputs=contract_inputs(cfg, capacity, cache_dtype, flavour),
        outputs=contract_outputs(cfg, capacity, cache_dtype, hidden_states, feature_layers),
    )
    with prog.stage(f"[{role}] exactness verdict (chains of 1-64 rows, trees, key-count boundaries; bit for bit)"):
        invariance = measure(OrtEngine(path, spec))  # as a default Pipeline.load runs it
    spec = replace(spec, verdict=to_verdict(invariance, device_identity("cpu", "default")))
    if role == "target" and flavour == "ort":
        from specdec_edge.export.prefill_graph import write_prefill_graph

        with prog.stage(f"[{role}] prefill graph (4-bit layers with fp32 activations)"):
            prefill_file = write_prefill_graph(path)
        spec = replace(spec, prefill_path=f"{role}/{prefill_file}" if prefill_file else "")
    with prog.stage(f"[{role}] validate vs PyTorch (S=1, S=5, tree)"):
        report = {**validate_graph(path, spec, loaded.model, window=cfg.sliding_window), "batch_invariance": invariance}
    config = loaded.model.config
    return {
        "role": role,
        "source": loaded.source,
        "revision": loaded.revision,
        "architecture": cfg.arch.name,
        "hf_architecture": (getattr(config, "architectures", None) or [type(loaded.model).__name__])[0],
        "graph": spec.to_json(),
        "validation": report,
    }


def contract_inputs(cfg, capacity, cache_dtype, flavour="ort") -> tuple:
    cache = [
        {
            "name": f"past_key_values.{i}.{kind}",
            "dtype": cache_dtype,
            "shape": ["batch", cfg.num_kv_heads, capacity, cfg.head_dim],
        }
        for i in range(cfg.num_layers)
        for kind in ("key", "value")
    ]
    return tuple(
        [
            {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
            {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
            {
                "name": "attention_bias",
                "dtype": "float32",
                "shape": ["batch", 1, "seq", "past+seq" if flavour == "portable" else "past+seq | capacity"],
                "meaning": "0 = attend, -inf = masked; columns are cache slots 0..past-1 then the new tokens"
                + (
                    ""
                    if flavour == "portable"
                    else "; may extend to the capacity with later columns masked (the last row must attend to itself)"
                ),
            },
            {
                "name": "logits_to_keep",
                "dtype": "int64",
                "shape": [1],
                "meaning": "logits are computed for the last N new positions only (1..S)",
            },
            *cache,
        ]
    )


def contract_outputs(cfg, capacity, cache_dtype, hidden_states, feature_layers=()) -> tuple:
    outs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "logits_to_keep", cfg.vocab_size]}]
    outs += [
        {
            "name": f"present.{i}.{kind}",
            "dtype": cache_dtype,
            "shape": ["batch", cfg.num_kv_heads, capacity, cfg.head_dim],
            "aliases": f"past_key_values.{i}.{kind}",
        }
        for i in range(cfg.num_layers)
        for kind in ("key", "value")
    ]
    if hidden_states:
        outs.append({"name": "hidden_states", "dtype": "float32", "shape": ["batch", "seq", cfg.hidden_size]})
    if feature_layers:
        outs.append(
            {
                "name": "layer_features",
                "dtype": "float32",
                "shape": ["batch", "seq", len(feature_layers) * cfg.hidden_size],
                "meaning": f"the residual stream entering layers {list(feature_layers)} (0 = the embedding), "
                "concatenated in that order",
            }
        )
    return tuple(outs)


def write_tokenizer(loaded, root: Path, chat_template: str | None = None) -> dict:
    tok = loaded.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(
            f"{loaded.source} has no fast tokenizer (tokenizer.json); only fast tokenizers are supported."
        )
    backend.save(str(root / "tokenizer.json"))
    eos = set()
    gen = getattr(loaded.model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tok.eos_token_id):
        if isinstance(value, int):
            eos.add(value)
        elif value:
            eos.update(int(v) for v in value)
    special = {
        name: str(getattr(tok, name))
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tok, name, None) is not None
    }
    template = tok.chat_template if isinstance(getattr(tok, "chat_template", None), str) else None
    template = chat_template or template
    return {
        "file": "tokenizer.json",
        "vocab_size": loaded.decoder.vocab_size,
        "eos_token_ids": sorted(eos),
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.pad_token_id,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "chat_template": template,
        "special_tokens": special,
    }
