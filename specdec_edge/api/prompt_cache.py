"""A bounded prompt cache: host-memory snapshots of earlier contexts, and prefix files.

One set of engines holds one context (KV prefix reuse: ``decode(reuse=True)`` keeps the prefix a call shares
with the last one). A server with several conversations, or an app that switches between documents, would still
prefill again at every switch. ``PromptCache`` keeps host copies of the contexts a call is about to overwrite --
the used prefix of every layer's K/V (target and draft) and the target's features where a method reads them
(``FeatureTap``), not the whole capacity -- in an LRU store of at most ``limit`` bytes. Before a call that reuses
(``prepare``, from ``decode``'s prefill, under the call's lease on the engines):

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

``save_prefix``/``load_prefix``: one snapshot in a file, keyed by the bundle's manifest digest and the token ids:
a magic line, a JSON header (format, digest, tokens, each array's dtype, shape and sha256) and the raw arrays.
Nothing in it is executed (no pickle); a file for another bundle, or damaged, is refused with the fix. Written
atomically. Light: numpy only.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec_edge.atomic import write_atomic
from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import common_prefix, prefill
from specdec_edge.speculative.features import FeatureTap

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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values()) + 8 * (len(self.tokens) + len(self.draft_tokens or ()))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: a for name in ARRAYS if (a := getattr(self, name)) is not None}


class PromptCache:
    """The LRU store of one set of engines (``engines.Engines.prompt_cache``), shared by every method over them."""

    def __init__(self, limit_bytes: int, digest: str | None = None):
        self.limit = int(limit_bytes)
        self.digest = digest  # the bundle's manifest digest: what prefix files are keyed by (None: engines by hand)
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
            if _covers(snap, old):
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

    def best(self, tokens, features: bool = False) -> tuple[Snapshot | None, int]:
        """The snapshot with the longest common prefix with ``tokens`` (with features, if ``features``), and that
        prefix's length; it becomes the most recently used."""
        found, longest = None, 0
        for key, snap in self._store.items():
            if features and snap.features is None:
                continue
            n = common_prefix(snap.tokens, tokens)
            if n > longest:
                found, longest = key, n
        if found is None:
            return None, 0
        self._store.move_to_end(found)
        return self._store[found], longest

    def prepare(self, engines, engine, context) -> int:
        """Before a call that reuses (module docstring): keep what the target holds if the call would lose it, then
        restore the best snapshot where it beats the live cache. ``engine``: the one the call's loop drives (the
        target or a feature tap over it). Returns the tokens restored (0: none)."""
        target = engines.target
        if self.limit <= 0 or not target.can_snapshot:
            return 0
        want = context[:-1]
        tap = engine if isinstance(engine, FeatureTap) else None
        snap, n = self.best(want, features=tap is not None)  # chosen first: keeping the live one may evict it
        held = target.held
        if held is not None and len(held) >= MIN_TOKENS and target.reusable(want) < len(held):
            self.keep(engines)
        live = engine.reusable(want)
        if snap is None or n < live + MIN_GAIN:
            return 0
        restore(engines, tap, snap, n, want)
        self.restored += 1
        return n - live

    def keep(self, engines) -> None:
        """Snapshot what the engines hold now, unless a stored snapshot covers it."""
        snap = capture(engines)
        if any(_covers(old, snap) for old in self._store.values()):
            return
        self.put(snap)


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


def capture(engines, tap: FeatureTap | None = None) -> Snapshot:
    """What the engines hold now: the target's slots, the features of a tap that holds all of them (``tap``, else
    any tap over the target among the engines' decoders), the draft's slots."""
    target, draft = engines.target, engines.draft
    tokens = list(target.held)
    snap = Snapshot(tokens, target.snapshot())
    taps = [tap] if tap is not None else [d.engine for d in engines.decoders() if isinstance(d.engine, FeatureTap)]
    for t in taps:
        if t.engine is target and t.reusable(tokens) == len(tokens):
            snap.features, snap.layer_features = t.snapshot_features()
            break
    if draft is not None and draft.can_snapshot and draft.held:
        snap.draft_tokens, snap.draft_kv = list(draft.held), draft.snapshot()
    return snap


def restore(engines, tap: FeatureTap | None, snap: Snapshot, n: int, want) -> None:
    """Make the engines hold the first ``n`` tokens of ``snap`` (they start ``want``), copying only the slots the
    live caches do not hold already; the draft's slots too, where the snapshot has more of ``want`` than it."""
    target = engines.target
    tokens = snap.tokens[:n]
    start = target.reusable(tokens)
    target.restore(snap.kv, tokens, start)
    if tap is not None and snap.features is not None:
        tap.restore_features(snap.features, snap.layer_features, tokens, min(start, tap.reusable(tokens)))
    draft = engines.draft
    if draft is not None and draft.can_snapshot and snap.draft_kv is not None:
        d = common_prefix(snap.draft_tokens, want)
        live = draft.reusable(want)
        if d > live:
            draft.restore(snap.draft_kv, snap.draft_tokens[:d], live)


# ---- prefix files


@contextmanager
def holding(lease):
    """Hold ``lease`` (the engines) for the block, as a generation holds it for a step; after it the caches hold
    no generation's context (``EngineLease.cached``)."""
    gen, cancel = lease.new_id(), threading.Event()
    if not lease.acquire(gen, cancel):
        raise SpecdecError("this pipeline was closed; load the bundle again with Pipeline.load(...).")
    try:
        yield
    finally:
        lease.cached = None
        lease.release(gen, False, cancel)


def save_prefix(engines, engine, ids: list[int], path: str | Path) -> Path:
    """Prefill ``ids`` (reusing what the caches hold) through ``engine`` (the target or a feature tap, whose
    features are saved too) and the draft, and write their snapshot to ``path`` atomically."""
    cache = engines.prompt_cache
    if cache is None or cache.digest is None:
        raise SpecdecError("these engines were opened by hand: there is no bundle to key a prefix file by; open the "
                           "bundle with Pipeline.load(...).")  # fmt: skip
    if not engines.target.can_snapshot:
        raise SpecdecError(
            f"prefix files need KV snapshots, which {type(engines.target).__name__} does not take; use provider cpu, "
            "cuda or tensorrt."
        )
    with holding(engines.lease):
        prefill(engine, ids, kept=engine.reusable(ids))
        if engines.draft is not None:
            prefill(engines.draft, ids, kept=engines.draft.reusable(ids))
        snap = capture(engines, engine if isinstance(engine, FeatureTap) else None)
    write_atomic(path, encode(snap, cache.digest))
    return Path(path)


def load_prefix(engines, engine, path: str | Path) -> int:
    """Read a prefix file (refused if it is for another bundle, or damaged), store it in the prompt cache and
    make the engines hold it now. Returns its token count."""
    cache = engines.prompt_cache
    if cache is None or cache.digest is None:
        raise SpecdecError("these engines were opened by hand: open the bundle with Pipeline.load(...) to load a "
                           "prefix file.")  # fmt: skip
    snap = decode_file(Path(path), cache.digest, engines.target.vocab_size)
    tap = engine if isinstance(engine, FeatureTap) else None
    with holding(engines.lease):
        held = engines.target.held
        if held is not None and len(held) >= MIN_TOKENS and engines.target.reusable(snap.tokens) < len(held):
            cache.keep(engines)  # what the engines hold now is overwritten next
        restore(engines, tap, snap, len(snap.tokens), snap.tokens)
        cache.put(snap)
    return len(snap.tokens)


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
        header = json.loads(data[len(MAGIC) + 8 : body])
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
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecdecError(f"{damaged} ({type(e).__name__}: {e})" + fix) from None
    if "kv" not in arrays or arrays["kv"].ndim != 6 or arrays["kv"].shape[4] != len(tokens):
        raise SpecdecError(f"{damaged} (its K/V do not match its {len(tokens)} tokens)" + fix)
    return Snapshot(tokens, draft_tokens=draft_tokens, **arrays)


def _ids(values, vocab: int) -> list[int]:
    if not isinstance(values, list) or not all(type(t) is int and 0 <= t < vocab for t in values):
        raise ValueError("token ids that are not integers of this vocabulary")
    return values


def _array(name: str, meta: dict, data: bytes, body: int) -> np.ndarray:
    """One array of the file, checked: a known name and dtype, a shape, a range inside the file, its sha256."""
    if name not in ARRAYS or meta["dtype"] not in DTYPES:
        raise ValueError(f"array {name!r} of dtype {meta.get('dtype')!r}")
    shape = [int(d) for d in meta["shape"]]
    dtype = np.dtype(meta["dtype"])
    start, nbytes = body + int(meta["offset"]), int(meta["nbytes"])
    if min(shape, default=0) < 0 or nbytes != int(np.prod(shape)) * dtype.itemsize or start + nbytes > len(data):
        raise ValueError(f"array {name!r}: shape {shape} and {nbytes} bytes do not fit the file")
    raw = data[start : start + nbytes]
    if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise ValueError(f"array {name!r}: its sha256 differs (the file changed after it was saved)")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
