"""Lookahead decoding: Jacobi-style parallel guessing plus an n-gram pool, verified in one pass.

Each step the target sees, after the pending token, one token tree made of two parts:

* verification branch: up to ``guesses`` n-grams from the pool that start with the pending
  token, merged into a trie; any of them may be accepted;
* lookahead branch: a window of ``ngram - 1`` levels x ``window`` columns of guesses. Token
  (level l, column j) attends to the pending token, level-0 tokens 0..j and column j's lower
  levels, at position ``past + 1 + j + l`` -- which is exactly a tree (parent of (0, j) is
  (0, j-1), parent of (l, j) is (l-1, j)), so it can be accepted too.

After the pass, the target's greedy outputs at the top level become the window's next level
(one Jacobi iteration), and each column yields an n-gram for the pool. Acceptance is the
loop's exact tree rule, so the output is the target's.

A call that reuses the caches (``prefill``'s ``kept``) keeps the pool: the n-grams of the prompt prefix it
remembered last time are there already (with what earlier calls' windows found), so only those of the new
part of the prompt are added.
"""

from __future__ import annotations

import numpy as np

from specdec_edge.errors import SpecdecError
from specdec_edge.runtime.base import common_prefix
from specdec_edge.speculative.proposal import EMPTY, Proposal, Proposer


class LookaheadProposer(Proposer):
    branches = True  # the Jacobi window's columns and the pool's n-grams are sibling branches

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 4, prompt_ngrams: bool = True, seed: int = 0):
        if window < 1 or ngram < 2 or guesses < 0:
            raise SpecdecError(
                f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0; got window={window}, "
                f"ngram={ngram}, guesses={guesses}."
            )
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.prompt_ngrams = prompt_ngrams
        self.seed = seed
        self.pool: dict[int, list[tuple]] = {}
        self.remembered: list[int] = []  # the prompt whose n-grams went into the pool
        self.levels = np.zeros((ngram - 1, window), dtype=np.int64)
        self._window_nodes: np.ndarray | None = None  # proposal node index of each window token
        self._last: Proposal | None = None
        self.pool_nodes = 0
        self.owner = None  # whose calls built the pool (``claim``)

    def claim(self, owner) -> None:
        """Another owner's calls: the pool of n-grams (the last owner's prompts and answers) is forgotten."""
        if owner != self.owner:
            self.pool, self.remembered, self.owner = {}, [], owner

    def prefill(self, prompt, params, rng, kept=None, history=None) -> None:
        prompt = np.asarray(prompt, dtype=np.int64)
        start = 0
        if kept is None:
            self.pool = {}
        else:  # n-grams that end inside the prefix remembered last time are in the pool already
            start = max(common_prefix(self.remembered, prompt) - self.ngram + 1, 0)
        if self.prompt_ngrams:
            for i in range(start, len(prompt) - self.ngram + 1):
                self._remember(prompt[i : i + self.ngram])
        self.remembered = prompt.tolist()
        # Initial guesses: tokens drawn from the prompt (own generator: sampling's stream is untouched).
        self.levels = np.random.default_rng(self.seed).choice(prompt, size=self.levels.shape)

    def _remember(self, gram) -> None:
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        grams = self.pool.setdefault(key, [])
        if rest in grams:
            grams.remove(rest)
        grams.append(rest)  # most recent last
        if len(grams) > 4 * max(self.guesses, 1):
            del grams[0]

    def propose(self, context, k) -> Proposal:
        if k <= 0:
            self._last = None
            return EMPTY
        tokens, parents, children = [], [], {}
        for gram in reversed(self.pool.get(int(context[-1]), [])[-self.guesses :] if self.guesses else []):
            parent = -1
            for t in gram[:k]:
                node = children.get((parent, t))
                if node is None:
                    node = children[(parent, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = node
        self.pool_nodes = len(tokens)  # nodes from the n-gram pool (the rest is the Jacobi window)
        levels, width = self.levels.shape
        nodes = len(tokens) + np.arange(levels * width).reshape(levels, width)
        for level in range(levels):
            for col in range(width):
                tokens.append(int(self.levels[level, col]))
                if level:
                    parents.append(int(nodes[level - 1, col]))
                else:
                    parents.append(int(nodes[0, col - 1]) if col else -1)
        self._window_nodes = nodes
        self._last = Proposal(
            np.array(tokens, dtype=np.int64), parents=np.array(parents, dtype=np.int64), source="lookahead"
        )
        return self._last

    def observe(self, proposal: Proposal, logits: np.ndarray, hidden=None) -> None:
        if proposal is not self._last:  # the loop verified something else (e.g. no room left)
            return
        top = logits[1 + self._window_nodes[-1]].argmax(axis=-1)  # next guess for every column
        for col in range(self.levels.shape[1]):
            self._remember(np.concatenate([self.levels[:, col], top[col : col + 1]]))
        self.levels = np.concatenate([self.levels[1:], top[None]], axis=0)
