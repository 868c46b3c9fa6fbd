"""Reading a bundle's manifest and checking it: schema version, field types, paths that stay inside the bundle,
listed files and their sizes, the external data its graphs read (the schema: ``schema.py``; checksums:
``hashes.py``; writing: ``write.py``).

Loading checks the manifest's fields and paths and every file's size; ``hashes.check_hashes`` then compares
each file with its sha256.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from specdec_edge.bundle.graph_refs import GraphFormatError, external_data_files
from specdec_edge.bundle.schema import (
    HEAD_SECTIONS,
    HEAD_TREE_KEYS,
    MANIFEST,
    SCHEMA_VERSION,
    CacheSpec,
    GraphSpec,
    HeadSpec,
    Manifest,
)
from specdec_edge.errors import BundleError
from specdec_edge.exactness import Verdict
from specdec_edge.values import is_int as _is_int


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
    """The ONNX graphs of a bundle: target (and its prefill graph), draft and head graphs (relative paths)."""
    paths = [m.graph.path for m in (manifest.target, manifest.draft) if m is not None]
    paths += [manifest.target.graph.prefill_path] if manifest.target.graph.prefill_path else []
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
        for name in ("vocab_size", "hidden_size"):
            need(_positive_int(getattr(g, name)), f"{role} graph {name} = {getattr(g, name)!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "capacity"):
            need(_positive_int(getattr(c, name)), f"{role} graph cache.{name} = {getattr(c, name)!r}")
        # the verdict's fields were checked as it was read (``GraphSpec.from_json``)
        need(isinstance(g.verdict, Verdict), f"{role} graph verdict = {g.verdict!r}")
        width = g.verdict.min_pass_width
        need(width <= c.capacity, f"{role} graph min_pass_width {width} > its capacity")
        need(g.flavour in ("ort", "portable"), f"{role} graph flavour {g.flavour!r}")
        need(isinstance(g.dtype, str), f"{role} graph dtype {g.dtype!r}")
        need(c.dtype in ("float32", "float16"), f"{role} graph cache.dtype {c.dtype!r}")
        need(isinstance(g.has_hidden_states, bool), f"{role} graph has_hidden_states = {g.has_hidden_states!r}")
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
    _check_heads(m, need, listed)
    need(m.default_method is None or isinstance(m.default_method, str), f"default_method = {m.default_method!r}")
    need(isinstance(m.engines, list) and all(isinstance(e, dict) for e in m.engines), "engines is not a list")
    if m.ngram_table is not None:
        listed(m.ngram_table, "the n-gram table")
    for entry in m.engines:
        for key in ("file", "sidecar"):
            if key in entry:
                listed(entry[key], f"the engine {key}")


def _check_heads(m: Manifest, need, listed) -> None:
    """``check_manifest``'s part for the heads sections (``need(ok, what)`` refuses, ``listed(rel, what)`` checks a
    path is in the file list)."""
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
