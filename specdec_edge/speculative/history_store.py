"""The history store: earlier calls' token streams in one bounded buffer with a hashed n-gram index (the design in
``history.py``, whose proposers draft from it). Pure numpy; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec_edge.errors import SpecdecError

LEVELS = (2, 4, 8, 16)  # n-gram lengths indexed, longest tried first
MAX_MATCH = 64  # how far back a match is measured
SEP = -1  # between streams in the buffer (never a token id)
DEFAULT_HISTORY_MB = 16.0
MAX_HISTORY_MB = 65536
MIN_TOKENS = 64  # the smallest store: its limit must hold at least this many tokens
_BYTES_PER_TOKEN = 4 + 8 * len(LEVELS)  # a buffer slot (int32) + one index slot (int64) per level
_MASK = (1 << 64) - 1
_P = 0x100000001B3  # multiplier of the polynomial n-gram hash
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer


def _mix(h: int) -> int:
    """splitmix64's finalizer of a Python int (the same bits as ``_mix_array``)."""
    h ^= h >> 30
    h = (h * _M1) & _MASK
    h ^= h >> 27
    h = (h * _M2) & _MASK
    return h ^ (h >> 31)


def _mix_array(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(_M1)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(_M2)
    return h ^ (h >> np.uint64(31))


def ngram_hash(tokens: Sequence[int]) -> int:
    """The hash of one n-gram (Python ints)."""
    h = 0
    for t in tokens:
        h = (h * _P + int(t)) & _MASK
    return _mix(h)


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """``ngram_hash`` of every n-gram of ``tokens`` (window i: tokens[i:i+n]), vectorized (uint64 wraps)."""
    windows = sliding_window_view(tokens.astype(np.uint64), n)
    h = np.zeros(len(windows), dtype=np.uint64)
    for j in range(n):
        h = h * np.uint64(_P) + windows[:, j]
    return _mix_array(h)


class HistoryStore:
    """Earlier calls' token streams under a memory limit, and the lookup of the current suffix's continuation.

    ``limit_bytes`` bounds the numpy arrays (``nbytes``): the buffer holds ``capacity`` tokens (separators
    included), and each level's index as many slots. Safe to share between threads.
    """

    def __init__(self, limit_bytes: int = int(DEFAULT_HISTORY_MB * (1 << 20))):
        capacity = int(limit_bytes) // _BYTES_PER_TOKEN
        if capacity < MIN_TOKENS:
            raise SpecdecError(
                f"a history store of {limit_bytes} bytes is too small: it needs at least "
                f"{MIN_TOKENS * _BYTES_PER_TOKEN} bytes ({MIN_TOKENS} tokens); give a larger limit, or turn "
                "history off."
            )
        self.limit_bytes = int(limit_bytes)
        self.capacity = capacity
        # allocated on the first add: a store nobody adds to (a server's, whose clients have their own) costs nothing
        self.buffer: np.ndarray | None = None  # [capacity] int32
        self.index: np.ndarray | None = None  # [levels, capacity] int64: slot -> where the continuation starts
        self.base = 0  # absolute position of buffer[0]
        self.end = 0  # absolute position after the last token
        self.stream = -1  # absolute start of the last stream (-1: none)
        self.streams = 0  # streams added (extensions not counted)
        self.evicted = 0  # tokens dropped to make room
        self._lock = threading.Lock()

    @classmethod
    def of_mb(cls, mb: float) -> HistoryStore:
        """A store of ``mb`` MiB; a bad size is named."""
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb <= MAX_HISTORY_MB:
            raise SpecdecError(
                f"history_mb={mb!r} is invalid: use a number of MiB above 0 and at most {MAX_HISTORY_MB}."
            )
        return cls(int(mb * (1 << 20)))

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes + self.index.nbytes

    @staticmethod
    def bytes_of(mb: float) -> int:
        """Bytes a store of ``mb`` MiB takes once used (``limit_bytes`` rounded down to whole tokens)."""
        return int(mb * (1 << 20)) // _BYTES_PER_TOKEN * _BYTES_PER_TOKEN

    @property
    def held(self) -> int:
        """Tokens held (separators included)."""
        return self.end - self.base

    def clear(self) -> None:
        with self._lock:
            self.buffer = self.index = None
            self.base = self.end = 0
            self.stream = -1

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one call's prompt + output (only what is new when it extends the last stream)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            if self.buffer is None:
                self.buffer = np.full(self.capacity, SEP, dtype=np.int32)
                self.index = np.full((len(LEVELS), self.capacity), -1, dtype=np.int64)
            start = self._extends(tokens)
            if start and (self.end - self.stream) + len(tokens) - start > self.capacity:
                start = 0  # the stream would outgrow the buffer: its tail becomes a new stream
            new = tokens[start:]
            if not len(new):
                return
            if start == 0:
                new = new[-(self.capacity - 1) :]
                self._make_room(len(new) + 1)
                self.buffer[self.end - self.base] = SEP
                self.end += 1
                self.stream = self.end
                self.streams += 1
            else:
                self._make_room(len(new))
            old_end = self.end
            self.buffer[old_end - self.base : old_end - self.base + len(new)] = new
            self.end += len(new)
            self._index(old_end)

    def _extends(self, tokens: np.ndarray) -> int:
        """How many leading tokens of ``tokens`` are the last stream (all of it, still held), else 0."""
        if self.stream < self.base:  # none, or its start was evicted
            return 0
        held = self.buffer[self.stream - self.base : self.end - self.base]
        if len(held) <= len(tokens) and np.array_equal(tokens[: len(held)], held):
            return len(held)
        return 0

    def _make_room(self, need: int) -> None:
        """Drop the oldest tokens (at least an eighth of the buffer at a time) until ``need`` more fit."""
        over = (self.end - self.base) + need - self.capacity
        if over <= 0:
            return
        drop = min(max(over, self.capacity // 8), self.end - self.base)
        keep = self.end - self.base - drop
        self.buffer[:keep] = self.buffer[drop : drop + keep].copy()
        self.buffer[keep:] = SEP
        self.base += drop
        self.evicted += drop

    def _index(self, old_end: int) -> None:
        """Index the n-grams whose continuation starts in [old_end, end - 1] (each has a token after it)."""
        for level, n in enumerate(LEVELS):
            first = max(old_end, self.stream + n, self.base + n)  # the first new n-gram's continuation
            if first >= self.end:
                continue
            positions = np.arange(first, self.end, dtype=np.int64)
            tokens = self.buffer[first - n - self.base : self.end - 1 - self.base]
            slots = (ngram_hashes(tokens, n) % np.uint64(self.capacity)).astype(np.int64)
            # the most recent occurrence wins a slot: each slot gets its last position
            unique, last = np.unique(slots[::-1], return_index=True)
            self.index[level, unique] = positions[::-1][last]

    def lookup(self, context: Sequence[int], k: int, min_match: int = 2) -> tuple[np.ndarray, int]:
        """Up to ``k`` tokens that followed the longest recent match of ``context``'s suffix (at least
        ``min_match`` tokens long), and the match's length (0 and no tokens: none)."""
        length = len(context)
        if k <= 0 or self.end == self.base:
            return np.zeros(0, dtype=np.int64), 0
        with self._lock:
            for level in range(len(LEVELS) - 1, -1, -1):
                n = LEVELS[level]
                if n > length:
                    continue
                tail = context[length - n :]
                at = int(self.index[level, ngram_hash(tail) % self.capacity])
                if at - n < self.base or at >= self.end:
                    continue  # an empty slot, or evicted
                if not np.array_equal(self.buffer[at - n - self.base : at - self.base], tail):
                    continue  # another n-gram's slot, or text overwritten since
                matched = n + self._longer(context, at - n, n)
                if matched < min_match:
                    continue
                out = self.buffer[at - self.base : min(at + k, self.end) - self.base]
                cut = np.flatnonzero(out == SEP)
                return (out[: cut[0]] if len(cut) else out).astype(np.int64), matched
        return np.zeros(0, dtype=np.int64), 0

    def _longer(self, context: Sequence[int], before: int, n: int) -> int:
        """How many more tokens match going back from absolute position ``before`` and the context's token
        before its matched ``n`` (``MAX_MATCH`` in all at most; a separator ends a match)."""
        most = min(MAX_MATCH - n, len(context) - n, before - self.base)
        if most <= 0:
            return 0
        stored = self.buffer[before - most - self.base : before - self.base][::-1]
        mine = np.asarray(context[len(context) - n - most : len(context) - n])[::-1]
        same = stored == mine
        return most if same.all() else int(np.argmin(same))
