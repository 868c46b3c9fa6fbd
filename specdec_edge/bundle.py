"""The on-disk bundle: manifest schema, loading and checksums (writing: ``bundle_write.py``).

A bundle is a directory::

    manifest.json        what is inside and how to drive it (see ``Manifest``)
    tokenizer.json       the `tokenizers` file shared by target and draft
    target/model.onnx    target decoder graph (+ model.onnx.data for weights)
    draft/model.onnx     optional draft decoder graph

``manifest.json`` lists every other file with its sha256 and size. Loading checks the
manifest's fields and paths and every file's size, then ``check_hashes`` compares each file
with its sha256 once per file version (a record in the user cache remembers files that
matched); ``verify_bundle`` re-hashes everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from specdec_edge.atomic import write_atomic
from specdec_edge.errors import BundleError
from specdec_edge.graph_refs import GraphFormatError, external_data_files
from specdec_edge.user_cache import cache_dir
from specdec_edge.values import is_int as _is_int

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


def manifest_digest(root: Path | str) -> str:
    """sha256 of a bundle's manifest.json, which lists every file's sha256: the key of what is measured per bundle
    (step costs, exactness verdicts)."""
    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()


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


def read_manifest(bundle: Path | str, *, check_files: bool = True) -> Manifest:
    """Load and check ``manifest.json``: schema, field types, paths that stay inside the bundle, and
    (``check_files``) that every listed file is there with its recorded size. Any problem is one
    ``BundleError`` that says what to do."""
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
        data = json.loads(mpath.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"{mpath} is not valid JSON ({e}); re-export or re-copy the bundle.") from None
    if not isinstance(data, dict):
        raise _malformed(mpath, f"the top level is a {type(data).__name__}, not an object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise BundleError(
            f"{mpath} has schema version {version!r}, this specdec-edge reads {SCHEMA_VERSION}; "
            "re-export the bundle with this version or upgrade specdec-edge."
        )
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _malformed(mpath, f"{type(e).__name__}: {e}") from None
    check_manifest(manifest, mpath)
    if check_files:
        for rel, entry in manifest.files.items():
            p = bundle_path(root, rel, mpath)
            if not p.is_file():
                raise BundleError(f"bundle file {rel} is missing from {root}; re-export or re-copy the bundle.")
            if p.stat().st_size != entry["size"]:
                raise BundleError(
                    f"bundle file {rel} has size {p.stat().st_size}, manifest says {entry['size']}; "
                    "the bundle is corrupted or was copied incompletely: re-copy or re-export it."
                )
        check_external_data(root, manifest, mpath)
    if manifest.draft is not None and manifest.draft.graph.vocab_size != manifest.target.graph.vocab_size:
        raise BundleError(
            f"draft vocab size {manifest.draft.graph.vocab_size} differs from target "
            f"{manifest.target.graph.vocab_size}; re-export with a draft that shares the target's tokenizer."
        )
    return manifest


def graph_paths(manifest: Manifest) -> list[str]:
    """The ONNX graphs of a bundle: target, draft and head graphs (relative paths)."""
    paths = [m.graph.path for m in (manifest.target, manifest.draft) if m is not None]
    paths += [h.graph for h in manifest.heads.values()]
    return paths


def check_external_data(root: Path, manifest: Manifest, mpath: Path) -> None:
    """Every file a graph reads as external data must be one the manifest lists (and so hashes): ONNX lets a
    graph name any file of its folder, which ONNX Runtime would read unchecked."""
    for rel in graph_paths(manifest):
        try:
            locations = external_data_files(root / rel)
        except (GraphFormatError, OSError, ValueError) as e:
            raise BundleError(
                f"bundle file {rel} is not a readable ONNX graph ({e}); run `specdec-edge verify {root}`, then "
                "re-copy or re-export the bundle."
            ) from None
        folder = PurePosixPath(rel).parent
        for location in sorted(locations):
            pure = PurePosixPath(location)
            data = (folder / pure).as_posix()
            if pure.is_absolute() or ".." in pure.parts or "\\" in location or data not in manifest.files:
                raise BundleError(
                    f"the graph {rel} reads its weights from {location!r}, a file that {mpath} does not list (so "
                    "its checksum cannot be checked); refusing to load it. Re-export the bundle, or get it from a "
                    "source you trust."
                )
            bundle_path(root, data, mpath)


def _malformed(mpath: Path, what: str) -> BundleError:
    return BundleError(f"{mpath} is malformed ({what}); re-export or re-copy the bundle.")


def bundle_path(root: Path, rel: str, mpath: Path | None = None) -> Path:
    """``root / rel`` for a path a manifest lists, refusing any that leads outside the bundle
    (absolute, ``..``, a drive, or a symbolic link that points out)."""
    where = mpath or Path(root) / MANIFEST
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise _malformed(where, f"{rel!r} is not a relative file path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or ":" in pure.parts[0]:
        raise BundleError(
            f"{where} lists {rel!r}, a path outside the bundle; refusing to read it. "
            "Re-export the bundle, or get it from a source you trust."
        )
    path = Path(root) / pure
    base = Path(root).resolve()
    if path.is_symlink() or path.exists():
        target = path.resolve()
        if target != base and base not in target.parents:
            raise BundleError(
                f"bundle file {rel} links to {target}, outside the bundle; refusing to read it. "
                "Replace the link with the file itself."
            )
    return path


def _positive_int(x) -> bool:
    return _is_int(x) and x > 0


def _small(x, most: int) -> bool:
    """A positive integer up to ``most`` (head sizes and tree settings: what sizes buffers stays sane)."""
    return _positive_int(x) and x <= most


def _recorded_verdict_ok(g: GraphSpec) -> bool:
    from specdec_edge.exactness import recorded_verdict

    try:
        recorded_verdict(g)
    except (ValueError, TypeError):
        return False
    return True


def check_manifest(m: Manifest, mpath: Path) -> None:
    """Field types and paths of a parsed manifest; a ``BundleError`` names the first bad field."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise _malformed(mpath, what)

    need(isinstance(m.exporter, dict), "exporter is not an object")
    need(isinstance(m.files, dict), "files is not an object")
    for rel, entry in m.files.items():
        bundle_path(Path(mpath).parent, rel, mpath)
        need(
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
            and isinstance(entry.get("size"), int)
            and not isinstance(entry["size"], bool)
            and entry["size"] >= 0,
            f"files[{rel!r}] needs a 64-digit sha256 and a size",
        )

    def listed(rel, what: str) -> None:
        bundle_path(Path(mpath).parent, rel, mpath)
        need(rel in m.files, f"{what} {rel!r} is not in its file list (so it cannot be checked)")
        data = f"{rel}.data"  # a graph's external weights are read with it, so they must be checked too
        need(data in m.files or not (Path(mpath).parent / data).exists(), f"{data!r} is not in its file list")

    for model in (m.target, m.draft):
        if model is None:
            continue
        g, c, role = model.graph, model.graph.cache, model.role
        need(isinstance(g, GraphSpec) and isinstance(c, CacheSpec), f"{role} graph is incomplete")
        listed(g.path, f"the {role} graph")
        for name in ("vocab_size", "hidden_size", "min_pass_width"):
            need(_positive_int(getattr(g, name)), f"{role} graph {name} = {getattr(g, name)!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "capacity"):
            need(_positive_int(getattr(c, name)), f"{role} graph cache.{name} = {getattr(c, name)!r}")
        need(g.min_pass_width <= c.capacity, f"{role} graph min_pass_width {g.min_pass_width} > its capacity")
        need(g.flavour in ("ort", "portable"), f"{role} graph flavour {g.flavour!r}")
        need(isinstance(g.dtype, str), f"{role} graph dtype {g.dtype!r}")
        need(c.dtype in ("float32", "float16"), f"{role} graph cache.dtype {c.dtype!r}")
        for name in ("has_hidden_states", "batch_invariant", "tree_invariant"):
            need(isinstance(getattr(g, name), bool), f"{role} graph {name} = {getattr(g, name)!r}")
        need(_recorded_verdict_ok(g), f"{role} graph verdict = {g.verdict!r}")
        need(
            isinstance(g.feature_layers, tuple) and len(g.feature_layers) <= 16
            and all(_is_int(k) and 0 <= k < c.num_layers for k in g.feature_layers),
            f"{role} graph feature_layers = {g.feature_layers!r}",
        )  # fmt: skip
        try:
            names = {c.input_name(0, "key"), c.output_name(0, "value")}
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            names = set()
        need(len(names) == 2 and all(isinstance(n, str) for n in names), f"{role} graph cache name templates")
        need(isinstance(model.validation, dict), f"{role} validation is not an object")
        need(all(isinstance(x, str) for x in (model.source, model.architecture)), f"{role} source/architecture")
    t = m.tokenizer
    listed(t.file, "the tokenizer file")
    need(_positive_int(t.vocab_size), f"tokenizer vocab_size = {t.vocab_size!r}")
    need(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in t.eos_token_ids), "eos_token_ids")
    for name in ("bos_token_id", "pad_token_id"):
        value = getattr(t, name)
        need(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0), name)
    need(isinstance(t.add_bos_token, bool), f"add_bos_token = {t.add_bos_token!r}")
    need(t.chat_template is None or isinstance(t.chat_template, str), "chat_template is not a string")
    need(isinstance(t.special_tokens, dict) and all(isinstance(k, str) for k in t.special_tokens), "special_tokens")
    for method, section in m.heads.items():
        need(method in HEAD_SECTIONS, f"unknown heads {method!r}")
        need(isinstance(section, HeadSpec), f"heads.{method} is not an object")
        listed(section.graph, f"the {method} head graph")
        need(_small(section.top_k, 64), f"heads.{method}.top_k = {section.top_k!r}")
        config, tree = section.config, section.tree
        need(isinstance(config, dict), f"heads.{method}.config is not an object")
        for key in ("training", "validation"):
            need(isinstance(getattr(section, key), dict), f"heads.{method}.{key} is not an object")
        for key in HEAD_SECTIONS[method]:
            need(_small(config.get(key), 1 << 16), f"heads.{method}.config.{key} = {config.get(key)!r}")
        if method == "eagle3":  # reads the target's layer features: the same layers, as a list
            layers = config.get("feature_layers")
            need(
                isinstance(layers, list) and m.target is not None and tuple(layers) == m.target.graph.feature_layers,
                f"heads.eagle3.config.feature_layers = {layers!r} (the target graph outputs "
                f"{list(m.target.graph.feature_layers) if m.target else None})",
            )
        need(isinstance(tree, dict) and set(tree) <= HEAD_TREE_KEYS[method], f"heads.{method}.tree = {tree!r}")
        for key, value in tree.items():
            if key == "tree":  # Medusa: rank paths such as [[0], [1], [0, 0]]
                ok = isinstance(value, list) and all(
                    isinstance(p, list) and p and all(_is_int(r) and r >= 0 for r in p) for p in value
                )
            else:  # EAGLE: topk, nodes, depth
                ok = _small(value, 64)
            need(ok, f"heads.{method}.tree.{key} = {value!r}")
    need(m.default_method is None or isinstance(m.default_method, str), f"default_method = {m.default_method!r}")
    need(isinstance(m.engines, list) and all(isinstance(e, dict) for e in m.engines), "engines is not a list")
    for entry in m.engines:
        for key in ("file", "sidecar"):
            if key in entry:
                listed(entry[key], f"the engine {key}")


def verify_bundle(bundle: Path | str) -> list[str]:
    """Re-hash every file; return the files that do not match, each with the reason when it is not the hash:
    ``rel`` (hash), ``rel (missing)``, ``rel (size N, manifest says M)``, ``rel (not in manifest)``.
    Files that match are remembered in the hash record (``check_hashes``)."""
    root = Path(bundle)
    manifest = read_manifest(root, check_files=False)
    bad, ok = [], []
    for rel, entry in manifest.files.items():
        p = root / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif p.stat().st_size != entry["size"]:
            bad.append(f"{rel} (size {p.stat().st_size}, manifest says {entry['size']})")
        elif sha256_file(p) != entry["sha256"]:
            bad.append(rel)
        else:
            ok.append((p, entry["sha256"]))
    listed = set(manifest.files)
    for p in root.rglob("*"):
        if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in listed:
            bad.append(p.relative_to(root).as_posix() + " (not in manifest)")
    HashRecord().remember(ok)
    return bad


def check_sources(root: Path | str, manifest: Manifest, rels, *, source: Path | str | None = None) -> None:
    """Hash each of ``rels`` under ``root`` now (never through the hash record) and raise one ``BundleError`` naming
    those that do not match ``manifest``: for what writes something new out of a bundle's files (a copy with heads,
    TensorRT engines), which would otherwise record fresh hashes of damaged bytes. ``source``: the bundle to name in
    the error when ``root`` holds copies of its files."""
    root = Path(root)
    bad = [
        rel for rel in rels if not (root / rel).is_file() or sha256_file(root / rel) != manifest.files[rel]["sha256"]
    ]
    if bad:
        where = Path(source or root)
        raise BundleError(
            f"bundle {where} is damaged: {', '.join(bad)} do not match the sha256 in its manifest, and nothing was "
            f"written from it. Re-copy or re-export the bundle (`specdec-edge verify {where}` lists every damaged "
            "file)."
        )


def check_hashes(bundle: Path | str, manifest: Manifest) -> None:
    """Hash every listed file that the hash record does not already vouch for (``HashRecord``), and
    raise a ``BundleError`` naming the first one that does not match its manifest sha256.

    The first load of a bundle reads it all once (about 0.5 s per 250 MB here); later loads only
    look at each file's size and modification time."""
    root = Path(bundle)
    record = HashRecord()
    checked = []
    for rel, entry in manifest.files.items():
        path = root / rel
        if record.vouches(path, entry["sha256"]):
            continue
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(
                f"bundle file {rel} in {root} does not match its sha256 in the manifest: the bundle is "
                f"corrupted. Run `specdec-edge verify {root}` to list every damaged file, then re-copy or "
                "re-export the bundle."
            )
        checked.append((path, entry["sha256"]))
    record.remember(checked)


class HashRecord:
    """Which files already matched which sha256, keyed by path, size, modification time, inode, device and
    change time (ctime), in ``<user cache>/verified.json`` (see ``user_cache.py``). A file that changes gets a
    new ctime (which, unlike the modification time, no tool can set back), so it is hashed again. Files
    modified or changed in the last ``RACY_S`` seconds are not recorded (a change within the file system's
    timestamp granularity would go unseen). Unwritable caches are ignored."""

    RACY_S = 2.0
    MAX_ENTRIES = 4096

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "verified.json"
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries = entries if isinstance(entries, dict) else {}

    @staticmethod
    def _key(path: Path) -> tuple[str, list] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        # ctime too: an in-place change that restores the mtime (rsync --inplace -t, cp -p, tar) still moves it
        return str(path.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]

    def vouches(self, path: Path, sha256: str) -> bool:
        key = self._key(path)
        return key is not None and self.entries.get(key[0]) == [*key[1], sha256]

    def remember(self, files: list[tuple[Path, str]]) -> None:
        now = time.time_ns()
        changed = False
        for path, sha256 in files:
            key = self._key(path)
            if key is not None and now - max(key[1][1], key[1][4]) > self.RACY_S * 1e9:
                self.entries[key[0]] = [*key[1], sha256]
                changed = True
        if not changed:
            return
        live = {p: v for p, v in self.entries.items() if os.path.exists(p)}
        keep = dict(list(live.items())[-self.MAX_ENTRIES :])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(keep))
        except OSError:
            pass


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
            "feature_layers": list(g.feature_layers),
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
                "draft_vocab": h.config.get("draft_vocab"),
                "tree": h.tree,
                "training_tokens": h.training.get("tokens"),
                "max_rel_err": h.validation.get("max_rel_err"),
            }
            for m, h in manifest.heads.items()
        },
        "default_method": manifest.default_method or "auto",
    }
