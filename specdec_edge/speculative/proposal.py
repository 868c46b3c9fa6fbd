"""What a proposer hands the decode loop, and the proposer protocol.

A proposer keeps whatever state it needs across the steps of one generation::

    prefill(prompt, params, rng)      start a generation (the prompt's last token is pending)
    propose(context, k) -> Proposal   tokens to verify after ``context`` (at most k deep)
    observe(proposal, logits, hidden) the target's logits (and hidden states, if the graph has them)
                                      for [pending] + proposal: lookahead and feature-based heads learn here
    commit(context)                   the context after acceptance: drop what was rejected

``Proposal.parents`` makes the tokens a tree: node i's parent among the proposal's nodes,
-1 for a child of the pending token, parents before children. ``None`` means a chain.
``Proposal.probs`` (q, chains only) is the distribution each token was drawn from, needed by
exact rejection sampling; ``None`` means the tokens were chosen deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [m] int64
    probs: np.ndarray | None = None  # [m, V] float64 (q), or None for deterministic tokens
    parents: np.ndarray | None = None  # [m] int64 tree parents, or None for a chain


EMPTY = Proposal(np.zeros(0, dtype=np.int64))


class Proposer:
    """Base with the optional steps as no-ops; subclasses implement ``propose``."""

    def prefill(self, prompt, params, rng) -> None:
        pass

    def propose(self, context, k: int) -> Proposal:
        raise NotImplementedError

    def observe(self, proposal: Proposal, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        pass

    def commit(self, context) -> None:
        pass
