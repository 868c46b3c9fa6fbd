"""An n-gram table of the model's own text: a guess for the next tokens that costs microseconds.

Built from a corpus of the target's greedy answers (``export/corpus.py``): for every context of the last
1, 2 or 3 tokens seen at least ``min_count`` times, the token that most often came next and how often it did
(its share). ``TableProposer`` drafts a chain: the longest context the table knows predicts the next token,
which extends the context for the one after. Where a pass is padded for exactness anyway (a one-row step
verified as two rows), its second row costs nothing, so even a guess right one time in four pays; ``auto``
reads that from the measured step costs, as for any proposer.

Example (orders up to 2): answers "the cat sat", "the cat ran", "the cat sat" give (the) -> cat, share 1.0;
(cat) -> sat, 2/3; (the, cat) -> sat, 2/3. After "... the", the proposer drafts "cat", then "sat".

The table is a file of arrays (``.npz``, read without pickles): per order n, ``keys{n}`` (the context's token
ids packed into one uint64, sorted), ``next{n}`` (int32) and ``share{n}`` (float16).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer

MAX_ORDER = 3


def _pack(contexts: np.ndarray, vocab: int) -> np.ndarray:
    """[N, n] token ids -> [N] uint64 keys (base-``vocab`` digits; n <= 3 and vocab < 2**21 fit)."""
    keys = np.zeros(len(contexts), dtype=np.uint64)
    for column in contexts.T:
        keys = keys * np.uint64(vocab) + column.astype(np.uint64)
    return keys


class NgramTable:
    """Per order n (1..``MAX_ORDER``): sorted context keys, the next token and its share."""

    def __init__(self, vocab: int, orders: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]):
        if not 0 < vocab < 2**21:
            raise SpecdecError(f"an n-gram table over {vocab} tokens is not supported (at most 2**21).")
        self.vocab, self.orders = vocab, orders

    @classmethod
    def build(cls, sequences: Iterable[np.ndarray], vocab: int, min_count: int = 2) -> NgramTable:
        """The table of ``sequences`` (token ids of the text to learn, e.g. answers)."""
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        orders = {}
        for n in range(1, MAX_ORDER + 1):
            rows = [np.stack([s[i : len(s) - n + i] for i in range(n + 1)], 1) for s in seqs if len(s) > n]
            if not rows:
                continue
            grams = np.concatenate(rows)  # [N, n + 1]: context, then the next token
            keys, nxt = _pack(grams[:, :n], vocab), grams[:, n]
            order = np.lexsort((nxt, keys))
            keys, nxt = keys[order], nxt[order]
            # runs of equal (key, next) with their counts; then per key the most frequent next token (ties: the
            # lowest id), and the key's total count
            starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nxt[1:] != nxt[:-1])])
            counts = np.diff(np.r_[starts, len(keys)])
            pair_key, pair_next = keys[starts], nxt[starts]
            best_first = np.lexsort((pair_next, -counts, pair_key))
            pair_key, pair_next, counts = pair_key[best_first], pair_next[best_first], counts[best_first]
            first = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
            totals = np.add.reduceat(counts, first)
            keep = totals >= min_count
            orders[n] = (
                pair_key[first][keep],
                pair_next[first][keep].astype(np.int32),
                (counts[first] / totals)[keep].astype(np.float16),
            )
        return cls(vocab, orders)

    def lookup(self, context: Sequence[int]) -> tuple[int, float] | None:
        """(next token, its share) for the longest order whose context ends ``context``, or None."""
        tail = [int(t) for t in context[-MAX_ORDER:]]
        for n in range(len(tail), 0, -1):
            arrays = self.orders.get(n)
            if arrays is None:
                continue
            keys, nxt, share = arrays
            key = 0
            for token in tail[-n:]:  # _pack's key, in Python ints: no arrays made per drafted token
                key = key * self.vocab + token
            i = int(keys.searchsorted(np.uint64(key)))
            if i < len(keys) and int(keys[i]) == key:
                return int(nxt[i]), float(share[i])
        return None

    @property
    def entries(self) -> int:
        return sum(len(k) for k, _, _ in self.orders.values())

    def save(self, path: str | Path) -> None:
        arrays = {"vocab": np.array(self.vocab, dtype=np.int64)}
        for n, (keys, nxt, share) in self.orders.items():
            arrays.update({f"keys{n}": keys, f"next{n}": nxt, f"share{n}": share})
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        """Read a table file, checked: arrays of the right kinds and lengths, keys sorted, tokens in range."""
        problem = f"the n-gram table {path} is damaged or not one; re-export the bundle"
        try:
            with np.load(path, allow_pickle=False) as z:
                vocab = int(z["vocab"])
                orders = {}
                for n in range(1, MAX_ORDER + 1):
                    if f"keys{n}" in z:
                        orders[n] = (z[f"keys{n}"], z[f"next{n}"], z[f"share{n}"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SpecdecError(f"{problem} ({e}).") from None
        for keys, nxt, share in orders.values():
            ok = (
                keys.dtype == np.uint64 and nxt.dtype == np.int32 and share.dtype == np.float16
                and keys.ndim == nxt.ndim == share.ndim == 1 and len(keys) == len(nxt) == len(share)
                and bool(np.all(keys[1:] > keys[:-1])) and (len(nxt) == 0 or 0 <= nxt.min() <= nxt.max() < vocab)
            )  # fmt: skip
            if not ok:
                raise SpecdecError(f"{problem} (its arrays do not fit together).")
        return cls(vocab, orders)


class TableProposer(Proposer):
    """A chain of up to k tokens, each the table's guess after the context and the guesses before it; each
    node's confidence is the product of the shares along the chain (``Calibrated`` learns what they are worth)."""

    def __init__(self, table: NgramTable, min_share: float = 0.0):
        self.table, self.min_share = table, min_share

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0:
            return EMPTY
        tail = [int(t) for t in context[-MAX_ORDER:]]
        tokens, confidence, p = [], [], 1.0
        for _ in range(k):
            guess = self.table.lookup(tail)
            if guess is None or guess[1] < self.min_share:
                break
            p *= guess[1]
            tokens.append(guess[0])
            confidence.append(p)
            tail = [*tail[1:], guess[0]] if len(tail) == MAX_ORDER else [*tail, guess[0]]
        if not tokens:
            return EMPTY
        return Proposal(np.array(tokens, dtype=np.int64), source="table", confidence=np.array(confidence))
