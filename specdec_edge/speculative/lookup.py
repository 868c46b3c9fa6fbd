"""Prompt lookup decoding: propose the continuation of an earlier occurrence of the last n-gram.

No extra model. Text that copies its input (summaries, answers over documents, code edits)
repeats long spans of the prompt; when the last ``n`` tokens occurred before, the tokens that
followed them then are a cheap, often-right guess. Longest n first; among matches of one n,
the most recent occurrence.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import common_prefix
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer


def lookup(tokens: np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching tail n-gram."""
    return lookup_match(tokens, k, max_ngram, min_ngram)[0]


def lookup_match(tokens: np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[np.ndarray, int]:
    """``lookup``'s tokens and the length n of the n-gram they follow (0: no match)."""
    start, n = find_match(tokens, max_ngram, min_ngram)
    return tokens[start : start + k], n


def find_match(tokens: np.ndarray, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, int]:
    """Where ``lookup``'s continuation starts in ``tokens`` and the length n of the n-gram it follows
    (``(len(tokens), 0)``: no match).

    The earlier occurrences of the last token are found in one pass; each n-gram length then checks only those
    (comparing a window of every position per length cost ~3x more, a step of every ``auto`` call)."""
    length = len(tokens)
    # positions p with a token after them (p < length - 1) that hold the last token: where an n-gram match may end
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) if length > 1 else np.zeros(0, np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            hits = hits[tokens[hits - back] == tokens[length - 1 - back]]
        if len(hits):
            return int(hits[-1] + 1), n
    return length, 0


def match_length(tokens: np.ndarray, start: int, most: int) -> int:
    """How many tokens before ``start`` equal the last ones of ``tokens`` (at most ``most``): the whole length
    of the match whose continuation starts at ``start``."""
    most = min(most, start)
    if most <= 0:
        return 0
    same = tokens[start - most : start][::-1] == tokens[len(tokens) - most :][::-1]
    return most if same.all() else int(np.argmin(same))


class PromptLookupProposer(Proposer):
    """Proposer over prompt + output; keeps the context in a growing numpy buffer."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecdecError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, max_ngram={max_ngram}."
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.buf = np.zeros(0, dtype=np.int64)
        self.length = 0
        self.matched = 0  # the n-gram length behind the last proposal (0: none); auto keys its statistics by it

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        if kept is None:
            self.buf = np.zeros(max(1024, 2 * len(prompt)), dtype=np.int64)
            self.length = 0
        else:  # the index is the context itself: keep the prefix the buffer shares with this prompt
            self.length = common_prefix(self.buf[: self.length], prompt)
        self._extend(prompt[self.length :])

    def _extend(self, tokens) -> None:
        need = self.length + len(tokens)
        if need > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(need, len(self.buf)), dtype=np.int64)])
        self.buf[self.length : need] = tokens
        self.length = need

    def propose(self, context, k) -> Proposal:
        self.matched = 0
        if k <= 0:
            return EMPTY
        tokens, self.matched = lookup_match(self.buf[: self.length], k, self.max_ngram, self.min_ngram)
        return Proposal(tokens.copy(), source="pld") if len(tokens) else EMPTY

    def commit(self, context) -> None:
        self._extend(context[self.length :])
