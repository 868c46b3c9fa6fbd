"""The engine contract: what the decode loop may ask of any backend, and what every engine shares.

``Engine`` is the contract (a ``typing.Protocol``): what the decode loop, the proposers and the API ask of the
engine they drive, the target or a ``speculative.features.FeatureTap`` over it; ``SnapshotEngine`` adds the KV
snapshots that the prompt cache takes of the target and draft. ``CachedEngine`` is the base class of the backends
(``ort_engine``, ``ort_gpu_engine``, ``tensorrt_engine``): the host-side length, held-id tracking, snapshots and
compaction, so that a backend implements ``run`` and ``_compact``.

An engine runs one decoder graph of a bundle over a fixed-capacity KV cache (batch 1). The
cache's valid length lives on the host, in the engine:

* ``run(ids)`` computes S new tokens after the ``length`` committed cache slots, writes their
  K/V to slots ``length .. length+S-1`` and returns their logits; ``length`` does not move.
* ``commit(n)`` keeps the first n of them (``length += n``); the rest are overwritten by the
  next ``run``, so rolling back rejected tokens copies nothing.
* ``commit(n, path)`` keeps tree nodes ``path`` instead: their K/V move to consecutive slots
  (compaction after tree verification, ``_compact``).
* ``rollback(length)`` forgets slots from ``length`` on; ``reset()`` forgets all of them.
* ``held`` lists the token ids of the committed slots (recorded by ``commit`` from the last ``run``'s ids), kept
  across calls: ``reusable(tokens)`` is how many leading ``tokens`` the cache holds already, so a new call rolls
  back to that common prefix (O(1): nothing is copied) and computes only the rest. ``None`` while unknown
  (slots committed other than from a run, or written directly): nothing is reused until the next ``reset``.

Shapes below: S new tokens of one pass, N kept logits rows, V vocabulary, H hidden size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specdec_edge.errors import SpecdecError

if TYPE_CHECKING:
    from specdec_edge.bundle.schema import GraphSpec

# The backends that implement this contract, by provider name, and the engine class that runs each
# (runtime/factory.py): ONNX Runtime on the CPU, its CUDA and TensorRT execution providers, and the APIs
# of TensorRT and TensorRT-RTX on prebuilt engines.
BACKENDS = {
    "cpu": "OrtEngine",
    "cuda": "OrtGpuEngine",
    "tensorrt": "OrtGpuEngine",
    "trt": "TensorRTEngine",
    "trt-rtx": "TensorRTEngine",
}
# The widest passes an engine must accept: prefill runs in chunks of PREFILL_CHUNK tokens; a
# verified tree has at most MAX_VERIFY nodes (GPU engines build their shape profiles for these).
PREFILL_CHUNK = 256
MAX_VERIFY = 64
# GPU engines pad every narrower pass to this many rows (see pad_step); CPU kernels need no padding.
PAD_TO = 32
# Graph metadata (ONNX ``metadata_props``): the fewest rows the graph's attention op sees. Graphs that record 2 pad a
# one-row pass's attention inside the graph (``export/graph.py``, ``OrtAttention.pad_rows``), so where the device's
# verdict finds such a pass exact the engine runs it as one row and pads nothing (``min_width`` 1).
ATTENTION_ROWS_KEY = "specdec_edge.attention_rows"


@dataclass(frozen=True)
class GpuOptions:
    """How the GPU engines run passes (``Pipeline.load(pad_to=..., cuda_graph=...)``; the last two fields are
    ``OrtGpuEngine``'s, for tests that run its code on the CPU)."""

    pad_to: int | None = None  # pad narrower passes to this many rows; None: PAD_TO on a GPU; 0: off
    cuda_graph: bool = False  # provider "cuda": decode passes replay one captured CUDA graph (ort_gpu_engine)
    ping_pong: bool | None = None  # two cache slabs, read one and write the other; None: on for provider "tensorrt"
    fixed_shape: bool | None = None  # fixed-shape passes (what CUDA graphs replay) without a graph; None: cuda_graph


DEFAULT_GPU = GpuOptions()


def common_prefix(a, b) -> int:
    """How many leading items two token sequences share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def physical_memory() -> int | None:
    """Bytes of RAM in this machine, where the platform says."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> int | None:
    """Bytes of memory available to new allocations now (Linux: MemAvailable), else the machine's RAM, where the
    platform says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory()


def kv_cache_bytes(graph) -> int:
    """Bytes of one graph's KV cache (``GraphSpec.cache``): layers x key and value x heads x capacity x dim."""
    c = graph.cache
    return c.num_layers * 2 * c.num_kv_heads * c.capacity * c.head_dim * (2 if c.dtype == "float16" else 4)


def check_cache_memory(graph, path, memory: int | None = None) -> None:
    """Refuse, before anything is allocated, a KV cache larger than this machine's memory (a damaged or
    hostile manifest's capacity would otherwise end in a MemoryError, or the machine swapping)."""
    need = kv_cache_bytes(graph)
    memory = memory or physical_memory()
    if memory and need > memory:
        raise SpecdecError(
            f"{path}: its KV cache of {graph.cache.capacity} tokens needs {need / 2**30:.1f} GiB, more than this "
            f"machine's {memory / 2**30:.1f} GiB of memory; re-export the bundle with a smaller --capacity."
        )


@dataclass
class StepOutput:
    """What one ``run`` returns. The arrays may be reused buffers, valid until the engine's next run."""

    logits: np.ndarray  # [N, V] float32: row j predicts the token after new token S-N+j
    hidden_states: np.ndarray | None = None  # [S, H] float32, when the graph outputs them
    layer_features: np.ndarray | None = None  # [S, n*H] float32, when the graph has feature layers


@dataclass
class StepInputs:
    """One pass's host-side inputs, shaped for the graph."""

    ids: np.ndarray  # [1, S] int64
    positions: np.ndarray  # [1, S] int64
    bias: np.ndarray  # [1, 1, S, past+S] float32: 0 = attend, -inf = masked
    keep: int  # logits rows to compute (the last ``keep`` new tokens)


def causal_bias(past: int, seq: int) -> np.ndarray:
    """[1, 1, S, past+S] float32 bias: every new token sees the cache and earlier new tokens."""
    bias = np.zeros((1, 1, seq, past + seq), dtype=np.float32)
    if seq > 1:
        bias[0, 0, :, past:][np.triu_indices(seq, 1)] = -np.inf
    return bias


# Kernels that vectorize over the keys in blocks (4 floats on ARM NEON, up to 16 with AVX-512) and finish with a
# scalar tail round a row by its pass's key count modulo the block: runtime/verdicts.py checks every width up to
# RESIDUE_WIDTHS after RESIDUE_PERIOD consecutive cache lengths (a multiple of every such block).
RESIDUE_PERIOD = 16
RESIDUE_WIDTHS = 8


def residue_limit(bad_residues: Mapping, past: int, widest: int) -> int:
    """The most rows a pass after ``past`` slots may have so that it and every narrower pass (down to two rows)
    match plain decoding, given the widths that do not after ``past % RESIDUE_PERIOD`` slots; 1 (a plain step)
    when even two rows do not."""
    residue, fine = past % RESIDUE_PERIOD, 1
    for width in range(2, min(widest, RESIDUE_WIDTHS) + 1):
        if residue in bad_residues.get(width, ()):
            break
        fine = width
    return fine


def pad_step(step: StepInputs, width: int, past: int) -> StepInputs:
    """``step`` widened to ``width`` rows by appending padding tokens, so that every pass has one shape.

    GPU kernels pick their algorithm (and so their rounding) by shape: a token scored in a 1-row
    pass and in a 5-row pass can get logits that differ in the last bits, and a near-tie can then
    flip greedy output. With every decode pass padded to one width, each real row goes through
    the same kernels whichever pass it is in. Padding rows (token 0 at the last real position)
    see the committed cache and themselves only, real rows never see them, and their K/V land in
    slots after the real tokens, beyond the valid length, where the next pass overwrites them.
    The real rows' logits are the first ``step.keep`` of the kept ``step.keep + pad`` rows.
    """
    seq = step.ids.shape[1]
    pad = width - seq
    if pad <= 0:
        return step
    ids = np.concatenate([step.ids, np.zeros((1, pad), np.int64)], axis=1)
    positions = np.concatenate([step.positions, np.repeat(step.positions[:, -1:], pad, axis=1)], axis=1)
    bias = np.full((1, 1, width, past + width), -np.inf, dtype=np.float32)
    bias[0, 0, :seq, : past + seq] = step.bias[0, 0]
    rows = np.arange(seq, width)
    bias[0, 0, seq:, :past] = 0
    bias[0, 0, rows, past + rows] = 0
    return StepInputs(ids, positions, bias, step.keep + pad)


def widen_bias(step: StepInputs, capacity: int, out: np.ndarray | None = None) -> StepInputs:
    """``step`` with its bias [1, 1, S, past+S] extended to [1, 1, S, capacity], the extra columns masked.

    For graphs that read the valid length from the bias's values (``GraphSpec.capacity_bias``): with
    every pass padded to one width, every input then has one shape, pass after pass (CUDA graphs).
    ``out``: a reused [1, 1, S, capacity] buffer to fill.
    """
    seq, width = step.ids.shape[1], step.bias.shape[-1]
    bias = np.empty((1, 1, seq, capacity), np.float32) if out is None else out
    bias[..., :width] = step.bias
    bias[..., width:] = -np.inf
    return StepInputs(step.ids, step.positions, bias, step.keep)


class HeldIds:
    """Which token ids the committed slots hold (``held``), recorded by a commit from the ids of the last run
    (``_ran``): what ``reusable`` compares a call's context with. ``CachedEngine`` keeps them for its KV cache,
    ``speculative.features.FeatureTap`` for the features it stores."""

    length: int = 0  # committed slots
    # The token ids of slots 0..length-1 (see the module docstring), or None: unknown until the next reset.
    held: list | None = None
    _ran: tuple | None = None  # (length, ids) of the last run: what a commit keeps

    def _kept_ids(self, n: int, path) -> list | None:
        """The ids a commit of n rows (``path``) keeps from the last run, or None when it kept no run's rows."""
        ran, self._ran = self._ran, None
        if n == 0:
            return []
        if ran is None or ran[0] != self.length or self.held is None or len(self.held) != self.length:
            return None
        ids = ran[1]
        return (ids[:n] if path is None else ids[np.asarray(path, dtype=np.int64)[:n]]).tolist()

    def _hold(self, rows: list | None) -> None:
        if rows is None:
            self.held = None
        elif self.held is not None:
            self.held.extend(rows)

    def reusable(self, tokens) -> int:
        """How many leading ``tokens`` the committed slots hold now (``held``): a call after them may roll back
        to that many and compute only the rest."""
        return 0 if self.held is None else common_prefix(self.held[: self.length], tokens)


class Engine(Protocol):
    """What the decode loop, the proposers and the API ask of the engine they drive (module docstring): a
    ``CachedEngine`` backend, or a ``FeatureTap`` over one. Shapes: S new tokens, N kept logits rows, V vocabulary."""

    graph: GraphSpec  # the manifest's spec of the graph it runs
    capacity: int  # cache slots
    held: list | None  # token ids of the committed slots, None while unknown

    @property
    def length(self) -> int:
        """Committed cache slots."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def run(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepOutput:
        """S new tokens after the committed slots (``CachedEngine.run``); logits [N, V]."""
        ...

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Keep n of the last run's tokens: the first n, or tree nodes ``path[:n]``."""
        ...

    def rollback(self, length: int) -> None: ...

    def reset(self) -> None: ...

    def reusable(self, tokens) -> int:
        """How many leading ``tokens`` the committed slots hold."""
        ...

    def max_rows(self, past: int | None = None) -> int | None:
        """The most rows a pass after ``past`` slots may have and keep plain decoding's rounding (None: no limit)."""
        ...


class SnapshotEngine(Engine, Protocol):
    """An ``Engine`` whose committed slots can be copied to the host and back (the prompt cache's, prefix files):
    what ``api.engines.Engines`` asks of the target and the draft. ``can_snapshot`` False: ``snapshot`` refuses."""

    @property
    def can_snapshot(self) -> bool: ...

    def kv_layout(self) -> tuple[tuple, np.dtype] | None:
        """The K/V shape without the slot axis and the dtype of a snapshot; None where it takes none."""
        ...

    def snapshot(self) -> np.ndarray:
        """[layers, 2, 1, kv_heads, length, head_dim]: a host copy of the committed slots' K/V."""
        ...

    def restore(self, kv: np.ndarray, tokens, start: int = 0) -> None:
        """Make the cache hold ``tokens`` from a snapshot ``kv``, copying slots ``start`` on."""
        ...


class CachedEngine(HeldIds, ABC):
    """One decoder graph with a fixed-capacity KV cache whose valid length the host holds: the base of the backends,
    implementing ``Engine`` and ``SnapshotEngine``.

    Subclasses set ``graph`` (the manifest's ``GraphSpec``), ``capacity`` and ``length`` and
    implement ``run`` and ``_compact``; the length bookkeeping is shared.
    """

    graph: GraphSpec
    capacity: int  # cache slots
    length: int = 0  # committed slots
    # From the device's exactness verdict (runtime/verdicts.py, applied by ``verdicts.apply``): passes narrower
    # than ``min_width`` rows are padded to it (engines that pad to a width of their own ignore it), and a pass
    # must not straddle one of the key-count ``boundaries`` (``max_rows``), and where a row's rounding depends on
    # its pass's key count modulo a kernel's block, a pass of w rows after ``past`` slots runs only where
    # ``past % RESIDUE_PERIOD`` is not in ``bad_residues[w]`` (``max_rows``).
    min_width: int = 1
    boundaries: tuple = ()
    bad_residues: Mapping = MappingProxyType({})  # {width: frozenset of residues of past mod RESIDUE_PERIOD}
    max_width: int | None = None  # the widest verify pass measured exact (wider proposals are cut to it)
    attention_rows: int = 1  # the fewest rows the graph's attention op sees (ATTENTION_ROWS_KEY): what a 1-row pass is

    @abstractmethod
    def run(
        self,
        input_ids,
        position_ids: np.ndarray | None = None,
        attention_bias: np.ndarray | None = None,
        logits_to_keep: int | None = None,
    ) -> StepOutput:
        """Compute S new tokens after the committed cache; their K/V land in slots length..length+S-1.

        Args:
            input_ids: [S] (or [1, S]) token ids.
            position_ids: [S] rotary positions; default ``length .. length+S-1`` (a chain).
            attention_bias: [1, 1, S, length+S]; default causal (a tree passes its ancestor mask).
            logits_to_keep: logits rows for the last N new tokens; default all S.
        Returns:
            ``StepOutput`` with logits [N, V] (and hidden states [S, H] if the graph has them).
        """

    # Prefill passes (``prefill``): ``run`` with the chunk of ``PREFILL_CHUNK`` rows, unless a backend prefills
    # another way (``OrtEngine`` with OpenVINO attached: ``runtime/ov_prefill.py``).
    prefill_chunk: int = PREFILL_CHUNK

    def prefill_run(self, input_ids, logits_to_keep: int | None = None) -> StepOutput:
        """One prefill pass of ``input_ids`` after the committed cache (``run``'s contract, as a causal chain)."""
        return self.run(input_ids, logits_to_keep=logits_to_keep)

    @abstractmethod
    def _compact(self, path: np.ndarray) -> None:
        """Move the K/V of slots ``length + path`` to slots ``length .. length+len(path)-1``."""

    @property
    def plain_rows(self) -> int:
        """The rows plain decoding's attention sees for one token: the pass's padding (``min_width``), or the graph's
        own attention padding (``attention_rows``) where a one-row pass runs as one row. A token at position p is
        computed over p + plain_rows keys (Gemma 3's 256-wide heads round differently past 64 keys: with the
        attention padded inside the graph, plain decoding crosses that at p = 63, not 64)."""
        return max(self.min_width, self.attention_rows)

    @property
    def vocab_size(self) -> int:
        return self.graph.vocab_size

    def max_rows(self, past: int | None = None) -> int | None:
        """The most rows a pass after ``past`` committed slots (default: ``length``) may have so that every row
        keeps the rounding of plain decoding, or None for no limit.

        Plain decoding computes the token at position p over p + ``plain_rows`` keys. At a key-count boundary B the
        kernels round differently (``runtime/verdicts.py``), so rows at positions below B - plain_rows and rows
        from there on must not share a pass; no pass may be wider than ``max_width``, the widest measured exact;
        and where ``bad_residues`` were measured, no pass of a width that does not match plain decoding after
        this many slots (modulo ``RESIDUE_PERIOD``)."""
        past = self.length if past is None else past
        w = self.plain_rows
        limits = [b - w - past for b in self.boundaries if b - w > past]
        limits += [self.max_width] if self.max_width else []
        if self.bad_residues:
            limits.append(residue_limit(self.bad_residues, past, self.max_width or RESIDUE_WIDTHS))
        return min(limits) if limits else None

    def reset(self) -> None:
        self.length = 0
        self.held, self._ran = [], None

    def commit(self, n: int, path: np.ndarray | None = None) -> None:
        """Keep n of the tokens from the last ``run``: the first n, or tree nodes ``path[:n]`` (indices into it)."""
        rows = self._kept_ids(n, path)
        if path is not None:
            path = np.asarray(path, dtype=np.int64)[:n]
            if not np.array_equal(path, np.arange(n)):
                self._compact(path)
        self.length += n
        self._hold(rows)

    def rollback(self, length: int) -> None:
        """Forget every cache slot from ``length`` on (nothing is copied)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside 0..{self.length}")
        self.length = length
        if self.held is not None:
            del self.held[length:]

    def kv_layout(self) -> tuple[tuple, np.dtype] | None:
        """What ``snapshot`` returns and ``restore`` takes: the K/V shape without the slot axis (``[layers, 2, 1,
        kv_heads, head_dim]``) and dtype; None where this engine takes no snapshots. Here: a host-memory cache."""
        cache = getattr(self, "cache", None)
        if not isinstance(cache, np.ndarray):
            return None
        return (*cache.shape[:4], cache.shape[-1]), cache.dtype

    @property
    def can_snapshot(self) -> bool:
        """Whether ``snapshot``/``restore`` work here (``kv_layout``): the cpu backend, ONNX Runtime's GPU EPs."""
        return self.kv_layout() is not None

    def snapshot(self) -> np.ndarray:
        """A host copy of the committed slots' K/V: [layers, 2, 1, kv_heads, length, head_dim] (``held`` names them)."""
        if not self.can_snapshot:
            raise SpecdecError(f"{type(self).__name__} takes no KV snapshots (its cache cannot be copied to the host).")
        return self._read_slots(self.length)

    def restore(self, kv: np.ndarray, tokens, start: int = 0) -> None:
        """Make the cache hold ``tokens`` (n of them) from ``kv`` (a ``snapshot`` of them, or a longer one), copying
        slots ``start``..n-1 only (the first ``start`` must hold ``tokens[:start]`` already, see ``reusable``)."""
        n = len(tokens)
        layout = self.kv_layout()
        if layout is None or kv.dtype != layout[1] or (*kv.shape[:4], kv.shape[-1]) != layout[0] or kv.shape[4] < n:
            where = "no snapshots" if layout is None else f"{layout[0]} {layout[1]}"
            raise SpecdecError(
                f"a KV snapshot of shape {kv.shape} ({kv.dtype}) does not fit this {type(self).__name__}'s cache "
                f"({where}); it was made for another graph."
            )
        if n > self.capacity or not 0 <= start <= min(n, self.length):
            raise SpecdecError(f"cannot restore {n} slots after {start} into a cache of {self.capacity}.")
        if n > start:
            self._write_slots(kv, start, n)
        self.length, self._ran = n, None
        self.held = [int(t) for t in tokens]

    def host_kv(self, start: int, stop: int) -> np.ndarray | None:
        """A copy of the K/V of slots ``start``..``stop``-1 as the cache holds them now (committed, or written by the
        last ``run`` past ``length``): [layers, 2, 1, kv_heads, stop-start, head_dim]; None where the cache is not in
        host memory (reading a device cache costs a transfer: ``runtime/verdicts.py`` then compares logits only)."""
        cache = getattr(self, "cache", None)
        return cache[..., start:stop, :].copy() if isinstance(cache, np.ndarray) else None

    def _read_slots(self, n: int) -> np.ndarray:
        """A host copy of slots 0..n-1 (engines whose cache is not a host array override this and ``_write_slots``)."""
        return self.cache[..., :n, :].copy()

    def _write_slots(self, kv: np.ndarray, start: int, n: int) -> None:
        """Slots start..n-1 of the cache from ``kv``'s."""
        self.cache[..., start:n, :] = kv[..., start:n, :]

    def step_inputs(self, input_ids, position_ids=None, attention_bias=None, logits_to_keep=None) -> StepInputs:
        """Check capacity and fill in the defaults: positions after the cache, a causal bias, all logits."""
        ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64).reshape(1, -1))
        seq, past = ids.shape[1], self.length
        if past + seq > self.capacity:
            raise SpecdecError(
                f"the KV cache holds {self.capacity} tokens and this step needs {past + seq}; "
                "shorten the prompt or max_new_tokens, or export with a larger --capacity."
            )
        if position_ids is None:
            position_ids = np.arange(past, past + seq, dtype=np.int64)
        bias = causal_bias(past, seq) if attention_bias is None else attention_bias
        self._ran = (past, ids[0])
        return StepInputs(
            ids,
            np.ascontiguousarray(np.asarray(position_ids, dtype=np.int64).reshape(1, seq)),
            np.ascontiguousarray(bias, dtype=np.float32),
            seq if logits_to_keep is None else max(1, min(int(logits_to_keep), seq)),
        )


REPLAY_ROWS = 16  # rows of each pass ``replay`` feeds (the engines' reused chain buffers go this wide)


def replay(engine: Engine, tokens, rows: int = REPLAY_ROWS) -> None:
    """Commit ``tokens`` after the engine's committed slots through decode passes (``run``: causal chains of at most
    ``rows`` and ``max_rows()`` rows, as the decode loop verifies them), not its prefill path: their K/V get the bits
    decoding gave them (a chain's rows equal plain decoding's wherever the device's verdict lets chains run), which a
    prefill by another runtime or in wider chunks need not give (the verdict's ``reuse_matches_prefill``)."""
    done = 0
    while done < len(tokens):
        limit = engine.max_rows()  # None: no limit; else at least 1 (a plain step)
        cap = rows if limit is None else min(rows, max(1, limit))
        width = min(len(tokens) - done, cap)
        engine.run(tokens[done : done + width], logits_to_keep=1)
        engine.commit(width)
        done += width


def prefill(engine: Engine, tokens, chunk: int | None = None, kept: int = 0) -> None:
    """Commit ``tokens`` to ``engine``'s cache, ``chunk`` tokens per pass (default: the engine's ``prefill_chunk``),
    after its first ``kept`` slots (0: reset it first; else it rolls back to them: they must hold
    ``tokens[:kept]``, see ``Engine.reusable``). The passes are the engine's ``prefill_run`` (another runtime may
    run them: ``runtime/ov_prefill.py``), so every call, plain or speculative, prefills alike."""
    chunk = chunk or getattr(engine, "prefill_chunk", PREFILL_CHUNK)
    run = getattr(engine, "prefill_run", engine.run)
    if kept:
        engine.rollback(kept)
    else:
        engine.reset()
    for start in range(kept, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        run(piece, logits_to_keep=1)  # the logits are not used; keep the LM head work minimal
        engine.commit(len(piece))
