"""The on-disk bundle: manifest schema, atomic writing, loading and checksums.

A bundle is a directory::

    manifest.json        what is inside and how to drive it (see ``Manifest``)
    tokenizer.json       the `tokenizers` file shared by target and draft
    target/model.onnx    target decoder graph (+ model.onnx.data for weights)
    draft/model.onnx     optional draft decoder graph

``manifest.json`` lists every other file with its sha256 and size. Loading checks
sizes (fast); ``verify_bundle`` re-hashes everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_edge.errors import BundleError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


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
    # Measured at export (export/invariance.py): True when a token's logits are bit-identical in every
    # pass width from ``min_pass_width`` up and in tree passes, so speculation is exact. The runtime
    # pads narrower passes to ``min_pass_width`` rows.
    batch_invariant: bool = True
    min_pass_width: int = 1
    # Tree rows bit-identical to their branches run as chains. When False, a float graph differs by rounding
    # only (near-ties are logged); a quantized graph verifies only chain-shaped proposals exactly.
    tree_invariant: bool = True
    # The graph reads the valid cache length from the attention bias's values, so the bias may span the whole
    # capacity (later slots masked): every decode pass can then have one shape (CUDA graphs). Graphs exported
    # before this (and the portable flavour, which slices the cache to the bias width) need past+S columns.
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
class Manifest:
    schema_version: int
    exporter: dict
    target: ModelSpec
    tokenizer: TokenizerSpec
    draft: ModelSpec | None = None
    files: dict = field(default_factory=dict)  # relpath -> {"sha256", "size"}
    heads: dict | None = None  # trained draft heads: method -> graph, settings, training summary; "default"
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
            g["cache"] = CacheSpec(**g["cache"])
            g["inputs"] = tuple(g.get("inputs", ()))
            g["outputs"] = tuple(g.get("outputs", ()))
            return ModelSpec(**{**d, "graph": GraphSpec(**g)})

        tok = dict(data["tokenizer"])
        tok["eos_token_ids"] = tuple(tok["eos_token_ids"])
        return cls(
            schema_version=data["schema_version"],
            exporter=data["exporter"],
            target=model(data["target"]),
            draft=model(data.get("draft")),
            tokenizer=TokenizerSpec(**tok),
            files=data.get("files", {}),
            heads=data.get("heads"),
            engines=list(data.get("engines", [])),
            default_method=data.get("default_method"),
        )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict:
    """sha256 and size of every file under ``root`` except the manifest."""
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            table[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return table


def prepare_out_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite a non-empty directory unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise BundleError(f"--out {out} is a file; choose a directory path for the bundle.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BundleError(
            f"output directory {out} already exists and is not empty; "
            "pass --force to replace it or choose another --out."
        )


class StagingDir:
    """A temp dir next to ``out``; ``commit`` writes the manifest and renames it into place.

    Used as a context manager: on any exception the staging dir is removed, so an
    interrupted or failed export leaves nothing behind.
    """

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out).resolve()
        self.force = force
        prepare_out_dir(self.out, force)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))

    def __enter__(self) -> StagingDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self, manifest_without_files: dict) -> Path:
        data = dict(manifest_without_files)
        data["files"] = file_table(self.path)
        Manifest.from_json(data)  # the manifest must load before it is written
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.path / MANIFEST)
        if self.out.exists():
            # Swap: move the old bundle aside, move the new one in, then delete the old.
            trash = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, trash / "old")
            os.replace(self.path, self.out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.path, self.out)
        return self.out


def read_manifest(bundle: Path | str) -> Manifest:
    """Load and schema-check ``manifest.json``; check every listed file's size."""
    root = Path(bundle)
    if not root.exists():
        raise BundleError(f"bundle {root} does not exist; export one with `specdec-edge export`.")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise BundleError(
            f"{root} is not a specdec-edge bundle (no {MANIFEST}); "
            "export one with `specdec-edge export --target MODEL --out DIR`."
        )
    try:
        data = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{mpath} is not valid JSON ({e}); re-export the bundle.") from None
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(
            f"{mpath} has schema version {version!r}, this specdec-edge reads {SCHEMA_VERSION}; "
            "re-export the bundle with this version or upgrade specdec-edge."
        )
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError) as e:
        raise BundleError(f"{mpath} is malformed ({e}); re-export the bundle.") from None
    for rel, entry in manifest.files.items():
        p = root / rel
        if not p.is_file():
            raise BundleError(f"bundle file {rel} is missing from {root}; re-export or re-copy the bundle.")
        if p.stat().st_size != entry["size"]:
            raise BundleError(
                f"bundle file {rel} has size {p.stat().st_size}, manifest says {entry['size']}; "
                "the bundle is corrupted or was copied incompletely: re-copy or re-export it."
            )
    if manifest.draft is not None and manifest.draft.graph.vocab_size != manifest.target.graph.vocab_size:
        raise BundleError(
            f"draft vocab size {manifest.draft.graph.vocab_size} differs from target "
            f"{manifest.target.graph.vocab_size}; re-export with a draft that shares the target's tokenizer."
        )
    return manifest


def verify_bundle(bundle: Path | str) -> list[str]:
    """Re-hash every file; return the relative paths whose hash does not match."""
    root = Path(bundle)
    manifest = read_manifest(root)
    bad = []
    for rel, entry in manifest.files.items():
        if sha256_file(root / rel) != entry["sha256"]:
            bad.append(rel)
    listed = set(manifest.files)
    for p in root.rglob("*"):
        if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in listed:
            bad.append(p.relative_to(root).as_posix() + " (not in manifest)")
    return bad


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """A short JSON-able summary for `specdec-edge info`."""

    def model(m: ModelSpec | None):
        if m is None:
            return None
        g = m.graph
        return {
            "source": m.source,
            "architecture": m.architecture,
            "graph": g.path,
            "flavour": g.flavour,
            "dtype": g.dtype,
            "layers": g.cache.num_layers,
            "cache_capacity": g.cache.capacity,
            "vocab_size": g.vocab_size,
            "hidden_states": g.has_hidden_states,
            "batch_invariant": g.batch_invariant,
            "min_pass_width": g.min_pass_width,
            "tree_invariant": g.tree_invariant,
            "validation": m.validation,
        }

    return {
        "schema_version": manifest.schema_version,
        "exporter": manifest.exporter,
        "target": model(manifest.target),
        "draft": model(manifest.draft),
        "eos_token_ids": list(manifest.tokenizer.eos_token_ids),
        "chat_template": manifest.tokenizer.chat_template is not None,
        "files": len(manifest.files),
        "total_bytes": sum(e["size"] for e in manifest.files.values()),
        "heads": {
            m: {
                "draft_vocab": h.get("config", {}).get("draft_vocab"),
                "tree": h.get("tree", {}),
                "training_tokens": h.get("training", {}).get("tokens"),
                "max_rel_err": h.get("validation", {}).get("max_rel_err"),
            }
            for m, h in (manifest.heads or {}).items()
            if m != "default"
        },
        "default_method": manifest.default_method or "auto",
    }
