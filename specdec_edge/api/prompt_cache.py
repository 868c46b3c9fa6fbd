"""A bounded prompt cache: host-memory snapshots of earlier contexts, and prefix files.

One set of engines holds one context (KV prefix reuse: ``decode(reuse=True)`` keeps the prefix a call shares
with the last one). A server with several conversations, or an app that switches between documents, would still
prefill again at every switch. ``PromptCache`` keeps host copies of the contexts a call is about to overwrite --
the used prefix of every layer's K/V (target and draft) and the target's features where a method reads them
(``FeatureTap``), not the whole capacity -- in an LRU store of at most ``limit`` bytes: a plain store of typed
snapshots. Capturing and restoring are the engines' (``Engines.capture``/``restore``); before a call that reuses,
``decode`` asks them (``Engines.restore_best``, under the call's lease on the engines):

1. if the call keeps less than the target holds, the held context is snapshotted (unless a stored snapshot
   covers it already);
2. the snapshot with the longest common prefix with the call's context is restored when it keeps at least
   ``MIN_GAIN`` more tokens than the live cache does: copying K/V costs far less than computing it
   (docs/PERFORMANCE.md has the figures).

Proposer state that is not stored (EAGLE head slots, prompt lookup's index, lookahead's pool) is rebuilt by the
proposers from their own records (``Proposer.prefill``'s ``kept``). Snapshots need an engine that can copy its
slots to the host (``Engine.can_snapshot``): the ``cpu`` backend, and ONNX Runtime's ``cuda``/``tensorrt`` EPs (two
tiny graphs move only the used slots, ``ort_gpu_engine``); with the ``trt``/``trt-rtx`` engines the store stays
empty and reuse keeps the live context only.

Prefix files (``Engines.save_prefix``/``load_prefix``; ``encode``/``decode_file`` here): one snapshot in a file,
keyed by the bundle's manifest digest and the token ids: a magic line, a JSON header (format, digest, tokens, each
array's dtype, shape and sha256) and the raw arrays. Nothing in it is executed (no pickle); a file for another
bundle, or damaged, is refused with the fix. Written atomically. Light: numpy only.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import common_prefix

DEFAULT_MB = 256  # Pipeline.load's and serve's default limit
MIN_TOKENS = 32  # shorter contexts are not worth a snapshot: prefilling them is a pass or two
MIN_GAIN = 8  # a snapshot is restored when it keeps this many tokens more than the live cache
MAGIC = b"specdec-edge prefix\n"
FORMAT = 1
DTYPES = ("float32", "float16")
ARRAYS = ("kv", "features", "layer_features", "draft_kv")


@dataclass
class Snapshot:
    """One context's state: the target slots' ids and K/V, its features (for methods that read them) and the
    draft's slots (their own ids, a prefix of the context)."""

    tokens: list[int]
    kv: np.ndarray  # [layers, 2, 1, kv_heads, n, head_dim]
    features: np.ndarray | None = None  # [n, H]
    layer_features: np.ndarray | None = None  # [n, k*H]
    draft_tokens: list[int] | None = None
    draft_kv: np.ndarray | None = None
    owner: object = None  # whose context it was (``Engines.owner``): only that owner's calls restore it

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values()) + 8 * (len(self.tokens) + len(self.draft_tokens or ()))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: a for name in ARRAYS if (a := getattr(self, name)) is not None}


class PromptCache:
    """The LRU store of one set of engines (``engines.Engines.prompt_cache``), shared by every method over them."""

    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self._store: OrderedDict[int, Snapshot] = OrderedDict()  # least recently used first
        self._ids = 0
        self.nbytes = 0
        self.stored = self.evicted = self.restored = 0  # counters: snapshots taken, dropped, restored

    def __len__(self) -> int:
        return len(self._store)

    def snapshots(self) -> list[Snapshot]:
        """Least recently used first."""
        return list(self._store.values())

    def put(self, snap: Snapshot) -> bool:
        """Store ``snap``, dropping the snapshots it covers and then the least recently used until it fits; False
        (nothing changed) when it alone exceeds the limit."""
        size = snap.nbytes
        if size > self.limit:
            return False
        for key, old in list(self._store.items()):
            if old.owner == snap.owner and _covers(snap, old):
                self._drop(key)
        while self.nbytes + size > self.limit:
            self._drop(next(iter(self._store)))
            self.evicted += 1
        self._ids += 1
        self._store[self._ids] = snap
        self.nbytes += size
        self.stored += 1
        return True

    def clear(self) -> None:
        """Drop every snapshot (the counters stay)."""
        self._store.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._store.pop(key).nbytes

    def best(self, tokens, features: bool = False, owner=None) -> tuple[Snapshot | None, int]:
        """``owner``'s snapshot with the longest common prefix with ``tokens`` (with features, if ``features``), and
        that prefix's length; it becomes the most recently used."""
        found, longest = None, 0
        for key, snap in self._store.items():
            if snap.owner != owner or (features and snap.features is None):
                continue
            n = common_prefix(snap.tokens, tokens)
            if n > longest:
                found, longest = key, n
        if found is None:
            return None, 0
        self._store.move_to_end(found)
        return self._store[found], longest

    def covered(self, snap: Snapshot) -> bool:
        """A stored snapshot of the same owner holds everything ``snap`` does."""
        return any(old.owner == snap.owner and _covers(old, snap) for old in self._store.values())


def _covers(a: Snapshot, b: Snapshot) -> bool:
    """``a`` holds everything ``b`` does: b's tokens are a prefix of a's, with features and draft slots if b has."""
    if len(b.tokens) > len(a.tokens) or common_prefix(a.tokens, b.tokens) < len(b.tokens):
        return False
    if b.features is not None and a.features is None:
        return False
    if b.draft_tokens is not None:
        if a.draft_tokens is None or common_prefix(a.draft_tokens, b.draft_tokens) < len(b.draft_tokens):
            return False
    return True


# ---- prefix files


def prefix_digest(engines) -> str:
    """The bundle digest prefix files of ``engines`` are keyed by; engines opened by hand have none."""
    if engines.digest is None:
        raise SpecdecError(
            "prefix files are keyed by the bundle they were saved from, and these engines were built by hand "
            "(Engines(...)) without one: pass digest=specdec_edge.bundle.hashes.manifest_digest(bundle) to Engines, "
            "or open the bundle with Pipeline.load(...)."
        )
    return engines.digest


def encode(snap: Snapshot, digest: str) -> bytes:
    """The file bytes of ``snap``: MAGIC, the header's length (8 bytes, little endian), the JSON header, the arrays."""
    arrays, offset, parts = {}, 0, []
    for name, a in snap.arrays().items():
        data = np.ascontiguousarray(a).tobytes()
        arrays[name] = {
            "dtype": str(a.dtype),
            "shape": list(a.shape),
            "offset": offset,
            "nbytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        parts.append(data)
        offset += len(data)
    header = {
        "format": FORMAT,
        "bundle": digest,
        "tokens": snap.tokens,
        "draft_tokens": snap.draft_tokens,
        "arrays": arrays,
    }
    head = json.dumps(header).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(head)), head, *parts])


def decode_file(path: Path, digest: str, vocab: int) -> Snapshot:
    """The snapshot in ``path``, or a SpecdecError naming what is wrong and the fix."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SpecdecError(f"cannot read prefix file {path}: {e.strerror or e}.") from None
    damaged = f"prefix file {path} is damaged or not a prefix file"
    fix = "; save it again with Pipeline.save_prefix."
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise SpecdecError(damaged + fix)
    (size,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    body = len(MAGIC) + 8 + size
    try:
        header = json.loads(data[len(MAGIC) + 8 : body], parse_constant=_no_constant)
        if header.get("format") != FORMAT:
            raise SpecdecError(f"prefix file {path} has format {header.get('format')!r}, not {FORMAT}" + fix)
        if header.get("bundle") != digest:
            raise SpecdecError(
                f"prefix file {path} was saved for another bundle (or another export of this one): its manifest "
                "digest differs from this bundle's" + fix
            )
        tokens = _ids(header["tokens"], vocab)
        draft_tokens = None if header.get("draft_tokens") is None else _ids(header["draft_tokens"], vocab)
        arrays = {}
        for name, meta in header["arrays"].items():
            arrays[name] = _array(name, meta, data, body)
    except SpecdecError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        raise SpecdecError(f"{damaged} ({type(e).__name__}: {str(e)[:200]})" + fix) from None
    if "kv" not in arrays or arrays["kv"].ndim != 6 or arrays["kv"].shape[4] != len(tokens):
        raise SpecdecError(f"{damaged} (its K/V do not match its {len(tokens)} tokens)" + fix)
    return Snapshot(tokens, draft_tokens=draft_tokens, **arrays)


def snapshot_problem(engines, snap: Snapshot) -> str | None:
    """What in ``snap`` does not fit ``engines`` (each array's shape and dtype against the target, its features and
    the draft), or None: checked before a snapshot from outside (a prefix file) is restored or stored, since a
    stored one is restored into later calls."""
    n, target, draft = len(snap.tokens), engines.target, engines.draft

    def fits(name: str, a, shape: tuple, dtype) -> str | None:
        if a is None or (a.shape == shape and a.dtype == dtype):
            return None
        return f"{name} is {list(a.shape)} {a.dtype}, these engines need {list(shape)} {np.dtype(dtype)}"

    if target.kv_layout() is None:
        return f"{type(target).__name__} takes no KV snapshots"
    (layers, two, one, heads, dim), dtype = target.kv_layout()
    graph = target.graph
    width = len(graph.feature_layers) * graph.hidden_size
    problems = [
        fits("kv", snap.kv, (layers, two, one, heads, n, dim), dtype),
        fits("features", snap.features, (n, graph.hidden_size), np.float32),
        fits("layer_features", snap.layer_features, (n, width), np.float32),
        "layer_features come without features" if snap.features is None and snap.layer_features is not None else None,
        "features come without this target's layer_features"
        if snap.features is not None and width and snap.layer_features is None
        else None,
        "draft_kv and draft_tokens come one without the other"
        if (snap.draft_kv is None) != (snap.draft_tokens is None)
        else None,
    ]
    if snap.draft_kv is not None and snap.draft_tokens is not None and draft is not None and draft.can_snapshot:
        (layers, two, one, heads, dim), dtype = draft.kv_layout()
        problems.append(fits("draft_kv", snap.draft_kv, (layers, two, one, heads, len(snap.draft_tokens), dim), dtype))
    problems.append(f"{n} tokens, more than the KV cache holds ({target.capacity})" if n > target.capacity else None)
    if draft is not None and len(snap.draft_tokens or ()) > draft.capacity:
        problems.append(f"{len(snap.draft_tokens)} draft tokens, more than the draft's cache holds ({draft.capacity})")
    return next((p for p in problems if p), None)


def _no_constant(name: str):
    raise ValueError(f"{name} in the header")


def _ids(values, vocab: int) -> list[int]:
    if not isinstance(values, list) or not all(type(t) is int and 0 <= t < vocab for t in values):
        raise ValueError("token ids that are not integers of this vocabulary")
    return values


def _array(name: str, meta: dict, data: bytes, body: int) -> np.ndarray:
    """One array of the file, checked: a known name and dtype, a shape, a range inside the file, its sha256."""
    if name not in ARRAYS or meta["dtype"] not in DTYPES:
        raise ValueError(f"array {name!r} of dtype {meta.get('dtype')!r}")
    values = [meta["offset"], meta["nbytes"], *meta["shape"]]
    if not isinstance(meta["shape"], list) or len(meta["shape"]) > 8 or not all(type(v) is int for v in values):
        raise ValueError(f"array {name!r}: a shape, offset or size that is not integers")
    shape, dtype = meta["shape"], np.dtype(meta["dtype"])
    start, nbytes = body + meta["offset"], meta["nbytes"]
    if min(shape, default=0) < 0 or meta["offset"] < 0 or nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"array {name!r}: shape {shape} and {nbytes} bytes do not fit the file")
    if start + nbytes > len(data):
        raise ValueError(f"array {name!r}: shape {shape} and {nbytes} bytes do not fit the file")
    raw = data[start : start + nbytes]
    if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise ValueError(f"array {name!r}: its sha256 differs (the file changed after it was saved)")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
